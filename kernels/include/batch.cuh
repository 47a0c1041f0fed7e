// A selection kernel's view of the batch (the `Batch` of params.cuh: block table, lengths, query
// starts): a row's limits and physical blocks, and the per-call row and plan accounting into the layer's
// device counters.
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "decide.cuh"
#include "block_reduce.cuh"

__device__ __forceinline__ SeqRow seq_row(const Batch& b, int s) {
    return kvs_seq_row(s, b.qsl, b.qsl0, b.seq_lens, b.sl0, b.bt_cols << b.bs_log2, b.window, b.num_tokens);
}

// Physical block of logical block `lb` of sequence s, or -1.
__device__ __forceinline__ i64 phys_block(const Batch& b, int s, int lb) {
    if (lb < 0 || lb >= b.bt_cols) return -1;
    const i64 id = b.bt[s * b.bt0 + (i64)lb * b.bt1];
    return (id >= 0 && id < b.num_blocks) ? id : -1;
}

// Counts the blocks and tokens that the plan entries j0 <= j < j1 visit inside lo..=hi (entry(j): the
// plan's j-th unit, increasing in j; entry(j0 - 1) is read for the block the previous entry shares), as the
// CPU counts its candidate units, and adds them (times `heads`) to the counters. Block-wide; CTAs that
// each count a part of one plan add up to the whole plan's counts.
template <typename Entry>
__device__ __forceinline__ void account_entries(Entry entry, int j0, int j1, int ulog2, int lo, int hi, int bs_log2, int heads, i64 row_bytes,
                                                unsigned long long* ctr, unsigned long long* red) {
    unsigned long long blocks = 0, tokens = 0;
    for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
        const i64 ej = entry(j), a = max(ej << ulog2, (i64)lo), z = min(((ej + 1) << ulog2) - 1, (i64)hi);
        if (a > z) continue;
        i64 nb = (z >> bs_log2) - (a >> bs_log2) + 1;
        if (j > 0) {
            const i64 ep = entry(j - 1), pa = max(ep << ulog2, (i64)lo), pz = min(((ep + 1) << ulog2) - 1, (i64)hi);
            if (pa <= pz && (pz >> bs_log2) == (a >> bs_log2)) nb -= 1;
        }
        blocks += nb;
        tokens += z - a + 1;
    }
    blocks = block_sum(blocks, red);
    tokens = block_sum(tokens, red);
    if (threadIdx.x == 0 && (blocks | tokens) != 0) {
        atomicAdd(&ctr[CTR_BLOCKS_VISITED], blocks * heads);
        atomicAdd(&ctr[CTR_KV_BYTES], tokens * (unsigned long long)row_bytes * heads);
    }
}

// account_entries over a whole plan e[0..n).
__device__ __forceinline__ void account(const unsigned* e, int n, int ulog2, int lo, int hi, int bs_log2, int heads, i64 row_bytes,
                                        unsigned long long* ctr, unsigned long long* red) {
    account_entries([&](int j) { return (i64)e[j]; }, 0, n, ulog2, lo, hi, bs_log2, heads, row_bytes, ctr, red);
}

// Per call: decode rows, prefill tokens and the dense rows' KV bytes, as the CPU counts them. Block-wide
// (one CTA of the first selection kernel runs it).
__device__ __forceinline__ void rows_count(const Batch& b, int hk, i64 row_bytes, unsigned long long* ctr, unsigned long long* red) {
    unsigned long long dec = 0, pre = 0, bytes = 0;
    for (int s = threadIdx.x; s < b.num_seqs; s += blockDim.x) {
        const SeqRow r = seq_row(b, s);
        if (r.decode) {
            dec += 1;
        } else {
            pre += r.q_len > 0 ? r.q_len : 0;
            const int first = r.hi + 1 - (r.q_len > 0 ? r.q_len : 0);  // first query position
            const int vis = (b.window > 0 && first + 1 - b.window > 0) ? first + 1 - b.window : 0;
            if (r.hi + 1 > vis) bytes += (unsigned long long)(r.hi + 1 - vis) * row_bytes * hk;
        }
    }
    dec = block_sum(dec, red);
    pre = block_sum(pre, red);
    bytes = block_sum(bytes, red);
    if (threadIdx.x == 0) {
        atomicAdd(&ctr[CTR_DECODE_ROWS], dec);
        atomicAdd(&ctr[CTR_PREFILL_TOKENS], pre);
        atomicAdd(&ctr[CTR_KV_BYTES], bytes);
    }
}
