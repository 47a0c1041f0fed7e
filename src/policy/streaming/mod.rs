//! StreamingLLM (attention sinks + a recent window). Parameters parsed here ([`parse`]); on the GPU its
//! plan is written by kernels/select.cu's `kvs_plan_simple` ([`cuda`], which serves `all` too).

pub mod cpu;
pub mod cuda;

use super::spec::{Arg, Args};
use crate::error::Result;

/// `streaming(sink, recent)`: the first `sink` and the last `recent` tokens (its CPU stage in [`cpu`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Streaming {
    pub sink: usize,
    pub recent: usize,
}

/// `streaming(sink, recent)`'s arguments (src/policy/registry.rs names the stage).
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<Streaming> {
    let mut a = Args::new(src, "streaming", raw, &["sink", "recent"])?;
    let sink = a.int("sink", Some(4), 0, "", |_| true)?;
    let recent = a.int("recent", None, 1, "", |_| true)?;
    Ok(Streaming { sink, recent })
}

impl super::kind::SelectorKind for Streaming {
    fn cuda_fp8_cache(&self) -> bool {
        true
    }

    fn graph_capturable(&self) -> bool {
        true
    }

    fn budget_entries(&self) -> Option<usize> {
        Some(self.sink.saturating_add(self.recent))
    }

    fn shared_plan(&self) -> bool {
        true
    }

    /// A pattern, not a ranking: later stages keep position order.
    fn ranks_by_score(&self) -> bool {
        false
    }

    fn sink_positions(&self) -> usize {
        self.sink
    }

    /// Its token windows are whole spans the terminating attention kernel walks in order.
    fn device_terminable(&self) -> bool {
        true
    }
}

/// This stage's spec forms: defaults, values and refusals (each message names the position and the key).
#[cfg(test)]
mod spec_tests {
    use crate::policy::registry::{parse, refusal as msg};
    use crate::policy::*;

    #[test]
    fn streaming_spec() {
        assert_eq!(parse("streaming(recent=64)").unwrap().pipeline.unwrap().selector, Selector::Streaming(Streaming { sink: 4, recent: 64 }));
        assert!(msg("streaming(sink=4)").contains("needs `recent="));
    }
}
