// AttentionPredictor on the device (src/cuda/predictor.rs): the block-attention history per (sequence
// slot, KV head), the calibration schedule, the CNN's forward pass, the selection and the history update,
// making the decisions of the CPU engine (src/policy/predictor/{cpu,mod}.rs) by the agreement contract
// (design.md), within stated error bounds (docs/policies.md): a decode row's history row from tensor-core
// logits over 16-bit caches (the step's attention's for predicted and first steps, kvs_pred_logits' for a
// calibration step's full row; then kvs_pred_weights), else (f32 and FP8 caches, prefill seeds)
// in the decisions' arithmetic, bit for bit (decide.cuh, as the CPU's history_row; this module is compiled
// with --fmad=false); the CNN's first convolution with explicit fused multiply-adds, the second on the
// tensor cores in 3xBF16; so a set may differ from the CPU's at borderline blocks only. Batch geometry, radix top-k, accounting, SnapKV's scoring arithmetic
// (wp_dot, WP_TP) and the cache-type MMA (mma16816) come from kernels/include/.
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
// (z rows), kvs_pred_average[_wide] (the time average: scores), kvs_pred_select[_cluster] (top-k, token
// plan, counters), the new history row and kvs_pred_finish (ring bookkeeping). Over 16-bit caches the
// selection zeroes the new ring row, the attention over the plan also writes its logits
// (attention_mma.cu LOGITS), then kvs_pred_logits (calibration rows only) and kvs_pred_weights; else
// kvs_pred_scores x3 before the attention (row maxima, fixed-point normalisers, weights max-pooled into the
// ring row; a decode row's keys read once). Prefill chunks (q_len > 1) take the SEED path of the same
// kernels: their last min(q_len, H) rows become the history.

#include "common.cuh"
#include "params.cuh"
#include "decide.cuh"
#include "batch.cuh"
#include "block_reduce.cuh"
#include "topk.cuh"
#include "cluster.cuh"
#include "cluster_topk.cuh"
#include "weights_pass.cuh"
#include "kv_load.cuh"
#include "mma.cuh"

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
#define PRED_PT 64  // image columns per column tile of kvs_pred_conv (a multiple of 16: a warp per 16)
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

// Blocks of the ring row a token at position `pos` pushes (the blocks its positions 0..pos touch, within
// the ring's width).
__device__ __forceinline__ int pred_row_blocks(const PredState& st, const PredSpec& ps, int pos) { return min((pos + ps.block) / ps.block, st.wc); }

