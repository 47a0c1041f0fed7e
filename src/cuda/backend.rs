//! The CUDA backend behind `Engine`: host-side validation of everything that can be checked without
//! reading device memory, kernel-variant choice, split planning, workspace, and the launches.
//!
//! Contract of a CUDA call (see also kernels/attention.cu): all tensors live on the engine's device;
//! metadata (block table, seq_lens, query_start_loc, slot mapping) is read only by kernels, which clamp or
//! mask anything out of range instead of reading or writing outside the tensors. Work is enqueued on the
//! caller's stream (NULL = legacy default stream) in the device's primary context; nothing synchronizes.
//! Workspace for split-KV partial results is kept per stream, allocated on first use and grown when a
//! call needs more; inside a graph capture it is never allocated: a capture whose call needs more than
//! a previous uncaptured call on that stream allocated fails with a clear error (warm up first).

use std::collections::{HashMap, HashSet};

use parking_lot::Mutex;

use super::batch::{dtype_code, kv8_code, Geometry, PlanRef, Rows};
use super::context::{DevBuf, Gpu};
use super::launch::{self, KArgs, Modules};
use super::kernel_src::KernelFile;
use super::plan::{self, SplitPolicy};
use super::meta::DeviceMeta;
use super::slots::SeqSlots;
use super::sparse::SparseState;
use super::stage::{CudaPipeline, Device, PolicyDevice};
use super::traversal::{HookKernel, HookSplits};
use crate::cpu::metadata::MetaNeeds;
use crate::config::EngineConfig;
use crate::args::{CacheWriteArgs, ForwardArgs, MergeArgs};
use crate::error::Result;
use crate::layout::KvCache;
use crate::stats::{Counters, StageCounter, VisitRecord};
use crate::tensor::{DType, TensorRef};
use crate::ensure;

const NTHREADS: u32 = 128;

/// Live sequence ids a CUDA engine without per-sequence device state registers (docs/abi.md); ids past
/// that are not registered (their release is `UNKNOWN_SEQUENCE`).
pub const ID_REGISTRY_SEQS: usize = 8192;

/// Fewest plan keys per split when a plan is shorter than its sequences (dense rows keep
/// `SplitPolicy::min_chunk`): short plans are split finer to fill the device at small batch.
const PLAN_MIN_CHUNK: usize = 256;

/// Cache writes of at most this many tokens run in one launch (`write_step`: each CTA reads every slot of
/// the call, so the launch's cost grows with the square of the tokens); longer ones by the general path.
pub(crate) const WRITE_STEP_MAX_TOKENS: usize = 1024;

pub struct CudaBackend {
    pub(crate) modules: Modules,
    /// Split-KV workspace per stream handle.
    pub(crate) workspaces: Mutex<HashMap<usize, DevBuf>>,
    /// Workspaces replaced by larger ones: kept until the engine is destroyed, because CUDA graphs
    /// captured before the growth still read and write them (at most as much again as the live ones).
    pub(crate) retired: Mutex<Vec<DevBuf>>,
    policy: SplitPolicy,
    mma: plan::MmaTunables,
    /// Functions whose dynamic shared-memory limit was raised already.
    smem_ready: Mutex<HashSet<usize>>,
    /// Key metadata the policy needs, kept by cache writes.
    pub meta: DeviceMeta,
    /// Policy state on the device: plans, scores and counters (see `sparse`).
    pub(crate) sparse: SparseState,
    /// Sequence id -> state slot map, for policies with per-sequence device state (see `slots`).
    pub slots: Option<super::slots::SeqSlots>,
    /// Without such a map: a slot map used only as the registry of sequence ids (created on first use in
    /// a forward call, freed by release, counted by the stats, as on the CPU engine), and the scratch its
    /// lookup writes the (unused) slots into.
    ids: Option<(super::slots::SeqSlots, DevBuf)>,
    /// The policy's own device state (PRR's, RefreshKV's, the predictor's), made by the policy registry.
    policy_dev: Option<Box<dyn PolicyDevice>>,
    /// The device checks' error record and the cache writes' checked slot buffers (see `checks`).
    pub checks: super::checks::DeviceChecks,
    /// `validate = sync`: every eager call waits and returns what the device checks found.
    validate_sync: bool,
    /// The attention modules' `KVS_CHECKS` define (`checks::kernel_define`, read once).
    pub(crate) checks_define: String,
    /// A decode step's one-launch cache write (src/cuda/write_step.rs), looked up on its first use (its
    /// defines follow from the engine's dtypes, which never change).
    pub(crate) write_step: std::sync::OnceLock<usize>,
    /// The device's primary context, held for the engine's life. Last: fields drop in declaration order,
    /// so every buffer, module and stream above is freed while the context still exists (released first,
    /// the context could be destroyed with them still to free: compute-sanitizer reported each of those
    /// frees as CUDA_ERROR_CONTEXT_IS_DESTROYED).
    pub gpu: Gpu,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // The fields are freed after this, in the engine's context: make it current for them.
        if self.gpu.make_current().is_ok() {
            // A policy's streams and events (PRR's) belong to that context too.
            if let Some(pd) = &self.policy_dev {
                pd.release();
            }
        }
    }
}

