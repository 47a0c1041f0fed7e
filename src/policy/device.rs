//! What the CUDA backend asks of the parsed policy at the engine's creation and calls: whether it runs it,
//! and whether a loaded speculation table applies. (The device state a policy keeps is made by the
//! registry, `Policy::cuda_device`.)

use super::{Policy, Selector};
use crate::error::Result;

impl Policy {
    /// Whether the backend of `device` runs this policy (for a GQA group of `group` query heads per KV head).
    pub fn supported_on(&self, device: crate::tensor::Device, group: usize) -> std::result::Result<(), String> {
        match (device, self.pipeline()) {
            (crate::tensor::Device::Cuda(_), Some(p)) => crate::cuda::sparse::supported(p, group),
            _ => Ok(()),
        }
    }

    /// Refuses a loaded speculation budget table on the CUDA backend: PRR there reads the spec's constant
    /// `budget` (the table is CPU-only for now).
    pub fn check_spec_budgets_on_device(&self) -> Result<()> {
        crate::ensure!(
            !matches!(self.pipeline().map(|p| &p.selector), Some(Selector::Speculate(_))),
            Unsupported,
            "a speculation budget table (set_speculation_budgets) is not supported by the CUDA backend; PRR there uses the spec's `budget`"
        );
        Ok(())
    }
}
