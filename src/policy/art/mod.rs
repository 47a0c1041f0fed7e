//! ART: attention run-time termination (the ART paper, §3.2–3.3, Algorithm 1), defined so that the CUDA
//! decode kernel makes the same decisions from the same f32 values.
//!
//! * **Step**: a *tile* of [`ART_TILE`] = 64 consecutive slots of the row's visit order (the plan's entries
//!   in ART's order, each entry `1 << unit_log2` slots, positions outside the row's visible range masked):
//!   one round of the tensor-core kernel's 4 warps × 16 keys. Patience counts tiles.
//! * **Probe** (`probe=lanes`, the paper's): the leading accumulator element of each of the 32 lanes of
//!   warp 0 in the `mma.m16n8k16` C-fragment layout, where the query heads of the GQA group are the rows:
//!   lane `j = 4r + c` holds output row `r` (query head `r` of the group, `r < 8`), dimension `2c`. The
//!   element is normalised by the row's running sum (the paper's O(t), Appendix A), so `tau` is absolute in
//!   output units. Rows past the group are the kernel's zero padding (they add 0 to every sum).
//! * **Decision** (Eq. 2–3): `d_scale = ‖x(t) − x(t−1)‖₂`, `d_dir = 1 − cos(x(t), x(t−1))`; the tile is
//!   stable when `d_scale < tau` and `d_dir < phi`; `patience` consecutive stable tiles stop the traversal.
//!   `x(0) = 0` (Algorithm 1's `O(0) = 0`). The four lane sums are formed in a warp's xor-butterfly order
//!   (16, 8, 4, 2, 1) with every product and sum rounded on its own ([`lane_sum`]), so the GPU reproduces
//!   the decision from the same probe values bit for bit.
//! * `probe=full` (the paper's oracle, Appendix B) compares the whole normalised output of every row of
//!   the group, in f64 (a CPU-side measure of the probe's quality, not a GPU mode).
//!
//! Here: the decision, the order and the tiles; the CPU engine's traversal ([`CpuTraversal`] for [`Art`]:
//! tiles attended in order, segment by segment, until the decision stops); the parser. The CUDA side is
//! [`cuda`] (the attention kernel's traversal hook, kernels/policy/art/).

pub mod cuda;

use std::any::Any;

use super::kind::SelectorKind;
use super::spec::{Arg, Args};
use crate::cpu::sparse::{attend_set_at, isa, CpuLaterStage, CpuTraversal, ForwardIo, HeadWork, RowLimits, RowsState, Scratch, SeqKv};
use crate::error::Result;
use crate::stats::Counters;

use super::plan::HeadPlan;

/// Traversal order of ART (sink units always come first). The spec's `order=auto` (default) is resolved
/// at parse time from the selector ([`default_order`], ART paper §3.3): recency for `all`/`streaming`,
/// priority for the scored selectors (`quest`, `snapkv`, and any pipeline with `top_p`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    Recent,
    Priority,
}

/// What ART compares between tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The paper's probe (§3.2): the leading accumulator element of each of the 32 lanes of warp 0 in the
    /// tensor-core layout (see `termination::probe_lanes`).
    Lanes,
    /// The whole normalised output of every query row of the group (the paper's oracle, Appendix B).
    Full,
}

/// Adaptive (early) termination of the block traversal.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Art {
    pub tau: f32,
    pub phi: f32,
    /// Consecutive stable blocks before stopping; `None` = never stop (`patience=inf`).
    pub patience: Option<u32>,
    pub order: Order,
    pub probe: Probe,
    /// Keys per independent segment of the traversal (a multiple of the 64-key tile), each terminated on
    /// its own and merged by log-sum-exp; `None` = one segment (the paper). Lets a GPU split the row.
    pub segment: Option<u32>,
}

/// ART terminates the traversal of the selector's plan (its order, not its entries); its terminating
/// attention kernel reads FP8 rows as the plan kernel does (the trait's defaults).
impl super::kind::LaterStageKind for Art {}

