//! Prefill rows (query length != 1) on the tensor-core prefill kernel (kernels/attention_prefill.cu): its
//! shape, its split planning and its launch. A call that may hold prefill rows (`max_query_len != 1`)
//! runs the decode kernel over its decode rows and this kernel over the others; a decode-only call
//! (`max_query_len == 1`, what serving engines capture in CUDA graphs) runs the decode kernel alone, as
//! before. Why: the decode kernel runs one CTA per query token, so a prompt's K/V is read once per token;
//! here a CTA serves up to 128 query rows (tokens x the GQA group's heads) per K/V tile.

use super::backend::{batch_args, lse_arg, p, CudaBackend};
use super::batch::Geometry;
use super::launch;
use crate::config::EngineConfig;
use crate::args::ForwardArgs;
use crate::error::Result;
use crate::layout::KvCache;

/// Fewest key positions per split (a split's pipeline fill and epilogue are paid once per split).
const MIN_SPLIT_KEYS: usize = 2048;
/// Most splits of a prefill launch (the workspace holds `tokens * heads * splits` partial rows).
const MAX_SPLITS: usize = 16;

/// Compile-time shape of the prefill kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillShape {
    /// Query heads per CTA: the largest power of two dividing the GQA group, at most 16.
    pub gq: usize,
    pub warps: usize,
    /// 16-row blocks per warp (each ldmatrix of K or V feeds 2 * mw MMAs).
    pub mw: usize,
    /// Keys per shared-memory tile.
    pub bn: usize,
    pub stages: usize,
}

impl PrefillShape {
    /// Query rows per CTA.
    pub fn rows(&self) -> usize {
        16 * self.warps * self.mw
    }
    /// Query tokens per CTA.
    pub fn tokens(&self) -> usize {
        self.rows() / self.gq
    }
    /// Dynamic shared memory, bytes (PF_SMEM_BYTES in the kernel).
    pub fn smem_bytes(&self, head_dim: usize) -> usize {
        let row = head_dim * 2 + 16;
        self.rows() * row + self.stages * 2 * self.bn * row
    }
    /// The kernel's compile-time definitions for a cache type (batch::dtype_code), head size and group.
    pub fn defines_for(&self, dtype_code: i32, head_dim: usize, group: usize) -> Vec<String> {
        vec![
            format!("KVS_DTYPE={dtype_code}"),
            format!("HEAD_DIM={head_dim}"),
            format!("GQ={}", self.gq),
            format!("GROUP={group}"),
            format!("NWARPS={}", self.warps),
            format!("MW={}", self.mw),
            format!("BN={}", self.bn),
            format!("NSTAGE={}", self.stages),
        ]
    }
}

/// The prefill kernel's shape when it applies: f16/bf16 caches with 16-byte aligned rows and strides, a
/// head size that is a multiple of 16 up to 256, and its shared memory within `smem_max`. None = the
/// decode kernel serves prefill rows too (f32 caches, other head sizes).
pub fn prefill_shape(group: usize, head_dim: usize, elem_bytes: usize, aligned16: bool, smem_max: usize) -> Option<PrefillShape> {
    if elem_bytes != 2 || !aligned16 || head_dim % 16 != 0 || head_dim == 0 || head_dim > 256 || group == 0 {
        return None;
    }
    let gq = 1usize << group.trailing_zeros().min(4);
    // Head sizes up to 128: 4 warps of 32 rows (128 rows), 32-key tiles, three stages (87 KiB at 128, two
    // CTAs per SM; the fastest of five shapes on an H200, docs/perf.md). Larger heads: 4 warps of 16 rows
    // and two stages (the accumulators take the registers).
    let s = if head_dim <= 128 { PrefillShape { gq, warps: 4, mw: 2, bn: 32, stages: 3 } } else { PrefillShape { gq, warps: 4, mw: 1, bn: 32, stages: 2 } };
    (s.smem_bytes(head_dim) <= smem_max).then_some(s)
}

