// The scalar passes that weigh positions by attention (softmax weights of a window of query rows over the
// keys): decision_dot in lane order, the CTA shape, the fixed-point softmax normaliser's unit, and the
// row maximum / normaliser reductions. Shared by SnapKV's choice (policy/snapkv.cu), RefreshKV's full step
// (policy/refresh.cu) and the AttentionPredictor's history rows (policy/predictor.cu).
#pragma once
#include "common.cuh"
#include "decide.cuh"

// Positions per CTA and query heads served side by side: 32 x min(GROUP, 8) threads; at head sizes
// above 128, 16 positions (the K tile stays in static shared memory) and an even count of query heads
// (whole warps: the reductions run over one head's WP_TP lanes). src/cuda/sparse.rs repeats this.
#if HEAD_DIM <= 128
#define WP_TP 32
#define WP_J (GROUP < 8 ? GROUP : 8)
#else
#define WP_TP 16
#define WP_J (GROUP < 8 ? ((GROUP + 1) / 2) * 2 : 8)
#endif
#define WP_KPER ((GROUP + WP_J - 1) / WP_J)  // query heads per thread
#define WP_THREADS (WP_TP * WP_J)
#define WP_NORM_ONE 4398046511104.0  // 2^42, math::NORM_FIXED_ONE

// decision_dot: eight lane sums over c = l (mod 8), each product rounded, then the lanes in order. Both
// rows 16-byte aligned (float4 reads; the callers' K tiles are rows of HEAD_DIM + 4 floats, WP_KS_PITCH).
#define WP_KS_PITCH (HEAD_DIM + 4)
__device__ __forceinline__ float wp_dot(const float* q, const float* k) {
    float acc[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) acc[l] = 0.0f;
    for (int c = 0; c < HEAD_DIM; c += 8) {
        const float4 qa = *reinterpret_cast<const float4*>(q + c), qb = *reinterpret_cast<const float4*>(q + c + 4);
        const float4 ka = *reinterpret_cast<const float4*>(k + c), kb = *reinterpret_cast<const float4*>(k + c + 4);
        acc[0] += qa.x * ka.x;
        acc[1] += qa.y * ka.y;
        acc[2] += qa.z * ka.z;
        acc[3] += qa.w * ka.w;
        acc[4] += qb.x * kb.x;
        acc[5] += qb.y * kb.y;
        acc[6] += qb.z * kb.z;
        acc[7] += qb.w * kb.w;
    }
    float s = acc[0];
#pragma unroll
    for (int l = 1; l < 8; ++l) s += acc[l];
    return s;
}

__device__ __forceinline__ float wp_unkey(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Phase 0 of the scalar weights passes (snapkv.cu, refresh.cu, predictor.cu): the largest logit `l` over
// one head's WP_TP lanes (fmaxf drops NaN, as f32::max) into *rmax as an order key, by the lane that
// `lead`s. All WP_TP lanes call it.
__device__ __forceinline__ void wp_row_max(float l, bool lead, unsigned* rmax) {
    float m = l;
#pragma unroll
    for (int off = WP_TP / 2; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lead && m > -INFINITY) atomicMax(rmax, kvs_order_key(m));
}

// Phase 1 of those passes: the weights `e` summed over the lanes in fixed point (exact, so in any order)
// into *zfix, a NaN among them flagged in *zbad, by the lane that `lead`s. All WP_TP lanes call it.
__device__ __forceinline__ void wp_row_sum(float e, bool lead, unsigned long long* zfix, unsigned* zbad) {
    unsigned long long x = isnan(e) ? 0ull : (unsigned long long)((double)e * WP_NORM_ONE);
    unsigned bad = isnan(e) ? 1u : 0u;
#pragma unroll
    for (int off = WP_TP / 2; off > 0; off >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, off);
        bad |= __shfl_xor_sync(0xffffffffu, bad, off);
    }
    if (lead) {
        if (x != 0ull) atomicAdd(zfix, x);
        if (bad) atomicOr(zbad, 1u);
    }
}