// Ring row `a` (mod H) of (slot, KV head) `sh`: the a-th row pushed counting from the seed.
__device__ __forceinline__ float* pred_ring_row(const PredState& st, long long sh, long long a) {
    return st.ring + (sh * st.H + pred_mod(a, st.H)) * (long long)st.wc;
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

// x0, x1 as bf16 pairs hi + lo (x = hi + lo to about 2^-18 of x): the low half of each word holds x0.
__device__ __forceinline__ void pred_split2(float x0, float x1, unsigned& hi, unsigned& lo) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(x1), "f"(x0));
    const float h0 = __uint_as_float(hi << 16), h1 = __uint_as_float(hi & 0xffff0000u);
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(x1 - h1), "f"(x0 - h0));
}
// c += a * b, m16n8k16, bf16 operands, f32 accumulation (row-major A, column-major B).
__device__ __forceinline__ void pred_mma(float (&c)[4], const uint4& a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// The second convolution as a GEMM: [C2 x 9 C1P] weights times [9 C1P x pixels] patches, its reduction
// index (offset dt * 3 + db, channel block kc, channel) in k-steps of 16 channels at one offset, so that a
// B operand's bf16 pair is two adjacent channels of one pixel. The weights' A fragments come pre-split
// (hi, lo) in lane order from the host (src/policy/predictor/cuda.rs `conv2_fragments`, the same layout).
#define PRED_C1P ((PRED_C1 + 15) / 16 * 16)  // first-layer channels, padded to whole k-steps
#define PRED_KC (PRED_C1P / 16)                // k-steps per spatial offset
#define PRED_K16 (9 * PRED_KC)                 // k-steps of the reduction
#define PRED_MT ((PRED_C2 + 15) / 16)          // output channels in tiles of 16
#define PRED_RB (8 / PRED_MT)                  // output rows per band (accumulators: MT x 2 RB x 4 per lane)
// Words per pixel of the conv1 tile: per 16-channel block kc and tq < 4 the quad (hi of channels 2 tq, 2 tq + 1;
// hi of the same + 8; lo of the first; lo of the second), so that a B operand pair (hi or lo) is one aligned
// register pair of one 16-byte load; a pixel stride of 16 (mod 32) words keeps those loads conflict-free.
#define PRED_PX (PRED_C1P + ((PRED_C1P / 16) % 2 == 0 ? 16 : 0))
#define PRED_RBH ((PRED_RB + 1) / 2)            // band rows per warp (two warps per 16 columns: even, odd rows)
#define PRED_THREADS (4 * PRED_PT)             // two warps per 16 columns
#define PRED_FRAG_WORDS (PRED_MT * PRED_K16 * 32 * 8)
#define PRED_XS_W ((PRED_RB + 4) * (PRED_PT + 4))
#define PRED_YS_W ((PRED_RB + 2) * (PRED_PT + 2) * PRED_PX)
#define PRED_SMALL_W ((PRED_C1 * 10 + 2 * PRED_C2 + 1 + PRED_RB + 4 + 3) / 4 * 4)  // w1, b1, b2, w3, b3, row lengths (16-byte multiple)
// Dynamic shared memory of kvs_pred_conv in 4-byte words (src/policy/predictor/cuda.rs `conv_smem_bytes`).
#define PRED_SMEM_W (PRED_FRAG_WORDS + PRED_SMALL_W + PRED_XS_W + PRED_YS_W)

// The CNN's per-row outputs z[t][b] of the rows and columns whose receptive field changed since the last
// prediction (all of them after a seed), into zc. Grid (CTAs per (sequence, KV head), hk, seqs);
// PRED_THREADS threads. A column tile of PRED_PT columns recomputes every row, or the two top rows whose
// zero padding moved and the bottom ones the new rows reach, in bands of up to PRED_RB rows; the work
// items are (band, tile), band-major, and a CTA walks items blockIdx.x, blockIdx.x + gridDim.x, ... (so
// the bands of a tile that recomputes every row run on many CTAs), staging the weights at its first
// item. A band: the image rows around it, the first convolution once per row it needs (f32 with fused
// multiply-adds, a pixel's four-channel quad per thread, stored as bf16 (hi, lo) words of channel pairs), then the second as an
// implicit GEMM on the tensor cores in 3xBF16 (hi*hi + hi*lo + lo*hi, m16n8k16, f32 accumulation; each
// warp 16 columns of every row of the band), then bias, ReLU and the 1x1 convolution over the channels (a
// warp-shuffle sum). Two warps per 16 columns, one the band's even rows, the other its odd rows; 3 CTAs per SM (80
// registers, no spills; 2 per SM measured slower). Device arithmetic and its error bound: docs/policies.md (predictor, "On the GPU").
extern "C" __global__ void __launch_bounds__(PRED_THREADS, 3) kvs_pred_conv(Batch b, PredState st, PredSpec ps, const float* wts, const uint4* frag,
                                                                           const int* slot, const int* mode) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    extern __shared__ __align__(16) unsigned pred_smem[];
    uint4* afr = reinterpret_cast<uint4*>(pred_smem);     // [MT][K16][hi, lo][32 lanes]: conflict-free 16-byte loads
    float* wsm = reinterpret_cast<float*>(pred_smem + PRED_FRAG_WORDS);  // w1 [C1][9], b1, b2, w3, b3
    float* xs = wsm + PRED_SMALL_W;                        // image rows a-2 .. a+R+1, columns b0-2 .. b0+PT+1
    unsigned* ys = reinterpret_cast<unsigned*>(xs + PRED_XS_W);  // conv1 rows a-1 .. a+R, columns b0-1 .. b0+PT
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
    const float* w1 = wsm;
    const float* b1 = wsm + PRED_C1 * 9;
    const float* b2 = wsm + PRED_C1 * 10;
    const float* w3 = b2 + PRED_C2;
    int* rlen = reinterpret_cast<int*>(wsm + PRED_C1 * 10 + 2 * PRED_C2 + 1);  // blocks of the image rows a-2 .. a+R+1 (0: no row)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g8 = lane >> 2, tq = lane & 3;
    const int rbase = pred_mod((long long)count - H, H);  // ring row of image row 0
    auto ring_row = [&](int tt) { return rbase + tt < H ? rbase + tt : rbase + tt - H; };
    // A reused row keeps z where its receptive field is unchanged: rows 2 .. H - pushed - 3, columns
    // whose field lies inside the previous crop.
    auto row_reused = [&](int t) { return reuse && t >= 2 && t + pushed + 2 < H; };
    const int nbands = (H + PRED_RB - 1) / PRED_RB;  // the bands of a tile that recomputes every row
    // Tiles [0, t_all) reuse rows 2 .. H - pushed - 3: their bands cover rows 0, 1 (top) and H - pushed - 2 ..
    // H - 1 (bottom); the tiles from t_all on (the previous crop's edge and past it) recompute every row.
    // Items: the reused tiles' (band, tile) pairs band-major, then the others' (no empty items to skip).
    const int x_all = wmin - PRED_PT - 2;
    const int t_all = !reuse || x_all < 0 ? 0 : min(tiles, x_all / PRED_PT + 1);
    const int nb_top = (2 + PRED_RB - 1) / PRED_RB, bottom = H - pushed - 2;
    const int nb_reused = nb_top + (pushed + 2 + PRED_RB - 1) / PRED_RB;
    const int n_reused = t_all * nb_reused, n_items = n_reused + (tiles - t_all) * nbands;
    bool staged = false;
    for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
        int tile, a, R;
        if (item < n_reused) {
            const int band = item / t_all;
            tile = item % t_all;
            if (band < nb_top) {
                a = band * PRED_RB;
                R = min(PRED_RB, 2 - a);
            } else {
                a = bottom + (band - nb_top) * PRED_RB;
                R = min(PRED_RB, H - a);
            }
        } else {
            const int j = item - n_reused, nt = tiles - t_all;
            tile = t_all + j % nt;
            a = (j / nt) * PRED_RB;
            R = min(PRED_RB, H - a);
        }
        const int b0 = tile * PRED_PT;
        __syncthreads();  // the previous item's tiles are no longer read
        if (!staged) {
            for (int i = threadIdx.x; i < PRED_FRAG_WORDS / 4; i += blockDim.x) afr[i] = frag[i];
            for (int i = threadIdx.x; i < PRED_C1 * 10; i += blockDim.x) wsm[i] = wts[PRED_W1 + i];  // w1 then b1
            for (int i = threadIdx.x; i < 2 * PRED_C2 + 1; i += blockDim.x) wsm[PRED_C1 * 10 + i] = wts[PRED_B2 + i];  // b2, w3, b3
            staged = true;
        }
        // The band's image rows: their blocks (0 outside the image and for rows never pushed).
        for (int i = threadIdx.x; i < R + 4; i += blockDim.x) {
            const int tt = a - 2 + i;
            rlen[i] = (tt < 0 || tt >= H || count - H + tt < 0) ? 0 : min(lens[ring_row(tt)], st.wc);
        }
        __syncthreads();
        // Image values (0 outside the image, past a row's blocks, and for padding); two loads in flight.
        const int nxs = (R + 4) * (PRED_PT + 4);
        for (int i0 = threadIdx.x; i0 < nxs; i0 += 2 * blockDim.x) {
            float v[2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int i = i0 + u * blockDim.x;
                const int rr = i / (PRED_PT + 4), bb = b0 - 2 + i % (PRED_PT + 4), c = start + bb;
                v[u] = (i < nxs && bb >= 0 && bb < width && c < rlen[rr]) ? ring[(long long)ring_row(a - 2 + rr) * st.wc + c] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 2; ++u)
                if (i0 + u * blockDim.x < nxs) xs[i0 + u * blockDim.x] = v[u] > 0.0f ? v[u] : 0.0f;
        }
        __syncthreads();
        {
            {
                // The first convolution: one (pixel, channel quad) per thread and pass, so that a warp's
                // 16-byte stores are conflict-free (a pixel's quads in consecutive lanes); 0 outside the image.
                constexpr int NQ = PRED_C1P / 4;
                for (int i = threadIdx.x; i < (R + 2) * (PRED_PT + 2) * NQ; i += blockDim.x) {
                    const int px = i / NQ, qd = i % NQ;
                    const int rr = px / (PRED_PT + 2), cc = px % (PRED_PT + 2);
                    const int tt = a - 1 + rr, bb = b0 - 1 + cc;
                    uint4* yp = reinterpret_cast<uint4*>(ys + px * PRED_PX) + qd;
                    if (!(tt >= 0 && tt < H && bb >= 0 && bb < width)) {  // zero padding of the second convolution
                        *yp = make_uint4(0u, 0u, 0u, 0u);
                        continue;
                    }
                    float xin[9];
#pragma unroll
                    for (int k = 0; k < 9; ++k) xin[k] = xs[(rr + k / 3) * (PRED_PT + 4) + cc + k % 3];
                    // The quad (kc, tq): channels kc*16 + 2 tq, + 1, + 8, + 9.
                    const int c0 = (qd / 4) * 16 + 2 * (qd % 4);
                    float v[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int ch = c0 + (j & 1) + (j >> 1) * 8;
                        float acc = 0.0f;
                        if (ch < PRED_C1) {
                            acc = b1[ch];
#pragma unroll
                            for (int k = 0; k < 9; ++k) acc = fmaf(w1[ch * 9 + k], xin[k], acc);
                        }
                        v[j] = pred_relu(acc);
                    }
                    unsigned h01, l01, h89, l89;
                    pred_split2(v[0], v[1], h01, l01);
                    pred_split2(v[2], v[3], h89, l89);
                    *yp = make_uint4(h01, h89, l01, l89);
                }
                __syncthreads();
                // The second convolution: acc[mi][n] holds channels mi*16 + (g8, g8 + 8) of n-tile n (row
                // rp + 2 (n / 2) of the band, columns cg*16 + (n % 2)*8 + 2 tq (+1)).
                const int cg = warp % (PRED_PT / 16), rp = warp / (PRED_PT / 16);
                float acc[PRED_MT][2 * PRED_RBH][4];
#pragma unroll
                for (int mi = 0; mi < PRED_MT; ++mi)
#pragma unroll
                    for (int n = 0; n < 2 * PRED_RBH; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[mi][n][e] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < PRED_K16; ++kk) {
                    const int sp = kk / PRED_KC, kc = kk % PRED_KC, dt = sp / 3, db = sp % 3;
                    uint4 ah[PRED_MT], al[PRED_MT];
#pragma unroll
                    for (int mi = 0; mi < PRED_MT; ++mi) {
                        ah[mi] = afr[(mi * PRED_K16 + kk) * 64 + lane];
                        al[mi] = afr[(mi * PRED_K16 + kk) * 64 + 32 + lane];
                    }
#pragma unroll
                    for (int n = 0; n < 2 * PRED_RBH; ++n) {
                        if (rp + 2 * (n / 2) >= R) break;
                        // hi and lo of channels kc*16 + 2 tq (+1) and of the same + 8: one conflict-free 16-byte load (PRED_PX).
                        const uint4 pq = *(reinterpret_cast<const uint4*>(ys + ((rp + 2 * (n / 2) + dt) * (PRED_PT + 2) + cg * 16 + (n % 2) * 8 + g8 + db) * PRED_PX) + kc * 4 + tq);
                        const unsigned bh0 = pq.x, bh1 = pq.y, bl0 = pq.z, bl1 = pq.w;
#pragma unroll
                        for (int mi = 0; mi < PRED_MT; ++mi) {
                            pred_mma(acc[mi][n], al[mi], bh0, bh1);
                            pred_mma(acc[mi][n], ah[mi], bl0, bl1);
                            pred_mma(acc[mi][n], ah[mi], bh0, bh1);
                        }
                    }
                }
                // Bias, ReLU, the 1x1 convolution: this lane's channels, then the sum over the warp's 8 row groups.
#pragma unroll
                for (int n = 0; n < 2 * PRED_RBH; ++n) {
                    if (rp + 2 * (n / 2) >= R) break;
                    float zp[2] = {0.0f, 0.0f};
#pragma unroll
                    for (int mi = 0; mi < PRED_MT; ++mi)
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const int co = mi * 16 + g8 + half * 8;
                            if (co >= PRED_C2) continue;
                            zp[0] += w3[co] * pred_relu(acc[mi][n][2 * half] + b2[co]);
                            zp[1] += w3[co] * pred_relu(acc[mi][n][2 * half + 1] + b2[co]);
                        }
                    const int t = a + rp + 2 * (n / 2);
                    const int rw = rbase + t < H ? rbase + t : rbase + t - H;
                    const bool keep_old = row_reused(t);
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        float v = zp[j];
                        v += __shfl_xor_sync(0xffffffffu, v, 4);
                        v += __shfl_xor_sync(0xffffffffu, v, 8);
                        v += __shfl_xor_sync(0xffffffffu, v, 16);
                        const int c = b0 + cg * 16 + (n % 2) * 8 + 2 * tq + j;
                        if (g8 == 0 && c < width && !(keep_old && c + 2 < wmin)) zc[(long long)rw * st.wc + c] = v;
                    }
                }
            }
        }
    }
}

