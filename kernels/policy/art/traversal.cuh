// ART's run-time termination inside the tensor-core attention kernel: the traversal hook of
// kernels/attention_mma.cu (TRAVERSAL_HOOK; src/policy/art/cuda.rs puts this file in front of the kernel).
// docs/policies.md "art" defines it; src/policy/art/mod.rs is the same decision on the CPU.
//
// The kernel needs PLAN=1, NWARPS=4 (one round of the 4 warps x 16 keys = one ART tile of 64 plan slots)
// and GQ=GROUP (one CTA per KV head). The plan is walked in ART's recency order (its sink entries, then
// the others newest first) or in the priority order kvs_art_priority wrote (priority.cu); after each
// round every warp publishes its lanes' leading accumulator element (row r = lane/4, dim 2*(lane%4)) with
// its running max and row sum, one __syncthreads, and every warp computes the same CTA-normalised probe
// and the same decision (lane sums in the xor-butterfly order, each operation rounded on its own), so the
// CTA stops as a whole. With art(segment=K) a split is one segment (a whole number of tiles): each
// terminates on its own from x(0) = 0, and the combine merges them by LSE, as the CPU engine does.
// Without it (one segment) a row split over several CTAs walks its traversal split-parallel (`joint`):
// every round's probe partial is written out, the row's last split decides (art_decide) and re-runs the
// split its stop falls in (the kernel's pass 1); one split leaves the loop at the stop. The last split
// also counts the blocks no visited tile reached (art_count_blocks).
//
// Compile-time parameters: the kernel's; ART_NOPROBE=1 (benchmarks only) keeps ART's order and splits
// without the detector.
#pragma once
#include "common.cuh"
#include "decide.cuh"
#include "block_reduce.cuh"
#include "mma_tile.cuh"

#if NWARPS != 4 || GQ != GROUP || !PLAN
#error "ART's traversal needs PLAN=1, NWARPS=4 (a round = one 64-slot tile) and GQ=GROUP"
#endif
#ifndef ART_NOPROBE
#define ART_NOPROBE 0  // benchmarks only: ART's order and splits without the detector
#endif

// Rust: src/policy/art/cuda.rs ArtLaunch (a test compares the layouts).
// ART's launch arguments (the kernel's TraversalArgs, passed by value after `mode`). patience < 0: never
// stop (patience = inf).
struct ArtArgs {
    float tau, phi;
    int patience, sink_limit;
    unsigned long long* ctr;  // the layer's device counters (kernels/include/decide.cuh CTR_*)
    int* tiles_out;           // per (sequence, KV head, split): tiles visited
    int hk;
    int segment;              // keys per ART segment, 0 = one (host planning; the kernel reads its split)
    // Priority order (order=priority behind a scored selector): the plan's entries in visiting order,
    // same layout as the plan (kvs_art_priority, priority.cu); NULL = recency order.
    const unsigned* order;
    const int* inv;           // the order's inverse (the block count, art_count_blocks below)
    // One segment over several splits (the split-parallel traversal): every round's probe partial,
    // [seq][kv head][tmax][48] f32 (32 numerators, 8 row sums, 8 running maxima), and the rows' arrival
    // counters [seq][kv head] (zero before the launch; the last split of a row resets its own).
    float* probe;
    int* arrive;
    int tmax, pad;
};

#define ART_PR (GQ < 8 ? GQ : 8)  // probed rows
__device__ __forceinline__ float art_lane_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Merges partial probe state (ln, ld, lm) into (pn, pd, pm): numerator, row sum, running max (base 2).
__device__ __forceinline__ void art_merge(float& pn, float& pd, float& pm, float ln, float ld, float lm) {
    const float mm = fmaxf(pm, lm);
    const float a = pm == -INFINITY ? 0.f : exp2f(pm - mm), b = lm == -INFINITY ? 0.f : exp2f(lm - mm);
    pn = pn * a + ln * b;
    pd = pd * a + ld * b;
    pm = mm;
}

