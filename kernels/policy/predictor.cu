// AttentionPredictor on the device (src/cuda/predictor.rs): the block-attention history per (sequence
// slot, KV head), the calibration schedule, the CNN's forward pass, the selection and the history update,
// making the decisions of the CPU engine (src/policy/predictor/{cpu,mod}.rs) by the agreement contract
// (design.md): the history rows bit for bit (the decisions' arithmetic, decide.cuh, as the CPU's
// history_row; this module is compiled with --fmad=false), the CNN's second convolution on the tensor cores
// in 3xTF32 (a stated error bound, docs/policies.md), so a set may differ from the CPU's at borderline
// blocks only. Batch geometry, radix top-k, accounting and SnapKV's scoring arithmetic
// (wp_dot, WP_TP) come from kernels/include/.
//
// State of one layer (allocated per layer outside capture, indexed by the slot map's slot, kernels/slots.cu):
//   hdr  [max_seqs][hk][8]   generation stamp, rows pushed (count), steps since calibration, rows pushed
//                            since the last prediction, the last prediction's crop (start, width), z valid;
//   lens [max_seqs][hk][H]   blocks of each ring row; ring [max_seqs][hk][H][wc] block scores, row a (the
//                            a-th pushed, counting from the seed) at a mod H;
//   zc   [max_seqs][hk][H][wc] the CNN's per-row outputs z (before the time average) of the last
//                            prediction, image row t at absolute row count - H + t (mod H): a prediction
//                            recomputes only the entries whose 5x5 receptive field changed.
// A stamp that differs from the slot's generation means a new sequence: the state reads as empty.
//
// A decode step (layer call): kvs_pred_prepare (mode per (sequence, KV head), schedule), kvs_pred_conv
// (z rows), kvs_pred_average (the time average: scores), kvs_pred_select (top-k, token plan, counters),
// kvs_pred_scores x3 (the new history row: row maxima, fixed-point normalisers, weights max-pooled into
// the ring row; a decode row's keys read once) and kvs_pred_finish (ring bookkeeping); the attention reads the plan. Prefill chunks (q_len > 1) take the
// SEED path of the same kernels: their last min(q_len, H) rows become the history.

#include "common.cuh"
#include "params.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"
#include "weights_pass.cuh"
#include "kv_load.cuh"

// The predictor's layer state and parameters, passed by value; mirrored by `StateArg` and `SpecArg` in
// src/policy/predictor/cuda.rs (a test, src/cuda/kernel_src.rs, compares sizes and field offsets).
struct PredState {
    int* hdr;
    int* lens;
    float* ring;
    float* zc;
    int H, wc, hk, pad;
};

struct PredSpec {
    int budget, block, calib, sink, local, pad;
};

#ifndef PRED_PT
#define PRED_PT 128  // image columns per CTA of kvs_pred_conv
#endif
#define PRED_W1 0
#define PRED_B1 (PRED_C1 * 9)
#define PRED_W2 (PRED_B1 + PRED_C1)
#define PRED_B2 (PRED_W2 + PRED_C2 * PRED_C1 * 9)
#define PRED_W3 (PRED_B2 + PRED_C2)
#define PRED_B3 (PRED_W3 + PRED_C2)
#define PRED_NP (PRED_B3 + 1)

// Modes of a (sequence, KV head) in a call.
#define PM_SKIP -1   // not a decode row and nothing to seed
#define PM_DENSE 0   // decode row without a state slot (map full): every visible position, no state
#define PM_NOHIST 1  // decode row with no history: every visible position; pushes the full row
#define PM_CALIB 2   // predicted plan; pushes the full row (calibration step)
#define PM_PRED 3    // predicted plan; pushes the attended positions' row
#define PM_SEED 4    // prefill chunk with a slot: the history restarts from its last rows
#define PM_EMPTY 5   // decode row that sees nothing (bad metadata)

#define HDR_GEN 0
#define HDR_COUNT 1
#define HDR_SINCE 2
#define HDR_PUSHED 3
#define HDR_START 4
#define HDR_WIDTH 5
#define HDR_ZVALID 6
#define HDR_WORDS 8

__device__ __forceinline__ int pred_mod(long long a, int H) {
    const long long r = a % H;
    return (int)(r < 0 ? r + H : r);
}