// The prediction of every CALIB / PRED row: b3 + the mean over the H image rows of z (summed in row
// order), into `scores` [seqs][hk][nbmax] at the crop's blocks: a memory-bound read of every row of z. Grid
// (column tiles of a CTA's threads, hk, seqs); a thread's column, several rows' loads in flight at once, then
// their sum in row order. Two shapes (src/policy/predictor/cuda.rs picks one by the launch's columns): 256
// columns per CTA with 8 rows in flight (`kvs_pred_average`), 128 with 32 (`kvs_pred_average_wide`, small
// batches: more loads in flight per SM when there are few columns).
#define PRED_AVG_THREADS 256
#define PRED_AVG_WIDE_THREADS 128

// This thread's column of z: false when the row is not predicted or the column is past its crop; else its
// ring rows (row r of the image is zc + ((rbase + r) mod H) * wc) and where its score goes.
__device__ __forceinline__ bool pred_average_column(const Batch& b, const PredState& st, const PredSpec& ps, const int* slot, const int* mode, float* scores,
                                                    int nbmax, int threads, const float*& zc, int& rbase, float*& out) {
    const int s = blockIdx.z, h = blockIdx.y, hk = st.hk, H = st.H;
    int start, width;
    if (!pred_cnn_crop(b, ps, mode, hk, s, h, start, width)) return false;
    const int i = blockIdx.x * threads + threadIdx.x;
    if (i >= width) return false;
    const long long sh = (long long)slot[s] * hk + h;
    zc = st.zc + sh * H * (long long)st.wc + i;
    rbase = pred_mod((long long)st.hdr[sh * HDR_WORDS + HDR_COUNT] - H, H);  // ring row of image row 0
    out = scores + (i64)(s * hk + h) * nbmax + start + i;
    return true;
}

extern "C" __global__ void __launch_bounds__(PRED_AVG_THREADS) kvs_pred_average(Batch b, PredState st, PredSpec ps, const float* wts, const int* slot,
                                                                                const int* mode, float* scores, int nbmax) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    const float* zc;
    int rbase;
    float* out;
    if (!pred_average_column(b, st, ps, slot, mode, scores, nbmax, PRED_AVG_THREADS, zc, rbase, out)) return;
    const int H = st.H;
    float acc = 0.0f;
    // Eight rows' loads in flight, then their sum in row order.
    for (int t0 = 0, r0 = rbase; t0 < H; t0 += 8) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            int ri = r0 + u;
            while (ri >= H) ri -= H;
            v[u] = t0 + u < H ? zc[(long long)ri * st.wc] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
            if (t0 + u < H) acc += v[u];
        r0 += 8;
        while (r0 >= H) r0 -= H;
    }
    *out = wts[PRED_B3] + acc * (1.0f / (float)H);
}

extern "C" __global__ void __launch_bounds__(PRED_AVG_WIDE_THREADS) kvs_pred_average_wide(Batch b, PredState st, PredSpec ps, const float* wts, const int* slot,
                                                                                          const int* mode, float* scores, int nbmax) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    const float* zc;
    int rbase;
    float* out;
    if (!pred_average_column(b, st, ps, slot, mode, scores, nbmax, PRED_AVG_WIDE_THREADS, zc, rbase, out)) return;
    const int H = st.H;
    float acc = 0.0f;
    // 32 rows' loads in flight, then their sum in row order (the same sum as kvs_pred_average's).
    for (int t0 = 0; t0 < H; t0 += 32) {
        float v[32];
#pragma unroll
        for (int u = 0; u < 32; ++u) {
            const int t = t0 + u, ri = rbase + t < H ? rbase + t : rbase + t - H;  // rbase, t < H
            v[u] = t < H ? zc[(long long)ri * st.wc] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 32; ++u)
            if (t0 + u < H) acc += v[u];
    }
    *out = wts[PRED_B3] + acc * (1.0f / (float)H);
}

// Candidate keys kvs_pred_select keeps in shared memory (more are read from the scores in global memory).
#define PRED_SEL_CACHE 8192

// With the tensor-core history rows (`zero_ring`), the selection zeroes the ring row a decode row's history
// row goes to (its blocks so far), which kvs_pred_weights then fills by atomicMax after the attention:
// thread `tid` of `nt` over the row. Runs after this step's CNN, the row's last reader.
__device__ __forceinline__ void pred_zero_ring_row(const PredState& st, const PredSpec& ps, const int* slot, int s, int h, int m, const SeqRow& r, int tid, int nt) {
    if (m != PM_NOHIST && m != PM_CALIB && m != PM_PRED) return;
    const long long sh = (long long)slot[s] * st.hk + h;
    const int nbr = pred_row_blocks(st, ps, r.hi);
    float* rw = pred_ring_row(st, sh, st.hdr[sh * HDR_WORDS + HDR_COUNT]);
    for (int i = tid; i < nbr; i += nt) rw[i] = 0.0f;
}


