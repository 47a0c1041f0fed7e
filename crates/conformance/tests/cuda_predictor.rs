//! AttentionPredictor on the CUDA engine against the CPU engine (the reference for its decisions, by the
//! agreement contract: `predictor_agree`) over several calls per case: prefill seeds, decode steps that
//! write a token each, a sequence without a prefill, a released and reused slot; a full slot map; a
//! captured decode step replayed like eager steps.
//! Without a CUDA device the tests are listed as ignored, and fail when KVS_REQUIRE_CUDA=1. KVS_QUICK=1
//! runs a reduced matrix (for compute-sanitizer).

use kvsparse_conformance::predictor_cuda::{predictor_full_slot_map, predictor_graph_replay, predictor_policies, predictor_spec, run_predictor_case};
use kvsparse_conformance::sparse_cuda::sparse_specs;
use kvsparse::rng::Rng;

mod common;
use common::{have_cuda, quick};

fn cuda_predictor_decisions_agree_with_the_cpu_engine() {
    if !have_cuda("cuda_predictor_decisions") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    let (mut rows, mut full, mut partial, mut differing, mut checked, mut blocks, mut worst, mut delta) = (0, 0, 0, 0, 0, 0, 0f64, 0f64);
    for (i, spec) in sparse_specs(quick()).iter().enumerate() {
        let spec = predictor_spec(spec);
        for (j, pol) in predictor_policies().iter().enumerate() {
            if quick() && (i + j) % 3 != 0 {
                continue;
            }
            let r = run_predictor_case(&spec, pol, seed.wrapping_add((i * 100 + j) as u64));
            rows += r.rows;
            full += r.full_steps;
            partial += r.partial_steps;
            differing += r.differing_rows;
            checked += r.checked_rows;
            blocks += r.differing_blocks;
            if r.worst_margin > worst {
                (worst, delta) = (r.worst_margin, r.delta_at_worst);
            }
            println!(
                "predictor {:<36} {:<70} rows {:>4} full/pred {:>3}/{:<3} rows differing {} checked {} blocks {} margin {:.2e}/{:.2e} decisions {} counters {} rel {:.2e} lse {:.2e} {}",
                r.name,
                r.policy,
                r.rows,
                r.full_steps,
                r.partial_steps,
                r.differing_rows,
                r.checked_rows,
                r.differing_blocks,
                r.worst_margin,
                r.delta_at_worst,
                if r.decision_mismatch.is_none() { "agree" } else { "DIFF" },
                if r.counters_mismatch.is_none() { "same" } else { "DIFF" },
                r.rel_err,
                r.lse_err,
                if r.pass { "ok" } else { "FAIL" }
            );
            if !r.pass {
                failures.push(format!("{} / {} (seed {}): {:?} {:?} rel {:.3e} lse {:.3e} error {:?}", r.name, r.policy, r.seed, r.decision_mismatch, r.counters_mismatch, r.rel_err, r.lse_err, r.error));
            }
        }
    }
    println!("{rows} policy rows compared: {full} calibration and {partial} predicted (sequence, head) steps; {differing} rows differ from the CPU engine's set, {checked} checked against the exact prediction from the GPU's history, {blocks} blocks differ, worst margin {worst:.3e} (delta {delta:.3e})");
    assert!(failures.is_empty(), "failing predictor cases:\n{}", failures.join("\n"));
}

fn cuda_predictor_full_slot_map_runs_dense() {
    if !have_cuda("cuda_predictor_full_slot_map") {
        return;
    }
    let seed = Rng::fresh_seed();
    for spec in sparse_specs(true).iter().take(2) {
        let spec = predictor_spec(spec);
        let (with, dense, err) = predictor_full_slot_map(&spec, "predictor(budget=256, history=8, calib=3, sink=16, local=32)", seed).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
        println!("full slot map {:<36} rows with a slot {with}, dense rows {dense} {}", spec.name, if err.is_none() { "ok" } else { "FAIL" });
        assert!(err.is_none(), "{} (seed {seed}): {err:?}", spec.name);
    }
}

fn cuda_predictor_decode_step_graph_replays_like_eager() {
    if !have_cuda("cuda_predictor_graph") {
        return;
    }
    let seed = Rng::fresh_seed();
    for spec in sparse_specs(true).iter().take(2) {
        let spec = predictor_spec(spec);
        for pol in ["predictor(budget=256, history=8, calib=2, sink=16, local=32)", "predictor(budget=512)"] {
            let (rows, mism) = predictor_graph_replay(&spec, pol, seed).unwrap_or_else(|e| panic!("{} {pol}: {e}", spec.name));
            println!("graph {:<36} {pol:<64} rows {rows} {}", spec.name, if mism.is_none() { "replays == eager" } else { "DIFF" });
            assert!(rows > 0 && mism.is_none(), "{} {pol} (seed {seed}): {mism:?}", spec.name);
        }
    }
}

fn main() {
    common::run("predictor", vec![
        ("cuda_predictor_decisions_agree_with_the_cpu_engine", cuda_predictor_decisions_agree_with_the_cpu_engine as fn(), true),
        ("cuda_predictor_full_slot_map_runs_dense", cuda_predictor_full_slot_map_runs_dense as fn(), true),
        ("cuda_predictor_decode_step_graph_replays_like_eager", cuda_predictor_decode_step_graph_replays_like_eager as fn(), true),
    ]);
}
