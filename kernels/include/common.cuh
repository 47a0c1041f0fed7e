// Shared by every kvsparse kernel: element types and conversions without the CUDA headers, so NVRTC
// needs no include path. The storage type is chosen by KVS_DTYPE (0 = f32, 1 = f16, 2 = bf16).
// All arithmetic is f32; bf16/f16 are converted on load and rounded to nearest even on store.
#pragma once

typedef unsigned short u16;
typedef long long i64;

#define KVS_LOG2E 1.4426950408889634f
#define KVS_LN2 0.6931471805599453f
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float kvs_to_f32(float x) { return x; }
__device__ __forceinline__ float kvs_bf16_to_f32(u16 x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ float kvs_f16_to_f32(u16 x) {
    float f;
    asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ u16 kvs_f32_to_bf16(float x) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ u16 kvs_f32_to_f16(float x) {
    u16 r;
    asm("{ .reg .b16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(r) : "f"(x));
    return r;
}

// Per-dtype load/store of single elements.
struct F32T { typedef float S; static __device__ __forceinline__ float ld(float x) { return x; } static __device__ __forceinline__ float st(float x) { return x; } };
struct F16T { typedef u16 S; static __device__ __forceinline__ float ld(u16 x) { return kvs_f16_to_f32(x); } static __device__ __forceinline__ u16 st(float x) { return kvs_f32_to_f16(x); } };
struct BF16T { typedef u16 S; static __device__ __forceinline__ float ld(u16 x) { return kvs_bf16_to_f32(x); } static __device__ __forceinline__ u16 st(float x) { return kvs_f32_to_bf16(x); } };

#ifdef KVS_DTYPE
#if KVS_DTYPE == 0
typedef F32T ET;
#elif KVS_DTYPE == 1
typedef F16T ET;
#else
typedef BF16T ET;
#endif
typedef ET::S elem_t;
#endif

// Which sequence token t belongs to and the key positions it may see (shared by the attention kernels).
struct RowInfo {
    int seq;
    int lo, hi;  // inclusive visible key positions; hi < lo means the row sees nothing
    int qlen;    // query tokens of the sequence (1 = a decode row, which policies plan)
    bool pad;    // t is past the last sequence's rows (a padded batch's padding row when KVS_CHECKS & 4)
};

__device__ __forceinline__ RowInfo locate(int t, const int* qsl, i64 qsl0, const int* seq_lens, i64 sl0, int num_seqs,
                                          int max_pos, int window) {
    // Largest s with qsl[s] <= t (qsl is non-decreasing for valid input; any input gives some s in range).
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (qsl[mid * qsl0] <= t) lo = mid; else hi = mid - 1;
    }
    RowInfo r;
    r.seq = lo;
    int q0 = qsl[lo * qsl0], q1 = qsl[(lo + 1) * qsl0];
    r.qlen = q1 - q0;
    int len = seq_lens[lo * sl0];
    len = len < 0 ? 0 : (len > max_pos ? max_pos : len);
    int pos = len - (q1 - q0) + (t - q0);
    bool ok = t >= q0 && t < q1 && pos >= 0 && pos < len;
    r.hi = ok ? pos : -1;
    r.lo = (window > 0 && pos + 1 - window > 0) ? pos + 1 - window : 0;
    r.pad = lo == num_seqs - 1 && t >= q1;
    return r;
}

// Which rows a launch serves: every row (0), only decode rows of a policy layer, attended through their
// plans (1), or only the other rows of a policy layer, attended densely (2).
// Programmatic dependent launch (src/cuda/launch.rs launch_dependent, sm_90 and newer). KVS_GRID_WAIT():
// the first statement of a kernel that may be launched as a dependent: waits until the previous kernel of
// the stream has finished and its writes are visible (a no-op in a plain launch). KVS_GRID_LAUNCH_DEPENDENTS():
// once every CTA of this kernel has executed it (or exited), a dependent kernel's CTAs may be scheduled;
// it orders nothing in memory, the dependent's KVS_GRID_WAIT() does that.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVS_GRID_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define KVS_GRID_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define KVS_GRID_WAIT() ((void)0)
#define KVS_GRID_LAUNCH_DEPENDENTS() ((void)0)
#endif

#define MODE_ALL 0
#define MODE_PLAN 1
#define MODE_DENSE_REST 2
__device__ __forceinline__ bool kvs_row_served(int mode, int qlen) {
    return mode == MODE_ALL || ((mode == MODE_PLAN) == (qlen == 1));
}

// Query length of the sequence that token t belongs to (as locate() finds it).
__device__ __forceinline__ int kvs_token_qlen(int t, const int* qsl, i64 qsl0, int num_seqs) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (qsl[mid * qsl0] <= t) lo = mid; else hi = mid - 1;
    }
    return qsl[(lo + 1) * qsl0] - qsl[lo * qsl0];
}


