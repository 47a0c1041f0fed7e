//! Quest on the CUDA backend (kernels/policy/quest.cu): the page scores, then the top-k per row. With
//! `KVS_QUEST_ONE_LAUNCH=1`, on sm_90 and newer, while the rows' clusters fit in one wave and the scores
//! come from tensor cores, both in one launch (kvs_quest_select_cluster: a row's cluster scores its pages
//! and cuts them from its shared memory). Otherwise, on sm_90 and newer the top-k of a row runs on a thread-block cluster (kvs_quest_topk_cluster: the row's keys
//! split over QC_CTAS CTAs, each radix pass's counts summed through distributed shared memory); before
//! that, on one CTA per row (kvs_quest_topk), with the scoring kernel folding in the first pass (per-row
//! key histograms merged over the row's CTAs, checked against the keys and zeroed by the top-k). The page
//! scores stay in the workspace for ART's priority order. The scores come from tensor cores
//! (kvs_quest_scores_hist_mma: agreement with the CPU engine's within docs/policies.md's margin) when
//! Quest runs alone; with a later stage (top-p reads Quest's set, ART its scores), or where a page spans
//! several metadata units, from kvs_quest_scores_hist in the CPU's arithmetic bit for bit (those stages'
//! tests compare with the CPU engine exactly).

use crate::cuda::launch::{self, KArgs};
use crate::cuda::stage::{CallShape, CudaStage, PageScores, StepCx, WsAlloc};
use crate::error::Result;

/// Bins of Quest's per-row key histogram: kernels/policy/quest.cu QSEL_BINS.
const QSEL_BINS: usize = 2048;
/// Static shared memory of kvs_quest_topk and a margin (its gathered bin is 16 KiB), kept out of the
/// dynamic shared memory its page keys may take.
const TOPK_STATIC_SMEM: usize = 24 << 10;
/// CTAs per row (one thread-block cluster) and threads per CTA of kvs_quest_topk_cluster (kernels/policy/quest.cu
/// QC_CTAS, QC_THREADS).
const QC_CTAS: u32 = 8;
const QC_THREADS: u32 = 256;
/// Stages of page bounds per CTA of kvs_quest_select_cluster (kernels/policy/quest.cu QF_STAGES).
const QF_STAGES: usize = 3;
/// Static shared memory of kvs_quest_select_cluster (the cluster's radix scratch) and a margin.
const QF_STATIC_SMEM: usize = 4 << 10;

/// Dynamic shared memory of kvs_quest_select_cluster (kernels/policy/quest.cu, in its order): QF_STAGES
/// stages of `round` staged page rows of 2 * head_dim + 8 f16 (kernels/include/quest_mma.cuh QM_STRIDE),
/// the query's B fragments (QM_NT * QM_KS * 32 of 16 bytes), the query rows (group * QM_QSTR f32), then
/// `per` units and `per` keys (4 bytes each).
fn quest_fused_smem(head_dim: usize, group: usize, per: usize, round: usize) -> usize {
    QF_STAGES * round * (2 * head_dim + 8) * 2 + group.div_ceil(8) * (2 * head_dim / 16) * 32 * 16 + group * (head_dim + 8) * 4 + per * 8
}

/// The one-launch selection's pages per stage for this geometry: the most (128, 64, 32 or 16) whose
/// shared memory fits the device's opt-in limit, or None (the two launches run).
fn quest_fused_round(head_dim: usize, group: usize, per: usize, smem_optin: usize) -> Option<(usize, usize)> {
    let fits = group <= 16 && (head_dim <= 128 || group <= 8); // kernels/include/quest_mma.cuh QM_FITS
    [128, 64, 32, 16].into_iter().map(|r| (r, quest_fused_smem(head_dim, group, per, r))).find(|&(_, b)| fits && b + QF_STATIC_SMEM <= smem_optin)
}

/// `KVS_QUEST_ONE_LAUNCH=1` turns the one-launch selection on (off by default: its first version measured
/// slower than the two launches on an H200, and the second has not run on a device yet; journal
/// 2026-11-27, "Issue 34: Quest's selection in one launch"); read once per process.
fn one_launch_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVS_QUEST_ONE_LAUNCH").is_ok_and(|v| v == "1"))
}

/// Quest's stage for one call, and its workspace regions.
pub(crate) struct Quest {
    pub budget: usize,
    pub page: usize,
    pub sink: usize,
    /// Score in the CPU engine's arithmetic (a later stage reads Quest's set or scores).
    exact: bool,
    /// Pages per row (the table's positions, plus one).
    maxp: usize,
    /// `[seqs * kv_heads][maxp]` f32 page scores.
    scores: usize,
    /// Quest's per-row histograms of the page keys' top bits (kvs_quest_scores_hist, kvs_quest_topk),
    /// `[seqs * kv_heads][QSEL_BINS]` u32, left zeroed by each selection (a histogram that does not match
    /// the keys, e.g. the region's first use or another call's data, only costs the slow path).
    qhist: usize,
}

impl Quest {
    /// `exact`: the scores must be the CPU's bit for bit (a later stage reads the set or the scores).
    pub(crate) fn new(budget: usize, page: usize, sink: usize, exact: bool) -> Self {
        Quest { budget, page, sink, exact, maxp: 0, scores: 0, qhist: 0 }
    }
}

