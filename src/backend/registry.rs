//! Which backend serves a configuration's device: the one place that names them.

use crate::config::EngineConfig;
use crate::error::Result;
use crate::policy::Policy;
use crate::tensor::Device;

use super::Backend;

/// The backend of `cfg.device`, made for the parsed `policy`.
pub fn create(cfg: &EngineConfig, policy: &Policy) -> Result<Box<dyn Backend>> {
    Ok(match cfg.device {
        Device::Cpu => Box::new(crate::cpu::backend::CpuBackend::new(cfg, policy)?),
        Device::Cuda(i) => Box::new(crate::cuda::engine_backend::new(cfg, i, policy)?),
    })
}
