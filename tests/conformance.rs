//! Dense paged attention vs the float64 reference over the whole conformance matrix, on fresh random
//! data each run (the seed is printed; rerun with KVS_SEED=<seed> to replay).

use kvsparse::conformance::nonfinite::{check_all_attention, check_merge, merge_on_cpu};
use kvsparse::conformance::{matrix, run_case_cpu, run_fixture_cpu};
use kvsparse::rng::Rng;

#[test]
fn cpu_matches_float64_reference_on_the_matrix() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    for (i, spec) in matrix(false).iter().enumerate() {
        let r = run_case_cpu(spec, seed.wrapping_add(i as u64));
        println!("{:<40} rel_err {:.2e} lse_err {:.2e} {}", r.name, r.rel_err, r.lse_err, if r.pass { "ok" } else { "FAIL" });
        if !r.pass {
            failures.push(format!("{} (seed {}): rel {:.3e} lse {:.3e} {:?}", r.name, r.seed, r.rel_err, r.lse_err, r.error));
        }
    }
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
}

#[test]
fn portable_and_simd_paths_agree() {
    // The same case through the run-time-selected path must match the reference; the portable path is
    // exercised by running the whole binary with KVS_CPU_PORTABLE=1 (done in .ci/run).
    let spec = &matrix(true)[0];
    let r = run_case_cpu(spec, Rng::fresh_seed());
    assert!(r.pass, "{r:?}");
}

/// NaN and infinity in queries, keys and values propagate as the header documents (NaN row and LSE for a
/// non-finite logit, non-finite elements for a non-finite value), and nothing a row does not attend
/// changes it. The same check runs on CUDA (`tests/cuda.rs`).
#[test]
fn cpu_propagates_nan_and_inf_as_documented() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let results = check_all_attention(seed, &mut |f| run_fixture_cpu(f));
    let mut failures = Vec::new();
    for r in &results {
        println!("{:<40} rel_err {:.2e} lse_err {:.2e} {}", r.name, r.rel_err, r.lse_err, if r.pass { "ok" } else { "FAIL" });
        if !r.pass {
            failures.push(format!("{} (seed {}): {:?}", r.name, r.seed, r.error));
        }
    }
    assert_eq!(results.len(), 8);
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
}

#[test]
fn cpu_merge_propagates_nan_and_inf_as_documented() {
    for dtype in [kvsparse::DType::F32, kvsparse::DType::BF16] {
        let r = check_merge(dtype, Rng::fresh_seed(), &mut merge_on_cpu);
        assert!(r.pass, "{r:?}");
    }
}
