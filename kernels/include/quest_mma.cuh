// Quest's page scores on tensor cores (kvs_quest_scores_hist_mma, kernels/policy/quest.cu): the bound of
// page P for query row g, sum over channels c of max(q_c * min_c, q_c * max_c), is
//     sum_c q-_c * min_c + q+_c * max_c      (q- = min(q, 0), q+ = max(q, 0)),
// a matrix product of the page's staged row [min | max] (K = 2 * HEAD_DIM, f16 as the cache write stores
// them, lane-permuted: kernels/meta.cu) with the group's split query [q- | q+] in the same permutation.
// mma.sync m16n8k16 f16 -> f32: pages are the 16 rows of A, query rows the 8 columns of B. Each query row
// is scaled by 2^e (e from its max |q|, into [2^14, 2^15)) and split into two f16 terms hi + lo (residual
// under 2^-22 of the row's max |q|); the products are exact in f32, the tensor core accumulates them, and
// the score is acc * scale * 2^-e. docs/policies.md (Quest) states the error bound and the agreement
// margin the tests use. A 0 * inf product (a zero half of the split against an infinite bound) makes the
// page's score NaN, which the order key sorts first: the page is kept and its keys reach the attention.
#pragma once
#include "quest.cuh"
#include "mma.cuh"

#define QM_PAD 8                    // f16 per staged row against ldmatrix bank conflicts (16 bytes)
#define QM_NT ((GROUP + 7) / 8)     // 8-column tiles of query rows
#define QM_KS (2 * HEAD_DIM / 16)   // k-steps of one page row
// Pages staged per round: the staged rows, the split query and the CTA's q scratch within 48 KiB.
#if HEAD_DIM <= 128 && GROUP <= 8
#define QM_ROUND 64
#elif HEAD_DIM <= 128
#define QM_ROUND 32
#else
#define QM_ROUND 16
#endif
// Geometries the MMA path covers (the others score exactly as quest_score_tile).
#define QM_FITS (GROUP <= 16 && (HEAD_DIM <= 128 || GROUP <= 8))

__device__ __forceinline__ void quest_mma_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two f32 -> f16x2 (first in the low half), rounded to nearest.
__device__ __forceinline__ unsigned quest_f16x2(float first, float second) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(second), "f"(first));
    return r;
}
// The larger of a and b, NaN if either is NaN (fmaxf would drop a NaN).
__device__ __forceinline__ float quest_nanmax(float a, float b) { return (b > a || b != b) ? b : a; }

// Query rows in the CTA's scratch `qs`: row g at g * QM_QSTR, in the staged rows' lane order (position p
// holds channel (p % QC) * 16 + p / QC). The 8-float pad puts the fragment build's float2 reads (8 rows x 4
// column pairs per warp) on distinct banks; the caller's scratch holds GROUP * (HEAD_DIM + 16) floats.
#define QM_QSTR (HEAD_DIM + 8)

// 2^e as a float, for -126 <= e <= 127 (exact).
__device__ __forceinline__ float quest_pow2(int e) { return __int_as_float((e + 127) << 23); }

// One half of the split query, scaled: v * 2^e (as two exact power-of-two products; |v| * 2^e stays below
// 2^15, and a product that would round below f16's range is 0 in both f16 terms either way), then the
// negative part (min(v, 0)) or the positive part (max(v, 0)). NaN stays NaN in both halves.
__device__ __forceinline__ float quest_split_part(float v, float s1, float s2, bool neg) {
    v = v * s1 * s2;
    return neg ? (v > 0.f ? 0.f : v) : (v < 0.f ? 0.f : v);
}

// The group's split query as B fragments (`qb`, [QM_NT][QM_KS][32] uint4) and each row's scale exponent
// (`qe`, QM_NT * 8 ints), from the query rows of row (r, h); `qs` is 16-byte aligned shared scratch of
// GROUP * QM_QSTR floats or more. Block-wide; every thread sees qb and qe on return.
__device__ __forceinline__ void quest_mma_query(const SeqRow& r, int h, const elem_t* q, i64 q0, i64 q1, i64 q2, float* qs, uint4 (*qb)[QM_KS][32],
                                                int* qe) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, c = i % HEAD_DIM;
        qs[g * QM_QSTR + (c % 16) * QC + c / 16] = ET::ld(q[(i64)r.t * q0 + (i64)(h * GROUP + g) * q1 + (i64)c * q2]);
    }
    __syncthreads();
    for (int g = warp; g < QM_NT * 8; g += nw) {
        float m = 0.f;
        if (g < GROUP)
            for (int c = lane; c < HEAD_DIM; c += 32) m = quest_nanmax(m, fabsf(qs[g * QM_QSTR + c]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = quest_nanmax(m, __shfl_xor_sync(0xffffffffu, m, o));
        int x = 0;
        const bool finite = m > 0.f && m <= 3.402823466e38f;
        if (finite) frexpf(m, &x);
        if (lane == 0) qe[g] = finite ? 15 - x : 0;  // max |q| * 2^e in [2^14, 2^15)
    }
    __syncthreads();
    // Lane l of k-step ks holds, for query row nt * 8 + l / 4, the K indices k = ks * 16 + 2 (l % 4)
    // + {0, 1} (b0) and the same + 8 (b1): positions p, p + 1, p + 8, p + 9 of the row, p below, of
    // its negative half when k < HEAD_DIM (a k-step lies in one half: HEAD_DIM is a multiple of 16).
    for (int i = threadIdx.x; i < QM_NT * QM_KS * 32; i += blockDim.x) {
        const int l = i % 32, ks = (i / 32) % QM_KS, nt = i / (32 * QM_KS);
        const int g = nt * 8 + l / 4;
        unsigned hi[2] = {0u, 0u}, lo[2] = {0u, 0u};
        if (g < GROUP) {
            const int e = qe[g];
            const float s1 = quest_pow2(e - e / 2), s2 = quest_pow2(e / 2);  // qe in [-113, 163]
            const bool neg = ks * 16 < HEAD_DIM;
            const float* row = qs + g * QM_QSTR + (ks * 16) % HEAD_DIM + 2 * (l % 4);
            const float2 a = *reinterpret_cast<const float2*>(row), c = *reinterpret_cast<const float2*>(row + 8);
            const float v[4] = {quest_split_part(a.x, s1, s2, neg), quest_split_part(a.y, s1, s2, neg), quest_split_part(c.x, s1, s2, neg),
                                quest_split_part(c.y, s1, s2, neg)};
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                hi[half] = quest_f16x2(v[2 * half], v[2 * half + 1]);
                lo[half] = quest_f16x2(v[2 * half] - kvs_f16_to_f32((u16)hi[half]), v[2 * half + 1] - kvs_f16_to_f32((u16)(hi[half] >> 16)));
            }
        }
        qb[nt][ks][l] = make_uint4(hi[0], hi[1], lo[0], lo[1]);
    }
    __syncthreads();
}

