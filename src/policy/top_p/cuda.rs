//! Twilight's top-p on the CUDA backend (kernels/policy/top_p.cu): INT4 estimates of the logits of the
//! selector's candidates, then per (sequence, KV head) the shortest prefix by weight reaching mass `p`,
//! written as the final plan (tokens). The selector writes its plans into this stage's regions.
//!
//! The search is a radix select on the weights, 8 bits per pass, each pass a launch over tiles of every
//! row (the launches are the barriers between passes): a long row is spread over many CTAs instead of one
//! CTA per (sequence, KV head), and a batch of many rows over fewer CTAs per row. At small batch on Hopper
//! the steps after the estimate are one launch instead (`kvs_topp_cluster`): a thread-block cluster per row
//! holds the row's estimates in shared memory, and cluster barriers replace the launches between passes
//! (seven launches of ~10-40 us each were a latency chain at batch 1).

use crate::cuda::kernel_src::{kernel_file, KernelFile};
use crate::cuda::launch::{self, KArgs, CLUSTER_CTAS};
use crate::cuda::stage::{CallShape, CudaStage, StepCx, WsAlloc};
use crate::error::Result;

/// Top-p's kernels, compiled in the selection module (the registry's `SELECT_MODULE`).
pub const KERNEL: KernelFile = kernel_file!("top_p.cu", "policy/top_p.cu");

/// The kernels' threads, candidates per pass of the later kernels' loops (`TOPP_CHUNK`), the radix passes
/// and the search states per row (top_p.cu's defines).
const THREADS: usize = 256;
const CHUNK: usize = 4 * THREADS;
/// About how many CTAs a launch of the later kernels should have: enough for every SM several times over
/// (132 on an H100), few enough that each CTA's fixed cost (a histogram read, the digit's choice) stays
/// small next to its candidates.
const TARGET_CTAS: usize = 1024;
const PASSES: usize = 4;
const STATES: usize = PASSES + 1;
/// Threads per CTA of `kvs_topp_cluster` (top_p.cu TOPP_CL_THREADS; H200: 512 against 256 and 1,024, journal 2026-11-28).
const CLUSTER_THREADS: u32 = 512;
/// Static shared memory of `kvs_topp_cluster`, at most (its scratch: a few KiB at 16 query rows per KV head).
const CLUSTER_STATIC_SMEM: usize = 8 << 10;

/// Dynamic shared memory of `kvs_topp_cluster` for `group` query rows per KV head and `per` candidates per
/// CTA: two pass buffers and the merged pass (256 bins x group u64 each), the weights per query row and
/// their maximum (f32 per candidate).
fn cluster_smem(group: usize, per: usize) -> usize {
    (3 * 256 * 8usize).saturating_mul(group).saturating_add((group + 1).saturating_mul(per).saturating_mul(4))
}

/// Candidates per CTA of the estimate (`etile`: 1, 2 or 4 per thread): as many as keep at least 4 CTAs per SM
/// (the estimate is a chain of dependent f32 operations per candidate, so a batch of few rows needs more,
/// smaller CTAs in flight; many rows amortise each CTA's query load over 4 per thread).
fn estimate_tile(rows: usize, maxc: usize, num_sms: usize) -> usize {
    [4, 2].into_iter().find(|&per| rows.saturating_mul(maxc.div_ceil(THREADS * per)) >= 4 * num_sms.max(1)).unwrap_or(1) * THREADS
}

/// Whether the estimate runs on tensor cores (`kvs_topp_estimate_mma`, top_p.cu's `TE_FITS`): head sizes
/// a multiple of 32, at most 16 query heads per KV head. Its logits agree with the CPU's within the bound
/// of docs/policies.md instead of bit for bit; `KVS_TOPP_SCALAR_ESTIMATE=1` keeps the scalar kernel (the
/// CPU's operations) everywhere, for tests and comparisons.
fn estimate_on_tensor_cores(head_dim: usize, group: usize) -> bool {
    static SCALAR: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let scalar = *SCALAR.get_or_init(|| std::env::var("KVS_TOPP_SCALAR_ESTIMATE").is_ok_and(|v| v == "1"));
    !scalar && head_dim % 32 == 0 && group <= 16
}

/// Whether the steps after the estimate run as one cluster launch: on sm_90 and newer, where a CTA's part of
/// a row fits in shared memory, while the rows' clusters fit in one wave of one CTA per SM (more rows fill
/// the device with the tiled kernels). `KVS_TOPP_CLUSTER=0` / `=1` forces the tiled kernels / the cluster
/// wherever it can run (so that tests cover both paths).
fn use_cluster(cc_major: i32, rows: usize, num_sms: usize, fits: bool) -> bool {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = launch::env_choice(&FORCED, "KVS_TOPP_CLUSTER", "0", "1");
    cc_major >= 9 && fits && forced.unwrap_or(launch::clusters_fit_one_wave(rows, num_sms))
}

