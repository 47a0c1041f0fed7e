// Quest's selection kernels (src/policy/quest/cuda.rs launches them): the page scores (alone, as PRR
// reads them, and with the row's key histogram), and the top-k of pages per row. Moved from select.cu;
// the conventions of a plan, the trust rules and the counters are select.cu's (see its header).
//
// Compile-time parameters: KVS_DTYPE, HEAD_DIM, GROUP (query heads per KV head).

#include "common.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"
#include "quest.cuh"
#include "quest_mma.cuh"

// Quest's page scores alone (PRR's selection, src/cuda/prr.rs; Quest itself runs kvs_quest_scores_hist
// below, which scores the same way): the bound of every page of the row, max over the group's query rows and the page's
// units (units of `unit` slots of one block), as quest_page_scores. One half-warp per page: lane l holds
// the channels l, l+16, l+32, ... of the unit's min and max, which the cache write stores contiguously
// per lane (kernels/meta.cu), so a half-warp reads a unit's bounds in coalesced vector loads; each lane
// sums its channels in order and a butterfly over the 16 lanes adds the lane sums, the order the CPU's
// quest_bound follows. Each half-warp scores 4 pages; grid (page tiles of 64, KV heads, seqs).
// CTA (0,0,0) also counts the call's rows (folded in to save a launch) when `count_rows` is set.

extern "C" __global__ void __launch_bounds__(QS_THREADS) kvs_quest_scores(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, int hk,
                                                                          const u16* qmin, const u16* qmax, int unit, int upb, int page,
                                                                          float* scores, int maxp, int count_rows, i64 row_bytes,
                                                                          unsigned long long* ctr) {
    __shared__ float qs[GROUP * 16 * (QC + 1)];  // q rows in lane order, padded against bank conflicts
    __shared__ unsigned long long red[32];
    if (count_rows && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) rows_count(b, hk, row_bytes, ctr, red);
    const int s = blockIdx.z, h = blockIdx.y;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) return;
    float* sc = scores + (i64)(s * hk + h) * maxp;
    const unsigned long long units =
        quest_score_tile(b, r, s, h, q, q0, q1, q2, scale, hk, qmin, qmax, unit, upb, page, maxp, qs, [&](int i, float best) { sc[i] = best; });
    quest_count_units(units, red, ctr);
}

// Quest, selection in two launches: kvs_quest_scores_hist scores the row's pages over many CTAs (as
// kvs_quest_scores) and adds each candidate page (forced <= i < last) to the row's histogram of the top
// QSEL_BITS bits of its order key (`hist`, [seqs * hk][QSEL_BINS] u32, merged in global memory: each CTA
// adds its tile's counts, one atomic per distinct bin); kvs_quest_topk then reads the histogram, finds
// the bin B where the count from the top reaches the m pages needed, checks the counts above and in B
// against the keys, cuts B's pages exactly by topk32 (ties: the later page), and zeroes the histogram for
// the next call. Counts are exact integers and the cut reads the scores themselves, so the set is the
// CPU's quest_pages whatever order the atomics land in; a histogram that does not match the keys (the
// workspace's first use, or bytes another call left there) takes the whole-row path: same set.
#define QSEL_BITS 11
#define QSEL_BINS (1 << QSEL_BITS)
#define QSEL_GATHER 2048

// The row's candidates forced <= i < last and how many of them the top-k keeps (kvs_quest_topk's
// rules), shared by both kernels so they agree on what the histogram counts.
struct QuestRow {
    int fp, np, k, last, forced, m;
};
__device__ __forceinline__ QuestRow quest_row(const SeqRow& r, int budget, int page, int sink, int maxp) {
    QuestRow q;
    q.fp = r.lo / page;
    q.np = min(r.hi / page - q.fp + 1, maxp);
    q.k = max(budget / page + (budget % page != 0), 1);
    q.last = q.np - 1;
    const int sinkp = sink / page + (sink % page != 0);
    q.forced = min(max(sinkp - q.fp, 0), q.last);
    q.m = q.np <= q.k ? 0 : min(max(q.k - 1 - q.forced, 0), q.last - q.forced);
    return q;
}

// The body of both scoring kernels: MMA picks quest_score_tile_mma (unit == page, the launcher's choice)
// over the exact quest_score_tile. Block-wide.
template <bool MMA>
__device__ __forceinline__ void quest_scores_hist(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, int hk, const u16* qmin,
                                                  const u16* qmax, int unit, int upb, int page, int budget, int sink, float* scores, int maxp,
                                                  unsigned* hist, i64 row_bytes, unsigned long long* ctr) {
    __shared__ float qs[GROUP * 16 * (QC + 1)];
    __shared__ unsigned long long red[32];
    __shared__ unsigned tbin[QS_PAGES];
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) rows_count(b, hk, row_bytes, ctr, red);
    const int s = blockIdx.z, h = blockIdx.y;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) return;
    const QuestRow qr = quest_row(r, budget, page, sink, maxp);
    const i64 row = (i64)s * hk + h;
    float* sc = scores + row * maxp;
    if (threadIdx.x < QS_PAGES) tbin[threadIdx.x] = QSEL_BINS;  // none
    auto put = [&](int i, float best) {
        sc[i] = best;
        if (qr.m > 0 && i >= qr.forced && i < qr.last) tbin[i - blockIdx.x * QS_PAGES] = kvs_order_key(best) >> (32 - QSEL_BITS);
    };
    unsigned long long units;
