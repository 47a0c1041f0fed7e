// Page bounds: a page's score as the upper bound of q.k from its channel-wise key bounds (min/max, as the
// cache write lays them out, kernels/meta.cu), and one row's top-k of pages by that score; shared by
// Quest's selection (policy/quest.cu) and PRR's (policy/speculate.cu).
#pragma once
#include "common.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"

#define QC (HEAD_DIM / 16)  // channels per lane
#define QS_THREADS 256
#define QS_PAGES 64
// Issuing four pages' bound loads into registers first was measured slower on the H100 (selection 961
// against 633 us at batch 32, 128K: the registers cut the occupancy); page_score_tile stages them in
// shared memory by cp.async instead.
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

// Pages staged in shared memory per round of page_score_tile's page-per-unit path: 32 KiB of bounds.
#define QS_ROUND (HEAD_DIM <= 128 ? 64 : 32)

__device__ __forceinline__ void page_cp_async16(void* dst, const void* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

// One round of a tile's page bounds into shared memory (both scorers, unit == page): sbase[j] the offset
// of page tile0 + j's bounds, or -1 (outside the row, an unmapped block), then the page's [min | max] row
// copied by cp.async to `rows + j * stride`. Returns the pages inside the row this thread looked up (for
// CTR_KV_BYTES). The caller waits for the copies (cp.async.wait_all) and syncs. Block-wide.
__device__ __forceinline__ unsigned long long page_stage_round(const Batch& b, int s, int h, int hk, const u16* qmin, const u16* qmax, int upb, int fp,
                                                                int np, int maxp, int tile0, int round, i64* sbase, u16* rows, int stride) {
    unsigned long long units = 0;
    for (int j = threadIdx.x; j < round; j += blockDim.x) {
        const int i = tile0 + j;
        const bool active = i < np && i < maxp;
        units += active;
        const i64 pb = active ? phys_block(b, s, (fp + i) / upb) : -1;
        sbase[j] = pb < 0 ? -1 : ((pb * upb + (fp + i) % upb) * hk + h) * (i64)HEAD_DIM;
    }
    __syncthreads();
    // A warp copies one page's [min | max] row at a time, lane x its 16-byte chunk x (and x + 32): the
    // chunk's source and destination offsets are the lane's for every page, computed once.
    constexpr int CH = HEAD_DIM / 8;  // 16-byte chunks of one bound row
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int x = lane; x < 2 * CH; x += 32) {
        const int mx = x / CH, ch = x % CH;
        const u16* src = (mx ? qmax : qmin) + ch * 8;
        u16* dst = rows + mx * HEAD_DIM + ch * 8;
        for (int j = warp; j < round; j += nw) {
            const i64 base = sbase[j];
            if (base >= 0) page_cp_async16(dst + j * stride, src + base);
        }
    }
    return units;
}

// One page's score from a lane's channels of its min and max (`lo`, `hi`): for each query row of the
// group, the lane's sum of max(q * min, q * max) over its channels in order, a butterfly over the
// half-warp, and the maximum over the rows, the CPU's quest_bound order. Half-warp-wide.
__device__ __forceinline__ float page_bound(const float (&qv)[GROUP][QC], const float* lo, const float* hi, unsigned hmask) {
    float best = -INFINITY;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < QC; ++k) acc += fmaxf(qv[g][k] * lo[k], qv[g][k] * hi[k]);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) acc += __shfl_xor_sync(hmask, acc, o);
        best = fmaxf(best, acc);
    }
    return best;
}

