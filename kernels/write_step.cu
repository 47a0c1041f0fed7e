// A cache write of few tokens (a decode step; src/cuda/write_step.rs) in one launch: the slot check of
// kvs_slots_check, the store of kvs_cache_write (cache_write.cu) and the key metadata of meta.cu's kernels.
// One CTA per token. Each reads every slot of the call, so without a grid-wide barrier it knows
//  - whether any slot is at or beyond the capacity: then nothing is written, every entry of `clean` is -1
//    and the CTA of the first such token records the fault, as kvs_slots_check does;
//  - whether its token is the last one of the call written at its slot (the CPU writes the tokens in order,
//    so of a slot written twice the later row stays): only that token stores its K/V rows, sets its SnapKV
//    bits and makes the INT4 copy of its key rows;
//  - its block's first written offset f and every offset the call writes there. The block's owner (the
//    token that stays at f) updates the block's fill words as mark -> clear -> set do, then Quest's units
//    from f's on.
// The owner takes the call's rows from the input tensors converted exactly as the cache stores them
// (stored_value; another CTA's store in the same launch need not be visible to it).
// Quest's unit of f is updated incrementally when the call only appends to it (no fill bit of that unit at
// or above f was set before): its stored fp16 bounds folded with the new rows. Rounding to fp16 downwards
// (upwards) is monotone and leaves fp16 values as they are, so it commutes with min (max), and min/max
// (kvs_min_num, -0 < +0) do not depend on the order: the result is the recompute's, bit for bit. Otherwise
// (a rewrite) the unit's kept rows below f are read from the cache, as kvs_meta_units does. The later units
// hold only rows of this call.
// `clean` gets the call's slots (or -1 everywhere) for the policy write hooks that run after this launch.
// No host sync, capturable. Requires KVS_DTYPE (the new rows' type) and KV8; compiled with --fmad=false.

#include "key_rows.cuh"
#include "fp8.cuh"

// Element c of head h of new row u as the cache stores it and kv_ld reads it back.
__device__ __forceinline__ float stored_value(const elem_t* x, i64 x0, i64 x1, i64 x2, int u, int h, int c, float scale) {
    return kv_ld(kv_st(x[(i64)u * x0 + (i64)h * x1 + (i64)c * x2], scale), scale);
}

// The bits of fill word w for the offsets in [lo, hi).
__device__ __forceinline__ unsigned long long word_bits(int w, int lo, int hi) {
    const int a = max(lo - 64 * w, 0), z = min(hi - 64 * w, 64);
    if (a >= z) return 0ull;
    return (z == 64 ? ~0ull : ((1ull << z) - 1ull)) & ~((1ull << a) - 1ull);
}

// Folds channel c of KV head h of the call's rows at the written offsets in [lo, hi) into (mn, mx), in
// slot order; tok_at[o] is the token that stays at offset o.
__device__ __forceinline__ void fold_new(const unsigned long long* written, const int* tok_at, const elem_t* key, i64 k0, i64 k1, i64 k2, int h, int c,
                                         float kscale, int lo, int hi, float& mn, float& mx) {
    for (int w = lo / 64; w * 64 < hi; ++w) {
        unsigned long long bits = written[w] & word_bits(w, lo, hi);
        while (bits != 0ull) {
            const int o = 64 * w + __ffsll((long long)bits) - 1;
            bits &= bits - 1ull;
            const float v = stored_value(key, k0, k1, k2, tok_at[o], h, c, kscale);
            mn = kvs_min_num(mn, v);
            mx = kvs_max_num(mx, v);
        }
    }
}

