// RefreshKV on the device: the schedule, the full step's scores and the token sets. The schedule and the
// prefill's seed are the CPU engine's decisions in the same arithmetic (src/policy/refresh.rs,
// src/cpu/sparse/stateful.rs; decide.cuh, --fmad=false); a full decode step's weights come out of its own
// attention on tensor cores and agree with the CPU's within a stated margin (docs/policies.md, "refresh").
// Batch helpers (seq_row, phys_block, rows_count, account, compact, radix_kth) and SnapKV's
// scoring arithmetic (wp_dot, wp_unkey, the SNAP_* CTA shape, the fixed-point normaliser) come from
// kernels/include/.
//
// A policy call enqueues, with grids fixed by host-known bounds (capturable, no host decision):
//   kvs_refresh_decide   one CTA per sequence: the mean query (over all query heads, in head order) of the
//                        decode row, or of a prefill chunk's last row; the schedule (first step, every `N`
//                        steps, or the cosine check every `stride` steps, f64 summed in channel order as
//                        refresh::cosine); the per-sequence mode below; the layer state updated.
//   kvs_refresh_scores   phases 0/1/2 over the SEED sequences (and the FULL ones where the tensor-core
//                        attention does not apply: `seed_only` = 0), a grid-stride loop launched only by
//                        calls that hold a prefill chunk (or on that fallback): the row's logits per query
//                        head, its maximum, its fixed-point normaliser, then w = e / z, max over the
//                        group, per position (the CPU's bits).
//   kvs_refresh_plan     one CTA per (KV head, sequence) (and grid z > 0: slices of a FULL row's plan
//                        entries), before the attention: SEED (and FULL when not deferred) rebuild the
//                        set (max-pool, top k, ties: the earlier
//                        position); PARTIAL advances it (positions outside the range dropped, new ones
//                        appended at +inf, the k best kept, ties: the newer); the row's plan (FULL: every
//                        visible position; PARTIAL: the set; DENSE: every visible position), counters.
//   (attention)          the decode rows through their plans on tensor cores (attention_mma.cu, LOGITS=1),
//                        writing every visited key's base-2 logit per query head to `lg` and each split's
//                        (max, sum of 2^(l - max)) per query head to `parts`.
//   kvs_refresh_top_*    FULL rows: the set rebuilt from the logits: the row's LSE from the attention's
//                        split statistics (a fixed shuffle tree: deterministic), w = max over the group
//                        of 2^(l - lse) per position and its pool, the top k (ties: the earlier
//                        position). At batch 1-2 on sm_90 one launch on thread-block clusters
//                        (kvs_refresh_top_cluster); else a three-pass radix select across chunks (each
//                        pass's bin chosen by the row's last chunk; the last keeps per-chunk counts) and
//                        the chunks' kept positions (four launches). A partial step's calls find no FULL
//                        row and return at once.
//
// State per layer, indexed by the sequence's slot (kernels/slots.cu) and stamped with its generation (a
// stamp different from the slot's generation reads as "no state": a new or reused slot): the reference
// mean query qref[slot][HEAD_DIM], steps since the last full step, a stamp; per (slot, KV head): the set's
// positions (sorted) and scores (k of each), its size, the last position it has seen, a stamp.

#include "common.cuh"
#include "params.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"
#include "weights_pass.cuh"
#include "kv_load.cuh"
#include "cluster_topk.cuh"

// RefreshKV's layer state and parameters, passed by value; mirrored by `RefreshArgs` in
// src/policy/refresh/cuda.rs (a test, src/cuda/kernel_src.rs, compares sizes and field offsets).
struct RefreshArgs {
    float* qref;          // [max_seqs][HEAD_DIM]
    int* since;           // [max_seqs]
    unsigned* lstamp;     // [max_seqs]
    unsigned* tok;        // [max_seqs][hk][k]
    float* sc;            // [max_seqs][hk][k]
    int* cnt;             // [max_seqs][hk]
    int* last;            // [max_seqs][hk]
    unsigned* hstamp;     // [max_seqs][hk]
    const int* slot;      // per sequence of the call (-1: none)
    const unsigned* gen;  // per sequence of the call
    int* mode;            // per sequence of the call (RF_*)
    unsigned long long* rctr;  // the layer's [full steps, partial steps]
    int k, stride, every, pool;
    float s;
    int hk;
};

#define RF_NONE -1     // not a decode row and nothing to seed (or a decode row that sees nothing)
#define RF_PARTIAL 0   // attend the set
#define RF_FULL 1      // attend everything, score it, rebuild the set
#define RF_DENSE 2     // a decode row without a state slot: attend everything, keep no state
#define RF_SEED 3      // a prefill chunk: the set from its last row, that row's mean query the reference

// The row a sequence's decision reads: the decode row, or the chunk's last row (with the same limits).
__device__ __forceinline__ int rf_row(const SeqRow& r) { return r.t + (r.q_len > 0 ? r.q_len : 1) - 1; }

// refresh::cosine: f64 sums in channel order, clamped, to f32; 0 for a zero vector.
__device__ __forceinline__ float rf_cosine(const float* a, const float* b) {
    double ab = 0.0, aa = 0.0, bb = 0.0;
    for (int c = 0; c < HEAD_DIM; ++c) {
        const double x = (double)a[c], y = (double)b[c];
        ab = __dadd_rn(ab, __dmul_rn(x, y));
        aa = __dadd_rn(aa, __dmul_rn(x, x));
        bb = __dadd_rn(bb, __dmul_rn(y, y));
    }
    if (aa == 0.0 || bb == 0.0) return 0.0f;
    double v = __ddiv_rn(ab, __dmul_rn(__dsqrt_rn(aa), __dsqrt_rn(bb)));
    if (v < -1.0) v = -1.0;  // NaN stays NaN, as f64::clamp
    if (v > 1.0) v = 1.0;
    return __double2float_rn(v);
}