/// Slots (keys) per ART step.
pub const ART_TILE: usize = 64;
/// Lanes of the probe (one warp).
pub const PROBE_LANES: usize = 32;

/// The paper's probe of the running output: lane `4r + c` = `acc[r][2c] / l[r]` for `r < min(rows, 8)`,
/// 0 for the padding lanes. A row without weight (`l = 0`) or poisoned (`l = NaN`) gives NaN (unstable).
pub fn probe_lanes(acc: &[f32], l: &[f32], rows: usize, dim: usize, out: &mut [f32; PROBE_LANES]) {
    for (j, x) in out.iter_mut().enumerate() {
        let (r, c) = (j / 4, j % 4);
        *x = if r < rows { acc[r * dim + 2 * c] / l[r] } else { 0.0 };
    }
}

/// Sum of 32 lane values in the order of a warp's xor-shuffle reduction: `v[j] += v[j ^ o]` for
/// o = 16, 8, 4, 2, 1 (every lane ends with the same bits, since f32 addition is commutative).
pub fn lane_sum(mut v: [f32; PROBE_LANES]) -> f32 {
    let mut o = 16;
    while o > 0 {
        let w = v;
        for (j, x) in v.iter_mut().enumerate() {
            *x = w[j] + w[j ^ o];
        }
        o /= 2;
    }
    v[0]
}

/// `1 − cos` from the three lane sums: both probes zero count as aligned, one zero as orthogonal.
fn one_minus_cos(aa: f32, bb: f32, ab: f32) -> f32 {
    let cos = if aa == 0.0 && bb == 0.0 {
        1.0
    } else if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        ab / (aa.sqrt() * bb.sqrt())
    };
    1.0 - cos
}

/// `(d_scale, d_dir)` between two lane probes in the decision order (see the module doc).
pub fn lanes_stability(prev: &[f32; PROBE_LANES], cur: &[f32; PROBE_LANES]) -> (f32, f32) {
    let (mut dd, mut aa, mut bb, mut ab) = ([0f32; PROBE_LANES], [0f32; PROBE_LANES], [0f32; PROBE_LANES], [0f32; PROBE_LANES]);
    for j in 0..PROBE_LANES {
        let diff = cur[j] - prev[j];
        dd[j] = diff * diff;
        aa[j] = prev[j] * prev[j];
        bb[j] = cur[j] * cur[j];
        ab[j] = prev[j] * cur[j];
    }
    (lane_sum(dd).sqrt(), one_minus_cos(lane_sum(aa), lane_sum(bb), lane_sum(ab)))
}

/// `(d_scale, d_dir)` of the oracle (whole outputs), in f64.
pub fn full_stability(prev: &[f32], cur: &[f32]) -> (f64, f64) {
    let (mut dd, mut aa, mut bb, mut ab) = (0f64, 0f64, 0f64, 0f64);
    for (&x, &y) in prev.iter().zip(cur) {
        let (x, y) = (x as f64, y as f64);
        dd += (y - x) * (y - x);
        aa += x * x;
        bb += y * y;
        ab += x * y;
    }
    let cos = if aa == 0.0 && bb == 0.0 {
        1.0
    } else if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        ab / (aa.sqrt() * bb.sqrt())
    };
    (dd.sqrt(), 1.0 - cos)
}

/// Running state of one traversal (Algorithm 1): the previous probe and the stable-tile counter.
#[derive(Clone, Debug, Default)]
pub struct ArtState {
    prev: Vec<f32>,
    cur: Vec<f32>,
    stable_run: u32,
    /// Tiles observed so far.
    pub tiles: u32,
}

impl ArtState {
    /// Starts a traversal whose probe has `len` elements (`x(0) = 0`).
    pub fn reset(&mut self, len: usize) {
        self.prev.clear();
        self.prev.resize(len, 0.0);
        self.stable_run = 0;
        self.tiles = 0;
    }

    /// The probe buffer of the current tile, to be filled before [`observe`](Self::observe).
    pub fn cur_mut(&mut self, len: usize) -> &mut Vec<f32> {
        self.cur.resize(len, 0.0);
        &mut self.cur
    }

