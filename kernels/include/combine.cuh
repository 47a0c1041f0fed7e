// Merges the nsplit partial states (O_s, LSE_s) of every (token, query head) exactly through their LSEs.
// One CTA per (token, head); the splits are spread over the CTA: the max and the sum of the weights are
// computed by each warp for itself (kvs_split_stats), and each element d of the head is accumulated by blockDim/HEAD_DIM
// threads, each over its own subset of splits (independent loads in flight), then summed in shared
// memory. Launch with a multiple of HEAD_DIM threads, at most 1024. Needs HEAD_DIM and elem_t/ET.
// `mode` skips the rows another launch of the same call serves (common.cuh MODE_*).
#pragma once
#include "common.cuh"

// The splits' statistics of a row, computed by every warp for itself (no block barrier; the splits' LSEs
// come from L1): M = the largest LSE (max() skips NaN), whether any LSE is NaN, and L = the sum of
// exp(lse - M) in the order of a block reduction over the CTA's threads: thread t's own sum over the
// splits t, t + blockDim, ..., each warp's 32 sums by an xor butterfly, the warps' results added in warp
// order (so the result is that of the former block-wide reduction, bit for bit).
__device__ __forceinline__ void kvs_split_stats(const float* __restrict__ l, int nsplit, float& M, bool& poisoned, float& L) {
    const int lane = threadIdx.x & 31, B = blockDim.x;
    float mx = -INFINITY;
    bool nan_any = false;
    for (int s = lane; s < nsplit; s += 32) {
        const float v = l[s];
        mx = fmaxf(mx, v);
        nan_any |= isnan(v);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    M = mx;
    poisoned = __any_sync(0xffffffffu, nan_any);
    L = 0.f;
    if (M == -INFINITY) return;
    const int groups = (min(nsplit, B) + 31) / 32;  // warps whose threads hold a split
    for (int w = 0; w < groups; ++w) {
        float v = 0.f;
        for (int s = 32 * w + lane; s < nsplit; s += B) v += __expf(l[s] - M);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, o);
        L = w == 0 ? v : L + v;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
kvs_attn_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_lse, int nsplit, int num_q_heads,
                 elem_t* __restrict__ out, i64 o0, i64 o1, i64 o2, float* __restrict__ lse, i64 l0, i64 l1,
                 const int* __restrict__ qsl, i64 qsl0, int num_seqs, int mode) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ float part[1024];
    const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    if (mode != MODE_ALL && !kvs_row_served(mode, kvs_token_qlen(t, qsl, qsl0, num_seqs))) return;
#if KVS_CHECKS & 4
    if (t >= qsl[(i64)num_seqs * qsl0]) return;  // a padded batch's padding row: not written
#endif
    const i64 base = ((i64)t * num_q_heads + h) * nsplit;
    // A split whose row met a non-finite logit carries lse NaN: the whole row is NaN.
    float M, L;
    bool poisoned;
    kvs_split_stats(ws_lse + base, nsplit, M, poisoned, L);
    const int parts = blockDim.x / HEAD_DIM, pi = tid / HEAD_DIM, d = tid % HEAD_DIM;
    float O = 0.f;
    if (pi < parts && M != -INFINITY) {
#pragma unroll 4
        for (int s = pi; s < nsplit; s += parts) O = fmaf(__expf(ws_lse[base + s] - M), ws_o[(base + s) * HEAD_DIM + d], O);
    }
    part[tid] = O;
    __syncthreads();
    if (tid < HEAD_DIM) {
        for (int i = 1; i < parts; ++i) O += part[i * HEAD_DIM + tid];
        const bool any = L > 0.f;
        const float nan = __int_as_float(0x7fffffff);
        out[t * o0 + h * o1 + tid * o2] = ET::st(poisoned ? nan : (any ? O / L : 0.f));
        if (lse != 0 && tid == 0) lse[t * l0 + h * l1] = poisoned ? nan : (any ? M + __logf(L) : -INFINITY);
    }
}
