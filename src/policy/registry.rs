//! The policy registry: each selector's implementation, one line per policy. The engine and the backends
//! reach a stage through here (`Selector::cpu`), so nothing outside src/policy matches on a policy's name.

use super::Selector;
use crate::cpu::sparse::CpuStage;

/// `all`: every visible position (the stage's defaults).
struct All;
impl CpuStage for All {}

impl Selector {
    /// This selector as a CPU stage (one small value per forward call).
    pub(crate) fn cpu(&self) -> Box<dyn CpuStage + '_> {
        match *self {
            Selector::All => Box::new(All),
            Selector::Streaming { sink, recent } => Box::new(super::streaming::cpu::Streaming { sink, recent }),
            Selector::Quest { budget, page, sink } => Box::new(super::quest::cpu::Quest { budget, page, sink }),
            Selector::SnapKv { budget, window, pool } => Box::new(super::snapkv::cpu::SnapKv { budget, window, pool }),
            Selector::Speculate(s) => Box::new(s),
            Selector::Refresh(r) => Box::new(r),
            Selector::Predictor(p) => Box::new(p),
        }
    }
}