// One CTA's tile of QS_PAGES pages of row (s, h) (tile blockIdx.x), scored as the CPU's quest_page_scores
// (select.cu, kvs_quest_scores, says how): `put(i, score)` is called once per page i of the tile inside
// the row, by one lane. `qs` is shared scratch of GROUP * 16 * (QC + 1) floats. Returns the units this
// thread read (for CTR_KV_BYTES). All threads of the CTA call this.
// Where a page is one metadata unit (the common case, page == block's unit), the tile's bounds are copied
// into shared memory by cp.async first, every page's at once: the bytes in flight then cost no registers,
// so an SM keeps enough of them in flight to read the bounds near copy bandwidth (one load per page and
// half-warp at a time left it latency-bound, 22-29% of it on the H200). The arithmetic is unchanged.
template <typename Put>
__device__ __forceinline__ unsigned long long page_score_tile(const Batch& b, const SeqRow& r, int s, int h, const elem_t* q, i64 q0, i64 q1, i64 q2,
                                                               float scale, int hk, const u16* qmin, const u16* qmax, int unit, int upb, int page,
                                                               int maxp, float* qs, Put put) {
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, c = i % HEAD_DIM;
        qs[g * 16 * (QC + 1) + (c % 16) * (QC + 1) + c / 16] = ET::ld(q[(i64)r.t * q0 + (i64)(h * GROUP + g) * q1 + (i64)c * q2]) * scale;
    }
    __syncthreads();
    const int lane = threadIdx.x & 15, hw = threadIdx.x >> 4;
    const unsigned hmask = 0xffffu << (16 * (hw & 1));
    const int fp = r.lo / page, np = r.hi / page - fp + 1;
    float qv[GROUP][QC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
        for (int k = 0; k < QC; ++k) qv[g][k] = qs[g * 16 * (QC + 1) + lane * (QC + 1) + k];
    unsigned long long units = 0;
    float lo_[QC], hi_[QC];
    if (unit == page) {
        __shared__ __align__(16) u16 sb[QS_ROUND][2][HEAD_DIM];
        __shared__ i64 sbase[QS_ROUND];
        for (int r0 = 0; r0 < QS_PAGES; r0 += QS_ROUND) {
            const int tile0 = blockIdx.x * QS_PAGES + r0;
            if (r0 > 0) __syncthreads();  // the previous round's rows are read
            units += page_stage_round(b, s, h, hk, qmin, qmax, upb, fp, np, maxp, tile0, QS_ROUND, sbase, &sb[0][0][0], 2 * HEAD_DIM);
            asm volatile("cp.async.wait_all;" ::: "memory");
            __syncthreads();
            // Every half-warp runs the same trip count, so the butterflies use the full warp's mask (a
            // half-warp mask made the compiler wrap each shuffle in a divergence loop); a page outside
            // the row is summed from whatever its shared row holds and dropped.
            for (int j = hw; j < QS_ROUND; j += QS_THREADS / 16) {
                const int i = tile0 + j;  // the same for the half-warp
                const bool active = i < np && i < maxp;
                load_lane_bounds(&sb[j][0][lane * QC], lo_);
                load_lane_bounds(&sb[j][1][lane * QC], hi_);
                const float best = page_bound(qv, lo_, hi_, 0xffffffffu);
                if (active && lane == 0) put(i, sbase[j] >= 0 ? best : -INFINITY);
            }
        }
        return units;
    }
    for (int pi = 0; pi < QS_PAGES / 16; ++pi) {
        const int i = blockIdx.x * QS_PAGES + pi * 16 + hw;
        const bool active = i < np && i < maxp;
        const int pg = fp + i;
        const int a = max(pg * page, r.lo), z = active ? min((pg + 1) * page, r.hi + 1) : 0;
        float best = -INFINITY;
        for (int u0 = a / unit; u0 * unit < z; ++u0) {
            units += lane == 0;
            const i64 pb = phys_block(b, s, u0 / upb);
            if (pb < 0) continue;
            const i64 base = ((pb * upb + u0 % upb) * hk + h) * (i64)HEAD_DIM + lane * QC;
            load_lane_bounds(qmin + base, lo_);
            load_lane_bounds(qmax + base, hi_);
            best = fmaxf(best, page_bound(qv, lo_, hi_, hmask));
        }
        if (active && lane == 0) put(i, best);
    }
    return units;
}

// The units a CTA read, into CTR_KV_BYTES once per CTA (same-address atomics from every thread would
// serialize in L2). Block-wide.
__device__ __forceinline__ void page_count_units(unsigned long long units, unsigned long long* red, unsigned long long* ctr) {
    units = block_sum(units, red);
    if (threadIdx.x == 0) atomicAdd(&ctr[CTR_KV_BYTES], units * (2 * HEAD_DIM * 2));
}

// One row's Quest plan (the body of kvs_quest_topk, shared with PRR's kvs_prr_select): writes the plan
// entries to e and returns their count, or -1 for a sequence that is not a decode row. Block-wide.
__device__ __forceinline__ int page_topk_row(const Batch& b, const SeqRow& r, int s, int h, int hk, int budget, int page, int sink, const float* scores,
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
