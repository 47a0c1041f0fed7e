//! Key metadata on the device (Quest's per-unit key bounds, the INT4 copy of K, the fill mask, SnapKV's
//! kept-slot bits), kept by
//! `kvs_cache_write` in stream order with the semantics of the CPU's `LayerMeta` (see kernels/meta.cu), or
//! for a decode step's few tokens by the write's one launch (`write_step`, kernels/write_step.cu).
//!
//! Allocated per layer on the first cache write that needs it, sized from that cache's `num_blocks`, and
//! initialised to what the CPU starts from (empty bounds: +inf / -inf; no slot filled). A later write or
//! forward call with a cache of another size fails, as on the CPU. Allocation happens outside any graph
//! capture: a first write inside a capture fails with a message asking for a warm-up call.

use parking_lot::Mutex;

use super::context::{DevBuf, Gpu};
use super::driver::{check, cuda, CUstream};
use super::launch::{self, KArgs, Modules};
use crate::cpu::metadata::{MetaNeeds, MetaSnapshot};
use crate::error::Result;
use crate::layout::KvCache;
use crate::tensor::{DType, TensorRef};
use crate::{bail, ensure};

/// One layer's device metadata.
pub struct LayerDevMeta {
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub dim: usize,
    /// Slots per Quest unit and units per block (0 when Quest is off).
    pub unit: usize,
    pub units_per_block: usize,
    pub fill: DevBuf,
    first: DevBuf,
    pub qmin: Option<DevBuf>,
    pub qmax: Option<DevBuf>,
    pub codes: Option<DevBuf>,
    pub qparams: Option<DevBuf>,
    /// SnapKV: one bit per (block, KV head, slot), `[num_blocks][kv_heads][4]` u64 (kernels/snapkv.cu).
    pub keep: Option<DevBuf>,
}

impl LayerDevMeta {
    fn new(needs: MetaNeeds, cache: &KvCache, stream: CUstream) -> Result<Self> {
        let (nb, bs, hk, d) = (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim);
        let unit = needs.bounds_page.map_or(0, |p| p.min(bs));
        let upb = if unit > 0 { bs / unit } else { 0 };
        let api = cuda()?;
        let checked = |a: usize, b: usize| a.checked_mul(b).ok_or_else(|| crate::error::Error::new(crate::error::ErrorKind::OutOfMemory, "metadata size overflows"));
        let fill = DevBuf::alloc(checked(nb, 32)?)?;
        let first = DevBuf::alloc(checked(nb, 4)?)?;
        // SAFETY: each memset covers exactly its buffer.
        unsafe {
            check((api.cuMemsetD8Async)(fill.ptr, 0, nb * 32, stream), "cuMemsetD8Async")?;
            check((api.cuMemsetD8Async)(first.ptr, 0, nb * 4, stream), "cuMemsetD8Async")?;
        }
        let (mut qmin, mut qmax, mut codes, mut qparams) = (None, None, None, None);
        if unit > 0 {
            let n = checked(checked(nb, upb * hk)?, d)?;
            let (a, b) = (DevBuf::alloc(checked(n, 2)?)?, DevBuf::alloc(checked(n, 2)?)?);
            // SAFETY: n 16-bit elements each.
            unsafe {
                check((api.cuMemsetD16Async)(a.ptr, 0x7C00, n, stream), "cuMemsetD16Async")?;
                check((api.cuMemsetD16Async)(b.ptr, 0xFC00, n, stream), "cuMemsetD16Async")?;
            }
            qmin = Some(a);
            qmax = Some(b);
        }
        if needs.int4 {
            let rows = checked(checked(nb, bs)?, hk)?;
            let (c, p) = (DevBuf::alloc(checked(rows, d / 2)?)?, DevBuf::alloc(checked(rows, 4)?)?);
            // SAFETY: as above.
            unsafe {
                check((api.cuMemsetD8Async)(c.ptr, 0, rows * (d / 2), stream), "cuMemsetD8Async")?;
                check((api.cuMemsetD8Async)(p.ptr, 0, rows * 4, stream), "cuMemsetD8Async")?;
            }
            codes = Some(c);
            qparams = Some(p);
        }
        let mut keep = None;
        if needs.keep_bits {
            // Every slot starts kept: a sequence whose prefill SnapKV never saw attends everything (as on
            // the CPU); a write sets its slot's bit, SnapKV's choice rewrites the bits below its length.
            let n = checked(checked(nb, hk)?, 32)?;
            let k = DevBuf::alloc(n)?;
            // SAFETY: n bytes.
            unsafe { check((api.cuMemsetD8Async)(k.ptr, 0xFF, n, stream), "cuMemsetD8Async")? };
            keep = Some(k);
        }
        Ok(LayerDevMeta { num_blocks: nb, block_size: bs, kv_heads: hk, dim: d, unit, units_per_block: upb, fill, first, qmin, qmax, codes, qparams, keep })
    }

