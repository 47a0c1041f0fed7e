// Shared by every kvsparse kernel: element types and conversions without the CUDA headers, so NVRTC
// needs no include path. The storage type is chosen by KVS_DTYPE (0 = f32, 1 = f16, 2 = bf16).
// All arithmetic is f32; bf16/f16 are converted on load and rounded to nearest even on store.
#pragma once

typedef unsigned short u16;
typedef long long i64;

#define KVS_LOG2E 1.4426950408889634f
#define KVS_LN2 0.6931471805599453f
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float kvs_to_f32(float x) { return x; }
__device__ __forceinline__ float kvs_bf16_to_f32(u16 x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ float kvs_f16_to_f32(u16 x) {
    float f;
    asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ u16 kvs_f32_to_bf16(float x) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ u16 kvs_f32_to_f16(float x) {
    u16 r;
    asm("{ .reg .b16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(r) : "f"(x));
    return r;
}

// Per-dtype load/store of single elements.
struct F32T { typedef float S; static __device__ __forceinline__ float ld(float x) { return x; } static __device__ __forceinline__ float st(float x) { return x; } };
struct F16T { typedef u16 S; static __device__ __forceinline__ float ld(u16 x) { return kvs_f16_to_f32(x); } static __device__ __forceinline__ u16 st(float x) { return kvs_f32_to_f16(x); } };
struct BF16T { typedef u16 S; static __device__ __forceinline__ float ld(u16 x) { return kvs_bf16_to_f32(x); } static __device__ __forceinline__ u16 st(float x) { return kvs_f32_to_bf16(x); } };

#ifdef KVS_DTYPE
#if KVS_DTYPE == 0
typedef F32T ET;
#elif KVS_DTYPE == 1
typedef F16T ET;
#else
typedef BF16T ET;
#endif
typedef ET::S elem_t;
#endif

// Which sequence token t belongs to and the key positions it may see (shared by the attention kernels).
struct RowInfo {
    int seq;
    int lo, hi;  // inclusive visible key positions; hi < lo means the row sees nothing
    int qlen;    // query tokens of the sequence (1 = a decode row, which policies plan)
};

__device__ __forceinline__ RowInfo locate(int t, const int* qsl, i64 qsl0, const int* seq_lens, i64 sl0, int num_seqs,
                                          int max_pos, int window) {
    // Largest s with qsl[s] <= t (qsl is non-decreasing for valid input; any input gives some s in range).
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (qsl[mid * qsl0] <= t) lo = mid; else hi = mid - 1;
    }
    RowInfo r;
    r.seq = lo;
    int q0 = qsl[lo * qsl0], q1 = qsl[(lo + 1) * qsl0];
    r.qlen = q1 - q0;
    int len = seq_lens[lo * sl0];
    len = len < 0 ? 0 : (len > max_pos ? max_pos : len);
    int pos = len - (q1 - q0) + (t - q0);
    bool ok = t >= q0 && t < q1 && pos >= 0 && pos < len;
    r.hi = ok ? pos : -1;
    r.lo = (window > 0 && pos + 1 - window > 0) ? pos + 1 - window : 0;
    return r;
}

// Which rows a launch serves: every row (0), only decode rows of a policy layer, attended through their
// plans (1), or only the other rows of a policy layer, attended densely (2).
#define MODE_ALL 0
#define MODE_PLAN 1
#define MODE_DENSE_REST 2
__device__ __forceinline__ bool kvs_row_served(int mode, int qlen) {
    return mode == MODE_ALL || ((mode == MODE_PLAN) == (qlen == 1));
}

// Query length of the sequence that token t belongs to (as locate() finds it).
__device__ __forceinline__ int kvs_token_qlen(int t, const int* qsl, i64 qsl0, int num_seqs) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (qsl[mid * qsl0] <= t) lo = mid; else hi = mid - 1;
    }
    return qsl[(lo + 1) * qsl0] - qsl[lo * qsl0];
}
