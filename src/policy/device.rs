//! What the CUDA backend asks of the parsed policy at the engine's creation and calls: whether it runs it,
//! and whether a host-set policy input (`PolicyInput`) applies. (The device state a policy keeps is made by the
//! registry, `Policy::cuda_device`.)

use super::Policy;
use crate::error::Result;

impl Policy {
    /// Whether the backend of `device` runs this policy (for a GQA group of `group` query heads per KV head).
    pub fn supported_on(&self, device: crate::tensor::Device, group: usize) -> std::result::Result<(), String> {
        match (device, self.pipeline()) {
            (crate::tensor::Device::Cuda(_), Some(p)) => crate::cuda::sparse::supported(p, group),
            _ => Ok(()),
        }
    }

    /// Whether the CUDA backend runs this policy over an FP8 cache: dense, and pipelines whose selector
    /// reads keys through the key metadata or reads FP8 rows in its own kernels as the CPU does
    /// (`SelectorKind::cuda_fp8_cache`). The later stages serve FP8 caches as they are: top-p reads the
    /// INT4 copy, which the cache writes keep from the dequantized keys; ART's terminating kernel reads
    /// FP8 rows. Err(why) otherwise.
    pub fn cuda_fp8_cache(&self) -> std::result::Result<(), String> {
        let Some(p) = self.pipeline() else { return Ok(()) };
        if !p.selector.kind().cuda_fp8_cache() {
            return Err(super::registry::SELECTOR_NO_FP8.into());
        }
        Ok(())
    }

    /// Refuses a host-set policy input on the CUDA backend where the selector reads it on the CPU only.
    pub fn check_input_on_device(&self) -> Result<()> {
        match self.pipeline().map(|p| p.selector.kind().device_input()) {
            Some(Err(why)) => Err(crate::error::Error::new(crate::error::ErrorKind::Unsupported, why)),
            _ => Ok(()),
        }
    }
}
