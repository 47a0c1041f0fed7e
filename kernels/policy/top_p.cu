// Top-p's (Twilight) selection kernels, launched in this order by src/policy/top_p/cuda.rs: INT4 estimates
// of the base plan's candidates (kvs_topp_estimate), each row's softmax normaliser (kvs_topp_norm), the
// weights and the first radix pass (kvs_topp_weights), three more radix passes and the tile summaries
// (kvs_topp_pass), and the kept positions as the plan (kvs_topp_write). At small batch on Hopper the
// steps after the estimate run as one launch instead (kvs_topp_cluster: a thread-block cluster per row). The
// conventions of a plan, the trust rules and the counters are select.cu's (see its header).
//
// The set is top_p::select's: the shortest prefix of the candidates sorted by the aggregated weight w
// (max over the group's rows; descending, equal weights by position, ascending) whose mass reaches p of
// every row's total. It is found by a radix search on the bits of w (8 per pass, 4 passes), where every
// kernel spreads a row over many CTAs (tiles of whole chunks of TOPP_CHUNK candidates) and merges their
// per-bin masses in global memory; the state of the search (threshold bits so far, mass above them)
// passes from kernel to kernel. Each kernel needs the previous one complete: the launches are the
// grid-wide barriers.
//
// Arithmetic (docs/policies.md, "Twilight top-p on the device"): estimates and weights in the CPU's
// operations (decision_dot's order, kvs_fast_exp; this file needs --fmad=false as the whole SELECT module
// has), the softmax normaliser an f64 sum in another order (per tile, then over tiles), masses exact in
// fixed point. Decisions are deterministic: integer atomics only, ties by position.
//
// Compile-time parameters: KVS_DTYPE, HEAD_DIM, GROUP (query heads per KV head).

#include "common.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"
#include "cluster_topk.cuh"
#include "split_f16.cuh"

#define TOPP_THREADS 256               // threads of every later kernel (8 warps: choose_digit's layout)
#define TOPP_CHUNK (4 * TOPP_THREADS)  // candidates per pass of a CTA's loop in the later kernels, 4 consecutive per thread
#define TOPP_PASSES 4                  // radix passes of 8 bits over the 32-bit weight
#define TOPP_STATES (TOPP_PASSES + 1)  // search states: after pass k's digit (slot k, 1..4)

// The search after a digit: threshold bits chosen so far, each row's mass of the candidates above them
// (fixed point), each row's target (p times its total).
struct TopPState {
    unsigned t;
    unsigned pad;
    unsigned long long above[GROUP];
    double target[GROUP];
};

// One tile's candidates at the final threshold T: how many weigh more, how many weigh exactly T, and the
// tied ones' mass per row.
struct TopPTile {
    unsigned gt, ties;
    unsigned long long mass[GROUP];
};

// The parameters every kernel takes: the batch, the base plan, and the workspace (per row = sequence x
// KV head): logits [row][GROUP][maxc], weights w [row][maxc], estimate-tile maxima tmax
// [row][etiles][GROUP], tile normaliser sums psum [row][stiles][GROUP], row max and 1/normaliser rown
// [row][2][GROUP], mass histograms hist [row][TOPP_PASSES][256][GROUP], states [row][TOPP_STATES], tile
// summaries [row][stiles], flags [row][2] (a non-finite weight; the write kernel's done count). Each CTA
// of the kernels after the estimate covers a tile of `spt` chunks of TOPP_CHUNK candidates (the host
// picks spt so that a call has about a thousand such CTAs: long rows split, many rows not over-split).
#define TOPP_PARAMS                                                                                                               \
    Batch b, int hk, const unsigned *base, i64 b_s, i64 b_h, const int *base_len, int ulog2, int maxc, float *logits, float *w, \
        float *tmax, double *psum, float *rown, unsigned long long *hist, TopPState *state, TopPTile *tsum, int *flags, int spt, int etile

// One row's candidates: the base plan's units expanded to positions (increasing), `nc` of them, of which
// [ja, jb] lie inside the row's limits.
struct ToppRow {
    SeqRow r;
    int row, nc, ja, jb;
    const unsigned* be;
    int umask, ulog2;
    __device__ __forceinline__ int pos(int j) const { return (int)((be[j >> ulog2] << ulog2) | (unsigned)(j & umask)); }
    __device__ __forceinline__ bool valid(int j) const { return j >= ja && j <= jb; }
    __device__ __forceinline__ unsigned long long nvalid() const { return jb >= ja ? (unsigned long long)(jb - ja + 1) : 0ull; }
};

__device__ __forceinline__ ToppRow topp_row(const Batch& b, int s, int h, int hk, const unsigned* base, i64 b_s, i64 b_h, const int* base_len, int ulog2,
                                            int maxc) {
    ToppRow t;
    t.r = seq_row(b, s);
    t.row = s * hk + h;
    const int nb = (t.r.decode && t.r.hi >= t.r.lo) ? base_len[t.row] : 0;
    t.nc = nb > 0 ? min(nb << ulog2, maxc) : 0;
    t.be = base + s * b_s + h * b_h;
    t.ulog2 = ulog2;
    t.umask = (1 << ulog2) - 1;
    t.ja = 0;
    t.jb = -1;
    if (t.nc > 0) {  // positions increase with j: the candidates inside lo..=hi are [ja, jb]
        const int p0 = t.pos(0), pl = t.pos(t.nc - 1);
        t.ja = p0 < t.r.lo ? min(t.r.lo - p0, t.nc) : 0;
        t.jb = pl > t.r.hi ? t.nc - 1 - (pl - t.r.hi) : t.nc - 1;
    }
    return t;
}

// Candidate j's row of the INT4 copy (slot x KV heads + h), or -1 when its position lies outside the row's
// limits (no block there): the estimates' addressing.
__device__ __forceinline__ i64 topp_code_row(const ToppRow& t, const Batch& b, int s, int hk, int h, int j) {
    const int pos = t.pos(j);
    const i64 pb = (pos >= t.r.lo && pos <= t.r.hi) ? phys_block(b, s, pos >> b.bs_log2) : -1;
    if (pb < 0) return -1;
    const int bs = 1 << b.bs_log2;
    return (pb * bs + (pos & (bs - 1))) * hk + h;
}

// A candidate's estimated weight in one row, as softmax_decision: e = fast_exp(x - max), times f32(1/z)
// (times 1 when z is not positive, which leaves e unchanged).
__device__ __forceinline__ float topp_weight(float x, float m, float inv) { return kvs_fast_exp(x - m) * inv; }

// Masses are fixed point (P * 2^62 as u64; every weight is <= 1 and a row's weights sum to 1), so the
// sums are exact whatever order atomics land in; they differ from the CPU's f64 sums by at most ~1e-14,
// far below any mass gap a decision could hinge on.
#define MASS_ONE 4611686018427387904.0  // 2^62
__device__ __forceinline__ unsigned long long to_fixed(float v) { return (unsigned long long)((double)v * MASS_ONE); }

// Loads the GROUP query rows of KV head h at row t, times the scale (as the CPU's load_queries), into
// shared memory, and their ordered sums. All threads of the CTA call this.
__device__ __forceinline__ void load_q(const elem_t* q, i64 q0, i64 q1, i64 q2, int t, int h, float scale, float* qs, float* qsum) {
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int r = i / HEAD_DIM, c = i % HEAD_DIM;
        qs[i] = ET::ld(q[(i64)t * q0 + (i64)(h * GROUP + r) * q1 + (i64)c * q2]) * scale;
    }
    __syncthreads();
    if (threadIdx.x < GROUP) {
        float s = 0.0f;
        for (int c = 0; c < HEAD_DIM; ++c) s += qs[threadIdx.x * HEAD_DIM + c];
        qsum[threadIdx.x] = s;
    }
    __syncthreads();
}