#define RF_DQ 16  // query heads whose rows kvs_refresh_decide loads at once
extern "C" __global__ void __launch_bounds__(128) kvs_refresh_decide(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, int nqh,
                                                                     RefreshArgs ra, i64 row_bytes, unsigned long long* ctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ float qm[HEAD_DIM];
    __shared__ unsigned long long red[32];
    const int s = blockIdx.x;
    if (s == 0) rows_count(b, ra.hk, row_bytes, ctr, red);  // the call's rows, once
    const SeqRow r = seq_row(b, s);
    const int slot = ra.slot[s];
    const unsigned gen = ra.gen[s];
    const bool seed = r.q_len > 1 && r.hi >= r.lo && r.t + r.q_len <= b.num_tokens;
    int mode = RF_NONE;
    if (seed && slot >= 0) mode = RF_SEED;
    else if (r.decode && r.hi >= r.lo) mode = slot < 0 ? RF_DENSE : RF_FULL;  // FULL or PARTIAL, decided below
    if (mode == RF_NONE || mode == RF_DENSE) {
        if (threadIdx.x == 0) ra.mode[s] = mode;
        return;
    }
    // Mean query: per channel, the scaled rows of every query head added in head order (mean_query). The
    // rows are loaded first, RF_DQ heads at a time with every load in flight, then added in head order (a
    // dependent load per head was one L2 round trip each).
    const int t = rf_row(r);
    for (int c = threadIdx.x; c < HEAD_DIM; c += blockDim.x) {
        float acc = 0.0f;
        for (int h0 = 0; h0 < nqh; h0 += RF_DQ) {
            float x[RF_DQ];
#pragma unroll
            for (int j = 0; j < RF_DQ; ++j) x[j] = h0 + j < nqh ? ET::ld(q[(i64)t * q0 + (i64)(h0 + j) * q1 + (i64)c * q2]) : 0.0f;
#pragma unroll
            for (int j = 0; j < RF_DQ; ++j)
                if (h0 + j < nqh) acc += x[j] * scale;
        }
        qm[c] = acc;
    }
    // The reference query, staged for the one thread that compares with it (its loop is serial).
    __shared__ float qr[HEAD_DIM];
    for (int c = threadIdx.x; c < HEAD_DIM; c += blockDim.x) qr[c] = ra.qref[(i64)slot * HEAD_DIM + c];
    __syncthreads();
    __shared__ int full_s;
    if (threadIdx.x == 0) {
        bool full = true;
        if (mode == RF_FULL && ra.lstamp[slot] == gen) {
            // RefreshLayer::decide
            int since = ra.since[slot] + 1;
            if (ra.every > 0) full = since >= ra.every;
            else full = since % ra.stride == 0 && !(rf_cosine(qm, qr) > ra.s);
            if (!full) ra.since[slot] = since;
        }
        if (mode == RF_FULL) {
            mode = full ? RF_FULL : RF_PARTIAL;
            atomicAdd(&ra.rctr[full ? 0 : 1], 1ull);
        }
        full_s = full;
        ra.mode[s] = mode;
    }
    __syncthreads();
    if (full_s) {
        // A full step (or the prefill's seed) makes this row's mean query the reference.
        for (int c = threadIdx.x; c < HEAD_DIM; c += blockDim.x) ra.qref[(i64)slot * HEAD_DIM + c] = qm[c];
        if (threadIdx.x == 0) {
            ra.since[slot] = 0;
            ra.lstamp[slot] = gen;
        }
    }
}

// The full step's scores, for the sequences kvs_refresh_decide marked FULL or SEED: per (seq, head) the
// GROUP rows' maxima rmax (order keys, preset to -inf's), fixed-point normalisers zfix (preset 0) and NaN
// flags zbad (preset 0); phase 2 writes agg[(s*hk+h)*maxpos + pos] = max over the group of e / z, for
// pos in lo..=hi. Grid (CTAs per head, hk): each CTA walks the tiles blockIdx.x, blockIdx.x + gridDim.x,
// ... of every such sequence (uniform loops: every thread reaches every barrier and shuffle). An FP8
// cache's keys (KV8; its full steps always score here) are read as the CPU reads them, decoded times
// `kscale` (kv_load.cuh; unused otherwise).
extern "C" __global__ void __launch_bounds__(WP_THREADS) kvs_refresh_scores(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, float softcap,
                                                                              const kv_t* kc, i64 kc0, i64 kc1, i64 kc2, int hk, const int* mode,
                                                                              int phase, unsigned* rmax, unsigned long long* zfix, unsigned* zbad,
                                                                              float* agg, int maxpos, int seed_only, float kscale) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ __align__(16) float ks[WP_TP][WP_KS_PITCH];  // 16-byte rows, conflict-free float4 reads (wp_dot)
    __shared__ __align__(16) float qs[GROUP * HEAD_DIM];
    __shared__ float accs[GROUP][WP_TP];
    const int h = blockIdx.y;
    const int bs = 1 << b.bs_log2;
    const int p = threadIdx.x % WP_TP, j = threadIdx.x / WP_TP;
    for (int s = 0; s < b.num_seqs; ++s) {
        const int m_s = mode[s];
        if (m_s != RF_SEED && (seed_only || m_s != RF_FULL)) continue;
        const SeqRow r = seq_row(b, s);
        const int lo = r.lo, hi = min(r.hi, maxpos - 1);
        const int first = (lo / WP_TP) * WP_TP;
        if (first + blockIdx.x * WP_TP > hi) continue;
        const int t = rf_row(r);
        __syncthreads();  // the previous sequence's queries and tiles are no longer read
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
            const int g = i / HEAD_DIM, c = i % HEAD_DIM;
            qs[i] = ET::ld(q[(i64)t * q0 + (i64)(h * GROUP + g) * q1 + (i64)c * q2]) * scale;
        }
        const i64 rows = (i64)(s * hk + h) * GROUP;
        for (int p0 = first + blockIdx.x * WP_TP; p0 <= hi; p0 += gridDim.x * WP_TP) {
            __syncthreads();  // the previous tile is no longer read (and the queries are staged)
            for (int i = threadIdx.x; i < WP_TP * HEAD_DIM; i += blockDim.x) {
                const int pp = i / HEAD_DIM, c = i % HEAD_DIM, pos = p0 + pp;
                float v = 0.0f;
                if (pos >= lo && pos <= hi) {
                    const i64 blk = phys_block(b, s, pos >> b.bs_log2);
                    if (blk >= 0) v = kv_ld(kc[blk * kc0 + (i64)(pos & (bs - 1)) * kc1 + (i64)h * kc2 + c], kscale);
                }
                ks[pp][c] = v;
            }
            __syncthreads();
            const int pos = p0 + p;
            const bool vis = pos >= lo && pos <= hi;
            float acc[WP_KPER];
#pragma unroll
            for (int k = 0; k < WP_KPER; ++k) {
                acc[k] = 0.0f;
                const int gi = j + WP_J * k;
                const bool row_ok = gi < GROUP;
                const i64 rr = rows + (row_ok ? gi : 0);
                float l = -INFINITY;
                if (vis && row_ok) l = kvs_decision_softcap(wp_dot(qs + gi * HEAD_DIM, ks[p]), softcap);
                if (phase == 0) {
                    wp_row_max(l, p == 0 && row_ok, &rmax[rr]);
                    continue;
                }
                const float m = row_ok ? wp_unkey(rmax[rr]) : -INFINITY;
                const float e = vis && m > -INFINITY ? kvs_fast_exp(l - m) : 0.0f;
                if (phase == 1) {
                    wp_row_sum(e, p == 0 && row_ok && m > -INFINITY, &zfix[rr], &zbad[rr]);
                } else if (row_ok && m > -INFINITY) {
                    // refresh_weights: 0 + f32(e / z) (NaN everywhere when the normaliser is NaN).
                    const double z = zbad[rr] ? (double)__int_as_float(0x7fffffff) : (double)zfix[rr] / WP_NORM_ONE;
                    acc[k] = 0.0f + (float)((double)e / z);
                }
            }
            if (phase != 2) continue;
#pragma unroll
            for (int k = 0; k < WP_KPER; ++k)
                if (j + WP_J * k < GROUP) accs[j + WP_J * k][p] = acc[k];
            __syncthreads();
            if (j == 0 && vis) {
                float a = 0.0f;
                for (int g = 0; g < GROUP; ++g) a = fmaxf(a, accs[g][p]);
                agg[(i64)(s * hk + h) * maxpos + pos] = a;
            }
        }
    }
}