/// (splits, keys per split) of a launch of `ctas` CTAs per split over rows of at most `max_len` keys,
/// on a device with `slots` resident CTAs: one split when the CTAs fill the device, else enough splits
/// of at least MIN_SPLIT_KEYS keys (a multiple of `bn`) for about two waves.
pub fn prefill_splits(ctas: usize, max_len: usize, slots: usize, bn: usize) -> (usize, usize) {
    let max_len = max_len.max(1);
    if ctas >= slots || max_len < 2 * MIN_SPLIT_KEYS {
        return (1, max_len);
    }
    let want = (2 * slots).div_ceil(ctas.max(1)).min(max_len / MIN_SPLIT_KEYS).clamp(1, MAX_SPLITS);
    let chunk = max_len.div_ceil(want).next_multiple_of(bn);
    (max_len.div_ceil(chunk), chunk)
}

impl CudaBackend {
    /// The prefill kernel's shape for this engine and cache, if it applies (`KVS_CUDA_KERNEL=simt` or
    /// `KVS_CUDA_PREFILL=decode` keep prefill rows on the decode kernels).
    pub(crate) fn prefill_kernel(&self, cfg: &EngineConfig, aligned: bool) -> Option<PrefillShape> {
        if std::env::var("KVS_CUDA_KERNEL").is_ok_and(|v| v == "simt") || std::env::var("KVS_CUDA_PREFILL").is_ok_and(|v| v == "decode") {
            return None;
        }
        let s = prefill_shape(cfg.group_size(), cfg.head_dim, cfg.dtype.size_bytes(), aligned, (self.gpu.smem_optin as usize).saturating_sub(2048))?;
        // Experiments: KVS_PREFILL_WARPS / _MW / _BN / _STAGES override the shape (kept when it fits).
        let get = |k: &str, d: usize, ok: &dyn Fn(usize) -> bool| std::env::var(k).ok().and_then(|v| v.parse().ok()).filter(|&v| ok(v)).unwrap_or(d);
        let t = PrefillShape {
            warps: get("KVS_PREFILL_WARPS", s.warps, &|v| [1, 2, 4, 8].contains(&v)),
            mw: get("KVS_PREFILL_MW", s.mw, &|v| v == 1 || v == 2),
            bn: get("KVS_PREFILL_BN", s.bn, &|v| [16, 32, 64, 128].contains(&v)),
            stages: get("KVS_PREFILL_STAGES", s.stages, &|v| (2..=4).contains(&v)),
            ..s
        };
        Some(if t.smem_bytes(cfg.head_dim) + 2048 <= self.gpu.smem_optin as usize { t } else { s })
    }

