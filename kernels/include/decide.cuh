// The policies' decision arithmetic on the device, operation for operation the same as the CPU's
// (src/cpu/math.rs: fast_exp, decision_tanh, decision_dot; src/cpu/metadata.rs: f16_down / f16_up), so
// that the selection kernels choose exactly the pages and tokens the CPU engine chooses.
// The modules that include this are compiled with --fmad=false: a * b + c is never fused unless written
// as fmaf (which the CPU writes as mul_add).
#pragma once
#include "common.cuh"

__device__ __forceinline__ float kvs_fast_exp(float x) {
    const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // NaN stays NaN, as f32::clamp
    const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    float y = 1.9875691e-4f;
    y = fmaf(y, r, 1.3981999e-3f);
    y = fmaf(y, r, 8.3334520e-3f);
    y = fmaf(y, r, 4.1665796e-2f);
    y = fmaf(y, r, 1.6666665e-1f);
    y = fmaf(y, r, 5.0000001e-1f);
    y = fmaf(y, r * r, r + 1.0f);
    const float scale = __int_as_float(((int)n + 127) << 23);
    return x < -87.0f ? 0.0f : y * scale;
}

__device__ __forceinline__ float kvs_decision_tanh(float x) {
    const float e = kvs_fast_exp(-2.0f * fabsf(x));
    return copysignf((1.0f - e) / (1.0f + e), x);
}

__device__ __forceinline__ float kvs_decision_softcap(float x, float cap) {
    return cap > 0.0f ? cap * kvs_decision_tanh(x / cap) : x;
}

// fp16 bits of the largest fp16 <= x / the smallest fp16 >= x (directed rounding, as f16_down / f16_up).
__device__ __forceinline__ u16 kvs_f16_down(float x) {
    u16 r;
    asm("{ .reg .b16 h; cvt.rm.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ u16 kvs_f16_up(float x) {
    u16 r;
    asm("{ .reg .b16 h; cvt.rp.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(r) : "f"(x));
    return r;
}

// Scores keyed so that unsigned comparison is f32 total order (Rust's f32::total_cmp).
__device__ __forceinline__ unsigned kvs_order_key(float x) {
    const unsigned b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// What a decode row of sequence s sees: positions lo..=hi (hi = seq_len - 1, clamped to the table's
// capacity max_pos; the sliding window moves lo). decode = exactly one query token, at row t.
struct SeqRow {
    int decode;  // 1 when the sequence has exactly one query token
    int t;       // that token's row in q
    int lo, hi;  // visible positions (hi < lo: none)
    int q_len;
};

__device__ __forceinline__ SeqRow kvs_seq_row(int s, const int* qsl, i64 qsl0, const int* seq_lens, i64 sl0, int max_pos,
                                              int window, int num_tokens) {
    SeqRow r;
    const int q0 = qsl[s * qsl0], q1 = qsl[(s + 1) * qsl0];
    r.q_len = q1 - q0;
    r.decode = r.q_len == 1;
    int len = seq_lens[s * sl0];
    len = len < 0 ? 0 : (len > max_pos ? max_pos : len);
    r.t = q0;
    r.hi = len - 1;
    r.lo = (window > 0 && len - window > 0) ? len - window : 0;
    if (q0 < 0 || q0 >= num_tokens) {  // garbage metadata: a row that sees nothing, reads no query
        r.t = 0;
        r.hi = -1;
        r.lo = 0;
    }
    return r;
}

// Counter slots (the order of the fields of stats::Counters that the device counts).
#define CTR_DECODE_ROWS 0
#define CTR_PREFILL_TOKENS 1
#define CTR_POLICY_ROWS 2
#define CTR_BLOCKS_ELIGIBLE 3
#define CTR_BLOCKS_VISITED 4
#define CTR_TOP_P_CANDIDATES 5
#define CTR_TOP_P_KEPT 6
#define CTR_KV_BYTES 7
#define CTR_BLOCKS_SKIPPED_TERMINATION 8  // a traversal hook (kernels/attention_mma.cu, TRAVERSAL_HOOK)
#define CTR_TRAVERSAL_TILES 9
#define CTR_TRAVERSAL_TILES_TOTAL 10
#define CTR_SPEC_PREDICTED 11  // PRR (kernels/prr.cu)
#define CTR_SPEC_TRUE 12
#define CTR_SPEC_HIT 13
#define CTR_SPEC_REPAIRED 14
#define CTR_SPEC_REUSE_HIT 15
#define CTR_COUNT 16
