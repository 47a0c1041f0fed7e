// Paged varlen attention, split-KV (flash-decoding style), for decode and prefill rows alike.
//
// Grid: (token, query-head group of GQ heads sharing one KV head, split). A CTA walks the key positions
// [split*CHUNK, (split+1)*CHUNK) of its token's visible range (the last split runs to the end, so a caller
// that understates max_seq_len gets a slow but correct answer). Inside a CTA, "lane groups" of LPK lanes
// each own one key at a time: every lane loads LOAD_BYTES of the K row and of the V row (16-byte vector
// loads for the usual aligned caches), KB keys per lane group are loaded before any is used, so many loads
// are in flight. Scores are reduced across the lane group with shuffles; each lane group keeps its own
// online softmax (m, l, acc in f32, base-2 logits), and the CTA combines its lane groups in shared memory.
// With one split the CTA writes the final output and LSE; otherwise it writes (O_s, LSE_s) to the
// workspace and kvs_attn_combine (kernels/include/combine.cuh) merges the splits exactly through their LSEs.
// Used for f32 caches and whatever kernels/attention_mma.cu (the tensor-core path) does not cover.
//
// Bounds contract (metadata is on the device and never read by the host): seq_len is clamped to what the
// block-table row can address and a block id outside [0, num_blocks) masks its keys, so no index derived
// from metadata is used unchecked. Checks (common.cuh, issue 33): a row whose part of the batch
// description is bad (kvs_row_fault), or that read a block id outside [0, num_blocks), finishes as NaN
// (out and LSE) and the fault goes to the engine's error record `kerr`; kvs_check_seqs checks every
// sequence once and, when `kbk` is not NULL, counts decode rows and prefill tokens.
//
// Compile-time parameters (NVRTC -D): KVS_DTYPE, HEAD_DIM, GQ (query heads per CTA), GROUP (query heads
// per KV head), LOAD_BYTES (16, or the element size for unaligned caches), KB (keys per lane group batch),
// PLAN (1: decode rows walk their visit plan's keys, as in attention_mma.cu).

#include "common.cuh"
#include "params.cuh"
#include "combine.cuh"

#define NWARPS 4
#define NTHREADS (NWARPS * 32)
#define ELT ((int)sizeof(elem_t))
#define VEC (LOAD_BYTES / ELT)
#define NVEC_TOTAL (HEAD_DIM / VEC)
#define NV ((NVEC_TOTAL + 31) / 32)
#define LANES_NEEDED ((NVEC_TOTAL + NV - 1) / NV)
#define LPK (LANES_NEEDED <= 1 ? 1 : LANES_NEEDED <= 2 ? 2 : LANES_NEEDED <= 4 ? 4 : LANES_NEEDED <= 8 ? 8 : LANES_NEEDED <= 16 ? 16 : 32)
#define GPW (32 / LPK)
#define NG (NWARPS * GPW)

#if LOAD_BYTES == 16
typedef uint4 raw_t;
#elif LOAD_BYTES == 8
typedef uint2 raw_t;
#elif LOAD_BYTES == 4
typedef unsigned raw_t;
#else
typedef u16 raw_t;
#endif

union VecU {
    raw_t r;
    elem_t e[VEC];
};

__device__ __forceinline__ raw_t ld_stream(const elem_t* p) {
    // Read-only, read-once data: the non-coherent path, no L1 allocation.
    return __ldg(reinterpret_cast<const raw_t*>(p));
}

