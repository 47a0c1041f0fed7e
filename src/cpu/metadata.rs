//! Per-layer key metadata that policies read instead of K itself, maintained on every `Engine::cache_write`:
//!
//! * a fill mask per physical block (one bit per slot), so a forward call can refuse to trust metadata for
//!   rows that were never written through kvsparse;
//! * Quest: channel-wise min and max of K per page unit (`unit = min(page, block_size)` slots of one block)
//!   and KV head;
//! * Twilight: an INT4 per-token copy of K (see [`super::quantize`]).
//!
//! Blocks are reused by serving engines for other sequences, and sequences only grow (or are rewritten from
//! some position on, as after rejected speculative tokens). So a write at offset `j` of a block starts that
//! block over from `j`: fill bits `>= j` not written by the same call are cleared, and every page unit from
//! `j` on is recomputed from scratch from the rows still marked filled. Min/max are therefore never stale
//! after a reuse. If the caller writes the cache by other means, the metadata is stale for those rows:
//! rows never written through kvsparse are detected (the forward call fails), overwritten ones are not.
//!
//! Allocated lazily, on the first write to a layer, sized from that cache's `num_blocks`; a later call
//! with a cache of another size fails instead of silently mixing two caches.

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::convert::{load_cache_row, Portable};
use super::quantize::{code_bytes, quantize_row};
pub use super::math::{f16_down, f16_up};
use super::math::{max_num, min_num};
pub use crate::meta::{MetaNeeds, MetaSnapshot};
use crate::error::Result;
use crate::layout::KvCache;
use crate::{alloc, bail, ensure};


/// Metadata of one layer's cache.
pub struct LayerMeta {
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub dim: usize,
    filled: Vec<[u64; 4]>,
    /// Slots per Quest unit and units per block (0 when Quest is off).
    pub unit: usize,
    pub units_per_block: usize,
    /// fp16 bits, rounded down (min) and up (max), so the bound stays a bound at half the bytes.
    qmin: Vec<u16>,
    qmax: Vec<u16>,
    codes: Vec<u8>,
    /// Per row: fp16 bits of (min, scale).
    qparams: Vec<(u16, u16)>,
}

impl LayerMeta {
    /// Sized by the cache (fallibly: the cache's block count comes from the caller).
    fn new(needs: MetaNeeds, cache: &KvCache) -> Result<Self> {
        let (nb, bs, hk, d) = (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim);
        let unit = needs.bounds_page.map_or(0, |p| p.min(bs));
        let upb = if unit > 0 { bs / unit } else { 0 };
        let qn = alloc::checked_product(&[nb, upb, hk, d], "per-page key bound entries")?;
        let rows = if needs.int4 { alloc::checked_product(&[nb, bs, hk], "INT4 key rows")? } else { 0 };
        let code_len = alloc::checked_product(&[rows, code_bytes(d)], "INT4 code bytes")?;
        Ok(LayerMeta {
            num_blocks: nb,
            block_size: bs,
            kv_heads: hk,
            dim: d,
            filled: alloc::try_vec(nb, [0; 4], "the metadata fill mask")?,
            unit,
            units_per_block: upb,
            qmin: alloc::try_vec(qn, F16_POS_INF, "per-page key minima")?,
            qmax: alloc::try_vec(qn, F16_NEG_INF, "per-page key maxima")?,
            codes: alloc::try_vec(code_len, 0, "INT4 key codes")?,
            qparams: alloc::try_vec(rows, (0, 0), "INT4 key scales")?,
        })
    }

    pub fn bytes(&self) -> usize {
        self.filled.len() * 32 + (self.qmin.len() + self.qmax.len()) * 2 + self.codes.len() + self.qparams.len() * 4
    }

    #[inline]
    pub fn is_filled(&self, block: usize, off: usize) -> bool {
        self.filled[block][off / 64] >> (off % 64) & 1 == 1
    }

    fn set_filled(&mut self, block: usize, off: usize) {
        self.filled[block][off / 64] |= 1 << (off % 64);
    }

    fn clear_from(&mut self, block: usize, from: usize) {
        for off in from..self.block_size {
            self.filled[block][off / 64] &= !(1 << (off % 64));
        }
    }

    /// Fails unless every position of `lo..=hi` of a sequence with physical `blocks` was written here.
    pub fn check_covers(&self, blocks: &[u32], lo: usize, hi: usize, what: &str) -> Result<()> {
        let bs = self.block_size;
        // 64 slots per mask word at a time (a per-slot loop cost as much as a tenth of a Quest step at 8K).
        let mut pos = lo;
        while pos <= hi {
            let (b, off) = (blocks[pos / bs] as usize, pos % bs);
            let (w, bit) = (off / 64, off % 64);
            let n = (64 - bit).min(bs - off).min(hi + 1 - pos);
            let want = if n == 64 { u64::MAX } else { ((1u64 << n) - 1) << bit };
            if self.filled[b][w] & want == want {
                pos += n;
                continue;
            }
            let off = off + (!self.filled[b][w] & want).trailing_zeros() as usize - bit;
            let pos = pos - pos % bs + off;
            bail!(
                InvalidArgument,
                "{what} needs key metadata for position {pos} (block {b}, offset {off}), but that slot was never written through kvs_cache_write; a policy that reads key metadata needs every cache write to go through kvsparse"
            );
        }
        Ok(())
    }

