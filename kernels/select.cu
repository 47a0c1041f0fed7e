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

#define SEL_THREADS 256

struct Batch {
    const int* bt;
    i64 bt0, bt1;
    int bt_cols, bs_log2;
    i64 num_blocks;
    const int* seq_lens;
    i64 sl0;
    const int* qsl;
    i64 qsl0;
    int num_seqs, num_tokens, window;
};

__device__ __forceinline__ SeqRow seq_row(const Batch& b, int s) {
    return kvs_seq_row(s, b.qsl, b.qsl0, b.seq_lens, b.sl0, b.bt_cols << b.bs_log2, b.window, b.num_tokens);
}

// Physical block of logical block `lb` of sequence s, or -1.
__device__ __forceinline__ i64 phys_block(const Batch& b, int s, int lb) {
    if (lb < 0 || lb >= b.bt_cols) return -1;
    const i64 id = b.bt[s * b.bt0 + (i64)lb * b.bt1];
    return (id >= 0 && id < b.num_blocks) ? id : -1;
}

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

template <typename T>
__device__ __forceinline__ T block_sum(T v, T* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    T r = 0;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) r += red[i];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float block_max(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = -INFINITY;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) r = fmaxf(r, red[i]);
    __syncthreads();
    return r;
}

// Block-wide exclusive prefix sum of v in thread order; `total` gets the sum. `wsum` is shared scratch of
// blockDim/32 ints. All threads call it (blockDim a multiple of 32).
__device__ __forceinline__ int block_excl_scan(int v, int* wsum, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();  // a previous call may still read wsum
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < nw; ++w) {
        const int c = wsum[w];
        if (w < warp) before += c;
        all += c;
    }
    total = all;
    return before + x - v;
}

// Writes the entries i (0 <= i < n) for which keep(i) holds, in increasing i, as value(i); returns how
// many were written (at most cap). Block-wide (all threads call it); `cnt` is shared scratch of blockDim/32
// ints; `out` must not alias what keep or value read. One scan per call: each warp owns a contiguous
// segment of the indices (lanes interleaved, so reads stay coalesced), counts its kept entries, and writes
// them after the warps before it; keep is evaluated twice per index. Every thread sees the whole of `out`
// on return.
template <typename Keep, typename Val>
__device__ __forceinline__ int compact(int n, Keep keep, Val value, unsigned* out, int cap, int* cnt) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int per = ((n + nw - 1) / nw + 31) & ~31;
    const int a = min(warp * per, n), z = min(a + per, n);
    int c = 0;
    for (int i0 = a; i0 < z; i0 += 32) c += __popc(__ballot_sync(0xffffffffu, i0 + lane < z && keep(i0 + lane)));
    int total;
    // The warps before this one: lane 0 carries the warp's count, so lane 0's exclusive prefix is theirs.
    int at = __shfl_sync(0xffffffffu, block_excl_scan(lane == 0 ? c : 0, cnt, total), 0);
    for (int i0 = a; i0 < z; i0 += 32) {
        const int i = i0 + lane;
        const bool k = i < z && keep(i);
        const unsigned bal = __ballot_sync(0xffffffffu, k);
        const int p = at + __popc(bal & ((1u << lane) - 1u));
        if (k && p < cap) out[p] = value(i);
        at += __popc(bal);
    }
    __syncthreads();
    return total < cap ? total : cap;
}

// Counts the blocks and tokens a plan (entries increasing) visits inside lo..=hi, as the CPU counts its
// candidate units, and adds them (times `heads`) to the counters. Block-wide.
__device__ __forceinline__ void account(const unsigned* e, int n, int ulog2, int lo, int hi, int bs_log2, int heads, i64 row_bytes,
                                        unsigned long long* ctr, unsigned long long* red) {
    unsigned long long blocks = 0, tokens = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const i64 a = max((i64)e[j] << ulog2, (i64)lo), z = min((((i64)e[j] + 1) << ulog2) - 1, (i64)hi);
        if (a > z) continue;
        i64 nb = (z >> bs_log2) - (a >> bs_log2) + 1;
        if (j > 0) {
            const i64 pa = max((i64)e[j - 1] << ulog2, (i64)lo), pz = min((((i64)e[j - 1] + 1) << ulog2) - 1, (i64)hi);
            if (pa <= pz && (pz >> bs_log2) == (a >> bs_log2)) nb -= 1;
        }
        blocks += nb;
        tokens += z - a + 1;
    }
    blocks = block_sum(blocks, red);
    tokens = block_sum(tokens, red);
    if (threadIdx.x == 0) {
        atomicAdd(&ctr[CTR_BLOCKS_VISITED], blocks * heads);
        atomicAdd(&ctr[CTR_KV_BYTES], tokens * (unsigned long long)row_bytes * heads);
    }
}

