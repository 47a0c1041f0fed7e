// SnapKV on the device: the choice at a prefill chunk and the decode plan that reads it, the same
// decisions as the CPU engine (src/cpu/snapkv.rs, src/cpu/sparse/mod.rs) in the same arithmetic
// (decide.cuh, --fmad=false). Its batch, reduction and top-k helpers and its scoring arithmetic are
// headers in kernels/include/.
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
// The choice, for each prefill sequence (q_len > 1) longer than the budget, per KV head:
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
#include "snap_score.cuh"


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


// Grid (position tiles of SNAP_TP, KV heads, seqs). Per (seq, head), rows r = token * GROUP + query head:
// rmax[r] (order keys, preset to the key of -inf), zfix[r] (preset 0), zbad[r] (preset 0), rcap rows each;
// agg[maxpos] per (seq, head).
extern "C" __global__ void __launch_bounds__(SNAP_THREADS) kvs_snap_scores(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, float softcap,
                                                                           const elem_t* kc, i64 kc0, i64 kc1, i64 kc2, int hk, int budget, int window,
                                                                           int phase, unsigned* rmax, unsigned long long* zfix, unsigned* zbad, int rcap,
                                                                           float* agg, int maxpos) {
    __shared__ float ks[SNAP_TP][HEAD_DIM + 1];
    __shared__ float qs[GROUP * HEAD_DIM];
    __shared__ float accs[GROUP][SNAP_TP];
    const int s = blockIdx.z, h = blockIdx.y;
    const SnapSeq o = snap_seq(b, s, window);
    if (!o.prefill || o.len <= budget || o.n > rcap / GROUP) return;
    const int pend = phase == 2 ? min(o.obs_start, maxpos) : o.len;
    const int p0 = blockIdx.x * SNAP_TP;
    if (p0 >= pend) return;
    const int bs = 1 << b.bs_log2;
    for (int i = threadIdx.x; i < SNAP_TP * HEAD_DIM; i += blockDim.x) {
        const int p = i / HEAD_DIM, c = i % HEAD_DIM, pos = p0 + p;
        float v = 0.0f;
        if (pos < pend) {
            const i64 blk = phys_block(b, s, pos >> b.bs_log2);
            if (blk >= 0) v = ET::ld(kc[blk * kc0 + (i64)(pos & (bs - 1)) * kc1 + (i64)h * kc2 + c]);
        }
        ks[p][c] = v;
    }
    const int p = threadIdx.x % SNAP_TP, j = threadIdx.x / SNAP_TP, pos = p0 + p;
    const i64 rows = (i64)(s * hk + h) * rcap;
    float acc[SNAP_KPER];
#pragma unroll
    for (int k = 0; k < SNAP_KPER; ++k) acc[k] = 0.0f;
    for (int tt = 0; tt < o.n; ++tt) {
        const int tpos = o.pos0 + tt;
        const int lo = (b.window > 0 && tpos + 1 - b.window > 0) ? tpos + 1 - b.window : 0;
        __syncthreads();  // the previous token's queries are no longer read (and the K tile is staged)
        for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
            const int r = i / HEAD_DIM, c = i % HEAD_DIM;
            qs[i] = ET::ld(q[(i64)(o.t0 + tt) * q0 + (i64)(h * GROUP + r) * q1 + (i64)c * q2]) * scale;
        }
        __syncthreads();
        const bool vis = pos >= lo && pos <= tpos && pos < pend;
#pragma unroll
        for (int k = 0; k < SNAP_KPER; ++k) {
            const int gi = j + SNAP_J * k;
            const bool row_ok = gi < GROUP;
            const i64 r = rows + tt * GROUP + (row_ok ? gi : 0);
            float l = -INFINITY;
            if (vis && row_ok) l = kvs_decision_softcap(snap_dot(qs + gi * HEAD_DIM, ks[p]), softcap);
            if (phase == 0) {
                float m = l;  // fmaxf drops NaN, as f32::max
#pragma unroll
                for (int off = SNAP_TP / 2; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
                if (p == 0 && row_ok && m > -INFINITY) atomicMax(&rmax[r], kvs_order_key(m));
                continue;
            }
            const float m = row_ok ? snap_unkey(rmax[r]) : -INFINITY;
            const float e = vis && m > -INFINITY ? kvs_fast_exp(l - m) : 0.0f;
            if (phase == 1) {
                unsigned long long x = isnan(e) ? 0ull : (unsigned long long)((double)e * SNAP_NORM_ONE);
                unsigned bad = isnan(e) ? 1u : 0u;
#pragma unroll
                for (int off = SNAP_TP / 2; off > 0; off >>= 1) {
                    x += __shfl_xor_sync(0xffffffffu, x, off);
                    bad |= __shfl_xor_sync(0xffffffffu, bad, off);
                }
                if (p == 0 && row_ok && m > -INFINITY) {
                    if (x != 0ull) atomicAdd(&zfix[r], x);
                    if (bad) atomicOr(&zbad[r], 1u);
                }
            } else if (row_ok && m > -INFINITY) {
                // As the CPU: every prefix position of a row that saw something adds e / z (0 where the
                // row does not see it; NaN everywhere when the normaliser is NaN).
                const double z = zbad[r] ? (double)__int_as_float(0x7fffffff) : (double)zfix[r] / SNAP_NORM_ONE;
                acc[k] += (float)((double)e / z);
            }
        }
    }
    if (phase != 2) return;
#pragma unroll
    for (int k = 0; k < SNAP_KPER; ++k)
        if (j + SNAP_J * k < GROUP) accs[j + SNAP_J * k][p] = acc[k];
    __syncthreads();
    if (j == 0 && pos < pend) {
        float a = 0.0f;
        for (int g = 0; g < GROUP; ++g) a = fmaxf(a, accs[g][p]);
        agg[(i64)(s * hk + h) * maxpos + pos] = a;
    }
}

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
