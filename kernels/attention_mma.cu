// Paged varlen attention on tensor cores (f16/bf16 caches), split-KV, for decode and prefill rows alike.
//
// Grid: (token, query-head group, split), as kvs_attn_split. A CTA owns the GQ query heads of one KV head
// (GQ <= 16) for one token and one of `nsplit` equal parts of its visible range (plan keys
// [split*chunk, (split+1)*chunk) in plan mode).
// The GQ query rows form the M = 16 side of mma.sync.m16n8k16 tiles (rows GQ..15 are zero padding), so
// one decode token costs per 16 keys 2*HEAD_DIM/16 MMAs for S = Q K^T and HEAD_DIM/8 for O += P V,
// instead of per-key FMAs and shuffle reductions.
//
// Each warp walks its own 16-key tiles (tile i of the CTA goes to warp i % NWARPS; a tile is 16
// consecutive positions starting at a multiple of 16, so with block size >= 16 it is one page) through a
// private NSTAGE-deep ring of shared-memory stages filled by 16-byte cp.async (zero-filled for masked
// keys); only __syncwarp is needed inside the loop. K and V rows are padded by 16 bytes in shared memory
// so that ldmatrix is free of bank conflicts. The online softmax runs on the S fragment in registers
// (base-2 logits, f32); P is rounded to the cache type for the PV MMA, the row sums stay in f32. At the
// end the warps are merged through shared memory (reusing the stage buffers) and the CTA writes the output (one split) or (O_s, LSE_s) to
// the workspace for kvs_attn_combine.
//
// Bounds and checks: identical contract to kvs_attn_split (positions clamped, out-of-range block ids
// masked; no index derived from metadata is used unchecked; a row with a bad batch description or that
// read a bad block id finishes as NaN and the fault goes to `kerr`, common.cuh). Needs: 16-byte aligned K/V rows and strides, HEAD_DIM % 16 == 0.
//
// Compile-time parameters: KVS_DTYPE (1 = f16, 2 = bf16), HEAD_DIM, GQ, GROUP, NWARPS, NSTAGE, L2_HINT, PLAN,
// ROW_SPLIT (1 = each row splits its own visible span, or its own plan, over the grid; 0 = the host's fixed chunks).
// PLAN=1: decode rows read their visit plan (src/policy/plan.rs, kernels/select.cu) instead of the
// sequence's positions; a split is a range of plan keys; the visible range still masks every key.
// TRAVERSAL_HOOK (with PLAN=1): a later stage watches each decode row's traversal of its plan and may
// stop it (src/cuda/traversal.rs; ART's is kernels/policy/art/traversal.cuh). The module's text puts the
// hook's file in front of this one; it defines TRAVERSAL_HOOK 1, the kernel shape it needs (an #error
// otherwise) and, each called by every thread of the CTA (the stop decisions uniform over it):
//   TraversalArgs                 its launch arguments, passed by value after `mode`;
//   traversal_order / _entry      the order the plan's entries are visited in (the split's keys are
//                                 visit indices: a split is a run of the order);
//   traversal_row, _split_start   its state of the row (kept across the re-run below) and of a split;
//   traversal_round               after every round (each warp's tile k; every warp runs every round,
//                                 the masked ones included): true stops the split's loop;
//   traversal_split_done          after the split's loop: its visit record;
//   traversal_last_split          once every split of the row has run (nsplit > 1): true in the last;
//   traversal_decide              in the row's last split: a stop over the whole row, whose later splits
//                                 leave the merge (LSE -inf) and whose split may have attended past it: that
//                                 split then re-runs its first `keys` keys into its own slot (pass 1, the
//                                 row's checks as pass 0 judged them; pass 1 reads the order and starts a
//                                 split's state, and calls no other hook before traversal_row_done);
//   traversal_row_done            the row's final record (visits, counters).
// LOGITS=1 (with PLAN=1): the decode rows' logits are also written out, for a policy that decides from
// this attention's own weights (RefreshKV's full step, kernels/refresh.cu): every visible key's base-2
// logit (the value the online softmax uses: after the softcap, times log2(e) and the scale) of each of the
// CTA's query heads goes to lg[((seq * hk + kvh) * lg_maxpos + pos) * GROUP + (head - kvh * GROUP)], so K
// is read once for the attention and the weights. Positions at or past lg_maxpos are not written. Each
// split also writes its softmax statistics per query head, (max, sum of 2^(l - max)) in base 2, to
// lg_parts[((seq * hk + kvh) * GROUP + head - kvh * GROUP) * lg_nparts + split] (the host keeps nsplit <=
// lg_nparts; split 0 writes (-inf, 0) to the slots past nsplit), so the row's LSE needs no pass over the
// logits. Over an
// FP8 cache (KV8) they are the logits of the dequantized keys (k_scale folded into the scale, as below).
// It also spreads a row whose plan is shorter than the launch's bound over every split (a per-row chunk,
// the launch's `chunk` for the longest rows, so those split as dense rows do): RefreshKV's partial rows
// (k positions) share the launch of its full rows (every position).
// KV8 (fp8.cuh; dense rows, plans, a traversal hook and LOGITS): FP8 caches. A tile's rows are copied as bytes
// into padded shared-memory rows (ROWB below) and each lane reads its MMA fragments from them
// as 32-bit words, widening in registers (exact): no pass over shared memory. K: a word is 4 consecutive
// channels of one key, so the k-step's channels are taken in the order (4j, 4j+1 | 4j+2, 4j+3) for lane
// pair j, and Q's A fragment is loaded in the same order (a dot product does not care). V: the PV product
// runs transposed, O^T += V^T P^T (M = 16 channels, N = 8 query heads, K = the tile's 16 keys), whose B
// fragment is the S accumulator's layout, so P feeds it as it is, and a tile's 16 keys cost HEAD_DIM / 16
// MMAs into half the accumulators (GQ <= 8; two MMAs per channel tile for GQ > 8). The A fragment wants
// two consecutive keys per register; a lane reads the same words of 4 keys and byte-permutes them, so a
// word's 4 channels feed rows r, r + 8 of two channel tiles. A lane's words of a row are contiguous
// (kv8_vw below: 16 bytes per 128-channel block, one 16-byte load per key), and the accumulators are
// stored back in channel order; each output element sums the same products in the same key order as the
// untransposed product. The FP8 loop is issue-bound (not memory-bound as bf16 is), so it also copies a
// whole tile (16 visible keys of one block) from one address per lane, stepped, and skips the O rescale
// while no head's running maximum moved. The MMAs are f16
// (e4m3 and e5m2 widen to f16 exactly, one cvt per pair; P in f16 is finer than in bf16): Q, f16 or bf16,
// is multiplied by 2^qe, qe chosen so that its largest magnitude lies in [2^14, 2^15) (exact: a power of
// two; only elements below 2^-28 of the largest lose bits, as f16 subnormals), and the logits by 2^-qe.
// k_scale multiplies the logit scale and v_scale the output, in f32.
// Dynamic shared memory: kvs_mma_smem_bytes() below (the host computes the same formula).

