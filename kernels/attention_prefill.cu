// Paged varlen attention of prefill rows (query length != 1: prefill, chunked prefill, extend) on tensor
// cores, f16/bf16 caches. The decode kernel (attention_mma.cu) runs one CTA per query token and so reads
// a sequence's K/V once per token; here a CTA owns a tile of T consecutive query tokens of the batch and
// the GQ query heads of one KV head, BM = T * GQ rows (row m = token m / GQ, head m % GQ), and streams
// K/V tiles of BN keys through shared memory once for all BM rows.
//
// Grid: (ceil(num_tokens / T), num_q_heads / GQ, split). Tiles are cut from the batch's token axis, so
// every token has exactly one tile whatever the metadata holds; a tile that straddles sequences is served
// one sequence at a time ("segments": runs of tokens that locate() puts in the same sequence; locate is
// monotone in the token, so a run is contiguous). The kernel serves the rows a MODE_DENSE_REST launch of
// the decode kernel serves (query length != 1); decode rows are left to it.
//
// Warps: NWARPS, each owning MW blocks of 16 rows (the M side of mma.sync.m16n8k16), so one ldmatrix of
// K or V feeds 2 * MW MMAs. K/V tiles go through an NSTAGE-deep ring of shared-memory stages filled by
// 16-byte cp.async by the whole CTA (zero-filled for keys outside the segment's range or with a bad block
// id); rows are padded by 16 bytes so ldmatrix is free of bank conflicts. Q sits in shared memory for the
// CTA's life. The online softmax runs on the S fragment in registers in base 2 (f32), P is rounded to the
// cache type for the PV MMA and the row sums stay in f32, as in the decode kernel. Causal/window masking
// per row (a row at position p sees keys [lo(p), p]); a warp skips key tiles none of its rows sees, and
// the per-element mask runs only on tiles some row sees in part.
//
// Split-KV: split z covers key positions [z * chunk, (z + 1) * chunk) (the last one runs to the end);
// with more than one split every served row writes (O_z, LSE_z) of every split to the workspace (LSE
// -inf where it sees nothing) and kvs_attn_combine (combine.cuh, mode MODE_DENSE_REST) merges them.
//
// Bounds and checks (the decode kernel's contract): no index derived from metadata is used unchecked
// (clean rows read block-table columns below ceil(seq_len / block size), checked against the table's
// width; block ids are checked against num_blocks before any read). A row with a bad batch description
// (kvs_row_fault) finishes as NaN; a row whose visible keys include one with a bad block id finishes as
// NaN; a visible non-finite logit makes its row NaN. Faults go to `kerr` (common.cuh). The sequences'
// checks and counters (kvs_check_seqs) are the decode kernel's launch's, which runs first in each call.
//
// FP8 caches (KV8, fp8.cuh): a tile's FP8 rows are copied by cp.async into the upper half of each padded
// row and, once the stage is in, widened in place to the query's type (exact: every E4M3/E5M2 value is an
// f16 and a bf16), so the MMAs and the softmax are the 16-bit path's; k_scale multiplies the logit scale and
// v_scale the output, in f32.
//
// Compile-time parameters: KVS_DTYPE (1 = f16, 2 = bf16), HEAD_DIM (multiple of 16), GQ (query heads
// per CTA, a power of two dividing GROUP, at most 16), GROUP, NWARPS, MW, BN (multiple of 16), NSTAGE, KV8.
// Dynamic shared memory: PF_SMEM_BYTES below (src/cuda/prefill.rs computes the same formula).

#include "common.cuh"
#include "combine.cuh"
#include "mma.cuh"
#include "fp8.cuh"

#define NTHREADS (NWARPS * 32)
#define BM (NWARPS * MW * 16)          // query rows per CTA
#define TQ (BM / GQ)                   // query tokens per CTA
#define CPR (HEAD_DIM / 8)             // 16-byte chunks per row
#define ROWB (HEAD_DIM * 2 + 16)       // padded shared-memory row, bytes
#define KSTEPS (HEAD_DIM / 16)
#define NT (HEAD_DIM / 8)
#define NS (BN / 8)                    // n-tiles of S per row block
#define LCPR (HEAD_DIM * (int)sizeof(kv_t) / 16)  // 16-byte chunks per cached row (copied by cp.async)
#define LDST (KV8 ? HEAD_DIM : 0)                   // where a cached row lands in its padded row, bytes
#define Q_BYTES (BM * ROWB)
#define KV_STAGE_BYTES (2 * BN * ROWB)
#define PF_SMEM_BYTES (Q_BYTES + NSTAGE * KV_STAGE_BYTES)

