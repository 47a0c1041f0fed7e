// Radix top-k over 32-bit order keys (kvs_order_key), block-wide: radix_kth (the m-th largest key of a
// range, 8 bits per pass) and topk32 (threshold key and index cut of the m largest, exact at ties).
#pragma once
#include "common.cuh"
#include "block_reduce.cuh"

// Radix select, 8 bits per pass from the top: the m-th largest of the unique keys key_of(i), lo <= i < hi
// (1 <= m <= hi - lo), which needs `passes` passes to cover the keys' bits; 0 when m == 0. Block-wide;
// hist[256], wtot[8] and the two selection words are shared scratch.
template <typename KeyOf>
__device__ __forceinline__ unsigned long long radix_kth(int lo, int hi, int m, int passes, KeyOf key_of, unsigned* hist, unsigned* wtot,
                                                        unsigned long long& sel_prefix, int& sel_left) {
    if (threadIdx.x == 0) {
        sel_prefix = 0;
        sel_left = m;
    }
    __syncthreads();
    for (int pass = 0; pass < passes && m > 0; ++pass) {
        const int shift = 8 * (passes - 1 - pass);
        const unsigned long long hi_mask = shift + 8 >= 64 ? 0ull : (~0ull << (shift + 8));
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const unsigned long long prefix = sel_prefix;
        const int left = sel_left;
        // Uniform trip count, so the warp can aggregate equal bins before the shared-memory atomic
        // (early passes put most pages in one or two bins).
        for (int base_i = lo; base_i < hi; base_i += blockDim.x) {
            const int i = base_i + threadIdx.x;
            unsigned bin = 256u;
            if (i < hi) {
                const unsigned long long key = key_of(i);
                if ((key & hi_mask) == (prefix & hi_mask)) bin = (unsigned)((key >> shift) & 255);
            }
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (bin < 256u && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned)__popc(peers));
        }
        __syncthreads();
        // The digit: counts from the top bin down (thread t holds bin 255 - t), scanned; the one bin
        // where the running count crosses `left` is it.
        unsigned c = 0, v = 0;
        if (threadIdx.x < 256) {
            c = hist[255 - threadIdx.x];
            v = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned y = __shfl_up_sync(0xffffffffu, v, o);
                if ((int)(threadIdx.x & 31) >= o) v += y;
            }
            if ((threadIdx.x & 31) == 31) wtot[threadIdx.x >> 5] = v;
        }
        __syncthreads();
        if (threadIdx.x < 256) {
            unsigned pre = 0;
            for (int w = 0; w < (int)(threadIdx.x >> 5); ++w) pre += wtot[w];
            const unsigned incl = v + pre, excl = incl - c;
            if ((int)excl < left && (int)incl >= left) {
                sel_left = left - (int)excl;
                sel_prefix = prefix | ((unsigned long long)(255 - threadIdx.x) << shift);
            }
        }
        __syncthreads();
    }
    return sel_prefix;
}

// The minimum (a) and maximum (z) of the keys key_of(i), lo <= i < hi, in thread 0 (0xffffffff and 0 for an
// empty range). Block-wide; scratch[64] is shared.
template <typename KeyOf>
__device__ __forceinline__ void block_key_range(int lo, int hi, KeyOf key_of, unsigned* scratch, unsigned& a, unsigned& z) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    unsigned mn = 0xffffffffu, mx = 0u;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const unsigned k = key_of(i);
        mn = min(mn, k);
        mx = max(mx, k);
    }
    mn = __reduce_min_sync(0xffffffffu, mn);
    mx = __reduce_max_sync(0xffffffffu, mx);
    __syncthreads();  // scratch may still be read by a previous user
    if (lane == 0) {
        scratch[warp] = mn;
        scratch[32 + warp] = mx;
    }
    __syncthreads();
    a = 0xffffffffu;
    z = 0u;
    if (threadIdx.x == 0)
        for (int w = 0; w < nw; ++w) {
            a = min(a, scratch[w]);
            z = max(z, scratch[32 + w]);
        }
}

// A radix select's start from its keys' minimum a and maximum z: sel[0] = the bits every key shares (above
// bit `top`, the lower ones zero), sel[1] = m keys still needed, sel[2] = 0 (not done), sel[3] = top.
__device__ __forceinline__ void radix_start(unsigned a, unsigned z, int m, unsigned* sel) {
    const int top = a == z ? 0 : 32 - __clz(a ^ z);  // the low bits that differ among the keys
    sel[0] = top == 32 ? 0u : (z & (0xffffffffu << top));
    sel[1] = (unsigned)m;
    sel[2] = 0u;
    sel[3] = (unsigned)top;
}

