// PRR (predict, speculate, repair; src/policy/speculate.rs, src/cpu/sparse/stateful.rs) on the device.
// Batch geometry, top-k, compaction and Quest's row top-k come from kernels/include/.
//
// State: one PrrEntry per (cache block, KV head, page slot) in the layer's PRR buffer (src/cuda/prr.rs),
// spb = block_size / min(page, block_size) slots per block. A page no larger than a block lives in slot
// (offset in block) / page of its block; a page larger than a block lives in slot 0 of its first block
// (whose slot 0 is the page's first token). The cache write resets an entry when the first slot of its
// page is written (kvs_prr_reset), so a block that a new sequence reuses starts with no state: level NaN =
// never scored (predicted +inf), as a page the CPU's PrrHead has not seen. Sequences that share prefix
// blocks share those pages' state (as SnapKV's kept bits).
//
// A decode step (src/cuda/prr.rs): caller's stream: Quest scores, Quest top-k (the truth), [event T],
// [join A], kvs_prr_repair (missed = truth \ pred, union = pred + missed, counters), attention over the
// missed pages, [join B], kvs_prr_merge. Side stream, after the fork: kvs_prr_pred_scores and
// kvs_prr_predict (the speculative set), [A], attention over the predicted pages, [wait T],
// kvs_prr_update (Holt update with the true scores), [B].

#include "common.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"
#include "page_bounds.cuh"
#include "kv_load.cuh"

#define PRR_PARAMS 1u  // the entry carries its sequence's Holt parameters
#define PRR_PREV 2u    // the page was in the previous step's true set (for the reuse-previous counter)

struct __align__(8) PrrEntry {  // 24 bytes, 8-aligned: read and written as three float2 words
    float level, trend, alpha, beta, gamma;
    unsigned flags;
};

// Entry of page pg of sequence s, KV head h, or null (no block there).
__device__ __forceinline__ PrrEntry* prr_entry(const Batch& b, int s, int h, int hk, int pg, int page, int spb, PrrEntry* st) {
    const i64 pos = (i64)pg * page;
    const i64 pb = phys_block(b, s, (int)(pos >> b.bs_log2));
    if (pb < 0) return 0;
    const int j = spb > 1 ? (int)((pos & ((1 << b.bs_log2) - 1)) / page) : 0;
    return st + ((pb * hk + h) * spb + j);
}

// Whether sorted list e[0..n) holds v.
__device__ __forceinline__ bool prr_contains(const unsigned* e, int n, unsigned v) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (e[mid] < v) lo = mid + 1; else hi = mid;
    }
    return lo < n && e[lo] == v;
}

// Entries of sorted list e[0..n) below v.
__device__ __forceinline__ int prr_rank(const unsigned* e, int n, unsigned v) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (e[mid] < v) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Cache write: resets the entry of every written slot that starts a page (or, for pages larger than a
// block, a block: only a page's first block holds state, the others' entries are unused).
extern "C" __global__ void kvs_prr_reset(const void* slots, i64 s0, int slots_i64, int n, i64 num_blocks, int bs, int hk, int page_eff,
                                         PrrEntry* st) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    const int spb = bs / page_eff;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (i64)n * hk; i += (i64)gridDim.x * blockDim.x) {
        const int r = (int)(i / hk), h = (int)(i % hk);
        const i64 slot = slots_i64 ? ((const i64*)slots)[r * s0] : (i64)((const int*)slots)[r * s0];
        if (slot < 0 || slot >= num_blocks * bs) continue;
        const i64 blk = slot / bs;
        const int off = (int)(slot % bs);
        if (off % page_eff != 0) continue;
        PrrEntry* e = st + (blk * hk + h) * spb + off / page_eff;
        e->level = __int_as_float(0x7fffffff);
        e->trend = 0.f;
        e->flags = 0u;
    }
}