// The rebuild's radix histograms and selection state (kvs_refresh_top_*; cleared by kvs_refresh_plan).
#define RF_BINS 4096    // src/policy/refresh/cuda.rs HIST_BINS
#define RF_SEL 4        // words per row of `sel` (src/policy/refresh/cuda.rs SEL_WORDS): prefix, keys still
                        // needed, the current pass's arrived chunks, unused

// Per (KV head, sequence): the set and the plan (see the top of this file). `pooled` [maxpos] and `tmp`
// [k] per (seq, head) are workspace; the plan is token-granular with `cap` entries per row. `deferred`: a
// FULL row's set is rebuilt after its attention wrote the weights (kvs_refresh_top_*; here only its plan,
// and the rebuild's histograms `rhist` [rows][3][RF_BINS] and arrival count in `rsel` cleared). Grid (hk,
// sequences, slices of a FULL row's plan).
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) kvs_refresh_plan(Batch b, RefreshArgs ra, const float* agg, float* pooled, int maxpos,
                                                                            unsigned* plan, i64 p_s, i64 p_h, int* plan_len, int cap, float* tmp,
                                                                            i64 row_bytes, i64 k_bytes, unsigned long long* ctr, int deferred,
                                                                            unsigned* rhist, unsigned* rsel) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ unsigned hist[256];
    __shared__ unsigned wtot[8];
    __shared__ unsigned long long sel_prefix;
    __shared__ int sel_left;
    __shared__ int cnt[TOPK_THREADS / 32 + 1];
    __shared__ unsigned long long red[32];
    __shared__ unsigned sel[4];
    const int s = blockIdx.y, h = blockIdx.x, hk = ra.hk;
    const SeqRow r = seq_row(b, s);
    const int mode = ra.mode[s];
    unsigned* e = plan + s * p_s + h * p_h;
    const int lo = r.lo, hi = min(r.hi, maxpos - 1);
    const int slot = ra.slot[s];
    const unsigned gen = ra.gen[s];
    const i64 sh = (i64)slot * hk + h;  // this head's state row (slot >= 0 in FULL, SEED and PARTIAL)
    const int K = ra.k;
    // A FULL row's plan (every visible position) is written in gridDim.z slices, slice z by the CTAs of
    // blockIdx.z = z, so that a long row's entries are not one CTA's stores; the CTAs of z > 0 do nothing else.
    const int full_slice = (min(hi - lo + 1, cap) + (int)gridDim.z - 1) / (int)gridDim.z;
    if (blockIdx.z > 0) {
        if (mode == RF_FULL && r.decode) {
            const int n_plan = min(hi - lo + 1, cap), i1 = min(n_plan, ((int)blockIdx.z + 1) * full_slice);
            for (int i = (int)blockIdx.z * full_slice + threadIdx.x; i < i1; i += blockDim.x) e[i] = (unsigned)(lo + i);
        }
        return;
    }
    bool dense = mode == RF_DENSE || (mode == RF_PARTIAL && ra.hstamp[sh] != gen);  // the latter: no set (unreachable)
    if (mode == RF_NONE || (mode != RF_SEED && !r.decode)) {
        if (threadIdx.x == 0) plan_len[s * hk + h] = r.decode ? 0 : -1;
        return;
    }
    if (dense) {
        // No state: every visible position, counted as a dense row's bytes.
        const int n = min(hi - lo + 1, cap);
        for (int i = threadIdx.x; i < n; i += blockDim.x) e[i] = (unsigned)(lo + i);
        if (threadIdx.x == 0) {
            plan_len[s * hk + h] = n;
            atomicAdd(&ctr[CTR_KV_BYTES], (unsigned long long)n * (unsigned long long)row_bytes);
        }
        return;
    }
    unsigned* tok = ra.tok + sh * K;
    float* sc = ra.sc + sh * K;
    int n_plan;
    // The plan's visited blocks (this thread's share), as `account` counts them: every entry lies in
    // lo..=hi and the entries increase, so a block is counted at its first entry.
    unsigned long long blocks = 0;
    if (mode == RF_FULL || mode == RF_SEED) {
        const int n = hi - lo + 1;
        if (mode == RF_SEED || !deferred) {
            // RefreshHead::rebuild over max_pool(weights, pool) of positions lo..=hi.
            const float* ag = agg + (i64)(s * hk + h) * maxpos + lo;
            float* pl = pooled + (i64)(s * hk + h) * maxpos;
            const int rad = ra.pool / 2;
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                float v = -INFINITY;
                for (int x = max(i - rad, 0); x < min(i + rad + 1, n); ++x) v = fmaxf(v, ag[x]);
                pl[i] = v;
            }
            __syncthreads();
            // The K highest pooled scores, ties: the earlier position (top_k_positions). topk32 breaks ties
            // towards the larger index, so it ranks j = n - 1 - i.
            auto key_of = [&](int j) { return kvs_order_key(pl[n - 1 - j]); };
            TopCut cut{0u, 0};
            if (n > K) cut = topk32(0, n, K, key_of, hist, cnt, sel);
            auto keep = [&](int i) {
                if (n <= K) return true;
                const unsigned k = kvs_order_key(pl[i]);
                return k > cut.thr || (k == cut.thr && n - 1 - i >= cut.cut);
            };
            const int nk = compact(n, keep, [&](int i) { return (unsigned)(lo + i); }, tok, K, cnt);
            compact(n, keep, [&](int i) { return __float_as_uint(pl[i]); }, reinterpret_cast<unsigned*>(sc), K, cnt);
            if (threadIdx.x == 0) {
                ra.cnt[sh] = nk;
                ra.last[sh] = hi;
                ra.hstamp[sh] = gen;
            }
        }
        if (mode == RF_SEED) {
            if (threadIdx.x == 0) plan_len[s * hk + h] = -1;  // the chunk itself is attended densely
            return;
        }
        if (deferred) {
            unsigned* gh = rhist + ((i64)s * hk + h) * (3 * RF_BINS);
            for (int i = threadIdx.x; i < 3 * RF_BINS; i += blockDim.x) gh[i] = 0u;
            if (threadIdx.x == 0) rsel[((i64)s * hk + h) * RF_SEL + 2] = 0u;
        }
        n_plan = min(n, cap);
        // Every visible position: written (stores only; this CTA the first slice), counted by arithmetic,
        // not read back.
        for (int i = threadIdx.x; i < min(n_plan, full_slice); i += blockDim.x) e[i] = (unsigned)(lo + i);
        if (threadIdx.x == 0) {
            atomicAdd(&ctr[CTR_KV_BYTES], (unsigned long long)n * (unsigned long long)k_bytes);  // K read again to score
            if (n_plan > 0) blocks = (unsigned long long)(((lo + n_plan - 1) >> b.bs_log2) - (lo >> b.bs_log2) + 1);
        }
    } else {
        // RefreshHead::advance: the old set's positions in lo ..< from (a contiguous run of the sorted
        // set), then the new positions from..=hi at +inf; the k best kept (ties: the newer), i.e. the
        // largest of the unique keys (score's order key, position).
        const int c = min(max(ra.cnt[sh], 0), K);
        const int lastp = ra.last[sh];
        const int from = max(min(lastp, hi) + 1, lo);
        int ibits = 1;
        while ((1 << ibits) <= hi) ++ibits;
        auto key = [&](float score, int pos) { return ((unsigned long long)kvs_order_key(score) << ibits) | (unsigned)pos; };
        // One pass over the old set: both counts (each below 2^31, packed) and the smallest old key in
        // range with its index (a decode step adds one position, so one key goes: this one or the new).
        unsigned long long below = 0, mkey = ~0ull;
        int midx = -1;
        for (int i = threadIdx.x; i < c; i += blockDim.x) {
            const int p = (int)tok[i];
            below += ((unsigned long long)(p < lo) << 32) | (unsigned long long)(p < from);
            if (p >= lo && p < from) {
                const unsigned long long kk = key(sc[i], p);
                if (kk < mkey) mkey = kk, midx = i;
            }
        }
        below = block_sum(below, red);
        const unsigned long long tmin = block_min_u64(mkey, red);
        __shared__ int drop_at;
        if (threadIdx.x == 0) drop_at = -1;
        __syncthreads();
        if (midx >= 0 && mkey == tmin) drop_at = midx;  // keys are unique: one writer
        __syncthreads();
        const int below_lo = (int)(below >> 32), below_from = (int)(below & 0xffffffffull);
        const int i0 = below_lo, n_old = max(below_from - below_lo, 0);
        const int n_new = hi - from + 1;
        const int total = n_old + n_new;
        auto pos_of = [&](int i) { return i < n_old ? (int)tok[i0 + i] : from + (i - n_old); };
        auto score_of = [&](int i) { return i < n_old ? sc[i0 + i] : INFINITY; };
        auto key_of = [&](int i) { return key(score_of(i), pos_of(i)); };
        const int drop = total - K;
        float* tp = tmp + (i64)(s * hk + h) * K;
        if (drop <= 1) {
            // Nothing or one entry goes (index j of the old run then the new positions): the rest in order.
            int j = total;
            if (drop == 1) j = n_new > 0 && key(INFINITY, from) < tmin ? n_old : drop_at - i0;
            n_plan = min(total - (drop == 1 ? 1 : 0), min(cap, K));
            for (int p = threadIdx.x; p < n_plan; p += blockDim.x) {
                const int i = p < j ? p : p + 1;
                e[p] = (unsigned)pos_of(i);
                tp[p] = score_of(i);
            }
            __syncthreads();  // every old entry is read: the set can be rewritten
        } else {
            // Several go (a rewound or jumped sequence): the K-th largest key by a radix select.
            const unsigned long long thr = radix_kth(0, total, K, (32 + ibits + 7) / 8, key_of, hist, wtot, sel_prefix, sel_left);
            auto keep = [&](int i) { return key_of(i) >= thr; };
            n_plan = compact_each(total, keep, [&](int p, int i) {
                e[p] = (unsigned)pos_of(i);
                tp[p] = score_of(i);
            }, min(cap, K), cnt);
            // compact_each ended with a barrier: every old entry is read, the set can be rewritten.
        }
        for (int i = threadIdx.x; i < n_plan; i += blockDim.x) {
            const unsigned p = e[i];
            tok[i] = p;
            sc[i] = tp[i];
            blocks += i == 0 || (e[i - 1] >> b.bs_log2) != (p >> b.bs_log2);
        }
        if (threadIdx.x == 0) {
            ra.cnt[sh] = n_plan;
            ra.last[sh] = hi;
        }
    }
    blocks = block_sum(blocks, red);
    if (threadIdx.x == 0) {
        plan_len[s * hk + h] = n_plan;
        atomicAdd(&ctr[CTR_POLICY_ROWS], 1ull);
        atomicAdd(&ctr[CTR_BLOCKS_ELIGIBLE], (unsigned long long)((hi >> b.bs_log2) - (lo >> b.bs_log2) + 1));
        atomicAdd(&ctr[CTR_BLOCKS_VISITED], blocks);
        atomicAdd(&ctr[CTR_KV_BYTES], (unsigned long long)n_plan * (unsigned long long)row_bytes);
    }
}

