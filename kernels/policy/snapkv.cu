// SnapKV on the device: the choice at a prefill chunk and the decode plan that reads it. The choice's
// weights come from tensor cores where the cache allows (kvs_snap_lse_mma, kvs_snap_weights_mma below:
// agreement with the CPU engine's choice within a stated margin, docs/policies.md), otherwise from the
// scalar phases of kvs_snap_scores in the CPU's arithmetic (src/policy/snapkv/cpu.rs; decide.cuh,
// --fmad=false), which equal the CPU's choice bit for bit; over an FP8 cache (KV8) always the latter,
// reading each key as the CPU does (decoded, times k_scale: kv_load.cuh). Its batch, reduction and top-k helpers and its
// scoring arithmetic are headers in kernels/include/.
//
// Where the choice lives: with the cache, not with a sequence id. The layer's metadata holds one bit per
// (block, KV head, slot) (`keep[num_blocks][hk][4]` u64, kernels/meta.cu): every slot starts kept, a cache
// write sets its slot's bit, and the choice rewrites the bits of every position below the sequence's
// length. A decode row visits the positions of its visible range whose bit is set, and always its own.
// That is the CPU's `keep ∪ [prefill_len, len)` for every row written through kvs_cache_write, with no
// per-sequence state on the device (a captured step's sequence ids live on the device, so a slot table
// would need a device-side map). Blocks shared by sequences (prefix caching) share the bits: the last
// chunk that chose rewrites them (the CPU keeps one choice per sequence).
//
// The choice, for each prefill sequence (q_len > 1) longer than the budget, per KV head (scalar path;
// the tensor-core path replaces the three phases by two kernels, see below):
//   kvs_snap_scores phase 0: each observation row's largest logit (the chunk's tokens at positions
//       >= len - window, times the GROUP query heads; order-key atomicMax, NaN skipped as f32::max does);
//   phase 1: each row's softmax normaliser, an exact fixed-point sum (math::softmax_norm: atomics in any
//       order give the same bits), NaN flagged;
//   phase 2: per prefix position j < len - window and query head, the weights e / z summed over the
//       window in token order, then the max over the group: agg[j];
//   kvs_snap_choose: max-pool agg over `pool` positions, the radix top-k of the pooled scores (ties: the
//       earlier position), and the bits of positions [0, len). A sequence within the budget keeps all.
// Logits are recomputed in each phase (K is read three times; prefill only) rather than stored: the
// window's rows times the context would not fit a workspace at long contexts.

#include "common.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"
#include "weights_pass.cuh"
// kv_load.cuh: the scalar phases read FP8 keys (KV8) as the CPU does, decoded times k_scale.
#include "kv_load.cuh"
// mma.cuh: the tensor-core choice below (f16/bf16 caches).
#include "mma.cuh"


// The observation window of prefill sequence s: tokens [t0, t0 + n) of q at positions [pos0, pos0 + n).
struct SnapSeq {
    int prefill;  // q_len > 1, with consistent metadata
    int len, obs_start, t0, n, pos0;
};

__device__ __forceinline__ SnapSeq snap_seq(const Batch& b, int s, int window) {
    const SeqRow r = seq_row(b, s);
    SnapSeq o;
    o.len = r.hi + 1;
    o.obs_start = max(o.len - window, 0);
    o.n = min(r.q_len, o.len - o.obs_start);
    o.t0 = r.t + r.q_len - o.n;
    o.pos0 = o.len - o.n;
    o.prefill = r.q_len > 1 && o.len > 0 && o.n > 0 && o.t0 >= 0 && o.t0 + o.n <= b.num_tokens;
    return o;
}

// The first position a query at `pos` sees (the sliding window's start, or 0).
__device__ __forceinline__ int snap_lo(const Batch& b, int pos) { return (b.window > 0 && pos + 1 - b.window > 0) ? pos + 1 - b.window : 0; }