// Top-k of one row's scores sc[0..np) (pages fp ..): the last page and the best k - 1 others (ties: the
// later page), as quest_pages(scores, first, k, 1, 0), i.e. kvs_quest_topk with no sink. Block-wide.
__device__ __forceinline__ int prr_top_pages(const float* sc, const unsigned* skey, bool staged, int np, int fp, int k, unsigned* e, int cap,
                                             unsigned* hist, unsigned* sel, int* cnt) {
    if (np <= k) {
        const int n = min(np, cap);
        for (int i = threadIdx.x; i < n; i += blockDim.x) e[i] = fp + i;
        return n;
    }
    const int last = np - 1;
    const int m = min(k - 1, last);
    auto key_of = [&](int i) { return staged ? skey[i] : kvs_order_key(sc[i]); };
    TopCut tc{0u, last};
    if (m > 0) tc = topk32(0, last, m, key_of, hist, cnt, sel);
    auto keep = [&](int i) {
        if (i == last) return true;
        if (m == 0) return false;
        const unsigned kk = key_of(i);
        return kk > tc.thr || (kk == tc.thr && i >= tc.cut);
    };
    return compact(np, keep, [&](int i) { return (unsigned)(fp + i); }, e, cap, cnt);
}

// Side stream, step 1: the predicted score of every page of every decode row, level + gamma * trend with
// the entry's own gamma (every entry of a row that has been scored carries the row's parameters: the
// calibration and every update write them to all of the row's pages), +inf for a page never scored.
// Grid (page tiles of 256, KV heads, sequences).
extern "C" __global__ void kvs_prr_pred_scores(Batch b, int hk, int page, const PrrEntry* st, int spb, float* pred, int maxp) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    const int s = blockIdx.z, h = blockIdx.y, row = s * hk + h;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) return;
    const int fp = r.lo / page;
    const int np = min(r.hi / page - fp + 1, maxp);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= np) return;
    const PrrEntry* x = prr_entry(b, s, h, hk, fp + i, page, spb, const_cast<PrrEntry*>(st));
    float v = INFINITY;
    if (x != 0 && !isnan(x->level)) v = x->level + x->gamma * x->trend;
    pred[(i64)row * maxp + i] = v;
}

// Side stream, step 2 (one CTA per (KV head, sequence)): the row's Holt parameters (those of the lowest
// page of the row whose entry carries them, else the spec's fixed ones (fa, fb, fg)) into
// params[(s*hk+h)*4 ..] for the update, and the speculative set: the top k_spec pages of the predictions.
// Plans are (s*hk+h)*cap-strided.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) kvs_prr_predict(Batch b, int hk, int k_spec, int page, float fa, float fb, float fg,
                                                                          const PrrEntry* st, int spb, const float* pred, int maxp, unsigned* plan,
                                                                          int* plan_len, int cap, float* params, int smem_keys) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    extern __shared__ unsigned skey[];
    __shared__ unsigned hist[256];
    __shared__ unsigned sel[4];
    __shared__ int cnt[TOPK_THREADS / 32 + 1];
    __shared__ int first_param;
    const int s = blockIdx.y, h = blockIdx.x, row = s * hk + h;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) {
        if (threadIdx.x == 0) plan_len[row] = r.decode ? 0 : -1;
        return;
    }
    const int fp = r.lo / page;
    const int np = min(r.hi / page - fp + 1, maxp);
    if (threadIdx.x == 0) first_param = 0x7fffffff;
    __syncthreads();
    PrrEntry* stw = const_cast<PrrEntry*>(st);
    // Usually the row's first page carries them: scan a chunk of pages at a time, stop at the first hit.
    for (int i0 = 0; i0 < np; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        if (i < np) {
            const PrrEntry* x = prr_entry(b, s, h, hk, fp + i, page, spb, stw);
            if (x != 0 && (x->flags & PRR_PARAMS)) atomicMin(&first_param, i);
        }
        __syncthreads();
        const bool found = first_param < np;
        __syncthreads();
        if (found) break;
    }
    if (threadIdx.x == 0) {
        float pa = fa, pb = fb, pg = fg;
        if (first_param < np) {
            const PrrEntry* x = prr_entry(b, s, h, hk, fp + first_param, page, spb, stw);
            pa = x->alpha;
            pb = x->beta;
            pg = x->gamma;
        }
        params[row * 4 + 0] = pa;
        params[row * 4 + 1] = pb;
        params[row * 4 + 2] = pg;
    }
    const float* sc = pred + (i64)row * maxp;
    const bool staged = np <= smem_keys;
    if (staged)
        for (int i = threadIdx.x; i < np; i += blockDim.x) skey[i] = kvs_order_key(sc[i]);
    __syncthreads();
    const int n = prr_top_pages(sc, skey, staged, np, fp, max(k_spec, 1), plan + (i64)row * cap, cap, hist, sel, cnt);
    __syncthreads();
    if (threadIdx.x == 0) plan_len[row] = n;
}

