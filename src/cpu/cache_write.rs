//! Writing new K/V rows into the paged cache by slot mapping (slot = block * block_size + offset),
//! as vLLM's `reshape_and_cache_flash` does; negative slots are padding and are skipped.

use super::convert::{load_row, Portable};
use crate::error::Result;
use crate::layout::KvCache;
use crate::tensor::TensorRef;
use crate::ensure;

/// Validated slot list: `Some((block, offset))` per token, `None` for skipped (negative) slots.
pub fn decode_slots(slot_mapping: &TensorRef, num_tokens: usize, cache: &KvCache) -> Result<Vec<Option<(usize, usize)>>> {
    // The cache's memory holds num_blocks * block_size slots, so the product fits (checked anyway).
    let capacity = cache.num_blocks.checked_mul(cache.block_size).and_then(|c| i64::try_from(c).ok()).unwrap_or(i64::MAX);
    let mut out = crate::alloc::try_with_capacity(num_tokens, "the slot list")?;
    for t in 0..num_tokens {
        // SAFETY: t < num_tokens == slot_mapping.shape[0], validated by the caller.
        let slot = unsafe { slot_mapping.read_int(&[t]) };
        if slot < 0 {
            out.push(None);
            continue;
        }
        ensure!(slot < capacity, OutOfRange, "slot_mapping[{t}] = {slot} is outside the cache's {capacity} slots ({} blocks of {})", cache.num_blocks, cache.block_size);
        out.push(Some(((slot as usize) / cache.block_size, (slot as usize) % cache.block_size)));
    }
    Ok(out)
}

/// Copies `key[t]` / `value[t]` (`[num_tokens, num_kv_heads, head_dim]`, the engine's dtype) into their
/// slots; an FP8 cache gets them quantized (see [`write_fp8`]). Everything was validated, including the
/// slots, before the first byte is written.
pub fn write(cache: &KvCache, key: &TensorRef, value: &TensorRef, slots: &[Option<(usize, usize)>]) {
    if cache.dtype.is_fp8() {
        return write_fp8(cache, key, value, slots);
    }
    let es = cache.dtype.size_bytes();
    let d = cache.head_dim;
    for (t, slot) in slots.iter().enumerate() {
        let Some((b, o)) = *slot else { continue };
        for h in 0..cache.num_kv_heads {
            for (src, dst_row, dst_stride) in [
                (key, cache.k_row(b, o, h) as *mut u8, cache.k_dim_stride()),
                (value, cache.v_row(b, o, h) as *mut u8, cache.v_dim_stride()),
            ] {
                let src_row = src.ptr_at(&[t, h, 0]);
                let src_stride = src.stride(2);
                // SAFETY: indices validated; source and cache are distinct allocations by contract.
                unsafe {
                    if src_stride == 1 && dst_stride == 1 {
                        std::ptr::copy_nonoverlapping(src_row, dst_row, d * es);
                    } else {
                        for i in 0..d {
                            std::ptr::copy_nonoverlapping(src_row.offset(i as isize * src_stride * es as isize), dst_row.offset(i as isize * dst_stride * es as isize), es);
                        }
                    }
                }
            }
        }
    }
}

/// The FP8 cache write: each element `x` becomes `fp8::quantize(x, scale)` (float32 `x / scale`, rounded
/// to nearest even, saturating to ±max; NaN stays NaN), as vLLM's `reshape_and_cache_flash` stores it.
fn write_fp8(cache: &KvCache, key: &TensorRef, value: &TensorRef, slots: &[Option<(usize, usize)>]) {
    let d = cache.head_dim;
    let mut row = vec![0f32; d];
    for (t, slot) in slots.iter().enumerate() {
        let Some((b, o)) = *slot else { continue };
        for h in 0..cache.num_kv_heads {
            for (src, dst_row, dst_stride, scale) in [
                (key, cache.k_row(b, o, h) as *mut u8, cache.k_dim_stride(), cache.k_scale),
                (value, cache.v_row(b, o, h) as *mut u8, cache.v_dim_stride(), cache.v_scale),
            ] {
                // SAFETY: indices validated; source and cache are distinct allocations by contract.
                unsafe {
                    load_row::<Portable>(src.ptr_at(&[t, h, 0]), src.dtype, src.stride(2), d, &mut row);
                    for (i, &x) in row.iter().enumerate() {
                        *dst_row.offset(i as isize * dst_stride) = crate::fp8::quantize(cache.dtype, x, scale);
                    }
                }
            }
        }
    }
}