// ---- Device-side checks of the batch description (issue 33; src/cuda/checks.rs decodes the record) ----
// The engine owns one error record of four 64-bit words: [0] a lock (low 32 bits), [1] the fault's key
// (0 = none), [2] and [3] two values for the message. Keys order faults as the CPU engine checks them
// (query_start_loc[0]; then per sequence: its query_start_loc pair, seq_len, query length, table
// capacity, block ids; then the end of query_start_loc; slot_mapping), so the record keeps the smallest
// key: the fault the CPU engine would report, whatever order the CTAs ran in.
// KVS_CHECKS: which checks the attention kernels compile in, bit 0 the rows' (kvs_serve_row,
// kvs_finish_row_checks), bit 1 the sequences' with their counters (kvs_check_seqs); 3 always, other values
// for benchmarks only (KVS_BENCH_NO_DEVICE_CHECKS, src/cuda/checks.rs), the baselines of their cost.
#ifndef KVS_CHECKS
#define KVS_CHECKS 3
#endif
// Bit 2 of KVS_CHECKS (engine option padded_batches): query_start_loc may end before the last query row;
// the rows after it are padding (neither attended nor written). Without it the end must equal num_tokens.
#if KVS_CHECKS & 4
#define KVS_QSL_END_BAD(last, n) ((last) > (n))
#else
#define KVS_QSL_END_BAD(last, n) ((last) != (n))
#endif

