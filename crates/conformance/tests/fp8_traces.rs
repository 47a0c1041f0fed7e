//! A real trace replayed over an FP8 cache (issue 28, acceptance 3 on the CPU): the trace's K/V quantized
//! on write (E4M3, vLLM's uncalibrated scale 1) change dense attention visibly but moderately, and a
//! policy's attention mass recovered (against the model's own softmax) stays within 0.01 of the same policy
//! over a bf16 cache. `kvsparse eval --cache-dtype fp8` prints the whole table (docs/quality.md).

use kvsparse::DType;
use kvsparse_conformance::eval::{mean, quantile, recovered_mass, row_errors};
use kvsparse_conformance::traces::{committed_traces_dir, replay, Manifest, ReplayOptions};

#[test]
fn fp8_cache_replay_keeps_dense_close_and_policy_mass_within_a_hundredth() {
    let Some(dir) = committed_traces_dir() else { return };
    let m = Manifest::load(&dir).expect("manifest");
    let info = m.traces.iter().find(|t| t.name == "needle_2k").unwrap_or(&m.traces[0]);
    let tr = m.load_trace(info).expect("trace");
    let bf16 = ReplayOptions { dtype: DType::BF16, step_stride: 8, threads: 2, record_visits: true, ..Default::default() };
    let fp8 = ReplayOptions { cache_dtype: Some(DType::F8E4M3), ..bf16 };
    let dense_bf16 = replay(&tr, "dense", &bf16).expect("replay");
    let dense_fp8 = replay(&tr, "dense", &fp8).expect("replay");
    let errs = row_errors(&dense_fp8, &dense_bf16, tr.d);
    let (med, p99) = (quantile(&errs, 0.5), quantile(&errs, 0.99));
    println!("dense over E4M3 vs over bf16: row rel err median {med:.2e}, p99 {p99:.2e}");
    assert!(med > 1e-3, "the FP8 cache should differ visibly from bf16 ({med})");
    assert!(med < 0.1 && p99 < 0.5, "median {med}, p99 {p99}");
    for policy in ["quest(budget=256)", "top_p(p=0.95)", "snapkv(budget=256)"] {
        let a = replay(&tr, policy, &bf16).expect("replay");
        let b = replay(&tr, policy, &fp8).expect("replay");
        let masses = recovered_mass(&tr, &[&a, &b]);
        let (ma, mb) = (mean(&masses[0]), mean(&masses[1]));
        println!("{policy:<20} mass recovered bf16 {ma:.4}, fp8 {mb:.4}");
        assert!((ma - mb).abs() <= 0.01, "{policy}: {ma} vs {mb}");
    }
}
