//! Sparse decode on the CUDA backend: a policy layer's call runs its pipeline's stages (`selector [> top_p]
//! [> art]`, each a [`CudaStage`] of src/policy/<name>/cuda.rs, made per call by the registry), which write
//! each decode row's visit plan (src/policy/plan.rs) into a per-stream device workspace, then the attention
//! kernel's PLAN variant over those plans, and the dense kernel over the call's other rows (prefill).
//! Everything is enqueued on the caller's stream with grids fixed by host-known bounds (block-table shape,
//! budgets), so a decode step is capturable in a CUDA graph: no host sync, no allocation once the
//! workspace has grown to the step's size, no host-side decision.
//!
//! Counters are accumulated on the device per layer and read (with a sync) by `kvs_engine_stats`; visit
//! records (evaluation only) download the last call's plans.
//!
//! Which pipelines run on the GPU is the policies' to say (`Pipeline::cuda_supported`). The plans and
//! their decisions equal the CPU engine's for the same inputs (crates/conformance/tests/cuda_sparse.rs).

use std::collections::HashMap;

use parking_lot::Mutex;

use super::batch::{dtype_code, download_ints, download_raw, BatchArg, Geometry, PlanRef, Rows};
use super::context::{DevBuf, Gpu};
use super::stage::{CallShape, CudaPipeline, CudaStage, Device, PlanShape, PolicyDevice, RowVisits, StepCx, WsAlloc};
use crate::config::EngineConfig;
use crate::args::ForwardArgs;
use crate::error::Result;
use crate::layout::KvCache;
use crate::policy::plan::{device_plan_shapes, HeadPlan};
use crate::stats::{Counters, StageCounter, VisitRecord};
use crate::{bail, ensure};

/// The compile-time defines of the selection module (`CudaPipeline::select_module`) for an engine: every launcher of its
/// kernels (the pipeline here, PRR's own kernels) passes these, so they share one compiled module. KV8: the
/// selection kernels that read cache rows read an FP8 cache's bytes (kernels/include/kv_load.cuh).
pub(crate) fn select_defines(cfg: &EngineConfig) -> Vec<String> {
    vec![
        format!("KVS_DTYPE={}", dtype_code(cfg.dtype)),
        format!("HEAD_DIM={}", cfg.head_dim),
        format!("GROUP={}", cfg.group_size()),
        format!("KV8={}", super::batch::kv8_code(cfg.cache_dtype)),
        "--fmad=false".to_string(),
    ]
}

/// Counter slots on the device (kernels/include/decide.cuh CTR_*).
const CTR_COUNT: usize = crate::stats::DEVICE_COUNTER_SLOTS;

/// Largest GQA group the selection kernels stage in shared memory.
pub const MAX_POLICY_GROUP: usize = 16;

/// Whether the CUDA backend runs pipeline `p` (the engine refuses the others at creation).
pub(crate) fn supported(p: &dyn CudaPipeline, group: usize) -> std::result::Result<(), String> {
    p.cuda_supported(group, MAX_POLICY_GROUP)
}

/// Policy state of a CUDA engine: per-layer counters, per-stream workspaces, the last call's plans.
pub struct SparseState {
    counters: DevBuf,
    num_layers: usize,
    /// The stages' own counters, to read those with a device slot (the policy registry's table).
    stage_counters: &'static [&'static [StageCounter]],
    ws: Mutex<HashMap<usize, DevBuf>>,
    last: Mutex<Option<LastPlan>>,
    /// Benchmarks only: which phases a policy call runs (bit 0 selection, bit 1 attention).
    phases: std::sync::atomic::AtomicU8,
}

/// Where the last policy call left its plans (read back only for visit records).
struct LastPlan {
    plan: PlanRef,
    num_seqs: usize,
    /// What the rows visited of their plans, when a stage cut the visits short (ART).
    visits: Option<Box<dyn RowVisits>>,
}

