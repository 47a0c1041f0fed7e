//! Twilight top-p on CUDA against the CPU engine under the agreement contract (design.md "Decisions on
//! the GPU: agreement, not bit equality"; top_p_agree describes the reference and the bound): over the
//! sparse geometries and long rows (tens of tiles of the device's search), every token on which the two
//! engines' sets differ is borderline, and the GPU's output equals the reference over its own set; at ties
//! (every estimate equal, or three values) the sets are exactly the CPU's; the same inputs give the same
//! set twice; a captured step replays as an eager one. Without a CUDA device every test is listed as
//! ignored, and fails instead when KVS_REQUIRE_CUDA=1. KVS_QUICK=1: a reduced matrix; KVS_TOPP_SMALL=1: shorter
//! rows (compute-sanitizer).

use kvsparse::rng::Rng;
use kvsparse::DType;
use kvsparse_conformance::sparse_cuda::{compare_visits, run_sparse_case_keys, sparse_graph_replay, sparse_specs};
use kvsparse_conformance::top_p_agree::{gpu_visits, top_p_agreement, Base};
use kvsparse_conformance::CaseSpec;

mod common;
use common::{have_cuda, quick};

/// KVS_TOPP_SMALL=1: rows of a few thousand tokens (still several tiles), for compute-sanitizer.
fn small() -> bool {
    std::env::var("KVS_TOPP_SMALL").is_ok_and(|v| v == "1")
}

/// Rows long enough to span many tiles of the device's search (1,024 candidates each), GQA 4 and 8.
fn long_specs() -> Vec<CaseSpec> {
    let lens = if small() { vec![(1, 5000), (1, 1), (1, 2100)] } else { vec![(1, 40000), (1, 9000), (1, 1), (1, 3001)] };
    let mut v = vec![CaseSpec::new("h128-bf16-gqa4-bs16-long", DType::BF16, 128, 8, 2, 16, lens), many_rows()];
    if !quick() {
        v.push(CaseSpec::new("h128-f16-gqa8-bs32-long", DType::F16, 128, 16, 2, 32, vec![(1, 20000), (3, 700), (1, 12345)]));
    }
    v
}

/// Enough rows (sequences x KV heads) times candidates that each CTA of the device's search covers
/// several chunks of candidates (the host spreads a call over about a thousand CTAs).
fn many_rows() -> CaseSpec {
    // 256 rows x 4-6 chunks: over 1,024 chunks, so tiles of two chunks or more.
    let (n, len) = if small() { (40, 3100) } else if quick() { (32, 4200) } else { (32, 6000) };
    CaseSpec::new("h128-bf16-gqa4-bs16-many-rows", DType::BF16, 128, 32, 8, 16, vec![(1, len); n])
}

/// (policy, its base, p).
fn policies() -> Vec<(&'static str, Base, f32)> {
    vec![
        ("all > top_p(p=0.9)", Base::All, 0.9),
        ("all > top_p(p=0.5)", Base::All, 0.5),
        ("all > top_p(p=0.99)", Base::All, 0.99),
        ("streaming(sink=16, recent=2000) > top_p(p=0.8)", Base::Streaming { sink: 16, recent: 2000 }, 0.8),
    ]
}

fn cuda_top_p_sets_agree_with_the_cpu_engine() {
    if !have_cuda("cuda_top_p_agree") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut specs: Vec<CaseSpec> = sparse_specs(quick()).into_iter().filter(|s| s.window == 0).collect();
    specs.extend(long_specs());
    let (mut rows, mut rows_diff, mut diff, mut worst, mut allowed) = (0, 0, 0, 0f64, 0f64);
    let mut failures = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        for (j, &(pol, base, p)) in policies().iter().enumerate() {
            if quick() && (i + j) % 2 != 0 {
                continue;
            }
            let s = seed.wrapping_add((i * 100 + j) as u64);
            let r = top_p_agreement(spec, pol, base, p, s, None).unwrap_or_else(|e| panic!("{} / {pol}: {e}", spec.name));
            println!(
                "top_p {:<36} {:<48} rows {:>3} differing rows {:>2} tokens {:>3} kept CPU {:>6} GPU {:>6} worst margin {:.2e} (allowed {:.2e}) out rel {:.2e} {}",
                spec.name, pol, r.rows, r.rows_differing, r.differing, r.kept_cpu, r.kept_gpu, r.worst_margin, r.allowed_at_worst.max(r.max_allowed), r.out_rel,
                if r.pass() { "ok" } else { "FAIL" }
            );
            rows += r.rows;
            rows_diff += r.rows_differing;
            diff += r.differing;
            worst = worst.max(r.worst_margin);
            allowed = allowed.max(r.max_allowed);
            if !r.pass() {
                failures.push(format!("{} / {pol} (seed {s}): {:?} out rel {:.3e} > {:.1e}", spec.name, r.violation, r.out_rel, r.out_tol));
            }
        }
    }
    println!("top_p agreement: {rows} rows, {rows_diff} with differing sets, {diff} differing tokens, worst margin {worst:.3e} (largest allowed 2 delta {allowed:.3e})");
    assert!(failures.is_empty(), "failing top-p cases:\n{}", failures.join("\n"));
}

