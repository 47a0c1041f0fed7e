//! The arguments of the engine's calls, below the engine and the backends (both take them): what the C
//! ABI's `kvs_*_args` structs become once their pointers are checked.

use std::ffi::c_void;

use crate::tensor::TensorRef;

/// Arguments of one attention forward call (see `kvs_forward_args` in the C header for the contract).
#[derive(Clone, Copy, Debug)]
pub struct ForwardArgs {
    pub layer: usize,
    /// `[num_tokens, num_q_heads, head_dim]`
    pub query: TensorRef,
    /// `[num_blocks, block_size, num_kv_heads, head_dim]` each
    pub key_cache: TensorRef,
    pub value_cache: TensorRef,
    /// `[num_seqs, max_blocks]` int32
    pub block_table: TensorRef,
    /// `[num_seqs]` int32, total length including the new tokens
    pub seq_lens: TensorRef,
    /// `[num_seqs + 1]` int32
    pub query_start_loc: TensorRef,
    /// `[num_seqs]` int64/uint64 stable ids, needed by stateful policies
    pub seq_ids: Option<TensorRef>,
    /// `[num_tokens, num_q_heads, head_dim]`, dtype of the query
    pub out: TensorRef,
    /// `[num_tokens, num_q_heads]` float32
    pub lse: Option<TensorRef>,
    pub scale: f32,
    pub sliding_window: i32,
    pub softcap: f32,
    /// Largest query length / sequence length in the batch, for GPU grid sizing (0 = unknown: the CUDA
    /// backend then assumes the block table's capacity). Ignored on the CPU, which reads the metadata.
    pub max_query_len: i32,
    pub max_seq_len: i32,
    pub stream: *mut c_void,
}

/// Arguments of a cache write.
#[derive(Clone, Copy, Debug)]
pub struct CacheWriteArgs {
    pub layer: usize,
    /// `[num_tokens, num_kv_heads, head_dim]`
    pub key: TensorRef,
    pub value: TensorRef,
    pub key_cache: TensorRef,
    pub value_cache: TensorRef,
    /// `[num_tokens]` int64 or int32; negative entries are skipped
    pub slot_mapping: TensorRef,
    pub stream: *mut c_void,
}

/// Arguments of a state merge: `out, lse = merge((out_a, lse_a), (out_b, lse_b))`.
#[derive(Clone, Copy, Debug)]
pub struct MergeArgs {
    pub out_a: TensorRef,
    pub lse_a: TensorRef,
    pub out_b: TensorRef,
    pub lse_b: TensorRef,
    pub out: TensorRef,
    pub lse_out: Option<TensorRef>,
    pub stream: *mut c_void,
}