impl SparseState {
    pub fn new(num_layers: usize, stage_counters: &'static [&'static [StageCounter]]) -> Result<Self> {
        let bytes = num_layers.checked_mul(CTR_COUNT * 8).ok_or_else(|| crate::error::Error::new(crate::error::ErrorKind::OutOfMemory, "counter size overflows"))?;
        let counters = DevBuf::alloc(bytes)?;
        counters.upload(0, &vec![0u8; bytes])?;
        Ok(SparseState { counters, num_layers, stage_counters, ws: Mutex::new(HashMap::new()), last: Mutex::new(None), phases: std::sync::atomic::AtomicU8::new(3) })
    }

    /// The device address of `layer`'s counters.
    pub(crate) fn layer_counters(&self, layer: usize) -> u64 {
        self.counters.ptr + (layer * CTR_COUNT * 8) as u64
    }
}

/// A call's workspace: the final plans and their lengths, the attention's tile counts, then the stages'
/// own regions (the later stages', last first; the per-sequence slots; the selector's), each 256-byte
/// aligned.
pub(crate) struct CallLayout {
    pub plan: usize,
    pub plan_len: usize,
    pub tiles: usize,
    pub nsplit: usize,
    pub slot: usize,
    pub slot_gen: usize,
    pub ws: WsAlloc,
}