__device__ __forceinline__ float pred_relu(float v) { return v > 0.0f ? v : 0.0f; }

// predictor::crop: the blocks between the sink's and the local window's.
__device__ __forceinline__ void pred_crop(int nb, const PredSpec& ps, int& start, int& width) {
    const int s0 = ps.sink / ps.block;
    int e = max(nb - ps.local / ps.block, 0);
    e = max(e, s0);
    start = min(s0, nb);
    width = e - s0;
}

// The crop of a (sequence, KV head) whose CNN runs this call (CALIB / PRED): false for the others.
__device__ __forceinline__ bool pred_cnn_crop(const Batch& b, const PredSpec& ps, const int* mode, int hk, int s, int h, int& start, int& width) {
    const int m = mode[s * hk + h];
    if (m != PM_CALIB && m != PM_PRED) return false;
    const SeqRow r = seq_row(b, s);
    pred_crop((r.hi + ps.block) / ps.block, ps, start, width);
    return true;
}

__device__ __forceinline__ int pred_lo(const Batch& b, int pos) { return (b.window > 0 && pos + 1 - b.window > 0) ? pos + 1 - b.window : 0; }

// Mode and schedule of every (sequence, KV head): one CTA per sequence. A stamp from another generation
// resets the header (new or reused slot); a prefill chunk resets it for its seed. `pctr` [2]: calibration
// and predicted steps (the CPU's refresh_full_steps / refresh_partial_steps).
extern "C" __global__ void kvs_pred_prepare(Batch b, PredState st, PredSpec ps, const int* slot, const unsigned* slot_gen, int* mode,
                                            unsigned long long* pctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    const int s = blockIdx.x, hk = st.hk;
    const SeqRow r = seq_row(b, s);
    const int sl = slot[s];
    const unsigned gen = slot_gen[s];
    for (int h = threadIdx.x; h < hk; h += blockDim.x) {
        int m;
        if (!r.decode) {
            const bool seed = r.q_len > 1 && sl >= 0 && r.hi + 1 >= r.q_len && r.t + r.q_len <= b.num_tokens;
            m = seed ? PM_SEED : PM_SKIP;
            if (seed) {
                int* hd = st.hdr + ((long long)sl * hk + h) * HDR_WORDS;
                hd[HDR_GEN] = (int)gen;
                for (int k = 1; k < HDR_WORDS; ++k) hd[k] = 0;
            }
        } else if (sl < 0) {
            m = r.hi >= r.lo ? PM_DENSE : PM_EMPTY;
        } else {
            int* hd = st.hdr + ((long long)sl * hk + h) * HDR_WORDS;
            if ((unsigned)hd[HDR_GEN] != gen) {
                hd[HDR_GEN] = (int)gen;
                for (int k = 1; k < HDR_WORDS; ++k) hd[k] = 0;
            }
            if (r.hi < r.lo) {
                m = PM_EMPTY;
            } else {
                const int since = hd[HDR_SINCE] + 1;
                const bool nohist = hd[HDR_COUNT] == 0;
                const bool cal = nohist || since >= ps.calib;
                hd[HDR_SINCE] = cal ? 0 : since;
                m = nohist ? PM_NOHIST : (cal ? PM_CALIB : PM_PRED);
                atomicAdd(&pctr[cal ? 0 : 1], 1ull);
            }
        }
        mode[s * hk + h] = m;
    }
}

// TF32 operand of a tensor-core MMA: x rounded to nearest (ties away) to 10 mantissa bits.
__device__ __forceinline__ unsigned pred_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// x as hi + lo, both TF32 (3xTF32: hi*hi + hi*lo + lo*hi gives f32 products to about 2^-22).
__device__ __forceinline__ void pred_split(float x, unsigned& hi, unsigned& lo) {
    hi = pred_tf32(x);
    lo = pred_tf32(x - __uint_as_float(hi));
}
// c += a * b, m16n8k8, TF32 operands, f32 accumulation (row-major A, column-major B).
__device__ __forceinline__ void pred_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#define PRED_K (PRED_C1 * 9)         // the second convolution's reduction: (channel, dt, db)
#define PRED_K8 ((PRED_K + 7) / 8)   // its k-steps of 8 (zero-padded)
#define PRED_MT ((PRED_C2 + 15) / 16)  // its output channels in tiles of 16 (zero-padded)

