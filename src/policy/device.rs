//! What the CUDA backend asks of the parsed policy: whether it runs it, and the device state a stage needs
//! set up when the backend is made. Apart from the policy's own layers (spec, plans), so that the device
//! code the policies' CUDA files build on does not depend back on them.

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

    /// Sets up a new CUDA backend's device state that needs the parsed stage (PRR's parameters, the
    /// predictor's weights).
    pub fn init_device(&self, b: &mut crate::cuda::CudaBackend, cfg: &crate::config::EngineConfig) -> Result<()> {
        match self.pipeline().map(|p| &p.selector) {
            Some(Selector::Speculate(sp)) => b.prr.set_spec(*sp),
            Some(Selector::Predictor(ps)) => {
                if let Some(w) = self.predictor_weights()? {
                    b.init_predictor(&w, *ps, cfg.num_layers, cfg.num_kv_heads, self.spec.max_seqs)?;
                }
            }
            _ => {}
        }
        Ok(())
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
