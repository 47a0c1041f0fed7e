// The cut of the m largest 32-bit keys of a row split over the CTAs of a thread-block cluster (Hopper,
// sm_90): each radix pass's counts summed through distributed shared memory, one cluster barrier per
// pass. Quest's top-k of pages (kernels/policy/quest.cu) and RefreshKV's set rebuild
// (kernels/policy/refresh.cu) at small batch. Compiled only where KVS_CLUSTERS (cluster.cuh).
#pragma once
#include "common.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"
#include "cluster.cuh"

#define QC_CTAS 8  // CTAs per row's cluster: src/cuda/launch.rs CLUSTER_CTAS
#if KVS_CLUSTERS
#define QC_CLUSTER_DIMS __cluster_dims__(QC_CTAS, 1, 1)

// The cut of the m largest candidate keys of the row (forced = lo <= i < hi = last), which the cluster's
// CTAs hold in parts of `per` pages (this CTA: c0 <= i < c1), as topk32 finds it: a radix from below the
// bits every key shares (the cluster's minimum and maximum), 8 bits per pass, that stops once the bin it
// descends into holds exactly the keys still needed; each pass counts its part into xh (two alternating
// 256-bin histograms, so a pass never overwrites counts a CTA may still read from the pass before) and
// sums the QC_CTAS parts through distributed shared memory, one cluster barrier per pass. A tie on the
// whole key is cut by each CTA over its own part: the later CTAs' equal keys go first, then this CTA's
// from its top. The cut is exact for this CTA's pages: c0 <= i < c1 is kept iff key > thr, or key == thr
// and i >= cut. Block-wide, every CTA of the cluster; xw[0..2) are read by the other CTAs.
template <typename KeyOf>
__device__ __forceinline__ TopCut cluster_topk_cut(int lo, int hi, int np, int per, int m, unsigned rank, KeyOf key_of, unsigned* xh, unsigned* xw,
                                                    unsigned* sel, unsigned* wmm, int* cnt) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c0 = max(min((int)rank * per, np), lo), c1 = min(min((int)rank * per + per, np), hi);
    unsigned a0, z0;
    block_key_range(c0, c1, key_of, wmm, a0, z0);
    if (threadIdx.x == 0) {
        xw[0] = a0;
        xw[1] = z0;
    }
    cluster_sync();
    if (warp == 0) {
        const bool peer = lane < QC_CTAS;
        unsigned a = peer ? ld_cluster(&xw[0], lane) : 0xffffffffu, z = peer ? ld_cluster(&xw[1], lane) : 0u;
        a = __reduce_min_sync(0xffffffffu, a);
        z = __reduce_max_sync(0xffffffffu, z);
        // Every candidate of CTA `lane`: its count of keys equal to the maximum when all keys are equal.
        if (peer) sel[4 + lane] = (unsigned)max(min(min(lane * per + per, np), hi) - max(min(lane * per, np), lo), 0);
        if (lane == 0) radix_start(a, z, m, sel);
    }
    __syncthreads();
    unsigned prefix = sel[0];
    int left = (int)sel[1], top = (int)sel[3];
    bool done = false;
    for (int buf = 0; top > 0 && !done; buf ^= 1) {
        const int bits = min(8, top), shift = top - bits, nb = 1 << bits;
        const unsigned himask = top >= 32 ? 0u : (0xffffffffu << top);
        unsigned* part = xh + buf * 256;
        for (int i = threadIdx.x; i < nb; i += blockDim.x) part[i] = 0u;
        __syncthreads();
        for (int i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
            const unsigned k = key_of(i);
            if ((k & himask) == (prefix & himask)) atomicAdd(&part[(k >> shift) & (unsigned)(nb - 1)], 1u);
        }
        cluster_sync();
        // Bins from the top (thread t holds bin nb - 1 - t), summed over the CTAs and scanned: the bin
        // where the count crosses `left`, with each CTA's count in it.
        unsigned v[QC_CTAS];
        int c = 0;
#pragma unroll
        for (int q = 0; q < QC_CTAS; ++q) {
            v[q] = (int)threadIdx.x < nb ? ld_cluster(&part[nb - 1 - threadIdx.x], q) : 0u;
            c += (int)v[q];
        }
        int total;
        const int excl = block_excl_scan(c, cnt, total);
        if (radix_cross(c, excl, (unsigned)(nb - 1 - threadIdx.x), shift, prefix, left, sel)) {
#pragma unroll
            for (int q = 0; q < QC_CTAS; ++q) sel[4 + q] = v[q];
        }
        __syncthreads();
        radix_descend(sel, prefix, left, done);
        top = shift;
    }
    TopCut r{prefix, c0};  // done: every key of the bin is kept
    if (!done) {
        // sel[4 + q]: CTA q's keys equal to `prefix`, of which the `left` latest are kept.
        int after = 0;
        for (int q = (int)rank + 1; q < QC_CTAS; ++q) after += (int)sel[4 + q];
        const int mine = (int)sel[4 + rank];
        if (after >= left)
            r.cut = c1;
        else if (after + mine > left)
            r.cut = tie_cut(c0, c1, left - after, prefix, key_of, cnt, sel);
    }
    __syncthreads();  // sel is free again
    return r;
}

// A cluster kernel's shared scratch for cluster_topk_cut and what follows it (each kernel declares it
// once, QC_SCRATCH): `threads` per CTA (at least 256: a thread per bin of a pass).
struct QcScratch {
    unsigned* xh;  // [2 * 256] this CTA's counts of a radix pass, read by the cluster
    unsigned* xw;  // [4] this CTA's words read by the cluster: key minimum, maximum; kept entries
    unsigned* sel;  // [4 + QC_CTAS]
    unsigned* wmm;  // [64]
    int* cnt;       // [threads / 32 + 1]
    unsigned long long* red;  // [32]
};
#define QC_SCRATCH_N(threads)                                                       \
    __shared__ unsigned qc_xh[2 * 256], qc_xw[4], qc_sel[4 + QC_CTAS], qc_wmm[64]; \
    __shared__ int qc_cnt[(threads) / 32 + 1];                                     \
    __shared__ unsigned long long qc_red[32];                                      \
    const QcScratch xs{qc_xh, qc_xw, qc_sel, qc_wmm, qc_cnt, qc_red}

// The cluster's CTAs' counts `mine` (each CTA's; every thread of it passes the same) summed over the ranks
// before this CTA's (`higher`: the ranks after it) into x.sel[0], and over all ranks into x.sel[1]. One
// cluster barrier; x.xw[2] is read by the other CTAs. Block-wide, every CTA of the cluster.
__device__ __forceinline__ void cluster_rank_prefix(unsigned mine, unsigned rank, bool higher, const QcScratch& x) {
    if (threadIdx.x == 0) x.xw[2] = mine;
    cluster_sync();
    if (threadIdx.x < 32) {
        const unsigned v = threadIdx.x < QC_CTAS ? ld_cluster(&x.xw[2], threadIdx.x) : 0u;
        const bool before = higher ? threadIdx.x > rank : threadIdx.x < rank;
        const unsigned b = __reduce_add_sync(0xffffffffu, before ? v : 0u), sum = __reduce_add_sync(0xffffffffu, v);
        if (threadIdx.x == 0) {
            x.sel[0] = b;
            x.sel[1] = sum;
        }
    }
    __syncthreads();
}
#else
#define QC_CLUSTER_DIMS
#endif