// The CNN's per-row outputs z[t][b] of the rows and columns whose receptive field changed since the last
// prediction (all of them after a seed), into zc. Grid (CTAs per (sequence, KV head), hk, seqs); PRED_PT
// threads; a CTA stages the weights once, then walks the (image row, column tile) items blockIdx.x,
// blockIdx.x + gridDim.x, ... and skips at once those with nothing to recompute. Per image row: the first convolution in f32 (one value per thread and pass, the CPU's
// order), then the second as an implicit GEMM on the tensor cores, [C2 x 9 C1] weights times the
// [9 C1 x PT] patches of the first layer's outputs (each warp 32 columns, m16n8k8 MMAs in 3xTF32: both
// operands split into TF32 hi + lo, hi*hi + hi*lo + lo*hi accumulated in f32), then bias, ReLU and the 1x1
// convolution over the channels (a warp-shuffle sum). Device arithmetic and its error bound:
// docs/policies.md (predictor, "On the GPU").
extern "C" __global__ void __launch_bounds__(PRED_PT) kvs_pred_conv(Batch b, PredState st, PredSpec ps, const float* wts, const int* slot,
                                                                      const int* mode) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ float ws[PRED_NP];
    __shared__ float xs[5][PRED_PT + 4];
    __shared__ float ys[PRED_C1][3][PRED_PT + 2];
    const int s = blockIdx.z, hk = st.hk, h = blockIdx.y, H = st.H;
    int start, width;
    if (!pred_cnn_crop(b, ps, mode, hk, s, h, start, width)) return;
    const int tiles = (width + PRED_PT - 1) / PRED_PT;
    const long long sh = (long long)slot[s] * hk + h;
    const int* hd = st.hdr + sh * HDR_WORDS;
    const int count = hd[HDR_COUNT], pushed = hd[HDR_PUSHED];
    const bool reuse = hd[HDR_ZVALID] != 0 && hd[HDR_START] == start && pushed + 4 < H;
    const int wmin = min(hd[HDR_WIDTH], width);
    const int* lens = st.lens + sh * H;
    const float* ring = st.ring + sh * H * (long long)st.wc;
    float* zc = st.zc + sh * H * (long long)st.wc;
    for (int i = threadIdx.x; i < PRED_NP; i += blockDim.x) ws[i] = wts[i];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g8 = lane >> 2, tq = lane & 3;
    const float* yflat = &ys[0][0][0];
    // Image value at (row tt, column bb); 0 outside the image (padding) and for rows never pushed.
    const int rbase = pred_mod((long long)count - H, H);  // ring row of image row 0
    auto xv = [&](int tt, int bb) {
        if (tt < 0 || tt >= H || bb < 0 || bb >= width) return 0.0f;
        if (count - H + tt < 0) return 0.0f;
        const int ri = rbase + tt < H ? rbase + tt : rbase + tt - H;
        const int c = start + bb;
        if (c >= min(lens[ri], st.wc)) return 0.0f;
        const float v = ring[(long long)ri * st.wc + c];
        return v > 0.0f ? v : 0.0f;
    };
    // Offset in ys of reduction index k (channel k / 9, row (k % 9) / 3, column shift k % 3); -1: padding.
    auto koff = [](int k) { return k < PRED_K ? (k / 9) * 3 * (PRED_PT + 2) + ((k % 9) / 3) * (PRED_PT + 2) + k % 3 : -1; };
    for (int item = blockIdx.x; item < H * tiles; item += gridDim.x) {
        const int t = item / tiles, b0 = (item % tiles) * PRED_PT;
        const bool row_reused = reuse && t >= 2 && t + pushed + 2 < H;
        // A reused row keeps every column whose receptive field lies inside the previous crop.
        if (row_reused && b0 + PRED_PT + 2 <= wmin) continue;
        for (int i = threadIdx.x; i < 5 * (PRED_PT + 4); i += blockDim.x) {
            const int rr = i / (PRED_PT + 4), cc = i % (PRED_PT + 4);
            xs[rr][cc] = xv(t - 2 + rr, b0 - 2 + cc);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < PRED_C1 * 3 * (PRED_PT + 2); i += blockDim.x) {
            const int c = i / (3 * (PRED_PT + 2)), rem = i % (3 * (PRED_PT + 2)), rr = rem / (PRED_PT + 2), cc = rem % (PRED_PT + 2);
            const int tt = t - 1 + rr, bb = b0 - 1 + cc;
            float v = 0.0f;
            if (tt >= 0 && tt < H && bb >= 0 && bb < width) {
                float acc = ws[PRED_B1 + c];
#pragma unroll
                for (int dt = 0; dt < 3; ++dt)
#pragma unroll
                    for (int db = 0; db < 3; ++db) acc += ws[PRED_W1 + c * 9 + dt * 3 + db] * xs[rr + dt][cc + db];
                v = pred_relu(acc);
            }
            ys[c][rr][cc] = v;
        }
        __syncthreads();
        // The warp's 32 columns: acc[mi][ni] holds channels mi*16 + (g8, g8 + 8), columns ni*8 + 2 tq (+1).
        float acc[PRED_MT][4][4];
#pragma unroll
        for (int mi = 0; mi < PRED_MT; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
        for (int kk = 0; kk < PRED_K8; ++kk) {
            const int k0 = kk * 8 + tq, k1 = k0 + 4;
            unsigned ah[PRED_MT][4], al[PRED_MT][4];
#pragma unroll
            for (int mi = 0; mi < PRED_MT; ++mi) {
                const int r0 = mi * 16 + g8, r1 = r0 + 8;
                const float a0 = r0 < PRED_C2 && k0 < PRED_K ? ws[PRED_W2 + r0 * PRED_K + k0] : 0.0f;
                const float a1 = r1 < PRED_C2 && k0 < PRED_K ? ws[PRED_W2 + r1 * PRED_K + k0] : 0.0f;
                const float a2 = r0 < PRED_C2 && k1 < PRED_K ? ws[PRED_W2 + r0 * PRED_K + k1] : 0.0f;
                const float a3 = r1 < PRED_C2 && k1 < PRED_K ? ws[PRED_W2 + r1 * PRED_K + k1] : 0.0f;
                pred_split(a0, ah[mi][0], al[mi][0]);
                pred_split(a1, ah[mi][1], al[mi][1]);
                pred_split(a2, ah[mi][2], al[mi][2]);
                pred_split(a3, ah[mi][3], al[mi][3]);
            }
            const int o0 = koff(k0), o1 = koff(k1);
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const int cn = warp * 32 + ni * 8 + g8;
                unsigned bh0, bl0, bh1, bl1;
                pred_split(o0 >= 0 ? yflat[o0 + cn] : 0.0f, bh0, bl0);
                pred_split(o1 >= 0 ? yflat[o1 + cn] : 0.0f, bh1, bl1);
#pragma unroll
                for (int mi = 0; mi < PRED_MT; ++mi) {
                    pred_mma(acc[mi][ni], al[mi], bh0, bh1);
                    pred_mma(acc[mi][ni], ah[mi], bl0, bl1);
                    pred_mma(acc[mi][ni], ah[mi], bh0, bh1);
                }
            }
        }
        // Bias, ReLU, the 1x1 convolution: this lane's channels, then the sum over the warp's 8 row groups.
        float zp[4][2];
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) zp[ni][0] = zp[ni][1] = 0.0f;
#pragma unroll
        for (int mi = 0; mi < PRED_MT; ++mi)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int co = mi * 16 + g8 + half * 8;
                if (co >= PRED_C2) continue;
                const float w3 = ws[PRED_W3 + co], b2 = ws[PRED_B2 + co];
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) {
                    zp[ni][0] += w3 * pred_relu(acc[mi][ni][2 * half] + b2);
                    zp[ni][1] += w3 * pred_relu(acc[mi][ni][2 * half + 1] + b2);
                }
            }
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float v = zp[ni][j];
                v += __shfl_xor_sync(0xffffffffu, v, 4);
                v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                const int c = b0 + warp * 32 + ni * 8 + 2 * tq + j;
                if (g8 == 0 && c < width && !(row_reused && c + 2 < wmin)) zc[(long long)(rbase + t < H ? rbase + t : rbase + t - H) * st.wc + c] = v;
            }
        __syncthreads();
    }
}