// Grid (position tiles of WP_TP, KV heads, seqs). Per (seq, head), rows r = token * GROUP + query head:
// rmax[r] (order keys, preset to the key of -inf), zfix[r] (preset 0), zbad[r] (preset 0), rcap rows each;
// agg[maxpos] per (seq, head). kscale: an FP8 cache's k_scale (unused otherwise).
extern "C" __global__ void __launch_bounds__(WP_THREADS) kvs_snap_scores(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, float softcap,
                                                                           const kv_t* kc, i64 kc0, i64 kc1, i64 kc2, int hk, int budget, int window,
                                                                           int phase, unsigned* rmax, unsigned long long* zfix, unsigned* zbad, int rcap,
                                                                           float* agg, int maxpos, float kscale) {
    __shared__ __align__(16) float ks[WP_TP][WP_KS_PITCH];  // 16-byte rows, conflict-free float4 reads (wp_dot)
    __shared__ __align__(16) float qs[GROUP * HEAD_DIM];
    __shared__ float accs[GROUP][WP_TP];
    const int s = blockIdx.z, h = blockIdx.y;
    const SnapSeq o = snap_seq(b, s, window);
    if (!o.prefill || o.len <= budget || o.n > rcap / GROUP) return;
    const int pend = phase == 2 ? min(o.obs_start, maxpos) : o.len;
    const int p0 = blockIdx.x * WP_TP;
    if (p0 >= pend) return;
    const int bs = 1 << b.bs_log2;
    for (int i = threadIdx.x; i < WP_TP * HEAD_DIM; i += blockDim.x) {
        const int p = i / HEAD_DIM, c = i % HEAD_DIM, pos = p0 + p;
        float v = 0.0f;
        if (pos < pend) {
            const i64 blk = phys_block(b, s, pos >> b.bs_log2);
            if (blk >= 0) v = kv_ld(kc[blk * kc0 + (i64)(pos & (bs - 1)) * kc1 + (i64)h * kc2 + c], kscale);
        }
        ks[p][c] = v;
    }
    const int p = threadIdx.x % WP_TP, j = threadIdx.x / WP_TP, pos = p0 + p;
    const i64 rows = (i64)(s * hk + h) * rcap;
    float acc[WP_KPER];
#pragma unroll
    for (int k = 0; k < WP_KPER; ++k) acc[k] = 0.0f;
    for (int tt = 0; tt < o.n; ++tt) {
        const int tpos = o.pos0 + tt;
        const int lo = snap_lo(b, tpos);
        __syncthreads();  // the previous token's queries are no longer read (and the K tile is staged)
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
            const int r = i / HEAD_DIM, c = i % HEAD_DIM;
            qs[i] = ET::ld(q[(i64)(o.t0 + tt) * q0 + (i64)(h * GROUP + r) * q1 + (i64)c * q2]) * scale;
        }
        __syncthreads();
        const bool vis = pos >= lo && pos <= tpos && pos < pend;
#pragma unroll
        for (int k = 0; k < WP_KPER; ++k) {
            const int gi = j + WP_J * k;
            const bool row_ok = gi < GROUP;
            const i64 r = rows + tt * GROUP + (row_ok ? gi : 0);
            float l = -INFINITY;
            if (vis && row_ok) l = kvs_decision_softcap(wp_dot(qs + gi * HEAD_DIM, ks[p]), softcap);
            if (phase == 0) {
                wp_row_max(l, p == 0 && row_ok, &rmax[r]);
                continue;
            }
            const float m = row_ok ? wp_unkey(rmax[r]) : -INFINITY;
            const float e = vis && m > -INFINITY ? kvs_fast_exp(l - m) : 0.0f;
            if (phase == 1) {
                wp_row_sum(e, p == 0 && row_ok && m > -INFINITY, &zfix[r], &zbad[r]);
            } else if (row_ok && m > -INFINITY) {
                // As the CPU: every prefix position of a row that saw something adds e / z (0 where the
                // row does not see it; NaN everywhere when the normaliser is NaN).
                const double z = zbad[r] ? (double)__int_as_float(0x7fffffff) : (double)zfix[r] / WP_NORM_ONE;
                acc[k] += (float)((double)e / z);
            }
        }
    }
    if (phase != 2) return;
#pragma unroll
    for (int k = 0; k < WP_KPER; ++k)
        if (j + WP_J * k < GROUP) accs[j + WP_J * k][p] = acc[k];
    __syncthreads();
    if (j == 0 && pos < pend) {
        float a = 0.0f;
        for (int g = 0; g < GROUP; ++g) a = fmaxf(a, accs[g][p]);
        agg[(i64)(s * hk + h) * maxpos + pos] = a;
    }
}