/// Lays out a call's workspace: `stages` (selector first) reserve their regions; `slots`: the engine
/// keeps per-sequence state slots.
pub(crate) fn lay_out(stages: &mut [Box<dyn CudaStage + '_>], cx: &CallShape, slots: bool) -> Result<CallLayout> {
    let (ns, hk) = (cx.geo.num_seqs, cx.cfg.num_kv_heads);
    let mut ws = WsAlloc::default();
    let plan = ws.take_n(&[cx.rows_of(&cx.fin), cx.fin.cap, 4])?;
    let plan_len = ws.take_n(&[ns, hk, 4])?;
    // Tiles visited per (seq, head, split), written by a stage that terminates rows in the kernel.
    let nsplit = stages.iter().map(|s| s.splits(cx)).try_fold(1usize, |a, n| n.map(|n| a.max(n)))?;
    let tiles = ws.take_n(&[ns, hk, nsplit, 4])?;
    let (selector, later) = stages.split_first_mut().expect("a pipeline has a selector");
    // The last stage's regions first (ART's, then top-p's), as the workspace always had them.
    for s in later.iter_mut().rev() {
        s.reserve(cx, &mut ws)?;
    }
    let (mut slot, mut slot_gen) = (0, 0);
    if slots {
        slot = ws.take_n(&[ns, 4])?;
        slot_gen = ws.take_n(&[ns, 4])?;
    }
    selector.reserve(cx, &mut ws)?;
    Ok(CallLayout { plan, plan_len, tiles, nsplit, slot, slot_gen, ws })
}

impl SparseState {
    /// A policy layer's call on `dev`: selection, then attention over the plans (and dense over the other
    /// rows). `policy_dev`: the policy's device state.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(&self, dev: &dyn Device, policy_dev: Option<&dyn PolicyDevice>, cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache, geo: &Geometry, p: &dyn CudaPipeline) -> Result<()> {
        let mut stages = p.cuda_stages(policy_dev);
        if let Some(r) = stages[0].forward(dev, cfg, a, cache, geo) {
            return r;
        }
        let (hk, bs, d) = (cfg.num_kv_heads, cfg.block_size, cfg.head_dim);
        ensure!(geo.num_seqs < 65536, Unsupported, "policies on the CUDA backend take at most 65535 sequences per call (got {})", geo.num_seqs);
        let stream = a.stream;
        let [base, fin] = device_plan_shapes(p, bs, geo.max_pos).map(|(cap, ulog2, shared)| PlanShape { cap, ulog2, shared });
        let ns = geo.num_seqs;
        let shape = CallShape { cfg, max_query_len: a.max_query_len, geo, base, fin, smem_optin: dev.gpu().smem_optin as usize, tensor_cores: dev.tensor_cores(cfg, cache) };
        let lay = lay_out(&mut stages, &shape, dev.slots().is_some())?;
        let maxc = shape.candidates();
        ensure!(fin.cap < i32::MAX as usize && maxc < i32::MAX as usize, Unsupported, "policy plan too large for 32-bit indices");

        let meta_guard = dev.meta().layer(a.layer);
        let needs = dev.meta().needs;
        let meta = match meta_guard.as_ref() {
            Some(m) => {
                ensure!(m.num_blocks == cache.num_blocks, InvalidShape, "layer {}'s key metadata was built for {} blocks, the caches have {}", a.layer, m.num_blocks, cache.num_blocks);
                Some(m)
            }
            None if needs.any() => bail!(InvalidArgument, "policy {:?} needs key metadata for layer {}, but no cache write for that layer went through kvs_cache_write", cfg.policy, a.layer),
            None => None,
        };

        let mut ws_map = self.ws.lock();
        let ws = super::workspace::for_stream(&mut ws_map, dev.retired(), dev.gpu(), stream, lay.ws.total(), "policy")?;
        if let Some(slots) = dev.slots() {
            let Some(ids) = a.seq_ids.as_ref() else {
                bail!(InvalidArgument, "policy {:?} keeps per-sequence state: forward calls must pass seq_ids", cfg.policy);
            };
            slots.lookup(dev.gpu(), dev.modules(), ids, ns, ws + lay.slot as u64, ws + lay.slot_gen as u64, stream, dev.pdl())?;
        }

        let defines = select_defines(cfg);
        let plan_at = |region: usize, sh: &PlanShape, len_region: usize| PlanRef {
            e: ws + region as u64,
            p_s: if sh.shared { sh.cap as i64 } else { (hk * sh.cap) as i64 },
            p_h: if sh.shared { 0 } else { sh.cap as i64 },
            len: ws + len_region as u64,
            ulog2: sh.ulog2 as i32,
            hk: hk as i32,
            cap: sh.cap as i32,
            pad: 0,
        };
        let fin_ref = plan_at(lay.plan, &fin, lay.plan_len);
        // A later stage that writes the final plans from the selector's puts those in its own regions.
        let base_plan = stages.iter().find_map(|s| s.base_plan());
        let base_ref = match base_plan {
            Some((e, len)) => plan_at(e, &base, len),
            None => fin_ref,
        };
        let phases = self.phases.load(std::sync::atomic::Ordering::Relaxed);
        let (do_select, do_attend) = (phases & 1 != 0, phases & 2 != 0);
        let cx = StepCx {
            dev,
            cfg,
            a,
            cache,
            geo,
            batch: BatchArg::new(a, geo, cache),
            ws,
            module: p.select_module(),
            defines: &defines,
            ctr: self.layer_counters(a.layer) as i64,
            row_bytes: (2 * d * cfg.cache_dtype.size_bytes()) as i64,
            meta: None,
            base: base_ref,
            fin: fin_ref,
            count_base: base_plan.is_none() as i32,
            slot: if dev.slots().is_some() { ws + lay.slot as u64 } else { 0 },
            slot_gen: if dev.slots().is_some() { ws + lay.slot_gen as u64 } else { 0 },
            tiles: ws + lay.tiles as u64,
            nsplit: lay.nsplit,
            select: do_select,
            scores: stages[0].page_scores(ws),
        };
        if do_select {
            // The selection reads the layer's key metadata, locked until its launches are enqueued.
            let scx = StepCx { meta, ..cx };
            for s in &stages {
                s.select(&scx)?;
            }
        }
        drop(meta_guard);

        if do_attend {
            if a.max_query_len != 1 {
                dev.attend(cfg, a, cache, geo, Rows::DenseRest)?;
            }
            // Key bound of the split planner: a plan that covers every position gets dense's bound and
            // splits (attended in dense's order, bit for bit); a plan reaching past max_len (a partial last
            // page) is still covered, by the last split, which runs to the plan's end.
            let keys = (fin.cap << fin.ulog2).min(geo.max_len);
            let rows = stages.iter().find_map(|s| s.rows(&cx, keys)).unwrap_or(Rows::Plan(fin_ref, keys, None));
            let keys = match rows {
                Rows::Plan(_, k, _) | Rows::PlanLogits(_, k, _) => k,
                _ => keys,
            };
            dev.attend(cfg, a, cache, geo, rows)?;
            for s in &stages {
                s.after_attention(&cx, keys)?;
            }
        }
        // The workspace stays locked until the launches that read it are enqueued.
        drop(ws_map);
        let visits = stages.iter().find_map(|s| s.visits(&cx));
        *self.last.lock() = Some(LastPlan { plan: fin_ref, num_seqs: ns, visits });
        Ok(())
    }

    /// Records where a policy call left its final plans (for visit records).
    pub(crate) fn set_last_plan(&self, plan: PlanRef, num_seqs: usize) {
        *self.last.lock() = Some(LastPlan { plan, num_seqs, visits: None });
    }

    /// Benchmarks only: run just the selection (`attend = false`) or just the attention over the plans the
    /// previous call left (`select = false`) of later policy calls, to time the phases apart.
    pub(crate) fn set_phases(&self, select: bool, attend: bool) {
        self.phases.store(select as u8 | (attend as u8) << 1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The device counters of every layer since the engine started, with those the policy's device state
    /// keeps (synchronizes the device).
    pub(crate) fn device_counters(&self, gpu: &Gpu, policy_dev: Option<&dyn PolicyDevice>) -> Result<Vec<Counters>> {
        gpu.synchronize()?;
        let n = self.num_layers * CTR_COUNT;
        let mut raw = vec![0u8; n * 8];
        self.counters.download(0, &mut raw)?;
        let v: Vec<u64> = raw.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        let mut per_layer: Vec<Counters> = v
            .chunks_exact(CTR_COUNT)
            .map(|slots| Counters::from_device_slots(slots, self.stage_counters))
            .collect();
        if let Some(pd) = policy_dev {
            pd.add_counters(gpu, &mut per_layer)?;
        }
        Ok(per_layer)
    }

    /// What the last policy call's decode rows visited, from its plans (synchronizes; evaluation only).
    /// `a` must be that call's arguments.
    pub(crate) fn visit_records(&self, gpu: &Gpu, cfg: &EngineConfig, a: &ForwardArgs) -> Result<Vec<VisitRecord>> {
        let mut guard = self.last.lock();
        let Some(last) = guard.as_mut() else { return Ok(Vec::new()) };
        gpu.synchronize()?;
        let ns = last.num_seqs;
        let hk = cfg.num_kv_heads;
        let qsl = download_ints(&a.query_start_loc, ns + 1)?;
        let lens = download_ints(&a.seq_lens, ns)?;
        let ids = match &a.seq_ids {
            Some(t) => download_ints(t, ns)?,
            None => vec![0; ns],
        };
        let pr = last.plan;
        let ints = |ptr: u64| -> Result<Vec<i32>> {
            let mut raw = vec![0u8; ns * hk * 4];
            download_raw(ptr, &mut raw)?;
            Ok(raw.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4"))).collect())
        };
        let plan_len = ints(pr.len as u64)?;
        let max_pos = a.block_table.dim(1) * cfg.block_size;
        let mut out = Vec::new();
        let mut entries = vec![0u8; pr.cap as usize * 4];
        let mut spans = Vec::new();
        for s in 0..ns {
            if qsl[s + 1] - qsl[s] != 1 {
                continue;
            }
            let len = (lens[s].max(0) as usize).min(max_pos);
            if len == 0 {
                continue;
            }
            let hi = len - 1;
            let lo = if a.sliding_window > 0 { len.saturating_sub(a.sliding_window as usize) } else { 0 };
            for h in 0..hk {
                let n = plan_len[s * hk + h].clamp(0, pr.cap) as usize;
                download_raw(pr.e + ((s as i64 * pr.p_s + h as i64 * pr.p_h) * 4) as u64, &mut entries[..n * 4])?;
                let plan = HeadPlan { unit_log2: pr.ulog2 as u32, entries: entries[..n * 4].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4"))).collect() };
                let tiles_rec = match last.visits.as_mut() {
                    Some(v) => Some(v.spans(s, h, &plan.entries, plan.unit_log2, lo, hi, &mut spans)?),
                    None => {
                        plan.spans(lo, hi, &mut spans);
                        None
                    }
                };
                out.push(VisitRecord { layer: a.layer, seq_id: ids[s] as u64, kv_head: h, spans: spans.clone(), traversal_tiles: tiles_rec });
            }
        }
        Ok(out)
    }
}