// Fire-and-forget add to a device counter (a reduction: nothing waits for it, unlike an atomic whose
// result the hardware returns).
__device__ __forceinline__ void kvs_red_add(unsigned long long* p, unsigned long long v) {
    asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
#define KVS_FAULT_QSL_FIRST 1
#define KVS_FAULT_SEQ 2
#define KVS_FAULT_QSL_LAST 3
#define KVS_FAULT_SLOT 4
#define KVS_SUB_QSL_ORDER 0
#define KVS_SUB_QSL_BEYOND 1
#define KVS_SUB_LEN_NEG 2
#define KVS_SUB_QLEN 3
#define KVS_SUB_LEN_TABLE 4
#define KVS_SUB_BLOCK 5
// A row to poison whose fault another check records (a token outside its sequence's query rows).
#define KVS_FAULT_POISON_ONLY 0xffffffffffffffffull

__device__ __forceinline__ unsigned long long kvs_fault_key(int group, int idx, int sub, unsigned col) {
    return ((unsigned long long)group << 56) | ((unsigned long long)(idx & 0xfffff) << 36) | ((unsigned long long)sub << 32) |
           (unsigned long long)col;
}

// Records a fault unless one that comes earlier in the CPU engine's order is already recorded. Rare
// path: a spin lock makes key and values one consistent record.
__device__ __noinline__ void kvs_fail(unsigned long long* err, unsigned long long key, long long a, long long b) {
    if (err == 0 || key == 0ull || key == KVS_FAULT_POISON_ONLY) return;
    volatile unsigned long long* e = err;
    const unsigned long long cur = e[1];
    if (cur != 0ull && cur <= key) return;
    unsigned* lock = (unsigned*)err;
    while (atomicCAS(lock, 0u, 1u) != 0u) {
    }
    __threadfence();
    if (e[1] == 0ull || key < e[1]) {
        e[2] = (unsigned long long)a;
        e[3] = (unsigned long long)b;
        e[1] = key;
    }
    __threadfence();
    atomicExch(lock, 0u);
}

// What a row's checks read of the batch description: its sequence's query_start_loc pair and seq_len,
// the pairs on either side, and the ends of query_start_loc. Copied into shared memory by cp.async when
// the CTA starts (kvs_row_check_issue) and judged only after its main loop (kvs_finish_row_checks), so
// nothing waits for them in between (issue 33: the checks cost <= 1% of a decode step). Loads into
// registers would not do: the compiler moves such warp-uniform values into uniform registers at once,
// which waits for the loads before the main loop starts (measured: ~2 us per dense decode step).
struct RowCheck {
    int q0, q1, qprev, qnext, qfirst, qlast, len;
};
#define KVS_RC_WORDS 7
// Threads 0..6 each issue one 4-byte cp.async into sm_rc (the caller commits and waits: the tensor-core
// kernel's first pipeline group carries them, kvs_row_check_wait waits for them).
__device__ __forceinline__ void kvs_row_check_issue(int seq, const int* qsl, i64 qsl0, const int* seq_lens, i64 sl0, int num_seqs, int* sm_rc) {
    const int i = threadIdx.x;
    if (i >= KVS_RC_WORDS) return;
    const int* src = qsl + seq * qsl0;  // word 0, and the stand-in for a neighbour that does not exist
    if (i == 1) src = qsl + (seq + 1) * qsl0;
    if (i == 2 && seq > 0) src = qsl + (seq - 1) * qsl0;
    if (i == 3 && seq + 2 <= num_seqs) src = qsl + (seq + 2) * qsl0;
    if (i == 4) src = qsl;
    if (i == 5) src = qsl + num_seqs * qsl0;
    if (i == 6) src = seq_lens + seq * sl0;
    unsigned dst;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(dst) : "l"(sm_rc + i));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
// Every thread, before the barrier that precedes kvs_finish_row_checks: this thread's copies have landed.
__device__ __forceinline__ void kvs_row_check_wait() {
#if KVS_CHECKS & 1
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
__device__ __forceinline__ RowCheck kvs_row_check_read(const int* sm_rc, int seq, int num_seqs) {
    RowCheck c;
    c.q0 = sm_rc[0];
    c.q1 = sm_rc[1];
    c.qprev = seq > 0 ? sm_rc[2] : c.q0;
    c.qnext = seq + 2 <= num_seqs ? sm_rc[3] : c.q1;
    c.qfirst = sm_rc[4];
    c.qlast = sm_rc[5];
    c.len = sm_rc[6];
    return c;
}

// The same words loaded directly (kernels for which a wait before the main loop costs nothing
// measurable, e.g. the prefill kernel, whose CTAs run far longer than one L2 round trip).
__device__ __forceinline__ RowCheck kvs_row_check_load(int seq, const int* qsl, i64 qsl0, const int* seq_lens, i64 sl0, int num_seqs) {
    RowCheck c;
    c.q0 = qsl[seq * qsl0];
    c.q1 = qsl[(seq + 1) * qsl0];
    c.qprev = seq > 0 ? qsl[(seq - 1) * qsl0] : c.q0;
    c.qnext = seq + 2 <= num_seqs ? qsl[(seq + 2) * qsl0] : c.q1;
    c.qfirst = qsl[0];
    c.qlast = qsl[num_seqs * qsl0];
    c.len = seq_lens[seq * sl0];
    return c;
}

// The first fault of the batch description that the row of token t (in sequence `seq`, as locate()
// found it) depends on: its sequence's query_start_loc pair and the pairs on either side, its seq_len
// (sign, capacity of the table's `cols` columns, at least the query length), the ends of
// query_start_loc, and t inside its sequence's rows. 0 = none; such a row finishes as NaN.
__device__ __forceinline__ unsigned long long kvs_row_fault(const RowCheck& c, int t, int seq, int num_tokens, int cols, int bs_log2, long long* a,
                                                            long long* b) {
    const long long qlen = (long long)c.q1 - c.q0;
    *a = 0;
    *b = 0;
    if (c.qfirst != 0) { *a = c.qfirst; return kvs_fault_key(KVS_FAULT_QSL_FIRST, 0, 0, 0); }
    if (c.qprev > c.q0) { *a = c.qprev; *b = c.q0; return kvs_fault_key(KVS_FAULT_SEQ, seq - 1, KVS_SUB_QSL_ORDER, 0); }
    if (c.q1 < c.q0) { *a = c.q0; *b = c.q1; return kvs_fault_key(KVS_FAULT_SEQ, seq, KVS_SUB_QSL_ORDER, 0); }
    if (c.q1 > num_tokens) { *a = c.q1; *b = num_tokens; return kvs_fault_key(KVS_FAULT_SEQ, seq, KVS_SUB_QSL_BEYOND, 0); }
    if (c.len < 0) { *a = c.len; return kvs_fault_key(KVS_FAULT_SEQ, seq, KVS_SUB_LEN_NEG, 0); }
    if (qlen > c.len) { *a = qlen; *b = c.len; return kvs_fault_key(KVS_FAULT_SEQ, seq, KVS_SUB_QLEN, 0); }
    if ((long long)c.len > ((long long)cols << bs_log2)) { *a = c.len; *b = cols; return kvs_fault_key(KVS_FAULT_SEQ, seq, KVS_SUB_LEN_TABLE, 0); }
    if (c.qnext < c.q1) { *a = c.q1; *b = c.qnext; return kvs_fault_key(KVS_FAULT_SEQ, seq + 1, KVS_SUB_QSL_ORDER, 0); }
    if (KVS_QSL_END_BAD(c.qlast, num_tokens)) { *a = c.qlast; *b = num_tokens; return kvs_fault_key(KVS_FAULT_QSL_LAST, 0, 0, 0); }
    if (t < c.q0 || t >= c.q1) return KVS_FAULT_POISON_ONLY;
    return 0ull;
}

// Every sequence's part of the batch description, checked once per launch whether or not it has rows:
// the CTA (t, 0, 0) of the attention grid checks sequences t, t + num_tokens, ... (thread 0), and counts
// the valid ones' decode rows, prefill tokens and the K/V bytes dense attention reads for them (as the
// CPU engine counts: the visible keys of the first query row times `row_bytes`) into the layer's
// counters `bk` (decide.cuh CTR_*) when bk is not NULL. Records faults; poisons nothing (kvs_row_fault
// does). Called once per CTA after its main loop; its counters fire and forget.
#define KVS_BK_DECODE_ROWS 0     // decide.cuh CTR_DECODE_ROWS
#define KVS_BK_PREFILL_TOKENS 1  // decide.cuh CTR_PREFILL_TOKENS
#define KVS_BK_KV_BYTES 7        // decide.cuh CTR_KV_BYTES
// `rc` (NULL when the CTA serves no row): the row's check words for sequence `rc_seq`, used instead of
// loads (a decode batch's CTA checks exactly its row's sequence, so its tail loads nothing). The body is
// not inlined (it would hold registers in the main loop) and takes those words by value.
__device__ __noinline__ void kvs_check_seqs_body(unsigned long long* err, unsigned long long* bk, const int* qsl, i64 qsl0, const int* seq_lens,
                                                 i64 sl0, int num_seqs, int num_tokens, int cols, int bs_log2, int window, i64 row_bytes,
                                                 bool have, RowCheck rc, int rc_seq) {
    const int t = blockIdx.x;
    if (t == 0) {
        const int f = have ? rc.qfirst : qsl[0], l = have ? rc.qlast : qsl[num_seqs * qsl0];
        if (f != 0) kvs_fail(err, kvs_fault_key(KVS_FAULT_QSL_FIRST, 0, 0, 0), f, 0);
        if (KVS_QSL_END_BAD(l, num_tokens)) kvs_fail(err, kvs_fault_key(KVS_FAULT_QSL_LAST, 0, 0, 0), l, num_tokens);
    }
    unsigned long long dec = 0ull, pre = 0ull, bytes = 0ull;
    for (int s = t; s < num_seqs; s += gridDim.x) {
        const bool mine = have && s == rc_seq;
        const int a = mine ? rc.q0 : qsl[s * qsl0], b = mine ? rc.q1 : qsl[(s + 1) * qsl0], len = mine ? rc.len : seq_lens[s * sl0];
        const long long qlen = (long long)b - a;
        if (b < a) kvs_fail(err, kvs_fault_key(KVS_FAULT_SEQ, s, KVS_SUB_QSL_ORDER, 0), a, b);
        else if (b > num_tokens) kvs_fail(err, kvs_fault_key(KVS_FAULT_SEQ, s, KVS_SUB_QSL_BEYOND, 0), b, num_tokens);
        else if (len < 0) kvs_fail(err, kvs_fault_key(KVS_FAULT_SEQ, s, KVS_SUB_LEN_NEG, 0), len, 0);
        else if (qlen > len) kvs_fail(err, kvs_fault_key(KVS_FAULT_SEQ, s, KVS_SUB_QLEN, 0), qlen, len);
        else if ((long long)len > ((long long)cols << bs_log2)) kvs_fail(err, kvs_fault_key(KVS_FAULT_SEQ, s, KVS_SUB_LEN_TABLE, 0), len, cols);
        else {
            if (qlen == 1) dec += 1ull;
            else pre += (unsigned long long)qlen;
            const long long first = (long long)len - qlen;  // the first query row's position
            const long long vis = (window > 0 && first + 1 - window > 0) ? first + 1 - window : 0;
            bytes += (unsigned long long)(len - vis) * (unsigned long long)row_bytes;
        }
    }
    if (bk != 0) {
        if (dec != 0ull) kvs_red_add(&bk[KVS_BK_DECODE_ROWS], dec);
        if (pre != 0ull) kvs_red_add(&bk[KVS_BK_PREFILL_TOKENS], pre);
        if (bytes != 0ull) kvs_red_add(&bk[KVS_BK_KV_BYTES], bytes);
    }
}
__device__ __forceinline__ void kvs_check_seqs(unsigned long long* err, unsigned long long* bk, const int* qsl, i64 qsl0, const int* seq_lens,
                                               i64 sl0, int num_seqs, int num_tokens, int cols, int bs_log2, int window, i64 row_bytes,
                                               const RowCheck* rc, int rc_seq) {
#if KVS_CHECKS & 2
    if (blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0)
        kvs_check_seqs_body(err, bk, qsl, qsl0, seq_lens, sl0, num_seqs, num_tokens, cols, bs_log2, window, row_bytes, (KVS_CHECKS & 1) && rc != 0,
                            (KVS_CHECKS & 1) && rc != 0 ? *rc : RowCheck(),
                            rc_seq);
#endif
}

// The first block-table entry of `seq` (columns below ceil(len / block size), as the CPU engine checks
// them) outside [0, num_blocks), found by the whole CTA and recorded by thread 0. Called (by every
// thread) only by a CTA that read a bad entry: the fault path.
__device__ __noinline__ void kvs_record_block_fault(unsigned long long* err, int seq, const int* bt_row, i64 bt1, int cols, int bs_log2, int len,
                                                    i64 num_blocks, int* sm_col) {
    if (threadIdx.x == 0) *sm_col = 0x7fffffff;
    __syncthreads();
    len = len < 0 ? 0 : (len > (cols << bs_log2) ? (cols << bs_log2) : len);
    const int need = (len + (1 << bs_log2) - 1) >> bs_log2;
    for (int c = threadIdx.x; c < need; c += blockDim.x) {
        const int id = bt_row[(i64)c * bt1];
        if (id < 0 || id >= num_blocks) atomicMin(sm_col, c);
    }
    __syncthreads();
    const int c = *sm_col;
    if (threadIdx.x == 0 && c != 0x7fffffff) kvs_fail(err, kvs_fault_key(KVS_FAULT_SEQ, seq, KVS_SUB_BLOCK, (unsigned)c), bt_row[(i64)c * bt1], num_blocks);
}

// An attention CTA's checks, start: false when another launch of the call serves the row (the CTA has
// then checked its share of the batch description and must return); else the row's check words are on
// their way into sm_rc (kvs_row_check_issue).
__device__ __forceinline__ bool kvs_serve_row(int mode, const RowInfo& row, unsigned long long* err, unsigned long long* bk, const int* qsl, i64 qsl0,
                                              const int* seq_lens, i64 sl0, int num_seqs, int cols, int bs_log2, int window, i64 row_bytes,
                                              int* sm_rc) {
    // A padded batch's padding row (engine option padded_batches): the CTA checks its share and writes nothing.
    if (!kvs_row_served(mode, row.qlen) || ((KVS_CHECKS & 4) && row.pad)) {
        kvs_check_seqs(err, bk, qsl, qsl0, seq_lens, sl0, num_seqs, gridDim.x, cols, bs_log2, window, row_bytes, nullptr, -1);
        return false;
    }
#if KVS_CHECKS & 1
    kvs_row_check_issue(row.seq, qsl, qsl0, seq_lens, sl0, num_seqs, sm_rc);
#endif
    return true;
}

// An attention CTA's checks, end (every thread calls it, after the CTA's last read of the caches and a
// barrier after kvs_row_check_wait): judges the row's check words (left in *rc for kvs_check_seqs),
// records the row's fault and, when any thread read a bad block id (`cta_bt_bad`, uniform), the
// sequence's first bad block id. Returns whether the row finishes as NaN.
__device__ __forceinline__ bool kvs_finish_row_checks(unsigned long long* err, const int* sm_rc, int num_seqs, RowCheck* rc, bool cta_bt_bad, int t,
                                                      int seq, const int* bt_row, i64 bt1, i64 num_blocks, int cols, int bs_log2, int* sm_col) {
#if KVS_CHECKS & 1
    *rc = kvs_row_check_read(sm_rc, seq, num_seqs);
    long long fa, fb;
    const unsigned long long key = kvs_row_fault(*rc, t, seq, gridDim.x, cols, bs_log2, &fa, &fb);
    if (cta_bt_bad) kvs_record_block_fault(err, seq, bt_row, bt1, cols, bs_log2, rc->len, num_blocks, sm_col);
    if (key != 0ull && threadIdx.x == 0) kvs_fail(err, key, fa, fb);
    return key != 0ull || cta_bt_bad;
#else
    return false;
#endif
}