    /// Launches the prefill kernel over the call's rows of query length != 1 (and its split combine).
    pub(crate) fn attend_prefill(&self, cfg: &EngineConfig, a: &ForwardArgs, cache: &KvCache, geo: &Geometry, ps: &PrefillShape) -> Result<()> {
        let mut defines = ps.defines_for(super::batch::dtype_code(cfg.dtype), cfg.head_dim, cfg.group_size());
        defines.push(self.checks_define.clone());
        let fp8 = cache.dtype.is_fp8();
        if fp8 {
            defines.push(format!("KV8={}", super::batch::kv8_code(cache.dtype)));
        }
        let f = self.modules.function(&self.gpu, "attention_prefill", launch::ATTENTION_PREFILL, &defines, "kvs_attn_prefill")?;
        let smem = ps.smem_bytes(cfg.head_dim);
        let threads = 32 * ps.warps as u32;
        self.allow_smem_once(f, smem)?;
        let per_sm = launch::occupancy_smem(f, threads, smem)? as usize;
        let tiles = geo.num_tokens.div_ceil(ps.tokens());
        let head_groups = cfg.num_q_heads / ps.gq;
        let (nsplit, chunk) = prefill_splits(tiles * head_groups, geo.max_len, per_sm.max(1) * self.gpu.num_sms as usize, ps.bn);
        let stream = a.stream;
        let (mut ws_o, mut ws_lse) = (0u64, 0u64);
        let mut ws_guard = None;
        if nsplit > 1 {
            let slots = geo.num_tokens * cfg.num_q_heads * nsplit;
            let mut map = self.workspaces.lock();
            ws_o = super::workspace::for_stream(&mut map, &self.retired, &self.gpu, stream, slots * (cfg.head_dim + 1) * 4, "split-KV")?;
            ws_lse = ws_o + (slots * cfg.head_dim * 4) as u64;
            ws_guard = Some(map);
        }
        let (lse_ptr, l0, l1) = lse_arg(a);
        let mut k = batch_args(cfg, a, cache, geo);
        k.i32(geo.num_tokens as i32);
        k.f32(a.scale).f32(a.softcap).i32(a.sliding_window).i32(chunk.min(i32::MAX as usize) as i32);
        k.ptr(p(&a.out)).i64(a.out.stride(0) as i64).i64(a.out.stride(1) as i64).i64(a.out.stride(2) as i64);
        k.ptr(lse_ptr).i64(l0).i64(l1);
        k.i64(ws_o as i64).i64(ws_lse as i64).i32(cfg.num_q_heads as i32);
        k.i64(self.checks.record_ptr() as i64);
        if fp8 {
            k.f32(cache.k_scale).f32(cache.v_scale);
        }
        launch::launch_smem(f, (tiles as u32, head_groups as u32, nsplit as u32), threads, smem as u32, &mut k, stream, "kvs_attn_prefill launch")?;
        if nsplit > 1 {
            self.combine_splits(cfg, a, geo, &defines, (ws_o, ws_lse), nsplit, 2, ("attention_prefill", launch::ATTENTION_PREFILL), false)?;
        }
        drop(ws_guard);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_cover_the_supported_heads_and_fit_two_ctas_per_sm_at_128() {
        let h100 = 227 * 1024 - 2048;
        let s = prefill_shape(4, 128, 2, true, h100).unwrap();
        assert_eq!((s.gq, s.rows(), s.tokens()), (4, 128, 32));
        assert!(2 * s.smem_bytes(128) <= 227 * 1024);
        assert_eq!(prefill_shape(8, 64, 2, true, h100).unwrap().tokens(), 16);
        assert_eq!(prefill_shape(1, 256, 2, true, h100).unwrap().tokens(), 64);
        assert_eq!(prefill_shape(6, 128, 2, true, h100).unwrap().gq, 2);
        assert_eq!(prefill_shape(32, 128, 2, true, h100).unwrap().gq, 16);
        assert!(prefill_shape(4, 128, 4, true, h100).is_none(), "f32 caches stay on the decode kernels");
        assert!(prefill_shape(4, 72, 2, true, h100).is_none());
        assert!(prefill_shape(4, 128, 2, false, h100).is_none());
        assert!(prefill_shape(4, 512, 2, true, h100).is_none());
        assert!(prefill_shape(4, 256, 2, true, 64 * 1024).is_none());
    }

    #[test]
    fn splits_only_when_the_tiles_leave_the_device_idle() {
        // A 32K prompt (1024 tiles x 8 head groups) fills 264 slots: one split.
        assert_eq!(prefill_splits(8192, 32768, 264, 64), (1, 32768));
        // A 512-token chunk over a 32K prefix: 16 tiles x 8 groups = 128 CTAs -> 5 splits of 6592 keys.
        let (n, c) = prefill_splits(128, 32768, 264, 64);
        assert_eq!((n, c), (5, 6592));
        assert!(n * c >= 32768 && c % 64 == 0 && (n - 1) * c < 32768);
        // Short sequences are never split; splits stay within MAX_SPLITS.
        assert_eq!(prefill_splits(4, 3000, 264, 64).0, 1);
        assert_eq!(prefill_splits(1, 1 << 20, 264, 64).0, MAX_SPLITS);
    }
}
