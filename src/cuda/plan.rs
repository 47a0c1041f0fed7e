//! How one attention call is cut into CTAs: query heads per CTA, keys per lane-group batch, and the
//! number of KV splits (flash-decoding). Pure arithmetic, so it is unit-tested without a GPU.
//!
//! Splits: a decode batch has few (token, head-group) rows, often fewer than the GPU has CTA slots, and
//! one CTA per row would leave most of the memory system idle. We cut each row's keys into splits of at
//! least `min_chunk` positions until the grid holds about `waves` full waves of CTAs; many short splits
//! keep the last wave's tail small. Rows that already fill `waves / 2` waves get one split (no workspace,
//! no combine pass). The partial results cost `rows * GQ * splits * (head_dim + 1) * 4` bytes of workspace,
//! under 1% of the KV bytes for every grid point of the benchmark.

/// Tunables (overridable with `KVS_CUDA_WAVES` / `KVS_CUDA_MIN_CHUNK` for experiments).
#[derive(Clone, Copy, Debug)]
pub struct SplitPolicy {
    pub waves: usize,
    pub min_chunk: usize,
    /// Upper bound on splits: the combine pass walks the splits of a head serially, and on the H100 64
    /// splits of 2048 keys beat 256 of 512 at batch 1 x 128K (75.7% vs 60.9% of copy bandwidth).
    pub max_splits: usize,
}

impl SplitPolicy {
    pub fn from_env() -> Self {
        let get = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).filter(|&v| v > 0).unwrap_or(d);
        SplitPolicy { waves: get("KVS_CUDA_WAVES", 8), min_chunk: get("KVS_CUDA_MIN_CHUNK", 512), max_splits: get("KVS_CUDA_MAX_SPLITS", 64) }
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

/// Number of splits and positions per split for `rows` CTA rows over at most `max_len` keys.
pub fn splits(rows: usize, max_len: usize, ctas_per_wave: usize, shape: &KernelShape, pol: &SplitPolicy) -> (usize, usize) {
    let tile = shape.lane_groups * shape.kb;
    let want = pol.waves * ctas_per_wave.max(1);
    if rows == 0 || max_len == 0 || rows * 2 >= want {
        return (1, max_len.max(1).next_multiple_of(tile));
    }
    let by_len = max_len.div_ceil(pol.min_chunk.max(tile)).max(1);
    let n = want.div_ceil(rows).min(by_len).min(pol.max_splits).clamp(1, 65535);
    let chunk = max_len.div_ceil(n).next_multiple_of(tile);
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
        let pol = SplitPolicy { waves: 8, min_chunk: 512, max_splits: 64 };
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
}
