//! The CUDA prefill kernel (kernels/attention_prefill.cu: rows of query length != 1) against the float64
//! reference: whole prompts, chunked prefill over a cached prefix, short extends, next to decode rows, over
//! random paged caches (shuffled tables, NaN or garbage in unwritten slots, reused blocks), GQA 1/4/8,
//! head sizes 64/128/256, f16/bf16, sliding window and soft-cap, output and LSE within the dense
//! tolerances; a short chunk over a long prefix (split-KV and the combine). Bad metadata on prefill rows
//! is tested with the other device checks (tests/cuda_checks.rs, case "prefill-bf16-gqa8"). Without a
//! CUDA device the tests are listed as ignored (KVS_REQUIRE_CUDA=1 makes that a failure). Fresh random
//! shapes and data each run; the seed is printed.

use kvsparse::rng::Rng;
use kvsparse::DType;
use kvsparse_conformance::cuda::{cuda_required, run_case_cuda};
use kvsparse_conformance::fixture::Poison;
use kvsparse_conformance::CaseSpec;

/// A random batch: `n` sequences, each a whole prompt, a chunk over a cached prefix, an extend of 2..8
/// tokens or a decode row; at least one of each of the first three.
fn random_seqs(rng: &mut Rng, n: usize, max_len: usize) -> Vec<(usize, usize)> {
    (0..n)
        .map(|i| {
            let len = 2 + rng.below(max_len - 1);
            match if i < 3 { i } else { rng.below(4) } {
                0 => (len, len),
                1 => (2 + rng.below(len.min(300) - 1), len),
                2 => ((2 + rng.below(7)).min(len), len),
                _ => (1, len),
            }
        })
        .collect()
}

/// KVS_QUICK=1 (compute-sanitizer): short sequences, four shapes and the split-KV case.
fn quick() -> bool {
    std::env::var("KVS_QUICK").is_ok_and(|v| v == "1")
}

fn specs(seed: u64) -> Vec<CaseSpec> {
    let mut rng = Rng::new(seed);
    let quick = quick();
    let mut out = Vec::new();
    // (head size, query heads, KV heads, dtype, block size, window, soft-cap)
    let shapes = [
        (128, 8, 8, DType::BF16, 16, 0, 0.0),
        (128, 8, 2, DType::F16, 16, 0, 0.0),
        (64, 16, 2, DType::BF16, 32, 0, 0.0),
        (64, 8, 2, DType::F16, 16, 100, 0.0),
        (128, 16, 2, DType::BF16, 16, 0, 30.0),
        (128, 8, 2, DType::BF16, 64, 77, 20.0),
        (64, 4, 4, DType::F16, 8, 0, 0.0),
        (256, 8, 2, DType::BF16, 16, 0, 0.0),
        (128, 32, 8, DType::BF16, 16, 0, 0.0),
    ];
    for (i, &(hd, hq, hk, dt, bs, win, cap)) in shapes.iter().enumerate() {
        if quick && i % 2 == 1 {
            continue;
        }
        let n = 3 + rng.below(5);
        let seqs = random_seqs(&mut rng, n, if quick { 200 } else { 1500 });
        let mut c = CaseSpec::new(format!("prefill-h{hd}-{hq}x{hk}-{dt:?}-bs{bs}-w{win}-cap{cap}"), dt, hd, hq, hk, bs, seqs);
        c.window = win;
        c.softcap = cap;
        c.strided = i % 3 == 1;
        if i % 2 == 0 {
            c.poison = Poison::NaN;
        } else {
            c.reused = true;
        }
        out.push(c);
    }
    // A short chunk over a long prefix (split-KV), beside decode rows; and a token-aligned whole prompt.
    let long = if quick { 4200 } else { 9000 };
    let mut c = CaseSpec::new(format!("prefill-chunk-over-{long}-prefix-bf16-gqa4"), DType::BF16, 128, 32, 8, 16, vec![(1, 5000), (40, long), (1, 300)]);
    c.poison = Poison::NaN;
    out.push(c);
    if quick {
        return out;
    }
    out.push(CaseSpec::new("prefill-whole-2048-f16-gqa4", DType::F16, 128, 8, 2, 16, vec![(2048, 2048)]));
    out
}

fn prefill_rows_match_the_float64_reference() {
    if !kvsparse::cuda::device_available() {
        assert!(!cuda_required(), "KVS_REQUIRE_CUDA=1 but no CUDA device/driver is available");
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    for (i, spec) in specs(seed).iter().enumerate() {
        let r = run_case_cuda(spec, seed.wrapping_add(i as u64));
        println!("cuda {:<48} {:?} rel_err {:.2e} lse_err {:.2e} {}", r.name, spec.seqs, r.rel_err, r.lse_err, if r.pass { "ok" } else { "FAIL" });
        if !r.pass {
            failures.push(format!("{} (seed {}): rel {:.3e} lse {:.3e} {:?}", r.name, r.seed, r.rel_err, r.lse_err, r.error));
        }
    }
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
}

fn main() {
    use libtest_mimic::{Arguments, Trial};
    let args = Arguments::from_args();
    let skip = !kvsparse::cuda::device_available() && !cuda_required();
    let tests = vec![Trial::test("prefill_rows_match_the_float64_reference", || {
        prefill_rows_match_the_float64_reference();
        Ok(())
    })
    .with_ignored_flag(skip)];
    libtest_mimic::run(&args, tests).exit();
}