// The split-parallel traversal's decision (the split that finishes a row last, all NWARPS * 32 threads):
// from every round's probe partial `pr` ([T][48]: the split's running state after that round, 32
// numerators, 8 row sums, 8 maxima) the probe x(t) of the whole traversal's running output after tile t
// (the splits before t's merged with t's own), Eq. 2's stability of every tile against the one before,
// and the first tile where `patience` consecutive tiles were stable: the stop tile, or -1. Same definition
// as the sequential decision (traversal_round below) and the CPU engine (docs/policies.md "art"); the arithmetic differs (merge
// order, exp2f, fused products), which the agreement contract bounds. `sm`: nsplit * 48 floats of shared
// memory. Tiles go to 16 groups of 8 lanes (a lane holds its probe row's 4 elements), each group a
// contiguous range of tiles, summarised (leading stable run, trailing run, first stop after a break) and
// chained by one thread.
__device__ int art_decide(const float* pr, int T, int R, int nsplit, int nkeys, float tau, float phi, int patience, float* sm) {
    __shared__ int sm_grp[NTHREADS / 8][5];
    __shared__ int sm_stop;
    const int chunk = R * 64;
    // Each split's final partial (its last round), then the exclusive prefix over splits in place.
    for (int i = threadIdx.x; i < nsplit * 48; i += NTHREADS) {
        const int sp = i / 48, e = i % 48;
        const int end = sp == nsplit - 1 ? nkeys : min((sp + 1) * chunk, nkeys);
        const int rounds = end > sp * chunk ? (end - sp * chunk + 63) >> 6 : 0;
        sm[i] = rounds > 0 ? __ldcg(pr + (i64)(sp * R + rounds - 1) * 48 + e) : (e < 40 ? 0.f : -INFINITY);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const int j = threadIdx.x, rr = j >> 2;
        float pn = 0.f, pd = 0.f, pm = -INFINITY;
        for (int sp = 0; sp < nsplit; ++sp) {
            float* q = sm + sp * 48;
            const float ln = q[j], ld = q[32 + rr], lm = q[40 + rr];
            __syncwarp();
            q[j] = pn;
            if ((j & 3) == 0) {
                q[32 + rr] = pd;
                q[40 + rr] = pm;
            }
            __syncwarp();
            art_merge(pn, pd, pm, ln, ld, lm);
        }
    }
    __syncthreads();
    const int g = threadIdx.x >> 3, i = threadIdx.x & 7;
    const int Tg = (T + NTHREADS / 8 - 1) / (NTHREADS / 8), t0 = g * Tg, t1 = min(T, t0 + Tg);
    // x(tt) of probe row i (lanes 4i .. 4i + 3); 0 before the first tile and for rows not probed.
    auto xat = [&](int tt, float x[4]) {
        x[0] = x[1] = x[2] = x[3] = 0.f;
        if (tt < 0 || tt >= T || i >= ART_PR) return;
        const float* P = sm + (tt / R) * 48;
        const float* L = pr + (i64)tt * 48;
        const float4 ln = __ldcg(reinterpret_cast<const float4*>(L + 4 * i));
        float pd = P[32 + i], pm = P[40 + i];
        const float lnv[4] = {ln.x, ln.y, ln.z, ln.w};
        const float mm = fmaxf(pm, __ldcg(L + 40 + i));
        const float a = pm == -INFINITY ? 0.f : exp2f(pm - mm), b = __ldcg(L + 40 + i) == -INFINITY ? 0.f : exp2f(__ldcg(L + 40 + i) - mm);
        const float den = pd * a + __ldcg(L + 32 + i) * b;
#pragma unroll
        for (int c = 0; c < 4; ++c) x[c] = (P[4 * i + c] * a + lnv[c] * b) / den;
    };
    float xp[4], xc[4];
    xat(t0 - 1, xp);
    int lead = 0, run = 0, inner = -1;
    bool broke = false;
    for (int n = 0; n < Tg; ++n) {  // the same count in every lane (shuffles below)
        const int tt = t0 + n;
        xat(tt < t1 ? tt : T, xc);
        float dd = 0.f, aa = 0.f, bb = 0.f, ab = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float dl = xc[c] - xp[c];
            dd += dl * dl;
            aa += xp[c] * xp[c];
            bb += xc[c] * xc[c];
            ab += xp[c] * xc[c];
        }
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) {
            dd += __shfl_xor_sync(0xffffffffu, dd, o);
            aa += __shfl_xor_sync(0xffffffffu, aa, o);
            bb += __shfl_xor_sync(0xffffffffu, bb, o);
            ab += __shfl_xor_sync(0xffffffffu, ab, o);
        }
        if (tt < t1) {
            const float cosv = (aa == 0.f && bb == 0.f) ? 1.f : ((aa == 0.f || bb == 0.f) ? 0.f : ab / (sqrtf(aa) * sqrtf(bb)));
            const bool stable = sqrtf(dd) < tau && 1.f - cosv < phi;
            if (!broke) {
                if (stable) ++lead;
                else broke = true;
            }
            run = stable ? run + 1 : 0;
            if (broke && inner < 0 && patience > 0 && run >= patience) inner = tt;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) xp[c] = xc[c];
    }
    if (i == 0) {
        sm_grp[g][0] = lead;
        sm_grp[g][1] = !broke;
        sm_grp[g][2] = inner;
        sm_grp[g][3] = run;
        sm_grp[g][4] = max(t1 - t0, 0);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // Chain the groups in order: a run carried in plus a group's leading run may reach patience.
        int c = 0, stop = -1;
        for (int k = 0; patience > 0 && k < NTHREADS / 8; ++k) {
            if (sm_grp[k][4] == 0) continue;
            if (c + sm_grp[k][0] >= patience) {
                stop = k * Tg + (patience - c - 1);
                break;
            }
            if (!sm_grp[k][1]) {
                if (sm_grp[k][2] >= 0) {
                    stop = sm_grp[k][2];
                    break;
                }
                c = sm_grp[k][3];
            } else {
                c += sm_grp[k][4];
            }
        }
        sm_stop = stop;
    }
    __syncthreads();
    return sm_stop;
}