#include "common.cuh"
#include "params.cuh"
#include "combine.cuh"
#if KV8
#define MMA_F16 1  // FP8 widens to f16 in one instruction; Q is rescaled into f16's range (below)
#endif
#include "mma.cuh"
#include "fp8.cuh"
#include "mma_tile.cuh"

#if KV8
// Rescales the O^T tiles of one head half by the online softmax's alpha. Lane (r, qd) computed alpha of
// head r (+ 8) and holds heads 2 qd, 2 qd + 1: theirs come from lanes 8 qd and 8 qd + 4.
// Skipped while no head's maximum moved (alpha == 1 in every lane; x * 1 == x): most tiles of a long row.
__device__ __forceinline__ void kv8_rescale(float (*o)[4], float alpha, int qd) {
    if (!__any_sync(0xffffffffu, alpha != 1.f)) return;
    const float a0 = __shfl_sync(0xffffffffu, alpha, 8 * qd), a1 = __shfl_sync(0xffffffffu, alpha, 8 * qd + 4);
#pragma unroll
    for (int m = 0; m < KV8_MT; ++m) {
        o[m][0] *= a0;
        o[m][1] *= a1;
        o[m][2] *= a0;
        o[m][3] *= a1;
    }
}
#endif

#ifndef TRAVERSAL_HOOK
#define TRAVERSAL_HOOK 0
#endif
#if TRAVERSAL_HOOK && !PLAN
#error "TRAVERSAL_HOOK needs PLAN"
#endif
#ifndef ROW_SPLIT
#define ROW_SPLIT 1
#endif
#ifndef LOGITS
#define LOGITS 0
#endif
#if LOGITS && !PLAN
#error "LOGITS needs PLAN"
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS)
kvs_attn_mma(const elem_t* __restrict__ q, i64 q0, i64 q1, i64 q2,
             const kv_t* __restrict__ kc, i64 k0, i64 k1, i64 k2,
             const kv_t* __restrict__ vc, i64 v0, i64 v1, i64 v2,
             i64 num_blocks, int bs_log2,
             const int* __restrict__ bt, i64 bt0, i64 bt1, int bt_cols,
             const int* __restrict__ seq_lens, i64 sl0,
             const int* __restrict__ qsl, i64 qsl0, int num_seqs,
             float scale, float softcap, int window, int chunk,
             elem_t* __restrict__ out, i64 o0, i64 o1, i64 o2,
             float* __restrict__ lse, i64 l0, i64 l1,
             float* __restrict__ ws_o, float* __restrict__ ws_lse, int num_q_heads,
             unsigned long long* kerr, unsigned long long* kbk,
             PlanRef plan, int mode
#if TRAVERSAL_HOOK
             , TraversalArgs hook
#endif
#if LOGITS
             , float* __restrict__ lg, int lg_maxpos, float2* __restrict__ lg_parts, int lg_nparts
#endif
#if KV8
             , float k_scale, float v_scale
#endif
             ) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ unsigned sm_mask[NWARPS][NSTAGE];
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
#if LOGITS
    __shared__ int sm_pos[NWARPS][NSTAGE][16];  // each stage's key positions (-1: masked)
#endif
    const int t = blockIdx.x, hg = blockIdx.y, split = blockIdx.z, nsplit = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = lane >> 2, qd = lane & 3;  // fragment row (query head) and column pair
    const int h0 = hg * GQ, kvh = h0 / GROUP;

    const RowInfo row = locate(t, qsl, qsl0, seq_lens, sl0, num_seqs, bt_cols << bs_log2, window);
    // K and V bytes of one position over all KV heads (the counters' unit of dense reads).
    const i64 kv_row_bytes = (i64)HEAD_DIM * (i64)sizeof(kv_t) * 2 * (num_q_heads / GROUP);
#if KV8
    scale *= k_scale;  // logits of the dequantized keys: scale * q . (k * k_scale)
#else
    const float v_scale = 1.f;
