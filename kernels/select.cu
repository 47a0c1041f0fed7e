// Selection kernels: each decode row's visit plan on the device, the same decisions as the CPU engine
// (src/policy/select.rs, src/policy/top_p.rs, src/cpu/sparse/scoring.rs) in the same arithmetic
// (decide.cuh, --fmad=false). A plan is, per (sequence, KV head), `plan_len` entries of `1 << ulog2`
// positions each, in increasing order, at plan + s * p_s + h * p_h (p_h = 0: one plan for every head);
// plan_len = -1 marks a sequence that is not a decode row (its attention runs dense). The attention
// kernel (PLAN=1 variants of attention*.cu) reads the plan instead of the block table.
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
#include "quest.cuh"

#define SEL_THREADS 256

// Loads the GROUP query rows of KV head h at row t, times the scale (as the CPU's load_queries), into
// shared memory, and (optionally) their ordered sums. All threads of the CTA call this.
__device__ __forceinline__ void load_q(const elem_t* q, i64 q0, i64 q1, i64 q2, int t, int h, float scale, float* qs, float* qsum) {
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int r = i / HEAD_DIM, c = i % HEAD_DIM;
        qs[i] = ET::ld(q[(i64)t * q0 + (i64)(h * GROUP + r) * q1 + (i64)c * q2]) * scale;
    }
    __syncthreads();
    if (qsum != 0 && threadIdx.x < GROUP) {
        float s = 0.0f;
        for (int c = 0; c < HEAD_DIM; ++c) s += qs[threadIdx.x * HEAD_DIM + c];
        qsum[threadIdx.x] = s;
    }
    __syncthreads();
}

