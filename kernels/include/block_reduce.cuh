// Block-wide reductions, scans and the one-scan compaction shared by the selection kernels. All threads
// of the CTA call each (blockDim a multiple of 32).
#pragma once
#include "common.cuh"

template <typename T>
__device__ __forceinline__ T block_sum(T v, T* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    T r = 0;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) r += red[i];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = -INFINITY;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) r = fmaxf(r, red[i]);
    __syncthreads();
    return r;
}

__device__ __forceinline__ unsigned long long block_min_u64(unsigned long long v, unsigned long long* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long r = ~0ull;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) r = min(r, red[i]);
    __syncthreads();
    return r;
}

// Block-wide exclusive prefix sum of v in thread order; `total` gets the sum. `wsum` is shared scratch of
// blockDim/32 ints. All threads call it (blockDim a multiple of 32).
__device__ __forceinline__ int block_excl_scan(int v, int* wsum, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();  // a previous call may still read wsum
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < nw; ++w) {
        const int c = wsum[w];
        if (w < warp) before += c;
        all += c;
    }
    total = all;
    return before + x - v;
}

// Calls write(p, i) for the entries i (0 <= i < n) for which keep(i) holds, p = their rank in increasing
// i; returns how many there are (at most cap: ranks from cap on are not written). Block-wide (all
// threads call it); `cnt` is shared scratch of blockDim/32 ints; what write stores must not alias what
// keep reads. One scan per call: each warp owns a contiguous segment of the indices (lanes interleaved,
// so reads stay coalesced), counts its kept entries, and writes them after the warps before it; keep is
// evaluated twice per index. Every thread sees every write on return.
template <typename Keep, typename Write>
__device__ __forceinline__ int compact_each(int n, Keep keep, Write write, int cap, int* cnt) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int per = ((n + nw - 1) / nw + 31) & ~31;
    const int a = min(warp * per, n), z = min(a + per, n);
    int c = 0;
    for (int i0 = a; i0 < z; i0 += 32) c += __popc(__ballot_sync(0xffffffffu, i0 + lane < z && keep(i0 + lane)));
    int total;
    // The warps before this one: lane 0 carries the warp's count, so lane 0's exclusive prefix is theirs.
    int at = __shfl_sync(0xffffffffu, block_excl_scan(lane == 0 ? c : 0, cnt, total), 0);
    for (int i0 = a; i0 < z; i0 += 32) {
        const int i = i0 + lane;
        const bool k = i < z && keep(i);
        const unsigned bal = __ballot_sync(0xffffffffu, k);
        const int p = at + __popc(bal & ((1u << lane) - 1u));
        if (k && p < cap) write(p, i);
        at += __popc(bal);
    }
    __syncthreads();
    return total < cap ? total : cap;
}

// compact_each writing value(i) to out[p] (`out` must not alias what keep or value read).
template <typename Keep, typename Val>
__device__ __forceinline__ int compact(int n, Keep keep, Val value, unsigned* out, int cap, int* cnt) {
    return compact_each(n, keep, [&](int p, int i) { out[p] = value(i); }, cap, cnt);
}