    pub fn bytes(&self) -> usize {
        [Some(&self.fill), Some(&self.first), self.qmin.as_ref(), self.qmax.as_ref(), self.codes.as_ref(), self.qparams.as_ref(), self.keep.as_ref()].iter().flatten().map(|b| b.bytes).sum()
    }

    /// Downloads everything (synchronous; tests compare it with the CPU's metadata).
    pub fn download(&self) -> Result<MetaSnapshot> {
        let get = |b: &DevBuf| -> Result<Vec<u8>> {
            let mut v = vec![0u8; b.bytes];
            b.download(0, &mut v)?;
            Ok(v)
        };
        let u16s = |v: Vec<u8>| v.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect::<Vec<u16>>();
        // The device keeps each unit's bounds in lane order (kernels/meta.cu); back to channel order.
        let d = self.dim;
        let unlane = |v: Vec<u16>| -> Vec<u16> {
            let mut out = vec![0u16; v.len()];
            for (src, dst) in v.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
                for c in 0..d {
                    dst[c] = src[(c % 16) * (d / 16) + c / 16];
                }
            }
            out
        };
        let fill = get(&self.fill)?.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        Ok(MetaSnapshot {
            fill,
            qmin: self.qmin.as_ref().map(get).transpose()?.map(u16s).map(unlane),
            qmax: self.qmax.as_ref().map(get).transpose()?.map(u16s).map(unlane),
            codes: self.codes.as_ref().map(get).transpose()?,
            qparams: self.qparams.as_ref().map(get).transpose()?.map(u16s),
        })
    }
}

/// The engine's device metadata, one slot per layer.
pub struct DeviceMeta {
    pub needs: MetaNeeds,
    layers: Vec<Mutex<Option<LayerDevMeta>>>,
}

impl DeviceMeta {
    pub fn new(needs: MetaNeeds, num_layers: usize) -> Self {
        DeviceMeta { needs, layers: (0..num_layers).map(|_| Mutex::new(None)).collect() }
    }