#endif
    __shared__ int sm_rc[KVS_RC_WORDS];  // the row's check words, judged at the end (kvs_finish_row_checks)
    if (!kvs_serve_row(mode, row, kerr, kbk, qsl, qsl0, seq_lens, sl0, num_seqs, bt_cols, bs_log2, window, kv_row_bytes, sm_rc)) return;  // another launch serves it
    bool bt_bad = false;  // this thread read a block id outside [0, num_blocks)
#if PLAN
    // Plan mode: this split walks plan keys [s_lo, s_hi] (key g = position (e[g >> ulog2] << ulog2) | low bits).
    const int pl = min(max(plan.len[row.seq * plan.hk + kvh], 0), plan.cap);
    const int nkeys = pl << plan.ulog2;
    const unsigned* pe = plan.e + row.seq * plan.p_s + kvh * plan.p_h;
    const int umask = (1 << plan.ulog2) - 1;
#if LOGITS || (ROW_SPLIT && !TRAVERSAL_HOOK)
    // Each row cuts its own plan into the grid's splits (whole CTA rounds of 16 * NWARPS keys): the host
    // sized the grid for the longest plan a row may hold (for a selector without a budget, every
    // position), so a plan of a few thousand keys at 128K would otherwise sit in the first split alone.
    // A plan as long as the host planned for gets the host's chunks (no longer ones).
    const int rchunk = min(chunk, max(16 * NWARPS, ((nkeys + nsplit - 1) / nsplit + 16 * NWARPS - 1) / (16 * NWARPS) * (16 * NWARPS)));
#else
    const int rchunk = chunk;  // a traversal hook's fixed splits; KVS_CUDA_ROW_SPLIT=0 (measurements only)
#endif
    int s_lo = split * rchunk;  // (a traversal hook may re-run a split over its first keys: not const)
    int s_hi = (split == nsplit - 1) ? nkeys - 1 : min((split + 1) * rchunk, nkeys) - 1;
#if TRAVERSAL_HOOK
    // The hook's visiting order: visit index i -> plan entry.
    const i64 row_off = row.seq * plan.p_s + kvh * plan.p_h;
    const TraversalOrder hord = traversal_order(hook, pe, pl, plan.ulog2, row_off);
#define PLAN_E(i) traversal_entry(hord, pe, pl, i)
#else
#define PLAN_E(i) pe[i]
#endif
#else
    // The host sized the grid (nsplit, chunk) for the longest row it knows of; with max_seq_len = 0 (a
    // CUDA graph captured once for every length) that is the block table's width, often far beyond the
    // rows of a replay. So each row cuts its own visible span into the grid's splits (whole CTA tiles,
    // at least min(chunk, 4 tiles)): a short row still spreads over the device, a row as long as the
    // plan gets exactly the host's chunks, and a sliding window's span is split, not its absolute range.
#if ROW_SPLIT
    const int base = row.lo & ~15;
    int span_chunk = (row.hi - base + nsplit) / nsplit;  // ceil(span / nsplit), span = hi - base + 1
    span_chunk = (span_chunk + 16 * NWARPS - 1) / (16 * NWARPS) * (16 * NWARPS);
    span_chunk = max(span_chunk, min(chunk, 4 * 16 * NWARPS));
#else
    const int base = 0, span_chunk = chunk;  // KVS_CUDA_ROW_SPLIT=0: the plan's fixed chunks (measurements only)
#endif
    int s_lo = base + split * span_chunk, s_hi = (split == nsplit - 1) ? row.hi : base + (split + 1) * span_chunk - 1;
    s_lo = max(s_lo, row.lo);
    s_hi = min(s_hi, row.hi);
#endif

    // Q as the A operand (raw cache-type bits; the scale is applied to S in f32).
    unsigned qa[KSTEPS][4];
#if KV8
    // f16 A operand: Q times 2^qe (header). Every warp loads the whole Q tile, so a warp max is the CTA's.
    float qmax = 0.f;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int hr = r + (j & 1) * 8, col = ks * 16 + qd * 4 + (j >> 1) * 2;
            if (hr < GQ) {
                const elem_t* qp = q + t * q0 + (h0 + hr) * q1 + (i64)col * q2;
                qmax = fmaxf(qmax, fmaxf(fabsf(ET::ld(qp[0])), fabsf(ET::ld(qp[q2]))));
            }
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, o));
    // qe = 14 - floor(log2(qmax)) for a finite non-zero max (else 0: a non-finite Q poisons its rows anyway).
    const int qe = (qmax > 0.f && isfinite(qmax)) ? min(max(14 - (((__float_as_int(qmax) >> 23) & 0xff) - 127), -100), 100) : 0;
    const float qmul = ldexpf(1.f, qe);
    scale *= ldexpf(1.f, -qe);  // logits = (2^qe q) . k * 2^-qe * scale
#endif
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#if KV8
            const int hr = r + (j & 1) * 8, col = ks * 16 + qd * 4 + (j >> 1) * 2;  // the K words' channel order
#else
            const int hr = r + (j & 1) * 8, col = ks * 16 + (j >> 1) * 8 + qd * 2;
#endif
            unsigned v = 0;
            if (hr < GQ) {
                const elem_t* qp = q + t * q0 + (h0 + hr) * q1 + (i64)col * q2;
#if KV8
                asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(ET::ld(qp[q2]) * qmul), "f"(ET::ld(qp[0]) * qmul));
#else
                v = (unsigned)qp[0] | ((unsigned)qp[q2] << 16);