#if QM_FITS
    if (MMA)
        units = quest_score_tile_mma(b, r, s, h, q, q0, q1, q2, scale, hk, qmin, qmax, upb, page, maxp, qs, put);
    else
#endif
        units = quest_score_tile(b, r, s, h, q, q0, q1, q2, scale, hk, qmin, qmax, unit, upb, page, maxp, qs, put);
    __syncthreads();
    // The tile's counts into the row's histogram: one atomic per distinct bin of each warp.
    if (threadIdx.x < QS_PAGES) {
        const unsigned bin = tbin[threadIdx.x];
        const unsigned peers = __match_any_sync(0xffffffffu, bin);
        if (bin < QSEL_BINS && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[row * QSEL_BINS + bin], (unsigned)__popc(peers));
    }
    quest_count_units(units, red, ctr);
}

// The scores in the CPU's arithmetic (bit-equal to quest_page_scores): what ART's priority order reads,
// and every unit size.
extern "C" __global__ void __launch_bounds__(QS_THREADS) kvs_quest_scores_hist(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, int hk,
                                                                               const u16* qmin, const u16* qmax, int unit, int upb, int page,
                                                                               int budget, int sink, float* scores, int maxp, unsigned* hist,
                                                                               i64 row_bytes, unsigned long long* ctr) {
    quest_scores_hist<false>(b, q, q0, q1, q2, scale, hk, qmin, qmax, unit, upb, page, budget, sink, scores, maxp, hist, row_bytes, ctr);
}

// The scores on tensor cores (quest_mma.cuh; agreement with the CPU's within the margin docs/policies.md
// states), for unit == page only: Quest's own selection when no later stage reads the scores.
extern "C" __global__ void __launch_bounds__(QS_THREADS) kvs_quest_scores_hist_mma(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale,
                                                                                   int hk, const u16* qmin, const u16* qmax, int unit, int upb,
                                                                                   int page, int budget, int sink, float* scores, int maxp,
                                                                                   unsigned* hist, i64 row_bytes, unsigned long long* ctr) {
    quest_scores_hist<true>(b, q, q0, q1, q2, scale, hk, qmin, qmax, unit, upb, page, budget, sink, scores, maxp, hist, row_bytes, ctr);
}

// The row's cut (threshold key, first kept page among keys equal to it) of the m largest candidates,
// from the row's histogram `rh`: B's pages gathered (position order) and cut by topk32; a bin too full
// to gather (many equal scores) falls back to topk32 over every candidate (same set, more passes).
// Block-wide.
template <typename KeyOf>
__device__ __forceinline__ TopCut quest_hist_cut(const unsigned* rh, const QuestRow& qr, KeyOf key_of, unsigned* gkey, unsigned* gidx, unsigned* thist,
                                                 int* cnt, unsigned* sel, unsigned long long* red) {
    const int per = QSEL_BINS / blockDim.x;  // bins per thread, thread t holds the t-th group from the top
    int sum = 0;
    for (int j = 0; j < per; ++j) sum += (int)rh[QSEL_BINS - 1 - (threadIdx.x * per + j)];
    int total;
    int run = block_excl_scan(sum, cnt, total);
    if (threadIdx.x == 0) sel[0] = QSEL_BINS;  // stays only if the histogram is short of m (cannot happen)
    __syncthreads();
    for (int j = 0; j < per; ++j) {
        const int c = (int)rh[QSEL_BINS - 1 - (threadIdx.x * per + j)];
        if (run < qr.m && run + c >= qr.m) {
            sel[0] = (unsigned)(QSEL_BINS - 1 - (threadIdx.x * per + j));
            sel[1] = (unsigned)(qr.m - run);
            sel[2] = (unsigned)c;
        }
        run += c;
    }
    __syncthreads();
    const unsigned B = sel[0];
    const int need = (int)sel[1], nb = (int)sel[2];
    // The histogram's counts checked against the keys (candidates above B and in B), and the crossing
    // itself: a stale or foreign histogram takes the whole-row path.
    unsigned long long above = 0, in = 0;
    for (int i = qr.forced + threadIdx.x; i < qr.last; i += blockDim.x) {
        const unsigned bin = key_of(i) >> (32 - QSEL_BITS);
        above += bin > B;
        in += bin == B;
    }
    above = block_sum(above, red);
    in = block_sum(in, red);
    if (B >= QSEL_BINS || nb > QSEL_GATHER || need < 1 || need > nb || above != (unsigned long long)(qr.m - need) || in != (unsigned long long)nb)
        return topk32(qr.forced, qr.last, qr.m, key_of, thist, cnt, sel);
    const int got = compact(qr.last - qr.forced, [&](int i) { return (key_of(qr.forced + i) >> (32 - QSEL_BITS)) == B; },
                            [&](int i) { return (unsigned)(qr.forced + i); }, gidx, QSEL_GATHER, cnt);
    for (int j = threadIdx.x; j < got; j += blockDim.x) gkey[j] = key_of((int)gidx[j]);
    __syncthreads();
    TopCut tc = topk32(0, got, need, [&](int j) { return gkey[j]; }, thist, cnt, sel);
    tc.cut = (int)gidx[tc.cut];
    __syncthreads();
    return tc;
}

