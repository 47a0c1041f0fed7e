// The structs the host passes by value to kernels of several files, each mirrored by a #[repr(C)] Rust
// struct (named in its comment); a policy's own such structs sit in its kernel file (kernels/policy/). A
// test (src/cuda/kernel_src.rs) compiles them with the host C compiler and compares the size and every
// field's name and offset with the Rust struct, so the two cannot drift apart.
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
