//! Engine configuration as Rust sees it, and its validation. The C struct `kvs_engine_config` is converted
//! into this in `ffi`; everything that can be checked once (head size, block size, GQA ratio, policy spec)
//! is checked here, so a bad configuration fails at engine start rather than inside a forward pass.

use crate::error::Result;
use crate::tensor::{DType, Device};
use crate::{bail, ensure};

/// Head sizes the kernels are built and tested for (the set vLLM's paged kernels support).
pub const SUPPORTED_HEAD_DIMS: [usize; 7] = [64, 80, 96, 112, 128, 192, 256];

/// Most layers one engine serves (the deepest models have ~130); the per-layer state is allocated at start.
pub const MAX_LAYERS: usize = 4096;
/// Most query heads (the widest models have 128).
pub const MAX_Q_HEADS: usize = 1024;
/// Most CPU worker threads an engine starts.
pub const MAX_THREADS: usize = 1024;
/// Longest policy spec accepted, in bytes.
pub const MAX_POLICY_LEN: usize = 4096;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub device: Device,
    /// Number of attention layers the engine serves (layer ids are `0..num_layers`).
    pub num_layers: usize,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per KV block; a power of two from 1 to 256.
    pub block_size: usize,
    /// Number of blocks in each layer's cache; 0 = take it from the caches passed in (checked per call).
    pub num_blocks: usize,
    /// dtype of queries and outputs (and of the caches unless `cache_dtype` says FP8).
    pub dtype: DType,
    /// dtype of the K/V caches: `dtype`, or FP8 ([`DType::F8E4M3`], [`DType::F8E5M2`]) with per-layer
    /// scales set by [`crate::Engine::set_kv_scales`] (src/fp8.rs has vLLM's convention).
    pub cache_dtype: DType,
    /// Policy spec (see docs/policies.md); empty = dense.
    pub policy: String,
    /// CPU worker threads; 0 = one per available core (at most [`MAX_THREADS`]).
    /// In a process that runs PyTorch (or has one OpenMP runtime loaded), decode attention (dense and the
    /// policies') runs on that runtime's team of the calling thread instead, with at most this many of its
    /// threads and no more than it runs its own regions with; `KVS_HOST_OMP=0` keeps it on the engine's own
    /// threads.
    pub num_threads: usize,
    /// Upper bound on per-sequence policy state in bytes; 0 = unbounded.
    pub max_state_bytes: u64,
    /// How a CUDA engine reports what its device checks find (docs/abi.md, "Where each check runs").
    pub validate: Validate,
    /// A forward call's query may end with padding rows past `query_start_loc[num_seqs]` (a serving
    /// engine's CUDA graph of a decode batch padded to a captured size): they are neither attended nor
    /// written, and `query_start_loc[num_seqs] < num_tokens` is not an error. Off: it is.
    pub padded_batches: bool,
}

/// When a CUDA engine's device-side checks of the metadata surface (the CPU engine always fails the call).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Validate {
    /// The kernels record the first fault; `kvs_engine_check` returns it (and `kvs_engine_stats` shows
    /// it). Calls never wait: capturable.
    #[default]
    Deferred,
    /// Every eager call waits for its work and returns the fault itself; refused on a capturing stream.
    Sync,
}

impl EngineConfig {
    /// A dense CPU configuration; adjust fields as needed.
    pub fn new(num_layers: usize, num_q_heads: usize, num_kv_heads: usize, head_dim: usize, block_size: usize, dtype: DType) -> Self {
        EngineConfig {
            device: Device::Cpu,
            num_layers,
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks: 0,
            dtype,
            cache_dtype: dtype,
            policy: String::new(),
            num_threads: 0,
            max_state_bytes: 0,
            validate: Validate::Deferred,
            padded_batches: false,
        }
    }

    pub fn group_size(&self) -> usize {
        self.num_q_heads / self.num_kv_heads
    }

    /// Checks every field, limits included (a size over its limit is `Unsupported`), before the engine
    /// allocates or starts anything.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.num_layers >= 1, InvalidArgument, "num_layers must be at least 1");
        ensure!(self.num_layers <= MAX_LAYERS, Unsupported, "num_layers {} is more than the {MAX_LAYERS} one engine serves", self.num_layers);
        ensure!(self.num_q_heads >= 1 && self.num_kv_heads >= 1, InvalidArgument, "head counts must be positive (num_q_heads={}, num_kv_heads={})", self.num_q_heads, self.num_kv_heads);
        ensure!(self.num_q_heads <= MAX_Q_HEADS, Unsupported, "num_q_heads {} is more than the {MAX_Q_HEADS} supported", self.num_q_heads);
        ensure!(self.num_threads <= MAX_THREADS, Unsupported, "num_threads {} is more than the {MAX_THREADS} an engine starts (0 = one per core)", self.num_threads);
        ensure!(self.policy.len() <= MAX_POLICY_LEN, InvalidArgument, "the policy spec is {} bytes long, more than the {MAX_POLICY_LEN} accepted", self.policy.len());
        ensure!(
            self.num_q_heads % self.num_kv_heads == 0,
            InvalidArgument,
            "num_q_heads ({}) must be a multiple of num_kv_heads ({})",
            self.num_q_heads,
            self.num_kv_heads
        );
        if !SUPPORTED_HEAD_DIMS.contains(&self.head_dim) {
            bail!(Unsupported, "head_dim {} is not supported; supported sizes are {:?}", self.head_dim, SUPPORTED_HEAD_DIMS);
        }
        ensure!(
            self.block_size.is_power_of_two() && self.block_size <= 256,
            Unsupported,
            "block_size {} is not supported; it must be a power of two from 1 to 256",
            self.block_size
        );
        ensure!(self.dtype.is_float(), InvalidDtype, "dtype {} is not supported for queries and outputs; use float32, float16 or bfloat16 (FP8 is a cache dtype: set cache_dtype)", self.dtype.name());
        ensure!(
            self.cache_dtype == self.dtype || self.cache_dtype.is_fp8(),
            InvalidDtype,
            "cache_dtype {} is not supported with dtype {}; a cache holds the engine's dtype or FP8 (float8_e4m3, float8_e5m2)",
            self.cache_dtype.name(),
            self.dtype.name()
        );
        Ok(())
    }
}
