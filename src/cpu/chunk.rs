//! The chunk of keys every CPU attention path processes at once ([`super::attention`], the instruction-set
//! kernels in [`super::convert`], [`super::avx2`], [`super::avx512`] and [`super::prefill`]). A leaf file,
//! so that those modules share the constant without naming each other.

/// Keys per chunk: large enough to amortise the softmax rescale, small enough to keep K in L1/L2.
pub const CHUNK: usize = 32;
