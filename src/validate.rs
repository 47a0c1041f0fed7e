//! One validation routine per tensor role, shared by every entry point (forward, cache write, merge) and
//! both backends, so the same layout is accepted or rejected the same way wherever it is passed.
//!
//! Every view already has checked size arithmetic (see `TensorRef::from_raw`). A role adds rank, dtype,
//! device, extents and strides: inputs may broadcast (zero strides), outputs (and the caches, which
//! `kvs_cache_write` writes) must not alias themselves. Per-call counts have documented limits, so no call
//! can loop over a broadcast extent of 2^40 or size an allocation by it.

use crate::config::EngineConfig;
use crate::ensure;
use crate::error::Result;
use crate::tensor::{DType, Device, TensorRef};

/// Most query tokens (forward) or new K/V rows (cache write) one call accepts.
pub const MAX_TOKENS_PER_CALL: usize = 1 << 20;
/// Most sequences one forward call accepts.
pub const MAX_SEQS_PER_CALL: usize = 1 << 16;

/// Whether kvsparse writes the tensor (then it must not alias itself) or only reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    Read,
    Write,
}

fn check(t: &TensorRef, name: &str, dtypes: &[DType], device: Device, shape: &[Option<usize>], access: Access) -> Result<()> {
    t.expect(name, shape.len(), dtypes, device)?;
    t.expect_shape(name, shape)?;
    if access == Access::Write {
        t.expect_no_self_overlap(name)?;
    }
    Ok(())
}

fn count(name: &str, what: &str, n: usize, max: usize) -> Result<usize> {
    ensure!(n <= max, Unsupported, "{name} has {n} {what}, more than the {max} one call accepts");
    Ok(n)
}

/// `query [num_tokens, num_q_heads, head_dim]`, the engine's dtype; returns `num_tokens`.
pub fn query(cfg: &EngineConfig, t: &TensorRef) -> Result<usize> {
    check(t, "query", &[cfg.dtype], cfg.device, &[None, Some(cfg.num_q_heads), Some(cfg.head_dim)], Access::Read)?;
    count("query", "tokens", t.dim(0), MAX_TOKENS_PER_CALL)
}

/// `out [num_tokens, num_q_heads, head_dim]` of a forward call, the engine's dtype.
pub fn attention_out(cfg: &EngineConfig, t: &TensorRef, num_tokens: usize) -> Result<()> {
    check(t, "out", &[cfg.dtype], cfg.device, &[Some(num_tokens), Some(cfg.num_q_heads), Some(cfg.head_dim)], Access::Write)
}

/// A `[tokens, heads]` float32 log-sum-exp that kvsparse writes (forward `lse`, merge `lse_out`).
pub fn lse_out(name: &str, t: &TensorRef, device: Device, tokens: usize, heads: usize) -> Result<()> {
    check(t, name, &[DType::F32], device, &[Some(tokens), Some(heads)], Access::Write)
}

/// A `[tokens, heads]` float32 log-sum-exp that kvsparse reads (merge `lse_a`, `lse_b`).
pub fn lse_in(name: &str, t: &TensorRef, device: Device, tokens: usize, heads: usize) -> Result<()> {
    check(t, name, &[DType::F32], device, &[Some(tokens), Some(heads)], Access::Read)
}

/// Merge `out [tokens, heads, dim]`, any float dtype; returns (tokens, heads, dim).
pub fn merge_out(t: &TensorRef, device: Device) -> Result<(usize, usize, usize)> {
    check(t, "out", &[DType::F32, DType::F16, DType::BF16], device, &[None, None, None], Access::Write)?;
    Ok((t.dim(0), t.dim(1), t.dim(2)))
}

/// Merge inputs `out_a`, `out_b`: the shape and dtype of `out`.
pub fn merge_in(name: &str, t: &TensorRef, out: &TensorRef, device: Device) -> Result<()> {
    check(t, name, &[out.dtype], device, &[Some(out.dim(0)), Some(out.dim(1)), Some(out.dim(2))], Access::Read)
}

/// One layer cache (`key_cache` / `value_cache`) `[num_blocks, block_size, num_kv_heads, head_dim]`, of
/// the engine's cache dtype (an FP8 cache may also come as uint8 bytes, as vLLM allocates it).
/// Written by `kvs_cache_write`, so no two slots may share memory, in forward calls too.
pub fn cache(cfg: &EngineConfig, name: &str, t: &TensorRef) -> Result<()> {
    let fp8_bytes = [cfg.cache_dtype, DType::U8];
    let dtypes = if cfg.cache_dtype.is_fp8() { &fp8_bytes[..] } else { &fp8_bytes[..1] };
    check(t, name, dtypes, cfg.device, &[None, Some(cfg.block_size), Some(cfg.num_kv_heads), Some(cfg.head_dim)], Access::Write)
}

/// Rows to store (`key` / `value` of a cache write) `[num_tokens, num_kv_heads, head_dim]`; returns
/// `num_tokens`.
pub fn new_rows(cfg: &EngineConfig, name: &str, t: &TensorRef) -> Result<usize> {
    check(t, name, &[cfg.dtype], cfg.device, &[None, Some(cfg.num_kv_heads), Some(cfg.head_dim)], Access::Read)?;
    count(name, "tokens", t.dim(0), MAX_TOKENS_PER_CALL)
}

/// `slot_mapping [>= num_tokens]` int64 or int32.
pub fn slot_mapping(t: &TensorRef, device: Device, num_tokens: usize) -> Result<()> {
    check(t, "slot_mapping", &[DType::I64, DType::I32], device, &[None], Access::Read)?;
    ensure!(t.dim(0) >= num_tokens, InvalidShape, "slot_mapping has {} entries for {num_tokens} tokens", t.dim(0));
    Ok(())
}

/// The batch description of a forward call: `seq_lens [num_seqs]` int32, `query_start_loc [num_seqs+1]`
/// int32, `block_table [num_seqs, max_blocks]` int32, `seq_ids [num_seqs]` int64/uint64 (optional).
/// Checks their layout, not their contents (the CPU reads and checks those in `layout::Batch`); returns
/// `num_seqs`.
pub fn batch(device: Device, query_start_loc: &TensorRef, seq_lens: &TensorRef, block_table: &TensorRef, seq_ids: Option<&TensorRef>) -> Result<usize> {
    check(seq_lens, "seq_lens", &[DType::I32], device, &[None], Access::Read)?;
    let num_seqs = count("seq_lens", "sequences", seq_lens.dim(0), MAX_SEQS_PER_CALL)?;
    check(query_start_loc, "query_start_loc", &[DType::I32], device, &[Some(num_seqs + 1)], Access::Read)?;
    check(block_table, "block_table", &[DType::I32], device, &[Some(num_seqs), None], Access::Read)?;
    if let Some(ids) = seq_ids {
        check(ids, "seq_ids", &[DType::I64, DType::U64], device, &[Some(num_seqs)], Access::Read)?;
    }
    Ok(num_seqs)
}