// The scores of 16 staged page rows (`rows`: row j at rows + j * QM_STRIDE, [min | max] as
// quest_stage_round copies them) for the group's query: warp-wide; `put(j, score)` for j = 0..15 by the
// lanes j % 8 * 4 (row j of the 16), the score before the caller's check of the page's presence.
#define QM_STRIDE (2 * HEAD_DIM + QM_PAD)
template <typename Put>
__device__ __forceinline__ void quest_mma_rows16(const u16* rows, const uint4 (*qb)[QM_KS][32], const int* qe, float scale, Put put) {
    const int lane = threadIdx.x & 31;
    float acc[QM_NT][4];
#pragma unroll
    for (int nt = 0; nt < QM_NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[nt][c] = 0.f;
    const unsigned arow = smem_u32(rows + (lane & 15) * QM_STRIDE + (lane >> 4) * 8);
    // The k-steps accumulate in one chain, hi then lo term of each.
#pragma unroll 4
    for (int ks = 0; ks < QM_KS; ++ks) {
        unsigned a[4];
        ldsm_x4(a, arow + ks * 32);
#pragma unroll
        for (int nt = 0; nt < QM_NT; ++nt) {
            const uint4 bq = qb[nt][ks][lane];
            quest_mma_f16(acc[nt], a, bq.x, bq.y);
            quest_mma_f16(acc[nt], a, bq.z, bq.w);
        }
    }
    // Rows lane / 4 and lane / 4 + 8 of the 16 pages, columns 2 (lane % 4) + {0, 1}.
    float best[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < QM_NT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int g = nt * 8 + 2 * (lane % 4) + j;
            if (g < GROUP) {
                best[0] = quest_nanmax(best[0], ldexpf(acc[nt][j] * scale, -qe[g]));
                best[1] = quest_nanmax(best[1], ldexpf(acc[nt][2 + j] * scale, -qe[g]));
            }
        }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        best[0] = quest_nanmax(best[0], __shfl_xor_sync(0xffffffffu, best[0], o));
        best[1] = quest_nanmax(best[1], __shfl_xor_sync(0xffffffffu, best[1], o));
    }
    if (lane % 4 == 0) {
        put(lane / 4, best[0]);
        put(lane / 4 + 8, best[1]);
    }
}

// One CTA's tile of QS_PAGES pages of row (s, h), unit == page (the caller's choice), scored on tensor
// cores; `put(i, score)` once per page i of the tile inside the row, `qs` 16-byte aligned shared scratch of
// GROUP * QM_QSTR floats or more. Returns the units this thread read. All threads of the CTA call this.
template <typename Put>
__device__ __forceinline__ unsigned long long quest_score_tile_mma(const Batch& b, const SeqRow& r, int s, int h, const elem_t* q, i64 q0, i64 q1, i64 q2,
                                                                   float scale, int hk, const u16* qmin, const u16* qmax, int upb, int page, int maxp,
                                                                   float* qs, Put put) {
    __shared__ __align__(16) u16 sb[QM_ROUND][QM_STRIDE];
    __shared__ i64 sbase[QM_ROUND];
    __shared__ __align__(16) uint4 qb[QM_NT][QM_KS][32];  // B fragments per lane: hi b0, hi b1, lo b0, lo b1
    __shared__ int qe[QM_NT * 8];                         // 2^e per query row
    static_assert(HEAD_DIM % 16 == 0, "a k-step of 16 lies in one half of the split query");
    const int fp = r.lo / page, np = r.hi / page - fp + 1;
    const int warp = threadIdx.x >> 5;
    unsigned long long units = 0;
    for (int r0 = 0; r0 < QS_PAGES; r0 += QM_ROUND) {
        const int tile0 = blockIdx.x * QS_PAGES + r0;
        if (r0 > 0) __syncthreads();  // the previous round's rows are read
        units += quest_stage_round(b, s, h, hk, qmin, qmax, upb, fp, np, maxp, tile0, QM_ROUND, sbase, &sb[0][0], QM_STRIDE);
        if (r0 == 0) quest_mma_query(r, h, q, q0, q1, q2, qs, qb, qe);  // built while the first round's bounds are in flight
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        if (warp < QM_ROUND / 16)
            quest_mma_rows16(&sb[warp * 16][0], qb, qe, scale, [&](int j, float best) {
                const int i = tile0 + warp * 16 + j;
                if (i < np && i < maxp) put(i, sbase[warp * 16 + j] >= 0 ? best : -INFINITY);
            });
    }
    return units;
}
