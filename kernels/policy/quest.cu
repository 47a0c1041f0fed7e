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
#include "cluster.cuh"
#include "cluster_topk.cuh"
#include "page_bounds.cuh"

// Quest's page scores on tensor cores (kvs_quest_scores_hist_mma, below): the bound of
// page P for query row g, sum over channels c of max(q_c * min_c, q_c * max_c), is
//     sum_c q-_c * min_c + q+_c * max_c      (q- = min(q, 0), q+ = max(q, 0)),
// a matrix product of the page's staged row [min | max] (K = 2 * HEAD_DIM, f16 as the cache write stores
// them, lane-permuted: kernels/meta.cu) with the group's split query [q- | q+] in the same permutation.
// mma.sync m16n8k16 f16 -> f32: pages are the 16 rows of A, query rows the 8 columns of B. Each query row
// is scaled by 2^e (e from its max |q|, into [2^14, 2^15)) and split into two f16 terms hi + lo (residual
// under 2^-22 of the row's max |q|); the products are exact in f32, the tensor core accumulates them, and
// the score is acc * scale * 2^-e. docs/policies.md (Quest) states the error bound and the agreement
// margin the tests use. A 0 * inf product (a zero half of the split against an infinite bound) makes the
// page's score NaN, which the order key sorts first: the page is kept and its keys reach the attention.
#include "mma.cuh"
#include "split_f16.cuh"

#define QM_PAD 8                    // f16 per staged row against ldmatrix bank conflicts (16 bytes)
#define QM_NT ((GROUP + 7) / 8)     // 8-column tiles of query rows
#define QM_KS (2 * HEAD_DIM / 16)   // k-steps of one page row
// Pages staged per round: the staged rows, the split query and the CTA's q scratch within 48 KiB.
#if HEAD_DIM <= 128 && GROUP <= 8
#define QM_ROUND 64
#elif HEAD_DIM <= 128
#define QM_ROUND 32
#else
#define QM_ROUND 16
#endif
// Geometries the MMA path covers (the others score exactly as page_score_tile).
#define QM_FITS (GROUP <= 16 && (HEAD_DIM <= 128 || GROUP <= 8))

// Query rows in the CTA's scratch `qs`: row g at g * QM_QSTR, in the staged rows' lane order (position p
// holds channel (p % QC) * 16 + p / QC). The 8-float pad puts the fragment build's float2 reads (8 rows x 4
// column pairs per warp) on distinct banks; the caller's scratch holds GROUP * (HEAD_DIM + 16) floats.
#define QM_QSTR (HEAD_DIM + 8)

// One half of the split query, scaled: v * 2^e (as two exact power-of-two products; |v| * 2^e stays below
// 2^15, and a product that would round below f16's range is 0 in both f16 terms either way), then the
// negative part (min(v, 0)) or the positive part (max(v, 0)). NaN stays NaN in both halves.
__device__ __forceinline__ float quest_split_part(float v, float s1, float s2, bool neg) {
    v = v * s1 * s2;
    return neg ? (v > 0.f ? 0.f : v) : (v < 0.f ? 0.f : v);
}