// Bits lo .. hi - 1 of a 64-position chunk starting at p0 that [s, e) covers.
__device__ __forceinline__ unsigned long long pred_span_bits(int p0, int s, int e) {
    const int a = max(s - p0, 0), z = min(e - p0, 64);
    if (a >= z) return 0ull;
    return (z == 64 ? ~0ull : ((1ull << z) - 1ull)) & ~((1ull << a) - 1ull);
}

// One selection row (sequence s, KV head h) as both selection kernels see it: its visible range, mode,
// the sink's and the local window's ends and the candidate blocks cb0 <= i < cb1 of which mm are chosen
// (predictor::select), the crop its scores cover.
struct PredSelRow {
    SeqRow r;
    int m, n, blk, nb, sink_end, local_start, cb0, cb1, mm, cnt, start, width;
    bool all;  // DENSE and NOHIST rows: every visible position
    const float* sc;
};

// The row's setup; false when it has no plan to make (its length written: -1 none, 0 empty). `lead`: the
// one thread that writes the row's plan length and header.
__device__ __forceinline__ bool pred_sel_row(const Batch& b, const PredState& st, const PredSpec& ps, const int* slot, const int* mode, const float* scores,
                                             int nbmax, int s, int h, int* plan_len, bool lead, PredSelRow& w) {
    const int hk = st.hk;
    w.r = seq_row(b, s);
    w.m = mode[s * hk + h];
    if (!w.r.decode || w.m == PM_SKIP || w.m == PM_SEED) {
        if (lead) plan_len[s * hk + h] = -1;
        return false;
    }
    if (w.m == PM_EMPTY || w.r.hi < w.r.lo) {
        if (lead) plan_len[s * hk + h] = 0;
        return false;
    }
    w.n = w.r.hi + 1;
    w.blk = ps.block;
    w.nb = (w.n + w.blk - 1) / w.blk;
    w.all = w.m == PM_DENSE || w.m == PM_NOHIST;
    w.sink_end = min(ps.sink, w.n);
    w.local_start = max(w.n - ps.local, 0);
    w.cb0 = w.cb1 = w.mm = w.cnt = w.start = w.width = 0;
    w.sc = scores + (i64)(s * hk + h) * nbmax;
    if (!w.all) {
        const long long sh = (long long)slot[s] * hk + h;
        int* hd = st.hdr + sh * HDR_WORDS;
        pred_crop(w.nb, ps, w.start, w.width);  // the scores of the crop: kvs_pred_average
        if (lead) {
            hd[HDR_START] = w.start;
            hd[HDR_WIDTH] = w.width;
            hd[HDR_PUSHED] = 0;
            hd[HDR_ZVALID] = 1;
        }
        w.cb0 = w.sink_end >= w.n ? w.nb : w.sink_end / w.blk;
        w.cb1 = min((w.local_start + w.blk - 1) / w.blk, w.nb);
        w.cnt = max(w.cb1 - w.cb0, 0);
        const long long extra = max((long long)ps.budget - (long long)ps.sink - (long long)ps.local, 0ll) / w.blk;
        w.mm = (int)min(extra, (long long)w.cnt);
    }
    return true;
}

// Candidate block i's order key (-inf's outside the crop).
__device__ __forceinline__ unsigned pred_key_at(const PredSelRow& w, int i) {
    return kvs_order_key((i >= w.start && i < w.start + w.width) ? w.sc[i] : -INFINITY);
}

// Keys of candidates lo <= i < hi into kc[i - lo]: eight loads in flight per thread, then their keys (one
// round trip per eight, not per key). Block-wide; the caller syncs.
__device__ __forceinline__ void pred_stage_keys(const PredSelRow& w, int lo, int hi, unsigned* kc) {
    for (int i0 = lo + threadIdx.x; i0 < hi; i0 += 8 * (int)blockDim.x) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int bk = i0 + u * (int)blockDim.x;
            v[u] = (bk < hi && bk >= w.start && bk < w.start + w.width) ? w.sc[bk] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
            if (i0 + u * (int)blockDim.x < hi) kc[i0 + u * blockDim.x - lo] = kvs_order_key(v[u]);
    }
}

// Whether candidate block bk is chosen, given the cut tc of the keys key_of (exact at ties: the later block).
template <typename KeyOf>
__device__ __forceinline__ bool pred_chosen(const PredSelRow& w, const TopCut& tc, KeyOf key_of, int bk) {
    if (bk < w.cb0 || bk >= w.cb1 || w.mm == 0) return false;
    if (w.mm >= w.cnt) return true;
    const unsigned k = key_of(bk);
    return k > tc.thr || (k == tc.thr && bk >= tc.cut);
}

// A 64-position chunk's kept positions: visible, and in the sink, the local window or a chosen block.
template <typename Sel>
__device__ __forceinline__ unsigned long long pred_chunk_bits(const PredSelRow& w, int c, Sel sel) {
    const int p0 = c * 64, blk = w.blk;
    const unsigned long long vis = pred_span_bits(p0, w.r.lo, w.r.hi + 1);
    if (w.all) return vis;
    unsigned long long keep = pred_span_bits(p0, 0, w.sink_end) | pred_span_bits(p0, w.local_start, w.n);
    if (blk >= 64) {
        if (sel(p0 / blk)) keep = ~0ull;
    } else {
        const unsigned long long bm = (1ull << blk) - 1ull;
        for (int q = 0; q < 64; q += blk)
            if (sel((p0 + q) / blk)) keep |= bm << q;
    }
    return vis & keep;
}

// The plan entries of chunks my0 <= c < my1 (each thread its own run, `per` chunks at most), the first at
// plan index `at`, written a warp at a time: for each of its lanes with kept positions in their j-th
// chunk, the whole warp writes that chunk's entries (coalesced; no lane walks 64 positions alone). Entries
// from `cap` on are dropped. Every thread of the CTA.
template <typename Bits>
__device__ __forceinline__ void pred_write_chunks(unsigned* e, int my0, int my1, int per, int at, int cap, Bits chunk_bits) {
    const int lane = threadIdx.x & 31;
    for (int j = 0; j < per; ++j) {  // uniform trip count
        const int c = my0 + j;
        const unsigned long long bits = c < my1 ? chunk_bits(c) : 0ull;
        for (unsigned act = __ballot_sync(0xffffffffu, bits != 0ull); act; act &= act - 1u) {
            const int l = __ffs(act) - 1;
            const unsigned long long mb = __shfl_sync(0xffffffffu, bits, l);
            const int base = __shfl_sync(0xffffffffu, at, l), cl = __shfl_sync(0xffffffffu, c, l);
            const unsigned lo32 = (unsigned)mb, hi32 = (unsigned)(mb >> 32), below = (1u << lane) - 1u;
            const int o0 = base + __popc(lo32 & below), o1 = base + __popc(lo32) + __popc(hi32 & below);
            if ((lo32 >> lane) & 1u && o0 < cap) e[o0] = (unsigned)(cl * 64 + lane);
            if ((hi32 >> lane) & 1u && o1 < cap) e[o1] = (unsigned)(cl * 64 + 32 + lane);
        }
        at += __popcll(bits);
    }
}

