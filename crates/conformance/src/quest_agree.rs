//! Quest's agreement check on CUDA (design.md "Decisions on the GPU: agreement, not bit equality"): the
//! device scores pages on tensor cores (kernels/policy/quest.cu: f16 products, f32 accumulation in
//! the tensor core's order, the query split into two f16 terms), so a page whose bound lies near the
//! row's cut may be kept by one engine and not the other. For each policy row whose page sets differ this
//! module computes the exact (f64) bound of every page from the CPU engine's f16 bounds and the query, and
//! checks every differing page against the row's k-th largest exact bound (the boundary of the cut).
//!
//! The bound (docs/policies.md, "Quest on the device"): with B(P) = scale * max_g max_c |q_gc| *
//! sum_c max(|min_c|, |max_c|), either engine's bound of page P is within eps * B(P) of the exact one,
//! eps = (6 D + 16) * 2^-23 (the device: the split's residual 2^-22, 2 * 2D products accumulated with
//! truncation, at most 17 * 2^-23 per 16-product step, and the final scaling; the CPU: D f32 additions
//! and products in its order). A differing page P must then satisfy |S(P) - S_k| <= delta, delta = 2 eps
//! max_P B(P) over the row. Ties (equal bounds) stay exact: the cut among equal scores is by position on
//! both engines.

use super::fixture::Fixture;
use super::reference::rel_err;
use super::top_p_agree::attend_f64;
use super::tolerance;
use kvsparse::meta::MetaSnapshot;
use kvsparse::stats::VisitRecord;

/// A Quest policy's settings (page, budget, sink in tokens).
#[derive(Clone, Copy, Debug)]
pub struct QuestSet {
    pub budget: usize,
    pub page: usize,
    pub sink: usize,
}

/// What a case came to.
#[derive(Clone, Debug, Default)]
pub struct QuestAgreement {
    /// Policy rows compared, rows whose page sets differ, differing pages.
    pub rows: usize,
    pub rows_differing: usize,
    pub differing: usize,
    /// Worst |S(P) - S_k| / delta over the differing pages (must be <= 1), and the largest delta (relative
    /// to the row's largest |S|) of any row.
    pub worst_ratio: f64,
    pub max_rel_delta: f64,
    /// GPU output against the reference over the GPU's own set (the CPU engine's output where the sets
    /// agree, an f64 attention over the GPU's tokens elsewhere), and the tolerance.
    pub out_rel: f64,
    pub out_tol: f64,
    pub violation: Option<String>,
    /// (query token, KV head) of the rows whose sets differ (their LSE follows the GPU's set).
    pub rows_apart: Vec<(usize, usize)>,
}

impl QuestAgreement {
    pub fn pass(&self) -> bool {
        self.violation.is_none() && self.out_rel <= self.out_tol
    }
}

fn tokens_of(v: &VisitRecord) -> Vec<usize> {
    v.spans.iter().flat_map(|&(a, b)| a..b).collect()
}

/// Row (s, h)'s exact page bounds over pages lo/page..=hi/page (index 0 = first page) and each page's
/// B(P) (see the module header).
fn exact_bounds(f: &Fixture, meta: &MetaSnapshot, s: usize, h: usize, lo: usize, hi: usize, page: usize) -> (Vec<f64>, Vec<f64>) {
    let sp = &f.spec;
    let (d, g, bs, hk) = (sp.head_dim, sp.num_q_heads / sp.num_kv_heads, sp.block_size, sp.num_kv_heads);
    let (qmin, qmax) = (meta.qmin.as_ref().expect("quest bounds"), meta.qmax.as_ref().expect("quest bounds"));
    let unit = page.min(bs);
    let upb = bs / unit;
    let t = f.query_start_loc[s] as usize;
    let qs = f.q_strides.map(|x| x as usize);
    let q: Vec<Vec<f64>> = (0..g).map(|gi| (0..d).map(|c| f.q.get(t * qs[0] + (h * g + gi) * qs[1] + c * qs[2])).collect()).collect();
    let qabs = q.iter().flatten().fold(0f64, |m, &x| m.max(x.abs()));
    let scale = f.scale as f64;
    let (mut sc, mut bb) = (Vec::new(), Vec::new());
    for pg in lo / page..=hi / page {
        let (a, b) = ((pg * page).max(lo), ((pg + 1) * page).min(hi + 1));
        let (mut best, mut big) = (f64::NEG_INFINITY, 0f64);
        let mut u0 = a / unit;
        while u0 * unit < b {
            let blk = f.block_table[s * f.max_blocks + u0 / upb] as usize;
            let at = ((blk * upb + u0 % upb) * hk + h) * d;
            let mn: Vec<f64> = (0..d).map(|c| half::f16::from_bits(qmin[at + c]).to_f64()).collect();
            let mx: Vec<f64> = (0..d).map(|c| half::f16::from_bits(qmax[at + c]).to_f64()).collect();
            for qr in &q {
                best = best.max(scale * (0..d).map(|c| (qr[c] * mn[c]).max(qr[c] * mx[c])).sum::<f64>());
            }
            big = big.max(scale * qabs * (0..d).map(|c| mn[c].abs().max(mx[c].abs())).sum::<f64>());
            u0 += 1;
        }
        sc.push(best);
        bb.push(big);
    }
    (sc, bb)
}