// `all` (kind 0: every block of the row, unit = block) and `streaming` (kind 1: the first `sink` and last
// `recent` positions, unit = token): one plan shared by every KV head (p_h = 0). One CTA per sequence;
// CTA 0 also counts the call's rows.
extern "C" __global__ void kvs_plan_simple(Batch b, int hk, int kind, int sink, int recent, unsigned* plan, i64 p_s, int* plan_len, int cap,
                                           i64 row_bytes, int count, unsigned long long* ctr) {
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

extern "C" __global__ void __launch_bounds__(QS_THREADS) kvs_quest_scores_hist(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, int hk,
                                                                               const u16* qmin, const u16* qmax, int unit, int upb, int page,
                                                                               int budget, int sink, float* scores, int maxp, unsigned* hist,
                                                                               i64 row_bytes, unsigned long long* ctr) {
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
    const unsigned long long units = quest_score_tile(b, r, s, h, q, q0, q1, q2, scale, hk, qmin, qmax, unit, upb, page, maxp, qs, [&](int i, float best) {
        sc[i] = best;
        if (qr.m > 0 && i >= qr.forced && i < qr.last) tbin[i - blockIdx.x * QS_PAGES] = kvs_order_key(best) >> (32 - QSEL_BITS);
    });
    __syncthreads();
    // The tile's counts into the row's histogram: one atomic per distinct bin of each warp.
    if (threadIdx.x < QS_PAGES) {
        const unsigned bin = tbin[threadIdx.x];
        const unsigned peers = __match_any_sync(0xffffffffu, bin);
        if (bin < QSEL_BINS && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[row * QSEL_BINS + bin], (unsigned)__popc(peers));
    }
    quest_count_units(units, red, ctr);
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

// Top-p, step 1: INT4 estimates of every candidate's logits (the base plan's positions inside the row),
// as estimate_weights: min * sum(q) + scale * dot(q, codes), soft-capped. Candidates outside the row get
// NaN. Grid (candidate tiles, KV heads, seqs); logits [(s*hk+h)][GROUP][maxc].
extern "C" __global__ void __launch_bounds__(128) kvs_topp_estimate(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, int hk,
                                                                    const unsigned* base, i64 b_s, i64 b_h, const int* base_len, int ulog2,
                                                                    const unsigned char* codes, const u16* qparams, float softcap,
                                                                    float* logits, int maxc) {
    __shared__ float qs[GROUP * HEAD_DIM];
    __shared__ float qsum[GROUP];
    const int s = blockIdx.z, h = blockIdx.y;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) return;
    const int nb = base_len[s * hk + h];
    const int nc = min(nb << ulog2, maxc);
    if ((int)(blockIdx.x * blockDim.x) >= nc) return;
    load_q(q, q0, q1, q2, r.t, h, scale, qs, qsum);
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= nc) return;
    float* out = logits + (i64)(s * hk + h) * GROUP * maxc;
    const int pos = (int)((base[s * b_s + h * b_h + (j >> ulog2)] << ulog2) | (j & ((1 << ulog2) - 1)));
    const i64 pb = (pos >= r.lo && pos <= r.hi) ? phys_block(b, s, pos >> b.bs_log2) : -1;
    if (pb < 0) {
        for (int g = 0; g < GROUP; ++g) out[(i64)g * maxc + j] = __int_as_float(0x7fffffff);
        return;
    }
    const int bs = 1 << b.bs_log2;
    const i64 row = (pb * bs + (pos & (bs - 1))) * hk + h;
    const unsigned char* cr = codes + row * (HEAD_DIM / 2);
    const float mn = kvs_f16_to_f32(qparams[2 * row]), scl = kvs_f16_to_f32(qparams[2 * row + 1]);
    float acc[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
        for (int l = 0; l < 8; ++l) acc[g][l] = 0.f;
    const unsigned* cw = reinterpret_cast<const unsigned*>(cr);
    for (int c8 = 0; c8 < HEAD_DIM / 8; ++c8) {
        const unsigned word = cw[c8];  // codes of channels c8*8 .. c8*8+7, low nibble first
        float cf[8];
#pragma unroll
        for (int l = 0; l < 8; ++l) cf[l] = (float)((word >> (4 * l)) & 15u);
#pragma unroll
        for (int g = 0; g < GROUP; ++g)
#pragma unroll
            for (int l = 0; l < 8; ++l) acc[g][l] += qs[g * HEAD_DIM + c8 * 8 + l] * cf[l];
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        float dot = acc[g][0];
#pragma unroll
        for (int l = 1; l < 8; ++l) dot += acc[g][l];
        out[(i64)g * maxc + j] = kvs_decision_softcap(mn * qsum[g] + scl * dot, softcap);
    }
}

// Top-p, step 2 (one CTA per KV head and sequence): softmax of each row's estimates, the aggregated weight
// w = max over the group, and the shortest prefix of the candidates sorted by w (descending; ties by
// position, ascending) whose mass reaches p of every row's total (f64 masses), found by a radix search
// on w, 8 bits per pass; the kept positions become the plan (tokens, increasing). As top_p::select.
// `logits` [(s*hk+h)][GROUP][maxc] (maxc a multiple of 4) is overwritten with the weights; `wbuf`
// [(s*hk+h)][maxc] holds w. The base plan's entries increase, so the candidates inside the row are one
// contiguous range [ja, jb] of candidate indices; every pass reads 4 consecutive candidates per thread.
#define TOPP_THREADS 512
#define TOPP_WARPS (TOPP_THREADS / 32)

// Masses are fixed point (P * 2^62 as u64; every weight is <= 1 and a row's weights sum to 1), so the
// sums are exact whatever order atomics land in; they differ from the CPU's f64 sums by at most ~1e-14,
// far below any mass gap a decision could hinge on.
#define MASS_ONE 4611686018427387904.0  // 2^62
__device__ __forceinline__ unsigned long long to_fixed(float v) { return (unsigned long long)((double)v * MASS_ONE); }

// Adds each lane's `v` into mass[bin * GROUP + g] for its bin (256 = none). A warp with few distinct bins
// (the usual case: most weights share an exponent) sums each bin with a butterfly and adds it once;
// otherwise every lane adds its own (distinct addresses rarely conflict).
__device__ __forceinline__ void bin_add(unsigned long long* mass, unsigned bin, const float* v) {
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    const int lane = threadIdx.x & 31;
    const unsigned leaders = __ballot_sync(0xffffffffu, lane == __ffs(peers) - 1);
    if (__popc(leaders) > 4) {
        if (bin < 256u)
#pragma unroll
            for (int g = 0; g < GROUP; ++g) atomicAdd(&mass[bin * GROUP + g], to_fixed(v[g]));
        return;
    }
    for (unsigned rest = leaders; rest; rest &= rest - 1) {
        const int src = __ffs(rest) - 1;
        const unsigned b = __shfl_sync(0xffffffffu, bin, src);
        if (b >= 256u) continue;
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            unsigned long long x = bin == b ? to_fixed(v[g]) : 0ull;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
            if (lane == src) atomicAdd(&mass[b * GROUP + g], x);
        }
    }
}