// The row counters a selection adds once per row (`lead` thread): false for DENSE rows (counted as the
// CPU counts dense rows: KV bytes only; nothing else follows).
__device__ __forceinline__ bool pred_row_counters(const Batch& b, const PredSelRow& w, int np, i64 row_bytes, i64 k_row_bytes, bool lead,
                                                  unsigned long long* ctr) {
    const unsigned long long vis = (unsigned long long)(w.r.hi - w.r.lo + 1);
    if (w.m == PM_DENSE) {
        if (lead) atomicAdd(&ctr[CTR_KV_BYTES], vis * (unsigned long long)row_bytes);
        return false;
    }
    if (lead) {
        atomicAdd(&ctr[CTR_POLICY_ROWS], 1ull);
        atomicAdd(&ctr[CTR_BLOCKS_ELIGIBLE], (unsigned long long)((w.r.hi >> b.bs_log2) - (w.r.lo >> b.bs_log2) + 1));
        // K read again for the history row: every visible key on a full row, else the attended ones.
        atomicAdd(&ctr[CTR_KV_BYTES], (w.m == PM_PRED ? (unsigned long long)np : vis) * (unsigned long long)k_row_bytes);
    }
    return true;
}

// One CTA per (KV head, sequence): the selection from kvs_pred_average's scores (predictor::select: the
// sink's and the local window's tokens and the best candidate blocks by (score, later block): topk32 over
// the candidates' order keys, held in shared memory), the token plan (increasing positions, clipped to
// the visible range; each thread a contiguous run of 64-position chunks, a chunk's bits from the spans and
// its blocks' choices, one block scan, the writes warp-cooperative) and the counters. DENSE and NOHIST rows get every visible
// position. CTA (0, 0) also counts the call's rows.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) kvs_pred_select(Batch b, PredState st, PredSpec ps, const float* wts, const int* slot,
                                                                           const int* mode, float* scores, int nbmax, unsigned* plan, i64 p_s,
                                                                           i64 p_h, int* plan_len, int cap, i64 row_bytes, i64 k_row_bytes,
                                                                           unsigned long long* ctr, int zero_ring) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ unsigned hist[256];
    __shared__ int wsum[TOPK_THREADS / 32];
    __shared__ unsigned sel4[4];
    __shared__ unsigned kcache[PRED_SEL_CACHE];
    __shared__ unsigned long long red[32];
    const int s = blockIdx.y, h = blockIdx.x, hk = st.hk;
    if (s == 0 && h == 0) rows_count(b, hk, row_bytes, ctr, red);
    PredSelRow w;
    if (!pred_sel_row(b, st, ps, slot, mode, scores, nbmax, s, h, plan_len, threadIdx.x == 0, w)) return;
    if (zero_ring) pred_zero_ring_row(st, ps, slot, s, h, w.m, w.r, threadIdx.x, blockDim.x);
    const bool cached = w.cnt <= PRED_SEL_CACHE;
    if (cached) pred_stage_keys(w, w.cb0, w.cb1, kcache);
    __syncthreads();
    auto key_of = [&](int i) { return cached ? kcache[i - w.cb0] : pred_key_at(w, i); };
    TopCut tc{0u, w.cb0};
    if (!w.all && w.mm > 0 && w.mm < w.cnt) tc = topk32(w.cb0, w.cb1, w.mm, key_of, hist, wsum, sel4);
    auto chunk_bits = [&](int c) { return pred_chunk_bits(w, c, [&](int bk) { return pred_chosen(w, tc, key_of, bk); }); };
    unsigned* e = plan + s * p_s + h * p_h;
    const int c0 = w.r.lo / 64, c1 = w.r.hi / 64, nch = c1 - c0 + 1;
    const int per = (nch + (int)blockDim.x - 1) / (int)blockDim.x;
    const int my0 = c0 + (int)threadIdx.x * per, my1 = min(my0 + per, c1 + 1);
    int mine = 0;
    for (int c = my0; c < my1; ++c) mine += __popcll(chunk_bits(c));
    int total;
    const int at = block_excl_scan(mine, wsum, total);
    pred_write_chunks(e, my0, my1, per, at, cap, chunk_bits);
    const int np = total < cap ? total : cap;
    if (threadIdx.x == 0) plan_len[s * hk + h] = np;
    if (!pred_row_counters(b, w, np, row_bytes, k_row_bytes, threadIdx.x == 0, ctr)) return;
    __syncthreads();  // the plan's entries are read back by account
    account(e, np, 0, w.r.lo, w.r.hi, b.bs_log2, 1, row_bytes, ctr, red);
}

// kvs_pred_select on Hopper (sm_90; the launcher's choice there while the clusters fit): the same set and
// plan from a thread-block cluster of QC_CTAS CTAs per (KV head, sequence), so that a long row's radix
// passes and chunk scans run over QC_CTAS SMs. CTA `rank` owns the blocks rank * per <= i < (rank + 1) *
// per (per a whole number of 64-position chunks) and their chunks: their candidates' keys in its shared
// memory, the cut of the row's candidates from cluster_topk_cut (the same cut, exact at ties), its chunks'
// entries written after those of the CTAs before it (an exclusive prefix of the CTAs' counts), the
// counters of its entries. Grid (hk * QC_CTAS, seqs), PRED_QC_THREADS threads.
#define PRED_QC_THREADS 256  // src/policy/predictor/cuda.rs PRED_QC_THREADS; at least 256 (a thread per bin of a pass)
#define PRED_QC_KEYS 4096    // a CTA's staged keys (more: read from the scores in global memory)
extern "C" __global__ void QC_CLUSTER_DIMS __launch_bounds__(PRED_QC_THREADS)
    kvs_pred_select_cluster(Batch b, PredState st, PredSpec ps, const float* wts, const int* slot, const int* mode, float* scores, int nbmax,
                            unsigned* plan, i64 p_s, i64 p_h, int* plan_len, int cap, i64 row_bytes, i64 k_row_bytes, unsigned long long* ctr,
                            int zero_ring) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