// The group's split query as B fragments (`qb`, [QM_NT][QM_KS][32] uint4) and each row's scale exponent
// (`qe`, QM_NT * 8 ints), from the query rows of row (r, h); `qs` is 16-byte aligned shared scratch of
// GROUP * QM_QSTR floats or more. Block-wide; every thread sees qb and qe on return.
__device__ __forceinline__ void quest_mma_query(const SeqRow& r, int h, const elem_t* q, i64 q0, i64 q1, i64 q2, float* qs, uint4 (*qb)[QM_KS][32],
                                                int* qe) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, c = i % HEAD_DIM;
        qs[g * QM_QSTR + (c % 16) * QC + c / 16] = ET::ld(q[(i64)r.t * q0 + (i64)(h * GROUP + g) * q1 + (i64)c * q2]);
    }
    __syncthreads();
    for (int g = warp; g < QM_NT * 8; g += nw) {
        const int e = row_split_exponent<HEAD_DIM>(qs + g * QM_QSTR, g < GROUP);
        if (lane == 0) qe[g] = e;  // max |q| * 2^e in [2^14, 2^15)
    }
    __syncthreads();
    // Lane l of k-step ks holds, for query row nt * 8 + l / 4, the K indices k = ks * 16 + 2 (l % 4)
    // + {0, 1} (b0) and the same + 8 (b1): positions p, p + 1, p + 8, p + 9 of the row, p below, of
    // its negative half when k < HEAD_DIM (a k-step lies in one half: HEAD_DIM is a multiple of 16).
    for (int i = threadIdx.x; i < QM_NT * QM_KS * 32; i += blockDim.x) {
        const int l = i % 32, ks = (i / 32) % QM_KS, nt = i / (32 * QM_KS);
        const int g = nt * 8 + l / 4;
        uint4 frag = make_uint4(0u, 0u, 0u, 0u);
        if (g < GROUP) {
            const int e = qe[g];
            const float s1 = quest_pow2(e - e / 2), s2 = quest_pow2(e / 2);  // qe in [-113, 163]
            const bool neg = ks * 16 < HEAD_DIM;
            const float* row = qs + g * QM_QSTR + (ks * 16) % HEAD_DIM + 2 * (l % 4);
            const float2 a = *reinterpret_cast<const float2*>(row), c = *reinterpret_cast<const float2*>(row + 8);
            const float v[4] = {quest_split_part(a.x, s1, s2, neg), quest_split_part(a.y, s1, s2, neg), quest_split_part(c.x, s1, s2, neg),
                                quest_split_part(c.y, s1, s2, neg)};
            frag = split_b_fragment(v);
        }
        qb[nt][ks][l] = frag;
    }
    __syncthreads();
}

// The scores of 16 staged page rows (`rows`: row j at rows + j * QM_STRIDE, [min | max] as
// page_stage_round copies them) for the group's query: warp-wide; `put(j, score)` for j = 0..15 by the
// lanes j % 8 * 4 (row j of the 16), the score before the caller's check of the page's presence.
#define QM_STRIDE (2 * HEAD_DIM + QM_PAD)
template <typename Put>
__device__ __forceinline__ void quest_mma_rows16(const u16* rows, const uint4 (*qb)[QM_KS][32], const int* qe, float scale, Put put) {
    const int lane = threadIdx.x & 31;
    float acc[QM_NT][4];
#pragma unroll
    for (int nt = 0; nt < QM_NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[nt][c] = 0.f;
    const unsigned arow = smem_u32(rows + (lane & 15) * QM_STRIDE + (lane >> 4) * 8);
    // The k-steps accumulate in one chain, hi then lo term of each.
#pragma unroll 4
    for (int ks = 0; ks < QM_KS; ++ks) {
        unsigned a[4];
        ldsm_x4(a, arow + ks * 32);
#pragma unroll
        for (int nt = 0; nt < QM_NT; ++nt) {
            const uint4 bq = qb[nt][ks][lane];
            quest_mma_f16(acc[nt], a, bq.x, bq.y);
            quest_mma_f16(acc[nt], a, bq.z, bq.w);
        }
    }
    // Rows lane / 4 and lane / 4 + 8 of the 16 pages, columns 2 (lane % 4) + {0, 1}.
    float best[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < QM_NT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int g = nt * 8 + 2 * (lane % 4) + j;
            if (g < GROUP) {
                best[0] = quest_nanmax(best[0], ldexpf(acc[nt][j] * scale, -qe[g]));
                best[1] = quest_nanmax(best[1], ldexpf(acc[nt][2 + j] * scale, -qe[g]));
            }
        }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        best[0] = quest_nanmax(best[0], __shfl_xor_sync(0xffffffffu, best[0], o));
        best[1] = quest_nanmax(best[1], __shfl_xor_sync(0xffffffffu, best[1], o));
    }
    if (lane % 4 == 0) {
        put(lane / 4, best[0]);
        put(lane / 4 + 8, best[1]);
    }
}

