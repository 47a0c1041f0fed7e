//! Measurements of the stateful policies on the real traces (traces/): the numbers in docs/policies.md.
//!
//! `cargo run --release --example stateful_report [-- prr refresh predictor]` (all sections by default).
//! Every replay runs in f32 (so output rounding neither hides nor fakes differences), 2 worker threads.

use std::path::PathBuf;
use std::time::Instant;

use kvsparse_conformance::reference::rel_err;
use kvsparse::policy::refresh;
use kvsparse::policy::speculate::{self, TrajStep};
use kvsparse::stats::Counters;
use kvsparse_conformance::eval::{mean, recovered_mass};
use kvsparse_conformance::traces::{replay, Manifest, Replay, ReplayOptions, Trace};
use kvsparse::DType;

fn opts(visits: bool) -> ReplayOptions {
    ReplayOptions { dtype: DType::F32, threads: 2, record_visits: visits, ..Default::default() }
}

/// Mean over (layer, step, query head) of the true attention mass on the positions a policy attended.
fn recovery(tr: &Trace, r: &Replay) -> f64 {
    mean(&recovered_mass(tr, &[r])[0])
}

fn layer_err(a: &Replay, b: &Replay) -> f64 {
    let x: Vec<f64> = a.out.iter().flatten().copied().collect();
    let y: Vec<f64> = b.out.iter().flatten().copied().collect();
    rel_err(&x, &y)
}

/// Quest page bounds (f32 min/max of K per page, max over the group's query rows) of one query row at
/// position `pos` for KV head `h`: the trajectory PRR calibrates on.
fn page_bounds(tr: &Trace, li: usize, q: &[f32], pos: usize, h: usize, page: usize) -> Vec<f32> {
    let (hk, d, g) = (tr.hk, tr.d, tr.hq / tr.hk);
    let lt = &tr.layers[li];
    let mut out = Vec::new();
    for pg in 0..=pos / page {
        let (a, b) = (pg * page, ((pg + 1) * page).min(pos + 1));
        let mut mn = vec![f32::INFINITY; d];
        let mut mx = vec![f32::NEG_INFINITY; d];
        for j in a..b {
            for i in 0..d {
                let x = lt.k[(j * hk + h) * d + i].to_f32();
                mn[i] = mn[i].min(x);
                mx[i] = mx[i].max(x);
            }
        }
        let best = (0..g).map(|r| (0..d).map(|i| (q[r * d + i] * mn[i]).max(q[r * d + i] * mx[i])).sum::<f32>()).fold(f32::NEG_INFINITY, f32::max);
        out.push(best);
    }
    out
}

fn prr(m: &Manifest) {
    println!("## PRR: speculate(over=quest(budget=B), budget=S)");
    println!();
    println!("| trace | B | S | Holt hit | reuse-prev hit | missed blocks / row | blocks visited / eligible | rel err vs quest(B) | calib (α,β,γ) | calib ms (405 cand.) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for info in &m.traces {
        let tr = m.load_trace(info).expect("trace");
        for b in [256usize, 1024] {
            if b * 2 > info.prompt_len {
                continue;
            }
            let quest = replay(&tr, &format!("quest(budget={b})"), &opts(false)).expect("replay");
            for sb in [b, 2 * b] {
            let r = replay(&tr, &format!("speculate(over=quest(budget={b}), budget={sb})"), &opts(false)).expect("replay");
            let c = r.counters;
            // Calibration of the last recorded layer's KV head 0, timed outside the engine.
            let li = tr.layers.len() - 1;
            let lt = &tr.layers[li];
            let (hq, d, g) = (tr.hq, tr.d, tr.hq / tr.hk);
            let p = info.prompt_len;
            let traj: Vec<TrajStep> = (0..lt.tail_len)
                .map(|i| {
                    let q: Vec<f32> = (0..g * d).map(|x| lt.q_prompt_tail[i * hq * d + x].to_f32() * tr.scale).collect();
                    (0, page_bounds(&tr, li, &q, p - lt.tail_len + i, 0, 16))
                })
                .collect();
            let grid = speculate::grid(None, None, None);
            let t0 = Instant::now();
            let cal = speculate::calibrate(&traj, &grid, sb / 16, b / 16);
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            let tb = c[speculate::TRUE_BLOCKS] as f64;
            println!(
                "| {} | {b} | {sb} | {:.3} | {:.3} | {:.2} | {}/{} ({:.1}%) | {:.1e} | ({:.1}, {:.1}, {:.1}) | {ms:.1} |",
                info.name,
                c[speculate::HIT_BLOCKS] as f64 / tb,
                c[speculate::REUSE_HIT_BLOCKS] as f64 / tb,
                c[speculate::REPAIRED_BLOCKS] as f64 / c.policy_rows as f64,
                c.blocks_visited,
                c.blocks_eligible,
                100.0 * c.visited_fraction(),
                layer_err(&r, &quest),
                cal.params.alpha,
                cal.params.beta,
                cal.params.gamma
            );
            }
        }
    }
    println!();
}

