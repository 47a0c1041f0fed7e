//! SnapKV: tokens chosen at prefill from the attention of the last `window` prompt queries (the CPU's
//! choice in [`cpu`], the device's in [`cuda`] and kernels/policy/snapkv.cu).

pub mod cpu;
pub mod cuda;

use super::spec::{Arg, Args};
use crate::error::Result;

/// `snapkv(budget, window, pool)`: tokens chosen at prefill from the attention of the last `window` prompt
/// queries, max-pooled over `pool`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapKv {
    pub budget: usize,
    pub window: usize,
    pub pool: usize,
}

/// SnapKV's choice for one (sequence, layer, KV head), made at the sequence's last prefill chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapSelection {
    /// Sequence length when the choice was made; positions from here on (generated tokens) are all kept.
    pub prefill_len: usize,
    /// Sorted kept positions `< prefill_len` (the chosen prefix positions and the observation window).
    pub keep: Vec<u32>,
    /// The pooled score of each kept position (ART's priority); +inf for the observation window.
    pub score: Vec<f32>,
}

/// Held as an `Arc`, so a call's rows read it without the sequence's lock (`CpuStage::held`).
impl super::PolicyState for std::sync::Arc<SnapSelection> {
    fn bytes(&self) -> usize {
        std::mem::size_of::<SnapSelection>() + self.keep.capacity() * 4
    }
}

/// `snapkv(budget, window, pool)`'s arguments (src/policy/registry.rs names the stage).
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<SnapKv> {
    let mut a = Args::new(src, "snapkv", raw, &["budget", "window", "pool"])?;
    let budget = a.int("budget", None, 1, "", |_| true)?;
    let window = a.int("window", Some(32), 1, "", |_| true)?;
    let pool = a.int("pool", Some(7), 1, ", odd", |v| v % 2 == 1)?;
    Ok(SnapKv { budget, window, pool })
}

impl super::kind::SelectorKind for SnapKv {
    /// Over FP8 its choice takes the scalar phases, which read the keys decoded times k_scale (snapkv::cuda).
    fn cuda_fp8_cache(&self) -> bool {
        true
    }

    fn stateful(&self) -> bool {
        true
    }

    /// On the device the choice lives with the cache blocks (kept-slot bits, kernels/policy/snapkv.cu).
    fn device_meta_needs(&self, needs: &mut crate::meta::MetaNeeds) {
        needs.keep_bits = true;
    }
}

/// This stage's spec forms: defaults, values and refusals (each message names the position and the key).
#[cfg(test)]
mod spec_tests {
    use crate::policy::registry::{parse, refusal as msg};
    use crate::policy::*;

    #[test]
    fn snapkv_spec() {
        assert_eq!(parse("snapkv(budget=100)").unwrap().pipeline.unwrap().selector, Selector::SnapKv(SnapKv { budget: 100, window: 32, pool: 7 }));
        assert!(msg("snapkv(budget=0)").contains("snapkv.budget"));
        assert!(msg("snapkv(budget=8, pool=4)").contains("odd"));
    }
}