#endif
            }
            qa[ks][j] = v;
        }
#if KV8 && GQ <= 8
    // Rows r + 8 of the A operand are padding: zero, made by a byte permute that ptxas does not fold, so
    // that it keeps every quad whole in registers instead of re-zeroing and copying quads around each MMA
    // of the loop (the FP8 loop is issue-bound).
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        asm("prmt.b32 %0, %1, 0, 0x4444;" : "=r"(qa[ks][1]) : "r"(qa[ks][0]));
        asm("prmt.b32 %0, %1, 0, 0x4444;" : "=r"(qa[ks][3]) : "r"(qa[ks][2]));
    }
#endif

#if TRAVERSAL_HOOK
    // The hook's state of the row, and the re-run it may ask for once every split has run (pass 1: the
    // first keys of split `hook_slot` again, into that split's slot).
    TraversalRow hrow = traversal_row(hook, nsplit);
    int hook_pass = 0, hook_slot = split;
    bool hook_row_bad = false;
hook_pass_start:
#endif
#if KV8
    float o[KV8_HH * KV8_MT][4];  // O^T tiles (transposed PV, header): [head half][16-channel tile]
#pragma unroll
    for (int n = 0; n < KV8_HH * KV8_MT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
#else
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
#endif
    float m0 = -INFINITY, m1 = -INFINITY, l0s = 0.f, l1s = 0.f;
    bool bad0 = false, bad1 = false;  // this lane's rows r and r + 8 met a non-finite visible logit

    const int* bt_row = bt + row.seq * bt0;
    const int bmask = (1 << bs_log2) - 1;
    const int tb0 = s_lo & ~15;
    const int ntiles = s_hi >= s_lo ? ((s_hi - tb0) >> 4) + 1 : 0;
    const int my_n = ntiles > warp ? (ntiles - warp + NWARPS - 1) / NWARPS : 0;
    const unsigned wbase = smem_u32(smem) + warp * (NSTAGE * 2 * TILEB);
    const kv_t* kh = kc + kvh * k2;
    const kv_t* vh = vc + kvh * v2;
#if KV8 && 32 % CPR8 == 0
    // A whole tile's copies (below): lane l's first chunk is row l / CPR8, chunk l % CPR8 of the row.
    // Opaque to the compiler, so that it keeps them in registers instead of recomputing them every tile.
    const kv_t* kv8_kl = kh + (lane / CPR8) * k1 + (lane % CPR8) * 16;
    const kv_t* kv8_vl = vh + (lane / CPR8) * v1 + (lane % CPR8) * 16;
    unsigned kv8_dl = (lane / CPR8) * ROWB + (lane % CPR8) * 16;
    asm("" : "+l"(kv8_kl), "+l"(kv8_vl), "+r"(kv8_dl));
#endif

#if PLAN && !TRAVERSAL_HOOK
    // The plan entries of a tile are read one tile ahead: load(k) uses those load(k - 1) read and reads
    // tile k + 1's (load runs for k = 0, 1, 2, ... in order), so a tile's copy waits for its block id only,
    // as a dense row's does, not for a plan read before it.
    auto plan_entry = [&](int k) -> unsigned {
        const int g = tb0 + (warp + k * NWARPS) * 16 + (lane & 15);
        return k < my_n && g <= s_hi ? PLAN_E(g >> plan.ulog2) : 0u;
    };
    unsigned pf_e = plan_entry(0);
#endif
    // Issues the cp.async of this warp's k-th tile into stage st (always commits a group).
    auto load = [&](int k, int st) {
        if (k < my_n) {
            const int pb = tb0 + (warp + k * NWARPS) * 16;
            const int key = lane & 15;
#if PLAN
            int p = -1;
            bool ok = pb + key <= s_hi;
#if !TRAVERSAL_HOOK
            const unsigned e_k = pf_e;
            pf_e = plan_entry(k + 1);
#endif
            if (ok) {
                const int g = pb + key;
#if TRAVERSAL_HOOK
                p = (int)((PLAN_E(g >> plan.ulog2) << plan.ulog2) | (unsigned)(g & umask));
#else
                p = (int)((e_k << plan.ulog2) | (unsigned)(g & umask));
#endif
                ok = p >= row.lo && p <= row.hi;
            }
#else
            const int p = pb + key;
            bool ok = p >= s_lo && p <= s_hi;
#endif
            int blk = 0;
            if (ok) {
                blk = bt_row[(i64)(p >> bs_log2) * bt1];
                ok = blk >= 0 && blk < num_blocks;
                bt_bad = bt_bad || !ok;
            }
            const unsigned msk = __ballot_sync(0xffffffffu, ok) & 0xffffu;
            if (lane == 0) sm_mask[warp][st] = msk;
#if LOGITS
            if (lane < 16) sm_pos[warp][st][lane] = ok ? p : -1;
#endif
            const unsigned kdst = wbase + st * (2 * TILEB), vdst = kdst + TILEB;
#if KV8
            // FP8 rows: HEAD_DIM bytes per padded row (widened in registers when the fragments are read).
            // A whole tile (16 visible keys at consecutive positions of one block: every interior tile of a
            // dense row with blocks of >= 16 positions, a plan's runs of >= 16 keys) has affine row
            // addresses: one base per tile, stepped per chunk, no shuffles and no 64-bit products per
            // chunk (the FP8 path is issue-bound). Other tiles take the per-chunk path below.
#if PLAN
            const int p0 = __shfl_sync(0xffffffffu, p, 0);
            const bool whole = __all_sync(0xffffffffu, p == p0 + key) && msk == 0xffffu && (p0 & bmask) + 15 <= bmask;
#else
            const int p0 = pb;
            const bool whole = msk == 0xffffu && bs_log2 >= 4;
#endif
            if (whole) {
                // Every lane's blk is the tile's block (valid, so not negative; nor is the row).
                const i64 row0 = (unsigned)(p0 & bmask);
#if 32 % CPR8 == 0
                // Chunk i of lane l: row i * (32 / CPR8) + l / CPR8, chunk l % CPR8 of the row.
                const kv_t* ks = kv8_kl + (i64)(unsigned)blk * k0 + row0 * k1;
                const kv_t* vs = kv8_vl + (i64)(unsigned)blk * v0 + row0 * v1;
                const unsigned kd = kdst + kv8_dl;
#pragma unroll
                for (int i = 0; i < (16 * CPR8 + 31) / 32; ++i) {
                    if (CPR8 > 1 || lane < 16) {  // head size 16: one chunk per row, 16 lanes
                        cp_async16(kd + i * (32 / CPR8) * ROWB, ks + i * (32 / CPR8) * k1, 16);
                        cp_async16(kd + TILEB + i * (32 / CPR8) * ROWB, vs + i * (32 / CPR8) * v1, 16);
                    }
                }
#else
                const kv_t* kr0 = kh + (i64)(unsigned)blk * k0 + row0 * k1;
                const kv_t* vr0 = vh + (i64)(unsigned)blk * v0 + row0 * v1;
#pragma unroll
                for (int i = 0; i < (16 * CPR8 + 31) / 32; ++i) {
                    const int c = i * 32 + lane, kr = c / CPR8, cc = c % CPR8;
                    if (c < 16 * CPR8) {
                        cp_async16(kdst + kr * ROWB + cc * 16, kr0 + kr * k1 + cc * 16, 16);
                        cp_async16(vdst + kr * ROWB + cc * 16, vr0 + kr * v1 + cc * 16, 16);
                    }
                }
#endif
            } else {
#pragma unroll
                for (int i = 0; i < (16 * CPR8 + 31) / 32; ++i) {
                    const int c = i * 32 + lane, kr = min(c / CPR8, 15), cc = c % CPR8;
                    const int b = __shfl_sync(0xffffffffu, blk, kr);
                    const bool v = (msk >> kr) & 1;
#if PLAN
                    const i64 off = __shfl_sync(0xffffffffu, p, kr) & bmask;
#else
                    const i64 off = (pb + kr) & bmask;
#endif
                    if (c < 16 * CPR8) {
                        const kv_t* ks = v ? kh + (i64)b * k0 + off * k1 + cc * 16 : kc;
                        const kv_t* vs = v ? vh + (i64)b * v0 + off * v1 + cc * 16 : vc;
                        cp_async16(kdst + kr * ROWB + cc * 16, ks, v ? 16 : 0);
                        cp_async16(vdst + kr * ROWB + cc * 16, vs, v ? 16 : 0);
                    }
                }
            }
#else
#pragma unroll
            for (int i = 0; i < CPR / 2; ++i) {
                const int c = i * 32 + lane, kr = c / CPR, cc = c % CPR;
                const int b = __shfl_sync(0xffffffffu, blk, kr);
                const bool v = (msk >> kr) & 1;
#if PLAN
                const i64 off = __shfl_sync(0xffffffffu, p, kr) & bmask;
#else
                const i64 off = (pb + kr) & bmask;
#endif
                const elem_t* ks = v ? kh + (i64)b * k0 + off * k1 + cc * 8 : kc;
                const elem_t* vs = v ? vh + (i64)b * v0 + off * v1 + cc * 8 : vc;
                cp_async16(kdst + kr * ROWB + cc * 16, ks, v ? 16 : 0);
                cp_async16(vdst + kr * ROWB + cc * 16, vs, v ? 16 : 0);
            }
#endif
        }
        cp_commit();
    };

#pragma unroll
    for (int st = 0; st < NSTAGE - 1; ++st) load(st, st);

    const float sl2 = scale * KVS_LOG2E;
    // ldmatrix lane addresses inside a tile: K (non-transposed, B of S = Q K^T) and V (transposed, B of P V).
    const unsigned koff = ((lane & 7) + ((lane >> 4) << 3)) * ROWB + ((lane >> 3) & 1) * 16;
    const unsigned voff = ((lane & 7) + (((lane >> 3) & 1) << 3)) * ROWB + (lane >> 4) * 16;

#if TRAVERSAL_HOOK
    // Every warp runs every round (the hook watches whole rounds).
    const int nloop = (ntiles + NWARPS - 1) / NWARPS;
    TraversalSplit hsplit = traversal_split_start();
#else
    const int nloop = my_n;
#endif
    for (int k = 0; k < nloop; ++k) {
      if (k < my_n) {
        cp_wait<NSTAGE - 2>();
        __syncwarp();
        const int st = k % NSTAGE;
        const unsigned msk = sm_mask[warp][st];
        load(k + NSTAGE - 1, (k + NSTAGE - 1) % NSTAGE);
        const unsigned kb = wbase + st * (2 * TILEB), vb = kb + TILEB;

        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#if KV8
        // Lane (r, qd): key r (and r + 8), channels ks * 16 + 4 qd .. + 3 as one word.
        const unsigned char* k8 = smem + (kb - smem_u32(smem)) + r * ROWB + qd * 4;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const unsigned w = *reinterpret_cast<const unsigned*>(k8 + n * 8 * ROWB + ks * 16);
                mma16816(s[n], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], kv8x2_to_f16x2((unsigned short)(w & 0xffff)), kv8x2_to_f16x2((unsigned short)(w >> 16)));
            }
#else
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            unsigned b[4];
            ldsm_x4(b, kb + koff + ks * 32);
            mma16816(s[0], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b[0], b[1]);
            mma16816(s[1], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b[2], b[3]);
        }