// The weights of the FULL rows from the logits their attention wrote (attention_mma.cu, LOGITS=1):
// lg[((s * hk + h) * maxpos + pos) * GROUP + g] holds query head g's base-2 logit of position pos. Grid
// (chunks of RF_CH positions, hk, sequences), RF_WTHREADS threads; chunk c covers lo + c * RF_CH ...
#define RF_CH 2048      // src/policy/refresh/cuda.rs WEIGHT_CHUNK
#define RF_WTHREADS 256  // src/policy/refresh/cuda.rs WEIGHT_THREADS: the launches' block size, the chunk loops assume it
#define RF_PER (RF_CH / RF_WTHREADS)  // positions of a chunk per thread

// This thread's pooled values of chunk [i0, i1) (position i0 + j * RF_WTHREADS + threadIdx.x in pv[j], 0
// past i1), every load issued before any is used: the loops that read them have barriers or shuffles per
// step, which would otherwise keep one L2 round trip per step.
__device__ __forceinline__ void rf_load_chunk(const float* pl, int i0, int i1, float (&pv)[RF_PER]) {
#pragma unroll
    for (int j = 0; j < RF_PER; ++j) {
        const int i = i0 + j * RF_WTHREADS + threadIdx.x;
        pv[j] = i < i1 ? pl[i] : 0.0f;
    }
}
#define RF_RADMAX 64    // pooling radius up to which a chunk stages its weights in shared memory
#define RF_CCW 258      // words per chunk of `ccnt` (src/policy/refresh/cuda.rs CHUNK_COUNT_WORDS): keys above
                        // the last pass's 24-bit prefix, then suffix sums of its 256 low-byte bins (257)