#if (KVS_DTYPE == 1 || KVS_DTYPE == 2) && HEAD_DIM % 16 == 0 && HEAD_DIM <= 128 && !KV8
// The choice's weights on tensor cores (f16/bf16 caches, head sizes up to 128 in multiples of 16;
// src/policy/snapkv/cuda.rs picks these kernels where K rows are 16-byte aligned, the scalar phases above
// otherwise and over FP8 caches). Two passes over K instead of three:
//   kvs_snap_lse_mma: each observation row's base-2 (max, sum) over the keys of one split of SNM_SPLIT
//       positions (many CTAs per row: one per split, so a long prompt's window rows use the whole GPU);
//   kvs_snap_lse_merge: the splits merged in split order into each row's log-sum-exp (NaN when a visible
//       logit is not finite), written over `rmax` as f32 bits;
//   kvs_snap_weights_mma: per prefix position, the weights 2^(l - lse) summed over the window per query
//       head, then the max over the group (from 0, NaN dropped, as the CPU): agg[pos].
// Logits: mma.sync m16n8k16 of the stored f16/bf16 query and key rows (exact products, f32 accumulation),
// times scale * log2 e (or the softcap's tanhf), as the attention kernels compute them. Every sum runs in
// a fixed order (no atomics), so the same inputs give the same bits on the same device. Rows are ordered
// head-major in the kernels, rr = g * SNM_NP + t (SNM_NP = the window's tokens rounded up to 16), so every
// block of 16 rows belongs to one query head; the statistics are stored per row t * GROUP + g (`rcap`).

#define SNM_ROWB (HEAD_DIM * 2 + 16)  // padded shared-memory row (bytes): ldmatrix without bank conflicts
#define SNM_CPR (HEAD_DIM / 8)        // 16-byte chunks per row
#define SNM_KSTEPS (HEAD_DIM / 16)
#define SNM_THREADS 128               // 4 warps
#define SNM_LBN 64                    // lse pass: keys per tile (16 per warp)
#define SNM_LROWS 32                  // lse pass: rows per CTA (two blocks of 16)
#define SNM_WKEYS 32                  // weights pass: keys per warp
#define SNM_CW (4 * SNM_WKEYS)        // weights pass: positions per CTA
#define SNM_QR 32                     // weights pass: rows staged at a time
#define SNM_SPLIT 2048                // lse pass: positions per split (a multiple of SNM_LBN; the host's LSE_SPLIT)

__device__ __forceinline__ int snm_np(int rcap) { return ((rcap / GROUP) + 15) & ~15; }

// Stages `nrows` rows of the window's queries, kernel rows rr0.. (zeros for t >= n), into shared memory.
__device__ __forceinline__ void snm_stage_q(unsigned char* dst, const elem_t* q, i64 q0, i64 q1, i64 q2, const SnapSeq& o, int h, int np, int rr0, int nrows) {
    for (int i = threadIdx.x; i < nrows * HEAD_DIM; i += blockDim.x) {
        const int m = i / HEAD_DIM, c = i % HEAD_DIM, rr = rr0 + m, g = rr / np, t = rr % np;
        elem_t v = ET::st(0.0f);
        if (g < GROUP && t < o.n) v = q[(i64)(o.t0 + t) * q0 + (i64)(h * GROUP + g) * q1 + (i64)c * q2];
        *reinterpret_cast<elem_t*>(dst + m * SNM_ROWB + c * 2) = v;
    }
}

// Issues the cp.async of K rows [p0, p0 + nk) of (s, h) into `dst` (zeros past `pend` or for a bad block id).
__device__ __forceinline__ void snm_load_k(unsigned dst, const Batch& b, int s, const elem_t* kc, i64 kc0, i64 kc1, i64 kc2, int h, int p0, int nk, int pend) {
    const int bmask = (1 << b.bs_log2) - 1;
    for (int c = threadIdx.x; c < nk * SNM_CPR; c += blockDim.x) {
        const int kr = c / SNM_CPR, cc = c % SNM_CPR, p = p0 + kr;
        i64 blk = -1;
        if (p < pend) blk = phys_block(b, s, p >> b.bs_log2);
        const elem_t* src = blk >= 0 ? kc + blk * kc0 + (i64)(p & bmask) * kc1 + (i64)h * kc2 + cc * 8 : kc;
        cp_async16(dst + kr * SNM_ROWB + cc * 16, src, blk >= 0 ? 16 : 0);
    }
    cp_commit();
}

