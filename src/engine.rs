//! The engine: configuration, thread pool, per-sequence state, statistics, and dispatch of each call to
//! the backend (CPU here) and, for decode rows of non-dense layers, to the policy pipeline.

use std::ffi::c_void;

use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;

pub use crate::args::{CacheWriteArgs, ForwardArgs, MergeArgs};
use crate::backend::{Backend, CallEnv, PolicyPipeline};
use crate::config::EngineConfig;
use crate::meta::MetaSnapshot;
use crate::error::Result;
use crate::layout::{validate_params, KvCache};
use crate::policy::Policy;
use crate::stats::{Counters, EngineStats, VisitRecord};
use crate::{alloc, bail, ensure, validate};

pub struct Engine {
    cfg: EngineConfig,
    policy: Policy,
    /// The device's backend (src/backend): CPU or CUDA, each with its own state.
    backend: Box<dyn Backend>,
    stats: Mutex<(Counters, Vec<Counters>)>,
    /// Per-row visit records, collected only while [`Engine::record_visits`] is on.
    visits: Mutex<Option<Vec<VisitRecord>>>,
    /// PRR's speculation budget by context length, when loaded (else the spec's constant budget).
    policy_input: parking_lot::RwLock<Option<crate::policy::PolicyInput>>,
    /// Per layer, the FP8 cache's (k_scale, v_scale) as f32 bits; 0 = not set yet.
    kv_scales: Vec<[AtomicU32; 2]>,
}

impl Engine {
    /// Everything `new` checks about `cfg` that needs no device and no allocation: the geometry, the policy
    /// spec, and (for a CUDA device) whether the CUDA backend runs the policy. Serving plugins call it (through
    /// `kvs_engine_config_check`) where the engine cannot be made yet, e.g. in a process that must not touch
    /// the GPU before its workers fork.
    pub fn check_config(cfg: &EngineConfig) -> Result<Policy> {
        cfg.validate()?;
        let policy = Policy::parse(&cfg.policy)?;
        // Fail at engine start, not on the first forward call, when the policy has no path on the device yet.
        if let Err(why) = policy.supported_on(cfg.device, cfg.group_size()) {
            bail!(Unsupported, "policy {:?}: {why}", cfg.policy);
        }
        // The CUDA engine reads FP8 caches in its tensor-core kernel, for dense attention and the policies
        // whose device path has an FP8 read (docs/abi.md).
        if cfg.cache_dtype.is_fp8() && cfg.device != crate::tensor::Device::Cpu {
            ensure!(cfg.dtype != crate::tensor::DType::F32, Unsupported, "an FP8 cache ({}) on the CUDA engine needs float16 or bfloat16 queries", cfg.cache_dtype.name());
            if let Err(why) = policy.cuda_fp8_cache() {
                bail!(Unsupported, "policy {:?} over an FP8 cache ({}) on the CUDA engine: {why}", cfg.policy, cfg.cache_dtype.name());
            }
        }
        Ok(policy)
    }

    pub fn new(cfg: EngineConfig) -> Result<Self> {
        let policy = Self::check_config(&cfg)?;
        let backend = crate::backend::create(&cfg, &policy)?;
        let per_layer = alloc::try_vec(cfg.num_layers, Counters::default(), "per-layer statistics")?;
        let mut kv_scales = alloc::try_with_capacity(cfg.num_layers, "per-layer KV scales")?;
        kv_scales.resize_with(cfg.num_layers, Default::default);
        Ok(Engine { cfg, policy, backend, stats: Mutex::new((Counters::default(), per_layer)), visits: Mutex::new(None), policy_input: parking_lot::RwLock::new(None), kv_scales })
    }

    /// The engine's backend (benchmarks and parity harnesses downcast it through `as_any` to use a
    /// backend's own helpers).
    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Bytes of key metadata (all layers) kept for the policy.
    pub fn metadata_bytes(&self) -> usize {
        self.backend.metadata_bytes()
    }

    /// A copy of layer `layer`'s key metadata (None before its first cache write or when the policy needs
    /// none); on a CUDA engine downloaded from the device (synchronizes). For tests and debugging.
    pub fn metadata_snapshot(&self, layer: usize) -> Result<Option<MetaSnapshot>> {
        self.check_layer(layer)?;
        self.backend.metadata_snapshot(layer)
    }

    /// Sets the dequantization scales of an FP8 cache (vLLM's per-layer `k_scale`, `v_scale`: element =
    /// `fp8 * scale`) for one layer, or every layer with `None`. Both must be finite and positive, else
    /// nothing changes. An engine whose cache is not FP8 keeps them and never uses them. Applies from
    /// the next call; a captured CUDA graph keeps the scales it was captured with.
    pub fn set_kv_scales(&self, layer: Option<usize>, k_scale: f32, v_scale: f32) -> Result<()> {
        for (name, s) in [("k_scale", k_scale), ("v_scale", v_scale)] {
            ensure!(s.is_finite() && s > 0.0, InvalidArgument, "{name} is {s}; an FP8 cache's scale must be a finite float32 above 0");
        }
        let layers = match layer {
            Some(l) => {
                self.check_layer(l)?;
                l..l + 1
            }
            None => 0..self.cfg.num_layers,
        };
        for l in layers {
            self.kv_scales[l][0].store(k_scale.to_bits(), Ordering::Relaxed);
            self.kv_scales[l][1].store(v_scale.to_bits(), Ordering::Relaxed);
        }
        Ok(())
    }