#endif
        // Logits (base 2), masked keys at -inf. A visible key whose raw score is not finite (NaN or
        // infinity in q or k, or an overflow) poisons its row: the row finishes as NaN (issue 12).
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
#if KV8 && GQ <= 8
                if (e >= 2) continue;  // rows r + 8 are padding, never read on this path
#endif
                float x = s[n][e];
                const bool vis = (msk >> (n * 8 + qd * 2 + (e & 1))) & 1;
                if (vis && !isfinite(x)) {
                    if (e < 2) bad0 = true; else bad1 = true;
                }
                x = softcap > 0.f ? softcap * tanhf(x * scale / softcap) * KVS_LOG2E : x * sl2;
                s[n][e] = vis ? x : -INFINITY;
            }
#if LOGITS
        {
            float* lgh = lg + (i64)(row.seq * plan.hk + kvh) * lg_maxpos * GROUP + (h0 - kvh * GROUP);
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int hr = r + (e >> 1) * 8, pos = sm_pos[warp][st][n * 8 + qd * 2 + (e & 1)];
                    if (hr < GQ && pos >= 0 && pos < lg_maxpos) lgh[(i64)pos * GROUP + hr] = s[n][e];
                }
        }
#endif
        unsigned pa[4];
        {
            float mx = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m0, mx), mu = mn == -INFINITY ? 0.f : mn;
            const float alpha = exp2f(m0 - mu);
            m0 = mn;
            float sum = 0.f;
            pa[0] = pack2(exp2f(s[0][0] - mu), exp2f(s[0][1] - mu), &sum);
            pa[2] = pack2(exp2f(s[1][0] - mu), exp2f(s[1][1] - mu), &sum);
            l0s = l0s * alpha + sum;