// The prediction of every CALIB / PRED row: b3 + the mean over the H image rows of z (summed in row
// order), into `scores` [seqs][hk][nbmax] at the crop's blocks. Grid (column tiles of 256, hk, seqs).
extern "C" __global__ void __launch_bounds__(256) kvs_pred_average(Batch b, PredState st, PredSpec ps, const float* wts, const int* slot,
                                                                   const int* mode, float* scores, int nbmax) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    const int s = blockIdx.z, h = blockIdx.y, hk = st.hk, H = st.H;
    int start, width;
    if (!pred_cnn_crop(b, ps, mode, hk, s, h, start, width)) return;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= width) return;
    const long long sh = (long long)slot[s] * hk + h;
    const int count = st.hdr[sh * HDR_WORDS + HDR_COUNT];
    const float* zc = st.zc + sh * H * (long long)st.wc;
    const int rbase = pred_mod((long long)count - H, H);  // ring row of image row 0
    float acc = 0.0f;
    for (int t = 0, ri = rbase; t < H; ++t, ri = ri + 1 == H ? 0 : ri + 1) acc += zc[(long long)ri * st.wc + i];
    scores[(i64)(s * hk + h) * nbmax + start + i] = wts[PRED_B3] + acc * (1.0f / (float)H);
}

// One CTA per (KV head, sequence): the selection from kvs_pred_average's scores (predictor::select: the sink's and the local window's tokens and the best candidate
// blocks by (score, later block), radix top-k), the token plan (increasing positions, clipped to the
// visible range) and the counters. DENSE and NOHIST rows get every visible position. CTA (0, 0) also
// counts the call's rows.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) kvs_pred_select(Batch b, PredState st, PredSpec ps, const float* wts, const int* slot,
                                                                           const int* mode, float* scores, int nbmax, unsigned* plan, i64 p_s,
                                                                           i64 p_h, int* plan_len, int cap, i64 row_bytes, i64 k_row_bytes,
                                                                           unsigned long long* ctr) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ unsigned hist[256];
    __shared__ unsigned wtot[8];
    __shared__ unsigned long long sel_prefix;
    __shared__ int sel_left;
    __shared__ int wsum[TOPK_THREADS / 32];
    __shared__ int total;
    __shared__ unsigned long long red[32];
    const int s = blockIdx.y, h = blockIdx.x, hk = st.hk;
    if (s == 0 && h == 0) rows_count(b, hk, row_bytes, ctr, red);
    const SeqRow r = seq_row(b, s);
    const int m = mode[s * hk + h];
    if (!r.decode || m == PM_SKIP || m == PM_SEED) {
        if (threadIdx.x == 0) plan_len[s * hk + h] = -1;
        return;
    }
    if (m == PM_EMPTY || r.hi < r.lo) {
        if (threadIdx.x == 0) plan_len[s * hk + h] = 0;
        return;
    }
    const int n = r.hi + 1, blk = ps.block, nb = (n + blk - 1) / blk;
    const bool all = m == PM_DENSE || m == PM_NOHIST;
    const int sink_end = min(ps.sink, n), local_start = max(n - ps.local, 0);
    int cb0 = 0, cb1 = 0, mm = 0, cnt = 0, ibits = 1, start = 0, width = 0;
    unsigned long long thr = 0;
    float* sc = scores + (i64)(s * hk + h) * nbmax;
    if (!all) {
        const long long sh = (long long)slot[s] * hk + h;
        int* hd = st.hdr + sh * HDR_WORDS;
        pred_crop(nb, ps, start, width);  // the scores of the crop: kvs_pred_average
        if (threadIdx.x == 0) {
            hd[HDR_START] = start;
            hd[HDR_WIDTH] = width;
            hd[HDR_PUSHED] = 0;
            hd[HDR_ZVALID] = 1;
        }
        cb0 = sink_end >= n ? nb : sink_end / blk;
        cb1 = min((local_start + blk - 1) / blk, nb);
        cnt = max(cb1 - cb0, 0);
        const long long extra = max((long long)ps.budget - (long long)ps.sink - (long long)ps.local, 0ll) / blk;
        mm = (int)min(extra, (long long)cnt);
        while ((1 << ibits) < nb) ++ibits;
    }
    auto key_of = [&](int i) {
        const float v = (i >= start && i < start + width) ? sc[i] : -INFINITY;
        return ((unsigned long long)kvs_order_key(v) << ibits) | (unsigned)i;
    };
    if (!all && mm > 0 && mm < cnt) thr = radix_kth(cb0, cb1, mm, (32 + ibits + 7) / 8, key_of, hist, wtot, sel_prefix, sel_left);
    auto sel = [&](int bk) {
        if (bk < cb0 || bk >= cb1 || mm == 0) return false;
        return mm >= cnt || key_of(bk) >= thr;
    };
    // The plan: positions lo..=hi kept, 64 per thread and pass (popcounts, one block scan per pass).
    unsigned* e = plan + s * p_s + h * p_h;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int c0 = r.lo / 64, c1 = r.hi / 64;
    int base = 0;
    for (int cb = c0; cb <= c1; cb += blockDim.x) {  // uniform trip count
        const int c = cb + threadIdx.x;
        const int p0 = c * 64;
        unsigned long long bits = 0ull;
        if (c <= c1) {
            int last_b = -1;
            bool last_s = false;
            for (int x = 0; x < 64; ++x) {
                const int p = p0 + x;
                if (p < r.lo || p > r.hi) continue;
                bool keep = all || p < sink_end || p >= local_start;
                if (!keep) {
                    const int bk = p / blk;
                    if (bk != last_b) {
                        last_b = bk;
                        last_s = sel(bk);
                    }
                    keep = last_s;
                }
                if (keep) bits |= 1ull << x;
            }
        }
        const int cntb = __popcll(bits);
        int incl = cntb;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) wsum[warp] = incl;
        __syncthreads();
        int before = base + incl - cntb;
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
    const int np = base < cap ? base : cap;
    if (threadIdx.x == 0) plan_len[s * hk + h] = np;
    const unsigned long long vis = (unsigned long long)(r.hi - r.lo + 1);
    if (m == PM_DENSE) {
        // Dense rows (no state slot): counted as the CPU counts dense rows (KV bytes only).
        if (threadIdx.x == 0) atomicAdd(&ctr[CTR_KV_BYTES], vis * (unsigned long long)row_bytes);
        return;
    }
    if (threadIdx.x == 0) {
        atomicAdd(&ctr[CTR_POLICY_ROWS], 1ull);
        atomicAdd(&ctr[CTR_BLOCKS_ELIGIBLE], (unsigned long long)((r.hi >> b.bs_log2) - (r.lo >> b.bs_log2) + 1));
        // K read again for the history row: every visible key on a full row, else the attended ones.
        atomicAdd(&ctr[CTR_KV_BYTES], (m == PM_PRED ? (unsigned long long)np : vis) * (unsigned long long)k_row_bytes);
    }
    __syncthreads();  // the plan's entries are read back by account
    account(e, np, 0, r.lo, r.hi, b.bs_log2, 1, row_bytes, ctr, red);
}