#if KVS_CLUSTERS
    QC_SCRATCH_N(PRED_QC_THREADS);
    __shared__ unsigned kcache[PRED_QC_KEYS];
    static_assert(PRED_QC_THREADS >= 256 && QC_CTAS <= 32, "a pass needs a thread per bin; the peers are one warp's lanes");
    const unsigned rank = cluster_rank();
    const int s = blockIdx.y, h = blockIdx.x / QC_CTAS, hk = st.hk;
    const bool lead = rank == 0 && threadIdx.x == 0;
    if (s == 0 && h == 0 && rank == 0) rows_count(b, hk, row_bytes, ctr, xs.red);
    PredSelRow w;
    // Uniform over the cluster: every CTA of it leaves here, or none.
    if (!pred_sel_row(b, st, ps, slot, mode, scores, nbmax, s, h, plan_len, lead, w)) return;
    if (zero_ring) pred_zero_ring_row(st, ps, slot, s, h, w.m, w.r, rank * blockDim.x + threadIdx.x, QC_CTAS * blockDim.x);
    // This CTA's blocks [b0, b1) and chunks [ch0, ch1): `per` blocks, a whole number of chunks (blocks are
    // powers of two: a chunk lies in one block, or holds whole blocks).
    const int bpc = w.blk >= 64 ? 1 : 64 / w.blk;
    const int per = (((w.nb + QC_CTAS - 1) / QC_CTAS + bpc - 1) / bpc) * bpc;
    const int b0 = min((int)rank * per, w.nb), b1 = min(b0 + per, w.nb);
    const i64 ch0 = (i64)b0 * w.blk / 64, ch1 = b1 > b0 ? ((i64)b1 * w.blk + 63) / 64 : ch0;  // the last block's chunk once
    // Its candidates [a0, a1) and their keys.
    const int a0 = max(b0, w.cb0), a1 = min(b1, w.cb1);
    const bool cached = a1 - a0 <= PRED_QC_KEYS;
    const bool cut = !w.all && w.mm > 0 && w.mm < w.cnt;  // uniform over the cluster
    if (cut && cached) pred_stage_keys(w, a0, a1, kcache);
    __syncthreads();
    auto key_of = [&](int i) { return cached ? kcache[i - a0] : pred_key_at(w, i); };
    TopCut tc{0u, w.cb0};
    if (cut) tc = cluster_topk_cut(w.cb0, w.cb1, w.nb, per, w.mm, rank, key_of, xs.xh, xs.xw, xs.sel, xs.wmm, xs.cnt);
    // Its chunks within the visible range, each thread a contiguous run of them.
    auto chunk_bits = [&](int c) { return pred_chunk_bits(w, c, [&](int bk) { return pred_chosen(w, tc, key_of, bk); }); };
    const int c0 = (int)max(ch0, (i64)(w.r.lo / 64)), c1 = (int)min(ch1, (i64)(w.r.hi / 64 + 1));  // [c0, c1)
    const int nch = max(c1 - c0, 0);
    const int cper = (nch + (int)blockDim.x - 1) / (int)blockDim.x;
    const int my0 = c0 + (int)threadIdx.x * cper, my1 = min(my0 + cper, c1);
    int mine = 0;
    for (int c = my0; c < my1; ++c) mine += __popcll(chunk_bits(c));
    int ctotal;
    const int at = block_excl_scan(mine, xs.cnt, ctotal);
    cluster_rank_prefix((unsigned)ctotal, rank, false, xs);
    const int off = (int)xs.sel[0], total = (int)xs.sel[1];
    unsigned* e = plan + s * p_s + h * p_h;
    pred_write_chunks(e, my0, my1, cper, off + at, cap, chunk_bits);
    const int np = total < cap ? total : cap;
    if (lead) plan_len[s * hk + h] = np;
    // No CTA leaves while another may read its shared memory; after this the whole plan is written.
    cluster_sync();
    if (!pred_row_counters(b, w, np, row_bytes, k_row_bytes, lead, ctr)) return;
    // The entry before this CTA's first is another CTA's: read through L2 after the cluster barrier.
    const int j0 = min(off, np), j1 = min(off + ctotal, np);
    account_entries([&](int j) { return (i64)__ldcg(e + j); }, j0, j1, 0, w.r.lo, w.r.hi, b.bs_log2, 1, row_bytes, ctr, xs.red);
#else
    __trap();  // launched only on sm_90 and newer