// One CTA's tile of `ppc` pages of row (s, h) (a multiple of 64: tile blockIdx.x), unit == page (the
// caller's choice), scored on tensor cores in rounds of QM_ROUND pages; `put(i, score)` once per page i of
// the tile inside the row, then `flush()` after each round (block-wide, after a barrier). The query's
// fragments are built once per CTA, so a longer tile spends less of its time on them (at batch 32 x 128K
// one CTA per 64 pages was compute-bound on that build: 74% of the SM's throughput against 58% of the DRAM
// peak, ncu 2026-11-28). `qs` 16-byte aligned shared scratch of GROUP * QM_QSTR floats or more. Returns the
// units this thread read. All threads of the CTA call this.
template <typename Put, typename Flush>
__device__ __forceinline__ unsigned long long quest_score_tile_mma(const Batch& b, const SeqRow& r, int s, int h, const elem_t* q, i64 q0, i64 q1, i64 q2,
                                                                   float scale, int hk, const u16* qmin, const u16* qmax, int upb, int page, int maxp,
                                                                   int ppc, float* qs, Put put, Flush flush) {
    __shared__ __align__(16) u16 sb[QM_ROUND][QM_STRIDE];
    __shared__ i64 sbase[QM_ROUND];
    __shared__ __align__(16) uint4 qb[QM_NT][QM_KS][32];  // B fragments per lane: hi b0, hi b1, lo b0, lo b1
    __shared__ int qe[QM_NT * 8];                         // 2^e per query row
    static_assert(HEAD_DIM % 16 == 0, "a k-step of 16 lies in one half of the split query");
    const int fp = r.lo / page, np = r.hi / page - fp + 1;
    const int warp = threadIdx.x >> 5;
    unsigned long long units = 0;
    for (int r0 = 0; r0 < ppc; r0 += QM_ROUND) {
        const int tile0 = blockIdx.x * ppc + r0;
        if (r0 > 0 && (tile0 >= np || tile0 >= maxp)) break;  // uniform: the row ends before this round
        if (r0 > 0) __syncthreads();  // the previous round's rows are read
        units += page_stage_round(b, s, h, hk, qmin, qmax, upb, fp, np, maxp, tile0, QM_ROUND, sbase, &sb[0][0], QM_STRIDE);
        if (r0 == 0) quest_mma_query(r, h, q, q0, q1, q2, qs, qb, qe);  // built while the first round's bounds are in flight
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        if (warp < QM_ROUND / 16)
            quest_mma_rows16(&sb[warp * 16][0], qb, qe, scale, [&](int j, float best) {
                const int i = tile0 + warp * 16 + j;
                if (i < np && i < maxp) put(i, sbase[warp * 16 + j] >= 0 ? best : -INFINITY);
            });
        __syncthreads();
        flush();
    }
    return units;
}


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
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ float qs[GROUP * 16 * (QC + 1)];  // q rows in lane order, padded against bank conflicts
    __shared__ unsigned long long red[32];
    if (count_rows && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) rows_count(b, hk, row_bytes, ctr, red);
    const int s = blockIdx.z, h = blockIdx.y;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) return;
    float* sc = scores + (i64)(s * hk + h) * maxp;
    const unsigned long long units =
        page_score_tile(b, r, s, h, q, q0, q1, q2, scale, hk, qmin, qmax, unit, upb, page, maxp, qs, [&](int i, float best) { sc[i] = best; });
    page_count_units(units, red, ctr);
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
// `hist` null: no histogram (kvs_quest_topk_cluster below reads none).
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
// over the exact page_score_tile. Block-wide.
template <bool MMA>
__device__ __forceinline__ void quest_scores_hist(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, int hk, const u16* qmin,
                                                  const u16* qmax, int unit, int upb, int page, int budget, int sink, float* scores, int maxp,
                                                  unsigned* hist, i64 row_bytes, unsigned long long* ctr, int ppc) {
    __shared__ __align__(16) float qs[GROUP * 16 * (QC + 1)];  // q rows (the tensor-core scoring above: float2 reads)
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
    // Page i's histogram bin at tbin[i % QS_PAGES] (a tile of 64 pages, or an MMA round of QM_ROUND <= 64
    // starting at a multiple of QM_ROUND); flush adds the bins put since the last flush to the row's
    // histogram, one atomic per distinct bin of each warp, and clears them (the caller synced before; the
    // next round's puts come after a barrier). `ppc`: pages per CTA of the MMA path (the other path's tile
    // is QS_PAGES).
    auto put = [&](int i, float best) {
        sc[i] = best;
        if (hist != nullptr && qr.m > 0 && i >= qr.forced && i < qr.last) tbin[i % QS_PAGES] = kvs_order_key(best) >> (32 - QSEL_BITS);
    };
    auto flush = [&]() {
        if (threadIdx.x < QS_PAGES) {
            const unsigned bin = tbin[threadIdx.x];
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (bin < QSEL_BINS && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[row * QSEL_BINS + bin], (unsigned)__popc(peers));
            tbin[threadIdx.x] = QSEL_BINS;
        }
    };
    unsigned long long units;
#if QM_FITS
    if (MMA)
        units = quest_score_tile_mma(b, r, s, h, q, q0, q1, q2, scale, hk, qmin, qmax, upb, page, maxp, ppc, qs, put, flush);
    else
#endif
    {
        units = page_score_tile(b, r, s, h, q, q0, q1, q2, scale, hk, qmin, qmax, unit, upb, page, maxp, qs, put);
        __syncthreads();
        flush();
    }
    page_count_units(units, red, ctr);
}