// The INT4 codes of one key row as 32-bit words (channels 8i..8i+7, low nibble first), read 16 or 8 bytes
// at a time (a row is HEAD_DIM / 2 bytes: a multiple of 16 for head sizes 64, 96, 128, 192, 256, of 8 for
// every supported size).
#if (HEAD_DIM / 2) % 16 == 0
typedef uint4 code_vec;
#define CODE_WORDS 4
#else
typedef uint2 code_vec;
#define CODE_WORDS 2
#endif
__device__ __forceinline__ unsigned code_word(const code_vec& v, int i) {
#if CODE_WORDS == 4
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
#else
    return i == 0 ? v.x : v.y;
#endif
}

// A 4-bit code as a float, exactly: 2^23 + c as bits, minus 2^23 (two full-rate operations instead of a
// conversion, which runs at a quarter of the rate).
__device__ __forceinline__ float code_f(unsigned c) { return __fsub_rn(__uint_as_float(0x4b000000u | c), 8388608.0f); }

// One candidate's logits (every row of the group) from its INT4 row: min * sum(q) + scale * dot(q, codes)
// in decision_dot's order (8 strided accumulators, then their sum) and its arithmetic (a rounded product,
// then the addition): the CPU's logits bit for bit. (Fused multiply-adds would save a third of the
// estimate's arithmetic, within the stated bound, but would make the sets differ from the CPU's at the
// boundary where the sparse suite still asks for equal plans.)
__device__ __forceinline__ void estimate_row(const code_vec* cv, float mn, float scl, const float* qs, const float* qsum, float softcap,
                                             float (&xv)[GROUP]) {
    float acc[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
        for (int l = 0; l < 8; ++l) acc[g][l] = 0.f;
    for (int v = 0; v < HEAD_DIM / 8 / CODE_WORDS; ++v) {
        const code_vec words = cv[v];
#pragma unroll
        for (int wi = 0; wi < CODE_WORDS; ++wi) {
            const unsigned word = code_word(words, wi);
            const int c8 = v * CODE_WORDS + wi;
            float cf[8];
#pragma unroll
            for (int l = 0; l < 8; ++l) cf[l] = code_f((word >> (4 * l)) & 15u);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                // The 8 query values as two 16-byte shared loads (a broadcast: every thread reads them).
                const float4 qa = *reinterpret_cast<const float4*>(&qs[g * HEAD_DIM + c8 * 8]);
                const float4 qb = *reinterpret_cast<const float4*>(&qs[g * HEAD_DIM + c8 * 8 + 4]);
                const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
                for (int l = 0; l < 8; ++l) acc[g][l] += qv[l] * cf[l];  // --fmad=false: rounded products, as the CPU
            }
        }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        float dot = acc[g][0];
#pragma unroll
        for (int l = 1; l < 8; ++l) dot += acc[g][l];
        xv[g] = kvs_decision_softcap(mn * qsum[g] + scl * dot, softcap);
    }
}

// The estimate's CTA 0 of a row clears the row's histograms and flags for the later kernels (block-wide).
__device__ __forceinline__ void clear_row_search(int row, unsigned long long* hist, int* flags) {
    unsigned long long* hr = hist + (i64)row * TOPP_PASSES * 256 * GROUP;
    for (int i = threadIdx.x; i < TOPP_PASSES * 256 * GROUP; i += blockDim.x) hr[i] = 0ull;
    if (threadIdx.x < 2) flags[2 * row + threadIdx.x] = 0;
}

// Step 1: INT4 estimates of every candidate's logits (the base plan's positions inside the row), as
// estimate_weights, soft-capped.
// Candidates outside the row get NaN. Also each CTA's maximum per row (tmax), and CTA 0 of a row clears
// the row's histograms and flags for the later kernels. Grid (tiles of `etile` candidates, KV heads,
// seqs); each thread estimates etile / TOPP_THREADS (1, 2 or 4) candidates, TOPP_THREADS apart (coalesced
// stores).
extern "C" __global__ void __launch_bounds__(TOPP_THREADS) kvs_topp_estimate(TOPP_PARAMS, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale,
                                                                            const unsigned char* codes, const u16* qparams, float softcap) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ __align__(16) float qs[GROUP * HEAD_DIM];
    __shared__ float qsum[GROUP];
    __shared__ float red[32];
    const ToppRow t = topp_row(b, blockIdx.z, blockIdx.y, hk, base, b_s, b_h, base_len, ulog2, maxc);
    if ((int)(blockIdx.x * etile) >= t.nc) return;  // also every row that is not a decode row
    const int h = blockIdx.y;
    if (blockIdx.x == 0) clear_row_search(t.row, hist, flags);
    load_q(q, q0, q1, q2, t.r.t, h, scale, qs, qsum);
    float* out = logits + (i64)t.row * GROUP * maxc;
    float mx[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) mx[g] = -INFINITY;
    for (int k = 0; k < etile / TOPP_THREADS; ++k) {
        const int j = blockIdx.x * etile + k * TOPP_THREADS + threadIdx.x;
        if (j >= t.nc) break;
        const i64 row = topp_code_row(t, b, blockIdx.z, hk, h, j);
        if (row < 0) {
            for (int g = 0; g < GROUP; ++g) out[(i64)g * maxc + j] = __int_as_float(0x7fffffff);
            continue;
        }
        float xv[GROUP];
        estimate_row(reinterpret_cast<const code_vec*>(codes + row * (HEAD_DIM / 2)), kvs_f16_to_f32(qparams[2 * row]), kvs_f16_to_f32(qparams[2 * row + 1]), qs,
                     qsum, softcap, xv);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            out[(i64)g * maxc + j] = xv[g];
            mx[g] = fmaxf(mx[g], xv[g]);  // NaN ignored, as the CPU's fold with f32::max
        }
    }
    const int etiles = (maxc + etile - 1) / etile;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const float m = block_max(mx[g], red);
        if (threadIdx.x == 0) tmax[((i64)t.row * etiles + blockIdx.x) * GROUP + g] = m;
    }
}

// Step 1 on tensor cores (kvs_topp_estimate_mma; the host takes it where TE_FITS holds): the same
// estimates, min * sum(q) + scale * dot(q, codes), with dot(q, codes) as an f16 matrix product: 16
// candidates' codes (0..15, exact in f16) as the rows of A, the group's query rows as the columns of B,
// each row scaled by 2^e and split into hi + lo f16 terms (split_f16.cuh), mma.sync m16n8k16 with f32
// accumulation, then times 2^-e. The products are exact; the tensor core's additions are not the CPU's
// order, so a logit differs from the CPU's within the bound of docs/policies.md ("Twilight top-p on the
// device"). min * sum(q) and the rest stay the CPU's operations. K order: lane quad tt reads code words
// tt * TE_WPT .. + TE_WPT - 1 of each candidate row (16-byte loads where they fit), and k-steps 2 jw and
// 2 jw + 1 take its word jw as te_word_f16x2's nibble pairs: k is channel te_channel(ks, k) below, the
// same map in A and B. Same grid, tiles and outputs as kvs_topp_estimate; each warp takes 32 candidates
// per round.
#define TE_FITS (HEAD_DIM % 32 == 0 && GROUP <= 16)
#if TE_FITS
#define TE_NT ((GROUP + 7) / 8)  // 8-column tiles of query rows
#define TE_KS (HEAD_DIM / 16)    // k-steps of a candidate row
#define TE_WPT (HEAD_DIM / 32)   // code words (8 channels each) per lane of a quad, per candidate row
#define TE_MT 2                  // 16-candidate tiles per warp and round (the query's fragments loaded once)

