//! AttentionPredictor's agreement check (design.md "Decisions on the GPU: agreement, not bit equality").
//! The CUDA engine computes a decode row's history row from tensor-core logits over 16-bit caches (in the
//! CPU's arithmetic, bit for bit, over f32 and FP8 caches and for prefill seeds) and its CNN in other
//! arithmetic (fused multiply-adds, the second convolution on tensor cores in 3xBF16), so a predicted set
//! may differ from the CPU's at blocks whose scores lie within the device's error bound of the selection
//! boundary; after such a difference the two histories part ways (the rows of predicted steps hold the
//! attended positions' weights).
//!
//! So each (sequence, KV head) keeps a mirror of the *GPU's* history (which positions each row was over,
//! from the GPU's own visits) and its schedule, and every predicted decode row's GPU set is checked
//! against the exact (f64) prediction from the mirror: every differing block must lie within `delta` of
//! the boundary (the m-th / (m+1)-th largest reference score), `delta` twice the largest per-block bound
//! of the device's error ([`Cnn64::predict`], its input error from [`Exact::row`]; docs/policies.md "On
//! the GPU"). The CPU engine's sets are compared too, for the count of rows that differ from them.

use std::collections::{BTreeSet, VecDeque};

use kvsparse::policy::predictor::{crop, PredictorWeights};
use kvsparse::policy::PredictorSpec;

/// The CNN's weights in f64.
pub struct Cnn64 {
    c1: usize,
    c2: usize,
    w1: Vec<f64>,
    b1: Vec<f64>,
    w2: Vec<f64>,
    b2: Vec<f64>,
    w3: Vec<f64>,
    b3: f64,
}

const U: f64 = 1.0 / 16_777_216.0; // 2^-24

impl Cnn64 {
    pub fn new(w: &PredictorWeights) -> Self {
        let f: Vec<f64> = w.flat().into_iter().map(f64::from).collect();
        let (c1, c2) = (w.c1, w.c2);
        let mut at = 0;
        let mut take = |n: usize| {
            at += n;
            f[at - n..at].to_vec()
        };
        let (w1, b1, w2, b2, w3) = (take(c1 * 9), take(c1), take(c2 * c1 * 9), take(c2), take(c2));
        Cnn64 { c1, c2, w1, b1, w2, b2, w3, b3: f[at] }
    }