pub(crate) fn p(t: &TensorRef) -> *const u8 {
    t.data
}

/// The arguments every attention kernel starts with: query, caches, block size, block table, lengths
/// and query starts with the sequence count.
pub(crate) fn batch_args(cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache, geo: &Geometry) -> KArgs {
    let mut k = KArgs::new();
    k.ptr(p(&a.query)).i64(a.query.stride(0) as i64).i64(a.query.stride(1) as i64).i64(a.query.stride(2) as i64);
    k.ptr(p(&cache.k)).i64(cache.k.stride(0) as i64).i64(cache.k.stride(1) as i64).i64(cache.k.stride(2) as i64);
    k.ptr(p(&cache.v)).i64(cache.v.stride(0) as i64).i64(cache.v.stride(1) as i64).i64(cache.v.stride(2) as i64);
    k.i64(cache.num_blocks as i64).i32(cfg.block_size.trailing_zeros() as i32);
    k.ptr(p(&a.block_table)).i64(a.block_table.stride(0) as i64).i64(a.block_table.stride(1) as i64).i32(geo.cols as i32);
    k.ptr(p(&a.seq_lens)).i64(a.seq_lens.stride(0) as i64);
    k.ptr(p(&a.query_start_loc)).i64(a.query_start_loc.stride(0) as i64).i32(geo.num_seqs as i32);
    k
}

/// The optional LSE output as (pointer or NULL, token stride, head stride).
pub(crate) fn lse_arg(a: &ForwardArgs) -> (*const u8, i64, i64) {
    match &a.lse {
        Some(l) => (l.data as *const u8, l.stride(0) as i64, l.stride(1) as i64),
        None => (std::ptr::null(), 0, 0),
    }
}

