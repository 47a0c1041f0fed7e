//! How one attention call is cut into CTAs: query heads per CTA, keys per lane-group batch, and the
//! number of KV splits (flash-decoding). Pure arithmetic, so it is unit-tested without a GPU.
//!
//! Splits: a decode batch has few (token, head-group) rows, often fewer than the GPU has CTA slots, and
//! one CTA per row would leave most of the memory system idle. We cut each row's keys into splits of at
//! least `min_chunk` positions until the grid holds about `waves` full waves of CTAs; many short splits
//! keep the last wave's tail small. Rows that already fill `waves / 2` waves get one split (no workspace,
//! no combine pass). That is the lane-group kernel's planner (`splits`); the tensor-core kernel uses a wave
//! model instead (`splits_waves`), which keeps full single waves unsplit. The partial results cost `rows * GQ * splits * (head_dim + 1) * 4` bytes of workspace,
//! under 1% of the KV bytes for every grid point of the benchmark.

/// Tunables (overridable with `KVS_CUDA_WAVES` / `KVS_CUDA_MIN_CHUNK` / `KVS_CUDA_MAX_SPLITS` /
/// `KVS_CUDA_CTA_COST` for experiments).
#[derive(Clone, Copy, Debug)]
pub struct SplitPolicy {
    pub waves: usize,
    pub min_chunk: usize,
    /// Upper bound on splits: the combine pass walks the splits of a head serially, and on the H100 64
    /// splits of 2048 keys beat 256 of 512 at batch 1 x 128K (75.7% vs 60.9% of copy bandwidth).
    pub max_splits: usize,
    /// Tensor-core planner: fixed cost of one CTA (pipeline fill, epilogue, its share of the combine)
    /// in key positions; see `splits_waves`.
    pub cta_cost: usize,
}

impl SplitPolicy {
    pub fn from_env() -> Self {
        let get = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).filter(|&v| v > 0).unwrap_or(d);
        SplitPolicy { waves: get("KVS_CUDA_WAVES", 8), min_chunk: get("KVS_CUDA_MIN_CHUNK", 512), max_splits: get("KVS_CUDA_MAX_SPLITS", 64), cta_cost: get("KVS_CUDA_CTA_COST", 256) }
    }
}

/// Compile-time shape of the attention kernel variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelShape {
    /// Query heads handled by one CTA (a divisor of the GQA group, at most 8).
    pub gq: usize,
    /// Keys each lane group loads before using any.
    pub kb: usize,
    /// Bytes per vector load (16, or the element size when the cache is not 16-byte aligned).
    pub load_bytes: usize,
    /// Lane groups per CTA (4 warps of 32 lanes / lanes per key).
    pub lane_groups: usize,
}

pub fn kernel_shape(group: usize, head_dim: usize, elem_bytes: usize, aligned16: bool) -> KernelShape {
    let gq = (1..=group.min(8)).rev().find(|d| group % d == 0).unwrap_or(1);
    let load_bytes = if aligned16 { 16 } else { elem_bytes };
    let vec = load_bytes / elem_bytes;
    let nvec = head_dim / vec;
    let nv = nvec.div_ceil(32);
    let lanes = nvec.div_ceil(nv).next_power_of_two();
    let kb = (32 / (nv * gq.max(4))).clamp(2, 8);
    KernelShape { gq, kb, load_bytes, lane_groups: 4 * (32 / lanes) }
}

/// Shape of the tensor-core kernel (kernels/attention_mma.cu): query heads per CTA (the m16 tile rows),
/// warps per CTA and shared-memory stages per warp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaShape {
    pub gq: usize,
    pub warps: usize,
    pub stages: usize,
    /// L2 prefetch-size hint of the copies in bytes (0 = none).
    pub l2_hint: usize,
    /// Bytes of one cached element in the stages: 2, or 1 for an FP8 cache (its rows are staged as bytes
    /// and widened in registers, kernels/attention_mma.cu).
    pub kv_bytes: usize,
}

impl MmaShape {
    /// Dynamic shared memory of the kernel, bytes (same formula as SMEM_BYTES in the kernel).
    pub fn smem_bytes(&self, head_dim: usize) -> usize {
        // A staged row, padded (FP8: to a multiple of 128 bytes, against bank conflicts), plus 16 bytes.
        let row = if self.kv_bytes == 1 { head_dim.div_ceil(128) * 128 } else { head_dim * 2 } + 16;
        let stage = self.warps * self.stages * 2 * 16 * row;
        let merge = self.warps * self.gq * (head_dim + 2) * 4;
        stage.max(merge)
    }
    /// Keys per CTA tile round (every warp one 16-key tile).
    pub fn tile(&self) -> usize {
        16 * self.warps
    }
}