/// Checks the GPU's Quest visits against the CPU engine's on fixture `f` (both sorted by sequence and
/// head), the CPU's metadata `meta`, and the outputs (`oc`, `og`: f64, the layout of Outputs::to_f64).
pub fn quest_agreement(f: &Fixture, set: QuestSet, meta: &MetaSnapshot, v_cpu: &[VisitRecord], v_gpu: &[VisitRecord], oc: &[f64], og: &[f64]) -> QuestAgreement {
    let mut res = QuestAgreement { rows: v_cpu.len(), ..Default::default() };
    res.out_tol = tolerance(f.spec.dtype).0;
    if v_cpu.len() != v_gpu.len() {
        res.violation = Some(format!("{} CPU policy rows vs {} GPU rows", v_cpu.len(), v_gpu.len()));
        return res;
    }
    let sp = &f.spec;
    let (hq, d, page) = (sp.num_q_heads, sp.head_dim, set.page);
    let g = hq / sp.num_kv_heads;
    let eps = (6.0 * d as f64 + 16.0) * 2f64.powi(-23);
    let mut want = oc.to_vec();
    for (a, b) in v_cpu.iter().zip(v_gpu) {
        if (a.seq_id, a.kv_head) != (b.seq_id, b.kv_head) {
            res.violation = Some(format!("row order differs: seq {} head {} vs seq {} head {}", a.seq_id, a.kv_head, b.seq_id, b.kv_head));
            return res;
        }
        if a.spans == b.spans {
            continue;
        }
        let (s, h) = ((a.seq_id - 1000) as usize, a.kv_head);
        let hi = f.seq_lens[s] as usize - 1;
        let lo = if sp.window == 0 { 0 } else { (hi + 1).saturating_sub(sp.window) };
        let fp = lo / page;
        let (sc, bb) = exact_bounds(f, meta, s, h, lo, hi, page);
        let n = sc.len();
        let (tc, tg) = (tokens_of(a), tokens_of(b));
        let pages = |t: &[usize]| {
            let mut m = vec![false; n];
            for &p in t {
                m[p / page - fp] = true;
            }
            m
        };
        let (pc, pgu) = (pages(&tc), pages(&tg));
        // The cut's boundary: the m-th largest exact bound among the candidates forced..last.
        let k = set.budget.div_ceil(page).max(1);
        let last = n - 1;
        let forced = set.sink.div_ceil(page).saturating_sub(fp).min(last);
        let m = k.saturating_sub(1 + forced).min(last - forced);
        let mut cand: Vec<f64> = sc[forced..last].to_vec();
        cand.sort_by(|x, y| y.total_cmp(x));
        let boundary = if m > 0 { cand[m - 1] } else { f64::INFINITY };
        let delta = 2.0 * eps * bb.iter().copied().fold(0f64, f64::max);
        let top = sc.iter().fold(0f64, |x, y| x.max(y.abs()));
        res.max_rel_delta = res.max_rel_delta.max(if top > 0.0 { delta / top } else { 0.0 });
        res.rows_differing += 1;
        for i in 0..n {
            if pc[i] == pgu[i] {
                continue;
            }
            res.differing += 1;
            let ratio = if i < forced || i == last || m == 0 { f64::INFINITY } else { (sc[i] - boundary).abs() / delta };
            res.worst_ratio = res.worst_ratio.max(ratio);
            if !(ratio <= 1.0) && res.violation.is_none() {
                res.violation = Some(format!(
                    "seq {s} head {h}: page {} kept by the {} only: exact bound {:.9e}, boundary {:.9e}, |diff| / delta = {ratio:.3e} (delta {delta:.3e})",
                    fp + i,
                    if pc[i] { "CPU" } else { "GPU" },
                    sc[i],
                    boundary
                ));
            }
        }
        // This row's outputs: an f64 attention over the GPU's own set.
        let t = f.query_start_loc[s] as usize;
        res.rows_apart.push((t, h));
        for gi in 0..g {
            let o = attend_f64(f, s, t, h * g + gi, &tg);
            want[(t * hq + h * g + gi) * d..][..d].copy_from_slice(&o);
        }
    }
    res.out_rel = rel_err(og, &want);
    res
}

