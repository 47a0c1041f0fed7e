//! FP8 KV caches on the CUDA engine (issue 28): the conformance FP8 cases against the float64 reference
//! over the dequantized cache (the query dtype's tolerance), and the device's cache write against the
//! host's quantization of the same rows, byte for byte (vLLM's `x / scale`, nearest even, saturating).
//! Cases the CUDA engine does not serve (float32 queries; rows not 16-byte aligned) must be refused as
//! unsupported. Every policy over FP8 caches, CPU engine against CUDA engine over the same FP8 bytes
//! (`cuda_fp8_policies_match_the_cpu_engine` and its `_snapkv`, `_refresh`, `_predictor`, `_prr`, `_art`
//! siblings; the filter `cuda_fp8_policies` runs them all). Without a device the tests are listed as
//! ignored (KVS_REQUIRE_CUDA=1: a failure); KVS_QUICK=1 keeps one case per FP8 format in the first test
//! and one geometry in the others (compute-sanitizer). Fresh data; the seed is printed.

use kvsparse::rng::Rng;
use kvsparse::{DType, ErrorKind};
use kvsparse_conformance::cuda::{cuda_required, run_fixture_cuda_with_cache};
use kvsparse_conformance::fixture::CaseSpec;
use kvsparse_conformance::{fp8, judge, Fixture};

fn quick() -> bool {
    std::env::var("KVS_QUICK").map(|v| v == "1").unwrap_or(false)
}

/// GQA groups of more than 8 query heads (the kernel's FP8 path then runs two head halves per channel
/// tile), which the shared FP8 matrix does not reach: 12 (a half-full second half) and 16.
fn wide_groups() -> Vec<CaseSpec> {
    let mk = |name: &str, cache, dtype, hq| {
        let mut c = CaseSpec::new(name, dtype, 128, hq, 2, 16, vec![(1, 700), (2, 64), (1, 17)]);
        c.cache_dtype = Some(cache);
        c
    };
    vec![mk("fp8-e4m3-h128-bf16-q24k2-bs16", DType::F8E4M3, DType::BF16, 24), mk("fp8-e5m2-h128-f16-q32k2-bs16", DType::F8E5M2, DType::F16, 32)]
}

fn cuda_fp8_cases_match_the_reference_and_the_host_quantization() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    let mut served = 0;
    let mut specs = fp8(quick());
    if !quick() {
        specs.extend(wide_groups());
    }
    for (i, spec) in specs.iter().enumerate() {
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

/// The FP8 geometries of the policy tests: E4M3 under bf16 queries at head size 128, E5M2 under f16
/// queries at head size 64 with a sliding window (KVS_QUICK=1: the first only).
fn fp8_specs() -> Vec<CaseSpec> {
    let mk = |name: &str, dtype, head_dim, hq, hk, bs, window, cache| {
        let mut c = CaseSpec::new(name, dtype, head_dim, hq, hk, bs, vec![(1, 1), (1, 17), (1, 300), (7, 900), (1, 1500), (1, 4000)]);
        c.window = window;
        c.cache_dtype = Some(cache);
        c
    };
    let mut specs = vec![mk("fp8-e4m3-h128-bf16-gqa4-bs16", DType::BF16, 128, 8, 2, 16, 0, DType::F8E4M3), mk("fp8-e5m2-h64-f16-gqa8-bs8-window", DType::F16, 64, 16, 2, 8, 700, DType::F8E5M2)];
    if quick() {
        specs.truncate(1);
    }
    specs
}

/// The policies the CUDA engine runs over FP8 caches through the key metadata (Quest, streaming, top-p
/// over either), each on the CPU engine and on the device over the same FP8 bytes: the same key metadata
/// bit for bit (Quest bounds and the INT4 copy from the dequantized keys), the same visits (Quest alone by
/// the agreement contract of its tensor-core scores, crates/conformance/src/quest_agree.rs), counters, and
/// outputs within the query dtype's tolerance. A kernel that read raw FP8 codes, or dropped a scale, would
/// differ (the fixture's scales are ~0.01). The policies with kernels of their own that read FP8 rows
/// follow (`cuda_fp8_policies_match_the_cpu_engine_*`).
fn cuda_fp8_policies_match_the_cpu_engine() {
    use kvsparse_conformance::sparse_cuda::run_sparse_case;
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let policies = [
        "streaming(sink=4, recent=64)",
        "quest(budget=128)",
        "quest(budget=96, page=8, sink=16)",
        "quest(budget=256, sink=4) > top_p(p=0.95)",
        "all > top_p(p=0.9)",
    ];
    let specs = fp8_specs();
    let mut failures = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        for (j, pol) in policies.iter().enumerate() {
            let r = run_sparse_case(spec, pol, seed.wrapping_add((i * 16 + j) as u64));
            println!(
                "fp8 {:<36} {:<44} rows {:>3} decisions {} meta {} rel {:.2e} lse {:.2e}{} {}",
                r.name,
                pol,
                r.rows,
                if r.decision_mismatch.is_none() { "agree" } else { "DIFF" },
                if r.meta_equal { "same" } else { "DIFF" },
                r.rel_err,
                r.lse_err,
                r.quest.map_or(String::new(), |(n, w)| format!(" quest pages apart {n} (worst {w:.2} of delta)")),
                if r.pass { "ok" } else { "FAIL" }
            );
            if r.rows == 0 || !r.pass {
                failures.push(format!("{} / {pol} (seed {}): rows {} {:?} {:?} meta_equal={} rel {:.3e} lse {:.3e} error {:?}", r.name, r.seed, r.rows, r.decision_mismatch, r.counters_mismatch, r.meta_equal, r.rel_err, r.lse_err, r.error));
            }
        }
    }
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
}

