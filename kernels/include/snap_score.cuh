// SnapKV's scoring arithmetic and CTA shape, shared by SnapKV's choice (snapkv.cu) and RefreshKV's full
// step (refresh.cu): decision_dot in lane order and the fixed-point softmax normaliser's unit.
#pragma once
#include "common.cuh"

// Positions per CTA and query heads served side by side: 32 x min(GROUP, 8) threads; at head sizes
// above 128, 16 positions (the K tile stays in static shared memory) and an even count of query heads
// (whole warps: the reductions run over one head's SNAP_TP lanes). src/cuda/sparse.rs repeats this.
#if HEAD_DIM <= 128
#define SNAP_TP 32
#define SNAP_J (GROUP < 8 ? GROUP : 8)
#else
#define SNAP_TP 16
#define SNAP_J (GROUP < 8 ? ((GROUP + 1) / 2) * 2 : 8)
#endif
#define SNAP_KPER ((GROUP + SNAP_J - 1) / SNAP_J)  // query heads per thread
#define SNAP_THREADS (SNAP_TP * SNAP_J)
#define SNAP_NORM_ONE 4398046511104.0  // 2^42, math::NORM_FIXED_ONE

// decision_dot: eight lane sums over c = l (mod 8), each product rounded, then the lanes in order.
__device__ __forceinline__ float snap_dot(const float* q, const float* k) {
    float acc[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) acc[l] = 0.0f;
    for (int c = 0; c < HEAD_DIM; c += 8)
#pragma unroll
        for (int l = 0; l < 8; ++l) acc[l] += q[c + l] * k[c + l];
    float s = acc[0];
#pragma unroll
    for (int l = 1; l < 8; ++l) s += acc[l];
    return s;
}

__device__ __forceinline__ float snap_unkey(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
