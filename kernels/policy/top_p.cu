// Top-p's (Twilight) selection kernels (src/policy/top_p/cuda.rs launches them): INT4 estimates of the
// base plan's candidates, then the shortest prefix by weight reaching mass p. Moved from select.cu; the
// conventions of a plan, the trust rules and the counters are select.cu's (see its header).
//
// Compile-time parameters: KVS_DTYPE, HEAD_DIM, GROUP (query heads per KV head).

#include "common.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"

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
