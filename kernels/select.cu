// Selection kernels: each decode row's visit plan on the device, the same decisions as the CPU engine
// (src/policy/select.rs and each policy's folder) in the same arithmetic (decide.cuh, --fmad=false). A
// plan is, per (sequence, KV head), `plan_len` entries of `1 << ulog2` positions each, in increasing
// order, at plan + s * p_s + h * p_h (p_h = 0: one plan for every head); plan_len = -1 marks a sequence
// that is not a decode row (its attention runs dense). The attention kernel (PLAN=1 variants of
// attention*.cu) reads the plan instead of the block table. This file holds the plain plans (`all`,
// `streaming`); the policies' own selection kernels are in kernels/policy/ and follow the same rules.
//
// Nothing here trusts device metadata: sequence lengths are clamped to the table, rows outside the query
// tensor read nothing, block ids out of range contribute nothing, every write stays inside the plan's
// capacity. Counters (decide.cuh CTR_*) are accumulated with atomics into the layer's device counters.
//
// Compile-time parameters: KVS_DTYPE, HEAD_DIM, GROUP (query heads per KV head).

#include "common.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"

#define SEL_THREADS 256

// `all` (kind 0: every block of the row, unit = block) and `streaming` (kind 1: the first `sink` and last
// `recent` positions, unit = token): one plan shared by every KV head (p_h = 0). One CTA per sequence;
// CTA 0 also counts the call's rows.
extern "C" __global__ void kvs_plan_simple(Batch b, int hk, int kind, int sink, int recent, unsigned* plan, i64 p_s, int* plan_len, int cap,
                                           i64 row_bytes, int count, unsigned long long* ctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ unsigned long long red[32];
    if (blockIdx.x == 0) rows_count(b, hk, row_bytes, ctr, red);  // the call's rows, once
    const int s = blockIdx.x;
    const SeqRow r = seq_row(b, s);
    unsigned* e = plan + s * p_s;
    int n = 0, ulog2 = 0;
    if (r.decode && r.hi >= r.lo) {
        if (kind == 0) {
            ulog2 = b.bs_log2;
            const int f = r.lo >> b.bs_log2;
            n = min((r.hi >> b.bs_log2) - f + 1, cap);
            for (int i = threadIdx.x; i < n; i += blockDim.x) e[i] = f + i;
        } else {
            // spans [lo, a1) and [b0, hi + 1), merged when they touch (as normalize_spans)
            const int a1 = max(r.lo, min(sink, r.hi + 1));
            int b0 = max(r.lo, r.hi + 1 - recent);
            if (b0 < a1) b0 = a1;
            const int na = a1 - r.lo, nb = r.hi + 1 - b0;
            n = min(na + nb, cap);
            for (int i = threadIdx.x; i < n; i += blockDim.x) e[i] = i < na ? r.lo + i : b0 + (i - na);
        }
    }
    for (int i = threadIdx.x; i < hk; i += blockDim.x) plan_len[s * hk + i] = r.decode ? n : -1;
    __syncthreads();
    if (r.decode && count) {
        if (threadIdx.x == 0 && r.hi >= r.lo) {
            atomicAdd(&ctr[CTR_POLICY_ROWS], (unsigned long long)hk);
            atomicAdd(&ctr[CTR_BLOCKS_ELIGIBLE], (unsigned long long)((r.hi >> b.bs_log2) - (r.lo >> b.bs_log2) + 1) * hk);
        }
        account(e, n, ulog2, r.lo, r.hi, b.bs_log2, hk, row_bytes, ctr, red);
    }
}