fn refresh(m: &Manifest) {
    println!("## RefreshKV vs SnapKV at the same k");
    println!();
    println!("| trace | spec | full / partial steps | effective stride | blocks visited / eligible | recovery | rel err vs dense |");
    println!("|---|---|---|---|---|---|---|");
    for info in &m.traces {
        let tr = m.load_trace(info).expect("trace");
        let dense = replay(&tr, "dense", &opts(false)).expect("replay");
        for k in [256usize, 1024] {
            if k * 2 > info.prompt_len {
                continue;
            }
            for spec in [format!("refresh(k={k}, stride=5, s=0.85)"), format!("refresh(k={k}, every=5)"), format!("snapkv(budget={k})")] {
                let r = replay(&tr, &spec, &opts(true)).expect("replay");
                let c: Counters = r.counters;
                let eff = if c[refresh::FULL_STEPS] > 0 { format!("{:.1}", (c[refresh::FULL_STEPS] + c[refresh::PARTIAL_STEPS]) as f64 / c[refresh::FULL_STEPS] as f64) } else { "—".into() };
                println!(
                    "| {} | `{spec}` | {} / {} | {eff} | {}/{} ({:.1}%) | {:.3} | {:.3} |",
                    info.name,
                    c[refresh::FULL_STEPS],
                    c[refresh::PARTIAL_STEPS],
                    c.blocks_visited,
                    c.blocks_eligible,
                    100.0 * c.visited_fraction(),
                    recovery(&tr, &r),
                    layer_err(&r, &dense)
                );
            }
        }
    }
    println!();
}

/// H2O-style accumulated-score baseline (not a product policy): per (layer, KV head) the attention weights
/// each position received from every earlier query (the prompt-tail queries, then each decode step), summed
/// over the group's query heads; at each step the first 64 and last 64 tokens plus the highest accumulated
/// tokens up to `budget`. Uses the true weights of earlier steps (an optimistic H2O: nothing was evicted).
fn h2o_recovery(tr: &Trace, budget: usize) -> f64 {
    let (hq, hk, d, g) = (tr.hq, tr.hk, tr.d, tr.hq / tr.hk);
    let p = tr.info.prompt_len;
    let (mut sum, mut n_rows) = (0f64, 0usize);
    for (li, lt) in tr.layers.iter().enumerate() {
        let mut acc = vec![vec![0f64; tr.positions()]; hk];
        // Prompt-tail queries.
        for i in 0..lt.tail_len {
            let pos = p - lt.tail_len + i;
            for qh in 0..hq {
                let q: Vec<f64> = (0..d).map(|x| lt.q_prompt_tail[(i * hq + qh) * d + x].to_f64() * tr.scale as f64).collect();
                let kh = qh / g;
                let mut row: Vec<f64> = (0..=pos).map(|j| (0..d).map(|x| q[x] * lt.k[(j * hk + kh) * d + x].to_f64()).sum()).collect();
                let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = row.iter_mut().map(|x| {
                    *x = (*x - m).exp();
                    *x
                }).sum();
                for (j, x) in row.iter().enumerate() {
                    acc[kh][j] += x / z;
                }
            }
        }
        for t in 0..tr.info.decode_steps {
            let w = tr.dense_weights(li, t);
            let n = p + t + 1;
            for h in 0..hk {
                let mut keep = vec![false; n];
                for j in 0..n.min(64) {
                    keep[j] = true;
                }
                for j in n.saturating_sub(64)..n {
                    keep[j] = true;
                }
                let mut rest: Vec<usize> = (0..n).filter(|&j| !keep[j]).collect();
                rest.sort_by(|&a, &b| acc[h][b].total_cmp(&acc[h][a]).then(b.cmp(&a)));
                for &j in rest.iter().take(budget.saturating_sub(128)) {
                    keep[j] = true;
                }
                for qh in h * g..(h + 1) * g {
                    sum += (0..n).filter(|&j| keep[j]).map(|j| w[qh * n + j]).sum::<f64>();
                    n_rows += 1;
                    for j in 0..n {
                        acc[h][j] += w[qh * n + j];
                    }
                }
            }
        }
    }
    sum / n_rows.max(1) as f64
}

fn predictor(m: &Manifest) {
    println!("## AttentionPredictor recovery on the held-out traces (not used in training)");
    println!();
    println!("| trace | budget | predictor | quest | H2O-style (accumulated) | predictor blocks visited / eligible | full (calib) / predicted steps | predictor rel err vs dense | quest rel err vs dense |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for info in m.traces.iter().filter(|t| t.name == "document_4k" || t.name == "needle_8k") {
        let tr = m.load_trace(info).expect("trace");
        let dense = replay(&tr, "dense", &opts(false)).expect("replay");
        for b in [512usize, 1024, 2048] {
            let pr = replay(&tr, &format!("predictor(budget={b})"), &opts(true)).expect("replay");
            let q = replay(&tr, &format!("quest(budget={b})"), &opts(true)).expect("replay");
            let c = pr.counters;
            println!(
                "| {} | {b} | {:.3} | {:.3} | {:.3} | {}/{} ({:.1}%) | {} / {} | {:.3} | {:.3} |",
                info.name,
                recovery(&tr, &pr),
                recovery(&tr, &q),
                h2o_recovery(&tr, b),
                c.blocks_visited,
                c.blocks_eligible,
                100.0 * c.visited_fraction(),
                c[refresh::FULL_STEPS],
                c[refresh::PARTIAL_STEPS],
                layer_err(&pr, &dense),
                layer_err(&q, &dense)
            );
        }
    }
    println!();
}

fn main() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    let m = Manifest::load(&dir).expect("manifest");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let want = |s: &str| args.is_empty() || args.iter().any(|a| a == s);
    println!("(f32 replay, 2 threads; traces: {})", m.traces.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", "));
    println!();
    if want("prr") {
        prr(&m);
    }
    if want("refresh") {
        refresh(&m);
    }
    if want("predictor") {
        predictor(&m);
    }
}