// Per call: decode rows, prefill tokens and the dense rows' KV bytes, as the CPU counts them. Block-wide
// (one CTA of the first selection kernel runs it).
__device__ __forceinline__ void rows_count(const Batch& b, int hk, i64 row_bytes, unsigned long long* ctr, unsigned long long* red) {
    unsigned long long dec = 0, pre = 0, bytes = 0;
    for (int s = threadIdx.x; s < b.num_seqs; s += blockDim.x) {
        const SeqRow r = seq_row(b, s);
        if (r.decode) {
            dec += 1;
        } else {
            pre += r.q_len > 0 ? r.q_len : 0;
            const int first = r.hi + 1 - (r.q_len > 0 ? r.q_len : 0);  // first query position
            const int vis = (b.window > 0 && first + 1 - b.window > 0) ? first + 1 - b.window : 0;
            if (r.hi + 1 > vis) bytes += (unsigned long long)(r.hi + 1 - vis) * row_bytes * hk;
        }
    }
    dec = block_sum(dec, red);
    pre = block_sum(pre, red);
    bytes = block_sum(bytes, red);
    if (threadIdx.x == 0) {
        atomicAdd(&ctr[CTR_DECODE_ROWS], dec);
        atomicAdd(&ctr[CTR_PREFILL_TOKENS], pre);
        atomicAdd(&ctr[CTR_KV_BYTES], bytes);
    }
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

// Quest, step 1: the bound of every page of the row, max over the group's query rows and the page's
// units (units of `unit` slots of one block), as quest_page_scores. One half-warp per page: lane l holds
// the channels l, l+16, l+32, ... of the unit's min and max, which the cache write stores contiguously
// per lane (kernels/meta.cu), so a half-warp reads a unit's bounds in coalesced vector loads; each lane
// sums its channels in order and a butterfly over the 16 lanes adds the lane sums, the order the CPU's
// quest_bound follows. Each half-warp scores 4 pages; grid (page tiles of 64, KV heads, seqs).
// CTA (0,0,0) also counts the call's rows (folded in to save a launch) when `count_rows` is set.
#define QC (HEAD_DIM / 16)  // channels per lane
#define QS_THREADS 256
#define QS_PAGES 64
// Pages are scored one at a time per half-warp: issuing four pages' bound loads first was measured slower
// on the H100 (selection 961 against 633 us at batch 32, 128K; docs/perf.md) and was removed.
__device__ __forceinline__ void load_lane_bounds(const u16* p, float* v) {
#if QC % 8 == 0
#pragma unroll
    for (int k8 = 0; k8 < QC / 8; ++k8) {
        const uint4 w = reinterpret_cast<const uint4*>(p)[k8];
        const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k8 * 8 + k] = kvs_f16_to_f32((u16)(ws[k / 2] >> (16 * (k % 2))));
    }
#elif QC % 4 == 0
#pragma unroll
    for (int k4 = 0; k4 < QC / 4; ++k4) {
        const uint2 w = reinterpret_cast<const uint2*>(p)[k4];
        const unsigned ws[2] = {w.x, w.y};
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k4 * 4 + k] = kvs_f16_to_f32((u16)(ws[k / 2] >> (16 * (k % 2))));
    }