// The channel that k index k (0..15) of k-step ks stands for (both operands use this map): k-steps 2 jw
// and 2 jw + 1 take word jw of the lane's, as the nibble pairs te_word_f16x2 makes of it.
__device__ __forceinline__ int te_channel(int ks, int k) {
    const int tt = (k & 7) >> 1, e = k & 1, hi8 = k >> 3;
    return 8 * (tt * TE_WPT + (ks >> 1)) + 2 * (ks & 1) + hi8 + 4 * e;
}

// A word's 8 codes (nibbles n0..n7) as f16x2 pairs, exactly: p[i] = (n_i, n_{i+4}). The masked nibbles
// OR'd into 0x6400 (1024) are 1024 + n, or 1024 + 16 n for the high nibble of a byte; one f16x2
// subtraction or fused multiply-add (times 1/16, minus 64) leaves n. All values exact in f16.
__device__ __forceinline__ void te_word_f16x2(unsigned w, unsigned (&p)[4]) {
    const unsigned w8 = w >> 8;
    const unsigned v[4] = {(w & 0x000F000Fu) | 0x64006400u, (w & 0x00F000F0u) | 0x64006400u, (w8 & 0x000F000Fu) | 0x64006400u,
                           (w8 & 0x00F000F0u) | 0x64006400u};
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
        asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(p[i]) : "r"(v[i]), "r"(0x64006400u));
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(p[i + 1]) : "r"(v[i + 1]), "r"(0x2C002C00u), "r"(0xD400D400u));  // x / 16 - 64
    }
}

// A candidate row's TE_WPT code words of lane quad tt (zero when `row` < 0: no candidate there).
__device__ __forceinline__ void te_load_words(const unsigned char* codes, i64 row, int tt, unsigned (&w)[TE_WPT]) {
    if (row < 0) {
#pragma unroll
        for (int i = 0; i < TE_WPT; ++i) w[i] = 0u;
        return;
    }
    const unsigned* src = reinterpret_cast<const unsigned*>(codes + row * (HEAD_DIM / 2)) + tt * TE_WPT;
#if TE_WPT % 4 == 0
#pragma unroll
    for (int i = 0; i < TE_WPT; i += 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(src + i);
        w[i] = v.x, w[i + 1] = v.y, w[i + 2] = v.z, w[i + 3] = v.w;
    }
#elif TE_WPT % 2 == 0
#pragma unroll
    for (int i = 0; i < TE_WPT; i += 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(src + i);
        w[i] = v.x, w[i + 1] = v.y;
    }
#else
#pragma unroll
    for (int i = 0; i < TE_WPT; ++i) w[i] = src[i];
#endif
}

extern "C" __global__ void __launch_bounds__(TOPP_THREADS) kvs_topp_estimate_mma(TOPP_PARAMS, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale,
                                                                                const unsigned char* codes, const u16* qparams, float softcap) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ __align__(16) float qs[GROUP * HEAD_DIM];
    __shared__ float qsum[GROUP];
    __shared__ __align__(16) uint4 qb[TE_NT][TE_KS][32];  // B fragments per lane: hi b0, hi b1, lo b0, lo b1
    __shared__ int qe[TE_NT * 8];                         // 2^e per query row
    __shared__ float wmax[TOPP_THREADS / 32][GROUP];
    const ToppRow t = topp_row(b, blockIdx.z, blockIdx.y, hk, base, b_s, b_h, base_len, ulog2, maxc);
    if ((int)(blockIdx.x * etile) >= t.nc) return;  // also every row that is not a decode row
    const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = TOPP_THREADS / 32;
    if (blockIdx.x == 0) clear_row_search(t.row, hist, flags);
    load_q(q, q0, q1, q2, t.r.t, h, scale, qs, qsum);  // the CPU's scaled rows and their ordered sums
    for (int g = warp; g < TE_NT * 8; g += nw) {
        const int e = row_split_exponent<HEAD_DIM>(qs + g * HEAD_DIM, g < GROUP);
        if (lane == 0) qe[g] = e;
    }
    __syncthreads();
    // Lane l of k-step ks holds, for query row nt * 8 + l / 4, k = 2 (l % 4) + {0, 1} (b0) and + 8 (b1).
    for (int i = threadIdx.x; i < TE_NT * TE_KS * 32; i += blockDim.x) {
        const int l = i % 32, ks = (i / 32) % TE_KS, nt = i / (32 * TE_KS);
        const int g = nt * 8 + l / 4, k0 = 2 * (l % 4);
        uint4 frag = make_uint4(0u, 0u, 0u, 0u);
        if (g < GROUP) {
            const int e = qe[g];
            const float s1 = quest_pow2(e - e / 2), s2 = quest_pow2(e / 2);
            const float* row = qs + g * HEAD_DIM;
            const float v[4] = {row[te_channel(ks, k0)] * s1 * s2, row[te_channel(ks, k0 + 1)] * s1 * s2, row[te_channel(ks, k0 + 8)] * s1 * s2,
                                row[te_channel(ks, k0 + 9)] * s1 * s2};
            frag = split_b_fragment(v);
        }
        qb[nt][ks][l] = frag;
    }
    __syncthreads();
    float* out = logits + (i64)t.row * GROUP * maxc;
    const int qr = lane >> 2, tt = lane & 3;
    // 2^-e of this lane's query rows nt * 8 + 2 tt + e, as two exact factors (e in [-113, 163]).
    float sc1[TE_NT][2], sc2[TE_NT][2], mx[TE_NT][2];
#pragma unroll
    for (int nt = 0; nt < TE_NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int g = nt * 8 + 2 * tt + e, x = g < GROUP ? -qe[g] : 0;
            sc1[nt][e] = quest_pow2(x - x / 2);
            sc2[nt][e] = quest_pow2(x / 2);
            mx[nt][e] = -INFINITY;
        }
    // Each warp takes TE_MT * 16 candidates per round: rows qr and qr + 8 of each of its TE_MT tiles.
    for (int c0 = blockIdx.x * etile + warp * TE_MT * 16; c0 < min((int)(blockIdx.x + 1) * etile, t.nc); c0 += nw * TE_MT * 16) {
        i64 crow[TE_MT][2];
        float mn[TE_MT][2], scl[TE_MT][2];
        unsigned wd[TE_MT][2][TE_WPT];
#pragma unroll
        for (int m = 0; m < TE_MT; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int j = c0 + 16 * m + qr + 8 * r;
                crow[m][r] = j < t.nc ? topp_code_row(t, b, blockIdx.z, hk, h, j) : -1;
                mn[m][r] = crow[m][r] >= 0 ? kvs_f16_to_f32(qparams[2 * crow[m][r]]) : 0.f;
                scl[m][r] = crow[m][r] >= 0 ? kvs_f16_to_f32(qparams[2 * crow[m][r] + 1]) : 0.f;
                te_load_words(codes, crow[m][r], tt, wd[m][r]);
            }
        float acc[TE_MT][TE_NT][4];
#pragma unroll
        for (int m = 0; m < TE_MT; ++m)
#pragma unroll
            for (int nt = 0; nt < TE_NT; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[m][nt][c] = 0.f;
        // The k-steps accumulate in one chain per tile, hi then lo term of each.
#pragma unroll
        for (int jw = 0; jw < TE_WPT; ++jw) {
            unsigned pr[TE_MT][2][4];
#pragma unroll
            for (int m = 0; m < TE_MT; ++m)
#pragma unroll
                for (int r = 0; r < 2; ++r) te_word_f16x2(wd[m][r][jw], pr[m][r]);
#pragma unroll
            for (int odd = 0; odd < 2; ++odd) {
                const int ks = 2 * jw + odd;
#pragma unroll
                for (int nt = 0; nt < TE_NT; ++nt) {
                    const uint4 bq = qb[nt][ks][lane];
#pragma unroll
                    for (int m = 0; m < TE_MT; ++m) {
                        const unsigned a[4] = {pr[m][0][2 * odd], pr[m][1][2 * odd], pr[m][0][2 * odd + 1], pr[m][1][2 * odd + 1]};
                        quest_mma_f16(acc[m][nt], a, bq.x, bq.y);
                        quest_mma_f16(acc[m][nt], a, bq.z, bq.w);
                    }
                }
            }
        }
        // acc[m][nt][2 r + e]: candidate c0 + 16 m + qr + 8 r, query row nt * 8 + 2 tt + e.
#pragma unroll
        for (int m = 0; m < TE_MT; ++m)
#pragma unroll
            for (int nt = 0; nt < TE_NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int g = nt * 8 + 2 * tt + e;
                    if (g >= GROUP) continue;
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int j = c0 + 16 * m + qr + 8 * r;
                        if (j >= t.nc) continue;
                        float x = __int_as_float(0x7fffffff);  // outside the row: NaN, as kvs_topp_estimate
                        if (crow[m][r] >= 0) {
                            const float dot = acc[m][nt][2 * r + e] * sc1[nt][e] * sc2[nt][e];
                            x = kvs_decision_softcap(mn[m][r] * qsum[g] + scl[m][r] * dot, softcap);
                            mx[nt][e] = fmaxf(mx[nt][e], x);  // NaN ignored, as the CPU's fold with f32::max
                        }
                        out[(i64)g * maxc + j] = x;
                    }
                }
    }
    // Each query row's maximum: over the lanes of a quad position (same tt), then over the warps.
