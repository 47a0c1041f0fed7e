// The key metadata's arithmetic on rows, shared by the multi-launch upkeep (meta.cu) and a decode step's
// one-launch write (write_step.cu), so both produce the CPU's bits (src/cpu/metadata.rs, quantize.rs):
// min/max in an order-free form, the INT4 parameters and codes of a row, the channel-wise min/max fold of a
// Quest unit; and the slot mapping's entries.
// Compiled with --fmad=false (decide.cuh).
#pragma once
#include "common.cuh"
#include "decide.cuh"
#include "kv_load.cuh"

// Entry t of a cache write's slot mapping (int32 or int64, any non-negative stride), as int64.
__device__ __forceinline__ i64 kvs_slot_at(const void* slots, i64 stride, int is64, int t) {
    return is64 ? ((const i64*)slots)[t * stride] : (i64)((const int*)slots)[t * stride];
}

// min and max as IEEE 754-2019's minimumNumber / maximumNumber, as the CPU's min_num / max_num
// (src/cpu/math.rs): a NaN is ignored and -0 < +0, so a fold's bits do not depend on its order (fminf leaves
// the sign of a zero result to the implementation).
__device__ __forceinline__ float kvs_min_num(float a, float b) {
    return (a < b || isnan(b)) ? a : ((b < a || isnan(a)) ? b : __uint_as_float(__float_as_uint(a) | __float_as_uint(b)));
}
__device__ __forceinline__ float kvs_max_num(float a, float b) {
    return (a > b || isnan(b)) ? a : ((b > a || isnan(a)) ? b : __uint_as_float(__float_as_uint(a) & __float_as_uint(b)));
}

// A row's INT4 parameters as the CPU's quantize_row: fp16 min rounded down, fp16 scale (max - min) / 15
// rounded up; ok = false (zero codes and parameters) for a non-finite row or range.
struct Int4Params {
    u16 mn16, sc16;
    float mnf, inv;
    bool ok;
};

__device__ __forceinline__ Int4Params int4_params(float mn, float mx) {
    Int4Params p;
    p.mn16 = kvs_f16_down(mn);
    p.mnf = kvs_f16_to_f32(p.mn16);
    p.sc16 = kvs_f16_up((mx - p.mnf) / 15.0f);
    const float scf = kvs_f16_to_f32(p.sc16);
    p.ok = isfinite(mn) && isfinite(mx) && isfinite(p.mnf) && isfinite(scf);
    p.inv = scf > 0.0f ? 1.0f / scf : 0.0f;
    return p;
}

// The byte of two codes (x0 in the low nibble): round((x - min) * inv) clamped to 0..15, NaN -> 0, as
// Rust's `clamp(..) as u8`; 0 when !p.ok.
__device__ __forceinline__ unsigned char int4_byte(float x0, float x1, const Int4Params& p) {
    if (!p.ok) return 0;
    const float c0 = roundf((x0 - p.mnf) * p.inv);
    const float c1 = roundf((x1 - p.mnf) * p.inv);
    const unsigned q0 = c0 >= 0.0f ? (unsigned)fminf(c0, 15.0f) : 0u;
    const unsigned q1 = c1 >= 0.0f ? (unsigned)fminf(c1, 15.0f) : 0u;
    return (unsigned char)(q0 | (q1 << 4));
}

__device__ __forceinline__ void int4_store_params(u16* qparams, i64 r, const Int4Params& p) {
    qparams[2 * r] = p.ok ? p.mn16 : (u16)0;
    qparams[2 * r + 1] = p.ok ? p.sc16 : (u16)0;
}

// Folds the cached values col[o * kc1] of the slots o in [lo, hi) with filled(o) into (mn, mx), in slot
// order, eight loads in flight (every slot of a valid block is inside the cache: the unfilled ones are
// read and ignored).
template <typename Filled>
__device__ __forceinline__ void fold_cached(const kv_t* col, i64 kc1, float kscale, int lo, int hi, Filled filled, float& mn, float& mx) {
    for (int o0 = lo; o0 < hi; o0 += 8) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = o0 + j < hi ? kv_ld(col[(i64)(o0 + j) * kc1], kscale) : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (o0 + j < hi && filled(o0 + j)) {
                mn = kvs_min_num(mn, v[j]);
                mx = kvs_max_num(mx, v[j]);
            }
    }
}
