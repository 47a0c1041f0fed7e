//! SnapKV's choice on the CUDA backend (kernels/policy/snapkv.cu): at a call that may hold a prefill
//! chunk, the observation window's weights over the prefix, then pooling, top-k and the kept-slot bits in
//! the layer's metadata, which the decode plan (`kvs_plan_snap`, launched by this stage) reads.
//!
//! The weights on tensor cores where the kernels hold the cache (f16/bf16, head size a multiple of 16 up
//! to 128, K rows 16-byte aligned): `kvs_snap_lse_mma` (each window row's max and sum over one split of
//! `LSE_SPLIT` positions, a CTA per split) and `kvs_snap_lse_merge` (the splits in order: the row's
//! log-sum-exp), then `kvs_snap_weights_mma` (the weights summed per position over the window, max over the
//! group), K read twice. They agree with the CPU's `snapkv::cpu::choose` within the margin of docs/policies.md ("SnapKV's
//! choice on the device"), not bit for bit. Otherwise (and over FP8 caches, whose keys they read decoded
//! times k_scale, as the CPU) three scalar passes in the CPU's arithmetic (row maxima, fixed-point
//! normalisers, weights), which equal the CPU's choice bit for bit.

use crate::cuda::batch::{BatchArg, Geometry};
use crate::cuda::driver::{check, cuda, CUfunction};
use crate::cuda::kernel_src::{kernel_file, KernelFile};
use crate::cuda::launch::{self, KArgs};
use crate::cuda::stage::{checked, CallShape, CudaStage, StepCx, WsAlloc};
use crate::args::ForwardArgs;
use crate::error::Result;
use crate::layout::KvCache;
use crate::ensure;
use crate::tensor::DType;

/// SnapKV's kernels, compiled in the selection module (the registry's `SELECT_MODULE`).
pub const KERNEL: KernelFile = kernel_file!("snapkv.cu", "policy/snapkv.cu");

/// Positions per CTA and threads of `kvs_snap_scores` (weights_pass.cuh's WP_TP / WP_J).
pub(crate) fn scores_shape(head_dim: usize, group: usize) -> (usize, usize) {
    if head_dim <= 128 {
        (32, 32 * group.min(8))
    } else {
        let j = if group < 8 { group.div_ceil(2) * 2 } else { 8 };
        (16, 16 * j)
    }
}

/// Whether the tensor-core kernels serve this cache: f16/bf16, head size a multiple of 16 up to 128 (the
/// kernels' static shared memory), K rows and their start 16-byte aligned (cp.async). Benchmarks only:
/// `KVS_BENCH_SNAP_SCALAR=1` keeps the scalar phases, the baseline in the same binary.
pub(crate) fn mma_choice(cache: &KvCache) -> bool {
    static SCALAR: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let vec = 8; // elements per 16 bytes
    !*SCALAR.get_or_init(|| std::env::var("KVS_BENCH_SNAP_SCALAR").is_ok_and(|v| v == "1"))
        && matches!(cache.dtype, DType::F16 | DType::BF16)
        && cache.head_dim % 16 == 0
        && cache.head_dim <= 128
        && (cache.k.data as usize) % 16 == 0
        && cache.k.strides()[..3].iter().all(|&s| s as usize % vec == 0)
}

fn clamp(v: usize) -> i32 {
    v.min(i32::MAX as usize) as i32
}

/// The arguments every scoring kernel starts with: batch, query, scale, softcap, K, heads, budget, window.
fn score_args(k: &mut KArgs, a: &ForwardArgs, cache: &KvCache, batch: &BatchArg, budget: usize, window: usize) {
    let (q, kc) = (&a.query, &cache.k);
    k.by_value(batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).f32(a.softcap);
    k.ptr(kc.data).i64(kc.stride(0) as i64).i64(kc.stride(1) as i64).i64(kc.stride(2) as i64).i32(cache.num_kv_heads as i32).i32(clamp(budget)).i32(clamp(window));
}

/// Rows per CTA of `kvs_snap_lse_mma` and positions per CTA of `kvs_snap_weights_mma` (SNM_LROWS, SNM_CW).
const MMA_LSE_ROWS: usize = 32;
const MMA_WEIGHT_POSITIONS: usize = 128;
/// Positions per split of `kvs_snap_lse_mma` (SNM_SPLIT): a 32K prompt's window rows over 16 splits, so the
/// pass runs on hundreds of CTAs instead of 4 per KV head.
const LSE_SPLIT: usize = 2048;
/// Threads (rows) per CTA of `kvs_snap_lse_merge`.
const LSE_MERGE_ROWS: usize = 128;

