//! The engine: configuration, thread pool, per-sequence state, statistics, and dispatch of each call to
//! the backend (CPU here) and, for decode rows of non-dense layers, to the policy pipeline.

use std::ffi::c_void;

use parking_lot::Mutex;

use crate::config::EngineConfig;
use crate::cpu;
use crate::cpu::attention::AttnParams;
use crate::cpu::forward::ForwardIo;
use crate::cpu::metadata::CacheMeta;
use crate::cpu::sparse::{sparse_forward, SparseCtx};
use crate::error::Result;
use crate::layout::{validate_params, Batch, KvCache};
use crate::policy::speculate::SpecBudgetTable;
use crate::policy::{Policy, Selector, SnapSelection};
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
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Result<Self> {
        cfg.validate()?;
        let cuda = match cfg.device {
            Device::Cuda(i) => Some(crate::cuda::CudaBackend::new(&cfg, i)?),
            Device::Cpu => None,
        };
        let policy = Policy::parse(&cfg.policy)?;
        // Fail at engine start, not on the first forward call, when the policy has no GPU path yet.
        ensure!(cuda.is_none() || policy.pipeline().is_none(), Unsupported, "the CUDA backend runs dense attention only; policy {:?} is not available on it yet", cfg.policy);
        if let Some(Selector::Predictor(ps)) = policy.pipeline().map(|p| &p.selector) {
            let w = crate::policy::predictor::PredictorWeights::builtin()?;
            ensure!(ps.history == w.history, InvalidArgument, "policy {:?}: the built-in predictor weights were trained for history={}, not {}", cfg.policy, w.history, ps.history);
        }
        let threads = if cfg.num_threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()).min(crate::config::MAX_THREADS) } else { cfg.num_threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kvsparse-{i}"))
            .build()
            .map_err(|e| crate::error::Error::new(crate::error::ErrorKind::Internal, format!("could not start {threads} worker threads: {e}")))?;
        let per_layer = alloc::try_vec(cfg.num_layers, Counters::default(), "per-layer statistics")?;
        let meta = CacheMeta::new(policy.meta_needs(), cfg.num_layers)?;
        Ok(Engine { cfg, policy, pool, sequences: Registry::default(), meta, stats: Mutex::new((Counters::default(), per_layer)), visits: Mutex::new(None), cuda, spec_budgets: parking_lot::RwLock::new(None) })
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
        self.meta.bytes()
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
        if let Some(gpu) = &self.cuda {
            // Device metadata cannot be read without a sync, so the GPU path counts calls only.
            ensure!(self.policy.is_dense_for_layer(a.layer), Unsupported, "the CUDA backend runs dense attention only; policy {:?} is not available on it yet", cfg.policy);
            gpu.forward(cfg, a, &cache)?;
            let c = Counters { calls: 1, ..Default::default() };
            self.record(a.layer, &c);
            return Ok(c);
        }
        let batch = Batch::from_host_tensors(num_tokens, &a.query_start_loc, &a.seq_lens, &a.block_table, a.seq_ids.as_ref(), cfg.block_size, cache.num_blocks)?;
        let pipeline = if self.policy.is_dense_for_layer(a.layer) { None } else { self.policy.pipeline() };
        ensure!(
            batch.has_seq_ids || pipeline.is_none() || !self.policy.is_stateful(),
            InvalidArgument,
            "policy {:?} keeps per-sequence state, so seq_ids is required",
            cfg.policy
        );
        let params = AttnParams { scale: a.scale, softcap: a.softcap, window: a.sliding_window as usize };
        let io = ForwardIo { q: a.query, out: a.out, lse: a.lse, cache: &cache, batch: &batch, params, num_q_heads: cfg.num_q_heads, num_kv_heads: cfg.num_kv_heads };
        let (policy_seqs, dense_seqs): (Vec<usize>, Vec<usize>) = (0..batch.seqs.len()).partition(|&s| pipeline.is_some() && batch.seqs[s].is_decode());

        // PRR calibrates at prefill chunks (on Quest's page scores of the chunk's queries).
        let speculate = match pipeline.map(|p| &p.selector) {
            Some(Selector::Speculate(sp)) => Some(*sp),
            _ => None,
        };
        let predictor = match pipeline.map(|p| &p.selector) {
            Some(Selector::Predictor(ps)) => Some(*ps),
            _ => None,
        };
        let calib_seqs: Vec<usize> = if speculate.is_some() || predictor.is_some() { (0..batch.seqs.len()).filter(|&s| !batch.seqs[s].is_decode() && batch.seqs[s].q_len > 0).collect() } else { Vec::new() };
        if self.cfg.max_state_bytes > 0 && pipeline.is_some() && self.policy.is_stateful() && !matches!(pipeline.map(|p| &p.selector), Some(Selector::SnapKv { .. })) {
            let held = self.sequences.state_bytes();
            ensure!(held <= self.cfg.max_state_bytes, OutOfMemory, "policy state holds {held} bytes, over the engine's cap of {}; release finished sequences", self.cfg.max_state_bytes);
        }

        // Everything that can fail is checked before anything is written: metadata coverage, state cap.
        let meta_guard = if self.meta.needs.any() && pipeline.is_some() && (!policy_seqs.is_empty() || !calib_seqs.is_empty()) { Some(self.meta.read(a.layer)) } else { None };
        let meta = match &meta_guard {
            Some(g) => {
                let Some(m) = g.as_ref() else {
                    bail!(InvalidArgument, "policy {:?} needs key metadata for layer {}, but no cache write for that layer went through kvs_cache_write", cfg.policy, a.layer);
                };
                ensure!(m.num_blocks == cache.num_blocks, InvalidShape, "layer {}'s key metadata was built for {} blocks, the caches have {}", a.layer, m.num_blocks, cache.num_blocks);
                for &s in policy_seqs.iter().chain(&calib_seqs) {
                    let sd = &batch.seqs[s];
                    let lim = crate::cpu::attention::RowLimits::causal(sd.seq_len - 1, params.window);
                    m.check_covers(batch.blocks(s, cfg.block_size), lim.lo, lim.hi, &format!("policy {:?} (layer {}, sequence {})", cfg.policy, a.layer, sd.seq_id))?;
                }
                Some(m)
            }
            None => None,
        };
        let snap_choices = match pipeline.map(|p| &p.selector) {
            Some(&Selector::SnapKv { budget, window, pool }) => self.snapkv_prefill(&io, budget, window, pool)?,
            _ => Vec::new(),
        };

        if batch.has_seq_ids {
            for s in &batch.seqs {
                self.sequences.get_or_create(s.seq_id);
            }
        }
        for (s, heads) in snap_choices {
            let st = self.sequences.get_or_create(batch.seqs[s].seq_id);
            let mut st = st.lock();
            for (h, sel) in heads.into_iter().enumerate() {
                st.policy.head_mut(a.layer, h, cfg.num_kv_heads).snapkv = Some(std::sync::Arc::new(sel));
            }
        }
        let mut c = Counters { calls: 1, ..Default::default() };
        if let (Some(sp), Some(m)) = (speculate, meta) {
            use rayon::prelude::*;
            let hk = cfg.num_kv_heads;
            let t0 = std::time::Instant::now();
            let table = self.spec_budgets.read();
            let items: Vec<(usize, usize)> = calib_seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
            let warm: Vec<_> = self.pool.install(|| items.par_iter().map(|&(s, h)| cpu::sparse::prr_calibrate(&io, s, h, &sp, m, table.as_ref()).0).collect());
            for (&(s, h), w) in items.iter().zip(warm) {
                let st = self.sequences.get_or_create(batch.seqs[s].seq_id);
                st.lock().policy.head_mut(a.layer, h, hk).prr = Some(Box::new(w));
            }
            c.spec_calibrations += items.len() as u64;
            c.spec_calib_us += t0.elapsed().as_micros() as u64;
        }
        if let Some(ps) = predictor {
            use rayon::prelude::*;
            let hk = cfg.num_kv_heads;
            let items: Vec<(usize, usize)> = calib_seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
            let seeded: Vec<_> = self.pool.install(|| items.par_iter().map(|&(s, h)| cpu::sparse::predictor_seed(&io, s, h, &ps)).collect());
            for (&(s, h), ph) in items.iter().zip(seeded) {
                let st = self.sequences.get_or_create(batch.seqs[s].seq_id);
                st.lock().policy.head_mut(a.layer, h, hk).predictor = Some(Box::new(ph));
            }
        }
        cpu::forward::dense_forward(&io, &dense_seqs, &self.pool);

        if let Some(p) = pipeline {
            if !policy_seqs.is_empty() {
                let snap = policy_seqs
                    .iter()
                    .map(|&s| {
                        let st = self.sequences.get(batch.seqs[s].seq_id);
                        let st = st.as_ref().map(|st| st.lock());
                        (0..cfg.num_kv_heads).map(|h| st.as_ref().and_then(|st| st.policy.head(a.layer, h)).and_then(|hs| hs.snapkv.clone())).collect()
                    })
                    .collect();
                let log = self.visits.lock().is_some().then(|| std::sync::Mutex::new(Vec::new()));
                let states = if self.policy.is_stateful() { policy_seqs.iter().map(|&s| self.sequences.get(batch.seqs[s].seq_id)).collect() } else { Vec::new() };
                let table = self.spec_budgets.read();
                let ctx = SparseCtx { pipeline: p, meta, snap, visits: log.as_ref(), layer: a.layer, states, spec_budgets: table.as_ref() };
                c.add(&sparse_forward(&io, &policy_seqs, &ctx, &self.pool));
                if let (Some(log), Some(dst)) = (log, self.visits.lock().as_mut()) {
                    dst.extend(log.into_inner().expect("visit log").into_iter().map(|r| VisitRecord { layer: a.layer, ..r }));
                }
            }
        }
        drop(meta_guard);

        let row_bytes = (cfg.head_dim * cfg.dtype.size_bytes() * 2 * cfg.num_kv_heads) as u64;
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.q_len == 1 {
                c.decode_rows += 1;
            } else {
                c.prefill_tokens += s.q_len as u64;
            }
            if dense_seqs.binary_search(&i).is_ok() {
                let first_visible = if a.sliding_window > 0 { (s.first_pos() + 1).saturating_sub(a.sliding_window as usize) } else { 0 };
                c.kv_bytes_read += (s.seq_len - first_visible) as u64 * row_bytes;
            }
        }
        self.record(a.layer, &c);
        Ok(c)
    }

    /// SnapKV choices for the prefill sequences of this call, per (sequence, KV head), computed before
    /// anything is written; fails if storing them would exceed the engine's state cap.
    fn snapkv_prefill(&self, io: &ForwardIo, budget: usize, window: usize, pool: usize) -> Result<Vec<(usize, Vec<SnapSelection>)>> {
        use rayon::prelude::*;
        let hk = self.cfg.num_kv_heads;
        let seqs: Vec<usize> = (0..io.batch.seqs.len()).filter(|&s| !io.batch.seqs[s].is_decode() && io.batch.seqs[s].q_len > 0).collect();
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let items: Vec<(usize, usize)> = seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
        let mut sels: Vec<SnapSelection> = self.pool.install(|| items.par_iter().map(|&(s, h)| cpu::snapkv::choose(io, s, h, budget, window, pool)).collect());
        if self.cfg.max_state_bytes > 0 {
            let new: u64 = sels.iter().map(|s| (s.keep.len() * 4 + std::mem::size_of::<SnapSelection>()) as u64).sum();
            let held = self.sequences.state_bytes();
            ensure!(
                held + new <= self.cfg.max_state_bytes,
                OutOfMemory,
                "SnapKV state for this call needs {new} bytes, the engine holds {held} of its {} byte cap; release finished sequences",
                self.cfg.max_state_bytes
            );
        }
        let mut out = Vec::with_capacity(seqs.len());
        for &s in seqs.iter().rev() {
            let heads = sels.split_off(sels.len() - hk);
            out.push((s, heads));
        }
        Ok(out)
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

    /// Frees all state kept for `seq_id`.
    pub fn release_sequence(&self, seq_id: u64) -> Result<()> {
        self.sequences.release(seq_id)
    }

    pub fn stats(&self) -> EngineStats {
        let st = self.stats.lock();
        let (created, released) = self.sequences.lifecycle();
        EngineStats {
            total: st.0,
            per_layer: st.1.clone(),
            live_sequences: self.sequences.live(),
            sequences_created: created,
            sequences_released: released,
            state_bytes: self.sequences.state_bytes(),
        }
    }
}