#pragma unroll
    for (int nt = 0; nt < TE_NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) mx[nt][e] = fmaxf(mx[nt][e], __shfl_xor_sync(0xffffffffu, mx[nt][e], o));
            const int g = nt * 8 + 2 * tt + e;
            if (lane < 4 && g < GROUP) wmax[warp][g] = mx[nt][e];
        }
    __syncthreads();
    if (threadIdx.x < GROUP) {
        float m = -INFINITY;
        for (int w = 0; w < nw; ++w) m = fmaxf(m, wmax[w][threadIdx.x]);
        tmax[((i64)t.row * ((maxc + etile - 1) / etile) + blockIdx.x) * GROUP + threadIdx.x] = m;
    }
}
#endif

// Adds v to the u64 at `p` in shared memory with two 32-bit atomics (native, where a 64-bit add on shared
// memory is a compare-and-swap loop that spins under contention): the low word's wrap, which the adder
// that causes it sees in the old value, carries into the high word. The sum is exact in any order.
__device__ __forceinline__ void shared_add_u64(unsigned long long* p, unsigned long long v) {
    unsigned* w = reinterpret_cast<unsigned*>(p);  // little-endian: w[0] the low word
    const unsigned lo = (unsigned)v, old = atomicAdd(&w[0], lo);
    const unsigned hi = (unsigned)(v >> 32) + (old + lo < old ? 1u : 0u);
    if (hi != 0u) atomicAdd(&w[1], hi);
}

// Adds each lane's `v` into mass[bin * GROUP + g] for its bin (256 = none), each lane its own shared atomics
// (integer sums: the masses do not depend on the order). Summing a bin's lanes first (a 64-bit butterfly per
// distinct bin, up to 4 bins) was slower on the H200: select 158 -> 143 µs at 1 x 128K, 585 -> 554 at
// 8 x 128K without it (journal 2026-11-28, twentieth session).
__device__ __forceinline__ void bin_add(unsigned long long* mass, unsigned bin, const float* v) {
    if (bin >= 256u) return;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) shared_add_u64(&mass[bin * GROUP + g], to_fixed(v[g]));
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

// A tile's 4 consecutive candidates j4..j4+3 of this thread (j4 < nc, so all four lie inside the row's
// maxc columns): logits of every row.
__device__ __forceinline__ void load4(const float* x, int maxc, int j4, float (&v)[4][GROUP]) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const float4 y = *reinterpret_cast<const float4*>(x + (i64)g * maxc + j4);
        v[0][g] = y.x;
        v[1][g] = y.y;
        v[2][g] = y.z;
        v[3][g] = y.w;
    }
}

// The weights of candidates j4..j4+3 (-1 from j4 = nc on: outside every row).
__device__ __forceinline__ void load_w4(const float* wr, int j4, int nc, float (&wv)[4]) {
    wv[0] = wv[1] = wv[2] = wv[3] = -1.f;
    if (j4 < nc) {
        const float4 v = *reinterpret_cast<const float4*>(wr + j4);
        wv[0] = v.x;
        wv[1] = v.y;
        wv[2] = v.z;
        wv[3] = v.w;
    }
}

// Adds a CTA's histogram into the row's global one (integer atomics: the sums do not depend on order).
__device__ __forceinline__ void flush_hist(const unsigned long long* mass, unsigned long long* out) {
    __syncthreads();
    for (int i = threadIdx.x; i < 256 * GROUP; i += blockDim.x)
        if (mass[i] != 0ull) atomicAdd(&out[i], mass[i]);
}

// The CTA's tile of the row: candidates [a0, a1), visited in chunks of TOPP_CHUNK (j4: this thread's
// first of 4 in the chunk at c0). Every thread runs the same number of chunks (warp collectives inside).
#define TOPP_TILE_PROLOGUE                                                                                 \
    const ToppRow t = topp_row(b, blockIdx.z, blockIdx.y, hk, base, b_s, b_h, base_len, ulog2, maxc); \
    const int tile = blockIdx.x;                                                                        \
    const int stiles = (maxc + TOPP_CHUNK - 1) / TOPP_CHUNK;                                            \
    const int span = TOPP_CHUNK * spt;                                                                  \
    const int nt = (t.nc + span - 1) / span;                                                            \
    const int a0 = tile * span, a1 = min(a0 + span, t.nc);                                              \
    const float* x = logits + (i64)t.row * GROUP * maxc;
#define TOPP_CHUNKS for (int c0 = a0, j4 = a0 + 4 * threadIdx.x; c0 < a1; c0 += TOPP_CHUNK, j4 += TOPP_CHUNK)

// Step 2: each tile's share of every row's normaliser, sum of fast_exp(x - max) in f64 (psum); tile 0 of a
// row stores the row's maximum (over the estimate tiles' maxima). Grid (tiles, KV heads, seqs).
extern "C" __global__ void __launch_bounds__(TOPP_THREADS) kvs_topp_norm(TOPP_PARAMS) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ float red_f[32];
    __shared__ double red_d[32];
    TOPP_TILE_PROLOGUE
    if (tile >= nt) return;
    const int etiles = (maxc + etile - 1) / etile, ne = (t.nc + etile - 1) / etile;
    float m[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        float v = -INFINITY;
        for (int e = threadIdx.x; e < ne; e += blockDim.x) v = fmaxf(v, tmax[((i64)t.row * etiles + e) * GROUP + g]);
        m[g] = block_max(v, red_f);
    }
    double z[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) z[g] = 0.0;
    TOPP_CHUNKS {
        if (j4 >= a1) continue;
        float v[4][GROUP];
        load4(x, maxc, j4, v);
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (t.valid(j4 + k))
#pragma unroll
                for (int g = 0; g < GROUP; ++g) z[g] += (double)kvs_fast_exp(v[k][g] - m[g]);
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const double zs = block_sum(z[g], red_d);
        if (threadIdx.x == 0) {
            psum[((i64)t.row * stiles + tile) * GROUP + g] = zs;
            if (tile == 0) rown[(i64)t.row * 2 * GROUP + g] = m[g];
        }
    }
}

