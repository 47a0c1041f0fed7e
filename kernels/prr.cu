// PRR (predict, speculate, repair; src/policy/speculate.rs, src/cpu/sparse/stateful.rs) on the device.
// Appended to the selection module (select.cu's Batch, seq_row, phys_block, radix_kth, compact, account).
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

#define PRR_PARAMS 1u  // the entry carries its sequence's Holt parameters
#define PRR_PREV 2u    // the page was in the previous step's true set (for the reuse-previous counter)
#define PRR_THREADS 512

struct PrrEntry {
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
                                             unsigned* hist, unsigned* wtot, unsigned long long& sel_prefix, int& sel_left, int* cnt) {
    if (np <= k) {
        const int n = min(np, cap);
        for (int i = threadIdx.x; i < n; i += blockDim.x) e[i] = fp + i;
        return n;
    }
    const int last = np - 1;
    const int m = min(k - 1, last);
    int ibits = 1;
    while ((1 << ibits) < np) ++ibits;
    const int passes = (32 + ibits + 7) / 8;
    auto key_of = [&](int i) { return ((unsigned long long)(staged ? skey[i] : kvs_order_key(sc[i])) << ibits) | (unsigned)i; };
    const unsigned long long thr = radix_kth(0, last, m, passes, key_of, hist, wtot, sel_prefix, sel_left);
    auto keep = [&](int i) { return i == last || (m > 0 && key_of(i) >= thr); };
    return compact(np, keep, [&](int i) { return (unsigned)(fp + i); }, e, cap, cnt);
}

// Side stream, step 1: the predicted score of every page of every decode row, level + gamma * trend with
// the entry's own gamma (every entry of a row that has been scored carries the row's parameters: the
// calibration and every update write them to all of the row's pages), +inf for a page never scored.
// Grid (page tiles of 256, KV heads, sequences).
extern "C" __global__ void kvs_prr_pred_scores(Batch b, int hk, int page, const PrrEntry* st, int spb, float* pred, int maxp) {
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
extern "C" __global__ void __launch_bounds__(PRR_THREADS) kvs_prr_predict(Batch b, int hk, int k_spec, int page, float fa, float fb, float fg,
                                                                          const PrrEntry* st, int spb, const float* pred, int maxp, unsigned* plan,
                                                                          int* plan_len, int cap, float* params, int smem_keys) {
    extern __shared__ unsigned skey[];
    __shared__ unsigned hist[256];
    __shared__ unsigned wtot[8];
    __shared__ unsigned long long sel_prefix;
    __shared__ int sel_left;
    __shared__ int cnt[PRR_THREADS / 32 + 1];
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
    const int n = prr_top_pages(sc, skey, staged, np, fp, max(k_spec, 1), plan + (i64)row * cap, cap, hist, wtot, sel_prefix, sel_left, cnt);
    __syncthreads();
    if (threadIdx.x == 0) plan_len[row] = n;
}

// Caller's stream, after join A (one CTA per (KV head, sequence)): missed = truth \ pred (the repair
// plan), union = pred + missed (what the row reads and reports), and the counters as run_speculate counts
// them (policy rows, eligible blocks, spec_* pages, blocks visited and K/V bytes of the union; the
// reuse-previous hits are counted by the update, which reads the previous-true bits).
extern "C" __global__ void __launch_bounds__(PRR_THREADS) kvs_prr_repair(Batch b, int hk, int page, const unsigned* truth, const int* truth_len, int t_cap,
                                                                         const unsigned* pred, const int* pred_len, int p_cap, unsigned* missed,
                                                                         int* missed_len, int m_cap, unsigned* uni, int* uni_len, int u_cap, i64 row_bytes,
                                                                         unsigned long long* ctr) {
    __shared__ int cnt[PRR_THREADS / 32 + 1];
    __shared__ unsigned long long red[32];
    const int s = blockIdx.y, h = blockIdx.x, row = s * hk + h;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) {
        if (threadIdx.x == 0) {
            missed_len[row] = r.decode ? 0 : -1;
            uni_len[row] = r.decode ? 0 : -1;
        }
        return;
    }
    const int nt = min(max(truth_len[row], 0), t_cap), npd = min(max(pred_len[row], 0), p_cap);
    const unsigned* T = truth + (i64)row * t_cap;
    const unsigned* P = pred + (i64)row * p_cap;
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
    __shared__ unsigned long long red[32];
    const int s = blockIdx.z, h = blockIdx.y, row = s * hk + h;
    const SeqRow r = seq_row(b, s);
    if (!r.decode || r.hi < r.lo) return;  // uniform over the CTA
    const int fp = r.lo / page;
    const int np = min(r.hi / page - fp + 1, maxp);
    if ((int)(blockIdx.x * blockDim.x) >= np) return;  // uniform
    const int nt = min(max(truth_len[row], 0), t_cap);
    const unsigned* T = truth + (i64)row * t_cap;
    const float pa = params[row * 4 + 0], pb = params[row * 4 + 1], pg = params[row * 4 + 2];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long reuse = 0;
    PrrEntry* x = i < np ? prr_entry(b, s, h, hk, fp + i, page, spb, st) : 0;
    if (x != 0) {
        const bool in_truth = prr_contains(T, nt, (unsigned)(fp + i));
        if (in_truth && (x->flags & PRR_PREV)) reuse = 1;
        const float v = scores[(i64)row * maxp + i];
        float l = x->level, t = x->trend;
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
        x->level = l;
        x->trend = t;
        x->alpha = pa;
        x->beta = pb;
        x->gamma = pg;
        x->flags = PRR_PARAMS | (in_truth ? PRR_PREV : 0u);
    }
    reuse = block_sum(reuse, red);
    if (threadIdx.x == 0 && reuse > 0) atomicAdd(&ctr[CTR_SPEC_REUSE_HIT], reuse);
}