    /// The layer's caches with their scales: an FP8 cache needs both set ([`Engine::set_kv_scales`]).
    fn scaled(&self, mut cache: KvCache, layer: usize) -> Result<KvCache> {
        if cache.dtype.is_fp8() {
            let [k, v] = &self.kv_scales[layer];
            let (k, v) = (f32::from_bits(k.load(Ordering::Relaxed)), f32::from_bits(v.load(Ordering::Relaxed)));
            ensure!(k > 0.0 && v > 0.0, InvalidArgument, "layer {layer} has an FP8 cache ({}) but no k_scale/v_scale: set them with kvs_engine_set_kv_scales first", cache.dtype.name());
            (cache.k_scale, cache.v_scale) = (k, v);
        }
        Ok(cache)
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        ensure!(layer < self.cfg.num_layers, OutOfRange, "layer {layer} is outside the engine's {} layers", self.cfg.num_layers);
        Ok(())
    }

    /// Causal varlen attention for one layer. Validates everything before writing anything.
    pub fn attention_forward(&self, a: &ForwardArgs) -> Result<Counters> {
        let cfg = &self.cfg;
        let dev = cfg.device;
        self.check_layer(a.layer)?;
        validate_params(a.scale, a.sliding_window, a.softcap)?;
        let num_tokens = validate::query(cfg, &a.query)?;
        validate::attention_out(cfg, &a.out, num_tokens)?;
        if let Some(lse) = &a.lse {
            validate::lse_out("lse", lse, dev, num_tokens, cfg.num_q_heads)?;
        }
        let cache = self.scaled(KvCache::new(cfg, a.key_cache, a.value_cache, dev)?, a.layer)?;
        validate::batch(dev, &a.query_start_loc, &a.seq_lens, &a.block_table, a.seq_ids.as_ref())?;
        let pipeline = if self.policy.is_dense_for_layer(a.layer) { None } else { self.policy.pipeline().map(|p| p as &dyn PolicyPipeline) };
        let env = CallEnv { cfg, policy: &self.policy, pipeline, visits: &self.visits, policy_input: &self.policy_input };
        let (c, call) = self.backend.forward(&env, a, &cache)?;
        self.record(a.layer, &c);
        Ok(call)
    }

    /// The first fault the device checks recorded since the last check (CUDA engines: waits for the work
    /// enqueued on `stream`, then clears the record), as the CPU engine would have reported it. A CPU
    /// engine checks everything at the call, so it has nothing pending: always Ok.
    pub fn check(&self, stream: *mut c_void) -> Result<()> {
        self.backend.check(stream)
    }

    fn record(&self, layer: usize, c: &Counters) {
        let mut st = self.stats.lock();
        st.0.add(c);
        st.1[layer].add(c);
    }

    /// Stores new K/V rows by slot mapping. Validates every slot before writing any.
    pub fn cache_write(&self, a: &CacheWriteArgs) -> Result<()> {
        let cfg = &self.cfg;
        let dev = cfg.device;
        self.check_layer(a.layer)?;
        let cache = self.scaled(KvCache::new(cfg, a.key_cache, a.value_cache, dev)?, a.layer)?;
        let n = validate::new_rows(cfg, "key", &a.key)?;
        let nv = validate::new_rows(cfg, "value", &a.value)?;
        ensure!(nv == n, InvalidShape, "key has {n} tokens but value has {nv}");
        validate::slot_mapping(&a.slot_mapping, dev, n)?;
        self.backend.cache_write(cfg, a, &cache, n)
    }

    /// Merges two partial attention states exactly through their LSEs.
    pub fn merge_states(&self, a: &MergeArgs) -> Result<()> {
        let dev = self.cfg.device;
        let (tokens, heads, _) = validate::merge_out(&a.out, dev)?;
        validate::merge_in("out_a", &a.out_a, &a.out, dev)?;
        validate::merge_in("out_b", &a.out_b, &a.out, dev)?;
        validate::lse_in("lse_a", &a.lse_a, dev, tokens, heads)?;
        validate::lse_in("lse_b", &a.lse_b, dev, tokens, heads)?;
        if let Some(l) = &a.lse_out {
            validate::lse_out("lse_out", l, dev, tokens, heads)?;
        }
        self.backend.merge(a)
    }

    /// Starts (`true`) or stops collecting, per policy row, the positions it attended (see
    /// [`VisitRecord`]). Off by default; for evaluation and debugging, not for serving (it allocates).
    pub fn record_visits(&self, on: bool) {
        let mut v = self.visits.lock();
        *v = if on { Some(v.take().unwrap_or_default()) } else { None };
    }

    /// The visit records collected since the last call (empty when recording is off).
    pub fn take_visits(&self) -> Vec<VisitRecord> {
        self.visits.lock().as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Sets what the policy's stages read at run time (the policy's own setter, e.g.
    /// `set_speculation_budgets`, makes it); `None` clears it. Applies from the next call.
    pub(crate) fn set_policy_input(&self, input: Option<crate::policy::PolicyInput>) {
        *self.policy_input.write() = input;
    }

    /// Number of policy state objects (per-(sequence, layer, KV head) states and per-(sequence, layer)
    /// schedules) the engine holds now, over all live sequences.
    pub fn policy_state_objects(&self) -> u64 {
        self.backend.policy_state_objects()
    }

    /// Frees all state kept for `seq_id`; an id the engine does not hold is `UnknownSequence`. A CUDA
    /// engine registers ids on the device (its policy's state slots, or a plain registry of live ids);
    /// releasing synchronizes the device.
    pub fn release_sequence(&self, seq_id: u64) -> Result<()> {
        self.backend.release_sequence(seq_id)
    }

    /// Engine-wide counters. On a CUDA engine this synchronizes the device to read the policy counters
    /// kept there (the one call that may); if that fails the device part is left out.
    pub fn stats(&self) -> EngineStats {
        let host = self.stats.lock().clone();
        self.backend.stats(host)
    }
}
