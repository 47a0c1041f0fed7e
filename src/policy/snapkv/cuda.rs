//! SnapKV's choice on the CUDA backend (kernels/snapkv.cu): at a call that may hold a prefill chunk, the
//! observation window's weights over the prefix (three passes over the keys: row maxima, fixed-point
//! normalisers, weights summed per position), then pooling, top-k and the kept-slot bits in the layer's
//! metadata, which the decode plan (`kvs_plan_snap`, launched by `sparse.rs`) reads. Same decisions as
//! the CPU's `cpu::snapkv::choose`, bit for bit.

use crate::cuda::backend::{CudaBackend, Geometry};
use crate::cuda::driver::{check, cuda, CUfunction};
use crate::cuda::launch::{self, KArgs};
use crate::cuda::sparse::{BatchArg, WsLayout};
use crate::args::ForwardArgs;
use crate::error::Result;
use crate::layout::KvCache;

/// Positions per CTA and threads of `kvs_snap_scores` (the kernel's SNAP_TP / SNAP_J).
pub(crate) fn scores_shape(head_dim: usize, group: usize) -> (usize, usize) {
    if head_dim <= 128 {
        (32, 32 * group.min(8))
    } else {
        let j = if group < 8 { group.div_ceil(2) * 2 } else { 8 };
        (16, 16 * j)
    }
}

impl CudaBackend {
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
        lay: &WsLayout,
        rows: usize,
        keep: u64,
        (budget, window, pool): (usize, usize, usize),
    ) -> Result<()> {
        let (hk, d, g, ns) = (cache.num_kv_heads, cache.head_dim, group, geo.num_seqs);
        let stream = a.stream;
        let n_rows = ns * hk * rows;
        let api = cuda()?;
        // SAFETY: each region holds n_rows elements of its width (WsLayout, sized by the caller).
        unsafe {
            // -inf's order key (kernels/include/decide.cuh kvs_order_key): rows with no visible key stay there.
            check((api.cuMemsetD32Async)(ws + lay.snap_rmax as u64, 0x007f_ffff, n_rows, stream), "cuMemsetD32Async")?;
            check((api.cuMemsetD8Async)(ws + lay.snap_z as u64, 0, n_rows * 8, stream), "cuMemsetD8Async")?;
            check((api.cuMemsetD8Async)(ws + lay.snap_bad as u64, 0, n_rows * 4, stream), "cuMemsetD8Async")?;
        }
        let clamp = |v: usize| v.min(i32::MAX as usize) as i32;
        let (tp, threads) = scores_shape(d, g);
        let q = &a.query;
        let kc = &cache.k;
        let maxpos = geo.max_pos.max(1);
        for phase in 0..3 {
            let mut k = KArgs::new();
            k.by_value(batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).f32(a.softcap);
            k.ptr(kc.data).i64(kc.stride(0) as i64).i64(kc.stride(1) as i64).i64(kc.stride(2) as i64).i32(hk as i32).i32(clamp(budget)).i32(clamp(window));
            k.i32(phase).i64((ws + lay.snap_rmax as u64) as i64).i64((ws + lay.snap_z as u64) as i64).i64((ws + lay.snap_bad as u64) as i64).i32(rows as i32);
            k.i64((ws + lay.snap_agg as u64) as i64).i32(maxpos as i32);
            launch::launch(f("kvs_snap_scores")?, (maxpos.div_ceil(tp) as u32, hk as u32, ns as u32), threads as u32, &mut k, stream, "kvs_snap_scores launch")?;
        }
        let mut k = KArgs::new();
        k.by_value(batch).i32(hk as i32).i32(clamp(budget)).i32(clamp(window)).i32(clamp(pool)).i32(rows as i32);
        k.i64((ws + lay.snap_agg as u64) as i64).i64((ws + lay.snap_pool as u64) as i64).i32(maxpos as i32).i64(keep as i64);
        launch::launch(f("kvs_snap_choose")?, (hk as u32, ns as u32, 1), launch::TOPK_THREADS, &mut k, stream, "kvs_snap_choose launch")
    }
}
