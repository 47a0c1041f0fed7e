// kv_st: what a cache stores for element x of a new row (an FP8 cache: x / scale quantized, as vLLM's
// reshape_and_cache_flash; else x itself). kv_ld: one cached K or V element as f32, as the CPU's load_cache_row reads it: an FP8 cache's byte (KV8,
// fp8.cuh) decoded exactly and times its layer's scale (one f32 rounding), so a pass in the CPU's
// arithmetic sees the CPU's values; a 16-bit or f32 cache's element as stored (the scale unused).
// Needs KVS_DTYPE.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

__device__ __forceinline__ float kv_ld(kv_t x, float scale) {
#if KV8
    return kv8_to_f32(x) * scale;
#else
    (void)scale;
    return ET::ld(x);
#endif
}

__device__ __forceinline__ kv_t kv_st(elem_t x, float scale) {
#if KV8
    return kv8_from_f32(ET::ld(x) / scale);
#else
    (void)scale;
    return x;
#endif
}