/// Equal estimated weights (every key the same: one value; or three values): the set is the first
/// tokens by position reaching the mass, and masses of equal weights are exact on both engines, so the
/// GPU's set must be the CPU's exactly (also across tiles of the device's search: rows of 40,000).
fn cuda_top_p_ties_equal_the_cpu_engine() {
    if !have_cuda("cuda_top_p_ties") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let lens = if small() { vec![(1, 5000), (1, 1500), (1, 1)] } else { vec![(1, 40000), (1, 4000), (1, 1500), (1, 1)] };
    let spec = CaseSpec::new("h128-bf16-gqa4-bs16-ties", DType::BF16, 128, 8, 2, 16, lens);
    let one = |_row: usize| 0.25;
    let few = |row: usize| [0.5, -0.25, 0.125][(row / 16) % 3];
    let mut failures = Vec::new();
    for (name, key) in [("one value", &one as &dyn Fn(usize) -> f64), ("three values", &few)] {
        for pol in ["all > top_p(p=0.9)", "all > top_p(p=0.5)", "streaming(sink=16, recent=2000) > top_p(p=0.75)"] {
            let r = run_sparse_case_keys(&spec, pol, seed, Some(key));
            println!("ties {name:<12} {pol:<48} rows {:>3} decisions {} counters {} rel {:.2e} {}", r.rows, if r.decision_mismatch.is_none() { "same" } else { "DIFF" },
                if r.counters_mismatch.is_none() { "same" } else { "DIFF" }, r.rel_err, if r.pass { "ok" } else { "FAIL" });
            if !r.pass {
                failures.push(format!("{name} / {pol} (seed {seed}): {:?} {:?} error {:?}", r.decision_mismatch, r.counters_mismatch, r.error));
            }
        }
    }
    assert!(failures.is_empty(), "failing tie cases:\n{}", failures.join("\n"));
}

/// The same inputs twice on the device: the same sets (no atomics whose order changes a decision), on
/// rows whose tiles span several chunks.
fn cuda_top_p_is_deterministic() {
    if !have_cuda("cuda_top_p_determinism") {
        return;
    }
    let seed = Rng::fresh_seed();
    let spec = many_rows();
    for pol in ["all > top_p(p=0.9)", "quest(budget=2048) > top_p(p=0.95)"] {
        let f = kvsparse_conformance::Fixture::new(&spec, seed);
        let run = || gpu_visits(&f, pol).unwrap_or_else(|e| panic!("{pol}: {e}"));
        let (a, b) = (run(), run());
        println!("determinism {pol:<40} rows {} {}", a.len(), if compare_visits(&a, &b).is_none() { "same" } else { "DIFF" });
        assert!(!a.is_empty() && compare_visits(&a, &b).is_none(), "{pol} (seed {seed}): {:?}", compare_visits(&a, &b));
    }
}

/// A captured top-p decode step replays on new data exactly as an eager step (rows long enough for
/// several tiles).
fn cuda_top_p_graph_replay_equals_eager() {
    if !have_cuda("cuda_top_p_graph") {
        return;
    }
    let seed = Rng::fresh_seed();
    let spec = CaseSpec::new("graph-top-p-decode", DType::BF16, 128, 32, 8, 16, vec![(1, 12000), (1, 1), (1, 3000)]);
    for pol in ["all > top_p(p=0.9)", "quest(budget=4096) > top_p(p=0.95)"] {
        let (rows, mism) = sparse_graph_replay(&spec, pol, seed, seed.wrapping_add(7919)).unwrap_or_else(|e| panic!("{pol}: {e}"));
        println!("graph {pol:<40} rows {rows} {}", if mism.is_none() { "replay == eager" } else { "DIFF" });
        assert!(rows > 0 && mism.is_none(), "{pol} (seed {seed}): {mism:?}");
    }
}

fn main() {
    common::run("top_p", vec![
        ("cuda_top_p_sets_agree_with_the_cpu_engine", cuda_top_p_sets_agree_with_the_cpu_engine as fn(), true),
        ("cuda_top_p_ties_equal_the_cpu_engine", cuda_top_p_ties_equal_the_cpu_engine as fn(), true),
        ("cuda_top_p_is_deterministic", cuda_top_p_is_deterministic as fn(), true),
        ("cuda_top_p_graph_replay_equals_eager", cuda_top_p_graph_replay_equals_eager as fn(), true),
    ]);
}
