// Quest's page bounds as the cache write lays them out (kernels/meta.cu) and one row's Quest top-k,
// shared by Quest's selection (select.cu) and PRR's (prr.cu).
#pragma once
#include "common.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"

#define QC (HEAD_DIM / 16)  // channels per lane
#define QS_THREADS 256
#define QS_PAGES 64
// Pages are scored one at a time per half-warp: issuing four pages' bound loads first was measured slower
// on the H100 (selection 961 against 633 us at batch 32, 128K; docs/perf.md) and was removed.
__device__ __forceinline__ void load_lane_bounds(const u16* p, float* v) {
#if QC % 8 == 0
#pragma unroll
    for (int k8 = 0; k8 < QC / 8; ++k8) {
        const uint4 w = reinterpret_cast<const uint4*>(p)[k8];
        const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k8 * 8 + k] = kvs_f16_to_f32((u16)(ws[k / 2] >> (16 * (k % 2))));
    }
#elif QC % 4 == 0
#pragma unroll
    for (int k4 = 0; k4 < QC / 4; ++k4) {
        const uint2 w = reinterpret_cast<const uint2*>(p)[k4];
        const unsigned ws[2] = {w.x, w.y};
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k4 * 4 + k] = kvs_f16_to_f32((u16)(ws[k / 2] >> (16 * (k % 2))));
    }
#elif QC % 2 == 0
#pragma unroll
    for (int k2 = 0; k2 < QC / 2; ++k2) {
        const unsigned w = reinterpret_cast<const unsigned*>(p)[k2];
        v[2 * k2] = kvs_f16_to_f32((u16)w);
        v[2 * k2 + 1] = kvs_f16_to_f32((u16)(w >> 16));
    }
#else
#pragma unroll
    for (int k = 0; k < QC; ++k) v[k] = kvs_f16_to_f32(p[k]);
#endif
}

// One row's Quest plan (the body of kvs_quest_topk, shared with PRR's kvs_prr_select): writes the plan
// entries to e and returns their count, or -1 for a sequence that is not a decode row. Block-wide.
__device__ __forceinline__ int quest_topk_row(const Batch& b, const SeqRow& r, int s, int h, int hk, int budget, int page, int sink, const float* scores,
                                              int maxp, unsigned* e, int cap, int smem_keys, unsigned* skey, unsigned* hist, unsigned* sel, int* cnt) {
    if (!r.decode) return -1;
    if (r.hi < r.lo) return 0;
    const int fp = r.lo / page;
    const int np = min(r.hi / page - fp + 1, maxp);
    const int k = max(budget / page + (budget % page != 0), 1);
    const float* sc = scores + (i64)(s * hk + h) * maxp;
    if (np <= k) {
        const int n = min(np, cap);
        for (int i = threadIdx.x; i < n; i += blockDim.x) e[i] = fp + i;
        return n;
    }
    const int last = np - 1;
    const int sinkp = sink / page + (sink % page != 0);
    const int forced = min(max(sinkp - fp, 0), last);
    const int m = min(max(k - 1 - forced, 0), last - forced);
    const bool staged = np <= smem_keys;
    if (staged)
        for (int i = threadIdx.x; i < np; i += blockDim.x) skey[i] = kvs_order_key(sc[i]);
    __syncthreads();
    // Candidates forced <= i < last, larger order key first (higher score; equal scores: the later page).
    auto key_of = [&](int i) { return staged ? skey[i] : kvs_order_key(sc[i]); };
    TopCut tc{0u, last};
    if (m > 0) tc = topk32(forced, last, m, key_of, hist, cnt, sel);
    auto keep = [&](int i) {
        if (i < forced || i == last) return true;
        if (m == 0) return false;
        const unsigned kk = key_of(i);
        return kk > tc.thr || (kk == tc.thr && i >= tc.cut);
    };
    return compact(np, keep, [&](int i) { return (unsigned)(fp + i); }, e, cap, cnt);
}
