//! Sparse decode on the CUDA backend: a policy layer's call runs the selection kernels
//! (kernels/select.cu), which write each decode row's visit plan (src/policy/plan.rs) into a per-stream
//! device workspace, then the attention kernel's PLAN variant over those plans, and the dense kernel over
//! the call's other rows (prefill). Everything is enqueued on the caller's stream with grids fixed by
//! host-known bounds (block-table shape, budgets), so a decode step is capturable in a CUDA graph: no
//! host sync, no allocation once the workspace has grown to the step's size, no host-side decision.
//!
//! Counters are accumulated on the device per layer and read (with a sync) by `kvs_engine_stats`; visit
//! records (evaluation only) download the last call's plans.
//!
//! On the GPU today: `all`, `streaming`, `quest`, `snapkv` (any of them alone or followed by `top_p`), and
//! `art` behind `all`/`streaming`. The plans and their decisions equal the CPU engine's for the same inputs
//! (crates/conformance/tests/cuda_sparse.rs). SnapKV's choice lives with the cache blocks (kernels/snapkv.cu).

use std::collections::HashMap;

use parking_lot::Mutex;

use super::backend::{dtype_code, CudaBackend, Geometry, Rows};
use super::context::DevBuf;
use super::driver::{check, cuda};
use super::launch::{self, KArgs};
use crate::config::EngineConfig;
use crate::args::ForwardArgs;
use crate::error::Result;
use crate::layout::KvCache;
use crate::policy::plan::{plan_capacity, plan_unit_log2, selector_capacity, selector_unit_log2, HeadPlan};
use crate::policy::{Pipeline, Selector};
use crate::stats::{Counters, VisitRecord};
use crate::tensor::{DType, TensorRef};
use crate::{bail, ensure};

/// A plan as the attention kernel reads it (kernels/include/params.cuh `PlanRef`; a test compares the layouts).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanRef {
    pub e: u64,
    pub p_s: i64,
    pub p_h: i64,
    pub len: u64,
    pub ulog2: i32,
    pub hk: i32,
    pub cap: i32,
    pub pad: i32,
}

impl PlanRef {
    pub fn none() -> Self {
        PlanRef::default()
    }
}

/// The batch as the selection kernels read it (kernels/include/params.cuh `Batch`; a test compares the layouts).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchArg {
    bt: u64,
    bt0: i64,
    bt1: i64,
    bt_cols: i32,
    bs_log2: i32,
    num_blocks: i64,
    seq_lens: u64,
    sl0: i64,
    qsl: u64,
    qsl0: i64,
    num_seqs: i32,
    num_tokens: i32,
    window: i32,
    pad: i32,
}

impl BatchArg {
    /// The call's batch as the selection kernels read it.
    pub(crate) fn new(a: &ForwardArgs, geo: &Geometry, cache: &KvCache) -> Self {
        BatchArg {
            bt: a.block_table.data as u64,
            bt0: a.block_table.stride(0) as i64,
            bt1: a.block_table.stride(1) as i64,
            bt_cols: geo.cols as i32,
            bs_log2: cache.block_size.trailing_zeros() as i32,
            num_blocks: cache.num_blocks as i64,
            seq_lens: a.seq_lens.data as u64,
            sl0: a.seq_lens.stride(0) as i64,
            qsl: a.query_start_loc.data as u64,
            qsl0: a.query_start_loc.stride(0) as i64,
            num_seqs: geo.num_seqs as i32,
            num_tokens: geo.num_tokens as i32,
            window: a.sliding_window,
            pad: 0,
        }
    }
}

/// Counter slots on the device (kernels/include/decide.cuh CTR_*).
const CTR_COUNT: usize = 16;
/// Bins of Quest's per-row key histogram: kernels/select.cu QSEL_BINS.
const QSEL_BINS: usize = 2048;
/// Static shared memory of kvs_quest_topk and a margin (its gathered bin is 16 KiB), kept out of the
/// dynamic shared memory its page keys may take.
const TOPK_STATIC_SMEM: usize = 24 << 10;

/// ART's parameters as the tensor-core kernel reads them (kernels/include/params.cuh `ArtArgs`; a test compares the layouts).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ArtLaunch {
    pub tau: f32,
    pub phi: f32,
    /// -1 = never stop (`patience=inf`).
    pub patience: i32,
    pub sink_limit: i32,
    pub ctr: u64,
    pub tiles_out: u64,
    pub hk: i32,
    /// Keys per segment (`art(segment=...)`), 0 = one segment.
    pub segment: i32,
    /// Priority order (behind Quest): the plan's entries in visiting order and the inverse permutation,
    /// written by `kvs_art_priority`; 0 = recency order.
    pub order: u64,
    pub inv: u64,
}