#if BM % GQ != 0 || HEAD_DIM % 16 != 0 || BN % 16 != 0
#error "attention_prefill: BM % GQ, HEAD_DIM % 16 and BN % 16 must be 0"
#endif

// Token states of a tile (tk_st): not served here, a clean row, a row whose batch description is bad.
#define PF_SKIP 0
#define PF_CLEAN 1
#define PF_BAD 2

extern "C" __global__ void __launch_bounds__(NTHREADS)
kvs_attn_prefill(const elem_t* __restrict__ q, i64 q0, i64 q1, i64 q2,
                 const kv_t* __restrict__ kc, i64 k0, i64 k1, i64 k2,
                 const kv_t* __restrict__ vc, i64 v0, i64 v1, i64 v2,
                 i64 num_blocks, int bs_log2,
                 const int* __restrict__ bt, i64 bt0, i64 bt1, int bt_cols,
                 const int* __restrict__ seq_lens, i64 sl0,
                 const int* __restrict__ qsl, i64 qsl0, int num_seqs, int num_tokens,
                 float scale, float softcap, int window, int chunk,
                 elem_t* __restrict__ out, i64 o0, i64 o1, i64 o2,
                 float* __restrict__ lse, i64 l0, i64 l1,
                 float* __restrict__ ws_o, float* __restrict__ ws_lse, int num_q_heads,
                 unsigned long long* kerr
#if KV8
                 , float k_scale, float v_scale
#endif
                 ) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int tk_seq[TQ], tk_lo[TQ], tk_hi[TQ], tk_st[TQ];
    __shared__ int sm_col;
    // Tiles in reverse: the last tokens of a prompt see the most keys, so they start first.
    const int tile = gridDim.x - 1 - blockIdx.x, hg = blockIdx.y, split = blockIdx.z, nsplit = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r = lane >> 2, qd = lane & 3;
    const int h0 = hg * GQ, kvh = h0 / GROUP;
    const int t0 = tile * TQ;
    const int max_pos = bt_cols << bs_log2;
    const float nanv = __int_as_float(0x7fffffff);

    // Each token of the tile: its sequence (as locate() finds it), visible range and state.
    for (int i = tid; i < TQ; i += NTHREADS) {
        const int t = t0 + i;
        int st = PF_SKIP, seq = 0x7fffffff, lo = 0, hi = -1;
        if (t < num_tokens) {
            const RowInfo row = locate(t, qsl, qsl0, seq_lens, sl0, num_seqs, max_pos, window);
            seq = row.seq;
            // A padded batch's padding row (KVS_CHECKS & 4) is skipped like a row another launch serves.
            if (kvs_row_served(MODE_DENSE_REST, row.qlen) && !((KVS_CHECKS & 4) && row.pad)) {
                long long fa, fb;
                const RowCheck c = kvs_row_check_load(row.seq, qsl, qsl0, seq_lens, sl0, num_seqs);
                const unsigned long long key = kvs_row_fault(c, t, row.seq, num_tokens, bt_cols, bs_log2, &fa, &fb);
                st = key != 0ull ? PF_BAD : PF_CLEAN;
                if (key != 0ull && hg == 0 && split == 0) kvs_fail(kerr, key, fa, fb);
                lo = row.lo;
                hi = row.hi;
            }
        }
        tk_seq[i] = seq;
        tk_lo[i] = lo;
        tk_hi[i] = hi;
        tk_st[i] = st;
    }
    __syncthreads();

    // Rows with a bad batch description: NaN (output and LSE, or every split's partial state).
    for (int idx = tid; idx < BM * HEAD_DIM; idx += NTHREADS) {
        const int m = idx / HEAD_DIM, d = idx % HEAD_DIM, i = m / GQ;
        if (tk_st[i] != PF_BAD) continue;
        const int t = t0 + i, h = h0 + m % GQ;
        if (nsplit == 1) {
            out[t * o0 + h * o1 + d * o2] = ET::st(nanv);
            if (lse != 0 && d == 0) lse[t * l0 + h * l1] = nanv;
        } else {
            const i64 slot = ((i64)t * num_q_heads + h) * nsplit + split;
            ws_o[slot * HEAD_DIM + d] = nanv;
            if (d == 0) ws_lse[slot] = nanv;
        }
    }

    // Q of the clean rows into shared memory (zeros elsewhere); 16-byte loads when rows allow them.
    const unsigned sq = smem_u32(smem);
    const unsigned skv = sq + Q_BYTES;
    {
        const bool vec = q2 == 1 && (q0 % 8) == 0 && (q1 % 8) == 0 && ((unsigned long long)q % 16) == 0;
        for (int c = tid; c < BM * CPR; c += NTHREADS) {
            const int m = c / CPR, cc = c % CPR, i = m / GQ;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (tk_st[i] == PF_CLEAN) {
                const elem_t* qp = q + (i64)(t0 + i) * q0 + (i64)(h0 + m % GQ) * q1 + (i64)(cc * 8) * q2;
                if (vec) {
                    v = *reinterpret_cast<const uint4*>(qp);
                } else {
                    unsigned w[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) w[j] = (unsigned)qp[(2 * j) * q2] | ((unsigned)qp[(2 * j + 1) * q2] << 16);
                    v = make_uint4(w[0], w[1], w[2], w[3]);
                }
            }
            *reinterpret_cast<uint4*>(smem + m * ROWB + cc * 16) = v;
        }
    }
    __syncthreads();

