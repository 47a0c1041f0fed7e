//! Key metadata as the policies and the backends share it: what a policy needs maintained by the cache
//! writes ([`MetaNeeds`]) and one layer's metadata as plain arrays ([`MetaSnapshot`]). The CPU keeps it in
//! `cpu::metadata`, the CUDA backend in `cuda::meta`.

/// What the configured policy needs maintained, as generic kinds of metadata (each policy declares its
/// own in its folder: `SelectorKind::meta_needs`, `LaterStageKind::meta_needs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetaNeeds {
    /// Per-page element-wise key minima and maxima, for pages of this many tokens (the unit kept is
    /// `min(page, block_size)`; Quest's and PRR's page bounds).
    pub bounds_page: Option<usize>,
    /// An INT4 copy of every key row (top-p's weight estimate).
    pub int4: bool,
    /// One kept bit per cache slot, written by a selector's prefill choice (SnapKV; CUDA engines only:
    /// the CPU keeps its choice per sequence id).
    pub keep_bits: bool,
}

impl MetaNeeds {
    pub fn any(&self) -> bool {
        self.bounds_page.is_some() || self.int4 || self.keep_bits
    }
}

/// One layer's metadata as plain arrays: `fill[num_blocks * 4]` (bit `off` of word `off / 64` of block
/// `b` at `b * 4 + off / 64`), Quest bounds `[num_blocks][units_per_block][kv_heads][dim]` fp16 bits,
/// INT4 codes `[num_blocks * block_size * kv_heads][dim / 2]` and fp16 (min, scale) pairs per row.
#[derive(Clone, Debug, PartialEq)]
pub struct MetaSnapshot {
    pub fill: Vec<u64>,
    pub qmin: Option<Vec<u16>>,
    pub qmax: Option<Vec<u16>>,
    pub codes: Option<Vec<u8>>,
    pub qparams: Option<Vec<u16>>,
}