/// Kernel rows per (sequence, KV head) of the tensor-core passes: the group's heads times the window's tokens
/// rounded up to 16 (SNM_NP), for `rows` observation rows.
fn mma_rows(rows: usize, group: usize) -> usize {
    group * (rows / group).next_multiple_of(16)
}


impl SnapKv {
    /// Enqueues SnapKV's choice for the call's prefill sequences (`rows` observation rows per (sequence,
    /// KV head) fit the workspace regions of `lay`); `keep` is the layer's kept-slot bits.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn snap_choose(
        &self,
        a: &ForwardArgs,
        cache: &KvCache,
        geo: &Geometry,
        group: usize,
        batch: &BatchArg,
        f: impl Fn(&'static str) -> Result<CUfunction>,
        ws: u64,
        lay: &SnapWs,
        rows: usize,
        keep: u64,
        (budget, window, pool): (usize, usize, usize),
    ) -> Result<()> {
        let (hk, g, ns) = (cache.num_kv_heads, group, geo.num_seqs);
        let stream = a.stream;
        let maxpos = geo.max_pos.max(1);
        let common = |k: &mut KArgs| score_args(k, a, cache, batch, budget, window);
        let (lse, agg) = (ws + lay.snap_rmax as u64, ws + lay.snap_agg as u64);
        if mma_choice(cache) {
            let (kr, part) = (mma_rows(rows, g), ws + lay.snap_part as u64);
            let mut k = KArgs::new();
            common(&mut k);
            k.i64(part as i64).i32(lay.lse_splits as i32).i32(rows as i32);
            let x = launch::grid_dim(kr.div_ceil(MMA_LSE_ROWS).saturating_mul(lay.lse_splits), "kvs_snap_lse_mma")?;
            launch::launch(f("kvs_snap_lse_mma")?, (x, hk as u32, ns as u32), 128, &mut k, stream, "kvs_snap_lse_mma launch")?;
            let mut k = KArgs::new();
            k.by_value(batch).i32(hk as i32).i32(clamp(budget)).i32(clamp(window)).i64(part as i64).i32(lay.lse_splits as i32).i64(lse as i64).i32(rows as i32);
            let x = launch::grid_dim(kr.div_ceil(LSE_MERGE_ROWS), "kvs_snap_lse_merge")?;
            launch::launch(f("kvs_snap_lse_merge")?, (x, hk as u32, ns as u32), LSE_MERGE_ROWS as u32, &mut k, stream, "kvs_snap_lse_merge launch")?;
            let mut k = KArgs::new();
            common(&mut k);
            k.i64(lse as i64).i32(rows as i32).i64(agg as i64).i32(maxpos as i32);
            launch::launch(f("kvs_snap_weights_mma")?, (maxpos.div_ceil(MMA_WEIGHT_POSITIONS) as u32, hk as u32, ns as u32), 128, &mut k, stream, "kvs_snap_weights_mma launch")?;
        } else {
            // The scalar phases, in the CPU's arithmetic: row maxima, fixed-point normalisers, weights.
            let n_rows = ns * hk * rows;
            let api = cuda()?;
            // SAFETY: each region holds n_rows elements of its width (SnapWs, sized by the caller).
            unsafe {
                // -inf's order key (kernels/include/decide.cuh kvs_order_key): rows with no visible key stay there.
                check((api.cuMemsetD32Async)(lse, 0x007f_ffff, n_rows, stream), "cuMemsetD32Async")?;
                check((api.cuMemsetD8Async)(ws + lay.snap_z as u64, 0, n_rows * 8, stream), "cuMemsetD8Async")?;
                check((api.cuMemsetD8Async)(ws + lay.snap_bad as u64, 0, n_rows * 4, stream), "cuMemsetD8Async")?;
            }
            let (tp, threads) = scores_shape(cache.head_dim, g);
            for phase in 0..3 {
                let mut k = KArgs::new();
                common(&mut k);
                k.i32(phase).i64(lse as i64).i64((ws + lay.snap_z as u64) as i64).i64((ws + lay.snap_bad as u64) as i64).i32(rows as i32);
                k.i64(agg as i64).i32(maxpos as i32).f32(cache.k_scale);
                launch::launch(f("kvs_snap_scores")?, (maxpos.div_ceil(tp) as u32, hk as u32, ns as u32), threads as u32, &mut k, stream, "kvs_snap_scores launch")?;
            }
        }
        let mut k = KArgs::new();
        k.by_value(batch).i32(hk as i32).i32(clamp(budget)).i32(clamp(window)).i32(clamp(pool)).i32(rows as i32);
        k.i64(agg as i64).i64((ws + lay.snap_pool as u64) as i64).i32(maxpos as i32).i64(keep as i64);
        launch::launch(f("kvs_snap_choose")?, (hk as u32, ns as u32, 1), launch::TOPK_THREADS, &mut k, stream, "kvs_snap_choose launch")
    }
}