#if KV8
    scale *= k_scale;  // logits of the dequantized keys: scale * q . (k * k_scale)
#else
    const float v_scale = 1.f;
#endif
    const float sl2 = scale * KVS_LOG2E;
    const int bmask = (1 << bs_log2) - 1;
    const kv_t* kh = kc + kvh * k2;
    const kv_t* vh = vc + kvh * v2;
    // ldmatrix lane offsets: Q (A operand, rows lane & 15, column half lane >> 4), K (B of S = Q K^T) and
    // V (transposed, B of O = P V), as in attention_mma.cu.
    const unsigned qoff = (lane & 15) * ROWB + (lane >> 4) * 16;
    const unsigned koff = ((lane & 7) + ((lane >> 4) << 3)) * ROWB + ((lane >> 3) & 1) * 16;
    const unsigned voff = ((lane & 7) + (((lane >> 3) & 1) << 3)) * ROWB + (lane >> 4) * 16;
    const int wrow0 = warp * MW * 16;  // the warp's first row

    // Segments: runs of tokens of one sequence.
    for (int seg = 0; seg < TQ;) {
        const int seq = tk_seq[seg];
        int end = seg;
        while (end + 1 < TQ && tk_seq[end + 1] == seq) ++end;
        int klo = 0x7fffffff, khi = -1;
        for (int i = seg; i <= end; ++i)
            if (tk_st[i] == PF_CLEAN) {
                klo = min(klo, tk_lo[i]);
                khi = max(khi, tk_hi[i]);
            }
        if (khi < 0) {
            seg = end + 1;
            continue;
        }
        // This split's key range of the segment.
        const int s_lo = max(klo, split * chunk);
        const int s_hi = split == nsplit - 1 ? khi : min(khi, (split + 1) * chunk - 1);
        const int* bt_row = bt + (i64)seq * bt0;

        // This lane's rows (mb, half): active in the segment, and the keys each sees in this split.
        int rlo[MW][2], rhi[MW][2];
        bool act[MW][2];
        int wmin_lo = 0x7fffffff, wmax_hi = -1, wmax_lo = -1, wmin_hi = 0x7fffffff;
#pragma unroll
        for (int mb = 0; mb < MW; ++mb)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = (wrow0 + mb * 16 + r + hf * 8) / GQ;
                act[mb][hf] = i >= seg && i <= end && tk_st[i] == PF_CLEAN;
                rlo[mb][hf] = act[mb][hf] ? max(tk_lo[i], s_lo) : 0x7fffffff;
                rhi[mb][hf] = act[mb][hf] ? min(tk_hi[i], s_hi) : -1;
                if (act[mb][hf]) {
                    wmin_lo = min(wmin_lo, rlo[mb][hf]);
                    wmax_hi = max(wmax_hi, rhi[mb][hf]);
                    wmax_lo = max(wmax_lo, rlo[mb][hf]);
                    wmin_hi = min(wmin_hi, rhi[mb][hf]);
                }
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            wmin_lo = min(wmin_lo, __shfl_xor_sync(0xffffffffu, wmin_lo, o));
            wmax_hi = max(wmax_hi, __shfl_xor_sync(0xffffffffu, wmax_hi, o));
            wmax_lo = max(wmax_lo, __shfl_xor_sync(0xffffffffu, wmax_lo, o));
            wmin_hi = min(wmin_hi, __shfl_xor_sync(0xffffffffu, wmin_hi, o));
        }

        float o[MW][NT][4];
        float mrow[MW][2], lrow[MW][2];
        bool bad[MW][2];
