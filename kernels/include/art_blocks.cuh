// ART's block count, once every split of a row's attention has run (kernels/attention_mma.cu, ART=1: the
// CTA that finishes a (sequence, KV head) last calls it): the blocks of the row's plan that no visited tile
// reached, added to CTR_BLOCKS_SKIPPED_TERMINATION and taken back from CTR_BLOCKS_VISITED (which the
// selection counted for the whole plan). The plan is in position order, each entry within one block; an
// entry's visit index is the priority order's inverse (`inv`, kvs_art_priority) or ART's recency order
// (sink entries, then newest first). An entry counts as visited when its first slot lies in its
// segment's visited prefix (`done[k]` tiles of 64 slots of segment k, `chunk` slots each), or a later
// segment it reaches visited anything. All threads of the CTA call it (blockDim a multiple of 32).
#pragma once
#include "common.cuh"
#include "decide.cuh"
#include "block_reduce.cuh"

__device__ __forceinline__ void art_count_blocks(int lo, int hi, int bs_log2, const unsigned* pe, int pl, int ulog2, int sink_limit, const int* done,
                                                 int nsplit, i64 chunk, const int* iv, unsigned long long* ctr, unsigned long long* red) {
    const int per = 1 << ulog2;
    int nsink = 0;
    while (!iv && nsink < pl && (int)(pe[nsink] << ulog2) < sink_limit) ++nsink;
    auto visited = [&](int j) {
        const i64 a = (i64)(iv ? iv[j] : (j < nsink ? j : nsink + (pl - 1 - j))) * per;
        const int k0 = (int)(a / chunk);
        if (k0 >= nsplit) return false;
        if (a - (i64)k0 * chunk < (i64)__ldcg(done + k0) * 64) return true;
        const int k1 = (int)min((a + per - 1) / chunk, (i64)nsplit - 1);
        for (int k = k0 + 1; k <= k1; ++k)
            if (__ldcg(done + k) > 0) return true;
        return false;
    };
    // The block of entry j's visible part, or -1.
    auto block_of = [&](int j) {
        const int pos = (int)(pe[j] << ulog2);
        const int a = max(pos, lo), b = min(pos + per - 1, hi);
        return a <= b ? a >> bs_log2 : -1;
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