// ART's block count, once every split of a row's attention has run (traversal_row_done: the CTA that
// finishes a (sequence, KV head) last calls it): the blocks of the row's plan that no visited tile
// reached, added to CTR_BLOCKS_SKIPPED_TERMINATION and taken back from CTR_BLOCKS_VISITED (which the
// selection counted for the whole plan). The plan is in position order, each entry within one block; an
// entry's visit index is the priority order's inverse (`inv`, kvs_art_priority) or ART's recency order
// (sink entries, then newest first). An entry counts as visited when its first slot lies in its
// segment's visited prefix (`done[k]` tiles of 64 slots of segment k, `chunk` slots each), or a later
// segment it reaches visited anything. All threads of the CTA call it (blockDim a multiple of 32).
__device__ __forceinline__ void art_count_blocks(int lo, int hi, int bs_log2, const unsigned* pe, int pl, int ulog2, int sink_limit, const int* done,
                                                 int nsplit, i64 chunk, const int* iv, unsigned long long* ctr, unsigned long long* red) {
    const int per = 1 << ulog2;
    int nsink = 0;
    while (!iv && nsink < pl && (int)(pe[nsink] << ulog2) < sink_limit) ++nsink;
    auto visited = [&](int j) {
        const i64 a = (i64)(iv ? iv[j] : (j < nsink ? j : nsink + (pl - 1 - j))) * per;
        const int k0 = (int)(a / chunk);
        if (k0 >= nsplit) return false;
        if (a - (i64)k0 * chunk < (i64)__ldcg(done + k0) * 64) return true;
        const int k1 = (int)min((a + per - 1) / chunk, (i64)nsplit - 1);
        for (int k = k0 + 1; k <= k1; ++k)
            if (__ldcg(done + k) > 0) return true;
        return false;
    };
    // The block of entry j's visible part, or -1.
    auto block_of = [&](int j) {
        const int pos = (int)(pe[j] << ulog2);
        const int a = max(pos, lo), b = min(pos + per - 1, hi);
        return a <= b ? a >> bs_log2 : -1;
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

// ---- The hook (kernels/attention_mma.cu's header says when the kernel calls each) ----
#define TRAVERSAL_HOOK 1
typedef ArtArgs TraversalArgs;

// A row's visiting order: the priority order's row (NULL: recency order, whose sink entries are the
// plan's prefix of `nsink` entries, the plan being in position order).
struct TraversalOrder {
    const unsigned* ord;
    int nsink;
};

// `row_off`: the row's offset in the plan's layout.
__device__ __forceinline__ TraversalOrder traversal_order(const ArtArgs& art, const unsigned* pe, int pl, int ulog2, i64 row_off) {
    int nsink = 0;
    while (!art.order && nsink < pl && (int)(pe[nsink] << ulog2) < art.sink_limit) ++nsink;
    TraversalOrder o;
    o.ord = art.order ? art.order + row_off : nullptr;
    o.nsink = nsink;
    return o;
}

// The plan entry visited i-th: the priority order's, or entries [0, nsink) then the others newest first.
__device__ __forceinline__ unsigned traversal_entry(const TraversalOrder& o, const unsigned* pe, int pl, int i) {
    return o.ord ? o.ord[i] : pe[(i) < o.nsink ? (i) : pl - 1 - ((i) - o.nsink)];
}

// The row's traversal across its splits: whether they are one segment judged together once all ran
// (`joint`), and the row's record then (tiles visited, tiles).
struct TraversalRow {
    bool joint;
    int visited, total;
};

__device__ __forceinline__ TraversalRow traversal_row(const ArtArgs& art, int nsplit) {
    TraversalRow r;
    r.joint = art.segment == 0 && nsplit > 1;
    r.visited = 0;
    r.total = 0;
    return r;
}

// One split's state: x(t - 1) of this lane, the stable-tile run, the tiles observed (x(0) = 0).
struct TraversalSplit {
    float prev;
    int run, done;
};

__device__ __forceinline__ TraversalSplit traversal_split_start() {
    TraversalSplit s;
    s.prev = 0.f;
    s.run = 0;
    s.done = 0;
    return s;
}

// After round k of the split (every warp ran its tile of it; the split's keys start at s_lo): the probe
// and the decision; true when the traversal stops here. `o`, `l0s`, `m0`: this lane's accumulators, row
// sum and running max (row r = lane / 4).
__device__ __forceinline__ bool traversal_round(const ArtArgs& art, const TraversalRow& hr, TraversalSplit& st, int k, float (*o)[4], float l0s, float m0,
                                                float v_scale, int lane, int warp, int seq, int kvh, int s_lo) {
#if ART_NOPROBE
    return false;
#else
    const int r = lane >> 2, qd = lane & 3;
    __shared__ float sm_art[2][NWARPS][32][3];
    // This lane's probe element and its row's running max and sum (the quad's partial sums added).
    float lq = l0s;
    lq += __shfl_xor_sync(0xffffffffu, lq, 1);
    lq += __shfl_xor_sync(0xffffffffu, lq, 2);
    float* slot = sm_art[k & 1][warp][lane];  // double-buffered: one barrier per round
#if KV8
    // The probe element (head r, channel 2 qd, as over 16-bit caches) in the O^T tiles (the store
    // below): channels 0..7 are lane (0, h / 2)'s words 0 and 1 (kv8_vw), channel 2 qd of head h
    // its tile qd, column h % 2. Fetched by shuffles; times v_scale, the CPU's values of V.
    static_assert(KV8_GF > 0 || KV8_GR >= 2, "channels 0..7 in lane row 0's words 0 and 1");
    float pe = 0.f;
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const float v = __shfl_sync(0xffffffffu, o[t][j], r >> 1);
            if (t == qd && j == (r & 1)) pe = v;
        }
    slot[0] = pe * v_scale;
#else
    slot[0] = o[0][0];
#endif
    slot[1] = lq;
    slot[2] = m0;
    __syncthreads();
    float M = -INFINITY, num = 0.f, den = 0.f;
    if (r < ART_PR) {
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, sm_art[k & 1][w][lane][2]);
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float mw = sm_art[k & 1][w][lane][2];
            const float wt = mw == -INFINITY ? 0.f : exp2f(mw - M);
            num = __fadd_rn(num, __fmul_rn(sm_art[k & 1][w][lane][0], wt));
            den = __fadd_rn(den, __fmul_rn(sm_art[k & 1][w][lane][1], wt));
        }
    }
    if (hr.joint) {
        // The split's running partial after its round k = global tile s_lo / 64 + k (chunk is a
        // whole number of tiles); the decision waits for every split (after the loop).
        if (warp == 0) {
            float* pp = art.probe + ((i64)(seq * art.hk + kvh) * art.tmax + (s_lo >> 6) + k) * 48;
            pp[lane] = num;
            if (qd == 0) {
                pp[32 + r] = den;
                pp[40 + r] = M;
            }
        }
        return false;
    }
    const float x = r < ART_PR ? __fdiv_rn(num, den) : 0.f;
    const float dl = __fsub_rn(x, st.prev);
    const float dd = art_lane_sum(__fmul_rn(dl, dl));
    const float aa = art_lane_sum(__fmul_rn(st.prev, st.prev));
    const float bb = art_lane_sum(__fmul_rn(x, x));
    const float ab = art_lane_sum(__fmul_rn(st.prev, x));
    const float cosv = (aa == 0.f && bb == 0.f) ? 1.f : ((aa == 0.f || bb == 0.f) ? 0.f : __fdiv_rn(ab, __fmul_rn(__fsqrt_rn(aa), __fsqrt_rn(bb))));
    const bool stable = __fsqrt_rn(dd) < art.tau && __fsub_rn(1.f, cosv) < art.phi;
    st.run = stable ? st.run + 1 : 0;
    st.prev = x;
    st.done = k + 1;
    return art.patience > 0 && st.run >= art.patience;  // uniform: every warp decided the same