#pragma unroll
        for (int mb = 0; mb < MW; ++mb) {
#pragma unroll
            for (int n = 0; n < NT; ++n) o[mb][n][0] = o[mb][n][1] = o[mb][n][2] = o[mb][n][3] = 0.f;
            mrow[mb][0] = mrow[mb][1] = -INFINITY;
            lrow[mb][0] = lrow[mb][1] = 0.f;
            bad[mb][0] = bad[mb][1] = false;
        }
        bool bt_bad = false;  // this thread met a block id outside [0, num_blocks) in the range

        const int tb0 = s_hi >= s_lo ? (s_lo & ~(BN - 1)) : 0;
        const int ntiles = s_hi >= s_lo ? ((s_hi - tb0) / BN) + 1 : 0;

        // Issues the cp.async of key tile k into stage st (always commits a group).
        auto load = [&](int k, int st) {
            if (k < ntiles) {
                const int pb = tb0 + k * BN;
                const unsigned kdst = skv + st * KV_STAGE_BYTES, vdst = kdst + BN * ROWB;
#pragma unroll
                for (int j = 0; j < (BN * LCPR + NTHREADS - 1) / NTHREADS; ++j) {
                    const int c = j * NTHREADS + tid;
                    if ((BN * LCPR) % NTHREADS == 0 || c < BN * LCPR) {
                        const int kr = c / LCPR, cc = c % LCPR, p = pb + kr;
                        bool ok = p >= s_lo && p <= s_hi;
                        int blk = 0;
                        if (ok) {
                            blk = bt_row[(i64)(p >> bs_log2) * bt1];
                            const bool good = blk >= 0 && blk < num_blocks;
                            bt_bad = bt_bad || !good;
                            ok = good;
                        }
                        const i64 off = p & bmask;
                        const kv_t* ks = ok ? kh + (i64)blk * k0 + off * k1 + cc * (16 / (int)sizeof(kv_t)) : kc;
                        const kv_t* vs = ok ? vh + (i64)blk * v0 + off * v1 + cc * (16 / (int)sizeof(kv_t)) : vc;
                        cp_async16(kdst + kr * ROWB + LDST + cc * 16, ks, ok ? 16 : 0);
                        cp_async16(vdst + kr * ROWB + LDST + cc * 16, vs, ok ? 16 : 0);
                    }
                }
            }
            cp_commit();
        };