#elif QC % 2 == 0
#pragma unroll
    for (int k2 = 0; k2 < QC / 2; ++k2) {
        const unsigned w = reinterpret_cast<const unsigned*>(p)[k2];
        v[2 * k2] = kvs_f16_to_f32((u16)w);
        v[2 * k2 + 1] = kvs_f16_to_f32((u16)(w >> 16));
    }
#else
#pragma unroll
    for (int k = 0; k < QC; ++k) v[k] = kvs_f16_to_f32(p[k]);
#endif
}

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
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, c = i % HEAD_DIM;
        qs[g * 16 * (QC + 1) + (c % 16) * (QC + 1) + c / 16] = ET::ld(q[(i64)r.t * q0 + (i64)(h * GROUP + g) * q1 + (i64)c * q2]) * scale;
    }
    __syncthreads();
    const int lane = threadIdx.x & 15, hw = threadIdx.x >> 4;
    const unsigned hmask = 0xffffu << (16 * (hw & 1));
    const int fp = r.lo / page, np = r.hi / page - fp + 1;
    unsigned long long units = 0;
    for (int pi = 0; pi < QS_PAGES / 16; ++pi) {
        const int i = blockIdx.x * QS_PAGES + pi * 16 + hw;
        const bool active = i < np && i < maxp;
        const int pg = fp + i;
        const int a = max(pg * page, r.lo), z = active ? min((pg + 1) * page, r.hi + 1) : 0;
        float best = -INFINITY;
        for (int u0 = a / unit; u0 * unit < z; ++u0) {
            units += lane == 0;
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
        if (active && lane == 0) scores[(i64)(s * hk + h) * maxp + i] = best;
    }
    // One counter update per CTA: same-address atomics from every thread would serialize in L2.
    units = block_sum(units, red);
    if (threadIdx.x == 0) atomicAdd(&ctr[CTR_KV_BYTES], units * (2 * HEAD_DIM * 2));
}

// Radix select, 8 bits per pass from the top: the m-th largest of the unique keys key_of(i), lo <= i < hi
// (1 <= m <= hi - lo), which needs `passes` passes to cover the keys' bits; 0 when m == 0. Block-wide;
// hist[256], wtot[8] and the two selection words are shared scratch.
template <typename KeyOf>
__device__ __forceinline__ unsigned long long radix_kth(int lo, int hi, int m, int passes, KeyOf key_of, unsigned* hist, unsigned* wtot,
                                                        unsigned long long& sel_prefix, int& sel_left) {
    if (threadIdx.x == 0) {
        sel_prefix = 0;
        sel_left = m;
    }
    __syncthreads();
    for (int pass = 0; pass < passes && m > 0; ++pass) {
        const int shift = 8 * (passes - 1 - pass);
        const unsigned long long hi_mask = shift + 8 >= 64 ? 0ull : (~0ull << (shift + 8));
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const unsigned long long prefix = sel_prefix;
        const int left = sel_left;
        // Uniform trip count, so the warp can aggregate equal bins before the shared-memory atomic
        // (early passes put most pages in one or two bins).
        for (int base_i = lo; base_i < hi; base_i += blockDim.x) {
            const int i = base_i + threadIdx.x;
            unsigned bin = 256u;
            if (i < hi) {
                const unsigned long long key = key_of(i);
                if ((key & hi_mask) == (prefix & hi_mask)) bin = (unsigned)((key >> shift) & 255);
            }
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (bin < 256u && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned)__popc(peers));
        }
        __syncthreads();
        // The digit: counts from the top bin down (thread t holds bin 255 - t), scanned; the one bin
        // where the running count crosses `left` is it.
        unsigned c = 0, v = 0;
        if (threadIdx.x < 256) {
            c = hist[255 - threadIdx.x];
            v = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned y = __shfl_up_sync(0xffffffffu, v, o);
                if ((int)(threadIdx.x & 31) >= o) v += y;
            }
            if ((threadIdx.x & 31) == 31) wtot[threadIdx.x >> 5] = v;
        }
        __syncthreads();
        if (threadIdx.x < 256) {
            unsigned pre = 0;
            for (int w = 0; w < (int)(threadIdx.x >> 5); ++w) pre += wtot[w];
            const unsigned incl = v + pre, excl = incl - c;
            if ((int)excl < left && (int)incl >= left) {
                sel_left = left - (int)excl;
                sel_prefix = prefix | ((unsigned long long)(255 - threadIdx.x) << shift);
            }
        }
        __syncthreads();
    }
    return sel_prefix;
}