// Caller's stream, after join B: each decode row's output = exact LSE merge of the speculative (o1, l1)
// and repair (o2, l2) partial states (the rules of kernels/merge.cu), into the caller's out / lse. The
// partial states are [num_tokens][nq][HEAD_DIM] / [num_tokens][nq]. Grid (seqs, nq), HEAD_DIM threads.
extern "C" __global__ void kvs_prr_merge(Batch b, int nq, const elem_t* o1, const float* l1, const elem_t* o2, const float* l2, elem_t* out,
                                         i64 o0, i64 oq, i64 od, float* lse, i64 ls0, i64 ls1) {
    const int s = blockIdx.x, qh = blockIdx.y, d = threadIdx.x;
    const SeqRow r = seq_row(b, s);
    const int q0 = b.qsl[s * b.qsl0];
    if (!r.decode || q0 < 0 || q0 >= b.num_tokens || d >= HEAD_DIM) return;
    const int t = r.t;
    const i64 ri = (i64)t * nq + qh;
    const float xa = l1[ri], xb = l2[ri];
    const float va = ET::ld(o1[ri * HEAD_DIM + d]), vb = ET::ld(o2[ri * HEAD_DIM + d]);
    const float m = fmaxf(xa, xb);
    float v, l;
    if (isnan(xa) || isnan(xb) || xa == INFINITY || xb == INFINITY) {
        v = __int_as_float(0x7fffffff);
        l = v;
    } else if (m == -INFINITY) {
        v = 0.f;
        l = -INFINITY;
    } else if (xb == -INFINITY) {
        v = va;
        l = xa;
    } else if (xa == -INFINITY) {
        v = vb;
        l = xb;
    } else {
        const float wa = __expf(xa - m), wb = __expf(xb - m);
        v = (wa * va + wb * vb) / (wa + wb);
        l = m + __logf(wa + wb);
    }
    out[(i64)t * o0 + (i64)qh * oq + (i64)d * od] = ET::st(v);
    if (lse != 0 && d == 0) lse[(i64)t * ls0 + (i64)qh * ls1] = l;
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