impl CudaBackend {
    /// Opens the engine's device. Fails with Unsupported when there is no driver or no such device.
    /// `max_seqs`: the size of the per-sequence state slot map, for policies that keep such state;
    /// `stage_counters`: the stages' own counters (`Policy::stage_counters`), read with the device counters.
    pub fn new(cfg: &EngineConfig, ordinal: i32, needs: MetaNeeds, max_seqs: Option<usize>, stage_counters: &'static [&'static [StageCounter]]) -> Result<CudaBackend> {
        let gpu = Gpu::open(ordinal)?;
        ensure!(!cfg.cache_dtype.is_fp8() || gpu.cc >= (8, 9), Unsupported, "FP8 caches need compute capability 8.9 or newer (its FP8 conversions); device {ordinal} is {}.{}", gpu.cc.0, gpu.cc.1);
        let sparse = SparseState::new(cfg.num_layers, stage_counters)?;
        let slots = max_seqs.map(super::slots::SeqSlots::new).transpose()?;
        let ids = match slots {
            Some(_) => None,
            None => Some((super::slots::SeqSlots::new(ID_REGISTRY_SEQS)?, DevBuf::alloc(crate::validate::MAX_SEQS_PER_CALL * 8)?)),
        };
        Ok(CudaBackend {
            gpu,
            modules: Modules::default(),
            workspaces: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            policy: SplitPolicy::from_env(),
            mma: plan::MmaTunables::from_env(),
            smem_ready: Mutex::new(HashSet::new()),
            meta: DeviceMeta::new(needs, cfg.num_layers),
            sparse,
            slots,
            ids,
            policy_dev: None,
            checks: super::checks::DeviceChecks::new(cfg.num_layers, cfg.block_size)?,
            validate_sync: cfg.validate == crate::config::Validate::Sync,
            checks_define: super::checks::kernel_define(cfg.padded_batches),
            write_step: Default::default(),
        })
    }

    fn attn_defines(cfg: &EngineConfig, shape: &plan::KernelShape) -> Vec<String> {
        vec![
            format!("KVS_DTYPE={}", dtype_code(cfg.dtype)),
            format!("HEAD_DIM={}", cfg.head_dim),
            format!("GQ={}", shape.gq),
            format!("GROUP={}", cfg.group_size()),
            format!("LOAD_BYTES={}", shape.load_bytes),
            format!("KB={}", shape.kb),
        ]
    }

    /// Paged varlen attention on the device. `cache` and the query/output tensors were validated by the
    /// engine; the metadata tensors are validated here (shape, dtype, device; not their contents).
    pub(crate) fn forward(&self, cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache, pipeline: Option<&dyn CudaPipeline>) -> Result<Counters> {
        let Some(geo) = self.check_call(cfg, a, cache)? else {
            return Ok(Counters { calls: 1, ..Default::default() });
        };
        self.gpu.make_current()?;
        if self.validate_sync {
            super::checks::refuse_sync_in_capture(&self.gpu, a.stream)?;
        }
        if let (Some((reg, scratch)), Some(ids)) = (&self.ids, &a.seq_ids) {
            // Plain: it may precede a dense layer's launch, which stays plain.
            reg.lookup(&self.gpu, &self.modules, ids, geo.num_seqs, scratch.ptr, scratch.ptr + (geo.num_seqs * 4) as u64, a.stream, false)?;
        }
        match pipeline {
            None => self.attend(cfg, a, cache, &geo, Rows::All)?,
            Some(p) => self.sparse.forward(self, self.policy_device(), cfg, a, cache, &geo, p)?,
        }
        self.sync_checks(a.stream)?;
        Ok(Counters { calls: 1, ..Default::default() })
    }

    /// Under `validate = sync`: waits for the call's work on `stream` and returns the fault the device
    /// checks recorded, as the CPU engine would have (the record is cleared). Otherwise nothing.
    fn sync_checks(&self, stream: super::driver::CUstream) -> Result<()> {
        if !self.validate_sync {
            return Ok(());
        }
        match self.checks.take(&self.gpu, stream)? {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The map that registers this engine's sequence ids: the policy's state slots, or the plain registry.
    pub fn id_map(&self) -> Option<&super::slots::SeqSlots> {
        self.slots.as_ref().or(self.ids.as_ref().map(|r| &r.0))
    }

    /// Whether every eager call waits for the device checks (`validate = sync`).
    pub fn validates_sync(&self) -> bool {
        self.validate_sync
    }

    /// Validates what the host can see of a call (shapes, dtypes, devices; not the device-side contents).
    /// None = nothing to do (no query tokens).
    fn check_call(&self, cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache) -> Result<Option<Geometry>> {
        let dev = cfg.device;
        let num_tokens = a.query.dim(0);
        a.block_table.expect("block_table", 2, &[DType::I32], dev)?;
        let num_seqs = a.block_table.dim(0);
        let cols = a.block_table.dim(1);
        a.seq_lens.expect("seq_lens", 1, &[DType::I32], dev)?;
        a.seq_lens.expect_shape("seq_lens", &[Some(num_seqs)])?;
        a.query_start_loc.expect("query_start_loc", 1, &[DType::I32], dev)?;
        a.query_start_loc.expect_shape("query_start_loc", &[Some(num_seqs + 1)])?;
        if let Some(ids) = &a.seq_ids {
            ids.expect("seq_ids", 1, &[DType::I64, DType::U64], dev)?;
            ids.expect_shape("seq_ids", &[Some(num_seqs)])?;
        }
        ensure!(a.max_seq_len >= 0 && a.max_query_len >= 0, InvalidArgument, "max_seq_len and max_query_len must be non-negative (0 = unknown)");
        ensure!(cache.k_dim_stride() == 1 && cache.v_dim_stride() == 1, Unsupported, "the CUDA backend needs caches whose head_dim stride is 1 (got {} and {})", cache.k_dim_stride(), cache.v_dim_stride());
        ensure!(num_tokens < i32::MAX as usize && cols.saturating_mul(cfg.block_size) < i32::MAX as usize, Unsupported, "batch too large for 32-bit positions");
        if num_tokens == 0 {
            return Ok(None);
        }
        ensure!(num_seqs >= 1, InvalidShape, "query has {num_tokens} tokens but the batch has no sequences");
        ensure!(cache.num_blocks >= 1, InvalidShape, "the caches hold no blocks");
        let max_pos = cols * cfg.block_size;
        let max_len = if a.max_seq_len > 0 { (a.max_seq_len as usize).min(max_pos) } else { max_pos };
        Ok(Some(Geometry { num_tokens, num_seqs, cols, max_pos, max_len }))
    }


    /// The split planner's tunables for a launch over `keys` keys per row: a plan shorter than the longest
    /// sequence may use shorter splits; one that covers it splits exactly as dense rows do, so a lossless
    /// plan is attended in dense's order (bit for bit in f32).
    fn split_policy(&self, mode: i32, keys: usize, max_len: usize) -> SplitPolicy {
        let mut p = self.policy;
        if mode == 1 && keys < max_len {
            p.min_chunk = p.min_chunk.min(PLAN_MIN_CHUNK);
        }
        p
    }

    /// Raises `f`'s dynamic shared-memory limit to `bytes`, once per function (every launch site of a
    /// function asks for the same limit).
    pub(crate) fn allow_smem_once(&self, f: super::driver::CUfunction, bytes: usize) -> Result<()> {
        let mut ready = self.smem_ready.lock();
        if !ready.contains(&(f as usize)) {
            launch::allow_dynamic_smem(f, bytes)?;
            ready.insert(f as usize);
        }
        Ok(())
    }

    /// The tensor-core kernel's shape for these caches (with a traversal hook: the hook's warps and
    /// stages), or None where the lane-group kernel runs.
    pub(crate) fn mma_for(&self, cfg: &EngineConfig, cache: &KvCache, hook: Option<&HookKernel>) -> Option<plan::MmaShape> {
        let es = cfg.dtype.size_bytes();
        let aligned = aligned16(cache, cache.dtype.size_bytes());
        let tun = match hook {
            Some(h) => plan::MmaTunables { warps: h.warps, stages: h.stages, ..self.mma },
            None => self.mma,
        };
        let kv_bytes = if cache.dtype.is_fp8() { 1 } else { 2 };
        plan::mma_shape(cfg.group_size(), cfg.head_dim, es, kv_bytes, aligned, &tun, (self.gpu.smem_optin as usize).saturating_sub(hook.map_or(1024, |h| h.smem_reserve)))
    }

    /// One attention launch (plus its split combine) over the rows `rows` selects.
    pub(crate) fn attend(&self, cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache, geo: &Geometry, rows: Rows) -> Result<()> {
        let num_tokens = geo.num_tokens;
        let es = cfg.dtype.size_bytes();
        let aligned = aligned16(cache, cache.dtype.size_bytes());
        let fp8 = cache.dtype.is_fp8();
        // Rows of query length != 1 go to the prefill kernel where it applies (src/cuda/prefill.rs): a
        // policy layer's dense rest entirely; in a call that may hold prefill rows, the decode kernel then
        // serves the decode rows only (mode 1 without a plan). A decode-only call is unchanged.
        // An FP8 cache: decode rows on the tensor-core decode kernel, prefill rows on the prefill kernel (which
        // widens its tiles in shared memory), as for 16-bit caches.
        let prefill = match rows {
            Rows::All if a.max_query_len != 1 => self.prefill_kernel(cfg, aligned),
            Rows::DenseRest => self.prefill_kernel(cfg, aligned),
            _ => None,
        };
        if let (Rows::DenseRest, Some(ps)) = (rows, prefill) {
            return self.attend_prefill(cfg, a, cache, geo, &ps);
        }
        let (mode, plan_ref, keys, trav) = match rows {
            Rows::All => (if prefill.is_some() { 1 } else { 0 }, PlanRef::none(), geo.max_len, None),
            Rows::DenseRest => (2, PlanRef::none(), geo.max_len, None),
            Rows::Plan(pr, keys, trav) => (1, pr, keys, trav),
            Rows::PlanLogits(pr, keys, _) => (1, pr, keys, None),
        };
        let logits = match rows {
            Rows::PlanLogits(_, _, lo) => Some(lo),
            _ => None,
        };
        let plan_define = format!("PLAN={}", matches!(rows, Rows::Plan(..) | Rows::PlanLogits(..)) as i32);
        // Kernel variant: tensor cores where they apply, else the lane-group kernel.
        let (f_split, defines, head_groups, threads, smem, nsplit, chunk);
        // A traversal hook needs the tensor-core kernel with the hook's warps (a round of them is its step)
        // and one CTA per KV head (GQ = GROUP).
        let hook = trav.as_ref().map(|t| &t.hook);
        let mma = self.mma_for(cfg, cache, hook);
        ensure!(!fp8 || mma.is_some(), Unsupported, "an FP8 cache needs the tensor-core kernel (16-byte aligned rows and strides, GQA group <= 16) on the CUDA engine");
        ensure!(logits.is_none() || mma.is_some(), Internal, "the logits of a plan's attention need the tensor-core kernel (checked by the caller)");
        if let Some(h) = hook {
            ensure!(
                matches!(mma, Some(ms) if ms.warps == h.warps && ms.gq == cfg.group_size()),
                Unsupported,
                "{} on the CUDA backend needs the tensor-core kernel (f16/bf16 or FP8 cache, 16-byte aligned rows, head size a multiple of 16, GQA group <= 16) with {} warps",
                h.name,
                h.warps
            );
        }
        // The module: the kernel, or the hook's file in front of it.
        let hooked = hook.map(HookKernel::module);
        let (mma_name, mma_src) = hooked.as_ref().map_or(("attention_mma", launch::ATTENTION_MMA), |(n, s)| (n.as_str(), &s[..]));
        if let Some(ms) = mma {
            let mut d = vec![
                format!("KVS_DTYPE={}", dtype_code(cfg.dtype)),
                format!("HEAD_DIM={}", cfg.head_dim),
                format!("GQ={}", ms.gq),
                format!("GROUP={}", cfg.group_size()),
                format!("NWARPS={}", ms.warps),
                format!("NSTAGE={}", ms.stages),
                format!("L2_HINT={}", ms.l2_hint),
                format!("ROW_SPLIT={}", self.mma.row_split as i32),
                plan_define,
                format!("LOGITS={}", logits.is_some() as i32),
                format!("KV8={}", kv8_code(cache.dtype)),
            ];
            // Measurements only: the hook's variant without its decision.
            if let Some(b) = trav.and_then(|t| t.hook.bench_define.filter(|_| t.bench)) {
                d.push(b.to_string());
            }
            d.push(self.checks_define.clone());
            defines = d;
            f_split = self.modules.function(&self.gpu, mma_name, mma_src, &defines, "kvs_attn_mma")?;
            smem = ms.smem_bytes(cfg.head_dim);
            threads = 32 * ms.warps as u32;
            self.allow_smem_once(f_split, smem)?;
            let per_sm = launch::occupancy_smem(f_split, threads, smem)? as usize;
            head_groups = cfg.num_q_heads / ms.gq;
            let waves = |max_splits: usize| {
                let mut pol = self.split_policy(mode, keys, geo.max_len);
                pol.max_splits = pol.max_splits.min(max_splits);
                plan::splits_waves(num_tokens * head_groups, keys, per_sm * self.gpu.num_sms as usize, ms.tile(), &pol)
            };
            (nsplit, chunk) = match trav.map(|t| t.splits) {
                Some(HookSplits::Fixed(n, c)) => (n, c),
                Some(HookSplits::Planned { smem_per_split }) => waves(smem / smem_per_split),
                // The logits' launch: at most the split statistics' slots per head (LogitsOut::nparts).
                None => waves(logits.map_or(usize::MAX, |lo| lo.nparts.max(1) as usize)),
            };
        } else {
            let shape = plan::kernel_shape(cfg.group_size(), cfg.head_dim, es, aligned);
            let mut d = Self::attn_defines(cfg, &shape);
            d.push(plan_define);
            d.push(self.checks_define.clone());
            defines = d;
            f_split = self.modules.function(&self.gpu, "attention", launch::ATTENTION, &defines, "kvs_attn_split")?;
            smem = 0;
            threads = NTHREADS;
            let per_sm = launch::occupancy(f_split, NTHREADS)? as usize;
            head_groups = cfg.num_q_heads / shape.gq;
            (nsplit, chunk) = plan::splits(num_tokens * head_groups, keys, per_sm * self.gpu.num_sms as usize, &shape, &self.split_policy(mode, keys, geo.max_len));
        }
        let module = if mma.is_some() { (mma_name, mma_src) } else { ("attention", launch::ATTENTION) };
        let stream = a.stream;

        let (mut ws_o, mut ws_lse) = (0u64, 0u64);
        let mut ws_guard = None;
        if nsplit > 1 {
            let slots = num_tokens * cfg.num_q_heads * nsplit;
            let need = slots * (cfg.head_dim + 1) * 4;
            let mut map = self.workspaces.lock();
            ws_o = super::workspace::for_stream(&mut map, &self.retired, &self.gpu, stream, need, "split-KV")?;
            ws_lse = ws_o + (slots * cfg.head_dim * 4) as u64;
            ws_guard = Some(map);
        }

        let (lse_ptr, l0, l1) = lse_arg(a);
        let mut k = batch_args(cfg, a, cache, geo);
        k.f32(a.scale).f32(a.softcap).i32(a.sliding_window).i32(chunk as i32);
        k.ptr(p(&a.out)).i64(a.out.stride(0) as i64).i64(a.out.stride(1) as i64).i64(a.out.stride(2) as i64);
        k.ptr(lse_ptr).i64(l0).i64(l1);
        k.i64(ws_o as i64).i64(ws_lse as i64).i32(cfg.num_q_heads as i32);
        // The device checks' record, and the layer's decode-row / prefill-token counters (CTR_DECODE_ROWS,
        // CTR_PREFILL_TOKENS) for a dense layer's launch (a policy layer's selection counts them).
        let bk = if matches!(rows, Rows::All) { self.sparse.layer_counters(a.layer) } else { 0 };
        k.i64(self.checks.record_ptr() as i64).i64(bk as i64);
        k.by_value(&plan_ref).i32(mode);
        if let Some(t) = &trav {
            k.struct_arg(&t.args);
        }
        if let (Some(lo), true) = (logits, mma.is_some()) {
            k.i64(lo.lg as i64).i32(lo.maxpos).i64(lo.parts as i64).i32(lo.nparts);
        }
        if fp8 {
            k.f32(cache.k_scale).f32(cache.v_scale);
        }
        // A policy layer's plan attention (and its combine) runs as a dependent launch of the selection
        // kernels before it, where the GPU has them: both attention kernels start with KVS_GRID_WAIT().
        // Dense layers keep plain launches: nothing measurable to gain there (one launch after the
        // previous step's), and the bandwidth-bound FP8 points ran ~0.5% slower with it (docs/perf.md).
        let pdl = !matches!(rows, Rows::All) && Device::pdl(self);
        launch::launch_dependent(pdl, f_split, (num_tokens as u32, head_groups as u32, nsplit as u32), threads, smem as u32, &mut k, stream, "kvs_attn_split launch")?;
        if nsplit > 1 {
            self.combine_splits(cfg, a, geo, &defines, (ws_o, ws_lse), nsplit, mode, module, pdl)?;
        }
        drop(ws_guard);
        if let Some(ps) = prefill {
            self.attend_prefill(cfg, a, cache, geo, &ps)?;
        }
        Ok(())
    }

    /// Merges the `nsplit` partial states of every row `mode` serves (kvs_attn_combine of `module`,
    /// compiled with `defines`) into the call's output and LSE.
    /// `pdl`: launch as a dependent of the attention kernel before it (kvs_attn_combine starts with
    /// KVS_GRID_WAIT()); the caller has checked the GPU has them (`Device::pdl`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn combine_splits(&self, cfg: &EngineConfig, a: &ForwardArgs, geo: &Geometry, defines: &[String], ws: (u64, u64), nsplit: usize, mode: i32, module: (&str, &[&KernelFile]), pdl: bool) -> Result<()> {
        let (lse_ptr, l0, l1) = lse_arg(a);
        let f_comb = self.modules.function(&self.gpu, module.0, module.1, defines, "kvs_attn_combine")?;
        let mut k = KArgs::new();
        k.i64(ws.0 as i64).i64(ws.1 as i64).i32(nsplit as i32).i32(cfg.num_q_heads as i32);
        k.ptr(p(&a.out)).i64(a.out.stride(0) as i64).i64(a.out.stride(1) as i64).i64(a.out.stride(2) as i64);
        k.ptr(lse_ptr).i64(l0).i64(l1);
        k.ptr(p(&a.query_start_loc)).i64(a.query_start_loc.stride(0) as i64).i32(geo.num_seqs as i32).i32(mode);
        // Splits spread over the CTA: HEAD_DIM threads per group of splits, up to 512 threads.
        let parts = (512 / cfg.head_dim).clamp(1, nsplit);
        let threads = (cfg.head_dim * parts) as u32;
        launch::launch_dependent(pdl, f_comb, (geo.num_tokens as u32, cfg.num_q_heads as u32, 1), threads, 0, &mut k, a.stream, "kvs_attn_combine launch")
    }

    /// Cache write by slot mapping on the device (validated shapes; every slot is checked on the device
    /// before any is written, see `checks`). A call of few tokens (a decode step) is one launch
    /// (`write_step`); a longer one checks, stores and keeps the metadata in launches of their own.
    pub fn cache_write(&self, cfg: &EngineConfig, a: &CacheWriteArgs, cache: &KvCache, n: usize) -> Result<()> {
        ensure!(a.slot_mapping.strides()[0] >= 0, InvalidShape, "slot_mapping has a negative stride");
        if n == 0 {
            return Ok(());
        }
        self.gpu.make_current()?;
        if self.validate_sync {
            super::checks::refuse_sync_in_capture(&self.gpu, a.stream)?;
        }
        let slots = if n <= WRITE_STEP_MAX_TOKENS { self.write_step(cfg, a, cache, n)? } else { self.write_rows(cfg, a, cache, n)? };
        if let Some(pd) = &self.policy_dev {
            pd.on_cache_write(self, cfg, a.layer, cache, &slots, n, a.stream)?;
        }
        self.sync_checks(a.stream)
    }

    /// The general cache write: `kvs_slots_check`, `kvs_cache_write`, then the key metadata's launches;
    /// returns the checked slots.
    fn write_rows(&self, cfg: &EngineConfig, a: &CacheWriteArgs, cache: &KvCache, n: usize) -> Result<TensorRef> {
        let total = n * cfg.num_kv_heads * cfg.head_dim;
        let defines = vec![format!("KVS_DTYPE={}", dtype_code(cfg.dtype)), format!("KV8={}", kv8_code(cache.dtype))];
        // Every slot is checked on the device before any is written: the kernels below read the checked
        // copy, all -1 (skip) when any slot is out of range.
        let capacity = cache.num_blocks * cfg.block_size;
        let slots = self.checks.check_slots(&self.gpu, &self.modules, &defines, a.layer, &a.slot_mapping, n, capacity, a.stream)?;
        let f = self.modules.function(&self.gpu, "cache_write", launch::CACHE_WRITE, &defines, "kvs_cache_write")?;
        let mut k = KArgs::new();
        k.ptr(p(&a.key)).i64(a.key.stride(0) as i64).i64(a.key.stride(1) as i64).i64(a.key.stride(2) as i64);
        k.ptr(p(&a.value)).i64(a.value.stride(0) as i64).i64(a.value.stride(1) as i64).i64(a.value.stride(2) as i64);
        for t in [&cache.k, &cache.v] {
            k.ptr(p(t));
            for i in 0..4 {
                k.i64(t.stride(i) as i64);
            }
        }
        k.ptr(p(&slots)).i64(1).i32(1);
        k.i32(n as i32).i32(cfg.num_kv_heads as i32).i32(cfg.head_dim as i32).i64(cache.num_blocks as i64).i32(cfg.block_size as i32);
        if cache.dtype.is_fp8() {
            k.f32(cache.k_scale).f32(cache.v_scale);
        }
        let grid = total.div_ceil(256).min(65536 * 4) as u32;
        launch::launch(f, (grid, 1, 1), 256, &mut k, a.stream, "kvs_cache_write launch")?;
        self.meta.update(&self.gpu, &self.modules, a.layer, cache, &slots, n, a.stream)?;
        Ok(slots)
    }

    /// Merge of two partial states on the device (shapes validated by the engine).
    pub fn merge(&self, a: &MergeArgs) -> Result<()> {
        let (t, h, d) = (a.out.dim(0), a.out.dim(1), a.out.dim(2));
        let total = t * h * d;
        if total == 0 {
            return Ok(());
        }
        self.gpu.make_current()?;
        let func = match a.out.dtype {
            DType::F32 => "kvs_merge_f32",
            DType::F16 => "kvs_merge_f16",
            _ => "kvs_merge_bf16",
        };
        let f = self.modules.function(&self.gpu, "merge", launch::MERGE, &[], func)?;
        let mut k = KArgs::new();
        for (o, l) in [(&a.out_a, Some(&a.lse_a)), (&a.out_b, Some(&a.lse_b)), (&a.out, a.lse_out.as_ref())] {
            k.ptr(p(o)).i64(o.stride(0) as i64).i64(o.stride(1) as i64).i64(o.stride(2) as i64);
            match l {
                Some(l) => k.ptr(p(l)).i64(l.stride(0) as i64).i64(l.stride(1) as i64),
                None => k.ptr(std::ptr::null::<u8>()).i64(0).i64(0),
            };
        }
        k.i32(t as i32).i32(h as i32).i32(d as i32);
        let grid = total.div_ceil(256).min(65536 * 4) as u32;
        launch::launch(f, (grid, 1, 1), 256, &mut k, a.stream, "kvs_merge launch")
    }

    /// Fills `n` elements of `dtype` at `ptr` with pseudo-random values in [-amp/2, amp/2) (benchmarks).
    pub fn fill_random(&self, ptr: u64, n: usize, dtype: DType, seed: u32, amp: f32, stream: super::driver::CUstream) -> Result<()> {
        self.gpu.make_current()?;
        let defines = vec![format!("KVS_DTYPE={}", dtype_code(dtype))];
        let f = self.modules.function(&self.gpu, "fill", launch::FILL, &defines, "kvs_fill_random")?;
        let mut k = KArgs::new();
        k.i64(ptr as i64).i64(n as i64).i32(seed as i32).f32(amp);
        launch::launch(f, (((n.div_ceil(256)).min(1 << 16)) as u32, 1, 1), 256, &mut k, stream, "kvs_fill_random launch")
    }
}

