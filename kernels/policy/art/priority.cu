// ART's selection-side kernel (src/policy/art/cuda.rs launches it; the probe, the decision and the count
// of the blocks no visited tile reached run inside the tensor-core attention kernel, through its traversal
// hook: traversal.cuh beside this file): the priority order behind Quest. Moved from select.cu; the
// conventions of a plan, the trust rules and the counters are select.cu's (see its header).
//
// Compile-time parameters: KVS_DTYPE, HEAD_DIM, GROUP (query heads per KV head).

#include "common.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "topk.cuh"

// ART's priority order behind Quest (order=priority; termination::order_entries on the CPU): per (sequence,
// KV head) the plan's entries (absolute pages, position order) in visiting order: entries below
// `sink_limit` first (position order), then the newest entry (the row's own page), then the rest by their
// page's Quest score, highest first; ties, and NaN scores (as -inf), by recency (the later page first).
// Sorted as unique 64-bit keys (order key of the score, entry index) by a bitonic sort in dynamic shared
// memory of `n2` keys (a power of two >= the plan's capacity). Writes order[i] = the entry value visited
// i-th and inv[j] = the visit index of entry j, both in the plan's layout, and zeroes the row's arrival
// counter of the attention's splits (`arrive[s * hk + h]`, ArtArgs in traversal.cuh).
extern "C" __global__ void __launch_bounds__(512) kvs_art_priority(Batch b, int hk, const unsigned* plan, i64 p_s, i64 p_h, const int* plan_len,
                                                                   int cap, int sink_limit, int page, const float* scores, int maxp,
                                                                   unsigned* order, int* inv, int n2, int* arrive) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    extern __shared__ unsigned long long akey[];
    __shared__ int sm_nsink;
    const int s = blockIdx.y, h = blockIdx.x;
    if (threadIdx.x == 0) arrive[s * hk + h] = 0;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) return;
    const unsigned* pe = plan + s * p_s + h * p_h;
    unsigned* od = order + s * p_s + h * p_h;
    int* iv = inv + s * p_s + h * p_h;
    const int pl = min(max(plan_len[s * hk + h], 0), cap);
    if (pl == 0) return;
    // Entries are in position order, so the sink entries are a prefix: count them.
    if (threadIdx.x == 0) sm_nsink = 0;
    __syncthreads();
    int mine = 0;
    for (int j = threadIdx.x; j < pl; j += blockDim.x) mine += (i64)pe[j] * page < (i64)sink_limit;
    if (mine) atomicAdd(&sm_nsink, mine);
    __syncthreads();
    const int nsink = sm_nsink;
    const int rest = max(pl - 1 - nsink, 0);
    const int fp = r.lo / page;
    const float* sc = scores + (i64)(s * hk + h) * maxp;
    for (int i = threadIdx.x; i < n2; i += blockDim.x) {
        unsigned long long k = 0ull;
        if (i < rest) {
            const int j = nsink + i;
            const int pi = (int)pe[j] - fp;
            float x = (pi >= 0 && pi < maxp) ? sc[pi] : -INFINITY;
            if (x != x) x = -INFINITY;
            k = ((unsigned long long)kvs_order_key(x) << 32) | (unsigned)j;
        }
        akey[i] = k;
    }
    __syncthreads();
    // Bitonic sort, descending.
    for (int size = 2; size <= n2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < n2; i += blockDim.x) {
                const int p = i ^ stride;
                if (p > i) {
                    const bool desc = (i & size) == 0;
                    const unsigned long long a = akey[i], c = akey[p];
                    if (desc ? (a < c) : (a > c)) {
                        akey[i] = c;
                        akey[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int i = threadIdx.x; i < pl; i += blockDim.x) {
        int j;
        if (i < nsink) j = i;
        else if (i == nsink) j = pl - 1;
        else j = (int)(akey[i - nsink - 1] & 0xffffffffull);
        od[i] = pe[j];
        iv[j] = i;
    }
}