// Caller's stream, after join A (one CTA per (KV head, sequence)): the true selection (Quest's top-k, as
// kvs_quest_topk) and, in the same CTA, missed = truth \ pred (the repair plan), union = pred + missed
// (what the row reads and reports), and the counters as run_speculate counts them (policy rows, eligible
// blocks, spec_* pages, blocks visited and K/V bytes of the union; the reuse-previous hits are counted by
// the update, which reads the previous-true bits). The speculative set is staged in shared memory (after
// the top-k is done with it) when it fits.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) kvs_prr_select(Batch b, int hk, int budget, int page, int sink, const float* scores, int maxp,
                                                                          unsigned* truth, int* truth_len, int t_cap, const unsigned* pred,
                                                                          const int* pred_len, int p_cap, unsigned* missed, int* missed_len, int m_cap,
                                                                          unsigned* uni, int* uni_len, int u_cap, i64 row_bytes, int smem_keys,
                                                                          unsigned long long* ctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    extern __shared__ unsigned skey[];
    __shared__ unsigned hist[256];
    __shared__ unsigned sel[4];
    __shared__ int cnt[TOPK_THREADS / 32 + 1];
    __shared__ unsigned long long red[32];
    const int s = blockIdx.y, h = blockIdx.x, row = s * hk + h;
    const SeqRow r = seq_row(b, s);
    unsigned* T = truth + (i64)row * t_cap;
    const int n = page_topk_row(b, r, s, h, hk, budget, page, sink, scores, maxp, T, t_cap, smem_keys, skey, hist, sel, cnt);
    if (n <= 0 || r.hi < r.lo) {
        if (threadIdx.x == 0) {
            truth_len[row] = n;
            missed_len[row] = n;
            uni_len[row] = n;
        }
        return;  // uniform: n and the row are the CTA's
    }
    __syncthreads();  // T written, skey free
    const int nt = min(n, t_cap), npd = min(max(pred_len[row], 0), p_cap);
    const unsigned* Pg = pred + (i64)row * p_cap;
    const bool pstaged = npd <= smem_keys;
    if (pstaged)
        for (int i = threadIdx.x; i < npd; i += blockDim.x) skey[i] = Pg[i];
    __syncthreads();
    const unsigned* P = pstaged ? skey : Pg;
    unsigned* M = missed + (i64)row * m_cap;
    unsigned* U = uni + (i64)row * u_cap;
    const int nm = compact(nt, [&](int i) { return !prr_contains(P, npd, T[i]); }, [&](int i) { return T[i]; }, M, m_cap, cnt);
    __syncthreads();
    // The union by rank (pred and missed are disjoint and sorted).
    for (int i = threadIdx.x; i < npd; i += blockDim.x) {
        const int at = i + prr_rank(M, nm, P[i]);
        if (at < u_cap) U[at] = P[i];
    }
    for (int j = threadIdx.x; j < nm; j += blockDim.x) {
        const int at = j + prr_rank(P, npd, M[j]);
        if (at < u_cap) U[at] = M[j];
    }
    const int nu = min(npd + nm, u_cap);
    __syncthreads();
    if (threadIdx.x == 0) {
        truth_len[row] = nt;
        missed_len[row] = nm;
        uni_len[row] = nu;
        atomicAdd(&ctr[CTR_POLICY_ROWS], 1ull);
        atomicAdd(&ctr[CTR_BLOCKS_ELIGIBLE], (unsigned long long)((r.hi >> b.bs_log2) - (r.lo >> b.bs_log2) + 1));
        atomicAdd(&ctr[CTR_SPEC_PREDICTED], (unsigned long long)npd);
        atomicAdd(&ctr[CTR_SPEC_TRUE], (unsigned long long)nt);
        atomicAdd(&ctr[CTR_SPEC_HIT], (unsigned long long)(nt - nm));
        atomicAdd(&ctr[CTR_SPEC_REPAIRED], (unsigned long long)nm);
    }
    int ulog2 = 0;
    while ((1 << ulog2) < page) ++ulog2;
    account(U, nu, ulog2, r.lo, r.hi, b.bs_log2, 1, row_bytes, ctr, red);
}