impl CudaBackend {
    /// Gives the engine's policy its device state (made by the policy registry, `Policy::cuda_device`).
    pub(crate) fn set_policy_device(&mut self, d: Option<Box<dyn PolicyDevice>>) {
        self.policy_dev = d;
    }

    pub(crate) fn policy_device(&self) -> Option<&dyn PolicyDevice> {
        self.policy_dev.as_deref()
    }

    /// The policy's device state as its own type (benchmarks' hooks: PRR's timeline, the predictor's probe).
    pub fn policy_state(&self) -> Option<&dyn std::any::Any> {
        self.policy_dev.as_deref().map(|d| d.as_any())
    }

    /// Benchmarks only: run just the selection (`attend = false`) or just the attention over the plans the
    /// previous call left (`select = false`) of later policy calls, to time the phases apart.
    pub fn set_bench_phases(&self, select: bool, attend: bool) {
        self.sparse.set_phases(select, attend)
    }

    /// The device counters of every layer since the engine started (synchronizes the device).
    pub fn device_counters(&self) -> Result<Vec<Counters>> {
        self.sparse.device_counters(&self.gpu, self.policy_device())
    }

    /// What the last policy call's decode rows visited, from its plans (synchronizes; evaluation only).
    /// `a` must be that call's arguments.
    pub fn visit_records(&self, cfg: &EngineConfig, a: &ForwardArgs) -> Result<Vec<VisitRecord>> {
        self.sparse.visit_records(&self.gpu, cfg, a)
    }
}

