// Thread-block cluster primitives (Hopper, sm_90): the CTA's rank in its cluster, the cluster-wide
// barrier, and loads of another CTA's shared memory (distributed shared memory). Raw PTX, so NVRTC needs
// no cooperative_groups header. Compiled only for sm_90 and newer (KVS_CLUSTERS); the launchers use the
// cluster kernels only on such devices.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVS_CLUSTERS 1
#else
#define KVS_CLUSTERS 0
#endif

#if KVS_CLUSTERS
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// Every thread of every CTA of the cluster: the shared (and global) writes before it are visible to the
// whole cluster after it (arrive has release, wait acquire semantics). A CTA must pass one after its
// last read of another CTA's shared memory and before it exits, so that memory outlives the read.
__device__ __forceinline__ void cluster_sync() { asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory"); }

// The address, in the cluster's shared window, of the same shared-memory location as `p` in CTA `rank`.
__device__ __forceinline__ unsigned cluster_addr(const void* p, unsigned rank) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    unsigned ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    return ra;
}

// The word at the same shared-memory address as `p` in the cluster's CTA `rank`.
__device__ __forceinline__ unsigned ld_cluster(const unsigned* p, unsigned rank) {
    unsigned v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}

// The 64-bit word at the same shared-memory address as `p` (8-byte aligned) in the cluster's CTA `rank`.
__device__ __forceinline__ unsigned long long ld_cluster_u64(const unsigned long long* p, unsigned rank) {
    unsigned long long v;
    asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ double ld_cluster_f64(const double* p, unsigned rank) {
    return __longlong_as_double((long long)ld_cluster_u64(reinterpret_cast<const unsigned long long*>(p), rank));
}
#endif