/// SnapKV over FP8: its choice runs the scalar phases (kernels/policy/snapkv.cu), which read the keys
/// decoded times k_scale in the CPU's arithmetic, so the GPU keeps exactly the CPU engine's positions (no
/// differing position, a stricter test than SnapKV's agreement contract over 16-bit caches); counters
/// equal, decode outputs within the query dtype's tolerance of the CPU engine's (snapkv_cuda.rs: a
/// prefill call that chooses, then a decode call that reads the choice).
fn cuda_fp8_policies_match_the_cpu_engine_snapkv() {
    use kvsparse_conformance::snapkv_cuda::{run_snapkv_case, snapkv_policies, snapkv_spec};
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    for (i, spec) in fp8_specs().iter().enumerate() {
        let spec = snapkv_spec(spec);
        for (j, pol) in snapkv_policies().iter().enumerate() {
            let r = run_snapkv_case(&spec, pol, seed.wrapping_add((i * 16 + j) as u64));
            let b = &r.base;
            println!("fp8 {:<36} {:<48} rows {:>3} differing {} rel {:.2e} lse {:.2e} {}", b.name, pol, b.rows, r.agree.differing, b.rel_err, b.lse_err, if b.pass && r.agree.differing == 0 { "ok" } else { "FAIL" });
            if !b.pass || r.agree.differing > 0 {
                failures.push(format!("{} / {pol} (seed {}): rows {} differing {} {:?} {:?} rel {:.3e} lse {:.3e} error {:?}", b.name, b.seed, b.rows, r.agree.differing, b.decision_mismatch, b.counters_mismatch, b.rel_err, b.lse_err, b.error));
            }
        }
    }
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
}

/// RefreshKV over FP8, over many steps (refresh_cuda.rs; the caches quantized on write, the references
/// over the dequantized rows): its full steps take their weights from the tensor-core attention's logits
/// over the FP8 rows (attention_mma.cu KV8 with LOGITS: keys widened to f16, k_scale in the logit scale), so
/// sets agree with the CPU engine's by the contract (every differing position within the stated margin of
/// the boundary, refresh_agree.rs, its FP8 term included; the count and the worst margin printed); the
/// prefill seeds score in the CPU's arithmetic over keys decoded times k_scale; the same schedule and
/// counters, outputs within the query dtype's tolerance (of f64 attention over the GPU's own set where a
/// set differs); a sequence unseen at prefill and a released id included.
fn cuda_fp8_policies_match_the_cpu_engine_refresh() {
    use kvsparse_conformance::refresh_cuda::{refresh_policies, run_refresh_case, Variant};
    let steps = if quick() { 5 } else { 9 };
    let (mut failures, mut full, mut partial, mut differing) = (Vec::new(), 0, 0, 0);
    for (i, spec) in fp8_specs().iter().enumerate() {
        for (j, pol) in refresh_policies().iter().enumerate() {
            let v = Variant { unseen: true, release_at: Some(steps / 2), max_seqs: None };
            let seed = 177 + (i * 100 + j) as u64;
            let r = run_refresh_case(spec, pol, &[40, 300, 900, 1500], steps, v, seed);
            full += r.full_steps;
            partial += r.partial_steps;
            differing += r.agreement.differing;
            println!(
                "fp8 {:<36} {:<40} rows {:>4} full {:>3} partial {:>3} differing {} worst margin {:.2e} (delta {:.2e}) {} {} counters {} rel {:.2e} lse {:.2e} {}",
                spec.name,
                pol,
                r.rows,
                r.full_steps,
                r.partial_steps,
                r.agreement.differing,
                r.agreement.worst_margin,
                r.agreement.delta_at_worst,
                r.agreement.violation.as_deref().unwrap_or("all borderline"),
                r.decision_mismatch.as_deref().unwrap_or("same schedule"),
                r.counters_mismatch.as_deref().unwrap_or("equal"),
                r.rel_err,
                r.lse_err,
                if r.pass { "ok" } else { "FAIL" }
            );
            if !r.pass {
                failures.push(format!("{} / {pol} (seed {seed}): differing {} {:?} {:?} {:?} rel {:.3e} lse {:.3e} error {:?}", spec.name, r.agreement.differing, r.decision_mismatch, r.agreement.violation, r.counters_mismatch, r.rel_err, r.lse_err, r.error));
            }
        }
    }
    println!("fp8 refresh: {full} full and {partial} partial steps, {differing} differing positions");
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
    assert!(full > 0 && partial > 0, "the queries must drift enough for both full and partial steps");
}

