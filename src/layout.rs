//! KV-cache geometry and varlen batches, built from validated tensors.
//!
//! The tensors' layouts are checked by [`crate::validate`] (one routine per role); this file checks what
//! the kernels index inside them: block ids, sequence lengths and query lengths. A validated [`Batch`] is
//! a host-side copy of the per-sequence metadata, so the CPU kernels (and the policies) never read caller
//! memory they have not already checked.

use crate::config::EngineConfig;
use crate::error::Result;
use crate::tensor::{DType, Device, TensorRef};
use crate::{alloc, bail, ensure, validate};

/// One layer's K and V caches in vLLM's flash layout `[num_blocks, block_size, num_kv_heads, head_dim]`,
/// with arbitrary non-negative strides (in elements).
#[derive(Clone, Copy, Debug)]
pub struct KvCache {
    pub k: TensorRef,
    pub v: TensorRef,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The engine's cache dtype (an FP8 cache passed as uint8 bytes is read as its FP8 format).
    pub dtype: DType,
    /// Dequantization scales of an FP8 cache (element = `fp8 * scale`, src/fp8.rs); 1 otherwise.
    pub k_scale: f32,
    pub v_scale: f32,
}

impl KvCache {
    pub fn new(cfg: &EngineConfig, k: TensorRef, v: TensorRef, device: Device) -> Result<Self> {
        debug_assert_eq!(device, cfg.device);
        validate::cache(cfg, "key_cache", &k)?;
        validate::cache(cfg, "value_cache", &v)?;
        ensure!(k.shape() == v.shape(), InvalidShape, "key_cache shape {:?} differs from value_cache shape {:?}", k.shape(), v.shape());
        let num_blocks = k.dim(0);
        if cfg.num_blocks != 0 {
            ensure!(num_blocks == cfg.num_blocks, InvalidShape, "caches have {} blocks, the engine was configured for {}", num_blocks, cfg.num_blocks);
        }
        let (mut k, mut v) = (k, v);
        (k.dtype, v.dtype) = (cfg.cache_dtype, cfg.cache_dtype);
        Ok(KvCache { k, v, num_blocks, block_size: cfg.block_size, num_kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim, dtype: cfg.cache_dtype, k_scale: 1.0, v_scale: 1.0 })
    }


    /// Pointer to the K row of (block, offset-in-block, kv head).
    #[inline(always)]
    pub fn k_row(&self, block: usize, off: usize, head: usize) -> *const u8 {
        self.k.ptr_at(&[block, off, head, 0])
    }
    #[inline(always)]
    pub fn v_row(&self, block: usize, off: usize, head: usize) -> *const u8 {
        self.v.ptr_at(&[block, off, head, 0])
    }
    /// Bytes from one index to the next along `dim` of K (of V: [`v_byte_stride`](Self::v_byte_stride)), or 0
    /// when that dimension has a single index. Validation bounds a stride only where it is applied (its
    /// reach over the dimension's extent), so a single-index dimension (block_size 1, one KV head) may
    /// carry any stride, and that stride times the element size can overflow; no index steps along it.
    pub fn k_byte_stride(&self, dim: usize) -> isize {
        byte_stride(&self.k, dim, self.dtype)
    }
    pub fn v_byte_stride(&self, dim: usize) -> isize {
        byte_stride(&self.v, dim, self.dtype)
    }
    /// Element stride along head_dim (1 for every cache a framework normally allocates).
    pub fn k_dim_stride(&self) -> isize {
        self.k.stride(3)
    }
    pub fn v_dim_stride(&self) -> isize {
        self.v.stride(3)
    }
}

/// See [`KvCache::k_byte_stride`]: within a validated tensor's span (< isize::MAX bytes) whenever dim > 1.
fn byte_stride(t: &TensorRef, dim: usize, dtype: DType) -> isize {
    if t.dim(dim) > 1 {
        t.stride(dim) * dtype.size_bytes() as isize
    } else {
        0
    }
}

/// One sequence of a varlen batch, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqDesc {
    /// Index of the sequence in the batch (row of the block table).
    pub index: usize,
    /// First row of this sequence in the query/output tensors.
    pub q_start: usize,
    /// Number of new query tokens (1 for decode).
    pub q_len: usize,
    /// Total length including the new tokens.
    pub seq_len: usize,
    /// Caller's stable id for policy state (0 when the caller passed none).
    pub seq_id: u64,
}

impl SeqDesc {
    /// Position of the first new token; query row `i` sits at `first_pos() + i`.
    pub fn first_pos(&self) -> usize {
        self.seq_len - self.q_len
    }
    pub fn is_decode(&self) -> bool {
        self.q_len == 1
    }
}

/// A validated varlen batch: per-sequence descriptors plus the block table copied to the host.
#[derive(Clone, Debug)]
pub struct Batch {
    pub seqs: Vec<SeqDesc>,
    pub num_tokens: usize,
    /// The validated block ids of every sequence, back to back: sequence `s` owns
    /// `table[table_start[s]..table_start[s + 1]]`, its first `ceil(seq_len / block_size)` table entries
    /// (none for a sequence without query tokens, which attends nothing).
    table: Vec<u32>,
    table_start: Vec<usize>,
    pub has_seq_ids: bool,
}

