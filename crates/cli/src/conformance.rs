//! `kvsparse conformance`: the case suite against the float64 reference on every available device, through
//! another library's C ABI (`--lib`), or written to files for other implementations (`--export`); and the
//! sparse contract of the decode policies.

use std::path::Path;

use kvsparse_conformance::dylib::{run_case_lib, Lib};
use kvsparse_conformance::export::{export, KVSPARSE_RESULTS};
use kvsparse_conformance::sparse::{self, ContractResult};
use kvsparse_conformance::{run_case_cpu, suite, CaseResult};
use kvsparse::rng::Rng;

use crate::args::Args;

const HELP: &str = "kvsparse conformance [--quick] [--seed N] [--filter A,B,..] [--lib PATH | --export DIR] [--dense-only]

Runs dense paged attention over the conformance suite (head sizes, dtypes, GQA ratios, block sizes,
query/sequence lengths, sliding window, soft-cap, and what serving feeds a kernel: shuffled and shared
block tables, stale or -1 unused table columns, unwritten slots holding garbage or NaN, blocks reused
from earlier sequences, strided views of one combined cache) on fresh random data and compares with a
float64 reference; then checks the sparse contract of the decode policies (full budget equals dense bit
for bit in f32, unselected pages may hold NaN, a reused block's metadata is reset, selections are per KV
head). Prints one line per case and device; cases a target does not support are reported as such, not
failed. Exits non-zero on any failure. Runs on CUDA device 0 too when a driver and device are present
(KVS_REQUIRE_CUDA=1: a missing device is a failure).

  --quick        a reduced suite: one representative per axis of the case matrix (head size, dtype, block
                 size, GQA ratio, lengths) plus every serving case, in seconds instead of minutes; the
                 sparse contract is the same
  --seed N       seed of the random inputs (case i uses N+i); default: fresh, printed on the first line so
                 a failure can be replayed with --seed N
  --lib PATH     run the suite and the sparse contract through the C ABI of the library at PATH (dlopen;
                 any build of kvsparse or another library exposing kvsparse.h) instead of in process
  --export DIR   write the suite to DIR (safetensors per case + manifest.json, float64 reference, tolerances
                 by dtype), kvsparse's CPU outputs to DIR/results/kvsparse-cpu, and DIR/check.py, a numpy-only
                 checker: python3 DIR/check.py DIR  (docs/conformance.md)
  --filter A,B   only cases and checks whose name contains any of the comma-separated substrings (none
                 matching is an error)
  --dense-only   skip the sparse contract";

pub fn run(argv: &[String]) -> Result<(), String> {
    let a = Args::parse(argv, &["seed", "filter", "lib", "export"], &["quick", "dense-only"], HELP)?;
    let seed = a.get("seed", Rng::fresh_seed())?;
    let filter = a.str("filter").unwrap_or("").to_string();
    let quick = a.flag("quick");
    let cases: Vec<_> = suite(quick).into_iter().filter(|c| selected(&c.name, &filter)).collect();
    let with_contract = !a.flag("dense-only") && a.str("export").is_none();
    if cases.is_empty() && !(with_contract && sparse::checks(seed).iter().any(|c| selected(&c.name, &filter))) {
        return Err(format!("--filter {filter:?} matches no case{}", if with_contract { " and no sparse-contract check" } else { "" }));
    }
    println!("seed {seed} (replay with --seed {seed})");
    if let Some(dir) = a.str("export") {
        return run_export(Path::new(dir), &cases, seed);
    }
    let lib = match a.str("lib") {
        Some(p) => Some(Lib::open(Path::new(p))?),
        None => None,
    };
    let device = if lib.is_some() { "lib" } else { "cpu" };
    if let Some(l) = &lib {
        println!("library {} (ABI version {})", l.path.display(), l.abi_version());
    }
    println!("{:<6} {:<42} {:>10} {:>10}  result", "device", "case", "rel_err", "lse_err");
    let mut results: Vec<(String, CaseResult)> = Vec::new();
    for (i, spec) in cases.iter().enumerate() {
        let case_seed = seed.wrapping_add(i as u64);
        let r = match &lib {
            Some(l) => run_case_lib(l, spec, case_seed),
            None => run_case_cpu(spec, case_seed),
        };
        print_row(device, &r);
        results.push((device.into(), r));
    }
    if lib.is_none() {
        results.extend(crate::conformance_cuda::run_matrix(quick, seed, &filter)?);
    }
    let mut contract = Vec::new();
    if !a.flag("dense-only") {
        println!("sparse contract (policies on decode rows; dense_layers=0)");
        let checks = sparse::checks(seed).into_iter().filter(|c| selected(&c.name, &filter));
        for check in checks {
            let r = match &lib {
                Some(l) => check.run(&mut |g, p| sparse::lib_session(l, g, p)),
                None => check.run(&mut sparse::cpu_session),
            };
            print_contract(device, &r);
            contract.push(r);
        }
        if lib.is_none() {
            contract.extend(crate::conformance_cuda::run_sparse(seed, &filter)?);
        }
    }
    summarize(&results, &contract)
}

fn summarize(results: &[(String, CaseResult)], contract: &[ContractResult]) -> Result<(), String> {
    let unsupported = results.iter().filter(|(_, r)| r.unsupported).count() + contract.iter().filter(|r| r.unsupported).count();
    let failed = results.iter().filter(|(_, r)| !r.pass && !r.unsupported).count() + contract.iter().filter(|r| r.failed()).count();
    let passed = results.iter().filter(|(_, r)| r.pass).count() + contract.iter().filter(|r| r.pass).count();
    let known = contract.iter().filter(|r| r.known).count();
    println!("{passed} passed, {failed} failed, {unsupported} unsupported, {known} known deviations");
    if failed > 0 {
        return Err(format!("{failed} case(s) failed"));
    }
    Ok(())
}

fn run_export(dir: &Path, cases: &[kvsparse_conformance::CaseSpec], seed: u64) -> Result<(), String> {
    println!("exporting {} cases to {} (kvsparse CPU outputs in results/{KVSPARSE_RESULTS})", cases.len(), dir.display());
    let (results, bytes) = export(dir, cases, seed, |r| print_row("cpu", r))?;
    println!("wrote {:.1} MB; check with: python3 {}/check.py {}", bytes as f64 / 1e6, dir.display(), dir.display());
    let rs: Vec<(String, CaseResult)> = results.into_iter().map(|r| ("cpu".to_string(), r)).collect();
    summarize(&rs, &[])
}

/// Does `name` match the `--filter` (comma-separated substrings, any of them; empty matches all)?
pub fn selected(name: &str, filter: &str) -> bool {
    filter.is_empty() || filter.split(',').any(|f| !f.is_empty() && name.contains(f))
}

pub fn print_row(device: &str, r: &CaseResult) {
    println!("{:<6} {:<42} {:>10.2e} {:>10.2e}  {}", device, r.name, r.rel_err, r.lse_err, r.verdict());
}

pub fn print_contract(device: &str, r: &ContractResult) {
    println!("{:<6} {:<64} {}", device, r.name, r.verdict());
}