/// The AttentionPredictor over FP8 (predictor_cuda.rs): its history rows read the keys decoded times
/// k_scale in the CPU's arithmetic; its CNN runs on the tensor cores as over 16-bit caches, so sets agree by that
/// contract (a differing block within the stated margin of the boundary, checked against the exact
/// prediction over the dequantized cache); the same schedule and counters where sets agree, outputs within
/// the query dtype's tolerance of the CPU engine's (or of f64 attention over the GPU's own set).
fn cuda_fp8_policies_match_the_cpu_engine_predictor() {
    use kvsparse_conformance::predictor_cuda::{predictor_policies, predictor_spec, run_predictor_case};
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    for (i, spec) in fp8_specs().iter().enumerate() {
        let spec = predictor_spec(spec);
        for (j, pol) in predictor_policies().iter().enumerate() {
            let r = run_predictor_case(&spec, pol, seed.wrapping_add((i * 16 + j) as u64));
            println!(
                "fp8 {:<36} {:<60} rows {:>4} calib {:>3} predicted {:>3} differing rows {} blocks {} worst margin {:.2e} rel {:.2e} lse {:.2e} {}",
                spec.name,
                pol,
                r.rows,
                r.full_steps,
                r.partial_steps,
                r.differing_rows,
                r.differing_blocks,
                r.worst_margin,
                r.rel_err,
                r.lse_err,
                if r.pass { "ok" } else { "FAIL" }
            );
            if !r.pass {
                failures.push(format!("{} / {pol} (seed {}): {:?} {:?} rel {:.3e} lse {:.3e} error {:?}", spec.name, r.seed, r.decision_mismatch, r.counters_mismatch, r.rel_err, r.lse_err, r.error));
            }
        }
    }
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
}

/// PRR over FP8 (prr_cuda.rs: a prefill call that calibrates, then decode steps): its scores read Quest's
/// bounds (from the dequantized keys), its speculative attention the plan kernel and its repair attention
/// FP8 rows decoded times k_scale / v_scale; the same visits and counters (spec_* included) as the CPU
/// engine after every call, outputs within the query dtype's tolerance.
fn cuda_fp8_policies_match_the_cpu_engine_prr() {
    use kvsparse_conformance::prr_cuda::{prr_policies, run_prr_case};
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let (mut failures, mut repaired) = (Vec::new(), 0);
    for (i, spec) in fp8_specs().iter().enumerate() {
        for (j, pol) in prr_policies().iter().enumerate() {
            let r = run_prr_case(spec, pol, if quick() { 3 } else { 5 }, seed.wrapping_add((i * 16 + j) as u64));
            repaired += r.spec[3];
            println!("fp8 {:<36} {:<84} calls {} rows {:>4} spec {:?} rel {:.2e} lse {:.2e} {}", spec.name, pol, r.calls, r.rows, r.spec, r.rel_err, r.lse_err, if r.pass { "ok" } else { "FAIL" });
            if !r.pass {
                failures.push(format!("{} / {pol} (seed {}): {:?} {:?} rel {:.3e} lse {:.3e} error {:?}", spec.name, r.seed, r.decision_mismatch, r.counters_mismatch, r.rel_err, r.lse_err, r.error));
            }
        }
    }
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
    assert!(repaired > 0, "no page was repaired: the repair attention over FP8 rows was not exercised");
}