    /// Channel-wise (min, max) of the keys of Quest unit `u` of `block` for `head`, as fp16 bits
    /// (min rounded down, max rounded up); +inf / -inf for an empty unit.
    #[inline]
    pub fn unit_minmax(&self, block: usize, u: usize, head: usize) -> (&[u16], &[u16]) {
        let i = ((block * self.units_per_block + u) * self.kv_heads + head) * self.dim;
        (&self.qmin[i..i + self.dim], &self.qmax[i..i + self.dim])
    }

    /// INT4 codes and (min, scale) of the key row (block, off, head).
    #[inline]
    pub fn row_q4(&self, block: usize, off: usize, head: usize) -> (&[u8], f32, f32) {
        let r = (block * self.block_size + off) * self.kv_heads + head;
        let cb = code_bytes(self.dim);
        let (mn, sc) = super::quantize::params_f32(self.qparams[r]);
        (&self.codes[r * cb..(r + 1) * cb], mn, sc)
    }

    /// A copy in the layout the CUDA backend keeps (tests compare the two backends' metadata).
    pub fn snapshot(&self) -> MetaSnapshot {
        let q = self.unit > 0;
        let int4 = self.has_int4();
        MetaSnapshot {
            fill: self.filled.iter().flat_map(|w| w.iter().copied()).collect(),
            qmin: q.then(|| self.qmin.clone()),
            qmax: q.then(|| self.qmax.clone()),
            codes: int4.then(|| self.codes.clone()),
            qparams: int4.then(|| self.qparams.iter().flat_map(|&(a, b)| [a, b]).collect()),
        }
    }

    pub fn has_int4(&self) -> bool {
        !self.qparams.is_empty()
    }

    /// Brings the metadata up to date after `slots` were written into `cache` (already done).
    fn update(&mut self, cache: &KvCache, slots: &[Option<(usize, usize)>]) {
        let mut touched: Vec<(usize, usize)> = slots.iter().flatten().copied().collect();
        touched.sort_unstable();
        touched.dedup();
        let mut row = vec![0f32; self.dim];
        let mut i = 0;
        while i < touched.len() {
            let b = touched[i].0;
            let mut j = i;
            while j < touched.len() && touched[j].0 == b {
                j += 1;
            }
            let first = touched[i].1;
            self.clear_from(b, first);
            for &(_, off) in &touched[i..j] {
                self.set_filled(b, off);
            }
            if self.unit > 0 {
                for u in first / self.unit..self.units_per_block {
                    self.recompute_unit(cache, b, u, &mut row);
                }
            }
            if self.has_int4() {
                let cb = code_bytes(self.dim);
                for &(_, off) in &touched[i..j] {
                    for h in 0..self.kv_heads {
                        // SAFETY: (b, off) are validated slots, h < num_kv_heads.
                        unsafe { load_cache_row::<Portable>(cache.k_row(b, off, h), cache.dtype, cache.k_scale, cache.k_dim_stride(), self.dim, &mut row) };
                        let r = (b * self.block_size + off) * self.kv_heads + h;
                        self.qparams[r] = quantize_row(&row, &mut self.codes[r * cb..(r + 1) * cb]);
                    }
                }
            }
            i = j;
        }
    }

    fn recompute_unit(&mut self, cache: &KvCache, b: usize, u: usize, row: &mut [f32]) {
        let d = self.dim;
        let mut mn = vec![f32::INFINITY; d];
        let mut mx = vec![f32::NEG_INFINITY; d];
        for h in 0..self.kv_heads {
            let i = ((b * self.units_per_block + u) * self.kv_heads + h) * d;
            mn.fill(f32::INFINITY);
            mx.fill(f32::NEG_INFINITY);
            for off in u * self.unit..(u + 1) * self.unit {
                if !self.is_filled(b, off) {
                    continue;
                }
                // SAFETY: b < num_blocks (validated slot), off < block_size, h < num_kv_heads.
                unsafe { load_cache_row::<Portable>(cache.k_row(b, off, h), cache.dtype, cache.k_scale, cache.k_dim_stride(), d, row) };
                for ((a, z), &x) in mn.iter_mut().zip(mx.iter_mut()).zip(row.iter()) {
                    *a = min_num(*a, x);
                    *z = max_num(*z, x);
                }
            }
            for c in 0..d {
                self.qmin[i + c] = f16_down(mn[c]);
                self.qmax[i + c] = f16_up(mx[c]);
            }
        }
    }
}