    /// Compares the current probe with the previous one; returns true when the traversal stops here.
    pub fn observe(&mut self, probe: Probe, tau: f32, phi: f32, patience: Option<u32>) -> bool {
        let stable = match probe {
            Probe::Lanes => {
                let (p, c): (&[f32; PROBE_LANES], &[f32; PROBE_LANES]) = (self.prev[..].try_into().expect("32 lanes"), self.cur[..].try_into().expect("32 lanes"));
                let (ds, dd) = lanes_stability(p, c);
                ds < tau && dd < phi
            }
            Probe::Full => {
                let (ds, dd) = full_stability(&self.prev, &self.cur);
                ds < tau as f64 && dd < phi as f64
            }
        };
        std::mem::swap(&mut self.prev, &mut self.cur);
        self.tiles += 1;
        self.stable_run = if stable { self.stable_run + 1 } else { 0 };
        matches!(patience, Some(p) if self.stable_run >= p)
    }
}

/// ART's visiting order of a plan's entries (the plan in increasing position order; paper §3.3): entries
/// holding a position below `sink_limit` first (in position order; the base method's sinks are kept),
/// then the newest entry (the row's own key and the freshest tokens), then the rest most recent first
/// (`Recent`) or by `score(entry index)` highest first (`Priority`; ties and unscored (NaN) entries by
/// recency, unscored after scored). Writes the ordered entry values to `out`.
pub fn order_entries(plan: &HeadPlan, sink_limit: usize, order: Order, score: impl Fn(usize) -> f32, out: &mut Vec<u32>) {
    out.clear();
    let n = plan.entries.len();
    let start = |i: usize| (plan.entries[i] as usize) << plan.unit_log2;
    let sinks = (0..n).take_while(|&i| start(i) < sink_limit).count();
    out.extend_from_slice(&plan.entries[..sinks]);
    if sinks == n {
        return;
    }
    let mut rest: Vec<usize> = (sinks..n - 1).rev().collect();
    out.push(plan.entries[n - 1]);
    if order == Order::Priority {
        let key = |i: usize| {
            let s = score(i);
            if s.is_nan() {
                f32::NEG_INFINITY
            } else {
                s
            }
        };
        // Stable sort of the recency order: ties keep the more recent entry first.
        rest.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
    }
    out.extend(rest.into_iter().map(|i| plan.entries[i]));
}

/// A traversal cut into tiles: tile `t` is `spans[bounds[t]..bounds[t + 1]]` (visible positions only).
#[derive(Clone, Debug, Default)]
pub struct Tiles {
    pub spans: Vec<(usize, usize)>,
    pub bounds: Vec<usize>,
}

impl Tiles {
    pub fn len(&self) -> usize {
        self.bounds.len().saturating_sub(1)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn tile(&self, t: usize) -> &[(usize, usize)] {
        &self.spans[self.bounds[t]..self.bounds[t + 1]]
    }

    /// Cuts the ordered entries (each `1 << unit_log2` slots) into tiles of [`ART_TILE`] slots, keeping
    /// the positions inside `lo..=hi`.
    pub fn build(&mut self, ordered: &[u32], unit_log2: u32, lo: usize, hi: usize) {
        self.spans.clear();
        self.bounds.clear();
        self.bounds.push(0);
        let u = 1usize << unit_log2;
        let mut slot = 0usize;
        for &e in ordered {
            let mut a = e as usize * u;
            let end = a + u;
            while a < end {
                let room = ART_TILE - slot % ART_TILE;
                let b = end.min(a + room);
                let (ca, cb) = (a.max(lo), b.min(hi + 1));
                if ca < cb {
                    let in_tile = self.spans.len() > *self.bounds.last().expect("bounds");
                    match self.spans.last_mut() {
                        Some(l) if in_tile && l.1 == ca => l.1 = cb,
                        _ => self.spans.push((ca, cb)),
                    }
                }
                slot += b - a;
                a = b;
                if slot % ART_TILE == 0 {
                    self.bounds.push(self.spans.len());
                }
            }
        }
        if slot % ART_TILE != 0 {
            self.bounds.push(self.spans.len());
        }
    }
}

/// One KV head's traversal on the CPU engine (`HeadWork::traversal`): the plan's entries in visiting
/// order and their tiles, the decision's state, per segment (first tile, tiles visited), and a segment's
/// own accumulator.
#[derive(Default)]
struct ArtHead {
    order: Vec<u32>,
    tiles: Tiles,
    state: ArtState,
    segs: Vec<(u32, u32)>,
    seg: Option<RowsState>,
    active: bool,
}

impl ArtHead {
    /// The head's work in its slot (made on first use, kept for the next call's buffers).
    fn of(slot: &mut Option<Box<dyn Any + Send>>) -> &mut ArtHead {
        if !slot.as_ref().is_some_and(|b| b.is::<ArtHead>()) {
            *slot = Some(Box::<ArtHead>::default());
        }
        slot.as_mut().and_then(|b| b.downcast_mut()).expect("set above")
    }

