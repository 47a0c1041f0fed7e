//! `kvsparse conformance`: the case matrix against the float64 reference on every available device.

use kvsparse::conformance::{matrix, run_case_cpu, CaseResult};
use kvsparse::rng::Rng;

use crate::args::Args;

const HELP: &str = "kvsparse conformance [--quick] [--seed N] [--filter SUBSTRING]

Runs dense paged attention over the conformance matrix (head sizes, dtypes, GQA ratios, block sizes,
query/sequence lengths, sliding window, soft-cap, shuffled tables, strided tensors) on fresh random data
and compares with a float64 reference. Prints one line per case and device; exits non-zero on any failure. Runs on CUDA device 0 too when a\ndriver and device are present (KVS_REQUIRE_CUDA=1: a missing device is a failure).";

pub fn run(argv: &[String]) -> Result<(), String> {
    let a = Args::parse(argv, &["seed", "filter"], &["quick"], HELP)?;
    let seed = a.get("seed", Rng::fresh_seed())?;
    let filter = a.str("filter").unwrap_or("").to_string();
    println!("seed {seed} (replay with --seed {seed})");
    println!("{:<6} {:<42} {:>10} {:>10}  result", "device", "case", "rel_err", "lse_err");
    let mut results: Vec<(String, CaseResult)> = Vec::new();
    for (i, spec) in matrix(a.flag("quick")).iter().enumerate() {
        if !spec.name.contains(&filter) {
            continue;
        }
        let r = run_case_cpu(spec, seed.wrapping_add(i as u64));
        print_row("cpu", &r);
        results.push(("cpu".into(), r));
    }
    results.extend(crate::conformance_cuda::run_matrix(a.flag("quick"), seed, &filter)?);
    let failed = results.iter().filter(|(_, r)| !r.pass).count();
    println!("{} passed, {} failed", results.len() - failed, failed);
    if failed > 0 {
        return Err(format!("{failed} case(s) failed"));
    }
    Ok(())
}

pub fn print_row(device: &str, r: &CaseResult) {
    let verdict = if r.pass { "pass".to_string() } else { format!("FAIL {}", r.error.clone().unwrap_or_default()) };
    println!("{:<6} {:<42} {:>10.2e} {:>10.2e}  {}", device, r.name, r.rel_err, r.lse_err, verdict);
}