// The logit (base 2) of a raw score, as the attention kernels compute it.
__device__ __forceinline__ float snm_logit2(float x, float scale, float softcap) {
    return softcap > 0.f ? softcap * tanhf(x * scale / softcap) * KVS_LOG2E : x * (scale * KVS_LOG2E);
}

// Grid (ceil(GROUP * SNM_NP / SNM_LROWS) * nsplit, KV heads, seqs): CTA x serves rows (x / nsplit) * 32 ..
// over the positions [sp * SNM_SPLIT, (sp + 1) * SNM_SPLIT) of split sp = x % nsplit (the last split: to the
// end). Every warp serves the CTA's 32 rows over its 16 keys of each 64-key tile (two-stage cp.async ring);
// the warps' (max, sum) are merged in warp order into part[row][sp] (max NaN: a visible logit was not
// finite; (-inf, 0): no visible key in the split).
extern "C" __global__ void __launch_bounds__(SNM_THREADS) kvs_snap_lse_mma(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, float softcap,
                                                                           const elem_t* kc, i64 kc0, i64 kc1, i64 kc2, int hk, int budget, int window,
                                                                           float2* part, int nsplit, int rcap) {
    __shared__ __align__(16) unsigned char sq[SNM_LROWS * SNM_ROWB];
    __shared__ __align__(16) unsigned char sk[2][SNM_LBN * SNM_ROWB];
    __shared__ float part_m[4][SNM_LROWS], part_l[4][SNM_LROWS];
    __shared__ int part_bad[4][SNM_LROWS];
    const int s = blockIdx.z, h = blockIdx.y;
    const SnapSeq o = snap_seq(b, s, window);
    if (!o.prefill || o.len <= budget || o.n > rcap / GROUP) return;
    const int np = snm_np(rcap), sp = blockIdx.x % nsplit, rr0 = (blockIdx.x / nsplit) * SNM_LROWS;
    if (rr0 >= GROUP * np) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, qd = lane & 3;
    // This lane's rows (block mb, half hf): active when t < n; each sees [lo, tpos].
    int rlo[2][2], rhi[2][2];
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int rr = rr0 + mb * 16 + r + hf * 8, g = rr / np, t = rr % np;
            const int tpos = o.pos0 + t;
            const bool act = g < GROUP && t < o.n;
            rlo[mb][hf] = act ? snap_lo(b, tpos) : 0x7fffffff;
            rhi[mb][hf] = act ? tpos : -1;
        }
    // The CTA's key range: the union of its active rows' ranges (the same in every thread).
    int klo = 0x7fffffff, khi = -1;
    for (int i = 0; i < SNM_LROWS; ++i) {
        const int rr = rr0 + i, t = rr % np;
        if (rr / np < GROUP && t < o.n) {
            klo = min(klo, snap_lo(b, o.pos0 + t));
            khi = max(khi, o.pos0 + t);
        }
    }
    snm_stage_q(sq, q, q0, q1, q2, o, h, np, rr0, SNM_LROWS);
    // This split's tiles: 64-key tiles from a multiple of 64, so the splits' tiles never overlap.
    const int tb0 = max(khi >= 0 ? (klo & ~(SNM_LBN - 1)) : 0, sp * SNM_SPLIT);
    const int ke = sp == nsplit - 1 ? khi + 1 : min(khi + 1, (sp + 1) * SNM_SPLIT);
    const int ntiles = khi >= 0 && tb0 < ke ? (ke - 1 - tb0) / SNM_LBN + 1 : 0;
    const unsigned sq_a = smem_u32(sq), sk_a = smem_u32(sk[0]);
    const unsigned qoff = (lane & 15) * SNM_ROWB + (lane >> 4) * 16;
    const unsigned koff = ((lane & 7) + ((lane >> 4) << 3)) * SNM_ROWB + ((lane >> 3) & 1) * 16;
    float mrow[2][2], lrow[2][2];
    bool bad[2][2];
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            mrow[mb][hf] = -INFINITY;
            lrow[mb][hf] = 0.f;
            bad[mb][hf] = false;
        }
    if (ntiles > 0) snm_load_k(sk_a, b, s, kc, kc0, kc1, kc2, h, tb0, SNM_LBN, o.len);
    for (int k = 0; k < ntiles; ++k) {
        if (k + 1 < ntiles) {
            snm_load_k(sk_a + ((k + 1) & 1) * SNM_LBN * SNM_ROWB, b, s, kc, kc0, kc1, kc2, h, tb0 + (k + 1) * SNM_LBN, SNM_LBN, o.len);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();  // tile k (and, the first time, the queries) is in
        const unsigned kb = sk_a + (k & 1) * SNM_LBN * SNM_ROWB + warp * 16 * SNM_ROWB;
        const int pb = tb0 + k * SNM_LBN + warp * 16;  // this warp's first key
        float sc[2][2][4];
#pragma unroll
        for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int n = 0; n < 2; ++n) sc[mb][n][0] = sc[mb][n][1] = sc[mb][n][2] = sc[mb][n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < SNM_KSTEPS; ++ks) {
            unsigned bk[4];
            ldsm_x4(bk, kb + koff + ks * 32);
#pragma unroll
            for (int mb = 0; mb < 2; ++mb) {
                unsigned a[4];
                ldsm_x4(a, sq_a + mb * 16 * SNM_ROWB + qoff + ks * 32);
                mma16816(sc[mb][0], a[0], a[1], a[2], a[3], bk[0], bk[1]);
                mma16816(sc[mb][1], a[0], a[1], a[2], a[3], bk[2], bk[3]);
            }
        }
        __syncthreads();  // every warp is done with this stage before the next load refills it
#pragma unroll
        for (int mb = 0; mb < 2; ++mb)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float x[4];
                float mx = -INFINITY;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int n = i >> 1, e = 2 * hf + (i & 1);
                    const int kp = pb + n * 8 + qd * 2 + (i & 1);
                    const bool vis = kp >= rlo[mb][hf] && kp <= rhi[mb][hf];
                    const float raw = sc[mb][n][e];
                    if (vis && !isfinite(raw)) bad[mb][hf] = true;
                    x[i] = vis ? snm_logit2(raw, scale, softcap) : -INFINITY;
                    mx = fmaxf(mx, x[i]);
                }
                const float mn = fmaxf(mrow[mb][hf], mx);
                if (mn == -INFINITY) continue;
                float sum = lrow[mb][hf] * exp2f(mrow[mb][hf] - mn);
