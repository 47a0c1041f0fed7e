//! PRR (`speculate(over=quest(...))`) on CUDA against the CPU engine: over a prefill call (calibration)
//! and several decode steps, the same speculated + repaired pages (visit records), the same counters
//! (spec_* included), outputs within the dense tolerances; a captured PRR decode step replays on new data
//! exactly as an eager one. Without a CUDA device every test is a visible skip, and fails instead when
//! KVS_REQUIRE_CUDA=1. KVS_QUICK=1 runs a reduced matrix (for compute-sanitizer).

use kvsparse_conformance::prr_cuda::{prr_policies, run_prr_case, run_prr_case_with};
use kvsparse_conformance::sparse_cuda::{sparse_graph_replay, sparse_graph_replay_on, sparse_specs};
use kvsparse_conformance::CaseSpec;
use kvsparse::rng::Rng;
use kvsparse::DType;

mod common;
use common::{have_cuda, quick};

/// Decode steps after the prefill call.
const STEPS: usize = 5;

fn cuda_prr_decisions_equal_the_cpu_engine() {
    if !have_cuda("cuda_prr_decisions") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    let mut cases = 0;
    for (i, spec) in sparse_specs(quick()).iter().enumerate() {
        for (j, pol) in prr_policies().iter().enumerate() {
            if quick() && (i + j) % 3 != 0 {
                continue;
            }
            let r = run_prr_case(spec, pol, if quick() { 3 } else { STEPS }, seed.wrapping_add((i * 100 + j) as u64));
            cases += 1;
            println!(
                "prr {:<36} {:<92} calls {} rows {:>4} decisions {} counters {} pred/true/hit/repaired {:?} rel {:.2e} lse {:.2e} {}",
                r.name,
                r.policy,
                r.calls,
                r.rows,
                if r.decision_mismatch.is_none() { "same" } else { "DIFF" },
                if r.counters_mismatch.is_none() { "same" } else { "DIFF" },
                r.spec,
                r.rel_err,
                r.lse_err,
                if r.pass { "ok" } else { "FAIL" }
            );
            if !r.pass {
                failures
                    .push(format!("{} / {} (seed {}): {:?} {:?} rel {:.3e} lse {:.3e} error {:?}", r.name, r.policy, r.seed, r.decision_mismatch, r.counters_mismatch, r.rel_err, r.lse_err, r.error));
            }
        }
    }
    println!("prr cases {cases}, failing {}", failures.len());
    assert!(failures.is_empty(), "failing PRR cases:\n{}", failures.join("\n"));
}

/// Sequences whose first call through the engine is a decode step (the cache written, no prefill call:
/// no calibration, every page unseen), 2K-4K tokens, GQA 4, head 128, bf16 and f16: the same pages,
/// counters and outputs as the CPU engine from the first step on (an independent check had found the
/// outputs differing there).
fn cuda_prr_first_decode_steps_without_prefill_equal_the_cpu_engine() {
    if !have_cuda("cuda_prr_no_prefill") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    for (i, dt) in [DType::BF16, DType::F16].into_iter().enumerate() {
        let spec = CaseSpec::new("no-prefill-gqa4-h128", dt, 128, 32, 8, 16, vec![(1, 2048), (1, 3001), (1, 4096)]);
        for (j, pol) in ["speculate(over=quest(budget=256), budget=256)", "speculate(over=quest(budget=256, sink=16), alpha=0.5, beta=0.1, gamma=1)"].iter().enumerate() {
            let r = run_prr_case_with(&spec, pol, 3, seed.wrapping_add((i * 10 + j) as u64), false);
            println!(
                "prr {:?} {:<72} calls {} rows {:>4} decisions {} counters {} rel {:.2e} lse {:.2e} {}",
                dt,
                r.policy,
                r.calls,
                r.rows,
                if r.decision_mismatch.is_none() { "same" } else { "DIFF" },
                if r.counters_mismatch.is_none() { "same" } else { "DIFF" },
                r.rel_err,
                r.lse_err,
                if r.pass { "ok" } else { "FAIL" }
            );
            if !r.pass {
                failures.push(format!("{dt:?} / {} (seed {}): {:?} {:?} rel {:.3e} lse {:.3e} error {:?}", r.policy, r.seed, r.decision_mismatch, r.counters_mismatch, r.rel_err, r.lse_err, r.error));
            }
        }
    }
    assert!(failures.is_empty(), "failing PRR cases without prefill:\n{}", failures.join("\n"));
}

