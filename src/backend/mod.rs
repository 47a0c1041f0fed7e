//! The seam between the engine and the devices: the [`Backend`] trait every backend (CPU, CUDA) implements,
//! each owning its own state (threads, sequence state, key metadata, device buffers), and the registry
//! ([`create`]) that makes the backend of a configuration. The engine validates a call, then hands it here;
//! it names no backend module.

mod registry;

use std::ffi::c_void;

use parking_lot::{Mutex, RwLock};

use crate::args::{CacheWriteArgs, ForwardArgs, MergeArgs};
use crate::config::EngineConfig;
use crate::meta::MetaSnapshot;
use crate::error::Result;
use crate::layout::KvCache;
use crate::cpu::sparse::CpuPipeline;
use crate::cuda::stage::CudaPipeline;
use crate::policy::{Policy, PolicyInput};
use crate::stats::{Counters, EngineStats, VisitRecord};

pub use registry::create;

/// A policy pipeline as the backends see it (the policy registry's `Pipeline`): what the CPU backend asks
/// of it and what the CUDA backend does, never the closed set of policies itself.
pub(crate) trait PolicyPipeline: CpuPipeline + CudaPipeline {}
impl<T: CpuPipeline + CudaPipeline> PolicyPipeline for T {}

/// The engine's parts a backend reads during one call (borrowed for the call).
pub struct CallEnv<'a> {
    pub cfg: &'a EngineConfig,
    /// The parsed policy (backends never see the spec string's text as anything but a name in messages).
    pub policy: &'a Policy,
    /// The pipeline of this call's layer; None when the layer is dense.
    pub(crate) pipeline: Option<&'a dyn PolicyPipeline>,
    /// Per-row visit records, collected only while the engine records them.
    pub visits: &'a Mutex<Option<Vec<VisitRecord>>>,
    /// What the caller set for the policy at run time (`Engine::set_policy_input`).
    pub policy_input: &'a RwLock<Option<PolicyInput>>,
}

/// What the engine asks of a device. Every method gets arguments the engine has validated as far as the
/// host can without the device (shapes, dtypes, layers).
pub trait Backend: Send + Sync {
    /// One forward call. Returns (the counters the engine adds to its totals, the counters the call reports).
    fn forward(&self, env: &CallEnv, a: &ForwardArgs, cache: &KvCache) -> Result<(Counters, Counters)>;
    /// Stores `n` new K/V rows by slot mapping (and the key metadata the policy needs).
    fn cache_write(&self, cfg: &EngineConfig, a: &CacheWriteArgs, cache: &KvCache, n: usize) -> Result<()>;
    /// Merges two partial attention states.
    fn merge(&self, a: &MergeArgs) -> Result<()>;
    /// The first fault deferred checks recorded since the last check (none on a backend that checks at the call).
    fn check(&self, stream: *mut c_void) -> Result<()>;
    /// Bytes of key metadata (all layers) kept for the policy.
    fn metadata_bytes(&self) -> usize;
    /// A copy of one layer's key metadata (tests and debugging).
    fn metadata_snapshot(&self, layer: usize) -> Result<Option<MetaSnapshot>>;
    /// Frees all state kept for `seq_id`.
    fn release_sequence(&self, seq_id: u64) -> Result<()>;
    /// The engine's statistics from its host counters `host` (totals, per layer) and the backend's own.
    fn stats(&self, host: (Counters, Vec<Counters>)) -> EngineStats;
    /// Number of policy state objects held now.
    fn policy_state_objects(&self) -> u64;
    /// The backend as `Any`, for tools that need a backend's own helpers (benchmarks, parity harnesses).
    fn as_any(&self) -> &dyn std::any::Any;
}
