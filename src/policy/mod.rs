//! Decode policies: which KV blocks or tokens each decode row visits, in which order, and when it stops.
//! Policies decide; kernels compute (`cpu::sparse` runs a pipeline through the one exact kernel).
//!
//! A pipeline is `selector [> top_p] [> art]` (spec grammar: [`spec`], docs/policies.md). It applies to
//! decode rows (query length 1) of layers `>= dense_layers`, one decision per (sequence, KV head) shared
//! by the query heads of the GQA group (scores aggregated by max over the group).
//!
//! Stateful stages keep per-(sequence, layer, KV head) state in [`SequencePolicyState`], owned by the
//! engine's sequence registry: created on first use, freed by `kvs_sequence_release`.

pub mod device;
pub(crate) mod kind;
pub mod plan;
#[macro_use]
mod registry;
pub mod select;
pub mod spec;
// Each policy's folder (`src/policy/<name>/`), as the registry lists them.
policy_modules!();

use std::any::Any;
use std::collections::HashMap;

use crate::meta::MetaNeeds;
use crate::error::Result;
pub use plan::HeadPlan;
pub use registry::*;

/// What the caller set for the policy at run time, for its stages to read (`kvs_engine_set_speculation_budgets`:
/// PRR's budget table); its type is the policy's.
pub type PolicyInput = std::sync::Arc<dyn std::any::Any + Send + Sync>;

/// A parsed policy spec. The empty spec and `dense` mean dense attention everywhere.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    pub spec: Spec,
}

impl Default for Policy {
    fn default() -> Self {
        Policy { spec: Spec::default() }
    }
}

impl Policy {
    pub fn parse(text: &str) -> Result<Self> {
        Ok(Policy { spec: Spec::parse(text)? })
    }

    pub fn pipeline(&self) -> Option<&Pipeline> {
        self.spec.pipeline.as_ref()
    }

    pub fn dense_layers(&self) -> usize {
        self.spec.dense_layers
    }

    /// True when no decode row of `layer` runs anything but dense attention.
    pub fn is_dense_for_layer(&self, layer: usize) -> bool {
        self.spec.pipeline.is_none() || layer < self.spec.dense_layers
    }

    /// True when the pipeline keeps per-sequence state (so forward calls must pass seq_ids).
    pub fn is_stateful(&self) -> bool {
        self.pipeline().is_some_and(|p| p.selector.kind().stateful())
    }

    /// Number of stages of the pipeline (the selector, then the later stages present); 0 = dense.
    pub fn num_stages(&self) -> usize {
        self.pipeline().map_or(0, |p| 1 + p.later_stages().count())
    }

    /// Whether a CUDA engine's decode steps under this policy may be captured in a CUDA graph by a serving
    /// plugin: every stage's decode step enqueues a fixed launch sequence (no host sync, allocation or
    /// decision) and was checked replay == eager through the shim's twin-engine check (scripts/
    /// gpu_shim_check.py) or a whole model step (scripts/gpu_e2e.py). Dense: always. The stateful stages
    /// (snapkv, speculate, refresh, predictor) replay == eager in the C-level graph tests only, not yet in
    /// those checks, so they report false until they pass there.
    pub fn graph_capturable(&self) -> bool {
        match self.pipeline() {
            None => true,
            Some(p) => p.selector.kind().graph_capturable(),
        }
    }

    /// Key metadata the cache writes must maintain.
    pub fn meta_needs(&self) -> MetaNeeds {
        let mut needs = MetaNeeds::default();
        if let Some(p) = self.pipeline() {
            p.selector.kind().meta_needs(&mut needs);
            for s in p.later_stages() {
                s.meta_needs(&mut needs);
            }
        }
        needs
    }

    /// The size of a CUDA engine's per-sequence state slot map (`max_seqs`), for the policies whose device
    /// state belongs to a sequence rather than to cache blocks; None for the others.
    pub fn device_slots(&self) -> Option<usize> {
        self.pipeline().is_some_and(|p| p.selector.kind().per_sequence_device_state()).then_some(self.spec.max_seqs)
    }

