// Stores new K/V rows into the paged cache by slot mapping (slot = block * block_size + offset), as vLLM's
// reshape_and_cache_flash does. Negative slots are padding and skipped. Bounds contract: the slot mapping
// lives on the device and is not read by the host, so a slot >= num_blocks * block_size is also skipped
// (never written out of bounds); the host has already validated shapes, dtypes and strides.
// Requires KVS_DTYPE; KV8 (fp8.cuh): an FP8 cache stores `x / scale` quantized as vLLM does.
// One thread per (token, kv head, element), grid-stride.

#include "common.cuh"
#include "kv_load.cuh"

extern "C" __global__ void kvs_cache_write(const elem_t* key, i64 k0, i64 k1, i64 k2,
                                           const elem_t* val, i64 v0, i64 v1, i64 v2,
                                           kv_t* kc, i64 kc0, i64 kc1, i64 kc2, i64 kc3,
                                           kv_t* vc, i64 vc0, i64 vc1, i64 vc2, i64 vc3,
                                           const void* slots, i64 slot_stride, int slots_are_i64,
                                           int tokens, int heads, int dim, i64 num_blocks, int block_size
#if KV8
                                           , float k_scale, float v_scale
#endif
                                           ) {
#if !KV8
    const float k_scale = 1.f, v_scale = 1.f;  // unused: kv_st stores the element itself
#endif
    i64 n = (i64)tokens * heads * dim;
    i64 capacity = num_blocks * block_size;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        int d = (int)(i % dim);
        int h = (int)((i / dim) % heads);
        int t = (int)(i / ((i64)dim * heads));
        i64 slot = slots_are_i64 ? ((const i64*)slots)[t * slot_stride] : (i64)((const int*)slots)[t * slot_stride];
        if (slot < 0 || slot >= capacity) continue;
        i64 blk = slot / block_size, off = slot % block_size;
        kc[blk * kc0 + off * kc1 + h * kc2 + d * kc3] = kv_st(key[t * k0 + h * k1 + d * k2], k_scale);
        vc[blk * vc0 + off * vc1 + h * vc2 + d * vc3] = kv_st(val[t * v0 + h * v1 + d * v2], v_scale);
    }
}

// Validates every slot of a cache write before any is written (issue 33): copies the caller's slot
// mapping into the engine's int64 buffer `clean`, or -1 (skip) into every entry when any slot is at or
// beyond the capacity, and records the first such slot (smallest token index) in the error record. The
// write, the metadata and the policies' write hooks then read `clean`, so a bad slot writes nothing.
// One CTA (a block-wide OR separates the two passes); no host sync, capturable.
extern "C" __global__ void __launch_bounds__(1024)
kvs_slots_check(const void* slots, i64 slot_stride, int slots_are_i64, int tokens, i64 capacity, i64* clean, unsigned long long* err) {
    __shared__ int first_bad;
    if (threadIdx.x == 0) first_bad = 0x7fffffff;
    __syncthreads();
    for (int t = threadIdx.x; t < tokens; t += blockDim.x) {
        const i64 s = slots_are_i64 ? ((const i64*)slots)[t * slot_stride] : (i64)((const int*)slots)[t * slot_stride];
        if (s >= capacity) atomicMin(&first_bad, t);
    }
    __syncthreads();
    const int fb = first_bad;
    for (int t = threadIdx.x; t < tokens; t += blockDim.x) {
        const i64 s = slots_are_i64 ? ((const i64*)slots)[t * slot_stride] : (i64)((const int*)slots)[t * slot_stride];
        clean[t] = fb == 0x7fffffff ? s : (i64)-1;
    }
    if (threadIdx.x == 0 && fb != 0x7fffffff) {
        const i64 s = slots_are_i64 ? ((const i64*)slots)[fb * slot_stride] : (i64)((const int*)slots)[fb * slot_stride];
        kvs_fail(err, kvs_fault_key(KVS_FAULT_SLOT, fb, 0, 0), s, capacity);
    }
}