// Inclusive scan of `v` over the block's threads in order; `*total` gets the block's sum. Block-wide;
// `tmp` holds one value per warp.
__device__ __forceinline__ unsigned long long block_incl_scan(unsigned long long v, unsigned long long* tmp, unsigned long long* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    __syncthreads();
    if (lane == 31) tmp[warp] = v;
    __syncthreads();
    unsigned long long pre = 0, all = 0;
    for (int i = 0; i < nw; ++i) {
        if (i < warp) pre += tmp[i];
        all += tmp[i];
    }
    *total = all;
    return v + pre;
}

// The digit of this pass: the largest d such that above + (mass of bins >= d) reaches every row's target
// (scanned in parallel from the top bin down); `above` then gains the bins above d. Block-wide.
__device__ __forceinline__ unsigned choose_digit(const unsigned long long* mass, unsigned long long* above, const double* target,
                                                 unsigned long long (*wsum)[GROUP], int* pick) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    unsigned long long incl[GROUP];
    if (t == 0) *pick = 255;
    if (t < 256) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            unsigned long long v = mass[(255 - t) * GROUP + g];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long y = __shfl_up_sync(0xffffffffu, v, o);
                if (lane >= o) v += y;
            }
            incl[g] = v;
            if (lane == 31) wsum[warp][g] = v;
        }
    }
    __syncthreads();
    bool reach = false;
    if (t < 256) {
        reach = true;
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            unsigned long long pre = 0;
            for (int w = 0; w < warp; ++w) pre += wsum[w][g];
            incl[g] += pre;
            reach = reach && (double)(above[g] + incl[g]) >= target[g];
        }
    }
    const unsigned bal = __ballot_sync(0xffffffffu, reach);
    if (t < 256 && lane == 0 && bal) atomicMin(pick, warp * 32 + __ffs(bal) - 1);
    __syncthreads();
    const int ts = *pick;
    const unsigned d = 255u - (unsigned)ts;
    __syncthreads();
    if (t == ts) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) above[g] += incl[g] - mass[d * GROUP + g];
    }
    __syncthreads();
    return d;
}