// Step 3: the weights (each row's P = topp_weight(x), w = max over the rows; -1 outside the row) and the
// first radix pass (masses per top byte of w); a non-finite weight sets the row's flag. Tile 0 of a row
// stores 1/normaliser (the tiles' sums added in one fixed order, the same in every CTA of the row).
extern "C" __global__ void __launch_bounds__(TOPP_THREADS) kvs_topp_weights(TOPP_PARAMS) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ unsigned long long mass[256 * GROUP];
    __shared__ float m[GROUP], inv[GROUP];
    __shared__ double red_d[32];
    __shared__ int nonfinite;
    TOPP_TILE_PROLOGUE
    float* wr = w + (i64)t.row * maxc;  // the row's weights
    if (tile >= nt) return;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        double z = 0.0;
        for (int i = threadIdx.x; i < nt; i += blockDim.x) z += psum[((i64)t.row * stiles + i) * GROUP + g];
        z = block_sum(z, red_d);
        if (threadIdx.x == 0) {
            m[g] = rown[(i64)t.row * 2 * GROUP + g];
            inv[g] = z > 0.0 ? (float)(1.0 / z) : 1.0f;
            if (tile == 0) rown[(i64)t.row * 2 * GROUP + GROUP + g] = inv[g];
        }
    }
    if (threadIdx.x == 0) nonfinite = 0;
    for (int i = threadIdx.x; i < 256 * GROUP; i += blockDim.x) mass[i] = 0ull;
    __syncthreads();
    bool bad = false;
    TOPP_CHUNKS {
        float pv[4][GROUP] = {};
        float wv[4] = {-1.f, -1.f, -1.f, -1.f};  // outside the row: below every weight (w >= 0)
        if (j4 < a1) {
            load4(x, maxc, j4, pv);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const bool ok = t.valid(j4 + k);
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    const float y = ok ? topp_weight(pv[k][g], m[g], inv[g]) : 0.0f;
                    bad = bad || !isfinite(y);
                    if (ok) wv[k] = g == 0 ? y : fmaxf(wv[k], y);
                    pv[k][g] = y;
                }
            }
            *reinterpret_cast<float4*>(wr + j4) = make_float4(wv[0], wv[1], wv[2], wv[3]);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) bin_add(mass, wv[k] >= 0.0f ? (__float_as_uint(wv[k]) >> 24) : 256u, pv[k]);
    }
    if (bad) nonfinite = 1;
    flush_hist(mass, hist + (i64)t.row * TOPP_PASSES * 256 * GROUP);
    if (threadIdx.x == 0 && nonfinite) atomicOr(&flags[2 * t.row], 1);
}

// Steps 4-7 (pass = 1..4): every CTA of a row chooses digit pass-1 from the row's histogram of that pass
// and the state before it (pass 1 starts from the totals), tile 0 stores the new state; then passes 1..3
// build the histogram of the next byte among the candidates that match the threshold's bits so far, and
// pass 4 (the threshold T complete) summarises its tile: candidates above T, tied at T, and the tied mass.
// Rows that keep everything (p = 1, a non-finite weight) or have no candidate skip the search.
extern "C" __global__ void __launch_bounds__(TOPP_THREADS) kvs_topp_pass(TOPP_PARAMS, float p, int pass) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ unsigned long long mass[256 * GROUP];
    __shared__ unsigned long long above[GROUP];
    __shared__ double target[GROUP];
    __shared__ unsigned long long wsum[8][GROUP];
    __shared__ unsigned long long red_u[32];
    __shared__ float m[GROUP], inv[GROUP];
    __shared__ unsigned tsh;
    __shared__ int pick;
    TOPP_TILE_PROLOGUE
    const float* wr = w + (i64)t.row * maxc;  // the row's weights
    if (tile >= nt || t.nvalid() == 0 || p >= 1.0f || flags[2 * t.row] != 0) return;
    const unsigned long long* hr = hist + (i64)t.row * TOPP_PASSES * 256 * GROUP;
    for (int i = threadIdx.x; i < 256 * GROUP; i += blockDim.x) mass[i] = hr[(i64)(pass - 1) * 256 * GROUP + i];
    __syncthreads();
    TopPState* st = state + (i64)t.row * TOPP_STATES;
    if (pass == 1)
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {  // the row's total: every bin of the first pass
            const unsigned long long tot = block_sum(mass[threadIdx.x * GROUP + g], red_u);
            if (threadIdx.x == 0) {
                above[g] = 0ull;
                target[g] = (double)p * (double)tot;
            }
        }
    if (threadIdx.x < GROUP) {
        const int g = threadIdx.x;
        if (pass > 1) {
            above[g] = st[pass - 1].above[g];
            target[g] = st[pass - 1].target[g];
        }
        m[g] = rown[(i64)t.row * 2 * GROUP + g];
        inv[g] = rown[(i64)t.row * 2 * GROUP + GROUP + g];
    }
    if (threadIdx.x == 0) tsh = pass == 1 ? 0u : st[pass - 1].t;
    __syncthreads();
    const unsigned T = tsh | (choose_digit(mass, above, target, wsum, &pick) << (32 - 8 * pass));
    if (tile == 0) {
        if (threadIdx.x < GROUP) {
            st[pass].above[threadIdx.x] = above[threadIdx.x];
            st[pass].target[threadIdx.x] = target[threadIdx.x];
        }
        if (threadIdx.x == 0) st[pass].t = T;
    }
    const unsigned hmask = ~0u << (32 - 8 * pass);  // the bits chosen so far (all 32 at pass 4)
    const int shift = 24 - 8 * pass;                 // the next byte (passes 1..3)
    if (pass < TOPP_PASSES) {
        __syncthreads();  // choose_digit's last reads of mass
        for (int i = threadIdx.x; i < 256 * GROUP; i += blockDim.x) mass[i] = 0ull;
        __syncthreads();
    }
    unsigned long long gt = 0, ties = 0, tm[GROUP] = {};
    TOPP_CHUNKS {
        float wv[4];
        load_w4(wr, j4 < a1 ? j4 : t.nc, t.nc, wv);
        // Candidates whose weight matches T in the bits chosen so far, and their weights per row.
        bool in[4], any = false;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            in[k] = wv[k] >= 0.0f && (__float_as_uint(wv[k]) & hmask) == (T & hmask);
            any = any || in[k];
        }
        float pv[4][GROUP] = {};
        if (any) {
            load4(x, maxc, j4, pv);
#pragma unroll
            for (int k = 0; k < 4; ++k)
#pragma unroll
                for (int g = 0; g < GROUP; ++g) pv[k][g] = in[k] ? topp_weight(pv[k][g], m[g], inv[g]) : 0.0f;
        }
        if (pass < TOPP_PASSES) {
#pragma unroll
            for (int k = 0; k < 4; ++k) bin_add(mass, in[k] ? ((__float_as_uint(wv[k]) >> shift) & 255u) : 256u, pv[k]);
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                gt += wv[k] >= 0.0f && __float_as_uint(wv[k]) > T;
                ties += in[k];
#pragma unroll
                for (int g = 0; g < GROUP; ++g) tm[g] += in[k] ? to_fixed(pv[k][g]) : 0ull;
            }
        }
    }
    if (pass < TOPP_PASSES) {
        flush_hist(mass, hist + (i64)t.row * TOPP_PASSES * 256 * GROUP + (i64)pass * 256 * GROUP);
        return;
    }
    gt = block_sum(gt, red_u);
    ties = block_sum(ties, red_u);
    TopPTile* ts = tsum + (i64)t.row * stiles + tile;
    if (threadIdx.x == 0) {
        ts->gt = (unsigned)gt;
        ts->ties = (unsigned)ties;
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const unsigned long long v = block_sum(tm[g], red_u);
        if (threadIdx.x == 0) ts->mass[g] = v;
    }
}