// The INT4 copy of token t's key row at KV head h (copy row r), by one warp: min/max over the lanes (in
// any order: kvs_min_num), then two codes per lane and step.
__device__ __forceinline__ void quantize_new_row(const elem_t* key, i64 k0, i64 k1, i64 k2, int t, int h, int d, float kscale, i64 r, unsigned char* codes,
                                                 u16* qparams) {
    const int lane = threadIdx.x & 31;
    float mn = INFINITY, mx = -INFINITY;
    for (int c = lane; c < d; c += 32) {
        const float v = stored_value(key, k0, k1, k2, t, h, c, kscale);
        mn = kvs_min_num(mn, v);
        mx = kvs_max_num(mx, v);
    }
    for (int o = 16; o > 0; o >>= 1) {
        mn = kvs_min_num(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mx = kvs_max_num(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    }
    const Int4Params p = int4_params(mn, mx);
    unsigned char* cr = codes + r * (d / 2);
    for (int c = 2 * lane; c < d; c += 64) cr[c / 2] = int4_byte(stored_value(key, k0, k1, k2, t, h, c, kscale), stored_value(key, k0, k1, k2, t, h, c + 1, kscale), p);
    if (lane == 0) int4_store_params(qparams, r, p);
}

// Grid: one CTA per token; blockDim a multiple of 32. Metadata pointers are NULL where the engine keeps
// none (fill == NULL: no metadata at all; unit == 0: no Quest bounds; codes, keep).
extern "C" __global__ void __launch_bounds__(1024)
kvs_write_step(const elem_t* key, i64 k0, i64 k1, i64 k2, const elem_t* val, i64 v0, i64 v1, i64 v2,
               kv_t* kc, i64 kc0, i64 kc1, i64 kc2, i64 kc3, kv_t* vc, i64 vc0, i64 vc1, i64 vc2, i64 vc3,
               const void* slots, i64 slot_stride, int is64, int tokens, int hk, int d, i64 num_blocks, int bs, float kscale, float vscale,
               i64* clean, unsigned long long* err, unsigned long long* fill, int unit, int upb, u16* qmin, u16* qmax,
               unsigned char* codes, u16* qparams, unsigned long long* keep) {
    KVS_GRID_LAUNCH_DEPENDENTS();  // the next kernel may be scheduled now; its KVS_GRID_WAIT() orders memory
    __shared__ int bad, f;
    __shared__ int tok_at[256];  // block_size <= 256
    __shared__ unsigned long long written[4], old[4], mask[4];
    const int t = blockIdx.x;
    const i64 capacity = num_blocks * bs;
    const i64 s = kvs_slot_at(slots, slot_stride, is64, t);
    const bool mine = s >= 0 && s < capacity;
    const i64 b = mine ? s / bs : -1;
    const int off = mine ? (int)(s % bs) : 0;
    if (threadIdx.x == 0) {
        bad = 0x7fffffff;
        f = bs;
    }
    if (threadIdx.x < 4) written[threadIdx.x] = 0ull;
    for (int o = threadIdx.x; o < bs; o += blockDim.x) tok_at[o] = -1;
    __syncthreads();
    for (int u = threadIdx.x; u < tokens; u += blockDim.x) {
        const i64 su = kvs_slot_at(slots, slot_stride, is64, u);
        if (su >= capacity) {
            atomicMin(&bad, u);
        } else if (mine && su >= 0 && su / bs == b) {
            const int ou = (int)(su % bs);
            atomicMin(&f, ou);
            atomicOr(&written[ou / 64], 1ull << (ou % 64));
            atomicMax(&tok_at[ou], u);
        }
    }
    __syncthreads();
    if (bad != 0x7fffffff) {  // uniform: some slot is out of range, nothing is written
        if (threadIdx.x == 0) {
            clean[t] = -1;
            if (t == bad) kvs_fail(err, kvs_fault_key(KVS_FAULT_SLOT, t, 0, 0), s, capacity);
        }
        return;
    }
    if (threadIdx.x == 0) clean[t] = s;
    if (!mine) return;  // padding (negative slot): uniform
    if (tok_at[off] == t) {
        for (int i = threadIdx.x; i < hk * d; i += blockDim.x) {
            const int h = i / d, c = i % d;
            kc[b * kc0 + off * kc1 + h * kc2 + c * kc3] = kv_st(key[t * k0 + h * k1 + c * k2], kscale);
            vc[b * vc0 + off * vc1 + h * vc2 + c * vc3] = kv_st(val[t * v0 + h * v1 + c * v2], vscale);
        }
        if (keep != 0)
            for (int h = threadIdx.x; h < hk; h += blockDim.x) atomicOr(&keep[(b * hk + h) * 4 + off / 64], 1ull << (off % 64));
        if (codes != 0)
            for (int h = threadIdx.x / 32; h < hk; h += blockDim.x / 32) quantize_new_row(key, k0, k1, k2, t, h, d, kscale, (b * bs + off) * hk + h, codes, qparams);
    }
    if (fill == 0 || tok_at[f] != t) return;  // uniform: not the block's owner
    if (threadIdx.x < 4) {
        const int w = threadIdx.x;
        old[w] = fill[b * 4 + w];
        mask[w] = (old[w] & word_bits(w, 0, f)) | written[w];  // bits >= f cleared, then the call's set
        fill[b * 4 + w] = mask[w];
    }
    __syncthreads();
    if (unit == 0) return;
    const int u0 = f / unit;
    const bool append = ((old[0] & word_bits(0, f, (u0 + 1) * unit)) | (old[1] & word_bits(1, f, (u0 + 1) * unit)) | (old[2] & word_bits(2, f, (u0 + 1) * unit)) |
                         (old[3] & word_bits(3, f, (u0 + 1) * unit))) == 0ull;
    const auto kept = [&](int o) { return (mask[o / 64] >> (o % 64)) & 1ull; };
    const int per = hk * d;
    const i64 n = (i64)(upb - u0) * per;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const int u = u0 + (int)(i / per), h = (int)((i % per) / d), c = (int)(i % d);
        const i64 idx = ((b * upb + u) * hk + h) * (i64)d + (c % 16) * (d / 16) + c / 16;
        const kv_t* col = kc + b * kc0 + (i64)h * kc2 + (i64)c * kc3;
        const int lo = u * unit, hi = lo + unit;
        float mn = INFINITY, mx = -INFINITY;
        if (u == u0 && append) {
            mn = kvs_f16_to_f32(qmin[idx]);
            mx = kvs_f16_to_f32(qmax[idx]);
        } else if (u == u0) {
            fold_cached(col, kc1, kscale, lo, f, kept, mn, mx);
        }
        fold_new(written, tok_at, key, k0, k1, k2, h, c, kscale, max(lo, f), hi, mn, mx);
        qmin[idx] = kvs_f16_down(mn);
        qmax[idx] = kvs_f16_up(mx);
    }
}