/// SnapKV's choice regions in a call's policy workspace (calls that may hold a prefill chunk): per (seq,
/// head) rows' max keys (or log-sum-exps), fixed-point normalisers, NaN flags, the tensor-core pass's
/// (max, sum) per kernel row and split, and the aggregated and pooled scores per position.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SnapWs {
    pub(crate) snap_rmax: usize,
    pub(crate) snap_z: usize,
    pub(crate) snap_bad: usize,
    pub(crate) snap_part: usize,
    pub(crate) snap_agg: usize,
    pub(crate) snap_pool: usize,
    /// Splits of the tensor-core log-sum-exp pass (`LSE_SPLIT` positions each, the last to the end).
    pub(crate) lse_splits: usize,
}

/// SnapKV's stage for one call: the choice at calls that may hold a prefill chunk, then every decode
/// row's plan from the kept-slot bits (`kvs_plan_snap`).
pub(crate) struct SnapKv {
    pub budget: usize,
    pub window: usize,
    pub pool: usize,
    /// Observation rows per (seq, head) and the choice's regions, when the call may hold a prefill chunk.
    choice: Option<(usize, SnapWs)>,
}

impl SnapKv {
    pub(crate) fn new(budget: usize, window: usize, pool: usize) -> Self {
        SnapKv { budget, window, pool, choice: None }
    }
}

impl CudaStage for SnapKv {
    fn reserve(&mut self, cx: &CallShape, ws: &mut WsAlloc) -> Result<()> {
        let (mql, geo, window) = (cx.max_query_len, cx.geo, self.window);
        let (ns, hk, g) = (geo.num_seqs, cx.cfg.num_kv_heads, cx.cfg.group_size());
        // Observation rows per (seq, head): the window's tokens of the longest chunk, times the group.
        if mql == 1 {
            return Ok(());
        }
        let mq = if mql > 0 { mql as usize } else { window };
        let rows = checked(&[window.min(mq).max(1), g])?;
        let lse_splits = geo.max_pos.max(1).div_ceil(LSE_SPLIT);
        let lay = SnapWs {
            snap_rmax: ws.take_n(&[ns, hk, rows, 4])?,
            snap_z: ws.take_n(&[ns, hk, rows, 8])?,
            snap_bad: ws.take_n(&[ns, hk, rows, 4])?,
            snap_part: ws.take_n(&[ns, hk, mma_rows(rows, g), lse_splits, 8])?,
            snap_agg: ws.take_n(&[ns, hk, geo.max_pos.max(1), 4])?,
            snap_pool: ws.take_n(&[ns, hk, geo.max_pos.max(1), 4])?,
            lse_splits,
        };
        self.choice = Some((rows, lay));
        Ok(())
    }

    fn select(&self, cx: &StepCx) -> Result<()> {
        let (a, hk, ns, base) = (cx.a, cx.cfg.num_kv_heads, cx.geo.num_seqs, &cx.base);
        let m = cx.meta.expect("snapkv metadata checked above");
        let keep = m.keep.as_ref().map_or(0, |b| b.ptr);
        ensure!(keep != 0, Internal, "SnapKV's kept-slot bits were not allocated for layer {}", a.layer);
        if let Some((rows, lay)) = &self.choice {
            self.snap_choose(a, cx.cache, cx.geo, cx.cfg.group_size(), &cx.batch, |n| cx.function(n), cx.ws, lay, *rows, keep, (self.budget, self.window, self.pool))?;
        }
        let mut k = KArgs::new();
        k.by_value(&cx.batch).i32(hk as i32).i64(keep as i64);
        k.i64(base.e as i64).i64(base.p_s).i64(base.p_h).i64(base.len as i64).i32(base.cap).i64(cx.row_bytes).i32(cx.count_base).i64(cx.ctr);
        launch::launch_dependent(cx.pdl(), cx.function("kvs_plan_snap")?, (hk as u32, ns as u32, 1), launch::TOPK_THREADS, 0, &mut k, a.stream, "kvs_plan_snap launch")
    }
}
