//! Twilight's top-p on the CUDA backend (kernels/policy/top_p.cu): INT4 estimates of the logits of the
//! selector's candidates, then per (sequence, KV head) the shortest prefix by weight reaching mass `p`,
//! written as the final plan (tokens). The selector writes its plans into this stage's regions.

use crate::cuda::launch::{self, KArgs};
use crate::cuda::stage::{CallShape, CudaStage, StepCx, WsAlloc};
use crate::error::Result;

/// Top-p's stage for one call, and its workspace regions.
pub(crate) struct TopPStage {
    pub p: f32,
    /// Candidates per row (a multiple of 4).
    maxc: usize,
    /// The selector's plans and their lengths.
    base: usize,
    base_len: usize,
    /// The estimates `[seqs][kv_heads][group][maxc]` f32 (overwritten with the weights) and the
    /// aggregated weights `[seqs][kv_heads][maxc]` f32.
    logits: usize,
    w: usize,
}

impl TopPStage {
    pub(crate) fn new(p: f32) -> Self {
        TopPStage { p, maxc: 0, base: 0, base_len: 0, logits: 0, w: 0 }
    }
}

impl CudaStage for TopPStage {
    fn reserve(&mut self, cx: &CallShape, ws: &mut WsAlloc) -> Result<()> {
        let (ns, hk, g) = (cx.geo.num_seqs, cx.cfg.num_kv_heads, cx.cfg.group_size());
        self.maxc = cx.candidates();
        self.base = ws.take_n(&[cx.rows_of(&cx.base), cx.base.cap, 4])?;
        self.base_len = ws.take_n(&[ns, hk, 4])?;
        self.logits = ws.take_n(&[ns, hk, g, self.maxc, 4])?;
        self.w = ws.take_n(&[ns, hk, self.maxc, 4])?;
        Ok(())
    }

    fn base_plan(&self) -> Option<(usize, usize)> {
        Some((self.base, self.base_len))
    }

    fn select(&self, cx: &StepCx) -> Result<()> {
        let (hk, ns, d, stream) = (cx.cfg.num_kv_heads, cx.geo.num_seqs, cx.cfg.head_dim, cx.a.stream);
        let (a, base_ref, fin_ref, maxc) = (cx.a, &cx.base, &cx.fin, self.maxc);
        let m = cx.meta.expect("int4 metadata checked above");
        let (codes, qparams) = (m.codes.as_ref().map_or(0, |b| b.ptr), m.qparams.as_ref().map_or(0, |b| b.ptr));
        let (logits, w) = (cx.ws + self.logits as u64, cx.ws + self.w as u64);
        let q = &a.query;
        let mut k = KArgs::new();
        k.by_value(&cx.batch).ptr(q.data).i64(q.stride(0) as i64).i64(q.stride(1) as i64).i64(q.stride(2) as i64).f32(a.scale).i32(hk as i32);
        k.i64(base_ref.e as i64).i64(base_ref.p_s).i64(base_ref.p_h).i64(base_ref.len as i64).i32(base_ref.ulog2);
        k.i64(codes as i64).i64(qparams as i64).f32(a.softcap).i64(logits as i64).i32(maxc as i32);
        launch::launch(cx.function("kvs_topp_estimate")?, (maxc.div_ceil(128) as u32, hk as u32, ns as u32), 128, &mut k, stream, "kvs_topp_estimate launch")?;
        let mut k = KArgs::new();
        k.by_value(&cx.batch).i32(hk as i32).i64(base_ref.e as i64).i64(base_ref.p_s).i64(base_ref.p_h).i64(base_ref.len as i64).i32(base_ref.ulog2);
        k.i64(logits as i64).i64(w as i64).i32(maxc as i32).f32(self.p);
        k.i64(fin_ref.e as i64).i64(fin_ref.p_s).i64(fin_ref.p_h).i64(fin_ref.len as i64).i32(fin_ref.cap).i64(cx.row_bytes).i64((d / 2 + 4) as i64).i64(cx.ctr);
        launch::launch(cx.function("kvs_topp_select")?, (hk as u32, ns as u32, 1), 512, &mut k, stream, "kvs_topp_select launch")
    }
}