    fn get(slot: &Option<Box<dyn Any + Send>>) -> &ArtHead {
        slot.as_ref().and_then(|b| b.downcast_ref()).expect("ordered before it is read")
    }

    /// The spans of the tiles each segment visited before it stopped (in visiting order).
    fn visited(&self) -> impl Iterator<Item = &(usize, usize)> {
        self.segs.iter().flat_map(move |&(t0, n)| {
            let (a, b) = (t0 as usize, (t0 + n) as usize);
            let at = |t: usize| self.tiles.bounds.get(t.min(self.tiles.len())).copied().unwrap_or(0);
            self.tiles.spans[at(a)..at(b)].iter()
        })
    }
}

/// ART does not prune on the CPU: it orders the plan and terminates the traversal.
impl CpuLaterStage for Art {
    fn traversal(&self) -> Option<&dyn CpuTraversal> {
        Some(self)
    }
}

impl CpuTraversal for Art {
    fn order(&self, hw: &mut HeadWork, sink_limit: usize, lim: RowLimits) {
        let a = ArtHead::of(&mut hw.traversal);
        let sc_of = |i: usize| hw.entry_score.get(i).copied().unwrap_or(f32::NAN);
        order_entries(&hw.plan, sink_limit, self.order, sc_of, &mut a.order);
        a.tiles.build(&a.order, hw.plan.unit_log2, lim.lo, lim.hi);
    }

