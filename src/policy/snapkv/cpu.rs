//! SnapKV's one-time choice, made at a prefill chunk: the attention weights of the chunk's last `window`
//! queries (the observation window) over the earlier prompt positions, summed over the window, aggregated
//! over the GQA group by max, max-pooled over `pool` positions; the top positions are kept for the whole
//! decode, together with the window itself and every generated token.
//!
//! `budget` counts prompt tokens kept, the window included: `budget - window` positions are chosen from
//! the prefix (all of them when the prompt fits the budget). A later prefill chunk of the same sequence
//! replaces the choice, so the last chunk before decoding decides.
//!
//! The scores use the decisions' fixed arithmetic (`math::decision_dot`, `fast_exp`, `decision_softcap`,
//! the order-free normaliser `softmax_norm`) and sum the window's weights in token order, so that the
//! CUDA kernels (kernels/snapkv.cu) make the same choice bit for bit.

use crate::cpu::attention::RowLimits;
use crate::cpu::convert::{load_cache_row, Portable};
use crate::cpu::forward::ForwardIo;
use crate::cpu::math::{decision_dot, decision_softcap, fast_exp, softmax_norm};
use crate::policy::select::{max_pool, top_k_positions};
use super::SnapSelection;

/// The choice for prefill sequence `s` (index into the batch, `q_len > 1`) and `head`.
pub fn choose(io: &ForwardIo, s: usize, head: usize, budget: usize, window: usize, pool: usize) -> SnapSelection {
    let sd = &io.batch.seqs[s];
    let len = sd.seq_len;
    if len <= budget {
        return SnapSelection { prefill_len: len, keep: (0..len as u32).collect(), score: vec![f32::INFINITY; len] };
    }
    let obs_start = len.saturating_sub(window);
    let k_prefix = budget.saturating_sub(len - obs_start);
    let cache = io.cache;
    let (d, g, bs) = (cache.head_dim, io.group(), cache.block_size);
    let blocks = io.batch.blocks(s, bs);
    // Observation rows: the chunk's tokens at positions >= obs_start.
    let t_end = sd.q_start + sd.q_len;
    let t0 = t_end - (t_end - sd.q_start).min(len - obs_start);
    let rows = (t_end - t0) * g;
    let mut q = vec![0f32; rows * d];
    io.load_queries(t0..t_end, head, &mut q);
    let mut lim = Vec::new();
    io.limits(sd, t0..t_end, &mut lim);
    let width = lim.iter().map(|l| l.hi + 1).max().unwrap_or(0);
    // Logits of every observation row over every position it sees.
    let mut logits = vec![f32::NEG_INFINITY; rows * width];
    let mut k = vec![0f32; d];
    for pos in 0..width {
        // SAFETY: pos < seq_len, whose blocks were validated.
        unsafe { load_cache_row::<Portable>(cache.k_row(blocks[pos / bs] as usize, pos % bs, head), cache.dtype, cache.k_scale, cache.k_dim_stride(), d, &mut k) };
        for r in 0..rows {
            let RowLimits { lo, hi } = lim[r];
            if (lo..=hi).contains(&pos) {
                logits[r * width + pos] = decision_softcap(decision_dot(&q[r * d..(r + 1) * d], &k), io.params.softcap);
            }
        }
    }
    // Softmax per row (normalised over everything the row sees), summed over the window per query head,
    // then max over the group.
    let mut per_head = vec![0f32; g * obs_start];
    for r in 0..rows {
        let row = &mut logits[r * width..(r + 1) * width];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if m == f32::NEG_INFINITY {
            continue;
        }
        for x in row.iter_mut() {
            *x = fast_exp(*x - m);
        }
        let z = softmax_norm(row.iter().copied());
        let h = r % g;
        for j in 0..obs_start {
            per_head[h * obs_start + j] += (row[j] as f64 / z) as f32;
        }
    }
    let agg: Vec<f32> = (0..obs_start).map(|j| (0..g).map(|h| per_head[h * obs_start + j]).fold(0f32, f32::max)).collect();
    let pooled = max_pool(&agg, pool);
    let mut keep = top_k_positions(&pooled, k_prefix);
    let mut score: Vec<f32> = keep.iter().map(|&t| pooled[t as usize]).collect();
    keep.extend(obs_start as u32..len as u32);
    score.resize(keep.len(), f32::INFINITY);
    SnapSelection { prefill_len: len, keep, score }
}