// One chunk of the boundary tile's ties, in position order, 4 consecutive candidates per thread (tied[k] at
// position j4 + k; weight(k, g) its weight in row g, asked only of ties): a tie is kept while the mass before
// it does not yet reach every row's target (acc: the mass before the chunk, advanced past it here); kb counts
// this thread's kept ties, jcut (shared) the last kept position. Block-wide.
template <typename Weight>
__device__ __forceinline__ void cut_tied_chunk(const bool (&tied)[4], Weight weight, int j4, unsigned long long* acc, const double* target,
                                               unsigned long long* scan_tmp, int& kb, int* jcut) {
    unsigned long long mk[4][GROUP], before[GROUP];
    bool reach_before[4] = {true, true, true, true};
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        unsigned long long own = 0, tot;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            mk[k][g] = tied[k] ? to_fixed(weight(k, g)) : 0ull;
            own += mk[k][g];
        }
        const unsigned long long incl = block_incl_scan(own, scan_tmp, &tot);  // its barriers order acc's update
        before[g] = acc[g] + incl - own;
        __syncthreads();  // every thread has read acc[g]
        if (threadIdx.x == 0) acc[g] += tot;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            reach_before[k] = reach_before[k] && (double)before[g] >= target[g];
            before[g] += mk[k][g];
        }
        if (tied[k] && !reach_before[k]) {
            kb += 1;
            atomicMax(jcut, j4 + k);
        }
    }
}

// A row's plan length and its counters but the plan's blocks and bytes (one thread).
__device__ __forceinline__ void row_done(const Batch& b, const ToppRow& t, int n, int* plan_len, i64 meta_row_bytes, unsigned long long* ctr) {
    plan_len[t.row] = n;
    if (t.r.hi >= t.r.lo) {
        atomicAdd(&ctr[CTR_POLICY_ROWS], 1ull);
        atomicAdd(&ctr[CTR_BLOCKS_ELIGIBLE], (unsigned long long)((t.r.hi >> b.bs_log2) - (t.r.lo >> b.bs_log2) + 1));
    }
    atomicAdd(&ctr[CTR_TOP_P_CANDIDATES], t.nvalid());
    atomicAdd(&ctr[CTR_TOP_P_KEPT], (unsigned long long)n);
    atomicAdd(&ctr[CTR_KV_BYTES], t.nvalid() * (unsigned long long)meta_row_bytes);
}

// Step 8: the kept positions, increasing, as the plan (at most cap), and the counters. The tied candidates
// are taken in increasing position while the mass before them does not yet reach every row's target (as
// top_p::select's finish), so the kept ties are those up to one position, jcut: tiles before the boundary
// tile (the first whose tied mass makes the rows reach) keep all their ties, tiles after it none, the
// boundary tile those up to jcut (a block scan of its tied masses, chunk by chunk; every CTA of the row
// recomputes it). Each CTA writes its kept candidates after those of the tiles before it; the last CTA of
// a row to finish counts the plan's blocks and bytes.
extern "C" __global__ void __launch_bounds__(TOPP_THREADS) kvs_topp_write(TOPP_PARAMS, float p, unsigned* plan, i64 p_s, i64 p_h, int* plan_len, int cap,
                                                                         i64 row_bytes, i64 meta_row_bytes, unsigned long long* ctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ unsigned long long red_u[32];
    __shared__ unsigned long long scan_tmp[TOPP_THREADS / 32];
    __shared__ unsigned long long acc[GROUP];
    __shared__ double target[GROUP];
    __shared__ float m[GROUP], inv[GROUP];
    __shared__ int cnt[TOPP_THREADS / 32 + 1];
    __shared__ int bnd, jcut, kept_b, off, total, last;
    TOPP_TILE_PROLOGUE
    const float* wr = w + (i64)t.row * maxc;  // the row's weights
    const int ntw = max(1, nt);               // a row without candidates still has its tile 0
    if (tile >= ntw) return;
    unsigned* e = plan + blockIdx.z * p_s + blockIdx.y * p_h;
    if (!t.r.decode) {
        if (tile == 0 && threadIdx.x == 0) plan_len[t.row] = -1;
        return;
    }
    const bool keep_all = p >= 1.0f || (t.nc > 0 && flags[2 * t.row] != 0);
    const bool search = !keep_all && t.nvalid() > 0;
    const TopPState* st = state + (i64)t.row * TOPP_STATES + TOPP_PASSES;
    const unsigned T = search ? st->t : 0u;
    const TopPTile* ts = tsum + (i64)t.row * stiles;
    // Kept candidates of tile i, given the boundary tile's count kb.
    auto valid_in = [&](int i) {
        const int lo = max(i * span, t.ja), hi = min((i + 1) * span - 1, t.jb);
        return hi >= lo ? hi - lo + 1 : 0;
    };
    auto kept_in = [&](int i, int bt, int kb) -> int {
        if (!search) return keep_all ? valid_in(i) : 0;
        return (int)ts[i].gt + (i < bt ? (int)ts[i].ties : i == bt ? kb : 0);
    };
    // The boundary tile: the first whose tied mass, after the mass above T and the ties of the tiles
    // before it, makes every row reach (a block scan over the tiles, blockDim at a time).
    if (threadIdx.x == 0) {
        bnd = ntw;  // none: every tie kept (cannot happen when the search ran; kept for safety)
        jcut = -1;
        kept_b = 0;
    }
    if (threadIdx.x < GROUP && search) {
        const int g = threadIdx.x;
        acc[g] = st->above[g];
        target[g] = st->target[g];
        m[g] = rown[(i64)t.row * 2 * GROUP + g];
        inv[g] = rown[(i64)t.row * 2 * GROUP + GROUP + g];
    }
    __syncthreads();
    if (search) {
        for (int i0 = 0; i0 < nt; i0 += blockDim.x) {
            const int i = i0 + threadIdx.x;
            bool reach = i < nt;
            unsigned long long own[GROUP], incl[GROUP], tot[GROUP];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                own[g] = i < nt ? ts[i].mass[g] : 0ull;
                incl[g] = block_incl_scan(own[g], scan_tmp, &tot[g]);
                reach = reach && (double)(acc[g] + incl[g]) >= target[g];
            }
            if (reach) atomicMin(&bnd, i);
            __syncthreads();
            if (bnd != ntw) {  // uniform; acc becomes the mass before the boundary tile
                if (i == bnd)
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) acc[g] += incl[g] - own[g];
                break;
            }
            if (threadIdx.x == 0)
#pragma unroll
                for (int g = 0; g < GROUP; ++g) acc[g] += tot[g];
            __syncthreads();
        }
    }
    __syncthreads();
    const int bt = bnd;
    // The boundary tile's cut: a tie is kept while the mass before it does not reach every row's target.
    if (search && bt < nt) {
        int kb = 0;
        for (int c0 = bt * span, jb4 = c0 + 4 * threadIdx.x; c0 < min((bt + 1) * span, t.nc); c0 += TOPP_CHUNK, jb4 += TOPP_CHUNK) {
            float wv[4];
            load_w4(wr, jb4, t.nc, wv);
            bool tied[4], any = false;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                tied[k] = wv[k] >= 0.0f && __float_as_uint(wv[k]) == T;
                any = any || tied[k];
            }
            float pv[4][GROUP] = {};
            if (any) load4(x, maxc, jb4, pv);
            cut_tied_chunk(tied, [&](int k, int g) { return topp_weight(pv[k][g], m[g], inv[g]); }, jb4, acc, target, scan_tmp, kb, &jcut);
        }
        kb = (int)block_sum((unsigned long long)kb, red_u);
        if (threadIdx.x == 0) kept_b = kb;
    }
    __syncthreads();
    {
        unsigned long long o = 0, all = 0;
        for (int i = threadIdx.x; i < ntw; i += blockDim.x) {
            const unsigned long long k = (unsigned long long)kept_in(i, bt, kept_b);
            o += i < tile ? k : 0ull;
            all += k;
        }
        o = block_sum(o, red_u);
        all = block_sum(all, red_u);
        if (threadIdx.x == 0) {
            off = (int)o;
            total = (int)all;
        }
    }
    __syncthreads();
    const int n = min(total, cap), jc = jcut;
    if (off < cap) {
        auto keep = [&](int i) {
            const int j = a0 + i;
            if (!t.valid(j)) return false;
            if (!search) return keep_all;
            const unsigned k = __float_as_uint(wr[j]);
            return k > T || (k == T && (tile < bt || (tile == bt && j <= jc)));
        };
        compact(max(0, a1 - a0), keep, [&](int i) { return (unsigned)t.pos(a0 + i); }, e + off, cap - off, cnt);
    }
    if (tile == 0 && threadIdx.x == 0) {
        row_done(b, t, n, plan_len, meta_row_bytes, ctr);
    }
    // The plan complete (every CTA of the row has written its part): the last one counts it.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = ntw == 1 || atomicAdd(&flags[2 * t.row + 1], 1) == ntw - 1;
    __syncthreads();
    if (last) {
        __threadfence();
        account(e, n, 0, t.r.lo, t.r.hi, b.bs_log2, 1, row_bytes, ctr, red_u);
    }
}

