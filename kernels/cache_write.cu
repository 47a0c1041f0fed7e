// Stores new K/V rows into the paged cache by slot mapping (slot = block * block_size + offset), as vLLM's
// reshape_and_cache_flash does. Negative slots are padding and skipped. Bounds contract: the slot mapping
// lives on the device and is not read by the host, so a slot >= num_blocks * block_size is also skipped
// (never written out of bounds); the host has already validated shapes, dtypes and strides.
// Requires KVS_DTYPE. One thread per (token, kv head, element), grid-stride.

#include "common.cuh"

extern "C" __global__ void kvs_cache_write(const elem_t* key, i64 k0, i64 k1, i64 k2,
                                           const elem_t* val, i64 v0, i64 v1, i64 v2,
                                           elem_t* kc, i64 kc0, i64 kc1, i64 kc2, i64 kc3,
                                           elem_t* vc, i64 vc0, i64 vc1, i64 vc2, i64 vc3,
                                           const void* slots, i64 slot_stride, int slots_are_i64,
                                           int tokens, int heads, int dim, i64 num_blocks, int block_size) {
    i64 n = (i64)tokens * heads * dim;
    i64 capacity = num_blocks * block_size;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        int d = (int)(i % dim);
        int h = (int)((i / dim) % heads);
        int t = (int)(i / ((i64)dim * heads));
        i64 slot = slots_are_i64 ? ((const i64*)slots)[t * slot_stride] : (i64)((const int*)slots)[t * slot_stride];
        if (slot < 0 || slot >= capacity) continue;
        i64 blk = slot / block_size, off = slot % block_size;
        kc[blk * kc0 + off * kc1 + h * kc2 + d * kc3] = key[t * k0 + h * k1 + d * k2];
        vc[blk * vc0 + off * vc1 + h * vc2 + d * vc3] = val[t * v0 + h * v1 + d * v2];
    }
}