/// `snapkv(budget, window, pool)` as a CPU stage: the choice at prefill, the kept positions at decode.
impl crate::cpu::sparse::CpuStage for super::SnapKv {
    /// Chooses for every prefill sequence of the call and KV head (refused, with nothing stored, when
    /// storing the choices would exceed the engine's state cap), then stores the choices.
    fn prefill(&self, cx: &crate::cpu::sparse::PrefillCx) -> crate::error::Result<crate::stats::Counters> {
        use rayon::prelude::*;
        let io = cx.io;
        let hk = cx.cfg.num_kv_heads;
        let seqs: Vec<usize> = (0..io.batch.seqs.len()).filter(|&s| !io.batch.seqs[s].is_decode() && io.batch.seqs[s].q_len > 0).collect();
        if seqs.is_empty() {
            return Ok(Default::default());
        }
        let items: Vec<(usize, usize)> = seqs.iter().flat_map(|&s| (0..hk).map(move |h| (s, h))).collect();
        let mut sels: Vec<SnapSelection> = cx.pool.install(|| items.par_iter().map(|&(s, h)| choose(io, s, h, self.budget, self.window, self.pool)).collect());
        if cx.cfg.max_state_bytes > 0 {
            let new: u64 = sels.iter().map(|s| (s.keep.len() * 8 + std::mem::size_of::<SnapSelection>()) as u64).sum();
            let held = cx.sequences.state_bytes();
            crate::ensure!(
                held + new <= cx.cfg.max_state_bytes,
                OutOfMemory,
                "SnapKV state for this call needs {new} bytes, the engine holds {held} of its {} byte cap; release finished sequences",
                cx.cfg.max_state_bytes
            );
        }
        for &s in seqs.iter().rev() {
            let heads = sels.split_off(sels.len() - hk);
            let st = cx.sequences.get_or_create(io.batch.seqs[s].seq_id);
            let mut st = st.lock();
            for (h, sel) in heads.into_iter().enumerate() {
                st.policy.head_mut(cx.layer, h, hk).put(Box::new(std::sync::Arc::new(sel)));
            }
        }
        Ok(Default::default())
    }

    fn caps_own_state(&self) -> bool {
        true
    }

    /// The choice, which the decode rows read.
    fn held(&self, hs: &crate::policy::HeadState) -> Option<crate::cpu::sparse::Held> {
        hs.get::<std::sync::Arc<SnapSelection>>().map(|sel| sel.clone() as crate::cpu::sparse::Held)
    }

    fn select(&self, cx: &crate::cpu::sparse::SelectCx, hw: &mut crate::cpu::sparse::HeadWork, _sc: &mut crate::cpu::sparse::Scratch) -> (usize, u64, bool) {
        let lim = cx.lim;
        match cx.held.and_then(|held| held.downcast_ref::<SnapSelection>()) {
            Some(sel) => {
                // Chosen prompt positions, then everything from the end of the prompt on (generated
                // tokens); the row's own position is always attended, even if the sequence is now shorter
                // than the prompt the choice was made for.
                let cut = sel.prefill_len.min(lim.hi).max(lim.lo);
                let fixed = sel.keep.iter().copied().filter(|&t| t as usize >= lim.lo && (t as usize) < cut);
                hw.plan.clear(0);
                hw.plan.entries.extend(fixed.chain(cut as u32..lim.hi as u32 + 1));
                // Priority: the pooled score SnapKV chose a prefix position by; the observation window and
                // the generated tokens (kept unconditionally) rank first.
                hw.entry_score.extend(hw.plan.entries.iter().map(|&t| match sel.keep.binary_search(&t) {
                    Ok(i) if (t as usize) < cut => sel.score.get(i).copied().unwrap_or(f32::INFINITY),
                    _ => f32::INFINITY,
                }));
            }
            // No prefill was seen for this sequence and layer: nothing to choose from, attend everything.
            None => crate::policy::select::all(&mut hw.plan, lim.lo, lim.hi, cx.io.cache.block_size),
        }
        (1, 0, false)
    }
}