/// The layouts a test compares with kernels/include/params.cuh.
#[cfg(test)]
pub(crate) fn c_layouts() -> Vec<super::kernel_src::CLayout> {
    use super::kernel_src::c_layout;
    vec![
        c_layout!(BatchArg as "Batch" { bt, bt0, bt1, bt_cols, bs_log2, num_blocks, seq_lens, sl0, qsl, qsl0, num_seqs, num_tokens, window, pad }),
        c_layout!(PlanRef as "PlanRef" { e, p_s, p_h, len, ulog2, hk, cap, pad }),
        c_layout!(ArtLaunch as "ArtArgs" { tau, phi, patience, sink_limit, ctr, tiles_out, hk, segment, order, inv }),
    ]
}

/// Largest GQA group the selection kernels stage in shared memory.
pub const MAX_POLICY_GROUP: usize = 16;

/// Whether the CUDA backend runs pipeline `p` (the engine refuses the others at creation).
pub fn supported(p: &Pipeline, group: usize) -> std::result::Result<(), String> {
    if let Some(a) = p.art {
        // In the kernel: recency order over `all` / `streaming` / `quest` plans, and Quest's priority order
        // (its page scores sorted on the device, kvs_art_priority), the paper's probe. Priority by SnapKV's
        // pooled scores or top-p's estimated mass is not built (those scores are not kept on the device).
        if !matches!(p.selector, Selector::All | Selector::Streaming { .. } | Selector::Quest { .. }) || p.top_p.is_some() {
            return Err("`art` on the CUDA backend runs behind `all`, `streaming` or `quest` only (ART behind `snapkv` or `top_p` needs their scores on the device, not built yet)".into());
        }
        if a.probe != crate::policy::Probe::Lanes {
            return Err("`art` on the CUDA backend supports probe=lanes only".into());
        }
        if a.order == crate::policy::Order::Priority && !matches!(p.selector, Selector::Quest { .. }) {
            return Err("`art(order=priority)` on the CUDA backend needs a scored selector (quest)".into());
        }
    }
    if group > MAX_POLICY_GROUP {
        return Err(format!("policies on the CUDA backend support GQA groups of at most {MAX_POLICY_GROUP} query heads per KV head (this model has {group})"));
    }
    match p.selector {
        Selector::All | Selector::Streaming { .. } | Selector::Quest { .. } | Selector::SnapKv { .. } | Selector::Refresh(_) | Selector::Predictor(_) => Ok(()),
        Selector::Speculate(s) => crate::policy::speculate::cuda::supported(&s),
    }
}

/// The positions below which ART's order puts a plan's entries first (the selector's sinks, as the CPU's
/// `prepare_head`): `streaming.sink`, else position 0.
fn art_sink_limit(p: &Pipeline) -> i32 {
    match p.selector {
        Selector::Streaming { sink, .. } | Selector::Quest { sink, .. } => sink.clamp(1, i32::MAX as usize) as i32,
        _ => 1,
    }
}

/// Policy state of a CUDA engine: per-layer counters, per-stream workspaces, the last call's plans.
pub struct SparseState {
    counters: DevBuf,
    num_layers: usize,
    ws: Mutex<HashMap<usize, DevBuf>>,
    last: Mutex<Option<LastPlan>>,
    /// Benchmarks only: which phases a policy call runs (bit 0 selection, bit 1 attention).
    phases: std::sync::atomic::AtomicU8,
}

/// Where the last policy call left its plans (read back only for visit records).
#[derive(Clone, Copy, Debug)]
struct LastPlan {
    plan: PlanRef,
    num_seqs: usize,
    /// ART: the per-(sequence, KV head, split) tiles visited, the sink limit of the order, the splits
    /// and the segment (keys per split).
    art: Option<(u64, usize, usize, Option<u32>)>,
    /// ART's priority order (entries in visiting order, the plan's layout), 0 = recency.
    art_order: u64,
}

impl SparseState {
    pub fn new(num_layers: usize) -> Result<Self> {
        let bytes = num_layers.checked_mul(CTR_COUNT * 8).ok_or_else(|| crate::error::Error::new(crate::error::ErrorKind::OutOfMemory, "counter size overflows"))?;
        let counters = DevBuf::alloc(bytes)?;
        counters.upload(0, &vec![0u8; bytes])?;
        Ok(SparseState { counters, num_layers, ws: Mutex::new(HashMap::new()), last: Mutex::new(None), phases: std::sync::atomic::AtomicU8::new(3) })
    }

    fn layer_counters(&self, layer: usize) -> u64 {
        self.counters.ptr + (layer * CTR_COUNT * 8) as u64
    }
}