#pragma unroll
        for (int st = 0; st < NSTAGE - 1; ++st) load(st, st);

        for (int k = 0; k < ntiles; ++k) {
            cp_wait<NSTAGE - 2>();
            __syncthreads();  // stage k is in; every warp is done with stage k - 1, which the next load refills
            load(k + NSTAGE - 1, (k + NSTAGE - 1) % NSTAGE);
#if KV8
            // Stage k's FP8 rows (K then V: 2 BN padded rows) widened in place: every chunk is read into
            // registers before any widened chunk is written over the bytes.
            {
                unsigned char* st_rows = smem + Q_BYTES + (k % NSTAGE) * KV_STAGE_BYTES;
                constexpr int NCH = 2 * BN * LCPR, PER = (NCH + NTHREADS - 1) / NTHREADS;
                uint4 raw[PER];
#pragma unroll
                for (int j = 0; j < PER; ++j) {
                    const int c = j * NTHREADS + tid;
                    if (c < NCH) raw[j] = *reinterpret_cast<const uint4*>(st_rows + (c / LCPR) * ROWB + LDST + (c % LCPR) * 16);
                }
                __syncthreads();
#pragma unroll
                for (int j = 0; j < PER; ++j) {
                    const int c = j * NTHREADS + tid;
                    if (c < NCH) {
                        const unsigned w[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
                        uint4* dst = reinterpret_cast<uint4*>(st_rows + (c / LCPR) * ROWB + (c % LCPR) * 32);
                        dst[0] = make_uint4(kv8x2_to_elem2((unsigned short)(w[0] & 0xffffu)), kv8x2_to_elem2((unsigned short)(w[0] >> 16)),
                                            kv8x2_to_elem2((unsigned short)(w[1] & 0xffffu)), kv8x2_to_elem2((unsigned short)(w[1] >> 16)));
                        dst[1] = make_uint4(kv8x2_to_elem2((unsigned short)(w[2] & 0xffffu)), kv8x2_to_elem2((unsigned short)(w[2] >> 16)),
                                            kv8x2_to_elem2((unsigned short)(w[3] & 0xffffu)), kv8x2_to_elem2((unsigned short)(w[3] >> 16)));
                    }
                }
                __syncthreads();
            }
#endif
            const int pb = tb0 + k * BN;
            if (pb > wmax_hi || pb + BN - 1 < wmin_lo) continue;  // no row of this warp sees this tile
            const unsigned kb = skv + (k % NSTAGE) * KV_STAGE_BYTES, vb = kb + BN * ROWB;

            float s[MW][NS][4];
#pragma unroll
            for (int mb = 0; mb < MW; ++mb)
#pragma unroll
                for (int n = 0; n < NS; ++n) s[mb][n][0] = s[mb][n][1] = s[mb][n][2] = s[mb][n][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                unsigned a[MW][4];
#pragma unroll
                for (int mb = 0; mb < MW; ++mb) ldsm_x4(a[mb], sq + (wrow0 + mb * 16) * ROWB + qoff + ks * 32);
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) {
                    unsigned b[4];
                    ldsm_x4(b, kb + kk * 16 * ROWB + koff + ks * 32);
#pragma unroll
                    for (int mb = 0; mb < MW; ++mb) {
                        mma16816(s[mb][2 * kk], a[mb][0], a[mb][1], a[mb][2], a[mb][3], b[0], b[1]);
                        mma16816(s[mb][2 * kk + 1], a[mb][0], a[mb][1], a[mb][2], a[mb][3], b[2], b[3]);
                    }
                }
            }
            // Logits (base 2); keys a row does not see at -inf. A visible key whose raw score is not finite
            // poisons its row (the row finishes as NaN).
            const bool full = pb >= wmax_lo && pb + BN - 1 <= wmin_hi;  // every active row of the warp sees every key
            if (full && softcap <= 0.f) {
                // x * 0 is NaN exactly when x is not finite: one FMA per element flags the rows.
#pragma unroll
                for (int mb = 0; mb < MW; ++mb)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        float chk = 0.f;
#pragma unroll
                        for (int n = 0; n < NS; ++n) {
                            chk = fmaf(s[mb][n][2 * hf], 0.f, chk);
                            chk = fmaf(s[mb][n][2 * hf + 1], 0.f, chk);
                            s[mb][n][2 * hf] *= sl2;
                            s[mb][n][2 * hf + 1] *= sl2;
                        }
                        if (chk != 0.f) bad[mb][hf] = true;
                    }
            } else {
#pragma unroll
                for (int mb = 0; mb < MW; ++mb)
#pragma unroll
                    for (int n = 0; n < NS; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            float x = s[mb][n][e];
                            const int hf = e >> 1, kp = pb + n * 8 + qd * 2 + (e & 1);
                            const bool vis = full || (kp >= rlo[mb][hf] && kp <= rhi[mb][hf]);
                            if (vis && !isfinite(x)) bad[mb][hf] = true;
                            x = softcap > 0.f ? softcap * tanhf(x * scale / softcap) * KVS_LOG2E : x * sl2;
                            s[mb][n][e] = vis ? x : -INFINITY;
                        }
            }
            // Online softmax per row: new maxima and the rescale of O and of the row sums.
            float mu[MW][2], sum[MW][2];
#pragma unroll
            for (int mb = 0; mb < MW; ++mb)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int n = 0; n < NS; ++n) mx = fmaxf(mx, fmaxf(s[mb][n][2 * hf], s[mb][n][2 * hf + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float mn = fmaxf(mrow[mb][hf], mx);
                    mu[mb][hf] = mn == -INFINITY ? 0.f : mn;
                    const float alpha = exp2f(mrow[mb][hf] - mu[mb][hf]);
                    mrow[mb][hf] = mn;
                    lrow[mb][hf] *= alpha;
                    sum[mb][hf] = 0.f;
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        o[mb][n][2 * hf] *= alpha;
                        o[mb][n][2 * hf + 1] *= alpha;
                    }
                }
            // O += P V, 16 keys at a time (P of those keys made just before use: fewer live registers).
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                unsigned pa[MW][4];
#pragma unroll
                for (int mb = 0; mb < MW; ++mb)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        pa[mb][hf] = pack2(exp2f(s[mb][2 * kk][2 * hf] - mu[mb][hf]), exp2f(s[mb][2 * kk][2 * hf + 1] - mu[mb][hf]), &sum[mb][hf]);
                        pa[mb][2 + hf] = pack2(exp2f(s[mb][2 * kk + 1][2 * hf] - mu[mb][hf]), exp2f(s[mb][2 * kk + 1][2 * hf + 1] - mu[mb][hf]), &sum[mb][hf]);
                    }