// Steps 2-8 in one launch (Hopper, sm_90; the launcher's choice while the rows' clusters fit in one wave of
// one CTA per SM): a thread-block cluster of QC_CTAS CTAs per (KV head, sequence) holds the row's estimated
// logits in shared memory (CTA `rank` the candidates rank * per <= j < (rank + 1) * per, per = the row's
// candidates / QC_CTAS rounded up to 4), and the launches that were the barriers between the tiled kernels'
// steps become cluster barriers: the normaliser (each CTA's f64 share, summed over the ranks in order), the
// weights and the four radix passes (a pass's masses per bin summed over the cluster through distributed
// shared memory, two alternating buffers), the summaries (a CTA is a tile), the boundary CTA's cut of the
// ties and the write (each CTA's kept positions after those of the CTAs before it). The same set as the
// tiled kernels: the same weights, digits and tie rule; only the normaliser's order of summation differs (as
// it does between two tilings). Dynamic shared memory: 3 x 256 x GROUP u64 (two pass buffers, the merged
// pass) and (GROUP + 1) x per f32 (the weights per query row, their maximum), src/policy/top_p/cuda.rs
// `cluster_smem`. Grid (hk * QC_CTAS, seqs), TOPP_CL_THREADS threads.
// Threads per CTA (src/policy/top_p/cuda.rs CLUSTER_THREADS). H200, 2026-11-28, with Quest(L/4) before it:
// 256 / 512 / 1,024 threads, select 105 / 94 / 109 us at 1 x 32K, 210 / 171 / 167 us at 1 x 128K.
#define TOPP_CL_THREADS 512
extern "C" __global__ void QC_CLUSTER_DIMS __launch_bounds__(TOPP_CL_THREADS, 1)
    kvs_topp_cluster(Batch b, int hk, const unsigned* base, i64 b_s, i64 b_h, const int* base_len, int ulog2, int maxc, const float* logits,
                     const float* tmax, int etile, float p, unsigned* plan, i64 p_s, i64 p_h, int* plan_len, int cap, i64 row_bytes,
                     i64 meta_row_bytes, unsigned long long* ctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
#if KVS_CLUSTERS
    static_assert(TOPP_CL_THREADS >= 256 && TOPP_CL_THREADS % 32 == 0 && QC_CTAS <= 32, "a pass needs a thread per bin; the peers are one warp's lanes");
    extern __shared__ __align__(16) unsigned long long tpc_dyn[];
    __shared__ double xz[GROUP];              // read by the cluster: this CTA's share of each row's normaliser
    __shared__ unsigned long long xm[GROUP];  // read by the cluster: this CTA's mass tied at T, per row
    __shared__ unsigned xc[4];                // read by the cluster: above T, tied at T, a non-finite weight, ties kept
    __shared__ unsigned xcut;                 // read by the cluster: the boundary CTA's last kept tie
    __shared__ unsigned long long pm[QC_CTAS][GROUP];
    __shared__ unsigned pk[QC_CTAS][2];
    __shared__ float m[GROUP], inv[GROUP];
    __shared__ unsigned long long above[GROUP], acc[GROUP];
    __shared__ double target[GROUP];
    __shared__ unsigned long long wsum[8][GROUP];
    __shared__ unsigned long long red_u[32], scan_tmp[TOPP_CL_THREADS / 32];
    __shared__ double red_d[32];
    __shared__ float red_f[32];
    __shared__ int cnt[TOPP_CL_THREADS / 32 + 1];
    __shared__ int pick, bnd, jcut, bad_any, kb_all, jc_all;
    const unsigned rank = cluster_rank();
    const int h = blockIdx.x / QC_CTAS, s = blockIdx.y;
    const ToppRow t = topp_row(b, s, h, hk, base, b_s, b_h, base_len, ulog2, maxc);
    if (!t.r.decode) {  // the whole cluster holds this row: every CTA leaves here
        if (rank == 0 && threadIdx.x == 0) plan_len[t.row] = -1;
        return;
    }
    unsigned* e = plan + s * p_s + h * p_h;
    const int per = ((t.nc + QC_CTAS - 1) / QC_CTAS + 3) & ~3;
    const int a0 = min((int)rank * per, t.nc), a1 = min(a0 + per, t.nc), len = a1 - a0;
    unsigned long long* hx = tpc_dyn;                         // [2][256 * GROUP]: this CTA's masses of a pass
    unsigned long long* mass = hx + 2 * 256 * GROUP;          // [256 * GROUP]: the cluster's
    float* P = reinterpret_cast<float*>(mass + 256 * GROUP);  // [GROUP][per]: logits, then weights
    float* W = P + GROUP * per;                               // [per]: the aggregated weight, -1 outside the row
    const float* x = logits + (i64)t.row * GROUP * maxc;
    // The row's maxima (over the estimate tiles'), this CTA's logits staged, its share of the normalisers.
    const int etiles = (maxc + etile - 1) / etile, ne = (t.nc + etile - 1) / etile;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        float v = -INFINITY;
        for (int i = threadIdx.x; i < ne; i += blockDim.x) v = fmaxf(v, tmax[((i64)t.row * etiles + i) * GROUP + g]);
        v = block_max(v, red_f);
        if (threadIdx.x == 0) m[g] = v;
    }
    __syncthreads();
    double z[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) z[g] = 0.0;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        const bool ok = t.valid(a0 + i);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float v = x[(i64)g * maxc + a0 + i];
            P[g * per + i] = v;
            if (ok) z[g] += (double)kvs_fast_exp(v - m[g]);
        }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const double zs = block_sum(z[g], red_d);
        if (threadIdx.x == 0) xz[g] = zs;
    }
    for (int i = threadIdx.x; i < 256 * GROUP; i += blockDim.x) hx[i] = 0ull;  // the first pass's buffer
    cluster_sync();
    if (threadIdx.x < GROUP) {
        double zt = 0.0;
        for (int q = 0; q < QC_CTAS; ++q) zt += ld_cluster_f64(&xz[threadIdx.x], q);
        inv[threadIdx.x] = zt > 0.0 ? (float)(1.0 / zt) : 1.0f;
    }
    __syncthreads();
    // The weights (P per query row, W their maximum) and the first pass's masses per top byte of W.
    bool bad = false;
    for (int i0 = 0; i0 < len; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        const bool in = i < len, ok = in && t.valid(a0 + i);
        float pv[GROUP], wv = -1.f;
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float y = ok ? topp_weight(P[g * per + i], m[g], inv[g]) : 0.0f;
            bad = bad || !isfinite(y);
            if (ok) wv = g == 0 ? y : fmaxf(wv, y);
            pv[g] = y;
            if (in) P[g * per + i] = y;
        }
        if (in) W[i] = wv;
        bin_add(hx, wv >= 0.0f ? (__float_as_uint(wv) >> 24) : 256u, pv);
    }
    const int bad_mine = __syncthreads_or(bad);
    if (threadIdx.x == 0) xc[2] = (unsigned)bad_mine;
    // A pass's masses summed over the cluster's CTAs (in rank order: integers, exact in any order).
    auto merge = [&](const unsigned long long* part) {
        cluster_sync();
        for (int i = threadIdx.x; i < 256 * GROUP; i += blockDim.x) {
            unsigned long long v = 0ull;
#pragma unroll
            for (int q = 0; q < QC_CTAS; ++q) v += ld_cluster_u64(&part[i], q);
            mass[i] = v;
        }
        __syncthreads();
    };
    merge(hx);
    if (threadIdx.x == 0) {
        unsigned any = 0u;
        for (int q = 0; q < QC_CTAS; ++q) any |= ld_cluster(&xc[2], q);
        bad_any = (int)any;
    }
    __syncthreads();
    const bool keep_all = p >= 1.0f || (t.nc > 0 && bad_any != 0);
    const bool search = !keep_all && t.nvalid() > 0;
    // The radix search: digit `pass` from the cluster's masses, then the next byte's masses among the
    // candidates matching the threshold's bits so far (into the buffer the cluster read two passes ago).
    unsigned T = 0u;
    if (search) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {  // the row's total: every bin of the first pass
            const unsigned long long tot = block_sum(threadIdx.x < 256 ? mass[threadIdx.x * GROUP + g] : 0ull, red_u);
            if (threadIdx.x == 0) {
                above[g] = 0ull;
                target[g] = (double)p * (double)tot;
            }
        }
        __syncthreads();
        for (int pass = 1;; ++pass) {
            T |= choose_digit(mass, above, target, wsum, &pick) << (32 - 8 * pass);
            if (pass == TOPP_PASSES) break;
            const unsigned hmask = ~0u << (32 - 8 * pass);
            const int shift = 24 - 8 * pass;
            unsigned long long* part = hx + (pass & 1) * 256 * GROUP;
            for (int i = threadIdx.x; i < 256 * GROUP; i += blockDim.x) part[i] = 0ull;
            __syncthreads();
            for (int i0 = 0; i0 < len; i0 += blockDim.x) {
                const int i = i0 + threadIdx.x;
                const float wv = i < len ? W[i] : -1.f;
                const bool in = wv >= 0.0f && (__float_as_uint(wv) & hmask) == (T & hmask);
                float pv[GROUP];
#pragma unroll
                for (int g = 0; g < GROUP; ++g) pv[g] = in ? P[g * per + i] : 0.0f;
                bin_add(part, in ? ((__float_as_uint(wv) >> shift) & 255u) : 256u, pv);
            }
            merge(part);
        }
    }
    // This CTA's summary at T (above it, tied, the tied mass per row), then the boundary CTA: the first
    // whose tied mass, after the mass above T and the ties of the CTAs before it, makes every row reach.
    unsigned long long gt = 0, ties = 0, tm[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) tm[g] = 0ull;
    if (search)
        for (int i = threadIdx.x; i < len; i += blockDim.x) {
            const float wv = W[i];
            if (!(wv >= 0.0f)) continue;
            const unsigned k = __float_as_uint(wv);
            gt += k > T;
            if (k == T) {
                ties += 1;
#pragma unroll
                for (int g = 0; g < GROUP; ++g) tm[g] += to_fixed(P[g * per + i]);
            }
        }
    gt = block_sum(gt, red_u);
    ties = block_sum(ties, red_u);
    if (threadIdx.x == 0) {
        xc[0] = (unsigned)gt;
        xc[1] = (unsigned)ties;
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const unsigned long long v = block_sum(tm[g], red_u);
        if (threadIdx.x == 0) xm[g] = v;
    }
    cluster_sync();
    if (threadIdx.x < QC_CTAS) {
        const unsigned q = threadIdx.x;
        pk[q][0] = ld_cluster(&xc[0], q);
        pk[q][1] = ld_cluster(&xc[1], q);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) pm[q][g] = ld_cluster_u64(&xm[g], q);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        bnd = QC_CTAS;  // none: every tie kept (cannot happen when the search ran; kept for safety)
        jcut = -1;
        if (search) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) acc[g] = above[g];
            for (int q = 0; q < QC_CTAS; ++q) {
                bool reach = true;
#pragma unroll
                for (int g = 0; g < GROUP; ++g) reach = reach && (double)(acc[g] + pm[q][g]) >= target[g];
                if (reach) {
                    bnd = q;
                    break;
                }
#pragma unroll
                for (int g = 0; g < GROUP; ++g) acc[g] += pm[q][g];
            }
        }
    }
    __syncthreads();
    const int bt = bnd;
    // The boundary CTA's cut: a tie is kept while the mass before it does not reach every row's target
    // (its ties in increasing position, 4 x TOPP_CL_THREADS at a time, a block scan of their masses).
    if (search && (int)rank == bt) {
        int kb = 0;
        for (int c0 = 0; c0 < len; c0 += 4 * TOPP_CL_THREADS) {
            const int i4 = c0 + 4 * threadIdx.x;
            bool tied[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) tied[k] = i4 + k < len && W[i4 + k] >= 0.0f && __float_as_uint(W[i4 + k]) == T;
            cut_tied_chunk(tied, [&](int k, int g) { return P[g * per + i4 + k]; }, a0 + i4, acc, target, scan_tmp, kb, &jcut);
        }
        kb = (int)block_sum((unsigned long long)kb, red_u);
        if (threadIdx.x == 0) {
            xc[3] = (unsigned)kb;
            xcut = (unsigned)jcut;
        }
    }
    cluster_sync();
    if (threadIdx.x == 0) {
        kb_all = bt < QC_CTAS ? (int)ld_cluster(&xc[3], bt) : 0;
        jc_all = bt < QC_CTAS ? (int)ld_cluster(&xcut, bt) : -1;
    }
    __syncthreads();
    // Kept candidates of CTA q; this CTA's place in the plan.
    auto kept_in = [&](int q) -> int {
        if (!search) {
            if (!keep_all) return 0;
            const int qa = min(q * per, t.nc), qz = min(qa + per, t.nc), lo = max(qa, t.ja), hi = min(qz - 1, t.jb);
            return hi >= lo ? hi - lo + 1 : 0;
        }
        return (int)pk[q][0] + (q < bt ? (int)pk[q][1] : q == bt ? kb_all : 0);
    };
    int off = 0, total = 0;
    for (int q = 0; q < QC_CTAS; ++q) {
        const int k = kept_in(q);
        off += q < (int)rank ? k : 0;
        total += k;
    }
    const int n = min(total, cap), jc = jc_all;
    if (off < cap) {
        auto keep = [&](int i) {
            const int j = a0 + i;
            if (!t.valid(j)) return false;
            if (!search) return keep_all;
            const unsigned k = __float_as_uint(W[i]);
            return k > T || (k == T && ((int)rank < bt || ((int)rank == bt && j <= jc)));
        };
        compact(len, keep, [&](int i) { return (unsigned)t.pos(a0 + i); }, e + off, cap - off, cnt);
    }
    if (rank == 0 && threadIdx.x == 0) {
        row_done(b, t, n, plan_len, meta_row_bytes, ctr);
    }
    // The whole plan written (and no CTA leaves while another may read its shared memory): each CTA counts
    // its entries, the one before its first (another CTA's) read through L2.
    cluster_sync();
    const int j0 = min(off, n), j1 = min(off + kept_in((int)rank), n);
    account_entries([&](int j) { return (i64)__ldcg(e + j); }, j0, j1, 0, t.r.lo, t.r.hi, b.bs_log2, 1, row_bytes, ctr, red_u);
#else
    __trap();  // launched only on sm_90 and newer
#endif
}