// The m largest of the 32-bit keys key_of(i), lo <= i < hi (1 <= m <= hi - lo), ties on the key going to
// the larger i: i is among them iff key_of(i) > thr, or key_of(i) == thr and i >= cut. The same set as
// radix_kth over the unique keys (key << ibits | i), found with fewer passes: the radix starts below the
// bits every key shares (from the keys' minimum and maximum), takes 8 bits per pass, and stops as soon as
// the bin it descends into holds exactly the keys still needed; only a tie on the whole key is cut by
// index (one scan from the top). Block-wide (all threads; blockDim a multiple of 32, at least 256);
// hist[256], wsum[blockDim/32] and sel[4] are shared scratch.
struct TopCut {
    unsigned thr;
    int cut;
};
template <typename KeyOf>
__device__ __forceinline__ TopCut topk32(int lo, int hi, int m, KeyOf key_of, unsigned* hist, int* wsum, unsigned* sel) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    unsigned mn = 0xffffffffu, mx = 0u;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const unsigned k = key_of(i);
        mn = min(mn, k);
        mx = max(mx, k);
    }
    mn = __reduce_min_sync(0xffffffffu, mn);
    mx = __reduce_max_sync(0xffffffffu, mx);
    __syncthreads();  // hist / sel may still be read by a previous user
    if (lane == 0) {
        hist[warp] = mn;
        hist[32 + warp] = mx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned a = 0xffffffffu, z = 0u;
        for (int w = 0; w < nw; ++w) {
            a = min(a, hist[w]);
            z = max(z, hist[32 + w]);
        }
        const int top = a == z ? 0 : 32 - __clz(a ^ z);  // the low bits that differ among the keys
        sel[0] = top == 32 ? 0u : (z & (0xffffffffu << top));
        sel[1] = (unsigned)m;
        sel[2] = 0u;
        sel[3] = (unsigned)top;
    }
    __syncthreads();
    unsigned prefix = sel[0];
    int left = (int)sel[1], top = (int)sel[3];
    bool done = false;
    while (top > 0 && !done) {
        const int bits = min(8, top), shift = top - bits, nb = 1 << bits;
        const unsigned himask = top >= 32 ? 0u : (0xffffffffu << top);
        for (int i = threadIdx.x; i < nb; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const unsigned k = key_of(i);
            if ((k & himask) == (prefix & himask)) atomicAdd(&hist[(k >> shift) & (unsigned)(nb - 1)], 1u);
        }
        __syncthreads();
        // Bins from the top (thread t holds bin nb - 1 - t), scanned: the bin where the count crosses `left`.
        const int c = (int)threadIdx.x < nb ? (int)hist[nb - 1 - threadIdx.x] : 0;
        int total;
        const int excl = block_excl_scan(c, wsum, total);
        if (c > 0 && excl < left && excl + c >= left) {
            sel[0] = prefix | ((unsigned)(nb - 1 - threadIdx.x) << shift);
            sel[1] = (unsigned)(left - excl);
            sel[2] = (c == left - excl) ? 1u : 0u;
        }
        __syncthreads();
        prefix = sel[0];
        left = (int)sel[1];
        done = sel[2] != 0u;
        top = shift;
    }
    TopCut r{prefix, lo};
    if (!done) {
        __syncthreads();  // every thread has read sel
        // Keys equal to `prefix` (all 32 bits): `left` of them, the later ones. Scan from the top.
        int acc = 0;
        if (threadIdx.x == 0) sel[3] = (unsigned)lo;
        for (int c0 = hi; c0 > lo; c0 -= blockDim.x) {
            const int i = c0 - 1 - (int)threadIdx.x;
            const bool t = i >= lo && key_of(i) == prefix;
            const unsigned bal = __ballot_sync(0xffffffffu, t);
            int total;
            const int before = block_excl_scan(lane == 0 ? __popc(bal) : 0, wsum, total);
            const int rank = acc + before + __popc(bal & ((2u << lane) - 1u));
            if (t && rank == left) sel[3] = (unsigned)i;
            acc += total;
            if (acc >= left) break;  // uniform
        }
        __syncthreads();
        r.cut = (int)sel[3];
    }
    __syncthreads();  // sel / hist are free again
    return r;
}