// The scores in the CPU's arithmetic (bit-equal to quest_page_scores): what ART's priority order reads,
// and every unit size.
extern "C" __global__ void __launch_bounds__(QS_THREADS) kvs_quest_scores_hist(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, int hk,
                                                                               const u16* qmin, const u16* qmax, int unit, int upb, int page,
                                                                               int budget, int sink, float* scores, int maxp, unsigned* hist,
                                                                               i64 row_bytes, unsigned long long* ctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    quest_scores_hist<false>(b, q, q0, q1, q2, scale, hk, qmin, qmax, unit, upb, page, budget, sink, scores, maxp, hist, row_bytes, ctr, QS_PAGES);
}

// The scores on tensor cores (the MMA scoring above; agreement with the CPU's within the margin docs/policies.md
// states), for unit == page only: Quest's own selection when no later stage reads the scores.
extern "C" __global__ void __launch_bounds__(QS_THREADS) kvs_quest_scores_hist_mma(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale,
                                                                                   int hk, const u16* qmin, const u16* qmax, int unit, int upb,
                                                                                   int page, int budget, int sink, float* scores, int maxp,
                                                                                   unsigned* hist, i64 row_bytes, unsigned long long* ctr, int ppc) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    quest_scores_hist<true>(b, q, q0, q1, q2, scale, hk, qmin, qmax, unit, upb, page, budget, sink, scores, maxp, hist, row_bytes, ctr, ppc);
}

// The order keys of the scores sc[a0..a1) into skey[0..a1 - a0), eight loads in flight per thread: a
// row's keys staged in a few L2 round trips, not one per key. Block-wide (the caller syncs after).
__device__ __forceinline__ void stage_keys(const float* sc, int a0, int a1, unsigned* skey) {
    for (int i0 = a0; i0 < a1; i0 += 8 * blockDim.x) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i = i0 + j * blockDim.x + threadIdx.x;
            v[j] = i < a1 ? sc[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i = i0 + j * blockDim.x + threadIdx.x;
            if (i < a1) skey[i - a0] = kvs_order_key(v[j]);
        }
    }
}