// The history rows: per (sequence, KV head) the weights of its token(s) over their positions (every
// visible one for NOHIST / CALIB / SEED rows, the plan's for PRED rows), as cpu::sparse::history_row,
// max-pooled over the group and each block into the ring row the token pushes. Three phases over the keys
// (as kvs_snap_scores): 0 zeroes the new ring rows and takes each row's largest logit (order-key
// atomicMax, NaN skipped; `rmax` preset to the key of -inf), 1 the fixed-point normalisers (`zfix`,
// `zbad` preset to 0), 2 the weights f32(e / z) (f64 division) into the ring row by atomicMax on their
// bits (non-negative floats order as their bits; NaN and 0 never written). A decode row's phase 0 also
// writes its logits to `lgs`, which phases 1 and 2 read instead of K (one pass over the keys; the same
// values, so the same bits). Grid (key tiles of WP_TP, capped; KV heads; seqs); rows r = token * GROUP +
// query head, `rcap` per (sequence, head). An FP8 cache's keys (KV8) are read as the CPU reads them,
// decoded times `kscale` (kv_load.cuh; unused otherwise).
extern "C" __global__ void __launch_bounds__(WP_THREADS) kvs_pred_scores(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, float softcap,
                                                                           const kv_t* kc, i64 kc0, i64 kc1, i64 kc2, PredState st, PredSpec ps,
                                                                           const int* slot, const int* mode, const unsigned* plan, i64 p_s, i64 p_h,
                                                                           const int* plan_len, int cap, int phase, unsigned* rmax,
                                                                           unsigned long long* zfix, unsigned* zbad, int rcap, float* lgs,
                                                                           int lcap, float kscale) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ float ks[WP_TP][HEAD_DIM + 1];
    __shared__ float qs[GROUP * HEAD_DIM];
    __shared__ float wsh[WP_J][WP_TP];
    const int s = blockIdx.z, h = blockIdx.y, hk = st.hk, H = st.H;
    const int m = mode[s * hk + h];
    if (m != PM_NOHIST && m != PM_CALIB && m != PM_PRED && m != PM_SEED) return;
    const SeqRow r = seq_row(b, s);
    const bool seed = m == PM_SEED;
    const int ntok = seed ? min(r.q_len, H) : 1;
    const int t0 = seed ? r.t + r.q_len - ntok : r.t;
    const int pos0 = seed ? r.hi + 1 - ntok : r.hi;
    if (ntok * GROUP > rcap || pos0 < 0 || r.hi < r.lo) return;
    const long long sh = (long long)slot[s] * hk + h;
    const int count0 = seed ? 0 : st.hdr[sh * HDR_WORDS + HDR_COUNT];
    const int blk = ps.block;
    auto row_of = [&](int tt) { return st.ring + (sh * H + pred_mod((long long)count0 + tt, H)) * (long long)st.wc; };
    if (phase == 0) {
        for (int tt = 0; tt < ntok; ++tt) {
            const int nbr = min((pos0 + tt + blk) / blk, st.wc);
            float* rw = row_of(tt);
            for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nbr; i += gridDim.x * blockDim.x) rw[i] = 0.0f;
        }
    }
    const bool use_plan = m == PM_PRED;
    const int jlo = pred_lo(b, pos0);
    const unsigned* pe = plan + s * p_s + h * p_h;
    const int jend = use_plan ? min(max(plan_len[s * hk + h], 0), cap) : pos0 + ntok - jlo;
    const int bs = 1 << b.bs_log2;
    const i64 rows = (i64)(s * hk + h) * rcap;
    // A decode row's logits, written by phase 0 and read back by phases 1 and 2 (K is read once), where the
    // workspace has room for them (`lgs` [seqs][hk][GROUP][lcap]); a seed's rows recompute them.
    const bool keep = lgs != nullptr && !seed && jend <= lcap;
    float* lrow = keep ? lgs + (i64)(s * hk + h) * GROUP * lcap : nullptr;
    // Key tiles j0, j0 + gridDim.x * WP_TP, ...: the grid is capped (a predicted row lists only its plan).
    for (int j0 = blockIdx.x * WP_TP; j0 < jend; j0 += gridDim.x * WP_TP) {
        __syncthreads();  // the previous tile's keys and weights are no longer read
        if (!(keep && phase > 0)) {
            // WP_J threads per key: one position and block lookup each, then the row's loads in flight.
            const int kp = threadIdx.x / WP_J, kq = threadIdx.x % WP_J, kj = j0 + kp;
            const kv_t* krow = nullptr;
            if (kj < jend) {
                const int kpos = use_plan ? (int)pe[kj] : jlo + kj;
                const i64 pb = phys_block(b, s, kpos >> b.bs_log2);
                if (pb >= 0) krow = kc + pb * kc0 + (i64)(kpos & (bs - 1)) * kc1 + (i64)h * kc2;
            }
#pragma unroll
            for (int c = kq; c < HEAD_DIM; c += WP_J) ks[kp][c] = krow ? kv_ld(krow[c], kscale) : 0.0f;
        }
        const int p = threadIdx.x % WP_TP, j = threadIdx.x / WP_TP, jj = j0 + p;
        const int pos = jj < jend ? (use_plan ? (int)pe[jj] : jlo + jj) : -1;
        for (int tt = 0; tt < ntok; ++tt) {
            const int tpos = pos0 + tt;
            const int lo = pred_lo(b, tpos);
            __syncthreads();  // the previous token's queries and weights are no longer read (and K is staged)
            for (int i = threadIdx.x; i < GROUP * HEAD_DIM && !(keep && phase > 0); i += blockDim.x) {
                const int g = i / HEAD_DIM, c = i % HEAD_DIM;
                qs[i] = ET::ld(q[(i64)(t0 + tt) * q0 + (i64)(h * GROUP + g) * q1 + (i64)c * q2]) * scale;
            }
            __syncthreads();
            const bool vis = pos >= lo && pos <= tpos;
            float wmax = 0.0f;
#pragma unroll
            for (int k = 0; k < WP_KPER; ++k) {
                const int gi = j + WP_J * k;
                const bool row_ok = gi < GROUP;
                const i64 rr = rows + tt * GROUP + (row_ok ? gi : 0);
                float l = -INFINITY;
                if (vis && row_ok) {
                    if (keep && phase > 0) {
                        l = lrow[(i64)gi * lcap + jj];
                    } else {
                        l = kvs_decision_softcap(wp_dot(qs + gi * HEAD_DIM, ks[p]), softcap);
                        if (keep) lrow[(i64)gi * lcap + jj] = l;
                    }
                }
                if (phase == 0) {
                    wp_row_max(l, p == 0 && row_ok, &rmax[rr]);
                    continue;
                }
                const float mrow = row_ok ? wp_unkey(rmax[rr]) : -INFINITY;
                const float ev = vis && mrow > -INFINITY ? kvs_fast_exp(l - mrow) : 0.0f;
                if (phase == 1) {
                    wp_row_sum(ev, p == 0 && row_ok && mrow > -INFINITY, &zfix[rr], &zbad[rr]);
                } else if (vis && row_ok && mrow > -INFINITY) {
                    const double z = zbad[rr] ? (double)__int_as_float(0x7fffffff) : (double)zfix[rr] / WP_NORM_ONE;
                    const float w = (float)((double)ev / z);
                    if (w > wmax) wmax = w;  // NaN never wins
                }
            }
            if (phase != 2) continue;
            wsh[j][p] = wmax;
            __syncthreads();
            if (j == 0 && vis) {
                float wm = 0.0f;
                for (int k = 0; k < WP_J; ++k) wm = wsh[k][p] > wm ? wsh[k][p] : wm;
                if (wm > 0.0f) atomicMax(reinterpret_cast<unsigned*>(row_of(tt)) + pos / blk, __float_as_uint(wm));
            }
        }
    }
}