    /// Key metadata a CUDA engine's cache writes maintain: the CPU's, plus what a selector keeps with the
    /// cache blocks on the device only.
    pub fn device_meta_needs(&self) -> MetaNeeds {
        let mut n = self.meta_needs();
        if let Some(p) = self.pipeline() {
            p.selector.kind().device_meta_needs(&mut n);
        }
        n
    }
}

/// A stateful selector's state of one (sequence, layer, KV head), or of one (sequence, layer): the
/// policy's own type, held here behind this trait so the sequence registry keeps, counts and frees it
/// without naming the policy.
pub trait PolicyState: Any + Send + Sync {
    /// Bytes held (the engine's state cap counts them).
    fn bytes(&self) -> usize;
}

/// State of one (sequence, layer, KV head): the selector's, when it keeps one.
#[derive(Default)]
pub struct HeadState {
    own: Option<Box<dyn PolicyState>>,
}

impl HeadState {
    pub fn bytes(&self) -> usize {
        self.own.as_ref().map_or(0, |s| s.bytes())
    }

    /// Number of policy state objects held (for lifecycle accounting).
    pub fn objects(&self) -> usize {
        self.own.is_some() as usize
    }

    /// The state, when it is a `T`.
    pub fn get<T: PolicyState>(&self) -> Option<&T> {
        let own: &dyn Any = self.own.as_deref()?;
        own.downcast_ref()
    }

    /// Takes the state out when it is a `T` (a stage updates it outside the sequence's lock).
    pub fn take<T: PolicyState>(&mut self) -> Option<Box<T>> {
        if self.get::<T>().is_none() {
            return None;
        }
        let own: Box<dyn Any> = self.own.take()?;
        own.downcast().ok()
    }

    /// Replaces the state.
    pub fn put<T: PolicyState>(&mut self, state: Box<T>) {
        self.own = Some(state);
    }
}

/// Per-sequence policy state: per layer, one [`HeadState`] per KV head, plus a selector's per-layer state
/// (RefreshKV's schedule).
#[derive(Default)]
pub struct SequencePolicyState {
    pub layers: HashMap<usize, Vec<HeadState>>,
    layer_states: HashMap<usize, Box<dyn PolicyState>>,
}

impl SequencePolicyState {
    pub fn bytes(&self) -> usize {
        self.layers.values().flat_map(|v| v.iter()).map(|h| h.bytes() + std::mem::size_of::<HeadState>()).sum::<usize>()
            + self.layer_states.values().map(|l| l.bytes()).sum::<usize>()
    }

    /// Number of policy state objects (per-head states and layer schedules) held.
    pub fn objects(&self) -> usize {
        self.layers.values().flat_map(|v| v.iter()).map(|h| h.objects()).sum::<usize>() + self.layer_states.len()
    }

    /// The state of (layer, head), created empty for `num_kv_heads` heads on first use.
    pub fn head_mut(&mut self, layer: usize, head: usize, num_kv_heads: usize) -> &mut HeadState {
        let v = self.layers.entry(layer).or_insert_with(|| (0..num_kv_heads).map(|_| HeadState::default()).collect());
        &mut v[head]
    }

    pub fn head(&self, layer: usize, head: usize) -> Option<&HeadState> {
        self.layers.get(&layer).and_then(|v| v.get(head))
    }

    /// The selector's state of `layer`, created by `T::default()` on first use (or when it held another type).
    pub fn layer_mut<T: PolicyState + Default>(&mut self, layer: usize) -> &mut T {
        let slot = self.layer_states.entry(layer).or_insert_with(|| Box::new(T::default()));
        if !(&**slot as &dyn Any).is::<T>() {
            *slot = Box::new(T::default());
        }
        let own: &mut dyn Any = &mut **slot;
        own.downcast_mut().expect("the state was just made a T")
    }

    /// Replaces the selector's state of `layer`.
    pub fn set_layer<T: PolicyState>(&mut self, layer: usize, state: T) {
        self.layer_states.insert(layer, Box::new(state));
    }
}