// Position pos's weight: max(0, max over the group of 2^(l - lse)) (L: the row's logits; 16-byte loads
// where the group's logits are whole float4s, the same operations in the same order).
__device__ __forceinline__ float rf_weight(const float* L, int pos, const float* lse) {
    float a = 0.0f;
#if GROUP % 4 == 0
    const float4* p = reinterpret_cast<const float4*>(L + (i64)pos * GROUP);
#pragma unroll
    for (int g = 0; g < GROUP / 4; ++g) {
        const float4 l = p[g];
        a = fmaxf(a, exp2f(l.x - lse[4 * g]));
        a = fmaxf(a, exp2f(l.y - lse[4 * g + 1]));
        a = fmaxf(a, exp2f(l.z - lse[4 * g + 2]));
        a = fmaxf(a, exp2f(l.w - lse[4 * g + 3]));
    }
#else
#pragma unroll
    for (int g = 0; g < GROUP; ++g) a = fmaxf(a, exp2f(L[(i64)pos * GROUP + g] - lse[g]));
#endif
    return a;
}

// Each query head's base-2 LSE over the row into lse[GROUP] (shared), merged from the attention's split
// statistics `pg` (GROUP * nparts pairs (max, sum of 2^(l - max)); empty splits are (-inf, 0)): a warp per
// query head, the lanes' strided parts reduced by a fixed shuffle tree (the same inputs give the same
// bits, whatever order the splits ran in). +inf when no logit is finite (every weight then 0). A NaN logit
// makes its split's sum NaN, the LSE NaN, and every weight of the row 0 (fmaxf from 0), as the CPU's max
// from 0 does. Block-wide.
__device__ __forceinline__ void rf_group_lse(const float2* pg, int nparts, float* lse) {
    const int lane = threadIdx.x & 31;
    for (int g = threadIdx.x >> 5; g < GROUP; g += blockDim.x >> 5) {
        const float2* pr = pg + g * nparts;
        float m = -INFINITY;
        for (int i = lane; i < nparts; i += 32) m = fmaxf(m, pr[i].x);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float z = 0.0f;
        if (m > -INFINITY)
            for (int i = lane; i < nparts; i += 32)
                if (pr[i].x > -INFINITY) z += pr[i].y * exp2f(pr[i].x - m);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
        if (lane == 0) lse[g] = m > -INFINITY ? m + log2f(z) : INFINITY;
    }
    __syncthreads();
}