// Side stream, after the true selection (event from the caller's stream): the Holt update of every page of
// every decode row with its true score (PrrHead::update, the same f32 operations; the module is compiled
// with --fmad=false), the row's parameters written to every page, the previous-true bits replaced by the
// true set; before that, the true pages whose bit was set are counted (spec_reuse_hit). Grid (page tiles
// of 256, KV heads, sequences).
extern "C" __global__ void kvs_prr_update(Batch b, int hk, int page, const float* scores, int maxp, const unsigned* truth, const int* truth_len, int t_cap,
                                          PrrEntry* st, int spb, const float* params, unsigned long long* ctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ unsigned long long red[32];
    const int s = blockIdx.z, h = blockIdx.y, row = s * hk + h;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) return;  // uniform over the CTA
    const int fp = r.lo / page;
    const int np = min(r.hi / page - fp + 1, maxp);
    if ((int)(blockIdx.x * blockDim.x) >= np) return;  // uniform
    const int nt = min(max(truth_len[row], 0), t_cap);
    const unsigned* T = truth + (i64)row * t_cap;
    // The true pages inside this CTA's 256 pages, as a bitmap (a binary search per thread in global memory
    // was the kernel's latency).
    __shared__ unsigned in_t[8];
    const int i0 = blockIdx.x * blockDim.x;
    if (threadIdx.x < 8) in_t[threadIdx.x] = 0u;
    __syncthreads();
    for (int j = threadIdx.x; j < nt; j += blockDim.x) {
        const i64 rel = (i64)T[j] - fp - i0;
        if (rel >= 0 && rel < 256) atomicOr(&in_t[rel >> 5], 1u << (rel & 31));
    }
    __syncthreads();
    const float pa = params[row * 4 + 0], pb = params[row * 4 + 1], pg = params[row * 4 + 2];
    const int i = i0 + threadIdx.x;
    unsigned long long reuse = 0;
    PrrEntry* x = i < np ? prr_entry(b, s, h, hk, fp + i, page, spb, st) : 0;
    if (x != 0) {
        // The entry as three 8-byte words (level, trend | alpha, beta | gamma, flags): half the memory
        // instructions of field-by-field access, and the parameters are stored only when they change.
        float2* x2 = reinterpret_cast<float2*>(x);
        const float2 lt = x2[0], ab = x2[1], gf = x2[2];
        const bool in_truth = (in_t[threadIdx.x >> 5] >> (threadIdx.x & 31)) & 1u;
        if (in_truth && (__float_as_uint(gf.y) & PRR_PREV)) reuse = 1;
        const float v = scores[(i64)row * maxp + i];
        float l = lt.x, t = lt.y;
        if (!isfinite(v)) {
            l = __int_as_float(0x7fffffff);
            t = 0.f;
        } else if (isnan(l)) {
            l = v;
            t = 0.f;
        } else {
            const float l2 = pa * v + (1.0f - pa) * (l + t);
            t = pb * (l2 - l) + (1.0f - pb) * t;
            l = l2;
        }
        x2[0] = make_float2(l, t);
        if (__float_as_uint(ab.x) != __float_as_uint(pa) || __float_as_uint(ab.y) != __float_as_uint(pb)) x2[1] = make_float2(pa, pb);
        x2[2] = make_float2(pg, __uint_as_float(PRR_PARAMS | (in_truth ? PRR_PREV : 0u)));
    }
    reuse = block_sum(reuse, red);
    if (threadIdx.x == 0 && reuse > 0) atomicAdd(&ctr[CTR_SPEC_REUSE_HIT], reuse);
}

