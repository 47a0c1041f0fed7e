//! What the CUDA test binaries share (each is a libtest-mimic harness, `harness = false` in Cargo.toml):
//! the device check, the reduced-matrix switch and the runner that lists GPU tests as ignored without a
//! device. Included with `mod common;` (cargo builds no binary from this folder).
#![allow(dead_code)]

use kvsparse_conformance::cuda::cuda_required;

/// True when a device is there; false (the test returns at once) when not, unless KVS_REQUIRE_CUDA=1
/// makes that a failure.
pub fn have_cuda(test: &str) -> bool {
    if kvsparse::cuda::device_available() {
        return true;
    }
    assert!(!cuda_required(), "{test}: KVS_REQUIRE_CUDA=1 but no CUDA device/driver is available");
    false
}

/// KVS_QUICK=1: the reduced matrices (for compute-sanitizer).
pub fn quick() -> bool {
    std::env::var("KVS_QUICK").map(|v| v == "1").unwrap_or(false)
}

/// Runs `tests` (name, function, needs a GPU): without a device the GPU ones are listed as ignored (a
/// visible skip), and fail instead when KVS_REQUIRE_CUDA=1.
pub fn run(what: &str, tests: Vec<(&'static str, fn(), bool)>) -> ! {
    use libtest_mimic::{Arguments, Trial};
    let args = Arguments::from_args();
    let skip = !kvsparse::cuda::device_available() && !cuda_required();
    if skip {
        println!("no CUDA device: the {what} GPU tests below are skipped, listed as ignored (KVS_REQUIRE_CUDA=1 makes a missing device a failure)");
    }
    let trials = tests
        .into_iter()
        .map(|(name, f, gpu)| {
            Trial::test(name, move || {
                f();
                Ok(())
            })
            .with_ignored_flag(skip && gpu)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit()
}