    /// Exact scores of the crop `start .. start + width` from the image of `rows` (oldest first, at most
    /// `h`, entries >= 0), and per block the bound of the CUDA engine's error when each image entry it holds
    /// is within relative `ex` of the exact one. Bound, with u = 2^-24 (docs/policies.md): first
    /// convolution (f32, 10 terms, fused or not) dy1 = ex a1 + 10 u (|b1| + a1), a1 = sum |w1| x; second
    /// (3xBF16: each operand split into bf16 hi + lo, within 2^-16 of it, and hi*hi + hi*lo + lo*hi, exact
    /// bf16 products: each product within 3.1 * 2^-16 < 800 u of exact; 3 K + 1 f32 additions that may
    /// truncate, 2u each) dy2 = sum |w2| dy1 + (800 u + (3 K + 2) 2u)(|b2| + sum |w2| y1); the 1x1 convolution
    /// dz = sum |w3| dy2 + (c2 + 1) 2u sum |w3 relu(y2)|; the time average dp = mean dz + (h + 2) 2u
    /// (|b3| + mean |z|); all times 1.01 for second-order terms.
    pub fn predict(&self, rows: &VecDeque<Vec<f64>>, h: usize, start: usize, width: usize, ex: f64) -> (Vec<f64>, Vec<f64>) {
        let (c1, c2, w) = (self.c1, self.c2, width);
        let mut x = vec![0f64; h * w];
        let used = rows.len().min(h);
        for (k, row) in rows.iter().skip(rows.len() - used).enumerate() {
            let t = h - used + k;
            for (b, &s) in row.iter().skip(start).take(w).enumerate() {
                x[t * w + b] = s.max(0.0);
            }
        }
        let at = |t: isize, b: isize| -> Option<usize> { (t >= 0 && (t as usize) < h && b >= 0 && (b as usize) < w).then(|| t as usize * w + b as usize) };
        let (mut y1, mut dy1) = (vec![0f64; c1 * h * w], vec![0f64; c1 * h * w]);
        for c in 0..c1 {
            for t in 0..h {
                for b in 0..w {
                    let (mut acc, mut a1) = (self.b1[c], 0f64);
                    for dt in 0..3 {
                        for db in 0..3 {
                            if let Some(i) = at(t as isize + dt as isize - 1, b as isize + db as isize - 1) {
                                acc += self.w1[c * 9 + dt * 3 + db] * x[i];
                                a1 += self.w1[c * 9 + dt * 3 + db].abs() * x[i];
                            }
                        }
                    }
                    y1[(c * h + t) * w + b] = acc.max(0.0);
                    dy1[(c * h + t) * w + b] = ex * a1 + 10.0 * U * (self.b1[c].abs() + a1);
                }
            }
        }
        let k = c1 * 9;
        let c2_err = 800.0 * U + (3 * k + 2) as f64 * 2.0 * U;
        // Columns in parallel (the checks run this for every predicted row).
        use rayon::prelude::*;
        let cols: Vec<(f64, f64)> = (0..w).into_par_iter().map(|b| {
            let (mut zsum, mut zabs, mut dzsum) = (0f64, 0f64, 0f64);
            for t in 0..h {
                let (mut z, mut zw, mut dz) = (0f64, 0f64, 0f64);
                for o in 0..c2 {
                    let (mut y2, mut s2, mut d2) = (self.b2[o], 0f64, 0f64);
                    for c in 0..c1 {
                        for dt in 0..3 {
                            for db in 0..3 {
                                if let Some(i) = at(t as isize + dt as isize - 1, b as isize + db as isize - 1) {
                                    let wv = self.w2[(o * c1 + c) * 9 + dt * 3 + db];
                                    let j = c * h * w + i;
                                    y2 += wv * y1[j];
                                    s2 += wv.abs() * y1[j];
                                    d2 += wv.abs() * dy1[j];
                                }
                            }
                        }
                    }
                    d2 += c2_err * (self.b2[o].abs() + s2);
                    z += self.w3[o] * y2.max(0.0);
                    zw += (self.w3[o] * y2.max(0.0)).abs();
                    dz += self.w3[o].abs() * d2;
                }
                dz += (c2 + 1) as f64 * 2.0 * U * zw;
                zsum += z;
                zabs += z.abs();
                dzsum += dz;
            }
            (self.b3 + zsum / h as f64, 1.01 * (dzsum / h as f64 + (h + 2) as f64 * 2.0 * U * (self.b3.abs() + zabs / h as f64)))
        }).collect();
        cols.into_iter().unzip()
    }
}

/// What one history row was computed from: the token's queries of the KV head (`g x d`, as stored), the
/// positions it was over (ascending) and the row's length `n` (positions seen).
#[derive(Clone, Debug)]
pub struct RowSrc {
    pub seq: usize,
    pub q: Vec<f64>,
    pub pos: Vec<usize>,
    pub n: usize,
    /// Its exact block row and relative bound ([`Exact::row`]), when computed once at the push.
    pub exact: Option<(Vec<f64>, f64)>,
}

/// The GPU's history and schedule of one (sequence, KV head), mirrored.
#[derive(Default)]
pub struct Mirror {
    pub rows: VecDeque<RowSrc>,
    pub since: usize,
}

impl Mirror {
    pub fn push(&mut self, r: RowSrc, h: usize) {
        self.rows.push_back(r);
        while self.rows.len() > h {
            self.rows.pop_front();
        }
    }
}

/// Exact inputs: `key(seq, pos, head)` as stored, to f64; the attention scale and soft-cap.
pub struct Exact<'a> {
    pub key: &'a dyn Fn(usize, usize, usize) -> Vec<f64>,
    pub head: usize,
    pub group: usize,
    pub d: usize,
    pub scale: f64,
    pub softcap: f64,
}