// Caller's stream, after join B: attention over the missed pages and the exact LSE merge with the
// speculative partial state (o1, l1; [num_tokens][nq][HEAD_DIM] / [num_tokens][nq]) into the caller's out /
// lse, in one launch. Grid (seqs, KV heads, parts), PRR_FIN_THREADS threads: part p takes the missed pages
// p, p + parts, ... (usually none: a hit step's repair is empty); warp w the group's query rows w, w + 4,
// ...; each lane the channels lane, lane + 32, ... Logits are f32 dot products times `scale`, soft-capped
// as the attention kernels do; a non-finite logit poisons the row (NaN out, NaN LSE). Each part writes its
// partial state (pw_o / pw_l, [(s*hk+h)*parts + p][GROUP][HEAD_DIM] / [..][GROUP]); the row's last part to
// finish (a counter per row in done[], zeroed by the side stream at the fork) merges the parts with the
// speculative state by the rules of kernels/merge.cu. An FP8 cache's rows (KV8) are read as the CPU reads
// them: decoded, K times `kscale`, V times `vscale` (kv_load.cuh; unused otherwise).
#define PRR_FIN_THREADS 128
#define PRR_FIN_ROWS ((GROUP + 3) / 4)
#define PRR_FIN_CH ((HEAD_DIM + 31) / 32)
#define PRR_FIN_UNROLL 2
#define PRR_FIN_MAX_PARTS 8
extern "C" __global__ void __launch_bounds__(PRR_FIN_THREADS) kvs_prr_finish(Batch b, int hk, int nq, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale,
                                                                           float softcap, const kv_t* kc, i64 k0, i64 k1, i64 k2, const kv_t* vc,
                                                                           i64 v0, i64 v1, i64 v2, const unsigned* missed, const int* missed_len,
                                                                           int m_cap, int ulog2, const elem_t* o1, const float* l1, float* pw_o,
                                                                           float* pw_l, unsigned* done, elem_t* out, i64 o0, i64 oq, i64 od, float* lse,
                                                                           i64 ls0, i64 ls1, float kscale, float vscale) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ int last_part;
    const int s = blockIdx.x, h = blockIdx.y, part = blockIdx.z, parts = gridDim.z, row = s * hk + h;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const SeqRow r = seq_row(b, s);
    const int first = b.qsl[s * b.qsl0];
    // Uniform over the row's CTAs: a prefill row's output is the dense launch's; a row whose query index is
    // out of range (bad metadata) writes nothing.
    if (!r.decode || first < 0 || first >= b.num_tokens) return;
    const int nm = r.hi >= r.lo ? min(max(missed_len[row], 0), m_cap) : 0;
    const unsigned* M = missed + (i64)row * m_cap;
    const int bs = 1 << b.bs_log2;
    // This part's partial state, per query row of this warp.
    float m[PRR_FIN_ROWS], l[PRR_FIN_ROWS], acc[PRR_FIN_ROWS][PRR_FIN_CH], qv[PRR_FIN_ROWS][PRR_FIN_CH];
    bool bad[PRR_FIN_ROWS];
#pragma unroll
    for (int j = 0; j < PRR_FIN_ROWS; ++j) {
        const int g = warp + 4 * j;
        m[j] = -INFINITY;
        l[j] = 0.f;
        bad[j] = false;
#pragma unroll
        for (int c = 0; c < PRR_FIN_CH; ++c) {
            const int d = lane + 32 * c;
            acc[j][c] = 0.f;
            qv[j][c] = (g < GROUP && d < HEAD_DIM) ? ET::ld(q[(i64)r.t * q0 + (i64)(h * GROUP + g) * q1 + (i64)d * q2]) : 0.f;
        }
    }
    for (int pi = part; pi < nm; pi += parts) {
        const i64 a = max((i64)M[pi] << ulog2, (i64)r.lo), z = min((((i64)M[pi] + 1) << ulog2) - 1, (i64)r.hi);
        for (i64 pos0 = a; pos0 <= z; pos0 += PRR_FIN_UNROLL) {
          // PRR_FIN_UNROLL tokens' rows loaded before any is used (memory-level parallelism).
          float kx[PRR_FIN_UNROLL][PRR_FIN_CH], vx[PRR_FIN_UNROLL][PRR_FIN_CH];
          bool ok[PRR_FIN_UNROLL];
#pragma unroll
          for (int u = 0; u < PRR_FIN_UNROLL; ++u) {
            const i64 pos = pos0 + u;
            const i64 pb = pos <= z ? phys_block(b, s, (int)(pos >> b.bs_log2)) : -1;
            ok[u] = pb >= 0;  // as the attention kernels: a block id out of range contributes nothing
            const i64 slot = pos & (bs - 1);
            const kv_t* kr = kc + (ok[u] ? pb * k0 + slot * k1 + (i64)h * k2 : 0);
            const kv_t* vr = vc + (ok[u] ? pb * v0 + slot * v1 + (i64)h * v2 : 0);
#pragma unroll
            for (int c = 0; c < PRR_FIN_CH; ++c) {
                const int d = lane + 32 * c;
                kx[u][c] = (ok[u] && d < HEAD_DIM) ? kv_ld(kr[d], kscale) : 0.f;
                vx[u][c] = (ok[u] && d < HEAD_DIM) ? kv_ld(vr[d], vscale) : 0.f;
            }
          }
#pragma unroll
          for (int u = 0; u < PRR_FIN_UNROLL; ++u) {
            if (!ok[u]) continue;  // uniform over the warp
#pragma unroll
            for (int j = 0; j < PRR_FIN_ROWS; ++j) {
                if (warp + 4 * j >= GROUP) continue;  // uniform over the warp
                float x = 0.f;
#pragma unroll
                for (int c = 0; c < PRR_FIN_CH; ++c) x = fmaf(qv[j][c], kx[u][c], x);
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
                x *= scale;
                if (!isfinite(x)) {
                    bad[j] = true;
                    continue;
                }
                if (softcap > 0.f) x = softcap * tanhf(x / softcap);
                const float mn = fmaxf(m[j], x);
                const float alpha = __expf(m[j] - mn), p = __expf(x - mn);
                m[j] = mn;
                l[j] = l[j] * alpha + p;
#pragma unroll
                for (int c = 0; c < PRR_FIN_CH; ++c) acc[j][c] = fmaf(p, vx[u][c], acc[j][c] * alpha);
            }
          }
        }
    }
    const float nan = __int_as_float(0x7fffffff);
    const i64 pbase = (i64)row * parts + part;
