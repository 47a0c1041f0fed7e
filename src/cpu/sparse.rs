//! Runs a policy pipeline for the decode rows of one forward call on the CPU: per (sequence, KV head), in
//! parallel on the engine's pool, select → prune (top-p) → order/terminate (ART), and attend exactly over
//! what is left with the same kernel dense attention uses ([`attend_spans`] / [`attend_tokens`]).
//!
//! The scoring kernels the decisions need live here too: Quest's page bound from the per-page min/max,
//! and Twilight's weight estimate from the INT4 copy of K. Both read only metadata, never K.

use std::sync::Arc;

use rayon::prelude::*;

use super::attention::{attend_spans, attend_tokens, RowLimits, RowsState, SeqKv, CHUNK};
use super::convert::{Isa, Portable};
use super::isa::{self, IsaLevel};
use super::forward::ForwardIo;
use super::math::fast_exp;
use super::metadata::LayerMeta;
use super::quantize::code_bytes;
use crate::policy::select::{self, Candidates};
use crate::policy::termination::{order_units, probe_dims, ArtState};
use crate::policy::{top_p, Pipeline, Selector, SnapSelection};
use crate::stats::Counters;

/// Everything one call's policy rows need besides the caller's tensors.
pub struct SparseCtx<'a> {
    pub pipeline: &'a Pipeline,
    /// Layer metadata (Quest min/max, INT4 K), present when the pipeline needs it.
    pub meta: Option<&'a LayerMeta>,
    /// SnapKV choices per decode sequence (same order as `seqs`), one entry per KV head.
    pub snap: Vec<Vec<Option<Arc<SnapSelection>>>>,
}

/// Reusable per-thread buffers, so a steady decode loop allocates little.
#[derive(Default)]
struct Scratch {
    st: Option<RowsState>,
    q: Vec<f32>,
    row: Vec<f32>,
    limits: Vec<RowLimits>,
    cand: Candidates,
    page_scores: Vec<f32>,
    p_rows: Vec<f32>,
    w: Vec<f32>,
    keep: Vec<bool>,
    tokens: Vec<u32>,
    order: Vec<usize>,
    merged: Vec<(usize, usize)>,
    art: ArtState,
    probe: Vec<f32>,
}

/// Below this many tokens per span on average, a selection is attended as a token list (full chunks).
const MIN_RUN_FOR_SPANS: usize = 8;

/// Policy attention for the decode sequences `seqs` (indices into the batch); returns the counters.
pub fn sparse_forward(io: &ForwardIo, seqs: &[usize], ctx: &SparseCtx, pool: &rayon::ThreadPool) -> Counters {
    let items: Vec<(usize, usize)> = (0..seqs.len()).flat_map(|i| (0..io.num_kv_heads).map(move |h| (i, h))).collect();
    let run = |sc: &mut Scratch, &(i, h): &(usize, usize)| -> Counters { run_item(io, seqs[i], h, ctx.snap.get(i).and_then(|v| v[h].clone()), ctx, sc) };
    if items.len() <= 1 || pool.current_num_threads() <= 1 {
        let mut sc = Scratch::default();
        let mut total = Counters::default();
        for it in &items {
            total.add(&run(&mut sc, it));
        }
        return total;
    }
    pool.install(|| {
        items
            .par_iter()
            .map_init(Scratch::default, run)
            .reduce(Counters::default, |mut a, b| {
                a.add(&b);
                a
            })
    })
}

