// The structs the host passes to kernels by value, each mirrored by a #[repr(C)] Rust struct (named in
// its comment). A test (src/cuda/kernel_src.rs) compiles this file with the host C compiler and compares
// the size and every field's name and offset with the Rust struct, so the two cannot drift apart.
// Plain C: fixed-width fields and pointers only (device pointers are 64-bit, as on the host).
#pragma once
#include "common.cuh"

// Rust: src/cuda/sparse.rs BatchArg. The batch geometry every selection kernel reads.
struct Batch {
    const int* bt;
    i64 bt0, bt1;
    int bt_cols, bs_log2;
    i64 num_blocks;
    const int* seq_lens;
    i64 sl0;
    const int* qsl;
    i64 qsl0;
    int num_seqs, num_tokens, window, pad;
};

// Rust: src/cuda/sparse.rs PlanRef.
// The plan a decode row reads (PLAN=1 variants): entries of (1 << ulog2) positions, plan_len[seq*hk+kvh].
struct PlanRef {
    const unsigned* e;
    i64 p_s, p_h;
    const int* len;
    int ulog2, hk, cap, pad;
};

// Rust: src/cuda/sparse.rs ArtLaunch.
// Termination parameters (passed by value after `mode`). patience < 0: never stop (patience = inf).
struct ArtArgs {
    float tau, phi;
    int patience, sink_limit;
    unsigned long long* ctr;  // the layer's device counters (kernels/include/decide.cuh CTR_*)
    int* tiles_out;           // per (sequence, KV head, split): tiles visited
    int hk;
    int segment;              // keys per ART segment, 0 = one (host planning; the kernel reads its split)
    // Priority order (order=priority behind a scored selector): the plan's entries in visiting order,
    // same layout as the plan (kvs_art_priority, kernels/select.cu); NULL = recency order.
    const unsigned* order;
    const int* inv;           // (read by kvs_art_blocks only)
};

// Rust: src/cuda/refresh.rs RefreshArgs. RefreshKV's layer state and parameters.
struct RefreshArgs {
    float* qref;          // [max_seqs][HEAD_DIM]
    int* since;           // [max_seqs]
    unsigned* lstamp;     // [max_seqs]
    unsigned* tok;        // [max_seqs][hk][k]
    float* sc;            // [max_seqs][hk][k]
    int* cnt;             // [max_seqs][hk]
    int* last;            // [max_seqs][hk]
    unsigned* hstamp;     // [max_seqs][hk]
    const int* slot;      // per sequence of the call (-1: none)
    const unsigned* gen;  // per sequence of the call
    int* mode;            // per sequence of the call (RF_*)
    unsigned long long* rctr;  // the layer's [full steps, partial steps]
    int k, stride, every, pool;
    float s;
    int hk;
};

// Rust: src/cuda/predictor.rs StateArg. The predictor's layer state.
struct PredState {
    int* hdr;
    int* lens;
    float* ring;
    float* zc;
    int H, wc, hk, pad;
};

// Rust: src/cuda/predictor.rs SpecArg.
struct PredSpec {
    int budget, block, calib, sink, local, pad;
};