#pragma unroll
    for (int j = 0; j < PRR_FIN_ROWS; ++j) {
        const int g = warp + 4 * j;
        if (g >= GROUP) continue;
        const bool any = l[j] > 0.f;
#pragma unroll
        for (int c = 0; c < PRR_FIN_CH; ++c) {
            const int d = lane + 32 * c;
            if (d < HEAD_DIM) pw_o[(pbase * GROUP + g) * HEAD_DIM + d] = bad[j] ? nan : (any ? acc[j][c] / l[j] : 0.f);
        }
        if (lane == 0) pw_l[pbase * GROUP + g] = bad[j] ? nan : (any ? m[j] + __logf(l[j]) : -INFINITY);
    }
    // The row's last part merges.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_part = atomicAdd(&done[row], 1u) == (unsigned)(parts - 1);
    __syncthreads();
    if (!last_part) return;
    __threadfence();
    // The merge: the weights of the speculative state (slot 0) and of every part (slots 1..), per query
    // row, once in shared memory; then each output channel is one pass over independent loads.
    __shared__ float w_sm[GROUP][PRR_FIN_MAX_PARTS + 1];
    __shared__ float lse_sm[GROUP];
    const int t = r.t;
    if ((int)threadIdx.x < GROUP) {
        const int g = threadIdx.x;
        float xs[PRR_FIN_MAX_PARTS + 1];
        xs[0] = l1[(i64)t * nq + h * GROUP + g];
        for (int p = 0; p < PRR_FIN_MAX_PARTS; ++p) xs[p + 1] = p < parts ? __ldcg(&pw_l[((i64)row * parts + p) * GROUP + g]) : -INFINITY;
        float mx = -INFINITY;
        bool poison = false;
#pragma unroll
        for (int p = 0; p <= PRR_FIN_MAX_PARTS; ++p) {
            poison = poison || isnan(xs[p]) || xs[p] == INFINITY;
            mx = fmaxf(mx, xs[p]);
        }
        float wsum = 0.f;
#pragma unroll
        for (int p = 0; p <= PRR_FIN_MAX_PARTS; ++p) {
            const float w = (poison || mx == -INFINITY || xs[p] == -INFINITY) ? 0.f : __expf(xs[p] - mx);
            w_sm[g][p] = w;
            wsum += w;
        }
        // Normalized weights; the row's LSE (NaN when poisoned, -inf when nothing was seen).
        const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
#pragma unroll
        for (int p = 0; p <= PRR_FIN_MAX_PARTS; ++p) w_sm[g][p] *= inv;
        lse_sm[g] = poison ? nan : (mx == -INFINITY ? -INFINITY : mx + __logf(wsum));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM, qh = h * GROUP + g;
        const i64 ri = (i64)t * nq + qh;
        const float lv = lse_sm[g];
        float v;
        if (isnan(lv)) {
            v = nan;
        } else if (lv == -INFINITY) {
            v = 0.f;
        } else {
            const float w0 = w_sm[g][0];
            v = w0 > 0.f ? w0 * ET::ld(o1[ri * HEAD_DIM + d]) : 0.f;
#pragma unroll
            for (int p = 0; p < PRR_FIN_MAX_PARTS; ++p) {
                const float w = w_sm[g][p + 1];
                if (p < parts && w > 0.f) v = fmaf(w, __ldcg(&pw_o[(((i64)row * parts + p) * GROUP + g) * HEAD_DIM + d]), v);
            }
        }
        out[(i64)t * o0 + (i64)qh * oq + (i64)d * od] = ET::st(v);
        if (lse != 0 && d == 0) lse[(i64)t * ls0 + (i64)qh * ls1] = lv;
    }
    if (threadIdx.x == 0) done[row] = 0u;  // for the next step (the side stream also zeroes it at the fork)
}

