// Tensor-core building blocks shared by the attention kernels (attention_mma.cu, attention_prefill.cu):
// 16-byte cp.async with an optional L2 prefetch hint, ldmatrix, mma.sync m16n8k16 in the cache type with
// f32 accumulation, and the packing of two f32 probabilities into one A-operand register. Needs KVS_DTYPE
// (1 = f16, 2 = bf16); L2_HINT (0, 64, 128 or 256) defaults to 0. MMA_F16=1 makes the MMAs f16 whatever
// the query type (an FP8 cache widens exactly to f16 in one instruction, attention_mma.cu).
#pragma once
#include "common.cuh"

#ifndef MMA_F16
#define MMA_F16 0
#endif
#if KVS_DTYPE == 1 || MMA_F16
#define MMA_T "f16"
#else
#define MMA_T "bf16"
#endif

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
// L2_HINT (0, 64, 128 or 256): L2 prefetch-size hint of the copies (0 = none).
#ifndef L2_HINT
#define L2_HINT 0
#endif
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
#if L2_HINT == 256
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
#elif L2_HINT == 128
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
#elif L2_HINT == 64
    asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void mma16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_T "." MMA_T ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Two f32 -> one register of two cache-type values (lo in the low half); *sum += the f32 values (the
// softmax denominator and the LSE stay exact; only the PV weights are rounded).
__device__ __forceinline__ unsigned pack2(float lo, float hi, float* sum) {
    unsigned r;
#if KVS_DTYPE == 1 || MMA_F16
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    *sum += lo + hi;
    return r;
}
