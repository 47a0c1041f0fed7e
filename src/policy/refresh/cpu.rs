//! RefreshKV on the CPU: the partial set seeded at a prefill chunk, the full steps' scores, the schedule's
//! mean query and the decode row (moved from src/cpu/sparse/stateful.rs).

use crate::cpu::sparse::*;
use crate::policy::refresh::RefreshHead;
use super::Refresh;

/// RefreshKV's partial set initialised at a prefill chunk, as the paper's prefilling stage does: the
/// attention of the chunk's last query row (softmax weights per query head, max over the GQA group,
/// max-pooled over `pool` neighbours) picks the top `k` positions it can see.
pub fn refresh_seed(io: &ForwardIo, s: usize, head: usize, r: &Refresh) -> RefreshHead {
    let (d, g) = (io.cache.head_dim, io.group());
    let sd = &io.batch.seqs[s];
    let blocks = io.batch.blocks(s, io.cache.block_size);
    let t = sd.q_start + sd.q_len - 1;
    let mut q = vec![0f32; g * d];
    let mut lims = Vec::new();
    io.load_queries(t..t + 1, head, &mut q);
    io.limits(sd, t..t + 1, &mut lims);
    let lim = lims[0];
    let mut w = Vec::new();
    refresh_weights(io, &q, g, lim, blocks, head, &mut w);
    let mut rh = RefreshHead::default();
    rh.rebuild(&max_pool(&w, r.pool), lim.lo, lim.hi, r.k);
    rh
}

/// RefreshKV's scores of one query row: the softmax weight of every visible position `lim.lo ..= lim.hi`
/// for each of the group's `rows` query heads (`q`: scaled rows), the maximum over the group (from 0, NaN
/// dropped as `f32::max` does), into `out[pos - lo]`. In the decisions' fixed arithmetic, as SnapKV's
/// choice (`cpu::snapkv`): `decision_dot`, `decision_softcap`, `fast_exp(x - max)`, the order-free
/// fixed-point normaliser `softmax_norm`, `w = f32(e / z)`; the CUDA kernel `kvs_refresh_scores`
/// (kernels/refresh.cu) computes the same bits, so both engines rebuild the same token sets.
pub fn refresh_weights(io: &ForwardIo, q: &[f32], rows: usize, lim: RowLimits, blocks: &[u32], head: usize, out: &mut Vec<f32>) {
    use crate::cpu::math::{decision_dot, decision_softcap, softmax_norm};
    let cache = io.cache;
    let (d, bs) = (cache.head_dim, cache.block_size);
    out.clear();
    if lim.hi < lim.lo {
        return;
    }
    let n = lim.hi + 1 - lim.lo;
    out.resize(n, 0.0);
    let mut logits = vec![0f32; rows * n];
    let mut k = vec![0f32; d];
    for j in 0..n {
        let pos = lim.lo + j;
        // SAFETY: pos <= hi < seq_len, whose blocks were validated.
        unsafe { load_cache_row::<Portable>(cache.k_row(blocks[pos / bs] as usize, pos % bs, head), cache.dtype, cache.k_scale, cache.k_dim_stride(), d, &mut k) };
        for r in 0..rows {
            logits[r * n + j] = decision_softcap(decision_dot(&q[r * d..(r + 1) * d], &k), io.params.softcap);
        }
    }
    for r in 0..rows {
        let row = &mut logits[r * n..(r + 1) * n];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if m == f32::NEG_INFINITY {
            continue;
        }
        for x in row.iter_mut() {
            *x = fast_exp(*x - m);
        }
        let z = softmax_norm(row.iter().copied());
        for (o, &e) in out.iter_mut().zip(row.iter()) {
            *o = o.max(0f32 + (e as f64 / z) as f32);
        }
    }
}

/// Mean query over all query heads of row `t` (RefreshKV's schedule compares it between steps).
pub fn mean_query(io: &ForwardIo, t: usize) -> Vec<f32> {
    let (d, g) = (io.cache.head_dim, io.group());
    let mut qm = vec![0f32; d];
    let mut buf = vec![0f32; g * d];
    for h in 0..io.num_kv_heads {
        io.load_queries(t..t + 1, h, &mut buf);
        for row in buf.chunks_exact(d) {
            for (m, &x) in qm.iter_mut().zip(row) {
                *m += x;
            }
        }
    }
    qm
}

