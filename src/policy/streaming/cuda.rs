//! `all` and `streaming` on the CUDA backend: one plan per sequence, shared by every KV head, written by
//! `kvs_plan_simple` (kernels/select.cu; kind 0: every block of the row, kind 1: the first `sink` and last
//! `recent` positions).

use crate::cuda::launch::{self, KArgs};
use crate::cuda::stage::{CudaStage, StepCx};
use crate::error::Result;

/// The simple plans' stage: `all` (kind 0) or `streaming` (kind 1, its sink and recent positions).
pub(crate) struct SimplePlan {
    pub kind: i32,
    pub sink: usize,
    pub recent: usize,
}

impl SimplePlan {
    /// `all`: every visible position.
    pub(crate) fn all() -> Self {
        SimplePlan { kind: 0, sink: 0, recent: 0 }
    }

    /// `streaming(sink, recent)`.
    pub(crate) fn streaming(sink: usize, recent: usize) -> Self {
        SimplePlan { kind: 1, sink, recent }
    }
}

impl CudaStage for SimplePlan {
    fn select(&self, cx: &StepCx) -> Result<()> {
        let (hk, ns, base) = (cx.cfg.num_kv_heads, cx.geo.num_seqs, &cx.base);
        let clamp = |v: usize| v.min(i32::MAX as usize) as i32;
        let mut k = KArgs::new();
        k.by_value(&cx.batch).i32(hk as i32).i32(self.kind).i32(clamp(self.sink)).i32(clamp(self.recent));
        k.i64(base.e as i64).i64(base.p_s).i64(base.len as i64).i32(base.cap).i64(cx.row_bytes).i32(cx.count_base).i64(cx.ctr);
        launch::launch_dependent(cx.pdl(), cx.function("kvs_plan_simple")?, (ns as u32, 1, 1), 256, 0, &mut k, cx.a.stream, "kvs_plan_simple launch")
    }
}
