//! SnapKV: tokens chosen at prefill from the attention of the last `window` prompt queries (the CPU's
//! choice in [`cpu`], the device's in [`cuda`] and kernels/policy/snapkv.cu).

pub mod cpu;
pub mod cuda;

use super::spec::{Arg, Args, Parsed, Selector};
use crate::error::Result;

/// `snapkv(budget, window, pool)`'s arguments (src/policy/registry.rs names the stage).
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<Parsed> {
    let mut a = Args::new(src, "snapkv", raw, &["budget", "window", "pool"])?;
    let budget = a.int("budget", None, 1, "", |_| true)?;
    let window = a.int("window", Some(32), 1, "", |_| true)?;
    let pool = a.int("pool", Some(7), 1, ", odd", |v| v % 2 == 1)?;
    Ok(Parsed::Selector(Selector::SnapKv { budget, window, pool }, None))
}
