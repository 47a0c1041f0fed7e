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
// A call of few tokens (a decode step) does the same in one launch, kvs_meta_step (at the end of this file).
// With SnapKV's bits only (no Quest bounds, no INT4 copy) just `set` runs: nothing reads fill's cleared tail.
// Slots are validated here as in kvs_cache_write (negative or out of range: skipped).
// Requires KVS_DTYPE; compiled with --fmad=false (decide.cuh). KV8 (fp8.cuh): an FP8 key cache, read as the
// CPU's load_cache_row reads it (the byte's exact value times k_scale, one f32 rounding).

#include "common.cuh"
#include "decide.cuh"
#include "kv_load.cuh"

__device__ __forceinline__ bool kvs_slot(const void* slots, i64 stride, int is64, int t, i64 capacity, int bs, i64* blk, int* off) {
    const i64 slot = is64 ? ((const i64*)slots)[t * stride] : (i64)((const int*)slots)[t * stride];
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
        mn = fminf(mn, v);
        mx = fmaxf(mx, v);
    }
    const i64 r = (b * bs + off) * hk + h;
    unsigned char* cr = codes + r * (d / 2);
    const u16 mn16 = kvs_f16_down(mn);
    const float mnf = kvs_f16_to_f32(mn16);
    const u16 sc16 = kvs_f16_up((mx - mnf) / 15.0f);
    const float scf = kvs_f16_to_f32(sc16);
    const bool ok = isfinite(mn) && isfinite(mx) && isfinite(mnf) && isfinite(scf);
    const float inv = scf > 0.0f ? 1.0f / scf : 0.0f;
    for (int c = 0; c < d; c += 2) {
        unsigned char byte = 0;
        if (ok) {
            const float c0 = roundf((kv_ld(row[c], kscale) - mnf) * inv);
            const float c1 = roundf((kv_ld(row[c + 1], kscale) - mnf) * inv);
            // clamp(0, 15) with NaN -> 0, as Rust's `clamp(..) as u8`
            const unsigned q0 = c0 >= 0.0f ? (unsigned)fminf(c0, 15.0f) : 0u;
            const unsigned q1 = c1 >= 0.0f ? (unsigned)fminf(c1, 15.0f) : 0u;
            byte = (unsigned char)(q0 | (q1 << 4));
        }
        cr[c / 2] = byte;
    }
    qparams[2 * r] = ok ? mn16 : (u16)0;
    qparams[2 * r + 1] = ok ? sc16 : (u16)0;
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
        const kv_t* col = kc + b * kc0 + (i64)h * kc2 + c;
        // Eight slots' loads in flight at a time (every slot of a valid block is inside the cache; the
        // unfilled ones are read and ignored), folded in slot order as before.
        for (int o0 = u * unit; o0 < (u + 1) * unit; o0 += 8) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = o0 + j < (u + 1) * unit ? kv_ld(col[(i64)(o0 + j) * kc1], kscale) : 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (o0 + j < (u + 1) * unit && filled(o0 + j)) {
                    mn = fminf(mn, v[j]);
                    mx = fmaxf(mx, v[j]);
                }
        }
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

// The four steps in one launch, for calls of few tokens (decode steps: META_STEP_MAX_TOKENS in
// src/cuda/meta.rs): one CTA per token, each of which reads every slot of the call, so it knows without
// a grid-wide barrier its block's first written offset f, the offsets the call writes there, and whether
// it is the block's owner (the first token written at f). The owner alone updates the block's fill words
// ((old & bits below f) | written, as mark -> clear -> set) and recomputes its units from f's on over the
// new mask; every token sets its SnapKV bits and quantizes its own row. Same results as the four
// launches; `first` is not used (it stays 0). Block-wide.
extern "C" __global__ void __launch_bounds__(1024) kvs_meta_step(const void* slots, i64 slot_stride, int is64, int tokens, i64 num_blocks, int bs,
                                         unsigned long long* fill, const kv_t* kc, i64 kc0, i64 kc1, i64 kc2, int hk, int d, int unit, int upb,
                                         u16* qmin, u16* qmax, unsigned char* codes, u16* qparams, unsigned long long* keep, float kscale) {
    __shared__ int f, owner;
    __shared__ unsigned long long written[4], mask[4];
    const int t = blockIdx.x;
    i64 b;
    int off;
    if (!kvs_slot(slots, slot_stride, is64, t, num_blocks * bs, bs, &b, &off)) return;  // uniform
    if (threadIdx.x == 0) {
        f = bs;
        owner = tokens;
    }
    if (threadIdx.x < 4) written[threadIdx.x] = 0ull;
    __syncthreads();
    for (int u = threadIdx.x; u < tokens; u += blockDim.x) {
        i64 bu;
        int ou;
        if (kvs_slot(slots, slot_stride, is64, u, num_blocks * bs, bs, &bu, &ou) && bu == b) {
            atomicMin(&f, ou);
            atomicOr(&written[ou / 64], 1ull << (ou % 64));
        }
    }
    __syncthreads();
    for (int u = threadIdx.x; u < tokens; u += blockDim.x) {
        i64 bu;
        int ou;
        if (kvs_slot(slots, slot_stride, is64, u, num_blocks * bs, bs, &bu, &ou) && bu == b && ou == f) atomicMin(&owner, u);
    }
    if (keep != 0)
        for (int h = threadIdx.x; h < hk; h += blockDim.x) atomicOr(&keep[(b * hk + h) * 4 + off / 64], 1ull << (off % 64));
    if (codes != 0)
        for (int h = threadIdx.x; h < hk; h += blockDim.x) quantize_row(kc, kc0, kc1, kc2, kscale, b, off, h, bs, hk, d, codes, qparams);
    __syncthreads();
    if (owner != t) return;  // uniform
    if (threadIdx.x < 4) {
        const int lo = f - 64 * (int)threadIdx.x;  // bits >= lo of word w are cleared
        const unsigned long long below = lo >= 64 ? ~0ull : (lo <= 0 ? 0ull : ((1ull << lo) - 1ull));
        mask[threadIdx.x] = (fill[b * 4 + threadIdx.x] & below) | written[threadIdx.x];
        fill[b * 4 + threadIdx.x] = mask[threadIdx.x];
    }
    __syncthreads();
    if (unit > 0) unit_bounds(b, f / unit, [&](int o) { return (mask[o / 64] >> (o % 64)) & 1ull; }, kc, kc0, kc1, kc2, kscale, hk, d, unit, upb, qmin, qmax);
}