/// The settings of `policy` when it is Quest alone (no later stage): the policies whose GPU scores come
/// from tensor cores.
pub fn quest_alone(policy: &str) -> Option<QuestSet> {
    let p = kvsparse::policy::Policy::parse(policy).ok()?;
    let pl = p.pipeline()?;
    match pl.selector {
        kvsparse::policy::Selector::Quest(kvsparse::policy::Quest { budget, page, sink }) if pl.top_p.is_none() && pl.art.is_none() => Some(QuestSet { budget, page, sink }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::run_on_engine;
    use crate::sparse_cuda::{cfg_for, sorted};
    use crate::CaseSpec;
    use kvsparse::engine::Engine;
    use kvsparse::tensor::{DType, Device};

    /// Visits of `pages` (row-relative indices from `fp`) of a row, as the engines record them.
    fn visit(like: &VisitRecord, pages: &[usize], fp: usize, page: usize, lo: usize, hi: usize) -> VisitRecord {
        let spans = pages.iter().map(|&i| (((fp + i) * page).max(lo), ((fp + i + 1) * page).min(hi + 1))).collect();
        VisitRecord { spans, ..like.clone() }
    }

    /// On the CPU engine's own run: the set of the exact (f64) bounds agrees with the CPU's (so the exact
    /// bounds read the metadata, the query and the scale as the engine does), and a set that trades the
    /// best candidate for the worst one is rejected.
    #[test]
    fn quest_agreement_accepts_the_exact_set_and_rejects_clear_swaps() {
        let spec = CaseSpec::new("quest-agree", DType::BF16, 64, 8, 2, 16, vec![(1, 1500), (1, 700), (1, 300)]);
        let set = QuestSet { budget: 128, page: 16, sink: 16 };
        let policy = "quest(budget=128, sink=16)";
        let mut f = Fixture::new(&spec, 7);
        let cpu = Engine::new(cfg_for(&f, policy, Device::Cpu)).unwrap();
        cpu.record_visits(true);
        let outs = run_on_engine(&cpu, &mut f).unwrap();
        let v = sorted(cpu.take_visits());
        let meta = cpu.metadata_snapshot(0).unwrap().unwrap();
        let (o, _) = outs.to_f64(&f);
        assert!(!v.is_empty());
        let (mut exact, mut swapped) = (Vec::new(), Vec::new());
        for r in &v {
            let (s, h) = ((r.seq_id - 1000) as usize, r.kv_head);
            let hi = f.seq_lens[s] as usize - 1;
            let (sc, _) = exact_bounds(&f, &meta, s, h, 0, hi, set.page);
            let n = sc.len();
            let (last, forced) = (n - 1, set.sink.div_ceil(set.page).min(n - 1));
            let m = set.budget.div_ceil(set.page).saturating_sub(1 + forced).min(last - forced);
            let mut cand: Vec<usize> = (forced..last).collect();
            cand.sort_by(|&a, &b| sc[b].total_cmp(&sc[a]).then(b.cmp(&a)));
            let mut keep: Vec<usize> = (0..forced).chain(cand[..m].iter().copied()).chain([last]).collect();
            keep.sort_unstable();
            exact.push(visit(r, &keep, 0, set.page, 0, hi));
            // The best candidate out, the worst in.
            let mut bad: Vec<usize> = keep.iter().copied().filter(|&i| i != cand[0]).chain([*cand.last().unwrap()]).collect();
            bad.sort_unstable();
            swapped.push(visit(r, &bad, 0, set.page, 0, hi));
        }
        let ok = quest_agreement(&f, set, &meta, &v, &exact, &o, &o);
        assert!(ok.violation.is_none(), "{:?}", ok.violation);
        assert!(ok.worst_ratio <= 1.0);
        let bad = quest_agreement(&f, set, &meta, &v, &swapped, &o, &o);
        assert!(bad.violation.is_some() && bad.differing >= 2 * v.len(), "{bad:?}");
    }
}
