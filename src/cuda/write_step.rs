//! A cache write of few tokens (a decode step) in one launch: `kvs_write_step` (kernels/write_step.cu)
//! checks every slot, stores the rows and keeps the key metadata, where the general path of
//! `CudaBackend::cache_write` takes two launches (slot check, store) plus up to four for the metadata. At
//! batch 1 a decode step's write is bound by the host's launches, so this path also keeps the host's work
//! per call small: the kernel is looked up once per engine, no define strings are built per call.

use super::batch::{dtype_code, kv8_code};
use super::checks::clean_view;
use super::launch::{self, KArgs};
use super::backend::WRITE_STEP_MAX_TOKENS;
use super::CudaBackend;
use crate::args::CacheWriteArgs;
use crate::config::EngineConfig;
use crate::error::Result;
use crate::layout::KvCache;
use crate::tensor::{DType, TensorRef};

impl CudaBackend {
    /// Writes the `n` (1..=WRITE_STEP_MAX_TOKENS) rows of `a` and keeps the layer's key metadata in one
    /// launch; returns the checked slots (the layer's clean buffer) for the policy's write hook.
    pub(crate) fn write_step(&self, cfg: &EngineConfig, a: &CacheWriteArgs, cache: &KvCache, n: usize) -> Result<TensorRef> {
        debug_assert!((1..=WRITE_STEP_MAX_TOKENS).contains(&n));
        let f = self.write_step_fn(cfg, cache)?;
        let clean = self.checks.clean_buffer(&self.gpu, a.layer, n, a.stream)?;
        let meta = self.meta.prepare(&self.gpu, a.layer, cache, a.stream)?;
        let m = meta.as_ref().and_then(|g| g.as_ref());
        let ptr = |b: Option<&super::context::DevBuf>| b.map_or(0, |b| b.ptr) as i64;
        let mut k = KArgs::new();
        for t in [&a.key, &a.value] {
            k.ptr(t.data).i64(t.stride(0) as i64).i64(t.stride(1) as i64).i64(t.stride(2) as i64);
        }
        for t in [&cache.k, &cache.v] {
            k.ptr(t.data);
            for i in 0..4 {
                k.i64(t.stride(i) as i64);
            }
        }
        let sm = &a.slot_mapping;
        k.ptr(sm.data).i64(sm.stride(0) as i64).i32((sm.dtype == DType::I64) as i32).i32(n as i32);
        k.i32(cfg.num_kv_heads as i32).i32(cfg.head_dim as i32).i64(cache.num_blocks as i64).i32(cfg.block_size as i32);
        let fp8 = cache.dtype.is_fp8();
        k.f32(if fp8 { cache.k_scale } else { 1.0 }).f32(if fp8 { cache.v_scale } else { 1.0 });
        k.i64(clean as i64).i64(self.checks.record_ptr() as i64);
        k.i64(ptr(m.map(|m| &m.fill))).i32(m.map_or(0, |m| m.unit as i32)).i32(m.map_or(0, |m| m.units_per_block as i32));
        k.i64(ptr(m.and_then(|m| m.qmin.as_ref()))).i64(ptr(m.and_then(|m| m.qmax.as_ref())));
        k.i64(ptr(m.and_then(|m| m.codes.as_ref()))).i64(ptr(m.and_then(|m| m.qparams.as_ref()))).i64(ptr(m.and_then(|m| m.keep.as_ref())));
        // A thread per element of a token's rows (up to 1024), whole warps (the INT4 copy is a warp per row).
        let threads = (cfg.num_kv_heads * cfg.head_dim).next_multiple_of(32).min(1024) as u32;
        launch::launch(f, (n as u32, 1, 1), threads, &mut k, a.stream, "kvs_write_step launch")?;
        drop(meta);
        clean_view(clean, n, sm.device)
    }

    fn write_step_fn(&self, cfg: &EngineConfig, cache: &KvCache) -> Result<super::driver::CUfunction> {
        if let Some(&f) = self.write_step.get() {
            return Ok(f as super::driver::CUfunction);
        }
        let defines = [format!("KVS_DTYPE={}", dtype_code(cfg.dtype)), format!("KV8={}", kv8_code(cache.dtype)), "--fmad=false".to_string()];
        let f = self.modules.function(&self.gpu, "write_step", launch::WRITE_STEP, &defines, "kvs_write_step")?;
        let _ = self.write_step.set(f as usize);
        Ok(f)
    }
}