#pragma unroll
                for (int i = 0; i < 4; ++i) sum += exp2f(x[i] - mn);
                mrow[mb][hf] = mn;
                lrow[mb][hf] = sum;
            }
    }
    // Merge: the quad's lanes, then the warps in order.
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float m = mrow[mb][hf], l = lrow[mb][hf];
            int bd = bad[mb][hf];
#pragma unroll
            for (int off = 1; off < 4; off <<= 1) {
                const float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
                bd |= __shfl_xor_sync(0xffffffffu, bd, off);
                const float mn = fmaxf(m, m2);
                l = mn == -INFINITY ? 0.f : l * exp2f(m - mn) + l2 * exp2f(m2 - mn);
                m = mn;
            }
            if (qd == 0) {
                const int row = mb * 16 + r + hf * 8;
                part_m[warp][row] = m;
                part_l[warp][row] = l;
                part_bad[warp][row] = bd;
            }
        }
    __syncthreads();
    if (threadIdx.x < SNM_LROWS && rr0 + (int)threadIdx.x < GROUP * np) {
        const int rr = rr0 + threadIdx.x;
        float m = -INFINITY;
        int bd = 0;
        for (int w = 0; w < 4; ++w) {
            m = fmaxf(m, part_m[w][threadIdx.x]);
            bd |= part_bad[w][threadIdx.x];
        }
        float l = 0.f;
        if (m > -INFINITY)
            for (int w = 0; w < 4; ++w) l += part_l[w][threadIdx.x] * exp2f(part_m[w][threadIdx.x] - m);
        part[((i64)(s * hk + h) * (GROUP * np) + rr) * nsplit + sp] = make_float2(bd ? __int_as_float(0x7fffffff) : m, l);
    }
}