#endif
}

// The split's record once its loop ended (pass 0): per (sequence, KV head, segment) the tiles visited,
// from which the last split counts the blocks no visited tile reached (CTR 8, art_count_blocks), and the
// tiles visited and in this split's part of the traversal (CTR 9, 10). The joint traversal writes them
// once it decided (traversal_row_done).
__device__ __forceinline__ void traversal_split_done(const ArtArgs& art, const TraversalRow& hr, TraversalSplit& st, int seq, int kvh, int split, int nsplit, int nloop) {
#if ART_NOPROBE
    st.done = nloop;
#endif
    if (threadIdx.x == 0 && !hr.joint) {
        art.tiles_out[(seq * art.hk + kvh) * nsplit + split] = st.done;
        atomicAdd(art.ctr + 9, (unsigned long long)st.done);
        atomicAdd(art.ctr + 10, (unsigned long long)nloop);
    }
}

// Once every split of the row has run (pass 0, nsplit > 1): true in the split that arrives last (the
// row's arrival counter is reset for the next launch), false in the others, which are done.
__device__ __forceinline__ bool traversal_last_split(const ArtArgs& art, int seq, int kvh, int nsplit) {
    __shared__ int sm_art_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* arr = art.arrive + seq * art.hk + kvh;
        sm_art_last = atomicAdd(arr, 1) == nsplit - 1;
        if (sm_art_last) *arr = 0;
    }
    __syncthreads();
    if (!sm_art_last) return false;
    __threadfence();
    return true;
}