// The pooled weights of positions i0 <= i < i1 (relative to lo, at most CH of them; n positions in the
// row): max of rf_weight over i - rad ..= i + rad within the row, thread t's i0 + j * THREADS + t in
// pv[j] (-inf past i1). The weights are staged in `wv` (shared, CH + 2 * RF_RADMAX) up to radius
// RF_RADMAX and recomputed per use beyond it (the same bits). Block-wide, THREADS threads; callable in a
// loop (it waits for the previous call's readers of wv).
template <int THREADS, int CH>
__device__ __forceinline__ void rf_pool_chunk(const float* L, const float* lse, int lo, int n, int rad, int i0, int i1, float* wv, float (&pv)[CH / THREADS]) {
    const int w0 = max(i0 - rad, 0), w1 = min(i1 + rad, n);
    const bool staged = rad <= RF_RADMAX;
    if (staged) {
        __syncthreads();
#pragma unroll 4
        for (int x = w0 + threadIdx.x; x < w1; x += THREADS) wv[x - w0] = rf_weight(L, lo + x, lse);
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < CH / THREADS; ++j) {
        const int i = i0 + j * THREADS + threadIdx.x;
        float v = -INFINITY;
        if (i < i1)
            for (int x = max(i - rad, 0); x < min(i + rad + 1, n); ++x) v = fmaxf(v, staged ? wv[x - w0] : rf_weight(L, lo + x, lse));
        pv[j] = v;
    }
}

// The full rows' sets rebuilt across CTAs (RefreshHead::rebuild: max_pool(weights, pool), the top k by
// (score, earlier position)), so that a row of 128K positions is not one CTA's serial work. Grids
// (chunks of RF_CH positions, hk, sequences); FULL rows only. The k-th largest pooled key is found by a
// radix select over the 32-bit order keys in three passes (bits 31..20, 19..8, 7..0): per pass the chunks
// add their histograms of the keys under the prefix chosen so far (global atomics: counts, so any order
// gives the same result), and the row's last chunk to finish (an arrival count) descends into the bin that
// holds the k-th key. `hist` [rows][3][4096] and the arrival counts are cleared by kvs_refresh_plan;
// `sel` [rows][RF_SEL] holds (prefix, keys still needed in it, arrivals); `ccnt` [rows][chunks][RF_CCW]
// what the last pass saw per chunk, from which each chunk's counts above and at the threshold follow.
__device__ __forceinline__ void rf_pass_bits(int pass, int& shift, int& bits) {
    shift = pass == 0 ? 20 : (pass == 1 ? 8 : 0);
    bits = pass == 2 ? 8 : 12;
}

// The bin of this pass that holds the k-th largest key: sel = (prefix, keys still needed among those equal
// to it so far). Block-wide, RF_WTHREADS threads; reads the histogram and `sel` from L2 (other CTAs wrote
// them).
#define RF_SELPER (RF_BINS / RF_WTHREADS)  // bins per thread of rf_select's widest pass
__device__ __forceinline__ void rf_select(const unsigned* gh, unsigned* sel, int pass, int k) {
    __shared__ int wsum[RF_WTHREADS / 32];
    int shift, bits;
    rf_pass_bits(pass, shift, bits);
    const int nb = 1 << bits, per = nb / RF_WTHREADS;  // bins per thread, from the top
    const unsigned prefix = pass == 0 ? 0u : __ldcg(&sel[0]);
    const int left = pass == 0 ? k : (int)__ldcg(&sel[1]);
    __syncthreads();  // sel is read by every thread before thread `hit` rewrites it
    const int top = nb - 1 - threadIdx.x * per;  // this thread's bins: top, top - 1, ..., top - per + 1
    // The bins loaded first, all in flight (per <= RF_SELPER), then summed.
    unsigned bin[RF_SELPER];
#pragma unroll
    for (int j = 0; j < RF_SELPER; ++j) bin[j] = j < per ? __ldcg(&gh[top - j]) : 0u;
    int mine = 0;
#pragma unroll
    for (int j = 0; j < RF_SELPER; ++j) mine += (int)bin[j];
    int total;
    int acc = block_excl_scan(mine, wsum, total);
    if (acc < left && acc + mine >= left) {
#pragma unroll
        for (int j = 0; j < RF_SELPER; ++j) {
            const int cnt = (int)bin[j];
            if (acc + cnt >= left) {
                sel[0] = prefix | ((unsigned)(top - j) << shift);
                sel[1] = (unsigned)(left - acc);
                break;
            }
            acc += cnt;
        }
    }
}

// One radix pass over a chunk, and the pass's selection by the row's last chunk. Pass 0 first computes the
// weights the chunk's pooling reads (from the logits and the row's LSE; staged in shared memory up to
// radius RF_RADMAX, recomputed per use beyond: the same bits) and max-pools them into `pooled` (positions
// relative to lo). Pass 2 also keeps the chunk's counts for kvs_refresh_top_write (`ccnt`): its keys
// above the 24-bit prefix and, per low byte b, its keys under the prefix with a low byte >= b.
extern "C" __global__ void __launch_bounds__(RF_WTHREADS) kvs_refresh_top_hist(Batch b, RefreshArgs ra, const float* lg, const float2* parts, int nparts, int nchunk,
                                                                               float* pooled, int maxpos, unsigned* hist, unsigned* sel, unsigned* ccnt,
                                                                               int pass) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ unsigned sh[RF_BINS];
    __shared__ float wv[RF_CH + 2 * RF_RADMAX];
    __shared__ float lse[GROUP];
    __shared__ int last;
    __shared__ int wsum[RF_WTHREADS / 32];
    __shared__ unsigned red[32];
    const int c = blockIdx.x, h = blockIdx.y, s = blockIdx.z, hk = ra.hk;
    if (ra.mode[s] != RF_FULL) return;
    const SeqRow r = seq_row(b, s);
    const int lo = r.lo, hi = min(r.hi, maxpos - 1), n = hi - lo + 1;
    const int i0 = c * RF_CH, i1 = min(n, i0 + RF_CH);
    if (i0 >= n) return;
    const i64 row = (i64)s * hk + h;
    float* pl = pooled + row * maxpos;
    float pv[RF_PER];  // this thread's pooled values: position i0 + j * RF_WTHREADS + threadIdx.x
    if (pass == 0) {
        rf_group_lse(parts + row * GROUP * nparts, nparts, lse);
        rf_pool_chunk<RF_WTHREADS, RF_CH>(lg + row * maxpos * GROUP, lse, lo, n, ra.pool / 2, i0, i1, wv, pv);
#pragma unroll
        for (int j = 0; j < RF_PER; ++j) {
            const int i = i0 + j * RF_WTHREADS + threadIdx.x;
            if (i < i1) pl[i] = pv[j];
        }
    } else {
        rf_load_chunk(pl, i0, i1, pv);  // what pass 0 wrote
    }
    if (n <= ra.k) return;  // every position kept: no threshold
    int shift, bits;
    rf_pass_bits(pass, shift, bits);
    const unsigned nb = 1u << bits, himask = pass == 0 ? 0u : (0xffffffffu << (shift + bits));
    const unsigned prefix = pass == 0 ? 0u : sel[row * RF_SEL];
    for (int i = threadIdx.x; i < (int)nb; i += blockDim.x) sh[i] = 0u;
    __syncthreads();
    unsigned above = 0;  // keys above the prefix (pass 2 keeps the count)