#if KV8
            kv8_rescale(o, alpha, qd);
#else
#pragma unroll
            for (int n = 0; n < NT; ++n) { o[n][0] *= alpha; o[n][1] *= alpha; }
#endif
        }
#if GQ > 8
        {
            float mx = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m1, mx), mu = mn == -INFINITY ? 0.f : mn;
            const float alpha = exp2f(m1 - mu);
            m1 = mn;
            float sum = 0.f;
            pa[1] = pack2(exp2f(s[0][2] - mu), exp2f(s[0][3] - mu), &sum);
            pa[3] = pack2(exp2f(s[1][2] - mu), exp2f(s[1][3] - mu), &sum);
            l1s = l1s * alpha + sum;
#if KV8
            kv8_rescale(o + KV8_MT, alpha, qd);
#else
#pragma unroll
            for (int n = 0; n < NT; ++n) { o[n][2] *= alpha; o[n][3] *= alpha; }
#endif
        }
#else
        pa[1] = pa[3] = 0u;
#endif
#if KV8
        // O^T += V^T P^T: lane (r, qd) reads keys 2 qd, 2 qd + 1, 2 qd + 8, 2 qd + 9, its words of each
        // (kv8_vw, 16-byte loads); bytes 2 h, 2 h + 1 of word g are rows r, r + 8 of channel tile 2 g + h.
        // P^T's B fragment is the S accumulator's layout (head r, keys 2 qd, 2 qd + 1 | + 8): pa.
        const unsigned char* v8 = smem + (vb - smem_u32(smem)) + 2 * qd * ROWB;
        // Channel tile mt from the 16-bit pairs (bytes b0, b1 of the 4 keys' words): rows r, r + 8.
        auto pv = [&](int mt, unsigned w0, unsigned w1, unsigned w8, unsigned w9, unsigned b0, unsigned b1) {
            const unsigned s0 = b0 | ((4 + b0) << 4), s1 = b1 | ((4 + b1) << 4);
            const unsigned a0 = kv8x2_to_f16x2((unsigned short)__byte_perm(w0, w1, s0)), a1 = kv8x2_to_f16x2((unsigned short)__byte_perm(w0, w1, s1));
            const unsigned a2 = kv8x2_to_f16x2((unsigned short)__byte_perm(w8, w9, s0)), a3 = kv8x2_to_f16x2((unsigned short)__byte_perm(w8, w9, s1));
            mma16816(o[mt], a0, a1, a2, a3, pa[0], pa[2]);
#if GQ > 8
            mma16816(o[KV8_MT + mt], a0, a1, a2, a3, pa[1], pa[3]);
#endif
        };
        auto pv4 = [&](int g, unsigned w0, unsigned w1, unsigned w8, unsigned w9) {
            pv(2 * g, w0, w1, w8, w9, 0, 1);
            pv(2 * g + 1, w0, w1, w8, w9, 2, 3);
        };
#pragma unroll
        for (int b = 0; b < KV8_GF; ++b) {
            const unsigned char* vw = v8 + kv8_vw(4 * b, r);
            const uint4 a0 = *reinterpret_cast<const uint4*>(vw), a1 = *reinterpret_cast<const uint4*>(vw + ROWB);
            const uint4 a8 = *reinterpret_cast<const uint4*>(vw + 8 * ROWB), a9 = *reinterpret_cast<const uint4*>(vw + 9 * ROWB);
            pv4(4 * b, a0.x, a1.x, a8.x, a9.x);
            pv4(4 * b + 1, a0.y, a1.y, a8.y, a9.y);
            pv4(4 * b + 2, a0.z, a1.z, a8.z, a9.z);
            pv4(4 * b + 3, a0.w, a1.w, a8.w, a9.w);
        }