    pub fn layer(&self, layer: usize) -> parking_lot::MutexGuard<'_, Option<LayerDevMeta>> {
        self.layers[layer].lock()
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.lock().as_ref().map_or(0, |m| m.bytes())).sum()
    }

    /// Layer `layer`'s metadata for a write into `cache`, allocated on first use (outside a capture only);
    /// None when the policy needs none. Fails when the cache does not fit it.
    pub fn prepare(&self, gpu: &Gpu, layer: usize, cache: &KvCache, stream: CUstream) -> Result<Option<parking_lot::MutexGuard<'_, Option<LayerDevMeta>>>> {
        if !self.needs.any() {
            return Ok(None);
        }
        ensure!(cache.k_dim_stride() == 1, Unsupported, "policy key metadata on the CUDA backend needs a key cache whose head_dim stride is 1 (got {})", cache.k_dim_stride());
        let mut g = self.layers[layer].lock();
        match &*g {
            Some(m) => ensure!(
                m.num_blocks == cache.num_blocks,
                InvalidShape,
                "layer {layer}'s key metadata was built for a cache of {} blocks, this cache has {}; one engine layer serves one cache",
                m.num_blocks,
                cache.num_blocks
            ),
            None => {
                if gpu.is_capturing(stream)? {
                    bail!(InvalidArgument, "layer {layer}'s key metadata would be allocated inside a CUDA graph capture; write the cache of every layer once before capturing");
                }
                *g = Some(LayerDevMeta::new(self.needs, cache, stream)?);
            }
        }
        Ok(Some(g))
    }

    /// Brings layer `layer`'s metadata up to date after the rows of `slot_mapping` were written into
    /// `cache` (same stream, already enqueued) by a call of many tokens (a decode step's few are kept by
    /// `write_step`'s one launch). Allocates the layer's metadata on first use.
    #[allow(clippy::too_many_arguments)]
    pub fn update(&self, gpu: &Gpu, modules: &Modules, layer: usize, cache: &KvCache, slot_mapping: &TensorRef, n: usize, stream: CUstream) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let Some(g) = self.prepare(gpu, layer, cache, stream)? else { return Ok(()) };
        let m = g.as_ref().expect("set above");
        // An FP8 key cache is read as bytes (KV8) and scaled by k_scale, as the CPU reads it; the module's
        // element type is then unused (f16).
        let elem = if cache.dtype.is_fp8() { DType::F16 } else { cache.dtype };
        let defines = vec![format!("KVS_DTYPE={}", super::batch::dtype_code(elem)), format!("KV8={}", super::batch::kv8_code(cache.dtype)), "--fmad=false".to_string()];
        let kscale = if cache.dtype.is_fp8() { cache.k_scale } else { 1.0 };
        let f = |name: &'static str| modules.function(gpu, "meta", launch::META, &defines, name);
        let (bs, hk, d) = (m.block_size as i32, m.kv_heads as i32, m.dim as i32);
        let slots = |k: &mut KArgs| {
            k.ptr(slot_mapping.data).i64(slot_mapping.stride(0) as i64).i32((slot_mapping.dtype == DType::I64) as i32);
            k.i32(n as i32).i64(m.num_blocks as i64).i32(bs);
        };
        let grid = (n.div_ceil(256).min(4096) as u32, 1, 1);
        // Only SnapKV's bits (no Quest bounds, no INT4 copy): nothing on the device reads the fill mask's
        // cleared tail, so one launch (set) instead of four.
        let bits_only = m.unit == 0 && m.codes.is_none();
        let kc = &cache.k;
        if !bits_only {
            let mut k = KArgs::new();
            slots(&mut k);
            k.i64(m.first.ptr as i64);
            launch::launch(f("kvs_meta_mark")?, grid, 256, &mut k, stream, "kvs_meta_mark launch")?;
            let mut k = KArgs::new();
            slots(&mut k);
            k.i64(m.first.ptr as i64).i64(m.fill.ptr as i64);
            launch::launch(f("kvs_meta_clear")?, grid, 256, &mut k, stream, "kvs_meta_clear launch")?;
        }
        let mut k = KArgs::new();
        slots(&mut k);
        k.i64(m.fill.ptr as i64).ptr(kc.data).i64(kc.stride(0) as i64).i64(kc.stride(1) as i64).i64(kc.stride(2) as i64).i32(hk).i32(d);
        k.i64(m.codes.as_ref().map_or(0, |b| b.ptr) as i64).i64(m.qparams.as_ref().map_or(0, |b| b.ptr) as i64).i64(m.keep.as_ref().map_or(0, |b| b.ptr) as i64);
        k.f32(kscale);
        let rows = n * m.kv_heads;
        launch::launch(f("kvs_meta_set")?, (rows.div_ceil(128).min(65536) as u32, 1, 1), 128, &mut k, stream, "kvs_meta_set launch")?;
        if bits_only {
            return Ok(());
        }
        let mut k = KArgs::new();
        slots(&mut k);
        k.i64(m.first.ptr as i64).i64(m.fill.ptr as i64).ptr(kc.data).i64(kc.stride(0) as i64).i64(kc.stride(1) as i64).i64(kc.stride(2) as i64).i32(hk).i32(d);
        k.i32(m.unit as i32).i32(m.units_per_block as i32).i64(m.qmin.as_ref().map_or(0, |b| b.ptr) as i64).i64(m.qmax.as_ref().map_or(0, |b| b.ptr) as i64);
        k.f32(kscale);
        launch::launch(f("kvs_meta_units")?, (n.min(65536) as u32, 1, 1), 256, &mut k, stream, "kvs_meta_units launch")
    }
}
