//! Quest on the CUDA backend (kernels/policy/quest.cu): the page scores, then the top-k per row. On sm_90
//! and newer, while the rows' clusters fit in one wave, the top-k of a row runs on a thread-block cluster (kvs_quest_topk_cluster: the row's keys
//! split over CLUSTER_CTAS CTAs, each radix pass's counts summed through distributed shared memory); before
//! that, on one CTA per row (kvs_quest_topk), with the scoring kernel folding in the first pass (per-row
//! key histograms merged over the row's CTAs, checked against the keys and zeroed by the top-k). The page
//! scores stay in the workspace for ART's priority order. The scores come from tensor cores
//! (kvs_quest_scores_hist_mma: agreement with the CPU engine's within docs/policies.md's margin) when
//! Quest runs alone; with a later stage (top-p reads Quest's set, ART its scores), or where a page spans
//! several metadata units, from kvs_quest_scores_hist in the CPU's arithmetic bit for bit (those stages'
//! tests compare with the CPU engine exactly).

use crate::cuda::kernel_src::{kernel_file, KernelFile};
use crate::cuda::launch::{self, KArgs, CLUSTER_CTAS};
use crate::cuda::stage::{CallShape, CudaStage, PageScores, StepCx, WsAlloc};
use crate::cuda::driver::CUfunction;
use crate::error::Result;
use parking_lot::Mutex;

/// Quest's kernels, compiled in the selection module (the registry's `SELECT_MODULE`).
pub const KERNEL: KernelFile = kernel_file!("quest.cu", "policy/quest.cu");

/// Bins of Quest's per-row key histogram: kernels/policy/quest.cu QSEL_BINS.
const QSEL_BINS: usize = 2048;
/// Static shared memory of kvs_quest_topk and a margin (its gathered bin is 16 KiB), kept out of the
/// dynamic shared memory its page keys may take.
const TOPK_STATIC_SMEM: usize = 24 << 10;
/// Threads per CTA of kvs_quest_topk_cluster (kernels/policy/quest.cu QC_THREADS; its CTAs per row:
/// `launch::CLUSTER_CTAS`).
const QC_THREADS: u32 = 256;
/// Pages per CTA of the tensor-core scorer (kvs_quest_scores_hist_mma): 64 (one tile), or 128-256 where the
/// grid still has at least 4 waves of `slots` resident CTAs (batch 8-32 at long contexts): a CTA builds the
/// query's fragments once for all its pages, and at 32 x 128K one CTA per 64 pages spent more of the SM on
/// that build than on reading the bounds (journal 2026-11-28). Between one and two waves of single tiles
/// (1 x 128K), 128 pages: one wave instead of a second one a third full (select 32.9 -> 30.3 µs on the
/// H200; under one wave, 1 x 32K, longer tiles lose: 18.5 -> 20.6).
/// `KVS_QUEST_PAGES_PER_CTA` (64, 128, 192 or 256) forces the choice, so that tests cover the longer tiles
/// on small batches.
fn pages_per_cta(rows: usize, maxp: usize, slots: usize) -> usize {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| std::env::var("KVS_QUEST_PAGES_PER_CTA").ok().and_then(|v| v.parse().ok()).filter(|v| [64, 128, 192, 256].contains(v)));
    let (tiles, slots) = (rows.saturating_mul(maxp.div_ceil(64)), slots.max(1));
    let ppc = if tiles > slots && tiles <= 2 * slots { 128 } else { 64 * (tiles / (4 * slots)).clamp(1, 4) };
    forced.unwrap_or(ppc)
}

/// Whether the top-k runs on thread-block clusters (sm_90 and newer): while the rows' clusters fit in one
/// wave of one CTA per SM. With more rows one CTA per row does less work in all (H200, 32/8 heads, select
/// µs one CTA / cluster: 1 x 128K 47.1 / 40.1, 8 x 32K 58.8 / 60.3, 32 x 32K 152 / 182; journal 2026-11-26,
/// "Sixth session"). `KVS_QUEST_TOPK=cta|cluster` forces the choice where the device has clusters.
fn topk_on_clusters(cc_major: i32, num_sms: usize, rows: usize) -> bool {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = launch::env_choice(&FORCED, "KVS_QUEST_TOPK", "cta", "cluster");
    cc_major >= 9 && forced.unwrap_or(launch::clusters_fit_one_wave(rows, num_sms))
}

/// Whether the tensor-core page scores cover this geometry (kernels/policy/quest.cu QM_FITS): elsewhere
/// kvs_quest_scores_hist_mma scores exactly, 64 pages per CTA.
fn mma_fits(group: usize, head_dim: usize) -> bool {
    group <= 16 && (head_dim <= 128 || group <= 8)
}

