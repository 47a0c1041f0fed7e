//! The engine: configuration, thread pool, per-sequence state, statistics, and dispatch of each call to
//! the backend (CPU here) and, for decode rows of non-dense layers, to the policy pipeline.

use std::ffi::c_void;

use parking_lot::Mutex;

use crate::config::EngineConfig;
use crate::cpu;
use crate::cpu::call::CallCtx;
use crate::cpu::metadata::CacheMeta;
use crate::error::Result;
use crate::layout::{validate_params, KvCache};
use crate::policy::speculate::SpecBudgetTable;
use crate::policy::{Policy, Selector};
use crate::sequences::Registry;
use crate::stats::{Counters, EngineStats, VisitRecord};
use crate::tensor::{Device, TensorRef};
use crate::{alloc, bail, ensure, validate};

/// Arguments of one attention forward call (see `kvs_forward_args` in the C header for the contract).
#[derive(Clone, Copy, Debug)]
pub struct ForwardArgs {
    pub layer: usize,
    /// `[num_tokens, num_q_heads, head_dim]`
    pub query: TensorRef,
    /// `[num_blocks, block_size, num_kv_heads, head_dim]` each
    pub key_cache: TensorRef,
    pub value_cache: TensorRef,
    /// `[num_seqs, max_blocks]` int32
    pub block_table: TensorRef,
    /// `[num_seqs]` int32, total length including the new tokens
    pub seq_lens: TensorRef,
    /// `[num_seqs + 1]` int32
    pub query_start_loc: TensorRef,
    /// `[num_seqs]` int64/uint64 stable ids, needed by stateful policies
    pub seq_ids: Option<TensorRef>,
    /// `[num_tokens, num_q_heads, head_dim]`, dtype of the query
    pub out: TensorRef,
    /// `[num_tokens, num_q_heads]` float32
    pub lse: Option<TensorRef>,
    pub scale: f32,
    pub sliding_window: i32,
    pub softcap: f32,
    /// Largest query length / sequence length in the batch, for GPU grid sizing (0 = unknown: the CUDA
    /// backend then assumes the block table's capacity). Ignored on the CPU, which reads the metadata.
    pub max_query_len: i32,
    pub max_seq_len: i32,
    pub stream: *mut c_void,
}

/// Arguments of a cache write.
#[derive(Clone, Copy, Debug)]
pub struct CacheWriteArgs {
    pub layer: usize,
    /// `[num_tokens, num_kv_heads, head_dim]`
    pub key: TensorRef,
    pub value: TensorRef,
    pub key_cache: TensorRef,
    pub value_cache: TensorRef,
    /// `[num_tokens]` int64 or int32; negative entries are skipped
    pub slot_mapping: TensorRef,
    pub stream: *mut c_void,
}

/// Arguments of a state merge: `out, lse = merge((out_a, lse_a), (out_b, lse_b))`.
#[derive(Clone, Copy, Debug)]
pub struct MergeArgs {
    pub out_a: TensorRef,
    pub lse_a: TensorRef,
    pub out_b: TensorRef,
    pub lse_b: TensorRef,
    pub out: TensorRef,
    pub lse_out: Option<TensorRef>,
    pub stream: *mut c_void,
}

pub struct Engine {
    cfg: EngineConfig,
    policy: Policy,
    pool: rayon::ThreadPool,
    /// CPU engines: the pool of the dense path (cpu::spin_pool), same thread count as `pool`.
    spin: Option<crate::cpu::spin_pool::SpinPool>,
    sequences: Registry,
    /// Key metadata (Quest min/max, INT4 K) maintained on cache writes for the policy's needs.
    meta: CacheMeta,
    stats: Mutex<(Counters, Vec<Counters>)>,
    /// Per-row visit records, collected only while [`Engine::record_visits`] is on.
    visits: Mutex<Option<Vec<VisitRecord>>>,
    /// The CUDA backend when the engine's device is a GPU (None = CPU backend).
    cuda: Option<crate::cuda::CudaBackend>,
    /// PRR's speculation budget by context length, when loaded (else the spec's constant budget).
    spec_budgets: parking_lot::RwLock<Option<SpecBudgetTable>>,
    /// AttentionPredictor's CNN: the spec's `weights` file, else the built-in weights.
    predictor: Option<std::sync::Arc<crate::policy::predictor::PredictorWeights>>,
}