#pragma unroll
                for (int j = 0; j < NT / 2; ++j) {
                    unsigned b[4];
                    ldsm_x4_t(b, vb + kk * 16 * ROWB + voff + j * 32);
#pragma unroll
                    for (int mb = 0; mb < MW; ++mb) {
                        mma16816(o[mb][2 * j], pa[mb][0], pa[mb][1], pa[mb][2], pa[mb][3], b[0], b[1]);
                        mma16816(o[mb][2 * j + 1], pa[mb][0], pa[mb][1], pa[mb][2], pa[mb][3], b[2], b[3]);
                    }
                }
            }
#pragma unroll
            for (int mb = 0; mb < MW; ++mb) {
                lrow[mb][0] += sum[mb][0];
                lrow[mb][1] += sum[mb][1];
            }
        }
        cp_wait<0>();

        // A bad block id in the range (rare): the rows whose visible keys hold one finish as NaN, and the
        // sequence's first bad column is recorded.
        const bool cta_bt_bad = __syncthreads_or((int)bt_bad) != 0;
        if (cta_bt_bad) {
#pragma unroll
            for (int mb = 0; mb < MW; ++mb)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
                    if (act[mb][hf] && rlo[mb][hf] <= rhi[mb][hf])
                        for (int c = rlo[mb][hf] >> bs_log2; c <= (rhi[mb][hf] >> bs_log2); ++c) {
                            const int id = bt_row[(i64)c * bt1];
                            if (id < 0 || id >= num_blocks) {
                                bad[mb][hf] = true;
                                break;
                            }
                        }
            kvs_record_block_fault(kerr, seq, bt_row, bt1, bt_cols, bs_log2, seq_lens[seq * sl0], num_blocks, &sm_col);
        }

        // Write the segment's rows.
#pragma unroll
        for (int mb = 0; mb < MW; ++mb)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float L = lrow[mb][hf];
                L += __shfl_xor_sync(0xffffffffu, L, 1);
                L += __shfl_xor_sync(0xffffffffu, L, 2);
                int b = bad[mb][hf];
                b |= __shfl_xor_sync(0xffffffffu, b, 1);
                b |= __shfl_xor_sync(0xffffffffu, b, 2);
                if (!act[mb][hf]) continue;
                const int m = wrow0 + mb * 16 + r + hf * 8;
                const int t = t0 + m / GQ, h = h0 + m % GQ;
                const bool any = L > 0.f;
                const float inv = any ? v_scale / L : 0.f;  // (v_scale 1 unless KV8)
                const float M = mrow[mb][hf];
                const float lse_nat = b ? nanv : (any ? (M + log2f(L)) * KVS_LN2 : -INFINITY);
                if (nsplit == 1) {
                    elem_t* op = out + t * o0 + h * o1;
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        const int d = n * 8 + qd * 2;
                        op[d * o2] = ET::st(b ? nanv : o[mb][n][2 * hf] * inv);
                        op[(d + 1) * o2] = ET::st(b ? nanv : o[mb][n][2 * hf + 1] * inv);
                    }
                    if (lse != 0 && qd == 0) lse[t * l0 + h * l1] = lse_nat;
                } else {
                    const i64 slot = ((i64)t * num_q_heads + h) * nsplit + split;
                    float* wp = ws_o + slot * HEAD_DIM;
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        const int d = n * 8 + qd * 2;
                        wp[d] = b ? nanv : o[mb][n][2 * hf] * inv;
                        wp[d + 1] = b ? nanv : o[mb][n][2 * hf + 1] * inv;
                    }
                    if (qd == 0) ws_lse[slot] = lse_nat;
                }
            }
        __syncthreads();  // the stages are refilled by the next segment
        seg = end + 1;
    }
}