const F16_POS_INF: u16 = 0x7C00;
const F16_NEG_INF: u16 = 0xFC00;



/// The engine's metadata for all layers.
pub struct CacheMeta {
    pub needs: MetaNeeds,
    layers: Vec<RwLock<Option<LayerMeta>>>,
}

impl CacheMeta {
    pub fn new(needs: MetaNeeds, num_layers: usize) -> Result<Self> {
        let mut layers = alloc::try_with_capacity(num_layers, "per-layer key metadata")?;
        layers.extend((0..num_layers).map(|_| RwLock::new(None)));
        Ok(CacheMeta { needs, layers })
    }

    /// Locks `layer` for a cache write and makes sure its metadata exists and fits `cache`. Call before
    /// writing the cache (so a mismatch changes nothing), then [`finish_write`](Self::finish_write).
    pub fn begin_write(&self, layer: usize, cache: &KvCache) -> Result<Option<RwLockWriteGuard<'_, Option<LayerMeta>>>> {
        if !self.needs.any() {
            return Ok(None);
        }
        let mut g = self.layers[layer].write();
        match &*g {
            Some(m) => ensure!(
                m.num_blocks == cache.num_blocks,
                InvalidShape,
                "layer {layer}'s key metadata was built for a cache of {} blocks, this cache has {}; one engine layer serves one cache",
                m.num_blocks,
                cache.num_blocks
            ),
            None => *g = Some(LayerMeta::new(self.needs, cache)?),
        }
        Ok(Some(g))
    }

    pub fn finish_write(g: &mut RwLockWriteGuard<'_, Option<LayerMeta>>, cache: &KvCache, slots: &[Option<(usize, usize)>]) {
        if let Some(m) = g.as_mut() {
            m.update(cache, slots);
        }
    }

    /// Read access for a forward call.
    pub fn read(&self, layer: usize) -> RwLockReadGuard<'_, Option<LayerMeta>> {
        self.layers[layer].read()
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.read().as_ref().map_or(0, |m| m.bytes())).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn directed_fp16_rounding_brackets_the_value() {
        let mut rng = Rng::new(Rng::fresh_seed());
        for i in 0..100_000 {
            let x = (rng.normal() * [1e-6, 1e-3, 1.0, 100.0, 1e5][i % 5]) as f32;
            let lo = half::f16::from_bits(f16_down(x)).to_f32();
            let hi = half::f16::from_bits(f16_up(x)).to_f32();
            assert!(lo <= x && x <= hi, "{x}: [{lo}, {hi}]");
        }
        assert_eq!(f16_down(f32::INFINITY), F16_POS_INF);
        assert_eq!(f16_up(f32::NEG_INFINITY), F16_NEG_INF);
    }

    #[test]
    fn check_covers_finds_the_first_unwritten_slot_like_a_slot_by_slot_scan() {
        let mut rng = Rng::new(Rng::fresh_seed());
        for bs in [1usize, 2, 16, 64, 128, 256] {
            let nb = 4096 / bs + 3;
            let mut m = LayerMeta { num_blocks: nb, block_size: bs, kv_heads: 1, dim: 8, filled: vec![[0; 4]; nb], unit: 0, units_per_block: 0, qmin: vec![], qmax: vec![], codes: vec![], qparams: vec![] };
            let mut blocks: Vec<u32> = (0..nb as u32).collect();
            rng.shuffle(&mut blocks);
            for b in 0..nb {
                for off in 0..bs {
                    m.set_filled(b, off);
                }
            }
            for trial in 0..200 {
                let len = nb * bs;
                let lo = rng.below(len);
                let hi = lo + rng.below(len - lo);
                // a hole in a third of the trials, somewhere in or near the range
                let hole = (trial % 3 == 0).then(|| (lo + rng.below(hi - lo + 2)).min(len - 1));
                if let Some(p) = hole {
                    m.filled[blocks[p / bs] as usize][p % bs / 64] &= !(1 << (p % 64));
                }
                let want = (lo..=hi).find(|&p| !m.is_filled(blocks[p / bs] as usize, p % bs));
                let got = m.check_covers(&blocks, lo, hi, "t");
                match want {
                    None => assert!(got.is_ok(), "bs {bs} [{lo}, {hi}]"),
                    Some(p) => {
                        let msg = got.expect_err("missing slot must fail").message;
                        assert!(msg.contains(&format!("position {p} (block {}, offset {})", blocks[p / bs], p % bs)), "bs {bs}: {msg}");
                    }
                }
                if let Some(p) = hole {
                    m.set_filled(blocks[p / bs] as usize, p % bs);
                }
            }
        }
    }
}