/// Byte offsets of one call's regions in its stream's workspace.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct WsLayout {
    plan: usize,
    plan_len: usize,
    base: usize,
    base_len: usize,
    scores: usize,
    /// Quest's per-row histograms of the page keys' top bits (kvs_quest_scores_hist, kvs_quest_topk),
    /// `[seqs * kv_heads][QSEL_BINS]` u32, left zeroed by each selection (a histogram that does not match
    /// the keys, e.g. the region's first use or another call's data, only costs the slow path).
    qhist: usize,
    art_tiles: usize,
    /// ART's priority order (behind Quest): the ordered entries and their inverse, in the plan's layout.
    art_order: usize,
    art_inv: usize,
    logits: usize,
    w: usize,
    /// SnapKV's choice (calls that may hold a prefill chunk): per (seq, head) rows' max keys, fixed-point
    /// normalisers, NaN flags, and the aggregated and pooled scores per position.
    pub(crate) snap_rmax: usize,
    pub(crate) snap_z: usize,
    pub(crate) snap_bad: usize,
    pub(crate) snap_agg: usize,
    pub(crate) snap_pool: usize,
    /// Per-sequence state slot (i32, -1 = none) and its generation (u32) of each sequence of the call,
    /// written by the slot lookup (src/cuda/slots.rs) when the policy keeps per-sequence state.
    pub(crate) slot: usize,
    pub(crate) slot_gen: usize,
    /// RefreshKV's regions (src/cuda/refresh.rs).
    pub(crate) refresh: crate::policy::refresh::cuda::RefreshWs,
    /// AttentionPredictor (src/cuda/predictor.rs): mode per (seq, head), predicted block scores per
    /// (seq, head, block), and the history rows' maxima, fixed-point normalisers and NaN flags per query row.
    pub(crate) pred_mode: usize,
    pub(crate) pred_scores: usize,
    pub(crate) pred_rmax: usize,
    pub(crate) pred_z: usize,
    pub(crate) pred_bad: usize,
    total: usize,
}

/// Sizes of a call's plans (entries per row, granularity, whether one plan serves every KV head).
#[derive(Clone, Copy, Debug)]
struct PlanShape {
    cap: usize,
    ulog2: u32,
    shared: bool,
}

fn shape_of_selector(sel: &Selector, bs: usize, max_pos: usize) -> PlanShape {
    PlanShape { cap: selector_capacity(sel, bs, max_pos).max(1), ulog2: selector_unit_log2(sel, bs), shared: matches!(sel, Selector::All | Selector::Streaming { .. }) }
}

fn checked(parts: &[usize]) -> Result<usize> {
    parts.iter().try_fold(1usize, |a, &b| a.checked_mul(b)).ok_or_else(|| crate::error::Error::new(crate::error::ErrorKind::OutOfMemory, "policy workspace size overflows"))
}

