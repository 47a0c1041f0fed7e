//! SnapKV: tokens chosen at prefill from the attention of the last `window` prompt queries (the CPU's
//! choice in [`cpu`], the device's in [`cuda`] and kernels/policy/snapkv.cu).

pub mod cpu;
pub mod cuda;
