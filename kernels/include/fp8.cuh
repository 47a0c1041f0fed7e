// FP8 KV caches (issue 28, src/fp8.rs has vLLM's convention): KV8 = 1 (E4M3) or 2 (E5M2) stores the
// caches as bytes, kv_t; 0 (default) keeps them in elem_t. Writers quantize `x / scale` with the
// hardware's round-to-nearest-even, saturating conversion (cvt.rn.satfinite: infinities become +-max,
// NaN stays NaN), as vLLM's reshape_and_cache_flash; readers convert to elem_t in registers (exact: every
// FP8 value is an f16 and a bf16) and apply the scale in f32. The conversions need compute capability
// 8.9 (the host refuses FP8 caches below it). Needs KVS_DTYPE.
#pragma once
#include "common.cuh"

#ifndef KV8
#define KV8 0
#endif

#if KV8
typedef unsigned char kv_t;
#if KV8 == 1
#define KV8_T "e4m3"
#else
#define KV8_T "e5m2"
#endif

// x rounded to the cache's FP8 format (nearest even, saturating); the byte vLLM stores for x / scale.
__device__ __forceinline__ kv_t kv8_from_f32(float x) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite." KV8_T "x2.f32 %0, %1, %1;" : "=h"(r) : "f"(x));
    return (kv_t)(r & 0xff);
#else
    __trap();
    return 0;
#endif
}

// Two FP8 values (the low byte first) as f16x2 (the low byte's value in the low half), exactly.
__device__ __forceinline__ unsigned kv8x2_to_f16x2(unsigned short b2) {
#if __CUDA_ARCH__ >= 890
    unsigned r;
    asm("cvt.rn.f16x2." KV8_T "x2 %0, %1;" : "=r"(r) : "h"(b2));
    return r;
#else
    __trap();
    return 0;
#endif
}

// Two FP8 values as two elem_t packed in 32 bits (the low byte's value in the low half), exactly.
__device__ __forceinline__ unsigned kv8x2_to_elem2(unsigned short b2) {
    const unsigned h = kv8x2_to_f16x2(b2);
#if KVS_DTYPE == 1
    return h;
#else
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(kvs_f16_to_f32((u16)(h >> 16))), "f"(kvs_f16_to_f32((u16)(h & 0xffff))));
    return r;
#endif
}

// One FP8 value as f32 (unscaled), exactly.
__device__ __forceinline__ float kv8_to_f32(kv_t b) {
    return kvs_f16_to_f32((u16)(kv8x2_to_f16x2((unsigned short)b) & 0xffff));
}
#else
typedef elem_t kv_t;
#endif