#endif
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
                                                                           int lcap, float kscale, int decode_rows) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ __align__(16) float ks[WP_TP][WP_KS_PITCH];  // 16-byte rows, conflict-free float4 reads (wp_dot)
    __shared__ __align__(16) float qs[GROUP * HEAD_DIM];
    __shared__ float wsh[WP_J][WP_TP];
    const int s = blockIdx.z, h = blockIdx.y, hk = st.hk, H = st.H;
    const int m = mode[s * hk + h];
    if (m != PM_NOHIST && m != PM_CALIB && m != PM_PRED && m != PM_SEED) return;
    const SeqRow r = seq_row(b, s);
    const bool seed = m == PM_SEED;
    if (!seed && !decode_rows) return;  // decode rows on the tensor cores (kvs_pred_logits)
    const int ntok = seed ? min(r.q_len, H) : 1;
    const int t0 = seed ? r.t + r.q_len - ntok : r.t;
    const int pos0 = seed ? r.hi + 1 - ntok : r.hi;
    if (ntok * GROUP > rcap || pos0 < 0 || r.hi < r.lo) return;
    const long long sh = (long long)slot[s] * hk + h;
    const int count0 = seed ? 0 : st.hdr[sh * HDR_WORDS + HDR_COUNT];
    const int blk = ps.block;
    auto row_of = [&](int tt) { return pred_ring_row(st, sh, (long long)count0 + tt); };
    if (phase == 0) {
        for (int tt = 0; tt < ntok; ++tt) {
            const int nbr = pred_row_blocks(st, ps, pos0 + tt);
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
            // 16-byte loads where the row allows them (WP_J threads share a row), else one element at a time.
            constexpr int EPV = 16 / (int)sizeof(kv_t);  // elements per 16 bytes
            if (krow && HEAD_DIM % EPV == 0 && (reinterpret_cast<unsigned long long>(krow) & 15ull) == 0ull) {
                for (int v = kq; v < HEAD_DIM / EPV; v += WP_J) {
                    union {
                        uint4 u;
                        kv_t e[EPV];
                    } w;
                    w.u = *reinterpret_cast<const uint4*>(krow + v * EPV);
#pragma unroll
                    for (int e = 0; e < EPV; ++e) ks[kp][v * EPV + e] = kv_ld(w.e[e], kscale);
                }
            } else {
                for (int c = kq; c < HEAD_DIM; c += WP_J) ks[kp][c] = krow ? kv_ld(krow[c], kscale) : 0.0f;
            }
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

// The decode rows' history rows on the tensor cores, where the cache is 16-bit and the queries are of its
// type (src/policy/predictor/cuda.rs `tc_history`): kvs_pred_logits then kvs_pred_weights replace the three
// scalar passes for NOHIST / CALIB / PRED rows (SEED rows keep the scalar passes: the CPU's bits). The
// rows are then the CPU's within the bound of docs/policies.md (the logits of exact 16-bit products summed in
// f32 by the MMA, as the attention kernel computes them), not bit for bit; the agreement test checks every
// predicted row against the exact prediction from the GPU's history (crates/conformance/src/predictor_agree.rs).
#define PL_WARPS 8
#define PL_THREADS (PL_WARPS * 32)
#define PL_NT ((GROUP + 7) / 8)  // query heads in n-tiles of 8 (the MMA's N)
#define PL_KT (HEAD_DIM <= 128 ? 2 : 1)  // 16-key tiles a warp loads before its MMAs (bytes in flight)
#define PL_KEYS (PL_WARPS * 16 * PL_KT)  // keys of one kvs_pred_logits CTA per iteration

// CTAs of a grid of `grid` that take part in a row of `jend` positions (the others only zero the ring row):
// a predicted row lists few positions, and its statistics are merged over these CTAs only.
__device__ __forceinline__ int pl_active(int jend, int grid) { return min(grid, (jend + PL_KEYS - 1) / PL_KEYS); }


// (m, s) += (m2, s2): softmax statistics in base 2 (largest logit, sum of 2^(l - m)); a NaN sum (a NaN
// logit) stays NaN whatever the maxima.
__device__ __forceinline__ void pl_merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (isnan(s) || isnan(s2)) {
        m = mm;
        s = __int_as_float(0x7fffffff);
        return;
    }
    if (mm == -INFINITY) return;
    s = (m == -INFINITY ? 0.0f : s * exp2f(m - mm)) + (m2 == -INFINITY ? 0.0f : s2 * exp2f(m2 - mm));
    m = mm;
}

// The positions a decode row's history row is over (as kvs_pred_scores): every visible one for NOHIST /
// CALIB rows, the plan's for PRED rows; false for rows this path does not serve.
__device__ __forceinline__ bool pl_row(const Batch& b, const int* mode, const int* plan_len, int cap, int hk, int s, int h, SeqRow& r, bool& use_plan,
                                       int& jlo, int& jend) {
    const int m = mode[s * hk + h];
    if (m != PM_NOHIST && m != PM_CALIB && m != PM_PRED) return false;
    r = seq_row(b, s);
    if (r.hi < r.lo || !r.decode) return false;
    use_plan = m == PM_PRED;
    jlo = pred_lo(b, r.hi);
    jend = use_plan ? min(max(plan_len[s * hk + h], 0), cap) : r.hi + 1 - jlo;
    return true;
}

// Rows whose history row can come from the step's own attention (kernels/attention_mma.cu LOGITS=1, the
// predictor's `Rows::PlanLogits`): it attends exactly their positions, a PRED row's plan and a NOHIST
// row's every visible position. A CALIB row attends its predicted plan but pushes the full row.
__device__ __forceinline__ bool pl_from_attention(int m) { return m == PM_PRED || m == PM_NOHIST; }

// Pass 1: the logits of a decode row's query heads over its positions, 16 keys per warp and m16n8k16 MMA
// (keys as M, query heads as N), written base 2 (times log2 e, after the scale and the soft-cap) to
// `lgs` [seqs][hk][GROUP][lcap] by position index; each taking-part CTA's (pl_active) softmax statistics
// per query head to `parts` [seqs][hk][GROUP][gridDim.x] (empty: (-inf, 0)). A lane loads 16 bytes of a key
// row at dimensions 32 j + 8 tq and the query's same dimensions, so the k index of the MMA is a permutation
// of the head dimension, the same for both operands. A missing block's key reads as zeros (as the scalar
// pass). It runs after the step's attention, which wrote the logits of PRED and NOHIST rows
// (pl_from_attention; this kernel leaves them alone), so CALIB rows only; the selection zeroed the new ring
// rows. Grid (CTAs per row, hk, seqs).
extern "C" __global__ void __launch_bounds__(PL_THREADS) kvs_pred_logits(Batch b, const elem_t* q, i64 q0, i64 q1, i64 q2, float scale, float softcap,
                                                                         const kv_t* kc, i64 kc0, i64 kc1, i64 kc2, PredState st, PredSpec ps,
                                                                         const int* slot, const int* mode, const unsigned* plan, i64 p_s, i64 p_h,
                                                                         const int* plan_len, int cap, float* lgs, int lcap, float2* parts) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
#if KVS_DTYPE != 0 && !KV8 && HEAD_DIM % 32 == 0
    __shared__ float wm[PL_WARPS][PL_NT * 8], wsum[PL_WARPS][PL_NT * 8];
    const int s = blockIdx.z, h = blockIdx.y, hk = st.hk;
    SeqRow r;
    bool use_plan;
    int jlo, jend;
    if (!pl_row(b, mode, plan_len, cap, hk, s, h, r, use_plan, jlo, jend) || jend > lcap) return;
    if (pl_from_attention(mode[s * hk + h])) return;  // the step's attention wrote this row's logits
    const int act = pl_active(jend, gridDim.x);
    if ((int)blockIdx.x >= act) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g8 = lane >> 2, tq = lane & 3;
    constexpr int NJ = HEAD_DIM / 32;
    // The B operands: query head nt * 8 + g8, dimensions 32 j + 8 tq .. + 8 (zero past GROUP).
    uint4 qf[PL_NT][NJ];
#pragma unroll
    for (int nt = 0; nt < PL_NT; ++nt) {
        const int gi = nt * 8 + g8;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            unsigned w[4] = {0u, 0u, 0u, 0u};
            if (gi < GROUP) {
                const elem_t* qr = q + (i64)r.t * q0 + (i64)(h * GROUP + gi) * q1 + (i64)(32 * j + 8 * tq) * q2;
#pragma unroll
                for (int e = 0; e < 4; ++e) w[e] = (unsigned)qr[2 * e * q2] | ((unsigned)qr[(2 * e + 1) * q2] << 16);
            }
            qf[nt][j] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
    const float l2s = scale;  // the soft-capped logit is then times log2 e
    const unsigned* pe = plan + s * p_s + h * p_h;
    float* lrow = lgs + (i64)(s * hk + h) * GROUP * lcap;
    const int bs = 1 << b.bs_log2;
    // This lane's running statistics of query heads nt * 8 + 2 tq + {0, 1}.
    float rm[PL_NT][2], rs[PL_NT][2];
#pragma unroll
    for (int nt = 0; nt < PL_NT; ++nt) rm[nt][0] = rm[nt][1] = -INFINITY, rs[nt][0] = rs[nt][1] = 0.0f;
    for (int j0 = (blockIdx.x * PL_WARPS + warp) * 16 * PL_KT; j0 < jend; j0 += act * PL_KEYS) {
        uint4 kf[PL_KT][2][NJ];
        int kpos[PL_KT][2];
#pragma unroll
        for (int kt = 0; kt < PL_KT; ++kt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int jj = j0 + kt * 16 + half * 8 + g8;
                int pos = -1;
                const kv_t* krow = nullptr;
                if (jj < jend) {
                    pos = use_plan ? (int)pe[jj] : jlo + jj;
                    const i64 pb = phys_block(b, s, pos >> b.bs_log2);
                    if (pb >= 0) krow = kc + pb * kc0 + (i64)(pos & (bs - 1)) * kc1 + (i64)h * kc2;
                }
                kpos[kt][half] = pos;
#pragma unroll
                for (int j = 0; j < NJ; ++j) kf[kt][half][j] = krow ? *reinterpret_cast<const uint4*>(krow + 32 * j + 8 * tq) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
        for (int kt = 0; kt < PL_KT; ++kt) {
#pragma unroll
            for (int nt = 0; nt < PL_NT; ++nt) {
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    mma16816(c, kf[kt][0][j].x, kf[kt][1][j].x, kf[kt][0][j].y, kf[kt][1][j].y, qf[nt][j].x, qf[nt][j].y);
                    mma16816(c, kf[kt][0][j].z, kf[kt][1][j].z, kf[kt][0][j].w, kf[kt][1][j].w, qf[nt][j].z, qf[nt][j].w);
                }
                // c: keys g8 (c0, c1) and g8 + 8 (c2, c3), query heads nt * 8 + 2 tq + {0, 1}.
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int half = e >> 1, gi = nt * 8 + 2 * tq + (e & 1);
                    const int pos = kpos[kt][half];
                    if (pos < 0 || pos < r.lo || pos > r.hi || gi >= GROUP) continue;
                    const float l = kvs_decision_softcap(c[e] * l2s, softcap) * 1.4426950408889634f;
                    lrow[(i64)gi * lcap + j0 + kt * 16 + half * 8 + g8] = l;
                    float& m = rm[nt][e & 1];
                    float& sm = rs[nt][e & 1];
                    if (l > m) {
                        sm = (m == -INFINITY ? 0.0f : sm * exp2f(m - l)) + 1.0f;
                        m = l;
                    } else {
                        sm += exp2f(l - m);  // NaN: the sum becomes NaN (and the row's weights 0)
                    }
                }
            }
        }
    }
    // The CTA's statistics per query head: over the 8 lanes of a tq (xor 4, 8, 16), then the warps.
#pragma unroll
    for (int nt = 0; nt < PL_NT; ++nt)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            float m = rm[nt][u], sm = rs[nt][u];
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) {
                const float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, sm, off);
                pl_merge(m, sm, m2, s2);
            }
            if (g8 == 0) {
                wm[warp][nt * 8 + 2 * tq + u] = m;
                wsum[warp][nt * 8 + 2 * tq + u] = sm;
            }
        }
    __syncthreads();
    if (threadIdx.x < GROUP) {
        float m = -INFINITY, sm = 0.0f;
        for (int w = 0; w < PL_WARPS; ++w) pl_merge(m, sm, wm[w][threadIdx.x], wsum[w][threadIdx.x]);
        parts[((i64)(s * hk + h) * GROUP + threadIdx.x) * gridDim.x + blockIdx.x] = make_float2(m, sm);
    }