#if KV8_GR == 2
        {
            const unsigned char* vw = v8 + kv8_vw(4 * KV8_GF, r);
            const uint2 a0 = *reinterpret_cast<const uint2*>(vw), a1 = *reinterpret_cast<const uint2*>(vw + ROWB);
            const uint2 a8 = *reinterpret_cast<const uint2*>(vw + 8 * ROWB), a9 = *reinterpret_cast<const uint2*>(vw + 9 * ROWB);
            pv4(4 * KV8_GF, a0.x, a1.x, a8.x, a9.x);
            pv4(4 * KV8_GF + 1, a0.y, a1.y, a8.y, a9.y);
        }
#else
#pragma unroll
        for (int g = 4 * KV8_GF; g < KV8_G; ++g) {
            const unsigned char* vw = v8 + kv8_vw(g, r);
            pv4(g, *reinterpret_cast<const unsigned*>(vw), *reinterpret_cast<const unsigned*>(vw + ROWB), *reinterpret_cast<const unsigned*>(vw + 8 * ROWB),
                *reinterpret_cast<const unsigned*>(vw + 9 * ROWB));
        }
#endif
#if HEAD_DIM % 32
        {
            // The last 16 channels, one tile: lane r reads channels 32 KV8_G + 2 r, + 1 of the same 4 keys.
            const unsigned char* vw = v8 + 32 * KV8_G + 2 * r;
            pv(2 * KV8_G, *reinterpret_cast<const unsigned short*>(vw), *reinterpret_cast<const unsigned short*>(vw + ROWB),
               *reinterpret_cast<const unsigned short*>(vw + 8 * ROWB), *reinterpret_cast<const unsigned short*>(vw + 9 * ROWB), 0, 1);
        }
#endif
#else
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            unsigned b[4];
            ldsm_x4_t(b, vb + voff + j * 32);
            mma16816(o[2 * j], pa[0], pa[1], pa[2], pa[3], b[0], b[1]);
            mma16816(o[2 * j + 1], pa[0], pa[1], pa[2], pa[3], b[2], b[3]);
        }
#endif
      }
#if TRAVERSAL_HOOK
        if (hook_pass == 0 && traversal_round(hook, hrow, hsplit, k, o, l0s, m0, v_scale, lane, warp, row.seq, kvh, s_lo)) break;  // uniform over the CTA
#endif
    }
    cp_wait<0>();
#if TRAVERSAL_HOOK
    if (hook_pass == 0) traversal_split_done(hook, hrow, hsplit, row.seq, kvh, split, nsplit, nloop);
#endif

    // Row sums across the quad (each lane summed its own columns).
    l0s += __shfl_xor_sync(0xffffffffu, l0s, 1);
    l0s += __shfl_xor_sync(0xffffffffu, l0s, 2);
    l1s += __shfl_xor_sync(0xffffffffu, l1s, 1);
    l1s += __shfl_xor_sync(0xffffffffu, l1s, 2);

    // Poisoned rows: OR over the quad (each lane saw its own columns).
    bad0 = __shfl_xor_sync(0xffffffffu, (int)bad0, 1) | bad0;
    bad0 = __shfl_xor_sync(0xffffffffu, (int)bad0, 2) | bad0;
    bad1 = __shfl_xor_sync(0xffffffffu, (int)bad1, 1) | bad1;
    bad1 = __shfl_xor_sync(0xffffffffu, (int)bad1, 2) | bad1;
    __shared__ int sm_bad[GQ];
    __shared__ int sm_col;
    if (threadIdx.x < GQ) sm_bad[threadIdx.x] = 0;

    // Merge the warps of this CTA in shared memory (the stage buffers are free once every warp is here).
    kvs_row_check_wait();
    const bool cta_bt_bad = __syncthreads_or((int)bt_bad) != 0;
    if (qd == 0) {
        if (bad0 && r < GQ) sm_bad[r] = 1;
        if (bad1 && r + 8 < GQ) sm_bad[r + 8] = 1;
    }
    float* sm_o = reinterpret_cast<float*>(smem);        // [NWARPS][GQ][HEAD_DIM]
    float* sm_m = sm_o + NWARPS * GQ * HEAD_DIM;           // [NWARPS][GQ]
    float* sm_l = sm_m + NWARPS * GQ;                      // [NWARPS][GQ]
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int hr = r + half * 8;
        if (hr < GQ) {
            if (qd == 0) {
                sm_m[warp * GQ + hr] = half ? m1 : m0;
                sm_l[warp * GQ + hr] = half ? l1s : l0s;
            }
#if !KV8
            float* dst = sm_o + (warp * GQ + hr) * HEAD_DIM + qd * 2;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                dst[n * 8] = o[n][half * 2];
                dst[n * 8 + 1] = o[n][half * 2 + 1];
            }
#endif
        }
    }
#if KV8
    // O^T tiles: lane (r, qd) holds heads 2 qd, 2 qd + 1 (+ 8 hh) at rows r, r + 8; the 4 bytes of its word g
    // (tiles 2 g, 2 g + 1) are 4 consecutive channels: one 16-byte store per word and head.