impl CudaStage for Quest {
    fn reserve(&mut self, cx: &CallShape, ws: &mut WsAlloc) -> Result<()> {
        let (ns, hk) = (cx.geo.num_seqs, cx.cfg.num_kv_heads);
        self.maxp = cx.geo.max_pos.div_ceil(self.page) + 1;
        self.scores = ws.take_n(&[ns, hk, self.maxp, 4])?;
        self.qhist = ws.take_n(&[ns, hk, QSEL_BINS, 4])?;
        Ok(())
    }

    fn page_scores(&self, ws: u64) -> Option<PageScores> {
        Some(PageScores { at: ws + self.scores as u64, maxp: self.maxp, page: self.page })
    }

    fn select(&self, cx: &StepCx) -> Result<()> {
        let (hk, ns, stream) = (cx.cfg.num_kv_heads, cx.geo.num_seqs, cx.a.stream);
        let (a, base, maxp, page) = (cx.a, &cx.base, self.maxp, self.page);
        let m = cx.meta.expect("quest metadata checked above");
        let clamp = |v: usize| v.min(i32::MAX as usize) as i32;
        let scores = cx.ws + self.scores as u64;
        let qhist = cx.ws + self.qhist as u64;
        let q = &a.query;
        let mut k = KArgs::new();
        k.by_value(&cx.batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).i32(hk as i32);
        k.i64(m.qmin.as_ref().map_or(0, |b| b.ptr) as i64).i64(m.qmax.as_ref().map_or(0, |b| b.ptr) as i64).i32(m.unit as i32).i32(m.units_per_block as i32).i32(page as i32);
        k.i32(clamp(self.budget)).i32(clamp(self.sink)).i64(scores as i64).i32(maxp as i32);
        // Thread-block clusters (sm_90 and newer) while the clusters fit in one wave of one CTA per SM: the
        // top-k of a row over QC_CTAS CTAs, no key histogram. With more rows one CTA per row does less work
        // in all (H200, 32/8 heads, select µs one CTA / cluster: 1 x 128K 47.1 / 40.1, 8 x 32K 58.8 / 60.3,
        // 32 x 32K 152 / 182; journal 2026-11-26, "Sixth session").
        let gpu = cx.dev.gpu();
        let cluster = gpu.cc.0 >= 9 && ns * hk * QC_CTAS as usize <= gpu.num_sms.max(1) as usize;
        let mma = !self.exact && m.unit == page;
        // With KVS_QUEST_ONE_LAUNCH=1, the whole selection in one launch (kvs_quest_select_cluster) where the
        // clusters fit and the scores come from tensor cores: no second launch and no trip of the scores
        // through global memory between scoring and the cut.
        let per = maxp.div_ceil(QC_CTAS as usize);
        let fused = if cluster && mma && one_launch_enabled() { quest_fused_round(cx.cfg.head_dim, cx.cfg.group_size(), per, gpu.smem_optin as usize) } else { None };
        if let Some((round, smem)) = fused {
            let f = cx.function("kvs_quest_select_cluster")?;
            cx.dev.allow_smem_once(f, (gpu.smem_optin as usize).saturating_sub(QF_STATIC_SMEM))?;
            k.i64(base.e as i64).i64(base.p_s).i64(base.p_h).i64(base.len as i64).i32(base.cap).i64(cx.row_bytes).i32(cx.count_base);
            k.i32(per as i32).i32(round as i32).i64(cx.ctr);
            let grid = (hk as u32 * QC_CTAS, ns as u32, 1);
            return launch::launch_smem(f, grid, QC_THREADS, smem as u32, &mut k, stream, "kvs_quest_select_cluster launch");
        }
        k.i64(if cluster { 0 } else { qhist as i64 }).i64(cx.row_bytes).i64(cx.ctr);
        let scorer = if mma { "kvs_quest_scores_hist_mma" } else { "kvs_quest_scores_hist" };
        launch::launch(cx.function(scorer)?, (maxp.div_ceil(64) as u32, hk as u32, ns as u32), 256, &mut k, stream, "kvs_quest_scores_hist launch")?;
        // The page keys (a row's, or with clusters a CTA's part of it) in dynamic shared memory when they
        // fit (the device's opt-in limit less the kernel's own static shared memory: the gathered bin and
        // scratch); longer rows read the scores from global memory.
        let dyn_max = (gpu.smem_optin as usize).saturating_sub(TOPK_STATIC_SMEM);
        let (name, grid, threads, keys) = if cluster {
            ("kvs_quest_topk_cluster", (hk as u32 * QC_CTAS, ns as u32, 1), QC_THREADS, maxp.div_ceil(QC_CTAS as usize))
        } else {
            ("kvs_quest_topk", (hk as u32, ns as u32, 1), launch::TOPK_THREADS, maxp)
        };
        let smem_keys = keys.min(dyn_max / 4);
        let f_topk = cx.function(name)?;
        cx.dev.allow_smem_once(f_topk, dyn_max)?;
        let mut k = KArgs::new();
        k.by_value(&cx.batch).i32(hk as i32).i32(clamp(self.budget)).i32(page as i32).i32(clamp(self.sink));
        k.i64(scores as i64).i32(maxp as i32);
        if !cluster {
            k.i64(qhist as i64);
        }
        k.i64(base.e as i64).i64(base.p_s).i64(base.p_h).i64(base.len as i64).i32(base.cap).i64(cx.row_bytes).i32(cx.count_base);
        k.i32(smem_keys as i32).i64(cx.ctr);
        launch::launch_smem(f_topk, grid, threads, (smem_keys * 4) as u32, &mut k, stream, "kvs_quest_topk launch")
    }
}