#endif
}

// A row's weights over its positions (index jj < jend: the plan's jj-th position, or jlo + jj), each
// max_g 2^(logit(g, jj, pos) - lse[g]), max-pooled into the ring row `rw` per block: a warp's consecutive
// positions reduced per block first (segmented max: a row's positions increase), one atomicMax on the bits
// per block and warp (non-negative floats order as their bits; 0 and NaN never written). `logit` reads
// where the row's logits are (inlined: each caller's loop is its own code).
template <class Logit>
__device__ __forceinline__ void pl_pool_row(const SeqRow& r, int blk, bool use_plan, int jlo, int jend, const unsigned* pe, const float* lse, unsigned* rw,
                                            Logit logit) {
    const int lane = threadIdx.x & 31, step = gridDim.x * blockDim.x;
    for (int jb = blockIdx.x * blockDim.x + (threadIdx.x & ~31); jb < jend; jb += step) {  // uniform per warp
        const int jj = jb + lane;
        int bk = -1;
        float w = 0.0f;
        if (jj < jend) {
            const int pos = use_plan ? (int)pe[jj] : jlo + jj;
            if (pos >= r.lo && pos <= r.hi) {
                bk = pos / blk;
#pragma unroll
                for (int g = 0; g < GROUP; ++g) w = fmaxf(w, exp2f(logit(g, jj, pos) - lse[g]));
            }
        }
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const float w2 = __shfl_down_sync(0xffffffffu, w, off);
            const int b2 = __shfl_down_sync(0xffffffffu, bk, off);
            if (lane + off < 32 && b2 == bk) w = fmaxf(w, w2);
        }
        const int prev = __shfl_up_sync(0xffffffffu, bk, 1);
        if (bk >= 0 && (lane == 0 || prev != bk) && w > 0.0f) atomicMax(rw + bk, __float_as_uint(w));
    }
}

// Pass 2 of a PRED / NOHIST row, from the step's attention (attention_mma.cu LOGITS, lg_maxpos = lcap): its
// logits lgs[((s * hk + h) * lcap + pos) * GROUP + g] (the same extent per row as kvs_pred_logits' layout,
// which CALIB rows keep) and its splits' statistics, `anparts` slots per query head (those past the
// launch's splits hold (-inf, 0)), merged by a warp per head: each lane its slots in order, then the lanes
// by a fixed butterfly (the same inputs give the same bits). The weights by pl_pool_row.
__device__ __forceinline__ void pl_weights_from_attention(const SeqRow& r, const PredSpec& ps, bool use_plan, int jlo, int jend, const unsigned* pe,
                                                          const float* la_row, const float2* pr_row, int anparts, unsigned* rw) {
    __shared__ float lse[GROUP];
    const int lane = threadIdx.x & 31;
    for (int g = threadIdx.x >> 5; g < GROUP; g += PL_WARPS) {
        const float2* pr = pr_row + (i64)g * anparts;
        float m = -INFINITY, sm = 0.0f;
        for (int i = lane; i < anparts; i += 32) pl_merge(m, sm, pr[i].x, pr[i].y);
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, sm, off);
            pl_merge(m, sm, m2, s2);
        }
        if (lane == 0) lse[g] = m > -INFINITY ? m + log2f(sm) : INFINITY;
    }
    __syncthreads();
    pl_pool_row(r, ps.block, use_plan, jlo, jend, pe, lse, rw, [&](int g, int, int pos) { return la_row[(i64)pos * GROUP + g]; });
}

// Pass 2: each position's weight max over the query heads of 2^(l - lse) (lse merged from the CTAs'
// statistics in CTA order, over the CTAs that took part: the same inputs give the same bits), max-pooled
// into the ring row per block (pl_pool_row; a NaN logit makes the row 0, as the CPU's). Grid (CTAs per
// row, hk, seqs), `nparts` = the grid of kvs_pred_logits (CALIB rows); PRED and NOHIST rows from the
// attention (pl_weights_from_attention, `aparts`, `anparts`). The selection zeroed the ring rows.
extern "C" __global__ void __launch_bounds__(PL_THREADS) kvs_pred_weights(Batch b, PredState st, PredSpec ps, const int* slot, const int* mode,
                                                                          const unsigned* plan, i64 p_s, i64 p_h, const int* plan_len, int cap,
                                                                          const float* lgs, int lcap, const float2* parts, int nparts,
                                                                          const float2* aparts, int anparts) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    __shared__ float lse[GROUP];
    const int s = blockIdx.z, h = blockIdx.y, hk = st.hk;
    SeqRow r;
    bool use_plan;
    int jlo, jend;
    if (!pl_row(b, mode, plan_len, cap, hk, s, h, r, use_plan, jlo, jend) || jend > lcap) return;
    if ((int)(blockIdx.x * blockDim.x) >= jend) return;  // no positions for this CTA
    const long long sh = (long long)slot[s] * hk + h;
    unsigned* rw = reinterpret_cast<unsigned*>(pred_ring_row(st, sh, st.hdr[sh * HDR_WORDS + HDR_COUNT]));
    const unsigned* pe = plan + s * p_s + h * p_h;
    if (pl_from_attention(mode[s * hk + h])) {
        pl_weights_from_attention(r, ps, use_plan, jlo, jend, pe, lgs + (i64)(s * hk + h) * lcap * GROUP, aparts + (i64)(s * hk + h) * GROUP * anparts, anparts, rw);
        return;
    }
    if (threadIdx.x < GROUP) {
        const float2* pr = parts + ((i64)(s * hk + h) * GROUP + threadIdx.x) * nparts;
        float m = -INFINITY, sm = 0.0f;
        const int act = pl_active(jend, nparts);
        for (int i = 0; i < act; ++i) pl_merge(m, sm, pr[i].x, pr[i].y);
        lse[threadIdx.x] = m > -INFINITY ? m + log2f(sm) : INFINITY;
    }
    __syncthreads();
    const float* lrow = lgs + (i64)(s * hk + h) * GROUP * lcap;
    pl_pool_row(r, ps.block, use_plan, jlo, jend, pe, lse, rw, [&](int g, int jj, int) { return lrow[(i64)g * lcap + jj]; });
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
            for (int tt = 0; tt < ntok; ++tt) lens[tt] = pred_row_blocks(st, ps, pos0 + tt);
            hd[HDR_COUNT] = ntok;
            hd[HDR_PUSHED] = ntok;
        } else {
            int c = hd[HDR_COUNT];
            lens[pred_mod(c, H)] = pred_row_blocks(st, ps, r.hi);
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
