// ART's selection-side kernels (src/policy/art/cuda.rs launches them; the probe itself runs inside the
// tensor-core attention kernel, ART=1 of attention_mma.cu): the blocks no visited tile reached, and the
// priority order behind Quest. Moved from select.cu; the conventions of a plan, the trust rules and the
// counters are select.cu's (see its header).
//
// Compile-time parameters: KVS_DTYPE, HEAD_DIM, GROUP (query heads per KV head).

#include "common.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"

// ART, once every split of the attention has run: the blocks of each decode row's plan that no visited
// tile reached, added to CTR_BLOCKS_SKIPPED_TERMINATION and taken back from CTR_BLOCKS_VISITED (which the
// selection counted for the whole plan). The plan is in position order, each entry within one block
// (all/streaming plans); its visit index follows ART's order (sink entries, then newest first). An entry
// counts as visited when its first slot lies in its split's visited prefix (`done` tiles of 64 slots), or
// a later split it reaches visited anything. One CTA per (KV head, sequence).
extern "C" __global__ void kvs_art_blocks(Batch b, int hk, const unsigned* plan, i64 p_s, i64 p_h, const int* plan_len, int cap, int ulog2,
                                          int sink_limit, const int* tiles, int nsplit, int chunk, const int* inv, unsigned long long* ctr) {
    __shared__ unsigned long long red[32];
    const int s = blockIdx.y, h = blockIdx.x;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) return;
    const unsigned* pe = plan + s * p_s + h * p_h;
    const int pl = min(max(plan_len[s * hk + h], 0), cap);
    const int per = 1 << ulog2;
    const int* done = tiles + (i64)(s * hk + h) * nsplit;
    // Visit index of entry j: the priority order's inverse (kvs_art_priority), else recency.
    const int* iv = inv ? inv + s * p_s + h * p_h : nullptr;
    int nsink = 0;
    while (!iv && nsink < pl && (int)(pe[nsink] << ulog2) < sink_limit) ++nsink;
    auto visited = [&](int j) {
        const i64 a = (i64)(iv ? iv[j] : (j < nsink ? j : nsink + (pl - 1 - j))) * per;
        const int k0 = (int)(a / chunk);
        if (k0 >= nsplit) return false;
        if (a - (i64)k0 * chunk < (i64)done[k0] * 64) return true;
        const int k1 = min((int)((a + per - 1) / chunk), nsplit - 1);
        for (int k = k0 + 1; k <= k1; ++k)
            if (done[k] > 0) return true;
        return false;
    };
    // The block of entry j's visible part, or -1.
    auto block_of = [&](int j) {
        const int pos = (int)(pe[j] << ulog2);
        const int lo = max(pos, r.lo), hi = min(pos + per - 1, r.hi);
        return lo <= hi ? lo >> b.bs_log2 : -1;
    };
    unsigned long long all = 0, seen = 0;
    for (int j = threadIdx.x; j < pl; j += blockDim.x) {
        const int blk = block_of(j);
        if (blk < 0) continue;
        if (j == 0 || block_of(j - 1) != blk) all += 1;
        if (!visited(j)) continue;
        bool earlier = false;  // an earlier entry of the same block was visited: counted there
        for (int i = j - 1; i >= 0 && block_of(i) == blk; --i)
            if (visited(i)) {
                earlier = true;
                break;
            }
        if (!earlier) seen += 1;
    }
    all = block_sum(all, red);
    seen = block_sum(seen, red);
    if (threadIdx.x == 0 && all > seen) {
        atomicAdd(&ctr[CTR_BLOCKS_VISITED], (unsigned long long)(-(long long)(all - seen)));
        atomicAdd(&ctr[CTR_BLOCKS_SKIPPED_TERMINATION], all - seen);
    }
}

// ART's priority order behind Quest (order=priority; termination::order_entries on the CPU): per (sequence,
// KV head) the plan's entries (absolute pages, position order) in visiting order: entries below
// `sink_limit` first (position order), then the newest entry (the row's own page), then the rest by their
// page's Quest score, highest first; ties, and NaN scores (as -inf), by recency (the later page first).
// Sorted as unique 64-bit keys (order key of the score, entry index) by a bitonic sort in dynamic shared
// memory of `n2` keys (a power of two >= the plan's capacity). Writes order[i] = the entry value visited
// i-th and inv[j] = the visit index of entry j, both in the plan's layout.
extern "C" __global__ void __launch_bounds__(512) kvs_art_priority(Batch b, int hk, const unsigned* plan, i64 p_s, i64 p_h, const int* plan_len,
                                                                   int cap, int sink_limit, int page, const float* scores, int maxp,
                                                                   unsigned* order, int* inv, int n2) {
    extern __shared__ unsigned long long akey[];
    __shared__ int sm_nsink;
    const int s = blockIdx.y, h = blockIdx.x;
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