extern "C" __global__ void __launch_bounds__(NTHREADS)
kvs_attn_split(const elem_t* __restrict__ q, i64 q0, i64 q1, i64 q2,
               const elem_t* __restrict__ kc, i64 k0, i64 k1, i64 k2,
               const elem_t* __restrict__ vc, i64 v0, i64 v1, i64 v2,
               i64 num_blocks, int bs_log2,
               const int* __restrict__ bt, i64 bt0, i64 bt1, int bt_cols,
               const int* __restrict__ seq_lens, i64 sl0,
               const int* __restrict__ qsl, i64 qsl0, int num_seqs,
               float scale, float softcap, int window, int chunk,
               elem_t* __restrict__ out, i64 o0, i64 o1, i64 o2,
               float* __restrict__ lse, i64 l0, i64 l1,
               float* __restrict__ ws_o, float* __restrict__ ws_lse, int num_q_heads,
               unsigned long long* kerr, unsigned long long* kbk,
               PlanRef plan, int mode) {
    KVS_GRID_WAIT();  // may run as a dependent launch (common.cuh): nothing before this line
    KVS_GRID_LAUNCH_DEPENDENTS();
    const int t = blockIdx.x, hg = blockIdx.y, split = blockIdx.z, nsplit = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int li = lane % LPK, gid = warp * GPW + lane / LPK;
    const int h0 = hg * GQ, kvh = h0 / GROUP;

    const RowInfo row = locate(t, qsl, qsl0, seq_lens, sl0, num_seqs, bt_cols << bs_log2, window);
    // K and V bytes of one position over all KV heads (the counters' unit of dense reads).
    const i64 kv_row_bytes = (i64)HEAD_DIM * (i64)sizeof(elem_t) * 2 * (num_q_heads / GROUP);
    __shared__ int sm_rc[KVS_RC_WORDS];  // the row's check words, judged at the end (kvs_finish_row_checks)
    if (!kvs_serve_row(mode, row, kerr, kbk, qsl, qsl0, seq_lens, sl0, num_seqs, bt_cols, bs_log2, window, kv_row_bytes, sm_rc)) return;  // another launch serves it
    bool bt_bad = false;  // this thread read a block id outside [0, num_blocks)
#if PLAN
    const int pl = min(max(plan.len[row.seq * plan.hk + kvh], 0), plan.cap);
    const int nkeys = pl << plan.ulog2;
    const unsigned* pe = plan.e + row.seq * plan.p_s + kvh * plan.p_h;
    const int umask = (1 << plan.ulog2) - 1;
    const int s_lo = split * chunk;
    const int s_hi = (split == nsplit - 1) ? nkeys - 1 : min((split + 1) * chunk, nkeys) - 1;
#else
    int s_lo = split * chunk, s_hi = (split == nsplit - 1) ? 0x7fffffff : (split + 1) * chunk - 1;
    s_lo = max(s_lo, row.lo);
    s_hi = min(s_hi, row.hi);
#endif

    // Query rows for this lane's vectors, pre-scaled (base-2 logits unless a soft-cap needs natural ones).
    const float qscale = softcap > 0.f ? scale : scale * KVS_LOG2E;
    float qr[GQ][NV][VEC];
#pragma unroll
    for (int g = 0; g < GQ; ++g)
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            int vi = k * LPK + li;
#pragma unroll
            for (int e = 0; e < VEC; ++e)
                qr[g][k][e] = vi < NVEC_TOTAL ? ET::ld(q[t * q0 + (h0 + g) * q1 + (i64)(vi * VEC + e) * q2]) * qscale : 0.f;
        }

    float m[GQ], l[GQ], acc[GQ][NV][VEC];
    bool bad[GQ];  // the row met a non-finite visible logit: it finishes as NaN
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
        bad[g] = false;
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int k = 0; k < NV; ++k)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][k][e] = 0.f;
    }

    const int* bt_row = bt + row.seq * bt0;
    const int bmask = (1 << bs_log2) - 1;
    for (int base = s_lo; base <= s_hi; base += NG * KB) {
        VecU kraw[KB][NV], vraw[KB][NV];
        bool valid[KB];
#pragma unroll
        for (int j = 0; j < KB; ++j) {
#if PLAN
            const int g = base + gid * KB + j;
            int p = 0;
            valid[j] = g <= s_hi;
            if (valid[j]) {
                p = (int)((pe[g >> plan.ulog2] << plan.ulog2) | (unsigned)(g & umask));
                valid[j] = p >= row.lo && p <= row.hi;
            }
#else
            int p = base + gid * KB + j;
            valid[j] = p <= s_hi;
#endif
            i64 blk = 0;
            if (valid[j]) {
                blk = bt_row[(i64)(p >> bs_log2) * bt1];
                valid[j] = blk >= 0 && blk < num_blocks;
                bt_bad = bt_bad || !valid[j];
            }
            const i64 off = p & bmask;
            const elem_t* kp = kc + blk * k0 + off * k1 + kvh * k2;
            const elem_t* vp = vc + blk * v0 + off * v1 + kvh * v2;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                int vi = k * LPK + li;
                if (valid[j] && vi < NVEC_TOTAL) {
                    kraw[j][k].r = ld_stream(kp + vi * VEC);
                    vraw[j][k].r = ld_stream(vp + vi * VEC);
                } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) { kraw[j][k].e[e] = 0; vraw[j][k].e[e] = 0; }
                }
            }
        }
        float s[KB][GQ];