/// A captured PRR decode step (cache write, fork, predict + speculative attention on the side stream,
/// selection, repair, merge) replays on new data exactly as an eager step.
fn cuda_prr_decode_step_graph_replays_on_new_data() {
    if !have_cuda("cuda_prr_graph") {
        return;
    }
    let seed = Rng::fresh_seed();
    let spec = CaseSpec::new("graph-prr-decode", DType::BF16, 128, 32, 8, 16, vec![(1, 4000), (1, 1), (1, 17), (1, 1500), (1, 2777)]);
    for pol in ["speculate(over=quest(budget=256, sink=16), alpha=0.5, beta=0.1, gamma=1)", "speculate(over=quest(budget=512, page=32), budget=256, alpha=0.3, beta=0.2, gamma=0.5)"] {
        let (rows, mism) = sparse_graph_replay(&spec, pol, seed, seed.wrapping_add(7919)).unwrap_or_else(|e| panic!("{pol}: {e}"));
        println!("graph {pol:<80} rows {rows} {}", if mism.is_none() { "replay == eager" } else { "DIFF" });
        assert!(rows > 0 && mism.is_none(), "{pol} (seed {seed}): {mism:?}");
    }
}

/// The same step captured on a stream that made no eager PRR call (the eager warm-up ran on another
/// stream, as vLLM and `torch.cuda.graph` do): the capture takes over the warm stream's side stream,
/// events and workspace instead of refusing, and replays as the eager step.
fn cuda_prr_graph_captured_on_a_stream_without_eager_calls() {
    if !have_cuda("cuda_prr_graph_other_stream") {
        return;
    }
    let seed = Rng::fresh_seed();
    let spec = CaseSpec::new("graph-prr-other-stream", DType::BF16, 128, 32, 8, 16, vec![(1, 4000), (1, 1), (1, 17), (1, 1500), (1, 2777)]);
    let pol = "speculate(over=quest(budget=256, sink=16), alpha=0.5, beta=0.1, gamma=1)";
    let (rows, mism) = sparse_graph_replay_on(&spec, pol, seed, seed.wrapping_add(7919), true).unwrap_or_else(|e| panic!("{pol}: {e}"));
    println!("graph on another stream {pol:<70} rows {rows} {}", if mism.is_none() { "replay == eager" } else { "DIFF" });
    assert!(rows > 0 && mism.is_none(), "{pol} (seed {seed}): {mism:?}");
}

/// Settings the CUDA backend refuses, with the reason.
fn cuda_prr_refuses_what_it_does_not_run() {
    for pol in ["speculate(over=quest(budget=64), extra=drop)", "speculate(over=quest(budget=64), predict=previous)"] {
        let p = kvsparse::policy::Policy::parse(pol).expect("parses");
        let why = p.supported_on(kvsparse::Device::Cuda(0), 4).expect_err(pol);
        println!("{pol}: {why}");
    }
    let p = kvsparse::policy::Policy::parse("speculate(over=quest(budget=64), alpha=0.5, beta=0.1, gamma=1)").unwrap();
    assert!(p.supported_on(kvsparse::Device::Cuda(0), 4).is_ok());
}

fn main() {
    common::run("PRR", vec![
        ("cuda_prr_decisions_equal_the_cpu_engine", cuda_prr_decisions_equal_the_cpu_engine as fn(), true),
        ("cuda_prr_first_decode_steps_without_prefill_equal_the_cpu_engine", cuda_prr_first_decode_steps_without_prefill_equal_the_cpu_engine as fn(), true),
        ("cuda_prr_decode_step_graph_replays_on_new_data", cuda_prr_decode_step_graph_replays_on_new_data as fn(), true),
        ("cuda_prr_graph_captured_on_a_stream_without_eager_calls", cuda_prr_graph_captured_on_a_stream_without_eager_calls as fn(), true),
        ("cuda_prr_refuses_what_it_does_not_run", cuda_prr_refuses_what_it_does_not_run as fn(), false),
    ]);
}
