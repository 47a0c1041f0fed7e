// Merges the nsplit partial states (O_s, LSE_s) of every (token, query head) exactly through their LSEs.
// One CTA per (token, head); the splits are spread over the CTA: the max and the sum of the weights are
// block reductions over splits, and each element d of the head is accumulated by blockDim/HEAD_DIM
// threads, each over its own subset of splits (independent loads in flight), then summed in shared
// memory. Launch with a multiple of HEAD_DIM threads, at most 1024. Needs HEAD_DIM and elem_t/ET.
// `mode` skips the rows another launch of the same call serves (common.cuh MODE_*).
#pragma once
#include "common.cuh"

__device__ __forceinline__ float kvs_block_reduce(float v, bool is_max, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    __syncthreads();  // red may still be read by a previous reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = red[0];
    for (int i = 1; i < nw; ++i) r = is_max ? fmaxf(r, red[i]) : r + red[i];
    return r;
}

extern "C" __global__ void __launch_bounds__(1024)
kvs_attn_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_lse, int nsplit, int num_q_heads,
                 elem_t* __restrict__ out, i64 o0, i64 o1, i64 o2, float* __restrict__ lse, i64 l0, i64 l1,
                 const int* __restrict__ qsl, i64 qsl0, int num_seqs, int mode) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ float red[32];
    __shared__ float part[1024];
    const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    if (mode != MODE_ALL && !kvs_row_served(mode, kvs_token_qlen(t, qsl, qsl0, num_seqs))) return;
#if KVS_CHECKS & 4
    if (t >= qsl[(i64)num_seqs * qsl0]) return;  // a padded batch's padding row: not written
#endif
    const i64 base = ((i64)t * num_q_heads + h) * nsplit;
    float mx = -INFINITY;
    for (int s = tid; s < nsplit; s += blockDim.x) mx = fmaxf(mx, ws_lse[base + s]);
    const float M = kvs_block_reduce(mx, true, red);
    // A split whose row met a non-finite logit carries lse NaN: the whole row is NaN (max() skips NaN).
    float nan_any = 0.f;
    for (int s = tid; s < nsplit; s += blockDim.x) nan_any = isnan(ws_lse[base + s]) ? 1.f : nan_any;
    const bool poisoned = kvs_block_reduce(nan_any, true, red) > 0.f;
    float sw = 0.f;
    if (M != -INFINITY)
        for (int s = tid; s < nsplit; s += blockDim.x) sw += __expf(ws_lse[base + s] - M);
    const float L = kvs_block_reduce(sw, false, red);
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