#pragma unroll
    for (int j = 0; j < RF_PER; ++j) {
        if (i0 + j * RF_WTHREADS + (int)threadIdx.x >= i1) break;
        const unsigned k = kvs_order_key(pv[j]);
        if ((k & himask) == (prefix & himask)) {
            const unsigned bin = (k >> shift) & (nb - 1);
            const unsigned peers = __match_any_sync(__activemask(), bin);
            if ((threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1)) atomicAdd(&sh[bin], (unsigned)__popc(peers));
        } else if ((k & himask) > (prefix & himask)) {
            ++above;
        }
    }
    __syncthreads();
    if (pass == 2) {
        // nb == RF_WTHREADS: thread t holds bin t; suffix sums by an exclusive scan from the bottom.
        above = block_sum(above, red);
        int in_chunk;
        const int below_t = block_excl_scan((int)sh[threadIdx.x], wsum, in_chunk);
        unsigned* cc = ccnt + (row * nchunk + c) * RF_CCW;
        cc[1 + threadIdx.x] = (unsigned)(in_chunk - below_t);
        if (threadIdx.x == 0) {
            cc[0] = above;
            cc[1 + RF_WTHREADS] = 0u;
        }
    }
    unsigned* gh = hist + (row * 3 + pass) * RF_BINS;
    for (int i = threadIdx.x; i < (int)nb; i += blockDim.x)
        if (sh[i]) atomicAdd(&gh[i], sh[i]);
    // The row's last chunk to add its counts chooses the pass's bin (the others' adds are visible to it:
    // each thread fences before the barrier, the count is taken after it).
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&sel[row * RF_SEL + 2], 1u) == (unsigned)((n + RF_CH - 1) / RF_CH - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    rf_select(gh, sel + row * RF_SEL, pass, ra.k);
    if (threadIdx.x == 0) sel[row * RF_SEL + 2] = 0u;  // the next pass's arrivals
}

// A FULL row's limits for its set's rebuild (positions lo..=hi, n of them; `row` its (sequence, KV head),
// `sh` its state's (slot, KV head)), with the set's size, last position and stamp written when `first`
// (one thread of the row's launch).
struct RfFullRow {
    int lo, hi, n;
    i64 row, sh;
    bool all;  // n <= k: every position kept
};
__device__ __forceinline__ RfFullRow rf_full_row(const Batch& b, const RefreshArgs& ra, int s, int h, int maxpos, bool first) {
    const SeqRow r = seq_row(b, s);
    RfFullRow f;
    f.lo = r.lo;
    f.hi = min(r.hi, maxpos - 1);
    f.n = f.hi - f.lo + 1;
    f.row = (i64)s * ra.hk + h;
    f.sh = (i64)ra.slot[s] * ra.hk + h;
    f.all = f.n <= ra.k;
    if (first) {
        ra.cnt[f.sh] = f.all ? f.n : ra.k;
        ra.last[f.sh] = f.hi;
        ra.hstamp[f.sh] = ra.gen[s];
    }
    return f;
}

// Per chunk: its kept positions (above the threshold, or at it among the first `left` of the row) written
// in position order at their rank in the row's set, with their pooled scores; chunk 0 writes the set's
// size, last position and stamp.
extern "C" __global__ void __launch_bounds__(RF_WTHREADS) kvs_refresh_top_write(Batch b, RefreshArgs ra, const float* pooled, int maxpos, const unsigned* sel,
                                                                                const unsigned* ccnt, int nchunk) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ int wsum[RF_WTHREADS / 32];
    __shared__ unsigned red[32];
    const int c = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    if (ra.mode[s] != RF_FULL) return;
    const RfFullRow fr = rf_full_row(b, ra, s, h, maxpos, c == 0 && threadIdx.x == 0);
    const int lo = fr.lo, hi = fr.hi, n = fr.n, K = ra.k;
    const i64 row = fr.row, sh = fr.sh;
    const bool all = fr.all;
    const int i0 = c * RF_CH, i1 = min(n, i0 + RF_CH);
    if (i0 >= n) return;
    const float* pl = pooled + row * maxpos;
    float pv[RF_PER];
    rf_load_chunk(pl, i0, i1, pv);
    unsigned* tok = ra.tok + sh * K;
    float* sc = ra.sc + sh * K;
    unsigned thr = 0, left = 0, base = 0, eq_before = 0;
    if (!all) {
        thr = sel[row * RF_SEL];
        left = sel[row * RF_SEL + 1];
        // The chunks before this one (a thread each): above the threshold = above the 24-bit prefix or
        // under it with a larger low byte d; at it = under it with low byte d (kvs_refresh_top_hist, pass 2).
        const int d = (int)(thr & 255u);
        unsigned a = 0, q = 0;
        for (int j = threadIdx.x; j < c; j += blockDim.x) {
            const unsigned* cc = ccnt + (row * nchunk + j) * RF_CCW;
            const unsigned ge = cc[1 + d], gt = cc[1 + d + 1];
            a += cc[0] + gt;
            q += ge - gt;
        }
        base = block_sum(a, red);
        eq_before = block_sum(q, red);
    }
    // Kept before this chunk: the ones above the threshold, and min(eq_before, left) of those at it.
    int out = all ? i0 : (int)(base + min(eq_before, left));
    int eq_seen = (int)eq_before;