impl Device for CudaBackend {
    fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    fn modules(&self) -> &Modules {
        &self.modules
    }

    fn meta(&self) -> &DeviceMeta {
        &self.meta
    }

    fn slots(&self) -> Option<&SeqSlots> {
        self.slots.as_ref()
    }

    fn retired(&self) -> &Mutex<Vec<DevBuf>> {
        &self.retired
    }

    fn allow_smem_once(&self, f: super::driver::CUfunction, bytes: usize) -> Result<()> {
        CudaBackend::allow_smem_once(self, f, bytes)
    }

    fn attend(&self, cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache, geo: &Geometry, rows: Rows) -> Result<()> {
        CudaBackend::attend(self, cfg, a, cache, geo, rows)
    }

    fn tensor_cores(&self, cfg: &EngineConfig, cache: &KvCache) -> bool {
        self.mma_for(cfg, cache, None).is_some()
    }

    fn layer_counters(&self, layer: usize) -> u64 {
        self.sparse.layer_counters(layer)
    }

    fn set_last_plan(&self, plan: PlanRef, num_seqs: usize) {
        self.sparse.set_last_plan(plan, num_seqs)
    }
}

/// Whether the K/V caches' rows and strides are 16-byte aligned (the tensor-core kernel's 16-byte copies).
fn aligned16(cache: &KvCache, es: usize) -> bool {
    let vec = 16 / es;
    [&cache.k, &cache.v].iter().all(|t| (t.data as usize) % 16 == 0 && t.strides()[..3].iter().all(|&s| s as usize % vec == 0))
}