impl CudaBackend {
    /// A policy layer's call: selection, then attention over the plans (and dense over the other rows).
    pub(crate) fn sparse_forward(&self, cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache, geo: &Geometry, p: &Pipeline) -> Result<()> {
        if let Selector::Speculate(sp) = &p.selector {
            return self.prr_forward(cfg, a, cache, geo, sp);
        }
        let (hk, bs, d, g) = (cfg.num_kv_heads, cfg.block_size, cfg.head_dim, cfg.group_size());
        ensure!(geo.num_seqs < 65536, Unsupported, "policies on the CUDA backend take at most 65535 sequences per call (got {})", geo.num_seqs);
        let stream = a.stream;
        let base = shape_of_selector(&p.selector, bs, geo.max_pos);
        let fin = PlanShape { cap: plan_capacity(p, bs, geo.max_pos).max(1), ulog2: plan_unit_log2(p, bs), shared: base.shared && p.top_p.is_none() };
        let ns = geo.num_seqs;
        let rows_of = |sh: &PlanShape| if sh.shared { ns } else { ns * hk };
        // Workspace layout (4-byte elements, each region 256-byte aligned).
        let mut lay = WsLayout::default();
        let mut off = 0usize;
        let mut take = |bytes: usize| -> usize {
            let at = off;
            off = (off + bytes).next_multiple_of(256);
            at
        };
        lay.plan = take(checked(&[rows_of(&fin), fin.cap, 4])?);
        lay.plan_len = take(checked(&[ns, hk, 4])?);
        // ART: tiles visited per (seq, head, split); its splits follow from the plan's capacity.
        let art_nsplit = p.art.map_or(1, |art| super::plan::art_splits(fin.cap << fin.ulog2, art.segment).0);
        ensure!(art_nsplit < 65536, Unsupported, "`art(segment=...)` would split a row into {art_nsplit} segments; at most 65535 (use a larger segment)");
        lay.art_tiles = take(checked(&[ns, hk, art_nsplit, 4])?);
        let art_priority = p.art.is_some_and(|art| art.order == crate::policy::Order::Priority);
        // The bitonic sort of kvs_art_priority holds a power of two >= the plan's capacity of 8-byte keys.
        let art_n2 = fin.cap.next_power_of_two();
        if art_priority {
            ensure!(art_n2 * 8 + 1024 <= self.gpu.smem_optin as usize, Unsupported, "`art(order=priority)` on the CUDA backend sorts a row's plan in shared memory: {} entries is more than this device holds (use a smaller budget or order=recent)", fin.cap);
            lay.art_order = take(checked(&[rows_of(&fin), fin.cap, 4])?);
            lay.art_inv = take(checked(&[rows_of(&fin), fin.cap, 4])?);
        }
        let quest_pages = match p.selector {
            Selector::Quest { page, .. } => Some((page, geo.max_pos.div_ceil(page) + 1)),
            _ => None,
        };
        // Candidates per row; a multiple of 4 (the top-p kernel reads float4s of each row).
        let maxc = (base.cap << base.ulog2).min(geo.max_pos + (1usize << base.ulog2)).next_multiple_of(4);
        if p.top_p.is_some() {
            lay.base = take(checked(&[rows_of(&base), base.cap, 4])?);
            lay.base_len = take(checked(&[ns, hk, 4])?);
            lay.logits = take(checked(&[ns, hk, g, maxc, 4])?);
            lay.w = take(checked(&[ns, hk, maxc, 4])?);
        }
        if let Some((_, maxp)) = quest_pages {
            lay.scores = take(checked(&[ns, hk, maxp, 4])?);
            lay.qhist = take(checked(&[ns, hk, QSEL_BINS, 4])?);
        }
        // SnapKV's observation rows per (seq, head): the window's tokens of the longest chunk, times the group.
        let snap_rows = match p.selector {
            Selector::SnapKv { window, .. } if a.max_query_len != 1 => {
                let mq = if a.max_query_len > 0 { a.max_query_len as usize } else { window };
                Some(checked(&[window.min(mq).max(1), g])?)
            }
            _ => None,
        };
        if let Some(rows) = snap_rows {
            lay.snap_rmax = take(checked(&[ns, hk, rows, 4])?);
            lay.snap_z = take(checked(&[ns, hk, rows, 8])?);
            lay.snap_bad = take(checked(&[ns, hk, rows, 4])?);
            lay.snap_agg = take(checked(&[ns, hk, geo.max_pos.max(1), 4])?);
            lay.snap_pool = take(checked(&[ns, hk, geo.max_pos.max(1), 4])?);
        }
        if self.slots.is_some() {
            lay.slot = take(checked(&[ns, 4])?);
            lay.slot_gen = take(checked(&[ns, 4])?);
        }
        if let Selector::Refresh(r) = p.selector {
            // The full step's weights from its own attention where the tensor-core kernel runs it.
            let logits = self.mma_for(cfg, cache, false).is_some();
            lay.refresh = crate::policy::refresh::cuda::RefreshWs::reserve(&mut take, ns, hk, g, geo.max_pos, r.k, logits)?;
        }
        let pred_ws = match p.selector {
            Selector::Predictor(ps) => Some(crate::policy::predictor::cuda::PredWs::new(&ps, geo, g, a.max_query_len)?),
            _ => None,
        };
        if let Some(pw) = &pred_ws {
            lay.pred_mode = take(checked(&[ns, hk, 4])?);
            lay.pred_scores = take(checked(&[ns, hk, pw.nbmax, 4])?);
            lay.pred_rmax = take(checked(&[ns, hk, pw.rcap, 4])?);
            lay.pred_z = take(checked(&[ns, hk, pw.rcap, 8])?);
            lay.pred_bad = take(checked(&[ns, hk, pw.rcap, 4])?);
        }
        lay.total = off.max(256);
        ensure!(fin.cap < i32::MAX as usize && maxc < i32::MAX as usize, Unsupported, "policy plan too large for 32-bit indices");

        let meta_guard = self.meta.layer(a.layer);
        let needs = self.meta.needs;
        let meta = match meta_guard.as_ref() {
            Some(m) => {
                ensure!(m.num_blocks == cache.num_blocks, InvalidShape, "layer {}'s key metadata was built for {} blocks, the caches have {}", a.layer, m.num_blocks, cache.num_blocks);
                Some(m)
            }
            None if needs.any() => bail!(InvalidArgument, "policy {:?} needs key metadata for layer {}, but no cache write for that layer went through kvs_cache_write", cfg.policy, a.layer),
            None => None,
        };

        let mut ws_map = self.sparse.ws.lock();
        let ws = super::workspace::for_stream(&mut ws_map, &self.retired, &self.gpu, stream, lay.total, "policy")?;
        if let Some(slots) = &self.slots {
            let Some(ids) = a.seq_ids.as_ref() else {
                bail!(InvalidArgument, "policy {:?} keeps per-sequence state: forward calls must pass seq_ids", cfg.policy);
            };
            slots.lookup(&self.gpu, &self.modules, ids, ns, ws + lay.slot as u64, ws + lay.slot_gen as u64, stream)?;
        }

        let defines = vec![format!("KVS_DTYPE={}", dtype_code(cfg.dtype)), format!("HEAD_DIM={d}"), format!("GROUP={g}"), "--fmad=false".to_string()];
        let f = |name: &'static str| self.modules.function(&self.gpu, "select", launch::SELECT, &defines, name);
        let batch = BatchArg {
            bt: a.block_table.data as u64,
            bt0: a.block_table.stride(0) as i64,
            bt1: a.block_table.stride(1) as i64,
            bt_cols: geo.cols as i32,
            bs_log2: bs.trailing_zeros() as i32,
            num_blocks: cache.num_blocks as i64,
            seq_lens: a.seq_lens.data as u64,
            sl0: a.seq_lens.stride(0) as i64,
            qsl: a.query_start_loc.data as u64,
            qsl0: a.query_start_loc.stride(0) as i64,
            num_seqs: ns as i32,
            num_tokens: geo.num_tokens as i32,
            window: a.sliding_window,
            pad: 0,
        };
        let ctr = self.sparse.layer_counters(a.layer) as i64;
        let row_bytes = (2 * d * cfg.dtype.size_bytes()) as i64;
        let q = &a.query;
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
        let base_ref = if p.top_p.is_some() { plan_at(lay.base, &base, lay.base_len) } else { fin_ref };
        let count_base = p.top_p.is_none() as i32;

        let phases = self.sparse.phases.load(std::sync::atomic::Ordering::Relaxed);
        let (do_select, do_attend) = (phases & 1 != 0, phases & 2 != 0);
        match p.selector {
            _ if !do_select => {}
            Selector::All | Selector::Streaming { .. } => {
                let (kind, sink, recent) = match p.selector {
                    Selector::Streaming { sink, recent } => (1, sink.min(i32::MAX as usize) as i32, recent.min(i32::MAX as usize) as i32),
                    _ => (0, 0, 0),
                };
                let mut k = KArgs::new();
                k.by_value(&batch).i32(hk as i32).i32(kind).i32(sink).i32(recent);
                k.i64(base_ref.e as i64).i64(base_ref.p_s).i64(base_ref.len as i64).i32(base_ref.cap).i64(row_bytes).i32(count_base).i64(ctr);
                launch::launch(f("kvs_plan_simple")?, (ns as u32, 1, 1), 256, &mut k, stream, "kvs_plan_simple launch")?;
            }
            Selector::Quest { budget, page, sink } => {
                let m = meta.expect("quest metadata checked above");
                let (_, maxp) = quest_pages.expect("quest");
                let scores = ws + lay.scores as u64;
                // Scores with the first pass of the top-k folded in (per-row key histograms merged over the
                // row's CTAs), then the top-k per row, which checks the histogram against the keys and
                // zeroes it for the next call (kernels/select.cu).
                let qhist = ws + lay.qhist as u64;
                let mut k = KArgs::new();
                k.by_value(&batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).i32(hk as i32);
                k.i64(m.qmin.as_ref().map_or(0, |b| b.ptr) as i64).i64(m.qmax.as_ref().map_or(0, |b| b.ptr) as i64).i32(m.unit as i32).i32(m.units_per_block as i32).i32(page as i32);
                k.i32(budget.min(i32::MAX as usize) as i32).i32(sink.min(i32::MAX as usize) as i32).i64(scores as i64).i32(maxp as i32).i64(qhist as i64).i64(row_bytes).i64(ctr);
                launch::launch(f("kvs_quest_scores_hist")?, (maxp.div_ceil(64) as u32, hk as u32, ns as u32), 256, &mut k, stream, "kvs_quest_scores_hist launch")?;
                // The page keys in dynamic shared memory when they fit (the device's opt-in limit less the
                // kernel's own static shared memory, ~18 KiB: the gathered bin and scratch).
                let dyn_max = (self.gpu.smem_optin as usize).saturating_sub(TOPK_STATIC_SMEM);
                let smem_keys = maxp.min(dyn_max / 4);
                let f_topk = f("kvs_quest_topk")?;
                self.allow_smem_once(f_topk, dyn_max)?;
                let mut k = KArgs::new();
                k.by_value(&batch).i32(hk as i32).i32(budget.min(i32::MAX as usize) as i32).i32(page as i32).i32(sink.min(i32::MAX as usize) as i32);
                k.i64(scores as i64).i32(maxp as i32).i64(qhist as i64).i64(base_ref.e as i64).i64(base_ref.p_s).i64(base_ref.p_h).i64(base_ref.len as i64).i32(base_ref.cap).i64(row_bytes).i32(count_base);
                k.i32(smem_keys as i32).i64(ctr);
                launch::launch_smem(f_topk, (hk as u32, ns as u32, 1), launch::TOPK_THREADS, (smem_keys * 4) as u32, &mut k, stream, "kvs_quest_topk launch")?;
                if art_priority {
                    let f_ord = f("kvs_art_priority")?;
                    let smem = art_n2 * 8;
                    if smem > 48 * 1024 {
                        self.allow_smem_once(f_ord, (self.gpu.smem_optin as usize).saturating_sub(1024))?;
                    }
                    let mut k = KArgs::new();
                    k.by_value(&batch).i32(hk as i32).i64(base_ref.e as i64).i64(base_ref.p_s).i64(base_ref.p_h).i64(base_ref.len as i64).i32(base_ref.cap);
                    k.i32(art_sink_limit(p)).i32(page as i32).i64(scores as i64).i32(maxp as i32);
                    k.i64((ws + lay.art_order as u64) as i64).i64((ws + lay.art_inv as u64) as i64).i32(art_n2 as i32);
                    launch::launch_smem(f_ord, (hk as u32, ns as u32, 1), 512, smem as u32, &mut k, stream, "kvs_art_priority launch")?;
                }
            }
            Selector::SnapKv { budget, window, pool } => {
                let m = meta.expect("snapkv metadata checked above");
                let keep = m.keep.as_ref().map_or(0, |b| b.ptr);
                ensure!(keep != 0, Internal, "SnapKV's kept-slot bits were not allocated for layer {}", a.layer);
                if let Some(rows) = snap_rows {
                    self.snap_choose(a, cache, geo, g, &batch, f, ws, &lay, rows, keep, (budget, window, pool))?;
                }
                let mut k = KArgs::new();
                k.by_value(&batch).i32(hk as i32).i64(keep as i64);
                k.i64(base_ref.e as i64).i64(base_ref.p_s).i64(base_ref.p_h).i64(base_ref.len as i64).i32(base_ref.cap).i64(row_bytes).i32(count_base).i64(ctr);
                launch::launch(f("kvs_plan_snap")?, (hk as u32, ns as u32, 1), launch::TOPK_THREADS, &mut k, stream, "kvs_plan_snap launch")?;
            }
            Selector::Refresh(r) => {
                let slots = (ws + lay.slot as u64, ws + lay.slot_gen as u64);
                self.refresh_select(a, cache, geo, g, &batch, f, ws, &lay.refresh, slots, &r, fin_ref, row_bytes, ctr, false)?;
            }
            Selector::Predictor(_) => {
                let pw = pred_ws.as_ref().expect("predictor workspace");
                self.predictor_step(a, cache, geo, g, &batch, &defines, ws, &lay, pw, &fin_ref, ctr)?;
            }
            _ => bail!(Unsupported, "policy {:?} is not available on the CUDA backend yet", cfg.policy),
        }

        if let (Some(tp), true) = (p.top_p, do_select) {
            let m = meta.expect("int4 metadata checked above");
            let (codes, qparams) = (m.codes.as_ref().map_or(0, |b| b.ptr), m.qparams.as_ref().map_or(0, |b| b.ptr));
            let (logits, w) = (ws + lay.logits as u64, ws + lay.w as u64);
            let mut k = KArgs::new();
            k.by_value(&batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).i32(hk as i32);
            k.i64(base_ref.e as i64).i64(base_ref.p_s).i64(base_ref.p_h).i64(base_ref.len as i64).i32(base_ref.ulog2);
            k.i64(codes as i64).i64(qparams as i64).f32(a.softcap).i64(logits as i64).i32(maxc as i32);
            launch::launch(f("kvs_topp_estimate")?, (maxc.div_ceil(128) as u32, hk as u32, ns as u32), 128, &mut k, stream, "kvs_topp_estimate launch")?;
            let mut k = KArgs::new();
            k.by_value(&batch).i32(hk as i32).i64(base_ref.e as i64).i64(base_ref.p_s).i64(base_ref.p_h).i64(base_ref.len as i64).i32(base_ref.ulog2);
            k.i64(logits as i64).i64(w as i64).i32(maxc as i32).f32(tp.p);
            k.i64(fin_ref.e as i64).i64(fin_ref.p_s).i64(fin_ref.p_h).i64(fin_ref.len as i64).i32(fin_ref.cap).i64(row_bytes).i64((d / 2 + 4) as i64).i64(ctr);
            launch::launch(f("kvs_topp_select")?, (hk as u32, ns as u32, 1), 512, &mut k, stream, "kvs_topp_select launch")?;
        }
        drop(meta_guard);

        if do_attend {
            if a.max_query_len != 1 {
                self.attend(cfg, a, cache, geo, Rows::DenseRest)?;
            }
            // Key bound of the split planner: a plan that covers every position gets dense's bound and
            // splits (attended in dense's order, bit for bit); a plan reaching past max_len (a partial last
            // page) is still covered, by the last split, which runs to the plan's end.
            let keys = (fin.cap << fin.ulog2).min(geo.max_len);
            let art = p.art.map(|art| ArtLaunch {
                tau: art.tau,
                phi: art.phi,
                patience: art.patience.map_or(-1, |v| v.min(i32::MAX as u32) as i32),
                sink_limit: art_sink_limit(p),
                ctr: ctr as u64,
                tiles_out: ws + lay.art_tiles as u64,
                hk: hk as i32,
                segment: art.segment.map_or(0, |v| v.min(i32::MAX as u32) as i32),
                order: if art_priority { ws + lay.art_order as u64 } else { 0 },
                inv: if art_priority { ws + lay.art_inv as u64 } else { 0 },
            });
            // ART walks the plan in its segments (art_splits): the key bound is the plan's capacity.
            let keys = if art.is_some() { fin.cap << fin.ulog2 } else { keys };
            match p.selector {
                Selector::Refresh(_) if lay.refresh.logits => {
                    let lo = self.refresh_logits_out(geo, ws, &lay.refresh);
                    self.attend(cfg, a, cache, geo, Rows::PlanLogits(fin_ref, keys, lo))?
                }
                _ => self.attend(cfg, a, cache, geo, Rows::Plan(fin_ref, keys, art))?,
            }
            if let (Selector::Refresh(r), true, true) = (&p.selector, lay.refresh.logits, do_select) {
                let slots = (ws + lay.slot as u64, ws + lay.slot_gen as u64);
                self.refresh_select(a, cache, geo, g, &batch, f, ws, &lay.refresh, slots, r, fin_ref, row_bytes, ctr, true)?;
            }
            if let Some(art) = p.art {
                // Blocks no visited tile reached, once every split has run (kernels/select.cu).
                let (nsplit, chunk) = super::plan::art_splits(keys, art.segment);
                let mut k = KArgs::new();
                k.by_value(&batch).i32(hk as i32).i64(fin_ref.e as i64).i64(fin_ref.p_s).i64(fin_ref.p_h).i64(fin_ref.len as i64).i32(fin_ref.cap).i32(fin_ref.ulog2);
                k.i32(art_sink_limit(p)).i64((ws + lay.art_tiles as u64) as i64).i32(nsplit as i32).i32(chunk.min(i32::MAX as usize) as i32);
                k.i64(if art_priority { (ws + lay.art_inv as u64) as i64 } else { 0 }).i64(ctr);
                launch::launch(f("kvs_art_blocks")?, (hk as u32, ns as u32, 1), 256, &mut k, stream, "kvs_art_blocks launch")?;
            }
        }
        // The workspace stays locked until the launches that read it are enqueued.
        drop(ws_map);
        *self.sparse.last.lock() = Some(LastPlan {
            plan: fin_ref,
            num_seqs: ns,
            art: p.art.map(|art| (ws + lay.art_tiles as u64, art_sink_limit(p) as usize, art_nsplit, art.segment)),
            art_order: if art_priority { ws + lay.art_order as u64 } else { 0 },
        });
        Ok(())
    }

