// Key metadata on the device, kept by kvs_cache_write right after the rows are stored, with the same
// semantics as the CPU's LayerMeta (src/cpu/metadata.rs), which a test compares bit for bit:
//
//   fill[num_blocks][4]            one bit per slot: written through kvsparse since the block (re)started
//   first[num_blocks]              scratch: (block_size - first offset written by this call), 0 between calls
//   qmin/qmax[num_blocks][upb][hk][d]  Quest: fp16 min (rounded down) / max (rounded up) of K per unit,
//                                  channels in lane order: c at (c % 16) * (d / 16) + c / 16
//   codes[num_blocks * bs * hk][d/2], qparams[...][2]   INT4 copy of K, fp16 (min, scale) per row
//   keep[num_blocks][hk][4]        SnapKV: one bit per slot, set when the slot is written (kernels/snapkv.cu)
//
// A write at offset j of a block starts that block over from j (serving engines reuse blocks for other
// sequences, and sequences only grow or are rewritten from some position on): fill bits >= j not written
// by the same call are cleared, and every Quest unit from j's on is recomputed from the filled rows.
// Four launches in stream order (no host sync, capturable): mark -> clear -> set (+INT4) -> units (+reset).
// A call of few tokens (a decode step) does all of it, with the slot check and the rows' store, in one
// launch instead: kvs_write_step (write_step.cu).
// With SnapKV's bits only (no Quest bounds, no INT4 copy) just `set` runs: nothing reads fill's cleared tail.
// Slots are validated here as in kvs_cache_write (negative or out of range: skipped).
// Requires KVS_DTYPE; compiled with --fmad=false (decide.cuh). KV8 (fp8.cuh): an FP8 key cache, read as the
// CPU's load_cache_row reads it (the byte's exact value times k_scale, one f32 rounding).

#include "key_rows.cuh"

__device__ __forceinline__ bool kvs_slot(const void* slots, i64 stride, int is64, int t, i64 capacity, int bs, i64* blk, int* off) {
    const i64 slot = kvs_slot_at(slots, stride, is64, t);
    if (slot < 0 || slot >= capacity) return false;
    *blk = slot / bs;
    *off = (int)(slot % bs);
    return true;
}

extern "C" __global__ void kvs_meta_mark(const void* slots, i64 slot_stride, int is64, int tokens, i64 num_blocks, int bs, int* first) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < tokens; t += gridDim.x * blockDim.x) {
        i64 b;
        int off;
        if (kvs_slot(slots, slot_stride, is64, t, num_blocks * bs, bs, &b, &off)) atomicMax(&first[b], bs - off);
    }
}

extern "C" __global__ void kvs_meta_clear(const void* slots, i64 slot_stride, int is64, int tokens, i64 num_blocks, int bs, const int* first,
                                          unsigned long long* fill) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < tokens; t += gridDim.x * blockDim.x) {
        i64 b;
        int off;
        if (!kvs_slot(slots, slot_stride, is64, t, num_blocks * bs, bs, &b, &off)) continue;
        const int f = bs - first[b];  // first offset written to this block by this call
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const int lo = f - 64 * w;  // bits >= lo of word w are cleared
            if (lo >= 64) continue;
            const unsigned long long keep = lo <= 0 ? 0ull : ((1ull << lo) - 1ull);
            atomicAnd(&fill[b * 4 + w], keep);
        }
    }
}

// The INT4 copy of one cached K row (slot b*bs + off, KV head h): fp16 (min, scale) and 4-bit codes, as
// the CPU's quantize_row.
__device__ __forceinline__ void quantize_row(const kv_t* kc, i64 kc0, i64 kc1, i64 kc2, float kscale, i64 b, int off, int h, int bs, int hk, int d,
                                             unsigned char* codes, u16* qparams) {
    const kv_t* row = kc + b * kc0 + (i64)off * kc1 + (i64)h * kc2;
    float mn = INFINITY, mx = -INFINITY;
    for (int c = 0; c < d; ++c) {
        const float v = kv_ld(row[c], kscale);
        mn = kvs_min_num(mn, v);
        mx = kvs_max_num(mx, v);
    }
    const i64 r = (b * bs + off) * hk + h;
    unsigned char* cr = codes + r * (d / 2);
    const Int4Params p = int4_params(mn, mx);
    for (int c = 0; c < d; c += 2) cr[c / 2] = int4_byte(kv_ld(row[c], kscale), kv_ld(row[c + 1], kscale), p);
    int4_store_params(qparams, r, p);
}

