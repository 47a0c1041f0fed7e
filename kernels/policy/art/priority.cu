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
// The rest as unique 64-bit keys (order key of the score, entry index) in dynamic shared memory (`cap` keys);
// an entry's place is its rank, the number of keys above its own (a count, so the order is the sort's
// exactly). Grid (hk, seqs, parts): part z ranks the rest's entries z*ART_RANKS .. +ART_RANKS, ART_RANK_SPLIT
// lanes per entry counting every ART_RANK_SPLIT-th key (lanes of a warp read adjacent keys: no bank
// conflicts), so a row's quadratic count runs on many SMs. Writes order[i] = the entry value visited i-th and
// inv[j] = the visit index of entry j, both in the plan's layout; part 0 writes the sinks' and the newest
// entry's and zeroes the row's arrival counter of the attention's splits (`arrive[s * hk + h]`, ArtArgs in
// traversal.cuh).
#define ART_RANK_THREADS 256
#define ART_RANK_SPLIT 4
#define ART_RANKS (ART_RANK_THREADS / ART_RANK_SPLIT)
extern "C" __global__ void __launch_bounds__(ART_RANK_THREADS) kvs_art_priority(Batch b, int hk, const unsigned* plan, i64 p_s, i64 p_h, const int* plan_len,
                                                                               int cap, int sink_limit, int page, const float* scores, int maxp,
                                                                               unsigned* order, int* inv, int* arrive) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    extern __shared__ unsigned long long akey[];
    __shared__ int sm_nsink;
    const int s = blockIdx.y, h = blockIdx.x, z = blockIdx.z;
    if (z == 0 && threadIdx.x == 0) arrive[s * hk + h] = 0;
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
    if (z == 0) {
        for (int i = threadIdx.x; i <= nsink && i < pl; i += blockDim.x) {
            const int j = i < nsink ? i : pl - 1;
            od[i] = pe[j];
            iv[j] = i;
        }
    }
    const int first = z * ART_RANKS;
    if (first >= rest) return;  // uniform: this part ranks nothing
    const int fp = r.lo / page;
    const float* sc = scores + (i64)(s * hk + h) * maxp;
    for (int i = threadIdx.x; i < rest; i += blockDim.x) {
        const int j = nsink + i;
        const int pi = (int)pe[j] - fp;
        float x = (pi >= 0 && pi < maxp) ? sc[pi] : -INFINITY;
        if (x != x) x = -INFINITY;
        akey[i] = ((unsigned long long)kvs_order_key(x) << 32) | (unsigned)j;
    }
    __syncthreads();
    const int i = first + threadIdx.x / ART_RANK_SPLIT, part = threadIdx.x % ART_RANK_SPLIT;
    const unsigned long long key = i < rest ? akey[i] : 0ull;
    int rank = 0;
    for (int j = part; j < rest; j += ART_RANK_SPLIT) rank += akey[j] > key;
#pragma unroll
    for (int o = 1; o < ART_RANK_SPLIT; o <<= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
    if (i < rest && part == 0) {
        const int j = (int)(key & 0xffffffffull), at = nsink + 1 + rank;
        od[at] = pe[j];
        iv[j] = at;
    }
}