    pub(crate) fn sparse_layer_counters(&self, layer: usize) -> u64 {
        self.sparse.layer_counters(layer)
    }

    /// Records where a policy call left its final plans (for visit records).
    pub(crate) fn sparse_set_last_plan(&self, plan: PlanRef, num_seqs: usize) {
        *self.sparse.last.lock() = Some(LastPlan { plan, num_seqs, art: None, art_order: 0 });
    }

    /// Benchmarks only: run just the selection (`attend = false`) or just the attention over the plans the
    /// previous call left (`select = false`) of later policy calls, to time the phases apart.
    pub fn set_bench_phases(&self, select: bool, attend: bool) {
        self.sparse.phases.store(select as u8 | (attend as u8) << 1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The device counters of every layer since the engine started (synchronizes the device).
    pub fn device_counters(&self) -> Result<Vec<Counters>> {
        self.gpu.synchronize()?;
        let n = self.sparse.num_layers * CTR_COUNT;
        let mut raw = vec![0u8; n * 8];
        self.sparse.counters.download(0, &mut raw)?;
        let v: Vec<u64> = raw.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        let mut per_layer: Vec<Counters> = v
            .chunks_exact(CTR_COUNT)
            .enumerate()
            .map(|(l, c)| Counters {
                decode_rows: c[0],
                prefill_tokens: c[1],
                policy_rows: c[2],
                blocks_eligible: c[3],
                blocks_visited: c[4],
                top_p_candidates: c[5],
                top_p_kept: c[6],
                kv_bytes_read: c[7],
                blocks_skipped_termination: c[8],
                art_tiles_visited: c[9],
                art_tiles_total: c[10],
                spec_predicted_blocks: c[11],
                spec_true_blocks: c[12],
                spec_hit_blocks: c[13],
                spec_repaired_blocks: c[14],
                spec_reuse_hit_blocks: c[15],
                ..self.prr.host_counters(l)
            })
            .collect();
        self.refresh.add_counters(&mut per_layer)?;
        if let Some(pd) = &self.predictor {
            for (c, (full, partial)) in per_layer.iter_mut().zip(pd.read_counters(&self.gpu)?) {
                c.refresh_full_steps += full;
                c.refresh_partial_steps += partial;
            }
        }
        Ok(per_layer)
    }

    /// What the last policy call's decode rows visited, from its plans (synchronizes; evaluation only).
    /// `a` must be that call's arguments.
    pub fn visit_records(&self, cfg: &EngineConfig, a: &ForwardArgs) -> Result<Vec<VisitRecord>> {
        let Some(last) = *self.sparse.last.lock() else { return Ok(Vec::new()) };
        self.gpu.synchronize()?;
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
        let art_tiles = match last.art {
            Some((ptr, _, nsplit, _)) => {
                let mut raw = vec![0u8; ns * hk * nsplit * 4];
                download_raw(ptr, &mut raw)?;
                Some(raw.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4"))).collect::<Vec<i32>>())
            }
            None => None,
        };
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
                let mut tiles_rec = None;
                match (&art_tiles, last.art) {
                    (Some(t), Some((_, sink_limit, nsplit, segment))) => {
                        // The kernel's order (priority: as kvs_art_priority wrote it; else recency) and tiles;
                        // each split (segment) cut where it stopped.
                        let mut order = Vec::new();
                        if last.art_order != 0 {
                            download_raw(last.art_order + ((s as i64 * pr.p_s + h as i64 * pr.p_h) * 4) as u64, &mut entries[..n * 4])?;
                            order.extend(entries[..n * 4].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4"))));
                        } else {
                            crate::policy::art::order_entries(&plan, sink_limit, crate::policy::Order::Recent, |_| f32::NAN, &mut order);
                        }
                        let mut tiles = crate::policy::art::Tiles::default();
                        tiles.build(&order, plan.unit_log2, lo, hi);
                        let seg_tiles = segment.map_or(usize::MAX, |k| k as usize / crate::policy::art::ART_TILE);
                        spans.clear();
                        let mut visited = 0usize;
                        for k in 0..nsplit {
                            let t0 = k.saturating_mul(seg_tiles).min(tiles.len());
                            let t1 = t0.saturating_add(t[(s * hk + h) * nsplit + k].max(0) as usize).min(tiles.len()).min(t0.saturating_add(seg_tiles));
                            spans.extend_from_slice(&tiles.spans[tiles.bounds[t0]..tiles.bounds[t1]]);
                            visited += t1 - t0;
                        }
                        crate::policy::select::normalize_spans(&mut spans);
                        tiles_rec = Some((visited as u32, tiles.len() as u32));
                    }
                    _ => plan.spans(lo, hi, &mut spans),
                }
                out.push(VisitRecord { layer: a.layer, seq_id: ids[s] as u64, kv_head: h, spans: spans.clone(), art_tiles: tiles_rec });
            }
        }
        Ok(out)
    }
}

fn download_raw(ptr: u64, dst: &mut [u8]) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: the caller names a device range inside one of our allocations or the caller's tensors.
    check(unsafe { (cuda()?.cuMemcpyDtoH)(dst.as_mut_ptr() as *mut std::ffi::c_void, ptr, dst.len()) }, "cuMemcpyDtoH")
}

/// The first `n` elements of a 1-D int32/int64 device tensor (any stride).
pub(crate) fn download_ints(t: &TensorRef, n: usize) -> Result<Vec<i64>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let es = t.dtype.size_bytes();
    let stride = t.stride(0);
    ensure!(stride >= 0, InvalidShape, "negative stride");
    let span = ((n - 1) * stride as usize + 1) * es;
    let mut raw = vec![0u8; span];
    download_raw(t.data as u64, &mut raw)?;
    Ok((0..n)
        .map(|i| {
            let at = i * stride as usize * es;
            match t.dtype {
                DType::I64 | DType::U64 => i64::from_le_bytes(raw[at..at + 8].try_into().expect("8")),
                _ => i32::from_le_bytes(raw[at..at + 4].try_into().expect("4")) as i64,
            }
        })
        .collect())
}
