//! # kvsparse
//!
//! Paged (block-table) attention for LLM inference engines, exact in dense mode, with sparse and adaptive
//! decode policies layered on top. The product is the C ABI in [`ffi`] (header: `include/kvsparse.h`);
//! the Rust API below is what the ABI, the CLI and the tests are built on.
//!
//! Layout: [`tensor`] (strided views of DLPack tensors, checked extents), [`validate`] (one check per tensor
//! role), [`layout`] (cache geometry, batches), [`alloc`] (fallible allocation),
//! [`engine`] (configuration, sequences, statistics, dispatch), [`cpu`] (reference kernels),
//! [`policy`] (which blocks a decode row visits), [`conformance`] (the float64 reference and test matrix),
//! [`synthetic`] (LLM-like decode batches for benchmarks and policy tests).

pub mod alloc;
pub mod args;
pub mod backend;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod fp8;
pub mod layout;
pub mod meta;
pub mod policy;
pub mod rng;
pub mod sequences;
pub mod stats;
pub mod tensor;
pub mod validate;

pub use config::EngineConfig;
pub use args::{CacheWriteArgs, ForwardArgs, MergeArgs};
pub use engine::Engine;
pub use error::{Error, ErrorKind, Result};
pub use tensor::{DType, Device, TensorRef};

/// ABI version reported by `kvs_version()` and `KVS_ABI_VERSION` in the header.
pub const ABI_VERSION: u32 = 0;