#pragma unroll
        for (int j = 0; j < KB; ++j)
#pragma unroll
            for (int g = 0; g < GQ; ++g) {
                float x = 0.f;
#pragma unroll
                for (int k = 0; k < NV; ++k)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) x = fmaf(qr[g][k][e], ET::ld(kraw[j][k].e[e]), x);
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
                if (valid[j] && !isfinite(x)) bad[g] = true;  // poisons the row (issue 12)
                if (softcap > 0.f) x = softcap * tanhf(x / softcap) * KVS_LOG2E;
                s[j][g] = valid[j] ? x : -INFINITY;
            }
#pragma unroll
        for (int g = 0; g < GQ; ++g) {
            float mb = s[0][g];
#pragma unroll
            for (int j = 1; j < KB; ++j) mb = fmaxf(mb, s[j][g]);
            const float mn = fmaxf(m[g], mb);
            const float mu = mn == -INFINITY ? 0.f : mn;  // nothing seen yet: keep every weight at 0
            const float alpha = exp2f(m[g] - mu);
            m[g] = mn;
            float lsum = l[g] * alpha;
#pragma unroll
            for (int k = 0; k < NV; ++k)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][k][e] *= alpha;
#pragma unroll
            for (int j = 0; j < KB; ++j) {
                const float pj = exp2f(s[j][g] - mu);
                lsum += pj;
#pragma unroll
                for (int k = 0; k < NV; ++k)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[g][k][e] = fmaf(pj, ET::ld(vraw[j][k].e[e]), acc[g][k][e]);
            }
            l[g] = lsum;
        }
    }

    // Combine the lane groups of this CTA.
    __shared__ float sm_m[NG][GQ], sm_l[NG][GQ];
    __shared__ float sm_acc[NG][GQ][HEAD_DIM];
    __shared__ int sm_bad[GQ];
    __shared__ int sm_col;
    if (threadIdx.x < GQ) sm_bad[threadIdx.x] = 0;
    kvs_row_check_wait();
    const bool cta_bt_bad = __syncthreads_or((int)bt_bad) != 0;
#pragma unroll
    for (int g = 0; g < GQ; ++g)
        if (bad[g]) sm_bad[g] = 1;
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
        if (li == 0) { sm_m[gid][g] = m[g]; sm_l[gid][g] = l[g]; }
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            int vi = k * LPK + li;
            if (vi < NVEC_TOTAL)
#pragma unroll
                for (int e = 0; e < VEC; ++e) sm_acc[gid][g][vi * VEC + e] = acc[g][k][e];
        }
    }
    __syncthreads();
    RowCheck rc;
    const bool row_bad = kvs_finish_row_checks(kerr, sm_rc, num_seqs, &rc, cta_bt_bad, t, row.seq, bt_row, bt1, num_blocks, bt_cols, bs_log2, &sm_col);
    kvs_check_seqs(kerr, kbk, qsl, qsl0, seq_lens, sl0, num_seqs, gridDim.x, bt_cols, bs_log2, window, kv_row_bytes, &rc, row.seq);
    for (int idx = threadIdx.x; idx < GQ * HEAD_DIM; idx += NTHREADS) {
        const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
        float M = -INFINITY;
#pragma unroll
        for (int r = 0; r < NG; ++r) M = fmaxf(M, sm_m[r][g]);
        float L = 0.f, O = 0.f;
        if (M != -INFINITY) {
#pragma unroll
            for (int r = 0; r < NG; ++r) {
                const float w = exp2f(sm_m[r][g] - M);
                L = fmaf(sm_l[r][g], w, L);
                O = fmaf(sm_acc[r][g][d], w, O);
            }
        }
        const bool any = L > 0.f;
        const float nan = __int_as_float(0x7fffffff);
        const bool poisoned = sm_bad[g] != 0 || row_bad;
        const float o = poisoned ? nan : (any ? O / L : 0.f);
        const float lse_nat = poisoned ? nan : (any ? (M + log2f(L)) * KVS_LN2 : -INFINITY);
        const int h = h0 + g;
        if (nsplit == 1) {
            out[t * o0 + h * o1 + d * o2] = ET::st(o);
            if (lse != 0 && d == 0) lse[t * l0 + h * l1] = lse_nat;
        } else {
            const i64 slot = ((i64)t * num_q_heads + h) * nsplit + split;
            ws_o[slot * HEAD_DIM + d] = o;
            if (d == 0) ws_lse[slot] = lse_nat;
        }
    }
}