// Grid (ceil(GROUP * SNM_NP / 128), KV heads, seqs), 128 threads: row rr's log-sum-exp from its nsplit
// parts, merged in split order (the same bits whatever order the split CTAs ran in), NaN if a part is.
extern "C" __global__ void __launch_bounds__(128) kvs_snap_lse_merge(Batch b, int hk, int budget, int window, const float2* part, int nsplit, float* lse,
                                                                     int rcap) {
    const int s = blockIdx.z, h = blockIdx.y;
    const SnapSeq o = snap_seq(b, s, window);
    if (!o.prefill || o.len <= budget || o.n > rcap / GROUP) return;
    const int np = snm_np(rcap), rr = blockIdx.x * 128 + threadIdx.x, g = rr / np, t = rr % np;
    if (g >= GROUP || t >= o.n) return;
    const float2* p = part + ((i64)(s * hk + h) * (GROUP * np) + rr) * nsplit;
    float m = -INFINITY;
    bool bad = false;
    for (int i = 0; i < nsplit; ++i) {
        const float x = p[i].x;
        bad = bad || isnan(x);
        m = fmaxf(m, x);
    }
    float l = 0.f;
    if (!bad && m > -INFINITY)
        for (int i = 0; i < nsplit; ++i) l += p[i].y * exp2f(p[i].x - m);
    lse[(i64)(s * hk + h) * rcap + t * GROUP + g] = bad ? __int_as_float(0x7fffffff) : (m > -INFINITY ? m + log2f(l) : -INFINITY);
}

// Grid (ceil(maxpos / SNM_CW), KV heads, seqs). The CTA's positions stay in shared memory while the
// window's rows pass by SNM_QR at a time; warp w owns positions [w * 32, w * 32 + 32) of them and keeps,
// per lane, the running sum of the current query head and the max over the heads done.
extern "C" __global__ void __launch_bounds__(SNM_THREADS) kvs_snap_weights_mma(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, float softcap,
                                                                               const elem_t* kc, i64 kc0, i64 kc1, i64 kc2, int hk, int budget, int window,
                                                                               const float* lse, int rcap, float* agg, int maxpos) {
    __shared__ __align__(16) unsigned char sk[SNM_CW * SNM_ROWB];
    __shared__ __align__(16) unsigned char sq[SNM_QR * SNM_ROWB];
    const int s = blockIdx.z, h = blockIdx.y;
    const SnapSeq o = snap_seq(b, s, window);
    if (!o.prefill || o.len <= budget || o.n > rcap / GROUP) return;
    const int pend = min(o.obs_start, maxpos);
    const int p0 = blockIdx.x * SNM_CW;
    if (p0 >= pend) return;
    const int np = snm_np(rcap);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, qd = lane & 3;
    const unsigned sk_a = smem_u32(sk), sq_a = smem_u32(sq);
    snm_load_k(sk_a, b, s, kc, kc0, kc1, kc2, h, p0, SNM_CW, pend);
    const unsigned qoff = (lane & 15) * SNM_ROWB + (lane >> 4) * 16;
    const unsigned koff = ((lane & 7) + ((lane >> 4) << 3)) * SNM_ROWB + ((lane >> 3) & 1) * 16;
    const unsigned kb = sk_a + warp * SNM_WKEYS * SNM_ROWB;
    const int pb = p0 + warp * SNM_WKEYS;
    const i64 rows = (i64)(s * hk + h) * rcap;
    float acc[4][2], best[4][2];
#pragma unroll
    for (int n = 0; n < 4; ++n) acc[n][0] = acc[n][1] = best[n][0] = best[n][1] = 0.f;
    // The head's sums over the window (the 8 row lanes added), then the max over the heads.
    auto flush = [&]() {
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float v = acc[n][j];
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                best[n][j] = fmaxf(best[n][j], v);  // fmaxf drops NaN, as f32::max
                acc[n][j] = 0.f;
            }
    };
    int cur = 0;  // the query head acc holds
    for (int rc = 0; rc < GROUP * np; rc += SNM_QR) {
        // Blocks of 16 rows that hold window tokens: a query head below GROUP (the last SNM_QR rows may run
        // past GROUP * np when it is an odd multiple of 16) and a token below n.
        auto live = [&](int rb) { return rb / np < GROUP && rb % np < o.n; };
        bool any = false;
#pragma unroll
        for (int mb = 0; mb < SNM_QR / 16; ++mb) any = any || live(rc + mb * 16);
        if (!any) continue;
        __syncthreads();  // the previous rows are no longer read
        snm_stage_q(sq, q, q0, q1, q2, o, h, np, rc, SNM_QR);
        cp_wait<0>();
        __syncthreads();
#pragma unroll
        for (int mb = 0; mb < SNM_QR / 16; ++mb) {
            const int rb = rc + mb * 16, g = rb / np, tb = rb % np;
            if (!live(rb)) continue;  // uniform over the CTA
            if (g != cur) {
                flush();
                cur = g;
            }
            float sc[4][4];
#pragma unroll
            for (int n = 0; n < 4; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < SNM_KSTEPS; ++ks) {
                unsigned a[4];
                ldsm_x4(a, sq_a + mb * 16 * SNM_ROWB + qoff + ks * 32);
#pragma unroll
                for (int kk = 0; kk < 2; ++kk) {
                    unsigned bk[4];
                    ldsm_x4(bk, kb + kk * 16 * SNM_ROWB + koff + ks * 32);
                    mma16816(sc[2 * kk], a[0], a[1], a[2], a[3], bk[0], bk[1]);
                    mma16816(sc[2 * kk + 1], a[0], a[1], a[2], a[3], bk[2], bk[3]);
                }
            }
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int t = tb + r + hf * 8;
                if (t >= o.n) continue;
                const int tpos = o.pos0 + t;
                const int lo = snap_lo(b, tpos);
                const float L = lse[rows + t * GROUP + g];
                if (L == -INFINITY) continue;  // the row sees nothing
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const int kp = pb + n * 8 + qd * 2 + j;
                        const bool vis = kp >= lo && kp <= tpos && kp < pend;
                        // As the CPU: a row whose normaliser is NaN adds NaN at every prefix position.
                        const float w = isnan(L) ? L : (vis ? exp2f(snm_logit2(sc[n][2 * hf + j], scale, softcap) - L) : 0.f);
                        acc[n][j] += w;
                    }
            }
        }
    }
    flush();
    if (r == 0)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int kp = pb + n * 8 + qd * 2 + j;
                if (kp < pend) agg[(i64)(s * hk + h) * maxpos + kp] = best[n][j];
            }
}
#endif

