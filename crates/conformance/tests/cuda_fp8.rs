//! FP8 KV caches on the CUDA engine (issue 28): the conformance FP8 cases against the float64 reference
//! over the dequantized cache (the query dtype's tolerance), and the device's cache write against the
//! host's quantization of the same rows, byte for byte (vLLM's `x / scale`, nearest even, saturating).
//! Cases the CUDA engine does not serve (float32 queries; rows not 16-byte aligned) must be refused as
//! unsupported. Without a device the tests are listed as ignored (KVS_REQUIRE_CUDA=1: a failure);
//! KVS_QUICK=1 keeps one case per FP8 format (compute-sanitizer). Fresh data; the seed is printed.

use kvsparse::rng::Rng;
use kvsparse::{DType, ErrorKind};
use kvsparse_conformance::cuda::{cuda_required, run_fixture_cuda_with_cache};
use kvsparse_conformance::{fp8, judge, Fixture};

fn quick() -> bool {
    std::env::var("KVS_QUICK").map(|v| v == "1").unwrap_or(false)
}

fn cuda_fp8_cases_match_the_reference_and_the_host_quantization() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    let mut served = 0;
    for (i, spec) in fp8(quick()).iter().enumerate() {
        let case_seed = seed.wrapping_add(i as u64);
        let f = Fixture::new(spec, case_seed);
        let expect_served = spec.dtype != DType::F32 && !spec.strided;
        match run_fixture_cuda_with_cache(&f) {
            Ok((outs, cache)) => {
                let r = judge(&f, &outs, case_seed);
                let same_bytes = cache == f.written_cache().as_bytes();
                println!("cuda {:<40} rel_err {:.2e} lse_err {:.2e} {} cache bytes {}", r.name, r.rel_err, r.lse_err, if r.pass { "ok" } else { "FAIL" }, if same_bytes { "= host" } else { "DIFFER" });
                if !r.pass || !same_bytes || !expect_served {
                    failures.push(format!("{} (seed {case_seed}): rel {:.3e} lse {:.3e}, cache bytes equal: {same_bytes}, expected served: {expect_served}", r.name, r.rel_err, r.lse_err));
                }
                served += 1;
            }
            Err(e) => {
                println!("cuda {:<40} refused: {e}", spec.name);
                if expect_served || e.kind != ErrorKind::Unsupported {
                    failures.push(format!("{} (seed {case_seed}): {e}", spec.name));
                }
            }
        }
    }
    assert!(served >= 2, "fewer than two FP8 cases ran on the device");
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
}

fn main() {
    use libtest_mimic::{Arguments, Trial};
    let args = Arguments::from_args();
    let skip = !kvsparse::cuda::device_available() && !cuda_required();
    if skip {
        println!("no CUDA device: the GPU tests below are skipped, listed as ignored (KVS_REQUIRE_CUDA=1 makes a missing device a failure)");
    }
    let tests = vec![Trial::test("cuda_fp8_cases_match_the_reference_and_the_host_quantization", || {
        cuda_fp8_cases_match_the_reference_and_the_host_quantization();
        Ok(())
    })
    .with_ignored_flag(skip)];
    libtest_mimic::run(&args, tests).exit();
}
