//! StreamingLLM on the CPU: the first `sink` and the last `recent` tokens.

use crate::cpu::sparse::{CpuStage, HeadWork, Scratch, SelectCx};
use crate::policy::plan::{normalize_spans, HeadPlan};

impl CpuStage for super::Streaming {
    fn select(&self, cx: &SelectCx, hw: &mut HeadWork, _sc: &mut Scratch) -> (usize, u64, bool) {
        streaming(&mut hw.plan, cx.lim.lo, cx.lim.hi, self.sink, self.recent);
        (self.sink.max(1), 0, false)
    }
}

/// `streaming(sink, recent)`: the first `sink` and the last `recent` visible positions, as a token plan
/// in increasing position order.
pub fn streaming(plan: &mut HeadPlan, lo: usize, hi: usize, sink: usize, recent: usize) {
    let mut spans = vec![(lo, sink.min(hi + 1).max(lo)), ((hi + 1).saturating_sub(recent).max(lo), hi + 1)];
    normalize_spans(&mut spans);
    plan.set_tokens_from_spans(&spans);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_covers_everything_when_window_is_long() {
        let mut p = HeadPlan::default();
        streaming(&mut p, 0, 99, 4, 200);
        assert_eq!(p.entries, (0..100).collect::<Vec<u32>>());
        streaming(&mut p, 0, 99, 4, 10);
        let mut c = crate::policy::select::Candidates::default();
        c.from_plan(&p, 0, 99, 16, 4, |_| f32::NAN, &mut Vec::new());
        assert_eq!(c.spans, vec![(0, 4), (90, 96), (96, 100)]);
        crate::policy::select::all(&mut p, 5, 40, 16);
        assert_eq!((p.unit_log2, p.entries.clone()), (4, vec![0, 1, 2]));
    }
}
