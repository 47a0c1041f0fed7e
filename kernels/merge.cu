// Exact merge of two partial attention states through their LSEs (same rules as src/cpu/merge.rs):
// m = max(la, lb); w = exp(l - m); out = (wa*a + wb*b) / (wa + wb); lse = m + ln(wa + wb).
// One thread per output element. A side with lse = -inf saw no key and is not read (both: zeros, -inf);
// an lse that is NaN or +inf on either side makes the row NaN, lse NaN; NaN or infinity in a side's
// output reaches the merged elements.

#include "common.cuh"

template <typename T>
__device__ void merge_impl(const typename T::S* a, i64 a0, i64 a1, i64 a2, const float* la, i64 la0, i64 la1,
                           const typename T::S* b, i64 b0, i64 b1, i64 b2, const float* lb, i64 lb0, i64 lb1,
                           typename T::S* o, i64 o0, i64 o1, i64 o2, float* lo, i64 lo0, i64 lo1,
                           int tokens, int heads, int dim) {
    i64 n = (i64)tokens * heads * dim;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        int d = (int)(i % dim);
        int h = (int)((i / dim) % heads);
        int t = (int)(i / ((i64)dim * heads));
        float xa = la[t * la0 + h * la1], xb = lb[t * lb0 + h * lb1];
        float m = fmaxf(xa, xb);
        float r, l;
        const float va = T::ld(a[t * a0 + h * a1 + d * a2]), vb = T::ld(b[t * b0 + h * b1 + d * b2]);
        if (isnan(xa) || isnan(xb) || xa == INFINITY || xb == INFINITY) {
            r = __int_as_float(0x7fffffff);
            l = r;
        } else if (m == -INFINITY) {
            r = 0.f;
            l = -INFINITY;
        } else if (xb == -INFINITY) {
            r = va;
            l = xa;
        } else if (xa == -INFINITY) {
            r = vb;
            l = xb;
        } else {
            float wa = __expf(xa - m), wb = __expf(xb - m);
            r = (wa * va + wb * vb) / (wa + wb);
            l = m + __logf(wa + wb);
        }
        o[t * o0 + h * o1 + d * o2] = T::st(r);
        if (lo != 0 && d == 0) lo[t * lo0 + h * lo1] = l;
    }
}

#define KVS_MERGE(NAME, T)                                                                                       \
    extern "C" __global__ void NAME(const T::S* a, i64 a0, i64 a1, i64 a2, const float* la, i64 la0, i64 la1,   \
                                    const T::S* b, i64 b0, i64 b1, i64 b2, const float* lb, i64 lb0, i64 lb1,   \
                                    T::S* o, i64 o0, i64 o1, i64 o2, float* lo, i64 lo0, i64 lo1, int tokens,    \
                                    int heads, int dim) {                                                        \
        merge_impl<T>(a, a0, a1, a2, la, la0, la1, b, b0, b1, b2, lb, lb0, lb1, o, o0, o1, o2, lo, lo0, lo1,     \
                      tokens, heads, dim);                                                                       \
    }
KVS_MERGE(kvs_merge_f32, F32T)
KVS_MERGE(kvs_merge_f16, F16T)
KVS_MERGE(kvs_merge_bf16, BF16T)