// A radix pass's crossing: the thread whose bin `digit` (at `shift`; c keys, excl keys in the bins above)
// holds the left-th key from the top records the bin's prefix, the keys still needed in it, and whether
// the bin holds exactly those (done); returns whether it was that thread. radix_descend reads them back
// in every thread after a barrier.
__device__ __forceinline__ bool radix_cross(int c, int excl, unsigned digit, int shift, unsigned prefix, int left, unsigned* sel) {
    if (c == 0 || excl >= left || excl + c < left) return false;
    sel[0] = prefix | (digit << shift);
    sel[1] = (unsigned)(left - excl);
    sel[2] = (c == left - excl) ? 1u : 0u;
    return true;
}
__device__ __forceinline__ void radix_descend(const unsigned* sel, unsigned& prefix, int& left, bool& done) {
    prefix = sel[0];
    left = (int)sel[1];
    done = sel[2] != 0u;
}

// Among the keys equal to `thr` at lo <= i < hi, the index of the left-th one counted from the top (the
// `left` later ones are i >= the result); lo when fewer than `left` are equal. One scan from the top, which
// stops once `left` are found. Block-wide; wsum[blockDim/32] and sel[3] are shared scratch.
template <typename KeyOf>
__device__ __forceinline__ int tie_cut(int lo, int hi, int left, unsigned thr, KeyOf key_of, int* wsum, unsigned* sel) {
    const int lane = threadIdx.x & 31;
    __syncthreads();  // every thread has read sel
    int acc = 0;
    if (threadIdx.x == 0) sel[3] = (unsigned)lo;
    for (int c0 = hi; c0 > lo; c0 -= blockDim.x) {
        const int i = c0 - 1 - (int)threadIdx.x;
        const bool t = i >= lo && key_of(i) == thr;
        const unsigned bal = __ballot_sync(0xffffffffu, t);
        int total;
        // The warps before this one: lane 0 carries the warp's count, so lane 0's exclusive prefix is
        // theirs (the other lanes' prefix would include their own warp's count).
        const int before = __shfl_sync(0xffffffffu, block_excl_scan(lane == 0 ? __popc(bal) : 0, wsum, total), 0);
        const int rank = acc + before + __popc(bal & ((2u << lane) - 1u));
        if (t && rank == left) sel[3] = (unsigned)i;
        acc += total;
        if (acc >= left) break;  // uniform
    }
    __syncthreads();
    return (int)sel[3];
}

// The m largest of the 32-bit keys key_of(i), lo <= i < hi (1 <= m <= hi - lo), ties on the key going to
// the larger i: i is among them iff key_of(i) > thr, or key_of(i) == thr and i >= cut. The same set as
// radix_kth over the unique keys (key << ibits | i), found with fewer passes: the radix starts below the
// bits every key shares (from the keys' minimum and maximum), takes 8 bits per pass, and stops as soon as
// the bin it descends into holds exactly the keys still needed; only a tie on the whole key is cut by
// index (one scan from the top). Block-wide (all threads; blockDim a multiple of 32, at least 256);
// hist[256], wsum[blockDim/32] and sel[4] are shared scratch.
struct TopCut {
    unsigned thr;
    int cut;
};
template <typename KeyOf>
__device__ __forceinline__ TopCut topk32(int lo, int hi, int m, KeyOf key_of, unsigned* hist, int* wsum, unsigned* sel) {
    unsigned a, z;
    block_key_range(lo, hi, key_of, hist, a, z);
    if (threadIdx.x == 0) radix_start(a, z, m, sel);
    __syncthreads();
    unsigned prefix = sel[0];
    int left = (int)sel[1], top = (int)sel[3];
    bool done = false;
    while (top > 0 && !done) {
        const int bits = min(8, top), shift = top - bits, nb = 1 << bits;
        const unsigned himask = top >= 32 ? 0u : (0xffffffffu << top);
        for (int i = threadIdx.x; i < nb; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const unsigned k = key_of(i);
            if ((k & himask) == (prefix & himask)) atomicAdd(&hist[(k >> shift) & (unsigned)(nb - 1)], 1u);
        }
        __syncthreads();
        // Bins from the top (thread t holds bin nb - 1 - t), scanned: the bin where the count crosses `left`.
        const int c = (int)threadIdx.x < nb ? (int)hist[nb - 1 - threadIdx.x] : 0;
        int total;
        const int excl = block_excl_scan(c, wsum, total);
        radix_cross(c, excl, (unsigned)(nb - 1 - threadIdx.x), shift, prefix, left, sel);
        __syncthreads();
        radix_descend(sel, prefix, left, done);
        top = shift;
    }
    TopCut r{prefix, lo};
    if (!done) r.cut = tie_cut(lo, hi, left, prefix, key_of, wsum, sel);
    __syncthreads();  // sel / hist are free again
    return r;
}

#define TOPK_THREADS 512  // src/cuda/launch.rs TOPK_THREADS
