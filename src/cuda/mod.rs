//! CUDA backend: the driver and NVRTC loaded at run time ([`driver`]), the device context ([`context`]),
//! NVRTC compilation with an on-disk module cache ([`module_cache`]), launches ([`launch`]), split-KV
//! planning ([`plan`]), prefill rows on their own kernel ([`prefill`]), the device checks of the metadata ([`checks`]), a decode step's cache write in one launch ([`write_step`]), the policies' device pipeline ([`sparse`], calling each policy's device code in `src/policy/<name>/cuda.rs` through [`stage`]), what launches share ([`batch`]), the attention kernel's traversal hook ([`traversal`]), per-sequence state slots ([`slots`]) and the backend the engine dispatches to ([`backend`]). Kernels: `kernels/*.cu`, a policy's own in `kernels/policy/`.
//! Nothing here is needed at build time, and every entry point fails cleanly when no driver is present.

pub mod backend;
pub mod batch;
pub mod checks;
pub mod context;
pub mod driver;
pub mod engine_backend;
pub mod kernel_src;
pub mod launch;
pub mod meta;
pub mod module_cache;
pub mod plan;
pub mod prefill;
pub mod slots;
pub mod sparse;
pub mod stage;
pub mod traversal;
pub mod workspace;
pub mod write_step;

pub use backend::CudaBackend;

/// True when a CUDA driver loads and reports at least one device (never panics).
pub fn device_available() -> bool {
    let Ok(api) = driver::cuda() else { return false };
    let mut n = 0;
    // SAFETY: out-parameter.
    unsafe { (api.cuDeviceGetCount)(&mut n) == 0 && n > 0 }
}