// Calibration at a prefill chunk, step 1: the Quest page scores of the calibration rows (rows[j] = (seq,
// query row, lo, hi)), as kvs_quest_scores scores a decode row: traj[(j*hk+h)*maxp + i] for pages lo/page + i.
// Grid (page tiles of 64, KV heads, rows).
extern "C" __global__ void __launch_bounds__(QS_THREADS) kvs_prr_traj_scores(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, int hk,
                                                                             const u16* qmin, const u16* qmax, int unit, int upb, int page,
                                                                             const int* rows, float* traj, int maxp) {
    __shared__ float qs[GROUP * 16 * (QC + 1)];
    const int j = blockIdx.z, h = blockIdx.y;
    const int s = rows[j * 4], t = rows[j * 4 + 1], lo = rows[j * 4 + 2], hi = rows[j * 4 + 3];
    if (s < 0 || s >= b.num_seqs || t < 0 || t >= b.num_tokens || hi < lo || lo < 0) return;
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, c = i % HEAD_DIM;
        qs[g * 16 * (QC + 1) + (c % 16) * (QC + 1) + c / 16] = ET::ld(q[(i64)t * q0 + (i64)(h * GROUP + g) * q1 + (i64)c * q2]) * scale;
    }
    __syncthreads();
    const int lane = threadIdx.x & 15, hw = threadIdx.x >> 4;
    const unsigned hmask = 0xffffu << (16 * (hw & 1));
    const int fp = lo / page, np = hi / page - fp + 1;
    for (int pi = 0; pi < QS_PAGES / 16; ++pi) {
        const int i = blockIdx.x * QS_PAGES + pi * 16 + hw;
        const bool active = i < np && i < maxp;
        const int pg = fp + i;
        const int a = max(pg * page, lo), z = active ? min((pg + 1) * page, hi + 1) : 0;
        float best = -INFINITY;
        for (int u0 = a / unit; u0 * unit < z; ++u0) {
            const i64 pb = phys_block(b, s, u0 / upb);
            if (pb < 0) continue;
            const i64 base = ((pb * upb + u0 % upb) * hk + h) * (i64)HEAD_DIM + lane * QC;
            float lo_[QC], hi_[QC];
            load_lane_bounds(qmin + base, lo_);
            load_lane_bounds(qmax + base, hi_);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float* qr = qs + g * 16 * (QC + 1) + lane * (QC + 1);
                float acc = 0.f;
#pragma unroll
                for (int k = 0; k < QC; ++k) acc += fmaxf(qr[k] * lo_[k], qr[k] * hi_[k]);
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) acc += __shfl_xor_sync(hmask, acc, o);
                best = fmaxf(best, acc);
            }
        }
        if (active && lane == 0) traj[(i64)(j * hk + h) * maxp + i] = best;
    }
}

// Calibration, step 2: the host's warm state (src[(j*hk+h)*maxp + pg] for pages 0 .. npages[j] of
// sequence seqs[j]) into the block-keyed entries. Grid (page tiles of 256, KV heads, sequences).
extern "C" __global__ void kvs_prr_scatter(Batch b, int hk, int page, int spb, const int* seqs, const int* npages, const PrrEntry* src, int maxp,
                                           PrrEntry* st) {
    const int j = blockIdx.z, h = blockIdx.y;
    const int s = seqs[j], n = min(npages[j], maxp);
    const int pg = blockIdx.x * blockDim.x + threadIdx.x;
    if (s < 0 || s >= b.num_seqs || pg >= n) return;
    PrrEntry* x = prr_entry(b, s, h, hk, pg, page, spb, st);
    if (x != 0) *x = src[(i64)(j * hk + h) * maxp + pg];
}
