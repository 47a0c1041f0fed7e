// A 32-bit float as the sum of two f16 terms, and the f16 tensor-core product they feed: the building
// blocks of the selection kernels that score on tensor cores with f32-exact products (Quest's page bounds,
// kernels/policy/quest.cu; top-p's INT4 estimates, kernels/policy/top_p.cu). A row of values is scaled by
// 2^e (its max |v| into [2^14, 2^15)), then split into hi = f16(v) and lo = f16(v - hi): the residual is
// under 2^-22 of the row's max |v|, and f16 x f16 products are exact in f32.
#pragma once
#include "common.cuh"

__device__ __forceinline__ void quest_mma_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two f32 -> f16x2 (first in the low half), rounded to nearest.
__device__ __forceinline__ unsigned quest_f16x2(float first, float second) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(second), "f"(first));
    return r;
}
// The larger of a and b, NaN if either is NaN (fmaxf would drop a NaN).
__device__ __forceinline__ float quest_nanmax(float a, float b) { return (b > a || b != b) ? b : a; }

// 2^e as a float, for -126 <= e <= 127 (exact).
__device__ __forceinline__ float quest_pow2(int e) { return __int_as_float((e + 127) << 23); }

// The exponent e that puts a row's max |v| (`m`, >= 0) into [2^14, 2^15); 0 for a zero or non-finite max.
__device__ __forceinline__ int split_exponent(float m) {
    int x = 0;
    const bool finite = m > 0.f && m <= 3.402823466e38f;
    if (finite) frexpf(m, &x);
    return finite ? 15 - x : 0;
}

// The exponent of a row of N values (`row`, shared memory), warp-wide: every lane returns split_exponent
// of the row's max |v| (NaN if any value is NaN, which gives 0); 0 when the row is not `active`.
template <int N>
__device__ __forceinline__ int row_split_exponent(const float* row, bool active) {
    float m = 0.f;
    if (active)
        for (int c = threadIdx.x & 31; c < N; c += 32) m = quest_nanmax(m, fabsf(row[c]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = quest_nanmax(m, __shfl_xor_sync(0xffffffffu, m, o));
    return split_exponent(m);
}

// One lane's B fragment of a k-step from its four scaled values v (k = 2 (lane % 4) + {0, 1}, then + 8):
// {hi b0, hi b1, lo b0, lo b1}, hi = f16(v) and lo = f16(v - hi).
__device__ __forceinline__ uint4 split_b_fragment(const float (&v)[4]) {
    unsigned hi[2], lo[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        hi[half] = quest_f16x2(v[2 * half], v[2 * half + 1]);
        lo[half] = quest_f16x2(v[2 * half] - kvs_f16_to_f32((u16)hi[half]), v[2 * half + 1] - kvs_f16_to_f32((u16)(hi[half] >> 16)));
    }
    return make_uint4(hi[0], hi[1], lo[0], lo[1]);
}