impl Exact<'_> {
    /// The exact block row of `r` (weights normalised over its positions, max over the group and each
    /// block), and the relative bound of the device's entries. Its logits are within Lambda of exact
    /// (refresh_agree's bound: the decisions' f32 dot of the scaled query, or the tensor cores' f32
    /// accumulation of exact 16-bit products, then the scale, soft-cap and base-2 steps); its normaliser
    /// (the CPU's fixed-point sum, or the f32 sums of the CTAs' statistics merged) within relative
    /// Z = (n + 256) 2^-24 for n positions (any order of n f32 additions of positive terms, plus the
    /// merges' rescalings); so a weight within exp(2 Lambda + Z) - 1, plus 2^-20 for the exponentials.
    pub fn row(&self, r: &RowSrc, block: usize) -> (Vec<f64>, f64) {
        let (g, d) = (self.group, self.d);
        let keys: Vec<Vec<f64>> = r.pos.iter().map(|&p| (self.key)(r.seq, p, self.head)).collect();
        let mut row = vec![0f64; r.n.div_ceil(block)];
        let (mut max_abs_dot, mut max_logit) = (0f64, 0f64);
        for gi in 0..g {
            let q = &r.q[gi * d..(gi + 1) * d];
            let l: Vec<f64> = keys
                .iter()
                .map(|k| {
                    let (dot, abs) = q.iter().zip(k).fold((0f64, 0f64), |(s, a), (x, y)| (s + x * y, a + (x * y).abs()));
                    max_abs_dot = max_abs_dot.max(abs * self.scale);
                    let x = dot * self.scale;
                    let l = if self.softcap > 0.0 { self.softcap * (x / self.softcap).tanh() } else { x };
                    max_logit = max_logit.max(l.abs());
                    l
                })
                .collect();
            let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = l.iter().map(|&x| (x - m).exp()).sum();
            for (&x, &p) in l.iter().zip(&r.pos) {
                let b = p / block;
                row[b] = row[b].max((x - m).exp() / z);
            }
        }
        let lambda = max_abs_dot * (d as f64 * 2.0 * U + (d as f64 + 1.0) * U) + 8.0 * U * max_logit + self.softcap * 2f64.powi(-17);
        let z = (r.pos.len() as f64 + 256.0) * U;
        (row, (2.0 * lambda + z).exp() - 1.0 + 2f64.powi(-20))
    }
}

/// The outcome of one checked row: blocks that differ from the reference's set, the worst margin (absolute
/// score distance past the boundary) and the delta it was held to; or a violation.
#[derive(Clone, Debug, Default)]
pub struct RowCheck {
    pub differing: usize,
    pub worst_margin: f64,
    pub delta: f64,
    pub violation: Option<String>,
}