// Where the traversal stopped: the split holding the stop (-1: none, or not decided here), the keys of
// it visited, and whether that is fewer than the split attended (so it must attend them again).
struct TraversalStop {
    int split, keys;
    bool rerun;
};

// The joint traversal's decision in the row's last split (pass 0, all threads; `sm`: the kernel's dynamic
// shared memory, free once the warps' merge is done): from every round's probe partial, the stop tile.
__device__ __forceinline__ TraversalStop traversal_decide(const ArtArgs& art, TraversalRow& hr, int seq, int kvh, int nkeys, int chunk, int nsplit, float* sm) {
    TraversalStop s;
    s.split = -1;
    s.keys = 0;
    s.rerun = false;
    if (!hr.joint) return s;
    const int T = (nkeys + 63) >> 6, R = chunk >> 6;
#if ART_NOPROBE
    const int stop = -1;
#else
    const int stop = art_decide(art.probe + (i64)(seq * art.hk + kvh) * art.tmax * 48, T, R, nsplit, nkeys, art.tau, art.phi, art.patience, sm);
#endif
    hr.total = T;
    hr.visited = stop >= 0 ? stop + 1 : T;
    if (stop >= 0) {
        const int ss = stop / R, ks = stop - ss * R;
        const int rounds = (min(ss == nsplit - 1 ? nkeys : (ss + 1) * chunk, nkeys) - ss * chunk + 63) >> 6;
        s.split = ss;
        s.keys = (ks + 1) * 64;
        s.rerun = ks + 1 < rounds;
    }
    return s;
}

// The row's record once it is final (the last split, after any re-run; all threads): the joint
// traversal's tiles, then the blocks of the plan no visited tile reached (art_count_blocks).
__device__ __forceinline__ void traversal_row_done(const ArtArgs& art, const TraversalRow& hr, int lo, int hi, int bs_log2, const unsigned* pe, int pl, int ulog2,
                                                   i64 row_off, int seq, int kvh, int nsplit, int chunk) {
    __shared__ unsigned long long sm_art_red[32];
    if (hr.joint && threadIdx.x == 0) {
        art.tiles_out[seq * art.hk + kvh] = hr.visited;  // one segment: one count per row
        atomicAdd(art.ctr + CTR_TRAVERSAL_TILES, (unsigned long long)hr.visited);
        atomicAdd(art.ctr + CTR_TRAVERSAL_TILES_TOTAL, (unsigned long long)hr.total);
    }
    __syncthreads();
    {
        const int nseg = hr.joint ? 1 : nsplit;
        const int* inv = art.inv ? art.inv + row_off : nullptr;
        art_count_blocks(lo, hi, bs_log2, pe, pl, ulog2, art.sink_limit, art.tiles_out + (seq * art.hk + kvh) * nseg, nseg,
                         hr.joint ? ((i64)1 << 40) : (i64)chunk, inv, art.ctr, sm_art_red);
    }
}