fn run_item(io: &ForwardIo, s: usize, head: usize, snap: Option<Arc<SnapSelection>>, ctx: &SparseCtx, sc: &mut Scratch) -> Counters {
    let cache = io.cache;
    let (d, bs, g) = (cache.head_dim, cache.block_size, io.group());
    let sd = &io.batch.seqs[s];
    let pos = sd.seq_len - 1;
    let lim = RowLimits::causal(pos, io.params.window);
    let blocks = io.batch.blocks(s, bs);
    let kv = SeqKv { cache, blocks, head };
    let p = ctx.pipeline;
    let mut c = Counters { policy_rows: 1, ..Default::default() };
    c.blocks_eligible = (lim.hi / bs - lim.lo / bs + 1) as u64;
    let row_bytes = (2 * d * cache.dtype.size_bytes()) as u64;
    let mut meta_bytes = 0u64;

    sc.q.resize(g * d, 0.0);
    sc.row.resize(d, 0.0);
    io.load_queries(sd.q_start..sd.q_start + 1, head, &mut sc.q);
    io.limits(sd, sd.q_start..sd.q_start + 1, &mut sc.limits);

    // 1. Select.
    match p.selector {
        Selector::All => select::all(&mut sc.cand, lim.lo, lim.hi, bs),
        Selector::Streaming { sink, recent } => select::streaming(&mut sc.cand, lim.lo, lim.hi, sink, recent, bs),
        Selector::Quest { budget, page } => {
            let meta = ctx.meta.expect("engine checked quest metadata");
            let first_page = lim.lo / page;
            let last_page = lim.hi / page;
            sc.page_scores.clear();
            for pg in first_page..=last_page {
                let (a, b) = ((pg * page).max(lim.lo), ((pg + 1) * page).min(lim.hi + 1));
                let mut best = f32::NEG_INFINITY;
                let mut u0 = a / meta.unit;
                while u0 * meta.unit < b {
                    let (blk, u) = (u0 / meta.units_per_block, u0 % meta.units_per_block);
                    let (mn, mx) = meta.unit_minmax(blocks[blk] as usize, u, head);
                    for r in 0..g {
                        best = best.max(quest_bound(&sc.q[r * d..(r + 1) * d], mn, mx));
                    }
                    meta_bytes += (2 * d * 4) as u64;
                    u0 += 1;
                }
                sc.page_scores.push(best);
            }
            let kept = select::quest_pages(&sc.page_scores, first_page, budget, page);
            select::quest(&mut sc.cand, &kept, &sc.page_scores, first_page, lim.lo, lim.hi, page, bs);
        }
        Selector::SnapKv { .. } => match &snap {
            Some(sel) => {
                let fixed = sel.keep.iter().map(|&t| t as usize).filter(|&t| t >= lim.lo && t <= lim.hi && t < sel.prefill_len);
                let generated = sel.prefill_len.max(lim.lo)..lim.hi + 1;
                sc.cand.from_tokens(fixed.chain(generated), bs, 1, |_| f32::NAN);
            }
            // No prefill was seen for this sequence and layer: nothing to choose from, attend everything.
            None => select::all(&mut sc.cand, lim.lo, lim.hi, bs),
        },
    }

    // 2. Prune: Twilight top-p on INT4 estimates.
    if let Some(tp) = p.top_p {
        let meta = ctx.meta.expect("engine checked int4 metadata");
        sc.tokens.clear();
        for &(a, b) in &sc.cand.spans {
            sc.tokens.extend(a as u32..b as u32);
        }
        let n = sc.tokens.len();
        c.top_p_candidates += n as u64;
        meta_bytes += (n * (code_bytes(d) + 8)) as u64;
        estimate_weights(&sc.q, g, d, &sc.tokens, blocks, bs, head, meta, io.params.softcap, &mut sc.p_rows);
        let kept = top_p::select(&sc.p_rows, g, n, tp.p, &mut sc.w, &mut sc.keep);
        c.top_p_kept += kept as u64;
        // Rebuild the units from the kept tokens; a unit's priority becomes its estimated mass.
        let mut mass: Vec<(usize, f32)> = Vec::new();
        for (j, &t) in sc.tokens.iter().enumerate() {
            if !sc.keep[j] {
                continue;
            }
            let wj = (0..g).map(|r| sc.p_rows[r * n + j]).fold(0f32, f32::max);
            let blk = t as usize / bs;
            match mass.last_mut() {
                Some(m) if m.0 == blk => m.1 += wj,
                _ => mass.push((blk, wj)),
            }
        }
        let keep = std::mem::take(&mut sc.keep);
        let toks = std::mem::take(&mut sc.tokens);
        let kept_iter = toks.iter().zip(&keep).filter(|(_, &k)| k).map(|(&t, _)| t as usize);
        let score = |blk: usize| mass.binary_search_by_key(&blk, |m| m.0).map_or(f32::NAN, |i| mass[i].1);
        sc.cand.from_tokens(kept_iter, bs, 1, score);
        sc.keep = keep;
        sc.tokens = toks;
    }

    // 3. Attend (with ART: unit by unit, in order, until the probe is stable for `patience` units).
    let st = match &mut sc.st {
        Some(st) if st.rows == g => {
            st.reset();
            st
        }
        slot => slot.insert(RowsState::new(g, d)),
    };
    let cand = &sc.cand;
    let mut attended_tokens = 0usize;
    match p.art {
        None => {
            // Units split spans at block boundaries; coalesce them again so chunks stay full.
            sc.merged.clear();
            for &(a, b) in &cand.spans {
                match sc.merged.last_mut() {
                    Some(l) if l.1 == a => l.1 = b,
                    _ => sc.merged.push((a, b)),
                }
            }
            let n_tok = cand.tokens();
            attend_set(st, &sc.q, &sc.limits, &kv, &sc.merged, n_tok, &mut sc.tokens, io.params.softcap);
            attended_tokens = n_tok;
            c.blocks_visited = cand.units.len() as u64;
        }
        Some(art) => {
            order_units(cand, art.order, &mut sc.order);
            let dims = probe_dims(d, art.probe);
            sc.art.reset();
            let mut visited = 0;
            for &ui in &sc.order {
                let u = &cand.units[ui];
                let spans = cand.unit_spans(u);
                let n_tok: usize = spans.iter().map(|(a, b)| b - a).sum();
                attend_set(st, &sc.q, &sc.limits, &kv, spans, n_tok, &mut sc.tokens, io.params.softcap);
                attended_tokens += n_tok;
                visited += 1;
                sc.probe.clear();
                for r in 0..g {
                    let l = st.l[r];
                    for &i in &dims {
                        sc.probe.push(if l > 0.0 { st.acc[r * d + i] / l } else { f32::NAN });
                    }
                }
                if sc.art.observe(&sc.probe, dims.len(), art.tau, art.phi, art.patience) {
                    break;
                }
            }
            c.blocks_visited = visited as u64;
            c.blocks_skipped_termination = (cand.units.len() - visited) as u64;
        }
    }
    c.kv_bytes_read = attended_tokens as u64 * row_bytes + meta_bytes;
    io.store_rows(st, sd.q_start..sd.q_start + 1, head, &mut sc.row);
    c
}