    fn attend(&self, io: &ForwardIo, blocks: &[u32], hws: &mut [HeadWork], sc: &mut Scratch, c: &mut Counters) {
        let art = self;
        let cache = io.cache;
        let (d, bs, g) = (cache.head_dim, cache.block_size, io.group());
        let kv_of = |head: usize| SeqKv { cache, blocks, head };
        let softcap = io.params.softcap;
        let plen = match art.probe {
            Probe::Lanes => PROBE_LANES,
            Probe::Full => g * d,
        };
        let steps = hws.iter_mut().map(|h| ArtHead::of(&mut h.traversal).tiles.len()).max().unwrap_or(0);
        // The traversal in segments of `segment` keys (whole tiles), each terminated on its own from
        // x(0) = 0 with its own accumulator (what one GPU split sees), merged by log-sum-exp; one
        // segment (the paper) accumulates straight into the row's state.
        let seg_tiles = art.segment.map_or(steps.max(1), |k| (k as usize / ART_TILE).max(1));
        for hw in hws.iter_mut() {
            ArtHead::of(&mut hw.traversal).segs.clear();
        }
        let mut lanes = [0f32; PROBE_LANES];
        let mut t0 = 0;
        while t0 < steps {
            let t1 = (t0 + seg_tiles).min(steps);
            let segmented = art.segment.is_some();
            for hw in hws.iter_mut() {
                let a = ArtHead::of(&mut hw.traversal);
                a.state.reset(plen);
                a.active = true;
                if segmented {
                    match &mut a.seg {
                        Some(st) if st.rows == g => st.reset(),
                        slot => *slot = Some(RowsState::new(g, d)),
                    }
                }
            }
            for t in t0..t1 {
                for hw in hws.iter_mut() {
                    let a = ArtHead::of(&mut hw.traversal);
                    if !a.active || t >= a.tiles.len() {
                        continue;
                    }
                    let spans = a.tiles.tile(t);
                    let n_tok: usize = spans.iter().map(|(a, b)| b - a).sum();
                    let st = if segmented { a.seg.as_mut() } else { hw.st.as_mut() }.expect("prepared");
                    // ART's probe reads the running output: attend in the decisions' arithmetic.
                    attend_set_at(isa::decisions(), st, &hw.q, &hw.limits, &kv_of(hw.head), spans, n_tok, &mut sc.tokens, softcap);
                    hw.attended += n_tok;
                    match art.probe {
                        Probe::Lanes => {
                            probe_lanes(&st.acc, &st.l, g, d, &mut lanes);
                            a.state.cur_mut(PROBE_LANES).copy_from_slice(&lanes);
                        }
                        Probe::Full => {
                            let cur = a.state.cur_mut(g * d);
                            for (r, row) in cur.chunks_exact_mut(d).enumerate() {
                                for (x, &a) in row.iter_mut().zip(&st.acc[r * d..(r + 1) * d]) {
                                    *x = a / st.l[r];
                                }
                            }
                        }
                    }
                    if a.state.observe(art.probe, art.tau, art.phi, art.patience) {
                        a.active = false;
                    }
                }
            }
            for hw in hws.iter_mut() {
                let a = ArtHead::of(&mut hw.traversal);
                if t0 < a.tiles.len() {
                    a.segs.push((t0 as u32, a.state.tiles));
                }
                if segmented {
                    let seg = a.seg.take().expect("set above");
                    hw.st.as_mut().expect("prepared").merge_from(&seg);
                    a.seg = Some(seg);
                }
            }
            t0 = t1;
        }
        for hw in hws.iter_mut() {
            let a = ArtHead::of(&mut hw.traversal);
            // Blocks whose keys a visited tile read (a tile may end inside a block).
            let mut blocks: Vec<usize> = a.visited().flat_map(|&(a, b)| a / bs..=(b - 1) / bs).collect();
            blocks.sort_unstable();
            blocks.dedup();
            hw.visited = blocks.len();
            let tiles_visited: u32 = a.segs.iter().map(|&(_, n)| n).sum();
            c.traversal_tiles_visited += tiles_visited as u64;
            c.traversal_tiles_total += a.tiles.len() as u64;
            c.blocks_visited += hw.visited as u64;
            c.blocks_skipped_termination += hw.cand.units.len().saturating_sub(hw.visited) as u64;
        }
    }

