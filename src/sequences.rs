//! Per-sequence state, keyed by the caller's stable 64-bit sequence id.
//!
//! An entry is created the first time a forward call names the id and lives until `release`. Policies
//! keep their per-(layer, KV head) state inside it; dense engines still register ids, so callers can count
//! lifecycles the same way whatever the policy.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::Result;
use crate::policy::SequencePolicyState;
use crate::bail;

/// Everything kvsparse keeps for one sequence.
#[derive(Default)]
pub struct SequenceState {
    pub policy: SequencePolicyState,
}

#[derive(Default)]
pub struct Registry {
    map: Mutex<HashMap<u64, Arc<Mutex<SequenceState>>>>,
    created: Mutex<(u64, u64)>, // (created, released)
}

impl Registry {
    /// The state of `id`, created empty if this is the first time it is seen.
    pub fn get_or_create(&self, id: u64) -> Arc<Mutex<SequenceState>> {
        let mut map = self.map.lock();
        if let Some(s) = map.get(&id) {
            return s.clone();
        }
        let s = Arc::new(Mutex::new(SequenceState::default()));
        map.insert(id, s.clone());
        self.created.lock().0 += 1;
        s
    }

    pub fn get(&self, id: u64) -> Option<Arc<Mutex<SequenceState>>> {
        self.map.lock().get(&id).cloned()
    }

    /// Frees the state of `id`; an id the engine never saw (or already released) is an error.
    pub fn release(&self, id: u64) -> Result<()> {
        if self.map.lock().remove(&id).is_none() {
            bail!(UnknownSequence, "sequence {id} is not known to this engine (never used in a forward call, or already released)");
        }
        self.created.lock().1 += 1;
        Ok(())
    }

    pub fn live(&self) -> u64 {
        self.map.lock().len() as u64
    }

    /// (created, released) since the engine started.
    pub fn lifecycle(&self) -> (u64, u64) {
        *self.created.lock()
    }

    /// Policy state objects held by all sequences.
    pub fn state_objects(&self) -> u64 {
        let ids: Vec<_> = self.map.lock().values().cloned().collect();
        ids.iter().map(|s| s.lock().policy.objects() as u64).sum()
    }

    /// Bytes of policy state held by all sequences.
    pub fn state_bytes(&self) -> u64 {
        let ids: Vec<_> = self.map.lock().values().cloned().collect();
        ids.iter().map(|s| s.lock().policy.bytes() as u64).sum()
    }
}