/// Top-p's stage for one call, and its workspace regions (top_p.cu's `TOPP_PARAMS` describes each).
pub(crate) struct TopPStage {
    pub p: f32,
    /// Candidates per row (a multiple of 4).
    maxc: usize,
    /// The selector's plans and their lengths.
    base: usize,
    base_len: usize,
    /// The estimates `[seqs][kv_heads][group][maxc]` f32, the aggregated weights `[seqs][kv_heads][maxc]`
    /// f32, and the search's scratch.
    logits: usize,
    w: usize,
    tmax: usize,
    psum: usize,
    rown: usize,
    hist: usize,
    state: usize,
    tsum: usize,
    flags: usize,
}

impl TopPStage {
    pub(crate) fn new(p: f32) -> Self {
        TopPStage { p, maxc: 0, base: 0, base_len: 0, logits: 0, w: 0, tmax: 0, psum: 0, rown: 0, hist: 0, state: 0, tsum: 0, flags: 0 }
    }
}

impl CudaStage for TopPStage {
    fn reserve(&mut self, cx: &CallShape, ws: &mut WsAlloc) -> Result<()> {
        let (ns, hk, g) = (cx.geo.num_seqs, cx.cfg.num_kv_heads, cx.cfg.group_size());
        self.maxc = cx.candidates();
        let (etiles, stiles) = (self.maxc.div_ceil(THREADS), self.maxc.div_ceil(CHUNK));  // the smallest estimate tile
        self.base = ws.take_n(&[cx.rows_of(&cx.base), cx.base.cap, 4])?;
        self.base_len = ws.take_n(&[ns, hk, 4])?;
        self.logits = ws.take_n(&[ns, hk, g, self.maxc, 4])?;
        self.w = ws.take_n(&[ns, hk, self.maxc, 4])?;
        self.tmax = ws.take_n(&[ns, hk, etiles, g, 4])?;
        self.psum = ws.take_n(&[ns, hk, stiles, g, 8])?;
        self.rown = ws.take_n(&[ns, hk, 2, g, 4])?;
        self.hist = ws.take_n(&[ns, hk, PASSES, 256, g, 8])?;
        // TopPState: t, pad, above[g] u64, target[g] f64; TopPTile: gt, ties, mass[g] u64.
        self.state = ws.take_n(&[ns, hk, STATES, 8 + 16 * g])?;
        self.tsum = ws.take_n(&[ns, hk, stiles, 8 + 8 * g])?;
        self.flags = ws.take_n(&[ns, hk, 2, 4])?;
        Ok(())
    }

    fn base_plan(&self) -> Option<(usize, usize)> {
        Some((self.base, self.base_len))
    }

