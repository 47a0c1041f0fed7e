//! StreamingLLM (attention sinks + a recent window). Parameters parsed here ([`parse`]); on the GPU its
//! plan is written by kernels/select.cu's `kvs_plan_simple` ([`cuda`], which serves `all` too).

pub mod cpu;
pub mod cuda;

use super::spec::{Arg, Args, Parsed, Selector};
use crate::error::Result;

/// `streaming(sink, recent)`'s arguments (src/policy/registry.rs names the stage).
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<Parsed> {
    let mut a = Args::new(src, "streaming", raw, &["sink", "recent"])?;
    let sink = a.int("sink", Some(4), 0, "", |_| true)?;
    let recent = a.int("recent", None, 1, "", |_| true)?;
    Ok(Parsed::Selector(Selector::Streaming { sink, recent }, None))
}

impl super::kind::SelectorKind for cpu::Streaming {
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
}

/// This stage's spec forms: defaults, values and refusals (each message names the position and the key).
#[cfg(test)]
mod spec_tests {
    use crate::policy::spec::{parse, refusal as msg};
    use crate::policy::*;

    #[test]
    fn streaming_spec() {
        assert_eq!(parse("streaming(recent=64)").unwrap().pipeline.unwrap().selector, Selector::Streaming { sink: 4, recent: 64 });
        assert!(msg("streaming(sink=4)").contains("needs `recent="));
    }
}