/// CTAs of 256 threads of `f` resident at once on the device, asked of the driver once per function.
fn resident_ctas(f: CUfunction, num_sms: i32) -> Result<usize> {
    static SEEN: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
    if let Some(&(_, n)) = SEEN.lock().iter().find(|e| e.0 == f as usize) {
        return Ok(n);
    }
    let n = launch::occupancy(f, 256)? as usize * num_sms.max(1) as usize;
    SEEN.lock().push((f as usize, n));
    Ok(n)
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
        // Thread-block clusters: the top-k of a row over CLUSTER_CTAS CTAs, no key histogram (topk_on_clusters).
        let gpu = cx.dev.gpu();
        let cluster = topk_on_clusters(gpu.cc.0, gpu.num_sms.max(0) as usize, ns * hk);
        let mma = !self.exact && m.unit == page;
        k.i64(if cluster { 0 } else { qhist as i64 }).i64(cx.row_bytes).i64(cx.ctr);
        let scorer = if mma { "kvs_quest_scores_hist_mma" } else { "kvs_quest_scores_hist" };
        // Both scorers and both top-k kernels start with KVS_GRID_WAIT(): dependent launches where the GPU has them.
        let pdl = cx.pdl();
        let f_score = cx.function(scorer)?;
        // Pages per CTA: longer tiles only where the tensor-core tile scores them (kvs_quest_scores_hist_mma
        // scores other geometries 64 pages per CTA, as kvs_quest_scores_hist, which takes no `ppc`).
        let ppc = if mma && mma_fits(cx.cfg.group_size(), cx.cfg.head_dim) { pages_per_cta(ns * hk, maxp, resident_ctas(f_score, gpu.num_sms)?) } else { 64 };
        if mma {
            k.i32(ppc as i32);
        }
        launch::launch_dependent(pdl, f_score, (maxp.div_ceil(ppc) as u32, hk as u32, ns as u32), 256, 0, &mut k, stream, "kvs_quest_scores_hist launch")?;
        // The page keys (a row's, or with clusters a CTA's part of it) in dynamic shared memory when they
        // fit (the device's opt-in limit less the kernel's own static shared memory: the gathered bin and
        // scratch); longer rows read the scores from global memory.
        let dyn_max = (gpu.smem_optin as usize).saturating_sub(TOPK_STATIC_SMEM);
        let (name, grid, threads, keys) = if cluster {
            ("kvs_quest_topk_cluster", ((hk * CLUSTER_CTAS) as u32, ns as u32, 1), QC_THREADS, maxp.div_ceil(CLUSTER_CTAS))
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
        launch::launch_dependent(pdl, f_topk, grid, threads, (smem_keys * 4) as u32, &mut k, stream, "kvs_quest_topk launch")
    }
}

#[cfg(test)]
mod tests {
    use super::{mma_fits, pages_per_cta};

    #[test]
    fn scorer_tiles_grow_only_where_the_grid_keeps_four_waves() {
        // H200-like: 132 SMs x 5 CTAs. 1 x 128K (8 rows of 8,193 pages): 1,032 tiles, 1.6 waves -> two
        // tiles per CTA, one wave; 1 x 32K (264 tiles): one tile per CTA.
        assert_eq!(pages_per_cta(8, 8193, 660), 128);
        assert_eq!(pages_per_cta(8, 2049, 660), 64);
        // 8 x 128K: 8,256 tiles = 12.5 waves of one tile -> 3 tiles per CTA.
        assert_eq!(pages_per_cta(64, 8193, 660), 192);
        // 32 x 128K: at most 4 tiles per CTA.
        assert_eq!(pages_per_cta(256, 8193, 660), 256);
        // 8 x 32K: 2,112 tiles, 3.2 waves: one tile per CTA.
        assert_eq!(pages_per_cta(64, 2049, 660), 64);
        // Degenerate sizes stay a multiple of 64 in 64..=256.
        assert_eq!(pages_per_cta(0, 0, 0), 64);
        assert_eq!(pages_per_cta(usize::MAX, usize::MAX, 1), 256);
    }

    #[test]
    fn longer_scorer_tiles_only_where_the_tensor_core_tile_scores() {
        // kernels/policy/quest.cu QM_FITS: GROUP <= 16 && (HEAD_DIM <= 128 || GROUP <= 8).
        assert!(mma_fits(4, 128) && mma_fits(16, 128) && mma_fits(8, 256) && mma_fits(1, 64));
        assert!(!mma_fits(32, 128) && !mma_fits(16, 256) && !mma_fits(12, 192));
    }
}