#define TOPK_THREADS 512  // src/cuda/launch.rs TOPK_THREADS
// One row's Quest plan (the body of kvs_quest_topk, shared with PRR's kvs_prr_select): writes the plan
// entries to e and returns their count, or -1 for a sequence that is not a decode row. Block-wide.
__device__ __forceinline__ int quest_topk_row(const Batch& b, const SeqRow& r, int s, int h, int hk, int budget, int page, int sink, const float* scores,
                                              int maxp, unsigned* e, int cap, int smem_keys, unsigned* skey, unsigned* hist, unsigned* sel, int* cnt) {
    if (!r.decode) return -1;
    if (r.hi < r.lo) return 0;
    const int fp = r.lo / page;
    const int np = min(r.hi / page - fp + 1, maxp);
    const int k = max(budget / page + (budget % page != 0), 1);
    const float* sc = scores + (i64)(s * hk + h) * maxp;
    if (np <= k) {
        const int n = min(np, cap);
        for (int i = threadIdx.x; i < n; i += blockDim.x) e[i] = fp + i;
        return n;
    }
    const int last = np - 1;
    const int sinkp = sink / page + (sink % page != 0);
    const int forced = min(max(sinkp - fp, 0), last);
    const int m = min(max(k - 1 - forced, 0), last - forced);
    const bool staged = np <= smem_keys;
    if (staged)
        for (int i = threadIdx.x; i < np; i += blockDim.x) skey[i] = kvs_order_key(sc[i]);
    __syncthreads();
    // Candidates forced <= i < last, larger order key first (higher score; equal scores: the later page).
    auto key_of = [&](int i) { return staged ? skey[i] : kvs_order_key(sc[i]); };
    TopCut tc{0u, last};
    if (m > 0) tc = topk32(forced, last, m, key_of, hist, cnt, sel);
    auto keep = [&](int i) {
        if (i < forced || i == last) return true;
        if (m == 0) return false;
        const unsigned kk = key_of(i);
        return kk > tc.thr || (kk == tc.thr && i >= tc.cut);
    };
    return compact(np, keep, [&](int i) { return (unsigned)(fp + i); }, e, cap, cnt);
}

// Quest, step 2: keep the decode token's page, the pages holding the first `sink` positions, and the best
// other pages (score descending, ties: the later page) up to ceil(budget / page) pages, as quest_pages.
// Top-k by topk32 over order keys staged in dynamic shared memory (`smem_keys` of them fit; longer rows
// read the scores from global memory instead). One CTA per (KV head, sequence).
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) kvs_quest_topk(Batch b, int hk, int budget, int page, int sink, const float* scores, int maxp,
                                                                          unsigned* plan, i64 p_s, i64 p_h, int* plan_len, int cap, i64 row_bytes,
                                                                          int count, int smem_keys, unsigned long long* ctr) {
    extern __shared__ unsigned skey[];
    __shared__ unsigned hist[256];
    __shared__ unsigned sel[4];
    __shared__ int cnt[TOPK_THREADS / 32 + 1];
    __shared__ unsigned long long red[32];
    const int s = blockIdx.y, h = blockIdx.x;
    const SeqRow r = seq_row(b, s);
    unsigned* e = plan + s * p_s + h * p_h;
    const int n = quest_topk_row(b, r, s, h, hk, budget, page, sink, scores, maxp, e, cap, smem_keys, skey, hist, sel, cnt);
    __syncthreads();
    if (threadIdx.x == 0) plan_len[s * hk + h] = n;
    if (n < 0 || r.hi < r.lo || !count) return;  // a later stage (top-p) makes the final plan and counts it
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