// One CTA per (KV head, prefill sequence): pooled scores, the top k_prefix = budget - window positions of
// the prefix, and the kept bits of positions [0, len). `pooled` [maxpos] per (seq, head) is scratch.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) kvs_snap_choose(Batch b, int hk, int budget, int window, int pool, int rcap,
                                                                           const float* agg, float* pooled, int maxpos, unsigned long long* keep) {
    __shared__ unsigned hist[256];
    __shared__ unsigned wtot[8];
    __shared__ unsigned long long sel_prefix;
    __shared__ int sel_left;
    const int s = blockIdx.y, h = blockIdx.x;
    const SnapSeq o = snap_seq(b, s, window);
    if (!o.prefill || o.n > rcap / GROUP) return;
    const bool all = o.len <= budget;
    const int n = all ? 0 : min(o.obs_start, maxpos);
    const int k = all ? 0 : max(budget - (o.len - o.obs_start), 0);
    const float* ag = agg + (i64)(s * hk + h) * maxpos;
    float* pl = pooled + (i64)(s * hk + h) * maxpos;
    const int rad = pool / 2;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = -INFINITY;
        for (int x = max(i - rad, 0); x < min(i + rad + 1, n); ++x) v = fmaxf(v, ag[x]);
        pl[i] = v;
    }
    __syncthreads();
    int ibits = 1;
    while ((1 << ibits) < n) ++ibits;
    // Larger key = kept first: higher pooled score, then the earlier position.
    auto key_of = [&](int i) { return ((unsigned long long)kvs_order_key(pl[i]) << ibits) | (unsigned)(n - 1 - i); };
    const int m = n > k ? k : 0;
    const unsigned long long thr = radix_kth(0, n, m, (32 + ibits + 7) / 8, key_of, hist, wtot, sel_prefix, sel_left);
    auto kept = [&](int pos) {
        if (all || pos >= o.obs_start || n <= k) return true;
        return m > 0 && pos < n && key_of(pos) >= thr;
    };
    const int bsz = 1 << b.bs_log2, words = (bsz + 63) / 64;
    const int nlb = (o.len + bsz - 1) >> b.bs_log2;
    for (int i = threadIdx.x; i < nlb * words; i += blockDim.x) {
        const int lb = i / words, w = i % words;
        const i64 blk = phys_block(b, s, lb);
        if (blk < 0) continue;
        unsigned long long mask = 0ull, bits = 0ull;
        for (int x = 0; x < 64 && w * 64 + x < bsz; ++x) {
            const int pos = lb * bsz + w * 64 + x;
            if (pos >= o.len) break;
            mask |= 1ull << x;
            if (kept(pos)) bits |= 1ull << x;
        }
        unsigned long long* word = keep + (blk * hk + h) * 4 + w;
        *word = (*word & ~mask) | bits;
    }
}

