// Benchmark helper: fills a buffer with reproducible pseudo-random values (hash of index and seed), so
// multi-GB caches are filled on the device instead of being copied from the host. Requires KVS_DTYPE.

#include "common.cuh"
extern "C" __global__ void kvs_fill_random(elem_t* p, i64 n, unsigned seed, float amp) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        unsigned x = (unsigned)i * 2654435761u ^ (unsigned)(i >> 32) * 0x9E3779B9u ^ seed * 0x85EBCA6Bu;
        x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
        p[i] = ET::st(((float)(x & 0xffffff) / 16777216.f - 0.5f) * amp);
    }
}