/// ART over FP8: the terminating tensor-core kernel reads FP8 rows (its probe takes the output channel
/// the CPU's probe reads, times v_scale), so it stops at the CPU engine's tile by the contract of
/// `cuda_art_stops_at_the_cpu_engine_tile` (crates/conformance/tests/cuda_sparse.rs): a row may stop
/// elsewhere only within the bracket of the CPU runs with thresholds scaled by 1 ± 2%, such rows below
/// 10%; rows that stopped at the same tile attend the same keys, outputs within the dense tolerance.
fn cuda_fp8_policies_match_the_cpu_engine_art() {
    use kvsparse_conformance::sparse_cuda::check_art_stops;
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let eps = 0.02;
    let pols: [(&str, fn(f64) -> String); 5] = [
        ("art(1e-3, 1e-2, 2)", |s| format!("art(tau={}, phi={}, patience=2)", 1e-3 * s, 1e-2 * s)),
        ("art(3e-3, 3e-2, 1)", |s| format!("art(tau={}, phi={}, patience=1)", 3e-3 * s, 3e-2 * s)),
        ("art(1e-3, 1e-2, 2, seg 256)", |s| format!("art(tau={}, phi={}, patience=2, segment=256)", 1e-3 * s, 1e-2 * s)),
        ("quest(512) > art(1e-3, 1e-2, 2)", |s| format!("quest(budget=512) > art(tau={}, phi={}, patience=2)", 1e-3 * s, 1e-2 * s)),
        ("streaming > art(3e-3, 3e-2, 1, seg 128)", |s| format!("streaming(sink=4, recent=1000) > art(tau={}, phi={}, patience=1, segment=128)", 3e-3 * s, 3e-2 * s)),
    ];
    // Decode-only fixtures (art_stop_tiles maps rows to tokens), as cuda_art_stops_at_the_cpu_engine_tile's;
    // the last, one long row walked by many splits (the split-parallel traversal and its re-run).
    let fp8_case = |name: &str, dtype, head_dim, hq, hk, seqs, cache| {
        let mut c = CaseSpec::new(name, dtype, head_dim, hq, hk, 16, seqs);
        c.cache_dtype = Some(cache);
        c
    };
    let mut specs = vec![
        fp8_case("fp8-e4m3-art-h128-bf16-gqa4-bs16", DType::BF16, 128, 8, 2, vec![(1, 1), (1, 17), (1, 300), (1, 900), (1, 1500), (1, 4000)], DType::F8E4M3),
        fp8_case("fp8-e5m2-art-h64-f16-gqa3-bs16", DType::F16, 64, 9, 3, vec![(1, 65), (1, 777), (1, 2047), (1, 3000)], DType::F8E5M2),
        fp8_case("fp8-e4m3-art-h128-bf16-gqa4-bs16-long", DType::BF16, 128, 8, 2, vec![(1, 20000)], DType::F8E4M3),
    ];
    if quick() {
        specs.truncate(1);
    }
    let (rows, same, border, early) = check_art_stops("fp8 art", &specs, &pols, eps, seed);
    println!("{rows} rows: {same} same stop tile, {border} borderline (within ±{eps} of a threshold), {early} stopped early on the CPU");
    assert!(border * 10 <= rows, "seed {seed}: {border} of {rows} rows borderline");
    assert!(early > 0, "seed {seed}: no row stopped early; the settings test nothing");
}

fn main() {
    use libtest_mimic::{Arguments, Trial};
    let args = Arguments::from_args();
    let skip = !kvsparse::cuda::device_available() && !cuda_required();
    if skip {
        println!("no CUDA device: the GPU tests below are skipped, listed as ignored (KVS_REQUIRE_CUDA=1 makes a missing device a failure)");
    }
    let tests = vec![
        Trial::test("cuda_fp8_cases_match_the_reference_and_the_host_quantization", || {
            cuda_fp8_cases_match_the_reference_and_the_host_quantization();
            Ok(())
        })
        .with_ignored_flag(skip),
    ];
    let policies: [(&str, fn()); 6] = [
        ("cuda_fp8_policies_match_the_cpu_engine", cuda_fp8_policies_match_the_cpu_engine),
        ("cuda_fp8_policies_match_the_cpu_engine_snapkv", cuda_fp8_policies_match_the_cpu_engine_snapkv),
        ("cuda_fp8_policies_match_the_cpu_engine_refresh", cuda_fp8_policies_match_the_cpu_engine_refresh),
        ("cuda_fp8_policies_match_the_cpu_engine_predictor", cuda_fp8_policies_match_the_cpu_engine_predictor),
        ("cuda_fp8_policies_match_the_cpu_engine_prr", cuda_fp8_policies_match_the_cpu_engine_prr),
        ("cuda_fp8_policies_match_the_cpu_engine_art", cuda_fp8_policies_match_the_cpu_engine_art),
    ];
    let tests: Vec<Trial> = tests
        .into_iter()
        .chain(policies.into_iter().map(|(name, f)| {
            Trial::test(name, move || {
                f();
                Ok(())
            })
            .with_ignored_flag(skip)
        }))
        .collect();
    libtest_mimic::run(&args, tests).exit();
}