    fn visits(&self, hw: &HeadWork) -> (Vec<(usize, usize)>, (u32, u32)) {
        let a = ArtHead::get(&hw.traversal);
        let mut v: Vec<(usize, usize)> = a.visited().copied().collect();
        v.sort_unstable();
        (v, (a.segs.iter().map(|&(_, n)| n).sum(), a.tiles.len() as u32))
    }
}

/// `art(tau, phi, patience, order, probe, segment)`'s arguments (src/policy/registry.rs names the
/// stage), and its order when the spec gives one (else [`resolve_order`] picks it).
pub(crate) fn parse(src: &str, raw: Vec<Arg>) -> Result<(Art, Option<Order>)> {
    let mut a = Args::new(src, "art", raw, &["tau", "phi", "patience", "order", "probe", "segment"])?;
    let tau = a.num("tau", Some(1e-5), false, "a finite number >= 0", |v| v.is_finite() && v >= 0.0)?;
    let phi = a.num("phi", Some(1e-3), false, "a finite number >= 0", |v| v.is_finite() && v >= 0.0)?;
    let pat = a.num("patience", Some(5.0), true, "an integer >= 1 or `inf`", |v| v == f64::INFINITY || (v.fract() == 0.0 && v >= 1.0 && v <= u32::MAX as f64))?;
    let order = match a.word("order", "auto", &["auto", "recent", "priority"])? {
        "priority" => Some(Order::Priority),
        "recent" => Some(Order::Recent),
        _ => None,
    };
    let probe = match a.word("probe", "lanes", &["lanes", "full"])? {
        "full" => Probe::Full,
        _ => Probe::Lanes,
    };
    let seg = a.num("segment", Some(f64::INFINITY), true, "a multiple of 64 (keys), at least 64, or `inf`", |v| {
        v == f64::INFINITY || (v.fract() == 0.0 && v >= 64.0 && v <= (1u64 << 30) as f64 && v % 64.0 == 0.0)
    })?;
    let patience = if pat.is_infinite() { None } else { Some(pat as u32) };
    let segment = if seg.is_infinite() { None } else { Some(seg as u32) };
    Ok((Art { tau: tau as f32, phi: phi as f32, patience, order: Order::Recent, probe, segment }, order))
}

/// ART's default traversal (paper §3.3): recency-first for full and pattern-based selections, the
/// selector's priority for the scored ones (and behind a pruning stage, `top_p`, whose weights rank).
pub(crate) fn default_order(selector: &dyn SelectorKind, pruned: bool) -> Order {
    if pruned || selector.ranks_by_score() {
        Order::Priority
    } else {
        Order::Recent
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_sum_is_the_butterfly_order() {
        // Values whose sum depends on the order: the butterfly pairs lane j with j^16 first.
        let mut v = [0f32; 32];
        v[0] = 1e8;
        v[16] = -1e8;
        v[1] = 1.0;
        assert_eq!(lane_sum(v), 1.0);
        // Sequentially (1e8 + 1) - 1e8 = 0 in f32; the butterfly adds lanes 0 and 2 first: 1.
        let mut w = [0f32; 32];
        w[0] = 1e8;
        w[1] = 1.0;
        w[2] = -1e8;
        assert_eq!(w.iter().sum::<f32>(), 0.0);
        assert_eq!(lane_sum(w), 1.0);
        let ones = [1f32; 32];
        assert_eq!(lane_sum(ones), 32.0);
    }

    #[test]
    fn probe_takes_the_leading_fragment_elements() {
        let (rows, dim) = (3, 64);
        let acc: Vec<f32> = (0..rows * dim).map(|i| i as f32).collect();
        let l = [1.0, 2.0, 4.0];
        let mut x = [0f32; 32];
        probe_lanes(&acc, &l, rows, dim, &mut x);
        assert_eq!(&x[..4], &[0.0, 2.0, 4.0, 6.0]);
        assert_eq!(&x[4..8], &[64.0 / 2.0, 66.0 / 2.0, 68.0 / 2.0, 70.0 / 2.0]);
        assert_eq!(x[8], 128.0 / 4.0);
        assert!(x[12..].iter().all(|&v| v == 0.0), "padding rows");
        // Rows beyond 8 are not probed (the leading element covers the fragment's rows 0..7).
        let acc = vec![1f32; 12 * 16];
        probe_lanes(&acc, &[1.0; 12], 12, 16, &mut x);
        assert!(x.iter().all(|&v| v == 1.0));
    }

    #[test]
    fn decision_follows_algorithm_1() {
        let mut s = ArtState::default();
        let x = [0.5f32; 32];
        s.reset(32);
        // x(0) = 0: the first tile moves by ‖x‖ and is not stable.
        s.cur_mut(32).copy_from_slice(&x);
        assert!(!s.observe(Probe::Lanes, 1e-3, 1e-3, Some(2)));
        s.cur_mut(32).copy_from_slice(&x);
        assert!(!s.observe(Probe::Lanes, 1e-3, 1e-3, Some(2))); // stable 1
        s.cur_mut(32).copy_from_slice(&x);
        assert!(s.observe(Probe::Lanes, 1e-3, 1e-3, Some(2))); // stable 2 -> stop
        assert_eq!(s.tiles, 3);
        // patience = inf never stops.
        s.reset(32);
        for _ in 0..50 {
            s.cur_mut(32).copy_from_slice(&x);
            assert!(!s.observe(Probe::Lanes, 1.0, 1.0, None));
        }
        // A scale change of exactly tau is not below tau; the run restarts.
        s.reset(32);
        s.cur_mut(32).copy_from_slice(&x);
        s.observe(Probe::Lanes, 0.25, 1.0, Some(1));
        let mut y = x;
        y[0] += 0.25;
        s.cur_mut(32).copy_from_slice(&y);
        assert!(!s.observe(Probe::Lanes, 0.25, 1.0, Some(1)));
        s.cur_mut(32).copy_from_slice(&y);
        assert!(s.observe(Probe::Lanes, 0.25, 1.0, Some(1)));
        // Direction: a rotation with a small scale change is caught by phi only.
        let (mut a, mut b) = ([0f32; 32], [0f32; 32]);
        a[0] = 1e-4;
        b[1] = 1e-4;
        let (ds, dd) = lanes_stability(&a, &b);
        assert!(ds < 2e-4 && dd == 1.0);
        // NaN (a row without weight or poisoned) is never stable.
        let mut n = [0f32; 32];
        n[3] = f32::NAN;
        let (ds, dd) = lanes_stability(&n, &n);
        assert!(!(ds < 1.0) && !(dd < 1.0));
    }

    #[test]
    fn lanes_and_full_agree_on_the_full_lane_vector() {
        // With the probe being the whole vector (32 values), lanes (f32) and full (f64) agree closely.
        let a: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = a.iter().enumerate().map(|(i, &v)| v + 1e-4 * (i as f32).cos()).collect();
        let (ds, dd) = lanes_stability(a[..].try_into().unwrap(), b[..].try_into().unwrap());
        let (fs, fd) = full_stability(&a, &b);
        assert!((ds as f64 - fs).abs() < 1e-6 * fs.max(1e-9) + 1e-9);
        assert!((dd as f64 - fd).abs() < 1e-6, "{dd} {fd}");
    }

    fn plan(ulog2: u32, e: &[u32]) -> HeadPlan {
        HeadPlan { unit_log2: ulog2, entries: e.to_vec() }
    }

    #[test]
    fn order_sinks_newest_then_recency_or_priority() {
        let p = plan(4, &[0, 1, 2, 3]);
        let mut o = Vec::new();
        order_entries(&p, 1, Order::Recent, |_| f32::NAN, &mut o);
        assert_eq!(o, vec![0, 3, 2, 1]);
        let sc = [0.0, 3.0, 1.0, 2.0];
        order_entries(&p, 1, Order::Priority, |i| sc[i], &mut o);
        assert_eq!(o, vec![0, 3, 1, 2], "sink, newest (the row's own block), then by score");
        // Ties and unscored entries by recency; unscored after scored.
        let sc = [0.0, 5.0, f32::NAN, 5.0, 1.0, 9.0];
        order_entries(&plan(4, &[0, 1, 2, 3, 4, 5]), 1, Order::Priority, |i| sc[i], &mut o);
        assert_eq!(o, vec![0, 5, 3, 1, 4, 2]);
        // Token plans: streaming's sinks (first 4 tokens) first, then newest to oldest.
        let p = plan(0, &[0, 1, 2, 3, 90, 91, 92]);
        order_entries(&p, 4, Order::Recent, |_| f32::NAN, &mut o);
        assert_eq!(o, vec![0, 1, 2, 3, 92, 91, 90]);
        // A single sink entry is not listed twice.
        order_entries(&plan(4, &[0]), 1, Order::Priority, |_| 1.0, &mut o);
        assert_eq!(o, vec![0]);
        order_entries(&plan(4, &[]), 1, Order::Recent, |_| 1.0, &mut o);
        assert!(o.is_empty());
    }

    #[test]
    fn tiles_are_64_slots_of_the_visit_order() {
        let mut t = Tiles::default();
        // Blocks of 16, newest block partial (hi = 4*16 + 4): masked slots still take room in their tile.
        t.build(&[0, 4, 3, 2, 1], 4, 0, 68);
        assert_eq!(t.len(), 2);
        assert_eq!(t.tile(0), &[(0, 16), (64, 69), (48, 64), (32, 48)]);
        assert_eq!(t.tile(1), &[(16, 32)]);
        // Pages of 128 span two tiles; a sliding window masks the front.
        t.build(&[1, 0], 7, 100, 255);
        assert_eq!(t.len(), 4);
        assert_eq!(t.tile(0), &[(128, 192)]);
        assert_eq!(t.tile(1), &[(192, 256)]);
        assert_eq!(t.tile(2), &[] as &[(usize, usize)]);
        assert_eq!(t.tile(3), &[(100, 128)]);
        // Tokens: descending single positions, 64 per tile.
        let toks: Vec<u32> = (0..130).rev().collect();
        t.build(&toks, 0, 0, 1000);
        assert_eq!(t.len(), 3);
        assert_eq!(t.tile(0).len(), 64);
        assert_eq!(t.tile(0)[0], (129, 130));
        assert_eq!(t.tile(2), &[(1, 2), (0, 1)]);
        // Adjacent ascending pieces inside one tile merge.
        t.build(&[0, 1, 2, 3, 4], 0, 0, 10);
        assert_eq!(t.tile(0), &[(0, 5)]);
    }
}

/// This stage's spec forms: defaults, values and refusals (each message names the position and the key).
#[cfg(test)]
mod spec_tests {
    use crate::policy::registry::{parse, refusal as msg};
    use crate::policy::*;

    #[test]
    fn parses_the_example() {
        let s = parse("quest(budget=4096) > top_p(p=0.95) > art(tau=1e-5, phi=1e-3, patience=5)").unwrap();
        let p = s.pipeline.unwrap();
        assert_eq!(p.selector, Selector::Quest(Quest { budget: 4096, page: 16, sink: 0 }));
        assert_eq!(p.top_p, Some(TopP { p: 0.95 }));
        let a = p.art.unwrap();
        assert_eq!((a.tau, a.phi, a.patience, a.order, a.probe), (1e-5, 1e-3, Some(5), Order::Priority, Probe::Lanes));
        let order = |spec: &str| parse(spec).unwrap().pipeline.unwrap().art.unwrap().order;
        assert_eq!(order("art"), Order::Recent);
        assert_eq!(order("streaming(recent=64) > art"), Order::Recent);
        assert_eq!(order("quest(budget=64) > art"), Order::Priority);
        assert_eq!(order("snapkv(budget=64) > art"), Order::Priority);
        assert_eq!(order("top_p > art"), Order::Priority);
        assert_eq!(order("quest(budget=64) > art(order=recent)"), Order::Recent);
        assert_eq!(order("art(order=priority)"), Order::Priority);
        assert_eq!(s.dense_layers, 2);
    }

    #[test]
    fn art_spec() {
        let s = parse("art(patience=inf, order=priority, probe=full); dense_layers=3").unwrap();
        assert_eq!(s.dense_layers, 3);
        let p = s.pipeline.unwrap();
        assert_eq!(p.selector, Selector::All);
        assert_eq!(p.art.unwrap().patience, None);
        assert!(msg("art(tau=-1e-5)").contains("art.tau"));
        assert!(msg("art(phi=-1)").contains("art.phi"));
        assert!(msg("art(patience=0)").contains("patience"));
        assert!(msg("art(segment=100)").contains("art.segment"));
        assert!(msg("art(segment=0)").contains("art.segment"));
        assert_eq!(parse("art(segment=4096)").unwrap().pipeline.unwrap().art.unwrap().segment, Some(4096));
        assert_eq!(parse("art").unwrap().pipeline.unwrap().art.unwrap().segment, None);
        assert_eq!(parse("art(segment=inf)").unwrap().pipeline.unwrap().art.unwrap().segment, None);
        assert!(msg("art(order=oldest)").contains("recent, priority"));
        assert!(msg("art > quest(budget=8)").contains("first stage"));
        assert!(msg("art > top_p").contains("before `art`"));
        assert!(msg("dense > art").contains("alone"));
        assert!(msg("all ! art").contains("position 4"));
    }
}