/// Checks the GPU's positions `gpu` (ascending) of a predicted decode row seeing `lo .. n` against the
/// exact prediction from the mirrored history `m`.
pub fn check_predicted(cnn: &Cnn64, ex: &Exact, m: &Mirror, ps: &PredictorSpec, lo: usize, n: usize, gpu: &[usize]) -> RowCheck {
    let mut out = RowCheck::default();
    let blk = ps.block;
    let nb = n.div_ceil(blk);
    let (rows, ebound): (VecDeque<Vec<f64>>, Vec<f64>) = m.rows.iter().map(|r| r.exact.clone().unwrap_or_else(|| ex.row(r, blk))).unzip();
    let e = ebound.iter().copied().fold(0f64, f64::max);
    let (start, width) = crop(nb, blk, ps.sink, ps.local);
    let (pred, bound) = cnn.predict(&rows, ps.history, start, width, e);
    let score = |b: usize| if b >= start && b < start + width { pred[b - start] } else { f64::NEG_INFINITY };
    let (sink_end, local_start) = (ps.sink.min(n), n.saturating_sub(ps.local));
    let covered = |b: usize| ((b + 1) * blk).min(n) <= sink_end || b * blk >= local_start;
    let mut cand: Vec<usize> = (0..nb).filter(|&b| !covered(b)).collect();
    cand.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(b.cmp(&a)));
    let mm = (ps.budget.saturating_sub(ps.sink + ps.local) / blk).min(cand.len());
    let reference: BTreeSet<usize> = cand[..mm].iter().copied().collect();
    // The GPU's blocks: those with a visited position outside the sink and the local window.
    let gs: BTreeSet<usize> = gpu.iter().filter(|&&p| p >= sink_end && p < local_start).map(|&p| p / blk).collect();
    // Its positions must be exactly the sink's, the window's and those blocks' (visible ones).
    let want: Vec<usize> = (lo..n).filter(|&p| p < sink_end || p >= local_start || gs.contains(&(p / blk))).collect();
    if want != gpu {
        out.violation = Some(format!("the GPU's positions are not sink + local window + whole blocks ({} listed, {} expected)", gpu.len(), want.len()));
        return out;
    }
    out.delta = 2.0 * bound.iter().copied().fold(0f64, f64::max);
    let visible = |b: usize| (b * blk).max(lo).max(sink_end) < ((b + 1) * blk).min(n).min(local_start);
    let (top, next) = (if mm > 0 { score(cand[mm - 1]) } else { f64::INFINITY }, cand.get(mm).map_or(f64::NEG_INFINITY, |&b| score(b)));
    for &b in cand.iter().filter(|&&b| visible(b)) {
        let (inr, ing) = (reference.contains(&b), gs.contains(&b));
        if inr == ing {
            continue;
        }
        out.differing += 1;
        // A block the GPU added displaced one of the reference's (score >= top); one it left out was
        // displaced by one outside the reference (score <= next).
        let margin = if ing { top - score(b) } else { score(b) - next };
        let margin = if margin.is_nan() { f64::INFINITY } else { margin };
        out.worst_margin = out.worst_margin.max(margin);
        if margin > out.delta {
            out.violation.get_or_insert_with(|| format!("block {b} ({}) differs at margin {margin:.3e} from the boundary, past delta {:.3e}", if ing { "GPU only" } else { "reference only" }, out.delta));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsparse::rng::Rng;

    /// The f64 network is the library's (its f32 prediction lies within the stated bound of the exact
    /// one, which covers f32 arithmetic), on random histories of attention-like rows.
    #[test]
    fn exact_cnn_matches_the_library_within_the_bound() {
        let w = PredictorWeights::builtin().unwrap();
        let cnn = Cnn64::new(w);
        let mut rng = Rng::new(11);
        for &(h, nrows, nb) in &[(8usize, 8usize, 30usize), (16, 9, 41), (6, 6, 12)] {
            let rows32: VecDeque<Vec<f32>> = (0..nrows).map(|i| (0..nb - (nrows - i) / 4).map(|_| (rng.uniform() as f32).powi(5)).collect()).collect();
            let rows64: VecDeque<Vec<f64>> = rows32.iter().map(|r| r.iter().map(|&x| x as f64).collect()).collect();
            let (start, width) = crop(nb, 16, 32, 48);
            let got = w.predict(&rows32, h, start, width);
            let (exact, bound) = cnn.predict(&rows64, h, start, width, 0.0);
            for b in 0..width {
                let e = (got[b] as f64 - exact[b]).abs();
                assert!(e <= bound[b], "h {h} block {b}: f32 {} exact {} error {e:.3e} bound {:.3e}", got[b], exact[b], bound[b]);
                // The bound is dominated by the 3xBF16 products (about 5e-5 of each term); it stays well
                // under a percent of the scores' scale, or it would let any set through.
                assert!(bound[b] < 5e-3 * exact.iter().map(|x| x.abs()).fold(1e-6, f64::max), "a bound that allows anything: {:.3e}", bound[b]);
            }
        }
    }

    /// The bound of [`Exact::row`] covers the tensor-core history row's arithmetic, emulated in f32: bf16
    /// queries and keys, their exact products summed in f32, the scale and log2 e applied in f32, per-CTA
    /// online statistics merged in order, 2^(l - lse) in f32; and it stays under 0.2% (a bound that allows
    /// anything would let any set through).
    #[test]
    fn exact_row_bound_covers_tensor_core_rows() {
        use half::bf16;
        let mut rng = Rng::new(17);
        let (d, g, blk) = (64usize, 4usize, 16usize);
        let round = |x: f64| bf16::from_f64(x).to_f64();
        for &(n, parts, scale) in &[(300usize, 3usize, 0.125f64), (1000, 16, 0.0883883), (77, 1, 0.25)] {
            let keys: Vec<Vec<f64>> = (0..n).map(|_| (0..d).map(|_| round(rng.normal() * 1.5)).collect()).collect();
            let key = |_: usize, p: usize, _: usize| keys[p].clone();
            let ex = Exact { key: &key, head: 0, group: g, d, scale, softcap: 0.0 };
            let r = RowSrc { seq: 0, q: (0..g * d).map(|_| round(rng.normal() * 1.5)).collect(), pos: (0..n).collect(), n, exact: None };
            let (exact, eps) = ex.row(&r, blk);
            let mut dev = vec![0f32; n.div_ceil(blk)];
            for gi in 0..g {
                let q = &r.q[gi * d..(gi + 1) * d];
                let l: Vec<f32> = keys
                    .iter()
                    .map(|k| {
                        let dot = q.iter().zip(k).fold(0f32, |a, (x, y)| a + (*x as f32) * (*y as f32));
                        dot * scale as f32 * std::f32::consts::LOG2_E
                    })
                    .collect();
                let (mut m, mut z) = (f32::NEG_INFINITY, 0f32);
                for c in l.chunks(n.div_ceil(parts)) {
                    let (mut cm, mut cs) = (f32::NEG_INFINITY, 0f32);
                    for &x in c {
                        if x > cm {
                            cs = if cm == f32::NEG_INFINITY { 0.0 } else { cs * (cm - x).exp2() } + 1.0;
                            cm = x;
                        } else {
                            cs += (x - cm).exp2();
                        }
                    }
                    let mm = m.max(cm);
                    z = if m == f32::NEG_INFINITY { 0.0 } else { z * (m - mm).exp2() } + cs * (cm - mm).exp2();
                    m = mm;
                }
                let lse = m + z.log2();
                for (p, &x) in l.iter().enumerate() {
                    dev[p / blk] = dev[p / blk].max((x - lse).exp2());
                }
            }
            let worst = exact.iter().zip(&dev).map(|(&e, &v)| ((v as f64) - e).abs() / e).fold(0f64, f64::max);
            assert!(worst <= eps, "n {n}: emulated tensor-core row off by {worst:.3e} relative, bound {eps:.3e}");
            assert!(eps < 2e-3, "n {n}: a bound of {eps:.3e} would let any row through");
        }
    }

    /// A GPU set equal to the exact prediction's passes; one that swaps a clearly best block for a clearly
    /// worst one fails; positions that are not whole blocks fail.
    #[test]
    fn check_predicted_accepts_the_reference_and_rejects_clear_swaps() {
        let (d, g, n) = (16usize, 2usize, 400usize);
        let ps = PredictorSpec { budget: 16 + 16 + 48, block: 16, history: 6, calib: 5, sink: 16, local: 16 };
        let mut rng = Rng::new(5);
        let keys: Vec<Vec<f64>> = (0..n).map(|_| (0..d).map(|_| rng.normal()).collect()).collect();
        let key = |_: usize, p: usize, _: usize| keys[p].clone();
        let ex = Exact { key: &key, head: 0, group: g, d, scale: 0.5, softcap: 0.0 };
        let mut m = Mirror::default();
        for i in 0..6 {
            let nn = n - 6 + i;
            m.push(RowSrc { seq: 0, q: (0..g * d).map(|_| rng.normal()).collect(), pos: (0..nn).collect(), n: nn, exact: None }, ps.history);
        }
        let cnn = Cnn64::new(PredictorWeights::builtin().unwrap());
        let rows: VecDeque<Vec<f64>> = m.rows.iter().map(|r| ex.row(r, 16).0).collect();
        let nb = n.div_ceil(16);
        let (start, width) = crop(nb, 16, 16, 16);
        let (pred, _) = cnn.predict(&rows, ps.history, start, width, 0.0);
        let mut order: Vec<usize> = (0..width).map(|i| i + start).collect();
        order.sort_by(|&a, &b| pred[b - start].total_cmp(&pred[a - start]).then(b.cmp(&a)));
        let set = |blocks: &[usize]| -> Vec<usize> { (0..n).filter(|&p| p < 16 || p >= n - 16 || blocks.contains(&(p / 16))).collect() };
        let ok = check_predicted(&cnn, &ex, &m, &ps, 0, n, &set(&order[..3]));
        assert!(ok.violation.is_none() && ok.differing == 0, "{ok:?}");
        assert!(ok.delta > 0.0 && ok.delta < 1e-3, "{ok:?}");
        let last = *order.last().unwrap();
        let bad = check_predicted(&cnn, &ex, &m, &ps, 0, n, &set(&[order[1], order[2], last]));
        assert_eq!(bad.differing, 2, "{bad:?}");
        assert!(bad.violation.is_some(), "{bad:?}");
        let mut partial = set(&order[..3]);
        partial.retain(|&p| p != order[0] * 16 + 3);
        assert!(check_predicted(&cnn, &ex, &m, &ps, 0, n, &partial).violation.is_some());
    }
}
