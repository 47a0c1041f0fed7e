//! CPU backend: the reference implementation, exact in f32 accumulation, and fast enough to serve.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod cache_write;
pub mod backend;
pub mod call;
pub mod chunk;
pub mod convert;
pub mod forward;
mod host_omp;
pub mod isa;
pub mod math;
pub mod merge;
pub mod metadata;
pub mod prefill;
pub mod quantize;
pub mod simd;
pub mod sparse;
pub mod spin_pool;