// The decode plan (one CTA per (KV head, sequence)): the visible positions whose bit is set, and the row's
// own, as tokens in increasing order. Compacted a chunk at a time (min(block, 64) positions: one keep
// word, or the part of it one block holds), so a 128K row is a few passes of popcounts and one scan each.
// CTA (0, 0) also counts the call's rows.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) kvs_plan_snap(Batch b, int hk, const unsigned long long* keep, unsigned* plan, i64 p_s,
                                                                         i64 p_h, int* plan_len, int cap, i64 row_bytes, int count,
                                                                         unsigned long long* ctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ int wsum[TOPK_THREADS / 32];
    __shared__ int total;
    __shared__ unsigned long long red[32];
    const int s = blockIdx.y, h = blockIdx.x;
    if (s == 0 && h == 0) rows_count(b, hk, row_bytes, ctr, red);
    const SeqRow r = seq_row(b, s);
    if (!r.decode) {
        if (threadIdx.x == 0) plan_len[s * hk + h] = -1;
        return;
    }
    if (r.hi < r.lo) {
        if (threadIdx.x == 0) plan_len[s * hk + h] = 0;
        return;
    }
    unsigned* e = plan + s * p_s + h * p_h;
    const int bsz = 1 << b.bs_log2, C = bsz < 64 ? bsz : 64;
    const int c0 = r.lo / C, c1 = r.hi / C;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int base = 0;
    for (int cb = c0; cb <= c1; cb += blockDim.x) {  // uniform trip count
        const int c = cb + threadIdx.x;
        const int p0 = c * C;
        unsigned long long bits = 0ull;
        if (c <= c1) {
            const i64 blk = phys_block(b, s, p0 >> b.bs_log2);
            if (blk >= 0) {
                bits = keep[(blk * hk + h) * 4 + (p0 & (bsz - 1)) / 64];
                if (C < 64) bits &= (1ull << C) - 1ull;
            }
            if (p0 < r.lo) bits &= ~0ull << (r.lo - p0);
            if (r.hi - p0 < 63) bits &= (1ull << (r.hi - p0 + 1)) - 1ull;
            if (r.hi < p0 + C) bits |= 1ull << (r.hi - p0);
        }
        const int n = __popcll(bits);
        int incl = n;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) wsum[warp] = incl;
        __syncthreads();
        int before = base + incl - n;
        for (int w = 0; w < warp; ++w) before += wsum[w];
        if (threadIdx.x == 0) {
            int t = 0;
            for (int w = 0; w < nw; ++w) t += wsum[w];
            total = t;
        }
        for (unsigned long long rest = bits; rest; rest &= rest - 1ull) {
            if (before < cap) e[before] = (unsigned)(p0 + __ffsll((long long)rest) - 1);
            ++before;
        }
        __syncthreads();
        base += total;
        __syncthreads();
    }
    const int n = base < cap ? base : cap;
    if (threadIdx.x == 0) plan_len[s * hk + h] = n;
    if (!count) return;  // a later stage (top-p) makes the final plan and counts it
    if (threadIdx.x == 0) {
        atomicAdd(&ctr[CTR_POLICY_ROWS], 1ull);
        atomicAdd(&ctr[CTR_BLOCKS_ELIGIBLE], (unsigned long long)((r.hi >> b.bs_log2) - (r.lo >> b.bs_log2) + 1));
    }
    __syncthreads();  // the plan's entries are read back by account
    account(e, n, 0, r.lo, r.hi, b.bs_log2, 1, row_bytes, ctr, red);
}