    fn select(&self, cx: &StepCx) -> Result<()> {
        let (hk, ns, d, stream) = (cx.cfg.num_kv_heads, cx.geo.num_seqs, cx.cfg.head_dim, cx.a.stream);
        let (a, base_ref, fin_ref, maxc) = (cx.a, &cx.base, &cx.fin, self.maxc);
        let m = cx.meta.expect("int4 metadata checked above");
        let (codes, qparams) = (m.codes.as_ref().map_or(0, |b| b.ptr), m.qparams.as_ref().map_or(0, |b| b.ptr));
        // Chunks per CTA (a CTA's tile): rows x chunks spread over about TARGET_CTAS CTAs.
        let chunks = maxc.div_ceil(CHUNK);
        let spt = (ns * hk * chunks).div_ceil(TARGET_CTAS).clamp(1, chunks.max(1));
        let gpu = cx.dev.gpu();
        let etile = estimate_tile(ns * hk, maxc, gpu.num_sms.max(0) as usize);
        // Every kernel's leading parameters (top_p.cu's TOPP_PARAMS).
        let common = || {
            let mut k = KArgs::new();
            k.by_value(&cx.batch).i32(hk as i32);
            k.i64(base_ref.e as i64).i64(base_ref.p_s).i64(base_ref.p_h).i64(base_ref.len as i64).i32(base_ref.ulog2).i32(maxc as i32);
            for off in [self.logits, self.w, self.tmax, self.psum, self.rown, self.hist, self.state, self.tsum, self.flags] {
                k.i64((cx.ws + off as u64) as i64);
            }
            k.i32(spt as i32).i32(etile as i32);
            k
        };
        let tiles = |per: usize| (maxc.div_ceil(per) as u32, hk as u32, ns as u32);
        // Every kernel starts with KVS_GRID_WAIT(): dependent launches where the GPU has them.
        let pdl = cx.pdl();
        let q = &a.query;
        let mut k = common();
        k.ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale);
        k.i64(codes as i64).i64(qparams as i64).f32(a.softcap);
        let estimate = if estimate_on_tensor_cores(d, cx.cfg.group_size()) { "kvs_topp_estimate_mma" } else { "kvs_topp_estimate" };
        launch::launch_dependent(pdl, cx.function(estimate)?, tiles(etile), THREADS as u32, 0, &mut k, stream, "kvs_topp_estimate launch")?;
        let smem = cluster_smem(cx.cfg.group_size(), maxc.div_ceil(CLUSTER_CTAS).next_multiple_of(4));
        let dyn_max = (gpu.smem_optin.max(0) as usize).saturating_sub(CLUSTER_STATIC_SMEM);
        if use_cluster(gpu.cc.0, ns * hk, gpu.num_sms.max(0) as usize, smem <= dyn_max) {
            let f = cx.function("kvs_topp_cluster")?;
            cx.dev.allow_smem_once(f, dyn_max)?;
            let mut k = KArgs::new();
            k.by_value(&cx.batch).i32(hk as i32);
            k.i64(base_ref.e as i64).i64(base_ref.p_s).i64(base_ref.p_h).i64(base_ref.len as i64).i32(base_ref.ulog2).i32(maxc as i32);
            k.i64((cx.ws + self.logits as u64) as i64).i64((cx.ws + self.tmax as u64) as i64).i32(etile as i32).f32(self.p);
            k.i64(fin_ref.e as i64).i64(fin_ref.p_s).i64(fin_ref.p_h).i64(fin_ref.len as i64).i32(fin_ref.cap).i64(cx.row_bytes).i64((d / 2 + 4) as i64).i64(cx.ctr);
            let grid = ((hk * CLUSTER_CTAS) as u32, ns as u32, 1);
            return launch::launch_dependent(pdl, f, grid, CLUSTER_THREADS, smem as u32, &mut k, stream, "kvs_topp_cluster launch");
        }
        for name in ["kvs_topp_norm", "kvs_topp_weights"] {
            launch::launch_dependent(pdl, cx.function(name)?, tiles(CHUNK * spt), THREADS as u32, 0, &mut common(), stream, name)?;
        }
        for pass in 1..=PASSES as i32 {
            let mut k = common();
            k.f32(self.p).i32(pass);
            launch::launch_dependent(pdl, cx.function("kvs_topp_pass")?, tiles(CHUNK * spt), THREADS as u32, 0, &mut k, stream, "kvs_topp_pass launch")?;
        }
        let mut k = common();
        k.f32(self.p);
        k.i64(fin_ref.e as i64).i64(fin_ref.p_s).i64(fin_ref.p_h).i64(fin_ref.len as i64).i32(fin_ref.cap).i64(cx.row_bytes).i64((d / 2 + 4) as i64).i64(cx.ctr);
        launch::launch_dependent(pdl, cx.function("kvs_topp_write")?, tiles(CHUNK * spt), THREADS as u32, 0, &mut k, stream, "kvs_topp_write launch")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_path_only_on_hopper_where_a_part_fits_and_the_clusters_fill_one_wave() {
        // 1 x 128K at budget L/4, GQA 4: 4,096 candidates per CTA, 104 KiB of an H100's 227 KiB.
        assert_eq!(cluster_smem(4, 4096), 106_496);
        assert_eq!(cluster_smem(4, usize::MAX / 2), usize::MAX, "saturates: never a small size that would fit");
        if std::env::var_os("KVS_TOPP_CLUSTER").is_some() {
            return;  // forced either way
        }
        assert!(use_cluster(9, 8, 132, true));
        assert!(!use_cluster(9, 17, 132, true), "136 CTAs on 132 SMs: the tiled kernels");
        assert!(!use_cluster(8, 8, 132, true), "no clusters before sm_90");
        assert!(!use_cluster(9, 8, 132, false), "a CTA's part does not fit in shared memory");
    }

    #[test]
    fn the_estimate_takes_tensor_cores_where_top_p_cu_compiles_them() {
        if std::env::var_os("KVS_TOPP_SCALAR_ESTIMATE").is_some() {
            return;  // forced
        }
        // top_p.cu's TE_FITS: HEAD_DIM % 32 == 0 && GROUP <= 16.
        for (d, g, fits) in [(64, 1, true), (96, 8, true), (128, 4, true), (256, 16, true), (80, 4, false), (112, 2, false), (128, 17, false)] {
            assert_eq!(estimate_on_tensor_cores(d, g), fits, "head {d}, group {g}");
        }
    }

    #[test]
    fn estimate_tiles_shrink_until_the_device_has_four_ctas_per_sm() {
        // 32/8 heads, Quest(L/4) candidates, 132 SMs.
        assert_eq!(estimate_tile(8, 8192, 132), 256, "1 x 32K: 256 CTAs of one candidate per thread");
        assert_eq!(estimate_tile(8, 32768, 132), 256, "1 x 128K: 1,024 CTAs");
        assert_eq!(estimate_tile(64, 8192, 132), 512, "8 x 32K: 1,024 CTAs of two per thread");
        assert_eq!(estimate_tile(64, 32768, 132), 1024, "8 x 128K: 2,048 CTAs of four per thread");
        assert_eq!(estimate_tile(0, 0, 0), 256);
    }
}