/// RefreshKV for the heads of one item: a full step attends everything, scores every position and
/// rebuilds the set; a partial step attends the set only.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_refresh(io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, r: &Refresh, full: bool, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, g) = (cache.head_dim, io.group());
    let sd = &io.batch.seqs[s];
    let lim = RowLimits::causal(sd.seq_len - 1, io.params.window);
    let blocks = io.batch.blocks(s, cache.block_size);
    let state = state_of(ctx, i);
    let softcap = io.params.softcap;
    for_each_policy_head(io, s, heads, ctx, sc, |head, hw, kv, sc, c| {
        let taken = state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).take::<crate::policy::refresh::RefreshHead>();
        let (mut rh, do_full) = match taken {
            Some(rh) if !full => (rh, false),
            other => (other.unwrap_or_default(), true),
        };
        let st = hw.st.as_mut().expect("loaded");
        let spans: Vec<(usize, usize)> = if do_full {
            let spans = vec![(lim.lo, lim.hi + 1)];
            attend_set(st, &hw.q, &hw.limits, kv, &spans, lim.hi + 1 - lim.lo, &mut sc.tokens, softcap);
            refresh_weights(io, &hw.q, g, lim, blocks, head, &mut sc.w);
            c.kv_bytes_read += ((lim.hi + 1 - lim.lo) * d * cache.dtype.size_bytes()) as u64; // K read again to score
            let pooled = max_pool(&sc.w, r.pool);
            rh.rebuild(&pooled, lim.lo, lim.hi, r.k);
            spans
        } else {
            rh.advance(lim.lo, lim.hi, r.k);
            let mut spans: Vec<(usize, usize)> = Vec::new();
            for &t in &rh.tokens {
                let t = t as usize;
                match spans.last_mut() {
                    Some(l) if l.1 == t => l.1 = t + 1,
                    _ => spans.push((t, t + 1)),
                }
            }
            let n = span_tokens(&spans);
            attend_set(st, &hw.q, &hw.limits, kv, &spans, n, &mut sc.tokens, softcap);
            spans
        };
        c.kv_bytes_read += (span_tokens(&spans) * 2 * d * cache.dtype.size_bytes()) as u64;
        state.lock().policy.head_mut(ctx.layer, head, io.num_kv_heads).put(rh);
        HeadVisit { read: spans, used: None }
    })
}

/// Mean query of the row over all query heads, compared by RefreshKV's schedule.
fn refresh_decide(io: &ForwardIo, s: usize, ctx: &SparseCtx, i: usize, r: &Refresh, c: &mut Counters) -> bool {
    let qm = mean_query(io, io.batch.seqs[s].q_start);
    let full = state_of(ctx, i).lock().policy.layer_mut::<crate::policy::refresh::RefreshLayer>(ctx.layer).decide(r, &qm);
    if full {
        c[super::FULL_STEPS] += 1;
    } else {
        c[super::PARTIAL_STEPS] += 1;
    }
    full
}

impl CpuStage for Refresh {
    /// RefreshKV's prefilling stage: the partial set from the last prompt token's attention, and that
    /// token's mean query as the schedule's reference (the prefill is the first full step).
    fn prefill(&self, cx: &PrefillCx) -> crate::error::Result<Counters> {
        use rayon::prelude::*;
        let (io, hk) = (cx.io, cx.cfg.num_kv_heads);
        let items: Vec<(usize, usize)> = cx.calib_seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
        let seeded: Vec<_> = cx.pool.install(|| items.par_iter().map(|&(s, h)| refresh_seed(io, s, h, self)).collect());
        for (&(s, h), rh) in items.iter().zip(seeded) {
            let st = cx.sequences.get_or_create(io.batch.seqs[s].seq_id);
            st.lock().policy.head_mut(cx.layer, h, hk).put(Box::new(rh));
        }
        for &s in cx.calib_seqs {
            let sd = &io.batch.seqs[s];
            let qm = mean_query(io, sd.q_start + sd.q_len - 1);
            let st = cx.sequences.get_or_create(sd.seq_id);
            st.lock().policy.set_layer(cx.layer, crate::policy::refresh::RefreshLayer { q_ref: qm, since_full: 0 });
        }
        Ok(Counters::default())
    }

    fn prefill_reads_meta(&self) -> bool {
        true
    }

    /// Full or partial, per (sequence, layer), before the heads run.
    fn decide_sequence(&self, io: &ForwardIo, s: usize, ctx: &SparseCtx, i: usize, c: &mut Counters) -> bool {
        refresh_decide(io, s, ctx, i, self, c)
    }

    fn run_item(&self, io: &ForwardIo, s: usize, i: usize, heads: std::ops::Range<usize>, full: bool, ctx: &SparseCtx, sc: &mut Scratch) -> Option<Counters> {
        Some(run_refresh(io, s, i, heads, self, full, ctx, sc))
    }
}
