//! Twilight's top-p on the CPU: prunes the selector's positions by their weights estimated from the INT4
//! copy of the keys (`cpu::sparse::estimate_weights`), keeping the minimal set of [`super::select`].

use crate::cpu::sparse::{code_bytes, estimate_weights, CpuLaterStage, HeadWork, Scratch, SelectCx};
use super::TopP;
use crate::stats::Counters;

impl CpuLaterStage for TopP {
    /// The plan becomes the kept tokens; a unit's priority (ART's order) becomes its estimated mass.
    fn prune(&self, cx: &SelectCx, hw: &mut HeadWork, sc: &mut Scratch, c: &mut Counters) -> u64 {
        let (io, lim, blocks) = (cx.io, cx.lim, cx.blocks);
        let (d, bs, g) = (io.cache.head_dim, io.cache.block_size, io.group());
        let head = hw.head;
        let meta = cx.ctx.meta.expect("engine checked int4 metadata");
        sc.tokens.clear();
        for &(a, b) in &hw.cand.spans {
            sc.tokens.extend(a as u32..b as u32);
        }
        let n = sc.tokens.len();
        c[super::CANDIDATES] += n as u64;
        let meta_bytes = (n * (code_bytes(d) + 4)) as u64;
        estimate_weights(&hw.q, g, d, &sc.tokens, blocks, bs, head, meta, io.params.softcap, &mut sc.p_rows);
        let kept = super::select(&sc.p_rows, g, n, self.p, &mut sc.w, &mut sc.keep);
        c[super::KEPT] += kept as u64;
        let mut mass: Vec<(usize, f32)> = Vec::new();
        hw.plan.clear(0);
        for (j, &t) in sc.tokens.iter().enumerate() {
            if !sc.keep[j] {
                continue;
            }
            hw.plan.entries.push(t);
            let wj = (0..g).map(|r| sc.p_rows[r * n + j]).fold(0f32, f32::max);
            let blk = t as usize / bs;
            match mass.last_mut() {
                Some(m) if m.0 == blk => m.1 += wj,
                _ => mass.push((blk, wj)),
            }
        }
        let score = |blk: usize| mass.binary_search_by_key(&blk, |m| m.0).map_or(f32::NAN, |i| mass[i].1);
        hw.entry_score.clear();
        hw.entry_score.extend(hw.plan.entries.iter().map(|&t| score(t as usize / bs)));
        hw.cand.from_plan(&hw.plan, lim.lo, lim.hi, bs, 1, score, &mut sc.part);
        meta_bytes
    }
}