#pragma unroll
    for (int j = 0; j < RF_PER; ++j) {
        if (i0 + j * RF_WTHREADS >= i1) break;  // uniform
        const int i = i0 + j * RF_WTHREADS + threadIdx.x;
        const bool in = i < i1;
        const float v = pv[j];
        const unsigned k = kvs_order_key(v);
        int eq_total;
        const int eq_rank = eq_seen + block_excl_scan(in && !all && k == thr ? 1 : 0, wsum, eq_total);
        const bool keep = in && (all || k > thr || (k == thr && eq_rank < (int)left));
        int kept_total;
        const int at = out + block_excl_scan(keep ? 1 : 0, wsum, kept_total);
        if (keep && at < K) {
            tok[at] = (unsigned)(lo + i);
            sc[at] = v;
        }
        out += kept_total;
        eq_seen += eq_total;
    }
}

// The full rows' sets rebuilt on a thread-block cluster (sm_90 and newer; src/policy/refresh/cuda.rs
// launches it while the rows' clusters fit in one wave): kvs_refresh_top_hist's three passes and
// kvs_refresh_top_write in one launch, with no grid-wide round trips between passes: the same weights,
// pooling and set (the top k by (score, earlier position)). Row (s, h)'s cluster of QC_CTAS CTAs splits
// the row from its newest position: CTA `rank` holds j = rank * per ... (per = ceil(n / QC_CTAS)), j
// being the relative position n - 1 - j, so that cluster_topk_cut's ties to the larger index are ties to
// the earlier position. Each CTA pools its positions' weights (as order keys in its shared memory when
// they fit, `smem_keys`; else in `pooled`), the cluster cuts the k largest, and each CTA writes its kept
// positions in position order after those of the CTAs holding earlier ones (the higher ranks). Grid
// (hk * QC_CTAS, sequences), RC_THREADS threads (a row's cluster is 8 SMs' work: as many warps as fit);
// FULL rows only.
#define RC_THREADS 1024  // src/policy/refresh/cuda.rs CLUSTER_THREADS
#define RC_CH 4096       // positions per pooled chunk of kvs_refresh_top_cluster
extern "C" __global__ void QC_CLUSTER_DIMS __launch_bounds__(RC_THREADS)
    kvs_refresh_top_cluster(Batch b, RefreshArgs ra, const float* lg, const float2* parts, int nparts, float* pooled, int maxpos, int smem_keys) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
#if KVS_CLUSTERS
    extern __shared__ unsigned skey[];
    __shared__ float wv[RC_CH + 2 * RF_RADMAX];
    __shared__ float lse[GROUP];
    QC_SCRATCH_N(RC_THREADS);
    const unsigned rank = cluster_rank();
    const int h = blockIdx.x / QC_CTAS, s = blockIdx.y;
    if (ra.mode[s] != RF_FULL) return;  // the whole cluster: one row
    const RfFullRow fr = rf_full_row(b, ra, s, h, maxpos, rank == 0 && threadIdx.x == 0);
    const int lo = fr.lo, n = fr.n, K = ra.k;
    const i64 row = fr.row, sh = fr.sh;
    const bool all = fr.all;
    const int per = (n + QC_CTAS - 1) / QC_CTAS;
    const int a0 = min((int)rank * per, n), a1 = min(a0 + per, n);  // this CTA's j
    const bool staged = a1 - a0 <= smem_keys;
    float* pl = pooled + row * maxpos;
    unsigned* tok = ra.tok + sh * K;
    float* sc = ra.sc + sh * K;
    rf_group_lse(parts + row * GROUP * nparts, nparts, lse);
    const float* L = lg + row * maxpos * GROUP;
    for (int i0 = n - a1; i0 < n - a0; i0 += RC_CH) {  // positions n - a1 <= i < n - a0, a chunk at a time
        const int i1 = min(n - a0, i0 + RC_CH);
        float pv[RC_CH / RC_THREADS];
        rf_pool_chunk<RC_THREADS, RC_CH>(L, lse, lo, n, ra.pool / 2, i0, i1, wv, pv);
#pragma unroll
        for (int j = 0; j < RC_CH / RC_THREADS; ++j) {
            const int i = i0 + j * RC_THREADS + threadIdx.x;
            if (i >= i1) continue;
            if (all) {  // every position kept, at its own rank
                tok[i] = (unsigned)(lo + i);
                sc[i] = pv[j];
            } else if (staged) {
                skey[n - 1 - i - a0] = kvs_order_key(pv[j]);
            } else {
                pl[i] = pv[j];
            }
        }
    }
    if (all) return;  // no CTA reads another's shared memory
    __syncthreads();
    auto key_of = [&](int j) { return staged ? skey[j - a0] : kvs_order_key(pl[n - 1 - j]); };
    const TopCut tc = cluster_topk_cut(0, n, n, per, K, rank, key_of, xs.xh, xs.xw, xs.sel, xs.wmm, xs.cnt);
    auto keep = [&](int j) {
        const unsigned kk = key_of(j);
        return kk > tc.thr || (kk == tc.thr && j >= tc.cut);
    };
    unsigned long long mine = 0;
    for (int j = a0 + threadIdx.x; j < a1; j += blockDim.x) mine += keep(j);
    mine = block_sum(mine, xs.red);
    cluster_rank_prefix((unsigned)mine, rank, true, xs);  // kept by the CTAs holding earlier positions
    const int off = (int)xs.sel[0];
    // This CTA's kept positions in increasing position order: t = 0, 1, ... is j = a1 - 1 - t.
    compact_each(
        a1 - a0, [&](int t) { return keep(a1 - 1 - t); },
        [&](int p, int t) {
            const int j = a1 - 1 - t;
            if (off + p < K) {
                tok[off + p] = (unsigned)(lo + n - 1 - j);
                sc[off + p] = wp_unkey(key_of(j));
            }
        },
        K, xs.cnt);
    cluster_sync();  // no CTA leaves while another may read its shared memory
#else
    __trap();  // launched only on sm_90 and newer
#endif
}