// Whether page i of the row (0 <= i < np) is in Quest's set, given the cut of the candidates: the forced
// pages, the decode token's page, and the candidates the cut keeps.
template <typename KeyOf>
__device__ __forceinline__ bool quest_keeps(const QuestRow& qr, const TopCut& tc, int i, KeyOf key_of) {
    if (i < qr.forced || i == qr.last) return true;
    if (qr.m == 0) return false;
    const unsigned kk = key_of(i);
    return kk > tc.thr || (kk == tc.thr && i >= tc.cut);
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
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
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
        if (staged) stage_keys(sc, 0, qr.np, skey);
        __syncthreads();
        auto key_of = [&](int i) { return staged ? skey[i] : kvs_order_key(sc[i]); };
        TopCut tc{0u, qr.last};
        if (qr.m > 0) tc = quest_hist_cut(rh, qr, key_of, gkey, gidx, thist, cnt, sel, red);
        auto keep = [&](int i) { return quest_keeps(qr, tc, i, key_of); };
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

// Quest, step 2 on Hopper (sm_90; the launcher's choice there): kvs_quest_topk's set from a thread-block
// cluster of QC_CTAS CTAs per (KV head, sequence) instead of one CTA, so a long row's passes run over
// QC_CTAS SMs. CTA `rank` holds the row's pages rank * per <= i < (rank + 1) * per (per = ceil(np /
// QC_CTAS)), their keys in its shared memory when they fit; the cut of the candidates is topk32's radix
// with each pass's counts summed over the cluster through distributed shared memory (cluster_topk_cut, cluster_topk.cuh);
// each CTA then writes its kept pages, in increasing page order, after those of the CTAs before it (an
// exclusive prefix of the CTAs' counts). Same set as kvs_quest_topk (exact at ties), no key histogram
// from the scoring kernel. Grid (hk * QC_CTAS, seqs), QC_THREADS threads.
#define QC_THREADS 256 // src/policy/quest/cuda.rs QC_THREADS; at least 256 (one thread per bin of a pass)

#define QC_SCRATCH QC_SCRATCH_N(QC_THREADS)

#if KVS_CLUSTERS
// Row (s, h)'s plan from the cluster of QC_CTAS CTAs that holds it, CTA `rank` holding pages a0 <= i < a1
// (= rank * per ..., clamped to np) with their keys key_of(i) (np > k only): the cut (cluster_topk_cut, cluster_topk.cuh),
// this CTA's kept pages written after those of the CTAs before it, the plan's length and, with `count`,
// the counters. The tail of kvs_quest_topk_cluster. Every CTA of the
// cluster; no CTA returns before the cluster's last barrier (its shared memory may still be read).
template <typename KeyOf>
__device__ __forceinline__ void quest_cluster_plan(const Batch& b, const SeqRow& r, int s, int h, int hk, int page, const QuestRow& qr, unsigned rank, int per,
                                                   int a0, int a1, KeyOf key_of, unsigned* e, int* plan_len, int cap, i64 row_bytes, int count,
                                                   unsigned long long* ctr, const QcScratch& x) {
    const bool all = qr.np <= qr.k;
    int n, j0, j1;  // the plan's length; this CTA's entries j0 <= j < j1
    if (all) {
        n = min(qr.np, cap);
        j0 = min(a0, n);
        j1 = min(a1, n);
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) e[j] = qr.fp + j;
    } else {
        TopCut tc{0u, qr.last};
        if (qr.m > 0) tc = cluster_topk_cut(qr.forced, qr.last, qr.np, per, qr.m, rank, key_of, x.xh, x.xw, x.sel, x.wmm, x.cnt);
        auto keep = [&](int i) { return quest_keeps(qr, tc, i, key_of); };
        unsigned long long mine = 0;
        for (int i = a0 + threadIdx.x; i < a1; i += blockDim.x) mine += keep(i);
        mine = block_sum(mine, x.red);
        cluster_rank_prefix((unsigned)mine, rank, false, x);
        const int off = (int)x.sel[0];
        n = min((int)x.sel[1], cap);
        j0 = min(off, n);
        j1 = min(off + (int)mine, n);
        compact(a1 - a0, [&](int i) { return keep(a0 + i); }, [&](int i) { return (unsigned)(qr.fp + a0 + i); }, e + j0, j1 - j0, x.cnt);
        // No CTA leaves while another may read its shared memory; after this the whole plan is written.
        cluster_sync();
    }
    if (rank == 0 && threadIdx.x == 0) plan_len[s * hk + h] = n;
    if (!count) return;  // a later stage (top-p) makes the final plan and counts it
    if (rank == 0 && threadIdx.x == 0) {
        atomicAdd(&ctr[CTR_POLICY_ROWS], 1ull);
        atomicAdd(&ctr[CTR_BLOCKS_ELIGIBLE], (unsigned long long)((r.hi >> b.bs_log2) - (r.lo >> b.bs_log2) + 1));
    }
    int ulog2 = 0;
    while ((1 << ulog2) < page) ++ulog2;
    // The entry before this CTA's first is another CTA's: read through L2 after the cluster barrier.
    account_entries([&](int j) { return all ? (i64)(qr.fp + j) : (i64)__ldcg(e + j); }, j0, j1, ulog2, r.lo, r.hi, b.bs_log2, 1, row_bytes, ctr, x.red);
}
#endif