/// Attends a set of spans: as spans when runs are long, as a token list (full chunks) when scattered.
#[allow(clippy::too_many_arguments)]
fn attend_set(st: &mut RowsState, q: &[f32], limits: &[RowLimits], kv: &SeqKv, spans: &[(usize, usize)], n_tok: usize, tokens: &mut Vec<u32>, softcap: f32) {
    if spans.is_empty() {
        return;
    }
    if n_tok >= MIN_RUN_FOR_SPANS * spans.len() {
        attend_spans(st, q, limits, kv, spans, softcap);
    } else {
        tokens.clear();
        for &(a, b) in spans {
            tokens.extend(a as u32..b as u32);
        }
        attend_tokens(st, q, limits, kv, tokens, softcap);
    }
}

/// Quest's upper bound of `q·k` over a page with channel-wise key bounds `[mn, mx]`:
/// `Σ_i max(q_i·mn_i, q_i·mx_i)`, which is `>=` the score of every key in the page.
#[inline]
pub fn quest_bound(q: &[f32], mn: &[f32], mx: &[f32]) -> f32 {
    let mut s = 0f32;
    for ((&qi, &a), &b) in q.iter().zip(mn).zip(mx) {
        s += (qi * a).max(qi * b);
    }
    s
}

/// Estimated softmax weights (`rows × n`, each row normalised to sum 1) of the candidate `tokens` from the
/// INT4 copy of K; `q` holds the scaled query rows. Codes are unpacked 32 tokens at a time and scored with
/// the same register-blocked kernel as exact attention: `q·k̂ = min·Σq + scale·(q·codes)`.
#[allow(clippy::too_many_arguments)]
pub fn estimate_weights(q: &[f32], rows: usize, d: usize, tokens: &[u32], blocks: &[u32], bs: usize, head: usize, meta: &LayerMeta, softcap: f32, out: &mut Vec<f32>) {
    match isa::detected() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { estimate_avx2(q, rows, d, tokens, blocks, bs, head, meta, softcap, out) },
        IsaLevel::Portable => estimate_generic::<Portable>(q, rows, d, tokens, blocks, bs, head, meta, softcap, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn estimate_avx2(q: &[f32], rows: usize, d: usize, tokens: &[u32], blocks: &[u32], bs: usize, head: usize, meta: &LayerMeta, softcap: f32, out: &mut Vec<f32>) {
    estimate_generic::<super::convert::Avx2>(q, rows, d, tokens, blocks, bs, head, meta, softcap, out)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn estimate_generic<I: Isa>(q: &[f32], rows: usize, d: usize, tokens: &[u32], blocks: &[u32], bs: usize, head: usize, meta: &LayerMeta, softcap: f32, out: &mut Vec<f32>) {
    let n = tokens.len();
    out.clear();
    out.resize(rows * n, 0.0);
    let sums: Vec<f32> = (0..rows).map(|r| q[r * d..(r + 1) * d].iter().sum()).collect();
    let mut kbuf = vec![0f32; CHUNK * d];
    let mut sc = vec![0f32; rows * CHUNK];
    let mut prm = [(0f32, 0f32); CHUNK];
    for (ci, part) in tokens.chunks(CHUNK).enumerate() {
        for (jj, &t) in part.iter().enumerate() {
            let t = t as usize;
            let (codes, mn, scl) = meta.row_q4(blocks[t / bs] as usize, t % bs, head);
            prm[jj] = (mn, scl);
            for (pair, &byte) in kbuf[jj * d..(jj + 1) * d].chunks_exact_mut(2).zip(codes) {
                pair[0] = (byte & 15) as f32;
                pair[1] = (byte >> 4) as f32;
            }
        }
        I::scores(&mut sc, q, &kbuf, rows, part.len(), d);
        for r in 0..rows {
            for (jj, &(mn, scl)) in prm[..part.len()].iter().enumerate() {
                let mut x = mn * sums[r] + scl * sc[r * CHUNK + jj];
                if softcap > 0.0 {
                    x = softcap * (x / softcap).tanh();
                }
                out[r * n + ci * CHUNK + jj] = x;
            }
        }
    }
    for r in 0..rows {
        let row = &mut out[r * n..(r + 1) * n];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f32;
        for x in row.iter_mut() {
            *x = fast_exp(*x - m);
            z += *x;
        }
        if z > 0.0 {
            let inv = 1.0 / z;
            for x in row.iter_mut() {
                *x *= inv;
            }
        }
    }
}