extern "C" __global__ void __launch_bounds__(TOPP_THREADS) kvs_topp_select(Batch b, int hk, const unsigned* base, i64 b_s, i64 b_h, const int* base_len,
                                                                           int ulog2, float* logits, float* wbuf, int maxc, float p,
                                                                           unsigned* plan, i64 p_s, i64 p_h, int* plan_len, int cap, i64 row_bytes,
                                                                           i64 meta_row_bytes, unsigned long long* ctr) {
    __shared__ unsigned long long mass[256 * GROUP];
    __shared__ unsigned long long above[GROUP];
    __shared__ double target[GROUP];
    __shared__ unsigned long long wsum[8][GROUP];
    __shared__ float red_f[32];
    __shared__ double red_d[32];
    __shared__ unsigned long long red_u[32];
    __shared__ unsigned long long scan_tmp[TOPP_WARPS];
    __shared__ int tie_cut, pick;
    __shared__ int cnt[TOPP_WARPS + 1];
    const int s = blockIdx.y, h = blockIdx.x;
    const SeqRow r = seq_row(b, s);
    if (!r.decode) {
        if (threadIdx.x == 0) plan_len[s * hk + h] = -1;
        return;
    }
    unsigned* e = plan + s * p_s + h * p_h;
    const int nb = r.hi >= r.lo ? base_len[s * hk + h] : 0;
    const int nc = nb > 0 ? min(nb << ulog2, maxc) : 0;
    float* x = logits + (i64)(s * hk + h) * GROUP * maxc;
    float* w = wbuf + (i64)(s * hk + h) * maxc;
    const unsigned* be = base + s * b_s + h * b_h;
    const int umask = (1 << ulog2) - 1;
    auto pos_of = [&](int j) { return (int)((be[j >> ulog2] << ulog2) | (unsigned)(j & umask)); };
    // Positions increase with j: the candidates inside lo..=hi are [ja, jb].
    int ja = 0, jb = -1;
    if (nc > 0) {
        const int p0 = pos_of(0), pl = pos_of(nc - 1);
        ja = p0 < r.lo ? min(r.lo - p0, nc) : 0;
        jb = pl > r.hi ? nc - 1 - (pl - r.hi) : nc - 1;
    }
    const unsigned long long nvalid = jb >= ja ? (unsigned long long)(jb - ja + 1) : 0ull;
    // Passes over 4 consecutive candidates per thread: a float4 of each row (maxc % 4 == 0).
    const int j4_end = ((jb + 1) + 3) & ~3;
    const int j4_start = ja & ~3;
    float mloc[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) mloc[g] = -INFINITY;
    for (int j4 = j4_start + 4 * threadIdx.x; j4 < j4_end; j4 += 4 * blockDim.x) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float4 v = *reinterpret_cast<const float4*>(x + (i64)g * maxc + j4);
            const float vs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (j4 + k >= ja && j4 + k <= jb) mloc[g] = fmaxf(mloc[g], vs[k]);
        }
    }
    float m[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) m[g] = block_max(mloc[g], red_f);
    double zloc[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) zloc[g] = 0.0;
    for (int j4 = j4_start + 4 * threadIdx.x; j4 < j4_end; j4 += 4 * blockDim.x) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float4 v = *reinterpret_cast<const float4*>(x + (i64)g * maxc + j4);
            const float vs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (j4 + k >= ja && j4 + k <= jb) zloc[g] += (double)kvs_fast_exp(vs[k] - m[g]);
        }
    }
    float inv[GROUP];
    bool zpos[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const double z = block_sum(zloc[g], red_d);
        zpos[g] = z > 0.0;
        inv[g] = zpos[g] ? (float)(1.0 / z) : 1.0f;
    }
    for (int i2 = threadIdx.x; i2 < 256 * GROUP; i2 += blockDim.x) mass[i2] = 0ull;
    __syncthreads();
    // Weights, w, row totals, and the first radix pass (top byte of w) in one sweep.
    unsigned long long tloc[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) tloc[g] = 0ull;
    bool nonfinite = false;  // a NaN or infinite weight (non-finite query or key): keep everything
    for (int j4b = j4_start; j4b < j4_end; j4b += 4 * blockDim.x) {  // uniform trip count (warp collectives)
        const int j4 = j4b + 4 * threadIdx.x;
        float pv[4][GROUP];
        float wv[4] = {-1.f, -1.f, -1.f, -1.f};  // invalid candidates sort below every weight (w >= 0)
        if (j4 < j4_end) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float4 v = *reinterpret_cast<const float4*>(x + (i64)g * maxc + j4);
                const float vs[4] = {v.x, v.y, v.z, v.w};
                float o[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const bool ok = j4 + k >= ja && j4 + k <= jb;
                    float y = 0.0f;
                    if (ok) {
                        y = kvs_fast_exp(vs[k] - m[g]);
                        if (zpos[g]) y *= inv[g];
                        nonfinite = nonfinite || !isfinite(y);
                        tloc[g] += isfinite(y) ? to_fixed(y) : 0ull;
                        wv[k] = g == 0 ? y : fmaxf(wv[k], y);
                    }
                    o[k] = y;
                    pv[k][g] = y;
                }
                *reinterpret_cast<float4*>(x + (i64)g * maxc + j4) = make_float4(o[0], o[1], o[2], o[3]);
            }
            *reinterpret_cast<float4*>(w + j4) = make_float4(wv[0], wv[1], wv[2], wv[3]);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) bin_add(mass, wv[k] >= 0.0f ? (__float_as_uint(wv[k]) >> 24) : 256u, pv[k]);
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const unsigned long long tot = block_sum(tloc[g], red_u);
        if (threadIdx.x == 0) {
            target[g] = (double)p * (double)tot;
            above[g] = 0ull;
        }
    }
    if (threadIdx.x == 0) tie_cut = nc;
    __syncthreads();
    // As top_p::select: p = 1, or a non-finite weight (nothing can be ranked, and a poisoned key must
    // reach the attention rather than be pruned by chance), keeps every candidate.
    const bool keep_all = p >= 1.0f || block_max(nonfinite ? 1.0f : 0.0f, red_f) > 0.0f;
    unsigned T = 0;
    if (!keep_all && nvalid > 0) {
        T = choose_digit(mass, above, target, wsum, &pick) << 24;
        for (int pass = 1; pass < 4; ++pass) {
            const int shift = 24 - 8 * pass;
            const unsigned hmask = ~0u << (shift + 8);
            for (int i2 = threadIdx.x; i2 < 256 * GROUP; i2 += blockDim.x) mass[i2] = 0ull;
            __syncthreads();
            for (int j4b = j4_start; j4b < j4_end; j4b += 4 * blockDim.x) {
                const int j4 = j4b + 4 * threadIdx.x;
                float wv[4] = {-1.f, -1.f, -1.f, -1.f};
                float pv[4][GROUP];
                if (j4 < j4_end) {
                    const float4 v = *reinterpret_cast<const float4*>(w + j4);
                    wv[0] = v.x; wv[1] = v.y; wv[2] = v.z; wv[3] = v.w;
                    bool any = false;
#pragma unroll
                    for (int k = 0; k < 4; ++k) any = any || (wv[k] >= 0.0f && (__float_as_uint(wv[k]) & hmask) == (T & hmask));
                    if (any) {
#pragma unroll
                        for (int g = 0; g < GROUP; ++g) {
                            const float4 y = *reinterpret_cast<const float4*>(x + (i64)g * maxc + j4);
                            pv[0][g] = y.x; pv[1][g] = y.y; pv[2][g] = y.z; pv[3][g] = y.w;
                        }
                    }
                }
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const unsigned key = __float_as_uint(wv[k]);
                    const bool in = wv[k] >= 0.0f && (key & hmask) == (T & hmask);
                    bin_add(mass, in ? ((key >> shift) & 255u) : 256u, pv[k]);
                }
            }
            __syncthreads();
            T |= choose_digit(mass, above, target, wsum, &pick) << shift;
        }
        // Ties at T: add them in increasing position until every row reaches, a chunk of blockDim
        // candidates at a time (a block scan of each row's tied masses per chunk).
        unsigned long long ties = 0;
        for (int j = ja + threadIdx.x; j <= jb; j += blockDim.x) ties += (w[j] >= 0.0f && __float_as_uint(w[j]) == T);
        ties = block_sum(ties, red_u);
        if (ties > 1) {
            if (threadIdx.x == 0) pick = 0x7fffffff;
            unsigned long long acc[GROUP];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) acc[g] = above[g];
            __syncthreads();
            for (int j0 = ja; j0 <= jb; j0 += blockDim.x) {
                const int j = j0 + threadIdx.x;
                const bool tied = j <= jb && w[j] >= 0.0f && __float_as_uint(w[j]) == T;
                bool reach = tied;
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    unsigned long long total;
                    const unsigned long long incl = block_incl_scan(tied ? to_fixed(x[(i64)g * maxc + j]) : 0ull, scan_tmp, &total);
                    reach = reach && (double)(acc[g] + incl) >= target[g];
                    acc[g] += total;
                }
                if (reach) atomicMin(&pick, j);
                __syncthreads();
                if (pick != 0x7fffffff) break;  // uniform: everyone reads the same value
            }
            if (threadIdx.x == 0) tie_cut = pick == 0x7fffffff ? nc : pick;
        }
        __syncthreads();
    }
    const int cut = tie_cut;
    auto keep = [&](int j) {
        if (j < ja || j > jb) return false;
        if (keep_all) return true;
        const unsigned k = __float_as_uint(w[j]);
        return k > T || (k == T && j <= cut);
    };
    const int n = compact(nc, keep, [&](int j) { return (unsigned)pos_of(j); }, e, cap, cnt);
    __syncthreads();
    if (threadIdx.x == 0) {
        plan_len[s * hk + h] = n;
        if (r.hi >= r.lo) {
            atomicAdd(&ctr[CTR_POLICY_ROWS], 1ull);
            atomicAdd(&ctr[CTR_BLOCKS_ELIGIBLE], (unsigned long long)((r.hi >> b.bs_log2) - (r.lo >> b.bs_log2) + 1));
        }
        atomicAdd(&ctr[CTR_TOP_P_CANDIDATES], nvalid);
        atomicAdd(&ctr[CTR_TOP_P_KEPT], (unsigned long long)n);
        atomicAdd(&ctr[CTR_KV_BYTES], nvalid * (unsigned long long)meta_row_bytes);
    }
    account(e, n, 0, r.lo, r.hi, b.bs_log2, 1, row_bytes, ctr, red_u);
}

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