impl Engine {
    /// Everything `new` checks about `cfg` that needs no device and no allocation: the geometry, the policy
    /// spec, and (for a CUDA device) whether the CUDA backend runs the policy. Serving plugins call it (through
    /// `kvs_engine_config_check`) where the engine cannot be made yet, e.g. in a process that must not touch
    /// the GPU before its workers fork.
    pub fn check_config(cfg: &EngineConfig) -> Result<Policy> {
        cfg.validate()?;
        let policy = Policy::parse(&cfg.policy)?;
        if let (Device::Cuda(_), Some(p)) = (cfg.device, policy.pipeline()) {
            // Fail at engine start, not on the first forward call, when the policy has no GPU path yet.
            if let Err(why) = crate::cuda::sparse::supported(p, cfg.group_size()) {
                bail!(Unsupported, "policy {:?}: {why}", cfg.policy);
            }
        }
        Ok(policy)
    }

    pub fn new(cfg: EngineConfig) -> Result<Self> {
        let policy = Self::check_config(&cfg)?;
        let predictor = match policy.pipeline().map(|p| &p.selector) {
            Some(Selector::Predictor(_)) => Some(std::sync::Arc::new(match &policy.spec.predictor_weights {
                Some(path) => crate::policy::predictor::PredictorWeights::from_file(path)?,
                None => crate::policy::predictor::PredictorWeights::builtin()?.clone(),
            })),
            _ => None,
        };
        let cuda = match cfg.device {
            Device::Cuda(i) => {
                let mut b = crate::cuda::CudaBackend::new(&cfg, i, policy.device_meta_needs(), policy.device_slots())?;
                if let (Some(w), Some(Selector::Predictor(ps))) = (&predictor, policy.pipeline().map(|p| &p.selector)) {
                    b.init_predictor(w, *ps, cfg.num_layers, cfg.num_kv_heads, policy.spec.max_seqs)?;
                }
                Some(b)
            }
            Device::Cpu => None,
        };
        let threads = if cfg.num_threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()).min(crate::config::MAX_THREADS) } else { cfg.num_threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kvsparse-{i}"))
            .build()
            .map_err(|e| crate::error::Error::new(crate::error::ErrorKind::Internal, format!("could not start {threads} worker threads: {e}")))?;
        // The dense decode hot path's pool (the caller takes part, workers spin between calls): CPU only.
        let spin = match cfg.device {
            Device::Cpu => Some(crate::cpu::spin_pool::SpinPool::new(threads).map_err(|e| crate::error::Error::new(crate::error::ErrorKind::Internal, format!("could not start {threads} worker threads: {e}")))?),
            Device::Cuda(_) => None,
        };
        let per_layer = alloc::try_vec(cfg.num_layers, Counters::default(), "per-layer statistics")?;
        let meta = CacheMeta::new(policy.meta_needs(), cfg.num_layers)?;
        Ok(Engine { cfg, policy, pool, spin, sequences: Registry::default(), meta, stats: Mutex::new((Counters::default(), per_layer)), visits: Mutex::new(None), cuda, spec_budgets: parking_lot::RwLock::new(None), predictor })
    }

    /// The CUDA backend, when the engine runs on a GPU (benchmarks and tests use its helpers).
    pub fn cuda_backend(&self) -> Option<&crate::cuda::CudaBackend> {
        self.cuda.as_ref()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Bytes of key metadata (all layers) kept for the policy.
    pub fn metadata_bytes(&self) -> usize {
        self.meta.bytes() + self.cuda.as_ref().map_or(0, |g| g.meta.bytes())
    }

    /// A copy of layer `layer`'s key metadata (None before its first cache write or when the policy needs
    /// none); on a CUDA engine downloaded from the device (synchronizes). For tests and debugging.
    pub fn metadata_snapshot(&self, layer: usize) -> Result<Option<crate::cpu::metadata::MetaSnapshot>> {
        self.check_layer(layer)?;
        match &self.cuda {
            Some(g) => {
                g.gpu.synchronize()?;
                g.meta.layer(layer).as_ref().map(|m| m.download()).transpose()
            }
            None => Ok(self.meta.read(layer).as_ref().map(|m| m.snapshot())),
        }
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
        let cache = KvCache::new(cfg, a.key_cache, a.value_cache, dev)?;
        validate::batch(dev, &a.query_start_loc, &a.seq_lens, &a.block_table, a.seq_ids.as_ref())?;
        let pipeline = if self.policy.is_dense_for_layer(a.layer) { None } else { self.policy.pipeline() };
        let (c, call) = match &self.cuda {
            Some(gpu) => {
                // PRR on the device reads the spec's constant budget; a loaded table is CPU-only for now.
                ensure!(
                    !matches!(pipeline.map(|p| &p.selector), Some(Selector::Speculate(_))) || self.spec_budgets.read().is_none(),
                    Unsupported,
                    "a speculation budget table (set_speculation_budgets) is not supported by the CUDA backend; PRR there uses the spec's `budget`"
                );
                // Host-known, so it fails at the call as on the CPU engine.
                ensure!(
                    a.seq_ids.is_some() || pipeline.is_none() || !self.policy.is_stateful(),
                    InvalidArgument,
                    "policy {:?} keeps per-sequence state, so seq_ids is required",
                    cfg.policy
                );
                // validate = sync: the call waits anyway, so its counters are read back from the device
                // (the difference of the layer's device counters across the call).
                let before = if gpu.validates_sync() {
                    crate::cuda::checks::refuse_sync_in_capture(&gpu.gpu, a.stream)?;
                    Some(gpu.device_counters()?)
                } else {
                    None
                };
                let c = gpu.forward(cfg, a, &cache, pipeline)?;
                if let (Some(_), Some(dst)) = (pipeline, self.visits.lock().as_mut()) {
                    dst.extend(gpu.visit_records(cfg, a)?);
                }
                let call = match before {
                    Some(b) => {
                        let mut d = gpu.device_counters()?[a.layer].since(&b[a.layer]);
                        d.add(&c);
                        d
                    }
                    None => c,
                };
                (c, call)
            }
            None => {
                let c = cpu::call::forward(&self.call_ctx(), a, &cache)?;
                (c, c)
            }
        };
        self.record(a.layer, &c);
        Ok(call)
    }

    /// The first fault the device checks recorded since the last check (CUDA engines: waits for the work
    /// enqueued on `stream`, then clears the record), as the CPU engine would have reported it. A CPU
    /// engine checks everything at the call, so it has nothing pending: always Ok.
    pub fn check(&self, stream: *mut c_void) -> Result<()> {
        match &self.cuda {
            Some(g) => match g.checks.take(&g.gpu, stream)? {
                Some(e) => Err(e),
                None => Ok(()),
            },
            None => Ok(()),
        }
    }

    fn call_ctx(&self) -> CallCtx<'_> {
        CallCtx { cfg: &self.cfg, policy: &self.policy, pool: &self.pool, spin: self.spin.as_ref().expect("CPU engines have a spin pool"), sequences: &self.sequences, meta: &self.meta, visits: &self.visits, spec_budgets: &self.spec_budgets, predictor: self.predictor.as_deref() }
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
        let cache = KvCache::new(cfg, a.key_cache, a.value_cache, dev)?;
        let n = validate::new_rows(cfg, "key", &a.key)?;
        let nv = validate::new_rows(cfg, "value", &a.value)?;
        ensure!(nv == n, InvalidShape, "key has {n} tokens but value has {nv}");
        validate::slot_mapping(&a.slot_mapping, dev, n)?;
        if let Some(gpu) = &self.cuda {
            return gpu.cache_write(cfg, a, &cache, n);
        }
        let slots = cpu::cache_write::decode_slots(&a.slot_mapping, n, &cache)?;
        let mut meta = self.meta.begin_write(a.layer, &cache)?;
        cpu::cache_write::write(&cache, &a.key, &a.value, &slots);
        if let Some(g) = meta.as_mut() {
            CacheMeta::finish_write(g, &cache, &slots);
        }
        Ok(())
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
        if let Some(gpu) = &self.cuda {
            return gpu.merge(a);
        }
        cpu::merge::merge_states(&a.out_a, &a.lse_a, &a.out_b, &a.lse_b, &a.out, a.lse_out.as_ref());
        Ok(())
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

    /// Loads PRR's speculation budget table (context length → speculation budget in tokens), replacing the
    /// spec's constant `budget`; `None` goes back to the constant. Applies from the next call.
    pub fn set_speculation_budgets(&self, table: Option<SpecBudgetTable>) {
        *self.spec_budgets.write() = table;
    }

    /// Number of policy state objects (per-(sequence, layer, KV head) states and per-(sequence, layer)
    /// schedules) the engine holds now, over all live sequences.
    pub fn policy_state_objects(&self) -> u64 {
        self.sequences.state_objects()
    }

    /// Frees all state kept for `seq_id`; an id the engine does not hold is `UnknownSequence`. A CUDA
    /// engine registers ids on the device (its policy's state slots, or a plain id registry of
    /// [`crate::cuda::backend::ID_REGISTRY_SEQS`] live ids); releasing synchronizes the device.
    pub fn release_sequence(&self, seq_id: u64) -> Result<()> {
        match &self.cuda {
            Some(g) => match g.id_map() {
                Some(s) => s.release(&g.gpu, seq_id),
                None => bail!(Internal, "the CUDA engine has no sequence id map"),
            },
            None => self.sequences.release(seq_id),
        }
    }

    /// Engine-wide counters. On a CUDA engine this synchronizes the device to read the policy counters
    /// kept there (the one call that may); if that fails the device part is left out.
    pub fn stats(&self) -> EngineStats {
        let dev = self.cuda.as_ref().and_then(|g| g.device_counters().ok());
        let mut st = self.stats.lock().clone();
        if let Some(dev) = dev {
            for (l, c) in dev.iter().enumerate() {
                st.0.add(c);
                st.1[l].add(c);
            }
        }
        let (mut created, mut released) = self.sequences.lifecycle();
        let mut live = self.sequences.live();
        let mut without_state = 0;
        let mut pending_status = 0;
        if let Some(g) = &self.cuda {
            // A CUDA engine registers its sequence ids on the device (slots.rs); only a policy's state
            // slots leave rows without state.
            if let Some((counts, life)) = g.id_map().and_then(|s| Some((s.read_counts(&g.gpu).ok()?, s.lifecycle(&g.gpu).ok()?))) {
                live = counts.1;
                (created, released) = life;
                without_state = if g.slots.is_some() { counts.0 } else { 0 };
            }
            pending_status = g.checks.peek().ok().flatten().map_or(0, |e| crate::ffi::guard::status_of(e.kind) as u64);
        }
        EngineStats {
            total: st.0,
            per_layer: st.1.clone(),
            live_sequences: live,
            policy_rows_without_state: without_state,
            sequences_created: created,
            sequences_released: released,
            state_bytes: self.sequences.state_bytes(),
            pending_status,
        }
    }
}