/// The tensor-core variant when it applies: f16/bf16 caches with 16-byte aligned rows, head_dim a
/// multiple of 16, and a GQA group of at most 16 query heads (or a multiple of 16). None = use the
/// lane-group kernel.
/// Stages, then warps, shrink until the shared memory fits `smem_max` bytes (the device's opt-in limit
/// less the kernel's static shared memory).
/// `kv_bytes`: 1 for an FP8 cache (staged as bytes), else 2.
pub fn mma_shape(group: usize, head_dim: usize, elem_bytes: usize, kv_bytes: usize, aligned16: bool, tun: &MmaTunables, smem_max: usize) -> Option<MmaShape> {
    if !tun.enabled || elem_bytes != 2 || !aligned16 || head_dim % 16 != 0 {
        return None;
    }
    let gq = if group <= 16 { group } else if group % 16 == 0 { 16 } else { return None };
    let mut s = MmaShape { gq, warps: tun.warps, stages: tun.stages, l2_hint: tun.l2_hint, kv_bytes };
    while s.smem_bytes(head_dim) > smem_max {
        if s.stages > 2 {
            s.stages -= 1;
        } else if s.warps > 1 {
            s.warps /= 2;
        } else {
            return None;
        }
    }
    Some(s)
}

/// Default shape of the tensor-core kernel: 6 warps of 2 stages (17 KiB of shared memory per warp at head
/// size 128, two CTAs and 12 warps per SM). Read bandwidth follows the warps resident per SM, not the
/// stages per warp: on an H200 (2026-11-26, docs/perf.md) 6x2 read 3-4% faster than 4x3 (8 warps per SM)
/// at every batch x context point of the bench, and 4x4 / 4x6 (one CTA, 4 warps) 20% slower.
pub const DEFAULT_WARPS: usize = 6;
pub const DEFAULT_STAGES: usize = 2;

/// Tensor-core kernel switches: `KVS_CUDA_KERNEL=simt` forces the lane-group kernel everywhere;
/// `KVS_MMA_WARPS` / `KVS_MMA_STAGES` override warps per CTA and stages per warp (experiments);
/// `KVS_CUDA_ROW_SPLIT=0` splits dense rows at the plan's fixed chunks instead of each row's own span
/// (the behaviour before 2026-11-26, kept to measure the difference).
#[derive(Clone, Copy, Debug)]
pub struct MmaTunables {
    pub enabled: bool,
    pub warps: usize,
    pub stages: usize,
    pub l2_hint: usize,
    /// Dense rows cut their own visible span into the grid's splits (kernels/attention_mma.cu, ROW_SPLIT).
    pub row_split: bool,
}

impl MmaTunables {
    pub fn from_env() -> Self {
        let get = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).filter(|&v| v > 0).unwrap_or(d);
        MmaTunables {
            enabled: std::env::var("KVS_CUDA_KERNEL").map(|v| v != "simt").unwrap_or(true),
            warps: get("KVS_MMA_WARPS", DEFAULT_WARPS).clamp(1, 16),
            stages: get("KVS_MMA_STAGES", DEFAULT_STAGES).clamp(2, 8),
            l2_hint: match std::env::var("KVS_MMA_L2").ok().and_then(|v| v.parse().ok()) { Some(v @ (0 | 64 | 128 | 256)) => v, _ => 128 },
            row_split: std::env::var("KVS_CUDA_ROW_SPLIT").map(|v| v != "0").unwrap_or(true),
        }
    }
}

/// Number of splits and positions per split for `rows` CTA rows over at most `max_len` keys.
pub fn splits(rows: usize, max_len: usize, ctas_per_wave: usize, shape: &KernelShape, pol: &SplitPolicy) -> (usize, usize) {
    splits_tile(rows, max_len, ctas_per_wave, shape.lane_groups * shape.kb, pol)
}

/// As `splits`, with chunks a multiple of `tile` keys.
pub fn splits_tile(rows: usize, max_len: usize, ctas_per_wave: usize, tile: usize, pol: &SplitPolicy) -> (usize, usize) {
    let want = pol.waves * ctas_per_wave.max(1);
    if rows == 0 || max_len == 0 || rows * 2 >= want {
        return (1, max_len.max(1).next_multiple_of(tile));
    }
    let by_len = max_len.div_ceil(pol.min_chunk.max(tile)).max(1);
    let n = want.div_ceil(rows).min(by_len).min(pol.max_splits).clamp(1, 65535);
    let chunk = max_len.div_ceil(n).next_multiple_of(tile);
    (max_len.div_ceil(chunk), chunk)
}