#pragma unroll
    for (int hh = 0; hh < KV8_HH; ++hh)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int hr = hh * 8 + 2 * qd + j;
            if (hr < GQ) {
                float* dst = sm_o + (warp * GQ + hr) * HEAD_DIM;
                const float(*ot)[4] = o + hh * KV8_MT;
#pragma unroll
                for (int g = 0; g < KV8_G; ++g)
                    *reinterpret_cast<float4*>(dst + kv8_vw(g, r)) = make_float4(ot[2 * g][j], ot[2 * g][2 + j], ot[2 * g + 1][j], ot[2 * g + 1][2 + j]);
#if HEAD_DIM % 32
                *reinterpret_cast<float2*>(dst + 32 * KV8_G + 2 * r) = make_float2(ot[2 * KV8_G][j], ot[2 * KV8_G][2 + j]);
#endif
            }
        }
#endif
    __syncthreads();
    bool row_bad;
#if TRAVERSAL_HOOK
    if (hook_pass == 1) {
        row_bad = hook_row_bad;  // judged (and recorded) in pass 0, which read a superset of these keys
    } else
#endif
    {
        RowCheck rc;
        row_bad = kvs_finish_row_checks(kerr, sm_rc, num_seqs, &rc, cta_bt_bad, t, row.seq, bt_row, bt1, num_blocks, bt_cols, bs_log2, &sm_col);
        kvs_check_seqs(kerr, kbk, qsl, qsl0, seq_lens, sl0, num_seqs, gridDim.x, bt_cols, bs_log2, window, kv_row_bytes, &rc, row.seq);
    }
#if TRAVERSAL_HOOK
    hook_row_bad = row_bad;
    const int wsplit = hook_slot;  // pass 1 rewrites the slot of the split it re-ran
#else
    const int wsplit = split;
#endif
#if LOGITS
    // Split 0 marks the slots of splits this launch does not have as empty (-inf, 0).
    if (split == 0)
        for (int i = threadIdx.x; i < GQ * (lg_nparts - nsplit); i += NTHREADS)
            lg_parts[((i64)(row.seq * plan.hk + kvh) * GROUP + (h0 - kvh * GROUP) + i % GQ) * lg_nparts + nsplit + i / GQ] = make_float2(-INFINITY, 0.f);
#endif
    for (int idx = threadIdx.x; idx < GQ * HEAD_DIM; idx += NTHREADS) {
        const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, sm_m[w * GQ + g]);
        float L = 0.f, O = 0.f;
        if (M != -INFINITY) {
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float wt = exp2f(sm_m[w * GQ + g] - M);
                L = fmaf(sm_l[w * GQ + g], wt, L);
                O = fmaf(sm_o[(w * GQ + g) * HEAD_DIM + d], wt, O);
            }
        }
        const bool any = L > 0.f;
        const float nan = __int_as_float(0x7fffffff);
        const bool bad = sm_bad[g] != 0 || row_bad;
        const float ov = bad ? nan : (any ? O / L * v_scale : 0.f);
        const float lse_nat = bad ? nan : (any ? (M + log2f(L)) * KVS_LN2 : -INFINITY);
        const int h = h0 + g;
#if LOGITS
        // The split's softmax statistics of this head (base 2: max logit, sum of 2^(l - max); raw, a NaN
        // logit's NaN included), from which the policy merges the row's LSE (lg_parts, header).
        if (d == 0 && split < lg_nparts) lg_parts[((i64)(row.seq * plan.hk + kvh) * GROUP + (h0 - kvh * GROUP) + g) * lg_nparts + split] = make_float2(M, L);
#endif
        if (nsplit == 1) {
            out[t * o0 + h * o1 + d * o2] = ET::st(ov);
            if (lse != 0 && d == 0) lse[t * l0 + h * l1] = lse_nat;
        } else {
            const i64 slot = ((i64)t * num_q_heads + h) * nsplit + wsplit;
            ws_o[slot * HEAD_DIM + d] = ov;
            if (d == 0) ws_lse[slot] = lse_nat;
        }
    }
#if TRAVERSAL_HOOK
    // Once every split of the row has run (the last to arrive goes on): the hook's decision over the row,
    // then its record.
    if (hook_pass == 0 && nsplit > 1 && !traversal_last_split(hook, row.seq, kvh, nsplit)) return;
    __syncthreads();  // the merge buffers are free
    if (hook_pass == 0) {
        const TraversalStop stop = traversal_decide(hook, hrow, row.seq, kvh, nkeys, chunk, nsplit, reinterpret_cast<float*>(smem));
        if (stop.split >= 0) {
            const int ss = stop.split;
            // The splits after the stop were not visited: out of the merge (kvs_attn_combine skips -inf).
            for (int idx = threadIdx.x; idx < (nsplit - 1 - ss) * GQ; idx += NTHREADS)
                ws_lse[((i64)t * num_q_heads + h0 + idx % GQ) * nsplit + ss + 1 + idx / GQ] = -INFINITY;
            if (stop.rerun) {
                // The stop lies inside split ss: attend its first stop.keys keys again into its slot.
                s_lo = ss * chunk;
                s_hi = min(s_lo + stop.keys, nkeys) - 1;
                hook_slot = ss;
                hook_pass = 1;
                bt_bad = false;
                __syncthreads();
                goto hook_pass_start;
            }
        }
    }
    traversal_row_done(hook, hrow, row.lo, row.hi, bs_log2, pe, pl, plan.ulog2, row_off, row.seq, kvh, nsplit, chunk);
#endif
}
