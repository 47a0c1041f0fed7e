//! The CPU backend: its thread pools, the per-sequence policy state, and the key metadata its cache writes
//! maintain; a forward call runs through [`super::call`].

use std::ffi::c_void;
use std::sync::Arc;

use super::call::CallCtx;
use super::metadata::CacheMeta;
use crate::meta::MetaSnapshot;
use super::spin_pool::SpinPool;
use crate::args::{CacheWriteArgs, ForwardArgs, MergeArgs};
use crate::backend::{Backend, CallEnv};
use crate::config::EngineConfig;
use crate::error::{Error, ErrorKind, Result};
use crate::layout::KvCache;
use crate::policy::Policy;
use crate::sequences::Registry;
use crate::stats::{Counters, EngineStats};

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    /// The pool of the dense path (cpu::spin_pool), same thread count as `pool`.
    spin: SpinPool,
    sequences: Registry,
    /// Key metadata (Quest min/max, INT4 K) maintained on cache writes for the policy's needs.
    meta: CacheMeta,
    /// What the policy loads for the engine's life (`Policy::cpu_data`).
    policy_data: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl CpuBackend {
    pub fn new(cfg: &EngineConfig, policy: &Policy) -> Result<Self> {
        let policy_data = policy.cpu_data()?;
        let threads = if cfg.num_threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()).min(crate::config::MAX_THREADS) } else { cfg.num_threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kvsparse-{i}"))
            .build()
            .map_err(|e| Error::new(ErrorKind::Internal, format!("could not start {threads} worker threads: {e}")))?;
        // The dense decode hot path's pool (the caller takes part, workers spin between calls).
        let spin = SpinPool::new(threads).map_err(|e| Error::new(ErrorKind::Internal, format!("could not start {threads} worker threads: {e}")))?;
        let meta = CacheMeta::new(policy.meta_needs(), cfg.num_layers)?;
        Ok(CpuBackend { pool, spin, sequences: Registry::default(), meta, policy_data })
    }
}

impl Backend for CpuBackend {
    fn forward(&self, env: &CallEnv, a: &ForwardArgs, cache: &KvCache) -> Result<(Counters, Counters)> {
        let ctx = CallCtx { cfg: env.cfg, policy: env.policy, pool: &self.pool, spin: &self.spin, sequences: &self.sequences, meta: &self.meta, visits: env.visits, policy_input: env.policy_input, policy_data: self.policy_data.as_deref() };
        let c = super::call::forward(&ctx, a, cache)?;
        Ok((c, c))
    }

    fn cache_write(&self, _cfg: &EngineConfig, a: &CacheWriteArgs, cache: &KvCache, n: usize) -> Result<()> {
        let slots = super::cache_write::decode_slots(&a.slot_mapping, n, cache)?;
        let mut meta = self.meta.begin_write(a.layer, cache)?;
        super::cache_write::write(cache, &a.key, &a.value, &slots);
        if let Some(g) = meta.as_mut() {
            CacheMeta::finish_write(g, cache, &slots);
        }
        Ok(())
    }

    fn merge(&self, a: &MergeArgs) -> Result<()> {
        super::merge::merge_states(&a.out_a, &a.lse_a, &a.out_b, &a.lse_b, &a.out, a.lse_out.as_ref());
        Ok(())
    }

    /// Everything is checked at the call: nothing is pending.
    fn check(&self, _stream: *mut c_void) -> Result<()> {
        Ok(())
    }

    fn metadata_bytes(&self) -> usize {
        self.meta.bytes()
    }

    fn metadata_snapshot(&self, layer: usize) -> Result<Option<MetaSnapshot>> {
        Ok(self.meta.read(layer).as_ref().map(|m| m.snapshot()))
    }

    fn release_sequence(&self, seq_id: u64) -> Result<()> {
        self.sequences.release(seq_id)
    }

    fn stats(&self, host: (Counters, Vec<Counters>)) -> EngineStats {
        let (created, released) = self.sequences.lifecycle();
        EngineStats {
            total: host.0,
            per_layer: host.1,
            live_sequences: self.sequences.live(),
            policy_rows_without_state: 0,
            sequences_created: created,
            sequences_released: released,
            state_bytes: self.sequences.state_bytes(),
            pending_status: 0,
        }
    }

    fn policy_state_objects(&self) -> u64 {
        self.sequences.state_objects()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