/// Split count for the tensor-core kernel, chosen by a wave model instead of a fixed wave target: with
/// `slots` CTAs resident at once, `n` splits of `rows` rows take about ceil(rows*n/slots) waves of
/// (len/n + cta_cost) key positions each. The smallest n with the least modelled time wins, within
/// chunks of at least `min_chunk` and at most `max_splits` splits. Measured on the H100 (batch 32 x 16K,
/// 256 rows on 264 slots): 1 split 94.8% of copy bandwidth vs 92.5% with 9 splits (8-wave target);
/// batch 1 x 128K: 33 splits 88.4% vs 85.6% with 64.
pub fn splits_waves(rows: usize, max_len: usize, slots: usize, tile: usize, pol: &SplitPolicy) -> (usize, usize) {
    let slots = slots.max(1);
    if rows == 0 || max_len == 0 {
        return (1, max_len.max(1).next_multiple_of(tile));
    }
    let by_len = max_len.div_ceil(pol.min_chunk.max(tile)).max(1);
    let top = by_len.min(pol.max_splits).clamp(1, 65535);
    let mut best = (u128::MAX, 1usize);
    for n in 1..=top {
        let chunk = max_len.div_ceil(n).next_multiple_of(tile);
        let n_eff = max_len.div_ceil(chunk);
        let waves = (rows * n_eff).div_ceil(slots) as u128;
        let cost = waves * (chunk + pol.cta_cost) as u128;
        if cost < best.0 {
            best = (cost, n);
        }
    }
    let chunk = max_len.div_ceil(best.1).next_multiple_of(tile);
    (max_len.div_ceil(chunk), chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_fit_registers_and_lanes() {
        let s = kernel_shape(4, 128, 2, true);
        assert_eq!((s.gq, s.kb, s.lane_groups), (4, 8, 8));
        let s = kernel_shape(8, 128, 2, true);
        assert_eq!((s.gq, s.kb), (8, 4));
        let s = kernel_shape(16, 256, 4, true);
        assert_eq!((s.gq, s.kb, s.lane_groups), (8, 2, 4));
        let s = kernel_shape(6, 80, 2, false);
        assert_eq!((s.gq, s.load_bytes), (6, 2));
    }

    #[test]
    fn splits_cover_the_longest_row() {
        let pol = SplitPolicy { waves: 8, min_chunk: 512, max_splits: 64, cta_cost: 256 };
        let sh = kernel_shape(4, 128, 2, true);
        for &(rows, len) in &[(8usize, 131072usize), (256, 16384), (1024, 1024), (8, 1), (100000, 50)] {
            let (n, chunk) = splits(rows, len, 396, &sh, &pol);
            assert!(n >= 1 && n * chunk >= len, "{rows} {len}: {n} x {chunk}");
            assert!((n - 1) * chunk < len.max(1), "no empty trailing split");
            assert_eq!(chunk % (sh.lane_groups * sh.kb), 0);
        }
        assert_eq!(splits(100000, 4096, 396, &sh, &pol).0, 1);
        assert_eq!(splits(8, 131072, 396, &sh, &pol), (64, 2048));
        assert_eq!(splits(8, 16384, 396, &sh, &pol), (32, 512));
    }

    #[test]
    fn mma_variant_applies_to_half_types_only() {
        let tun = MmaTunables { enabled: true, warps: 4, stages: 3, l2_hint: 0, row_split: true };
        let m = mma_shape(4, 128, 2, 2, true, &tun, 227 << 10).unwrap();
        assert_eq!((m.gq, m.warps, m.stages, m.tile()), (4, 4, 3, 64));
        assert_eq!(m.smem_bytes(128), 4 * 3 * 2 * 16 * 272);
        assert_eq!(mma_shape(32, 128, 2, 2, true, &tun, 227 << 10).unwrap().gq, 16);
        assert!(mma_shape(24, 128, 2, 2, true, &tun, 227 << 10).is_none());
        assert!(mma_shape(4, 128, 4, 2, true, &tun, 227 << 10).is_none(), "f32 stays on the lane-group kernel");
        assert!(mma_shape(4, 128, 2, 2, false, &tun, 227 << 10).is_none());
        assert!(mma_shape(4, 128, 2, 2, true, &MmaTunables { enabled: false, ..tun }, 227 << 10).is_none());
        let big = mma_shape(16, 256, 2, 2, true, &MmaTunables { enabled: true, warps: 8, stages: 4, l2_hint: 0, row_split: true }, 227 << 10).unwrap();
        assert!(big.smem_bytes(256) <= 227 << 10 && big.stages >= 2);
        let f8 = mma_shape(4, 128, 2, 1, true, &tun, 227 << 10).unwrap();
        assert_eq!(f8.smem_bytes(128), 4 * 3 * 2 * 16 * 144, "FP8 rows staged as bytes");
        let pol = SplitPolicy { waves: 8, min_chunk: 512, max_splits: 64, cta_cost: 256 };
        let (n, chunk) = splits_tile(8, 131072, 264, 64, &pol);
        assert!(n * chunk >= 131072 && chunk % 64 == 0);
        // Wave model: one full wave without splits at batch 32 x 8 KV heads; 33 splits at batch 1.
        assert_eq!(splits_waves(256, 16384, 264, 64, &pol).0, 1);
        assert_eq!(splits_waves(8, 131072, 264, 64, &pol).0, 33);
        assert_eq!(splits_waves(128, 16384, 264, 64, &pol).0, 2);
        for &(rows, len) in &[(8usize, 131072usize), (256, 16384), (1024, 1024), (8, 1), (100000, 50), (3, 777)] {
            let (n, chunk) = splits_waves(rows, len, 264, 64, &pol);
            assert!(n >= 1 && n * chunk >= len && (n - 1) * chunk < len.max(1) && chunk % 64 == 0, "{rows} {len}: {n} x {chunk}");
        }
    }
}
