//! Dense paged attention vs the float64 reference over the whole conformance matrix, on fresh random
//! data each run (the seed is printed; rerun with KVS_SEED=<seed> to replay).

use kvsparse::conformance::{matrix, run_case_cpu};
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