impl Batch {
    /// Reads and validates `query_start_loc`, `seq_lens`, `block_table` and `seq_ids` (host tensors).
    /// Reads only the table entries a sequence with query tokens needs, so the work and memory follow
    /// the batch's real size, not the extents of a broadcast (zero-stride) table.
    pub fn from_host_tensors(
        num_tokens: usize,
        query_start_loc: &TensorRef,
        seq_lens: &TensorRef,
        block_table: &TensorRef,
        seq_ids: Option<&TensorRef>,
        block_size: usize,
        num_blocks: usize,
        padded: bool,
    ) -> Result<Self> {
        let num_seqs = validate::batch(Device::Cpu, query_start_loc, seq_lens, block_table, seq_ids)?;
        let blocks_per_seq = block_table.dim(1);
        let mut seqs = alloc::try_with_capacity(num_seqs, "the batch's sequence list")?;
        let mut table_start = alloc::try_with_capacity(num_seqs + 1, "the batch's block table index")?;
        let mut table = Vec::new();
        table_start.push(0);
        // SAFETY (all reads below): indices are within the shapes checked above.
        let qsl0 = unsafe { query_start_loc.read_int(&[0]) };
        ensure!(qsl0 == 0, InvalidArgument, "query_start_loc[0] must be 0, got {qsl0}");
        for s in 0..num_seqs {
            let a = unsafe { query_start_loc.read_int(&[s]) };
            let b = unsafe { query_start_loc.read_int(&[s + 1]) };
            ensure!(b >= a, InvalidArgument, "query_start_loc must be non-decreasing: entry {} is {b} after {a}", s + 1);
            ensure!(b as usize <= num_tokens, OutOfRange, "query_start_loc[{}] = {b} exceeds the {num_tokens} query tokens", s + 1);
            let seq_len = unsafe { seq_lens.read_int(&[s]) };
            ensure!(seq_len >= 0, OutOfRange, "seq_lens[{s}] = {seq_len} is negative");
            let q_len = (b - a) as usize;
            let seq_len = seq_len as usize;
            ensure!(q_len <= seq_len, OutOfRange, "sequence {s} has {q_len} query tokens but seq_len {seq_len}; seq_lens must include the new tokens");
            let needed = seq_len.div_ceil(block_size);
            ensure!(
                needed <= blocks_per_seq,
                OutOfRange,
                "sequence {s} has seq_len {seq_len}, which needs {needed} blocks of {block_size}, but the block table has {blocks_per_seq} columns"
            );
            if q_len > 0 {
                table.try_reserve(needed).map_err(|_| crate::error::Error::new(crate::error::ErrorKind::OutOfMemory, format!("cannot copy {needed} block table entries of sequence {s}")))?;
                for j in 0..needed {
                    let id = unsafe { block_table.read_int(&[s, j]) };
                    ensure!(id >= 0 && (id as usize) < num_blocks, OutOfRange, "block_table[{s}][{j}] = {id} is outside the cache's {num_blocks} blocks");
                    table.push(id as u32);
                }
            }
            table_start.push(table.len());
            let seq_id = match seq_ids {
                Some(ids) => unsafe { ids.read_int(&[s]) as u64 },
                None => 0,
            };
            seqs.push(SeqDesc { index: s, q_start: a as usize, q_len, seq_len, seq_id });
        }
        let last = unsafe { query_start_loc.read_int(&[num_seqs]) } as usize;
        // With `padded_batches`, rows past the last sequence's are padding: not attended, not written.
        ensure!(last == num_tokens || (padded && last <= num_tokens), InvalidShape, "query_start_loc ends at {last} but the query has {num_tokens} tokens");
        Ok(Batch { seqs, num_tokens, table, table_start, has_seq_ids: seq_ids.is_some() })
    }

    /// The physical block ids of sequence `s` (the validated prefix; empty without query tokens).
    #[inline]
    pub fn blocks(&self, s: usize, block_size: usize) -> &[u32] {
        let row = &self.table[self.table_start[s]..self.table_start[s + 1]];
        debug_assert!(row.is_empty() || row.len() == self.seqs[s].seq_len.div_ceil(block_size));
        row
    }
}

/// Checks the scalar attention parameters.
pub fn validate_params(scale: f32, sliding_window: i32, softcap: f32) -> Result<()> {
    ensure!(scale.is_finite() && scale > 0.0, InvalidArgument, "scale must be a positive finite number, got {scale}");
    ensure!(sliding_window >= 0, InvalidArgument, "sliding_window must be 0 (off) or a positive number of tokens, got {sliding_window}");
    if !(softcap.is_finite() && softcap >= 0.0) {
        bail!(InvalidArgument, "softcap must be 0 (off) or a positive finite number, got {softcap}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A single-index dimension may carry any stride (validation bounds only applied strides): its byte
    /// stride is 0, not the stride times the element size (which overflows here; the fuzzer's c_abi
    /// target found the CPU prefill's block-row step panicking on it in an overflow-checked build).
    #[test]
    fn byte_strides_of_single_index_dims_are_zero_and_others_exact() {
        let data = vec![0f32; 2 * 8];
        let huge = i64::MAX / 3;
        let k = TensorRef::strided(&data, 0, &[2, 1, 1, 8], &[8, huge, huge, 1]).expect("a view whose huge strides are never applied");
        let cache = KvCache { k, v: k, num_blocks: 2, block_size: 1, num_kv_heads: 1, head_dim: 8, dtype: DType::F32, k_scale: 1.0, v_scale: 1.0 };
        assert_eq!((cache.k_byte_stride(1), cache.k_byte_stride(2), cache.v_byte_stride(1)), (0, 0, 0));
        assert_eq!((cache.k_byte_stride(0), cache.k_byte_stride(3)), (32, 4));
        let data = vec![half::bf16::ZERO; 4 * 3 * 8];
        let k = TensorRef::strided(&data, 0, &[1, 4, 3, 8], &[96, 24, 8, 1]).unwrap();
        let cache = KvCache { k, v: k, num_blocks: 1, block_size: 4, num_kv_heads: 3, head_dim: 8, dtype: DType::BF16, k_scale: 1.0, v_scale: 1.0 };
        assert_eq!((cache.k_byte_stride(1), cache.k_byte_stride(2)), (48, 16));
    }
}