// One thread per (token, KV head): marks the slot filled (head 0), kept for SnapKV, and quantizes the row
// to INT4.
extern "C" __global__ void kvs_meta_set(const void* slots, i64 slot_stride, int is64, int tokens, i64 num_blocks, int bs,
                                        unsigned long long* fill, const kv_t* kc, i64 kc0, i64 kc1, i64 kc2, int hk, int d,
                                        unsigned char* codes, u16* qparams, unsigned long long* keep, float kscale) {
    const i64 n = (i64)tokens * hk;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const int t = (int)(i / hk), h = (int)(i % hk);
        i64 b;
        int off;
        if (!kvs_slot(slots, slot_stride, is64, t, num_blocks * bs, bs, &b, &off)) continue;
        if (h == 0) atomicOr(&fill[b * 4 + off / 64], 1ull << (off % 64));
        if (keep != 0) atomicOr(&keep[(b * hk + h) * 4 + off / 64], 1ull << (off % 64));
        if (codes != 0) quantize_row(kc, kc0, kc1, kc2, kscale, b, off, h, bs, hk, d, codes, qparams);
    }
}

// Quest's units u0.. of block b recomputed: channel-wise min/max over the slots `filled(o)` of each unit,
// stored in lane order (channel c at lane c % 16, slot c / 16) as kvs_quest_scores reads it. Block-wide.
template <typename Filled>
__device__ __forceinline__ void unit_bounds(i64 b, int u0, Filled filled, const kv_t* kc, i64 kc0, i64 kc1, i64 kc2, float kscale, int hk, int d,
                                            int unit, int upb, u16* qmin, u16* qmax) {
    const int per = hk * d;
    const i64 n = (i64)(upb - u0) * per;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const int u = u0 + (int)(i / per), h = (int)((i % per) / d), c = (int)(i % d);
        float mn = INFINITY, mx = -INFINITY;
        fold_cached(kc + b * kc0 + (i64)h * kc2 + c, kc1, kscale, u * unit, (u + 1) * unit, filled, mn, mx);
        const i64 idx = ((b * upb + u) * hk + h) * (i64)d + (c % 16) * (d / 16) + c / 16;
        qmin[idx] = kvs_f16_down(mn);
        qmax[idx] = kvs_f16_up(mx);
    }
}

// One CTA per token: the token written at its block's first offset claims the block (exactly one, also
// with duplicate slots), resets its scratch and, when Quest is on (unit > 0), recomputes the block's units
// from the first written one on: channel-wise min/max over the filled slots of each unit.
extern "C" __global__ void kvs_meta_units(const void* slots, i64 slot_stride, int is64, int tokens, i64 num_blocks, int bs, int* first,
                                          const unsigned long long* fill, const kv_t* kc, i64 kc0, i64 kc1, i64 kc2, int hk, int d,
                                          int unit, int upb, u16* qmin, u16* qmax, float kscale) {
    __shared__ int won;
    for (int t = blockIdx.x; t < tokens; t += gridDim.x) {
        i64 b;
        int off;
        const bool ok = kvs_slot(slots, slot_stride, is64, t, num_blocks * bs, bs, &b, &off);
        __syncthreads();  // `won` of the previous token is read by everyone
        if (threadIdx.x == 0) won = ok && first[b] == bs - off && atomicCAS(&first[b], bs - off, 0) == bs - off;
        __syncthreads();
        if (!won || unit == 0) continue;
        unit_bounds(b, off / unit, [&](int o) { return (fill[b * 4 + o / 64] >> (o % 64)) & 1ull; }, kc, kc0, kc1, kc2, kscale, hk, d, unit, upb, qmin, qmax);
    }
}
