//! Quest (query-aware page selection). Its parameters are parsed in `policy::spec`; its kernels are in
//! kernels/select.cu and kernels/include/quest.cuh, launched by src/cuda/sparse.rs; its key metadata
//! (min/max per page) is kept by cpu::metadata and cuda::meta.

pub mod cpu;
pub mod cuda;