#if KVS_CLUSTERS
// A cluster's row (s, h) and this CTA's part of its pages (a0 <= i < a1, per = ceil(np / QC_CTAS) each):
// false when the row has nothing to select (its plan length written), and the whole cluster leaves.
struct QcPart {
    unsigned rank;
    int h, s, per, a0, a1;
    SeqRow r;
    QuestRow qr;
    unsigned* e;  // the row's plan entries
};
__device__ __forceinline__ bool quest_cluster_part(const Batch& b, int hk, int budget, int page, int sink, int maxp, unsigned* plan, i64 p_s, i64 p_h,
                                                   int* plan_len, QcPart& p) {
    p.rank = cluster_rank();
    p.h = blockIdx.x / QC_CTAS;
    p.s = blockIdx.y;
    p.r = seq_row(b, p.s);
    p.e = plan + p.s * p_s + p.h * p_h;
    if (!p.r.decode || p.r.hi < p.r.lo) {
        if (p.rank == 0 && threadIdx.x == 0) plan_len[p.s * hk + p.h] = p.r.decode ? 0 : -1;
        return false;
    }
    p.qr = quest_row(p.r, budget, page, sink, maxp);
    p.per = (p.qr.np + QC_CTAS - 1) / QC_CTAS;
    p.a0 = min((int)p.rank * p.per, p.qr.np);
    p.a1 = min(p.a0 + p.per, p.qr.np);
    return true;
}
#endif

extern "C" __global__ void QC_CLUSTER_DIMS __launch_bounds__(QC_THREADS)
    kvs_quest_topk_cluster(Batch b, int hk, int budget, int page, int sink, const float* scores, int maxp, unsigned* plan, i64 p_s, i64 p_h,
                           int* plan_len, int cap, i64 row_bytes, int count, int smem_keys, unsigned long long* ctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
#if KVS_CLUSTERS
    extern __shared__ unsigned skey[];
    QC_SCRATCH;
    static_assert(QC_THREADS >= 256 && QC_CTAS <= 32, "a pass needs a thread per bin; the peers are one warp's lanes");
    QcPart p;
    if (!quest_cluster_part(b, hk, budget, page, sink, maxp, plan, p_s, p_h, plan_len, p)) return;
    const float* sc = scores + ((i64)p.s * hk + p.h) * maxp;
    const bool staged = p.a1 - p.a0 <= smem_keys;
    if (p.qr.np > p.qr.k && staged) stage_keys(sc, p.a0, p.a1, skey);
    __syncthreads();
    auto key_of = [&](int i) { return staged ? skey[i - p.a0] : kvs_order_key(sc[i]); };
    quest_cluster_plan(b, p.r, p.s, p.h, hk, page, p.qr, p.rank, p.per, p.a0, p.a1, key_of, p.e, plan_len, cap, row_bytes, count, ctr, xs);
#else
    __trap();  // launched only on sm_90 and newer
#endif
}