// Ring bookkeeping once the rows are written: one CTA per sequence. A decode row's row becomes the
// newest (count + 1); a seed's ntok rows the whole history.
extern "C" __global__ void kvs_pred_finish(Batch b, PredState st, PredSpec ps, const int* slot, const int* mode, int rcap) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    const int s = blockIdx.x, hk = st.hk, H = st.H;
    const SeqRow r = seq_row(b, s);
    for (int h = threadIdx.x; h < hk; h += blockDim.x) {
        const int m = mode[s * hk + h];
        if (m != PM_NOHIST && m != PM_CALIB && m != PM_PRED && m != PM_SEED) continue;
        const long long sh = (long long)slot[s] * hk + h;
        int* hd = st.hdr + sh * HDR_WORDS;
        int* lens = st.lens + sh * H;
        if (m == PM_SEED) {
            const int ntok = min(r.q_len, H), pos0 = r.hi + 1 - ntok;
            if (ntok * GROUP > rcap || pos0 < 0) continue;  // not seeded (the kernels above skipped it too)
            for (int tt = 0; tt < ntok; ++tt) lens[tt] = min((pos0 + tt + ps.block) / ps.block, st.wc);
            hd[HDR_COUNT] = ntok;
            hd[HDR_PUSHED] = ntok;
        } else {
            int c = hd[HDR_COUNT];
            lens[pred_mod(c, H)] = min((r.hi + ps.block) / ps.block, st.wc);
            c += 1;
            if (c >= 0x40000000) c -= H * (0x20000000 / H);  // same residues mod H, count stays >= H
            hd[HDR_COUNT] = c;
            hd[HDR_PUSHED] += 1;
        }
    }
}

// Copies `rows` rows of `from` floats (pitch `from`) into rows of pitch `to` >= from (zero-filled past
// `from`): the layer's ring and z arrays when a wider block table grows them (outside capture).
extern "C" __global__ void kvs_pred_migrate(const float* src, float* dst, long long rows, int from, int to) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * to) return;
    const long long rw = i / to;
    const int c = (int)(i % to);
    dst[i] = c < from ? src[rw * from + c] : 0.0f;
}
