//! StreamingLLM (attention sinks + a recent window). Parameters parsed in `policy::spec`; on the GPU its
//! plan is written by kernels/select.cu.

pub mod cpu;
pub mod cuda;