// Quest, step 2: keep the decode token's page, the pages holding the first `sink` positions, and the best
// other pages (score descending, ties: the later page) up to ceil(budget / page) pages, as quest_pages.
// The page keys are staged in dynamic shared memory when they fit (`smem_keys` of them; longer rows read
// the scores from global memory), the cut found from the histogram (quest_hist_cut). One CTA per (KV head,
// sequence).
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) kvs_quest_topk(Batch b, int hk, int budget, int page, int sink, const float* scores, int maxp,
                                                                          unsigned* hist, unsigned* plan, i64 p_s, i64 p_h, int* plan_len, int cap,
                                                                          i64 row_bytes, int count, int smem_keys, unsigned long long* ctr) {
    extern __shared__ unsigned skey[];
    __shared__ unsigned gkey[QSEL_GATHER], gidx[QSEL_GATHER];
    __shared__ unsigned thist[256];
    __shared__ unsigned sel[4];
    __shared__ int cnt[TOPK_THREADS / 32 + 1];
    __shared__ unsigned long long red[32];
    const int s = blockIdx.y, h = blockIdx.x;
    const SeqRow r = seq_row(b, s);
    unsigned* e = plan + s * p_s + h * p_h;
    if (!r.decode || r.hi < r.lo) {
        if (threadIdx.x == 0) plan_len[s * hk + h] = r.decode ? 0 : -1;
        return;
    }
    const QuestRow qr = quest_row(r, budget, page, sink, maxp);
    const float* sc = scores + ((i64)s * hk + h) * maxp;
    unsigned* rh = hist + ((i64)s * hk + h) * QSEL_BINS;
    int n;
    if (qr.np <= qr.k) {
        n = min(qr.np, cap);
        for (int i = threadIdx.x; i < n; i += blockDim.x) e[i] = qr.fp + i;
        __syncthreads();
    } else {
        const bool staged = qr.np <= smem_keys;
        // Eight loads in flight per thread: a row's keys staged in a few L2 round trips, not one per key.
        if (staged)
            for (int i0 = 0; i0 < qr.np; i0 += 8 * blockDim.x) {
                float v[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int i = i0 + j * blockDim.x + threadIdx.x;
                    v[j] = i < qr.np ? sc[i] : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int i = i0 + j * blockDim.x + threadIdx.x;
                    if (i < qr.np) skey[i] = kvs_order_key(v[j]);
                }
            }
        __syncthreads();
        auto key_of = [&](int i) { return staged ? skey[i] : kvs_order_key(sc[i]); };
        TopCut tc{0u, qr.last};
        if (qr.m > 0) tc = quest_hist_cut(rh, qr, key_of, gkey, gidx, thist, cnt, sel, red);
        auto keep = [&](int i) {
            if (i < qr.forced || i == qr.last) return true;
            if (qr.m == 0) return false;
            const unsigned kk = key_of(i);
            return kk > tc.thr || (kk == tc.thr && i >= tc.cut);
        };
        n = compact(qr.np, keep, [&](int i) { return (unsigned)(qr.fp + i); }, e, cap, cnt);
    }
    for (int i = threadIdx.x; i < QSEL_BINS; i += blockDim.x) rh[i] = 0u;  // read above (compact synced)
    if (threadIdx.x == 0) plan_len[s * hk + h] = n;
    if (!count) return;  // a later stage (top-p) makes the final plan and counts it
    if (threadIdx.x == 0) {
        atomicAdd(&ctr[CTR_POLICY_ROWS], 1ull);
        atomicAdd(&ctr[CTR_BLOCKS_ELIGIBLE], (unsigned long long)((r.hi >> b.bs_log2) - (r.lo >> b.bs_log2) + 1));
    }
    int ulog2 = 0;
    while ((1 << ulog2) < page) ++ulog2;
    account(e, n, ulog2, r.lo, r.hi, b.bs_log2, 1, row_bytes, ctr, red);
}
