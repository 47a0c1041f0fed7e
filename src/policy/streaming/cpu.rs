//! StreamingLLM on the CPU: the first `sink` and the last `recent` tokens.

use crate::cpu::sparse::{CpuStage, HeadWork, Scratch, SelectCx};
use crate::policy::select;

/// `streaming(sink, recent)` as a CPU stage.
pub struct Streaming {
    pub sink: usize,
    pub recent: usize,
}

impl CpuStage for Streaming {
    fn select(&self, cx: &SelectCx, hw: &mut HeadWork, _sc: &mut Scratch) -> (usize, u64, bool) {
        select::streaming(&mut hw.plan, cx.lim.lo, cx.lim.hi, self.sink, self.recent);
        (self.sink.max(1), 0, false)
    }
}
