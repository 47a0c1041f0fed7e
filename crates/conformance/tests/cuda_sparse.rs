//! Sparse decode on CUDA against the CPU engine (the reference for the GPU's decisions): same visited
//! pages and tokens (Quest alone: agreement, differing pages only within delta of the cut, its ties
//! exact), same key metadata, same policy counters, outputs within the dense tolerances;
//! lossless settings equal dense attention; a captured sparse decode step replays on new data exactly as
//! an eager step; garbage device metadata stays in bounds. Without a CUDA device every test is listed as
//! ignored (a visible skip), and fails instead when KVS_REQUIRE_CUDA=1. KVS_QUICK=1 runs a reduced matrix
//! (for compute-sanitizer).

use kvsparse_conformance::cuda::DeviceCase;
use kvsparse_conformance::step_writes::step_writes_agree;
use kvsparse_conformance::snapkv_cuda::{run_snapkv_case, snapkv_policies, snapkv_spec, SnapResult};
use kvsparse_conformance::sparse_cuda::{check_art_stops, decode_step_meta_equal, run_sparse_case, run_sparse_case_keys, sparse_graph_replay, sparse_graph_replay_on, sparse_policies, sparse_specs};
use kvsparse_conformance::{judge, CaseSpec, Fixture, Outputs};
use kvsparse::rng::Rng;
use kvsparse::{DType, Device, Engine};

mod common;
use common::{have_cuda, quick};

/// The sparse matrix (every geometry x every policy): decisions as the contract says (bit-equal, or for
/// Quest alone agreement within delta), same metadata, counters and outputs within tolerance.
fn cuda_sparse_decisions_agree_with_the_cpu_engine() {
    if !have_cuda("cuda_sparse_decisions") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    let (mut quest_pages, mut worst) = (0usize, 0f64);
    let policies = sparse_policies();
    for (i, spec) in sparse_specs(quick()).iter().enumerate() {
        for (j, pol) in policies.iter().enumerate() {
            if quick() && (i + j) % 3 != 0 {
                continue;
            }
            let r = run_sparse_case(spec, pol, seed.wrapping_add((i * 100 + j) as u64));
            if let Some((n, ratio)) = r.quest {
                quest_pages += n;
                worst = worst.max(ratio);
            }
            println!(
                "sparse {:<36} {:<48} rows {:>4} decisions {} meta {} counters {} rel {:.2e} lse {:.2e} {}",
                r.name,
                r.policy,
                r.rows,
                match (&r.decision_mismatch, r.quest, r.top_p) {
                    (Some(_), _, _) => "DIFF".to_string(),
                    (None, Some((n, ratio)), _) if n > 0 => format!("agree ({n} pages apart, worst |S - S_k| / delta {ratio:.2e})"),
                    (None, _, Some((n, margin))) if n > 0 => format!("agree ({n} tokens apart, worst margin {margin:.2e})"),
                    _ => "same".to_string(),
                },
                if r.meta_equal { "same" } else { "DIFF" },
                if r.counters_mismatch.is_none() { "same" } else { "DIFF" },
                r.rel_err,
                r.lse_err,
                if r.pass { "ok" } else { "FAIL" }
            );
            if !r.pass {
                failures.push(format!("{} / {} (seed {}): {:?} {:?} meta_equal={} rel {:.3e} lse {:.3e} error {:?}", r.name, r.policy, r.seed, r.decision_mismatch, r.counters_mismatch, r.meta_equal, r.rel_err, r.lse_err, r.error));
            }
        }
    }
    println!("Quest alone: {quest_pages} pages kept by one engine only, worst |S - S_k| / delta {worst:.3e} (<= 1 required)");
    assert!(failures.is_empty(), "failing sparse cases:\n{}", failures.join("\n"));
}

/// Quest's top-k at ties: keys that make every page score the same (one value) or few values, on rows
/// short enough for the selection's gathered bin (250 pages) and long enough to overflow it (2,500 pages,
/// the whole-row fallback). The GPU must visit exactly the CPU engine's pages (ties go to the later page):
/// Quest's tensor-core scores of equal pages are equal, and the cut among them is by position as on the CPU.
fn cuda_quest_ties_equal_the_cpu_engine() {
    if !have_cuda("cuda_quest_ties") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let spec = CaseSpec::new("h128-bf16-gqa4-bs16-ties", DType::BF16, 128, 8, 2, 16, vec![(1, 4000), (1, 40000), (1, 1500)]);
    let one = |_row: usize| 0.25;
    let few = |row: usize| [0.5, -0.25, 0.125][(row / 16) % 3];
    let mut failures = Vec::new();
    for (name, key) in [("one value", &one as &dyn Fn(usize) -> f64), ("three values", &few)] {
        for pol in ["quest(budget=512)", "quest(budget=4096, sink=64)", "quest(budget=1000, page=8)"] {
            let r = run_sparse_case_keys(&spec, pol, seed, Some(key));
            println!("ties {name:<12} {pol:<32} rows {:>3} decisions {} counters {} rel {:.2e} {}", r.rows, if r.decision_mismatch.is_none() && r.quest.is_none_or(|q| q.0 == 0) { "same" } else { "DIFF" },
                if r.counters_mismatch.is_none() { "same" } else { "DIFF" }, r.rel_err, if r.pass { "ok" } else { "FAIL" });
            let apart = r.quest.map_or(0, |q| q.0);
            if !r.pass || apart > 0 {
                failures.push(format!("{name} / {pol} (seed {seed}): {apart} pages apart, {:?} {:?} meta_equal={} error {:?}", r.decision_mismatch, r.counters_mismatch, r.meta_equal, r.error));
            }
        }
    }
    assert!(failures.is_empty(), "failing tie cases:\n{}", failures.join("\n"));
}

/// Quest with few rows, where the clusters fit in one wave (here 6 or 12 row x KV-head pairs, 8 CTAs each;
/// sm_90 and newer): the cluster top-k over tensor-core scores; rows of 1 to 2,500 pages, head sizes 64-256 and groups 4-16 (one or two query tiles). Agreement as the sparse matrix states it: differing
/// pages only within delta of the cut, counters and outputs as the contract says. KVS_QUICK=1: the first
/// geometry, rows up to 4,000 tokens, two budgets (for compute-sanitizer).
fn cuda_quest_few_rows_agree_with_the_cpu_engine() {
    if !have_cuda("cuda_quest_few_rows") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut seqs = vec![(1, 1), (1, 17), (1, 300), (1, 1500), (1, 4000), (1, 40000)];
    if quick() {
        seqs.pop();
    }
    let specs = [
        CaseSpec::new("h128-bf16-gqa4-bs16-few", DType::BF16, 128, 8, 2, 16, seqs.clone()),
        CaseSpec::new("h64-f16-gqa8-bs16-few", DType::F16, 64, 16, 2, 16, seqs.clone()),
        CaseSpec::new("h256-bf16-gqa8-bs16-few", DType::BF16, 256, 8, 1, 16, seqs.clone()),
        CaseSpec::new("h128-f16-gqa16-bs16-few", DType::F16, 128, 32, 2, 16, seqs),
    ];
    let (mut failures, mut apart, mut worst) = (Vec::new(), 0usize, 0f64);
    let policies = ["quest(budget=128)", "quest(budget=512, sink=64)", "quest(budget=4096)", "quest(budget=1000000)"];
    let (specs, policies) = if quick() { (&specs[..1], &policies[..2]) } else { (&specs[..], &policies[..]) };
    for (i, spec) in specs.iter().enumerate() {
        for (j, pol) in policies.iter().enumerate() {
            let r = run_sparse_case(spec, pol, seed.wrapping_add((i * 10 + j) as u64));
            let (n, ratio) = r.quest.unwrap_or((0, 0.0));
            apart += n;
            worst = worst.max(ratio);
            println!("few rows {:<26} {pol:<28} rows {:>3} decisions {} counters {} rel {:.2e} lse {:.2e} {}", spec.name, r.rows,
                match &r.decision_mismatch { Some(_) => "DIFF".to_string(), None if n > 0 => format!("agree ({n} pages apart, worst |S - S_k| / delta {ratio:.2e})"), None => "same".to_string() },
                if r.counters_mismatch.is_none() { "same" } else { "DIFF" }, r.rel_err, r.lse_err, if r.pass { "ok" } else { "FAIL" });
            if !r.pass {
                failures.push(format!("{} / {pol} (seed {}): {:?} {:?} meta_equal={} rel {:.3e} error {:?}", spec.name, r.seed, r.decision_mismatch, r.counters_mismatch, r.meta_equal, r.rel_err, r.error));
            }
        }
    }
    println!("Quest few rows: {apart} pages kept by one engine only, worst |S - S_k| / delta {worst:.3e} (<= 1 required)");
    assert!(failures.is_empty(), "failing few-row cases:\n{}", failures.join("\n"));
}

/// A decode step's write keeps the key metadata in one launch on CUDA (kvs_write_step): after it, the
/// fill mask, Quest's bounds and the INT4 copy equal the CPU engine's bit for bit (block sizes 1..256).
fn cuda_decode_step_write_keeps_the_cpu_metadata() {
    if !have_cuda("cuda_decode_step_meta") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let seqs = vec![(1, 4000), (1, 1), (1, 17), (1, 1500), (1, 2777), (1, 64), (1, 257)];
    let mut failures = Vec::new();
    for (i, (dt, d, hq, hk, bs)) in [(DType::BF16, 128, 32, 8, 16), (DType::F16, 64, 16, 2, 8), (DType::BF16, 112, 4, 2, 256), (DType::F32, 80, 4, 4, 1)].into_iter().enumerate() {
        let spec = CaseSpec::new(format!("step-meta-h{d}-bs{bs}"), dt, d, hq, hk, bs, seqs.clone());
        for pol in ["quest(budget=256, sink=4) > top_p(p=0.95)", "quest(budget=96, page=8, sink=16)"] {
            let same = decode_step_meta_equal(&spec, pol, seed.wrapping_add(i as u64)).unwrap_or_else(|e| panic!("{} / {pol}: {e}", spec.name));
            println!("step meta {:<24} {pol:<44} {}", spec.name, if same { "same" } else { "DIFF" });
            if !same {
                failures.push(format!("{} / {pol} (seed {seed})", spec.name));
            }
        }
    }
    assert!(failures.is_empty(), "metadata differs after a decode step's write:\n{}", failures.join("\n"));
}

/// Few-token cache writes (the one-launch write on CUDA, kernels/write_step.cu) against the CPU engine after
/// a long prefix write: appends of one and of several tokens per call and block, a rewrite from the middle
/// of a block, a rewrite of its last row, a slot written twice in one call, a slot out of range (nothing
/// written, the CPU engine's error). After every call: the same outcome, cache bytes and key metadata
/// (fill mask, Quest bounds, INT4 copy), bit for bit; block sizes 1 to 256, 16-bit, f32 and FP8 caches;
/// also keys whose rows and units have zeros of both signs as their minimum.
fn cuda_step_writes_keep_the_cpu_cache_and_metadata() {
    if !have_cuda("cuda_step_writes") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let seqs = vec![(1, 1000), (1, 1), (1, 17), (1, 300), (1, 777), (1, 64), (1, 257), (1, 3)];
    let mut specs: Vec<CaseSpec> = [(DType::BF16, 128, 32, 8, 16), (DType::F16, 64, 16, 2, 8), (DType::BF16, 112, 4, 2, 256), (DType::F32, 80, 4, 4, 1)]
        .into_iter()
        .map(|(dt, d, hq, hk, bs)| CaseSpec::new(format!("step-writes-h{d}-bs{bs}"), dt, d, hq, hk, bs, seqs.clone()))
        .collect();
    let mut fp8 = CaseSpec::new("step-writes-h128-bs16-e4m3", DType::BF16, 128, 32, 8, 16, seqs.clone());
    fp8.cache_dtype = Some(DType::F8E4M3);
    specs.push(fp8);
    let mut failures = Vec::new();
    // Both policies on the first and the FP8 geometry, one on the others (alternating); keys with zeros of
    // both signs on the first. KVS_QUICK=1 (compute-sanitizer): the first and the FP8 geometry, one policy.
    for (i, spec) in specs.iter().enumerate() {
        for (j, pol) in ["quest(budget=256, sink=4) > top_p(p=0.95)", "quest(budget=96, page=8, sink=16)"].into_iter().enumerate() {
            for zeros in [false, true] {
                let both = i == 0 || i == 4;
                if (zeros && (i != 0 || j != 0)) || (!both && j != i % 2) || (quick() && (j > 0 || !both)) {
                    continue;
                }
                let runs = step_writes_agree(spec, pol, seed.wrapping_add(i as u64), zeros).unwrap_or_else(|e| panic!("{} / {pol}: {e}", spec.name));
                for r in runs {
                    let zs = if zeros { ", signed zeros" } else { "" };
                    println!("step writes {:<28} {pol:<44} {:<52} {} calls: {}", format!("{}{zs}", spec.name), r.scenario, r.calls, r.mismatch.as_deref().unwrap_or("same"));
                    if let Some(m) = r.mismatch {
                        failures.push(format!("{}{zs} / {pol} / {} (seed {seed}): {m}", spec.name, r.scenario));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "few-token writes differ from the CPU engine's:\n{}", failures.join("\n"));
}

/// SnapKV: a prefill call (the choice) then a decode call (the plan) on the same cache, over the sparse
/// geometries: the GPU's positions agree with the CPU engine's (differences only within delta of the
/// choice's boundary; counted and the worst margin printed), counters and outputs as the contract says.
fn cuda_snapkv_decisions_agree_with_the_cpu_engine() {
    if !have_cuda("cuda_snapkv_decisions") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    let (mut differing, mut worst, mut delta_at) = (0usize, 0f64, 0f64);
    for (i, spec) in sparse_specs(quick()).iter().enumerate() {
        let spec = snapkv_spec(spec);
        for (j, pol) in snapkv_policies().iter().enumerate() {
            if quick() && (i + j) % 2 != 0 {
                continue;
            }
            let SnapResult { base: r, agree } = run_snapkv_case(&spec, pol, seed.wrapping_add((i * 100 + j) as u64));
            differing += agree.differing;
            if agree.worst_margin > worst {
                (worst, delta_at) = (agree.worst_margin, agree.delta_at_worst);
            }
            println!(
                "snapkv {:<36} {:<52} rows {:>4} differing {:>3} (worst margin {:.2e} of delta {:.2e}) counters {} rel {:.2e} lse {:.2e} {}",
                r.name,
                r.policy,
                r.rows,
                agree.differing,
                agree.worst_margin,
                agree.delta_at_worst,
                if r.counters_mismatch.is_none() { "same" } else { "DIFF" },
                r.rel_err,
                r.lse_err,
                if r.pass { "ok" } else { "FAIL" }
            );
            if !r.pass {
                failures.push(format!("{} / {} (seed {}): {:?} {:?} rel {:.3e} lse {:.3e} error {:?}", r.name, r.policy, r.seed, r.decision_mismatch, r.counters_mismatch, r.rel_err, r.lse_err, r.error));
            }
        }
    }
    println!("snapkv agreement: {differing} differing positions in all, worst margin {worst:.3e} (delta there {delta_at:.3e})");
    assert!(failures.is_empty(), "failing SnapKV cases:\n{}", failures.join("\n"));
}

/// Budget >= context and p = 1 visit everything: the plan path must then agree with the float64
/// reference as closely as dense attention does.
fn cuda_lossless_policies_equal_dense() {
    if !have_cuda("cuda_lossless") {
        return;
    }
    let seed = Rng::fresh_seed();
    for spec in sparse_specs(true) {
        for pol in ["quest(budget=1000000)", "quest(budget=1000000) > top_p(p=1)", "all > top_p(p=1)", "streaming(sink=100000, recent=100000)", "snapkv(budget=1000000)", "art(patience=inf)", "quest(budget=1000000) > art(tau=0, phi=0, patience=1)"] {
            if pol.contains("art") && (spec.dtype == DType::F32 || spec.strided) {
                continue; // ART runs in the tensor-core kernel: f16/bf16, aligned rows
            }
            let f = Fixture::new(&spec, seed);
            let mut cfg = f.engine_config();
            cfg.policy = format!("{pol}; dense_layers=0");
            cfg.device = Device::Cuda(0);
            let engine = Engine::new(cfg).expect("engine");
            let mut outs = Outputs::new(&f);
            let dc = DeviceCase::upload(&f, &outs).expect("upload");
            engine.cache_write(&dc.cache_write_args(&f, std::ptr::null_mut()).unwrap()).expect("write");
            engine.attention_forward(&dc.forward_args(&f, &outs, std::ptr::null_mut()).unwrap()).expect("forward");
            dc.download(&mut outs).expect("download");
            let r = judge(&f, &outs, seed);
            println!("lossless {:<36} {:<40} rel {:.2e} lse {:.2e}", spec.name, pol, r.rel_err, r.lse_err);
            assert!(r.pass, "{} / {pol} (seed {seed}): {r:?}", spec.name);
        }
    }
}

fn decode_only() -> CaseSpec {
    CaseSpec::new("graph-sparse-decode", DType::BF16, 128, 32, 8, 16, vec![(1, 4000), (1, 1), (1, 17), (1, 1500), (1, 2777)])
}

fn cuda_sparse_decode_step_graph_replays_on_new_data() {
    if !have_cuda("cuda_sparse_graph") {
        return;
    }
    let seed = Rng::fresh_seed();
    for pol in ["quest(budget=256, sink=16)", "quest(budget=512) > top_p(p=0.95)", "streaming(sink=4, recent=300)", "all > top_p(p=0.9)", "snapkv(budget=256) > top_p(p=0.9)", "art(tau=1e-3, phi=1e-2, patience=2)", "streaming(sink=4, recent=1000) > art(tau=1e-3, phi=1e-2, patience=2)", "art(patience=inf)", "art(tau=1e-3, phi=1e-2, patience=2, segment=512)", "quest(budget=256, sink=16) > art(tau=1e-3, phi=1e-2, patience=2)"] {
        let (rows, mism) = sparse_graph_replay(&decode_only(), pol, seed, seed.wrapping_add(7919)).unwrap_or_else(|e| panic!("{pol}: {e}"));
        println!("graph {pol:<40} rows {rows} {}", if mism.is_none() { "replay == eager" } else { "DIFF" });
        assert!(rows > 0 && mism.is_none(), "{pol} (seed {seed}): {mism:?}");
    }
}

/// The eager warm-up on one stream, the capture on another that has made no call of its own (what vLLM's
/// and torch.cuda.graph's capture do): the capturing stream takes over the warm-up's workspaces (split-KV
/// and policy), and the graph replays on the first stream exactly as an eager step.
fn cuda_graph_captured_on_a_stream_without_eager_calls() {
    if !have_cuda("cuda_graph_other_stream") {
        return;
    }
    let seed = Rng::fresh_seed();
    for pol in ["dense", "quest(budget=256, sink=16)", "quest(budget=512) > top_p(p=0.95)", "streaming(sink=4, recent=300)"] {
        let (rows, mism) = sparse_graph_replay_on(&decode_only(), pol, seed, seed.wrapping_add(7919), true).unwrap_or_else(|e| panic!("{pol:?}: {e}"));
        println!("graph on another stream {pol:<40} rows {rows} {}", if mism.is_none() { "replay == eager" } else { "DIFF" });
        assert!((pol == "dense" || rows > 0) && mism.is_none(), "{pol:?} (seed {seed}): {mism:?}");
    }
}

/// Garbage metadata on the device (block ids out of range, negative, seq_lens beyond the table) cannot be
/// validated without a sync; selection and attention must stay inside their buffers, write every row
/// (finite, or NaN in output and LSE where the row read bad metadata: the ABI's device-side contract) and
/// record the fault for `check`. Run under compute-sanitizer memcheck for the "no read out of bounds" half.
fn cuda_sparse_bad_device_metadata_stays_in_bounds() {
    if !have_cuda("cuda_sparse_bad_metadata") {
        return;
    }
    // SnapKV also on prefill chunks (its choice kernels read the garbage table too).
    for (pol, prefill) in [("quest(budget=256) > top_p(p=0.9)", false), ("streaming(sink=4, recent=64)", false), ("snapkv(budget=256)", false), ("snapkv(budget=64, window=16)", true)] {
        let spec = if prefill { snapkv_spec(&decode_only()) } else { decode_only() };
        let mut f = Fixture::new(&spec, Rng::fresh_seed());
        let mut cfg = f.engine_config();
        cfg.policy = format!("{pol}; dense_layers=0");
        cfg.device = Device::Cuda(0);
        let engine = Engine::new(cfg).expect("engine");
        let mut outs = Outputs::new(&f);
        let dc = DeviceCase::upload(&f, &outs).expect("upload");
        engine.cache_write(&dc.cache_write_args(&f, std::ptr::null_mut()).unwrap()).expect("write");
        let nb = f.num_blocks as i32;
        for (i, b) in f.block_table.iter_mut().enumerate() {
            *b = match i % 3 {
                0 => nb + 1000,
                1 => -5,
                _ => *b,
            };
        }
        f.seq_lens[0] = 1 << 30;
        f.seq_lens[1] = -3;
        let mut dc = dc;
        dc.refill_metadata(&f).expect("metadata");
        let mut args = dc.forward_args(&f, &outs, std::ptr::null_mut()).expect("args");
        args.max_seq_len = 0;
        engine.attention_forward(&args).expect("forward");
        kvsparse::cuda::context::DevBuf::alloc(16).expect("any driver call after the kernels");
        dc.download(&mut outs).expect("download (would report a kernel fault)");
        let (o, l) = outs.to_f64(&f);
        let dim = o.len() / l.len();
        for (r, lse) in l.iter().enumerate() {
            let row = &o[r * dim..(r + 1) * dim];
            if lse.is_nan() {
                assert!(row.iter().all(|x| x.is_nan()), "{pol}: row {r} has a NaN LSE but not a NaN output");
            } else {
                assert!(row.iter().all(|x| x.is_finite()), "{pol}: row {r}: every output element written and finite");
            }
        }
        assert!(l.iter().any(|x| x.is_nan()), "{pol}: rows that read bad block ids are NaN");
        let e = engine.check(std::ptr::null_mut()).expect_err("the recorded fault");
        println!("bad metadata {pol:<36} {}", e);
        let _ = engine.stats();
    }
}

/// ART in the kernel stops at the CPU engine's tile. The GPU's probe values differ from the CPU's by the
/// accumulation order and, in the tensor-core kernel, by P rounded to the cache type for the PV product;
/// so a row may stop elsewhere only where the CPU run with thresholds scaled by 1 ± 2% would (a decision
/// value within 2% of its threshold): such rows are counted as borderline and must stay below 10%. Rows
/// that stopped at the CPU's tile attend the same keys: their outputs must equal the CPU engine's within
/// the dense tolerance. The long single rows walk one traversal over many splits (each a run of tiles;
/// the row's last split decides, and re-runs the split the stop falls in).
fn cuda_art_stops_at_the_cpu_engine_tile() {
    if !have_cuda("cuda_art") {
        return;
    }
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let eps = 0.02;
    let specs = [
        CaseSpec::new("art-h128-bf16-gqa4-bs16", DType::BF16, 128, 8, 2, 16, vec![(1, 1), (1, 17), (1, 300), (1, 900), (1, 1500), (1, 4000)]),
        CaseSpec::new("art-h64-f16-gqa3-bs16", DType::F16, 64, 9, 3, 16, vec![(1, 65), (1, 777), (1, 2047), (1, 3000)]),
        CaseSpec::new("art-h128-f16-gqa16-bs32", DType::F16, 128, 16, 1, 32, vec![(1, 129), (1, 1000), (1, 2500)]),
        CaseSpec::new("art-h128-bf16-gqa4-bs16-long", DType::BF16, 128, 8, 2, 16, vec![(1, 20000)]),
        CaseSpec::new("art-h64-f16-gqa8-bs16-long", DType::F16, 64, 8, 1, 16, vec![(1, 9000), (1, 12345)]),
    ];
    let pols: [(&str, fn(f64) -> String); 9] = [
        ("art(1e-3, 1e-2, 2)", |s| format!("art(tau={}, phi={}, patience=2)", 1e-3 * s, 1e-2 * s)),
        ("art(3e-3, 3e-2, 1)", |s| format!("art(tau={}, phi={}, patience=1)", 3e-3 * s, 3e-2 * s)),
        ("art(1e-5, 1e-3, 5)", |s| format!("art(tau={}, phi={}, patience=5)", 1e-5 * s, 1e-3 * s)),
        ("streaming > art(1e-3, 1e-2, 2)", |s| format!("streaming(sink=4, recent=1000) > art(tau={}, phi={}, patience=2)", 1e-3 * s, 1e-2 * s)),
        ("art(1e-3, 1e-2, 2, seg 256)", |s| format!("art(tau={}, phi={}, patience=2, segment=256)", 1e-3 * s, 1e-2 * s)),
        ("streaming > art(3e-3, 3e-2, 1, seg 128)", |s| format!("streaming(sink=4, recent=1000) > art(tau={}, phi={}, patience=1, segment=128)", 3e-3 * s, 3e-2 * s)),
        // Quest's priority order (its page scores, sorted on the device) and its recency order.
        ("quest(512) > art(1e-3, 1e-2, 2)", |s| format!("quest(budget=512) > art(tau={}, phi={}, patience=2)", 1e-3 * s, 1e-2 * s)),
        ("quest(1024, sink=16, page=8) > art(3e-3, 3e-2, 1, seg 128)", |s| format!("quest(budget=1024, sink=16, page=8) > art(tau={}, phi={}, patience=1, segment=128)", 3e-3 * s, 3e-2 * s)),
        ("quest(512) > art(recent, 1e-3, 1e-2, 2)", |s| format!("quest(budget=512) > art(tau={}, phi={}, patience=2, order=recent)", 1e-3 * s, 1e-2 * s)),
    ];
    let (rows, same, border, early) = check_art_stops("art", &specs, &pols, eps, seed);
    println!("{rows} rows: {same} same stop tile, {border} borderline (within ±{eps} of a threshold), {early} stopped early on the CPU");
    assert!(border * 10 <= rows, "seed {seed}: {border} of {rows} rows borderline");
    assert!(early > 0, "seed {seed}: no row stopped early; the settings test nothing");
}

fn cuda_refuses_policies_it_cannot_run_at_engine_creation() {
    if !have_cuda("cuda_refuses") {
        return;
    }
    for pol in ["quest(budget=256) > top_p(p=0.9) > art()", "snapkv(budget=256) > art()", "art(order=priority)", "speculate(over=quest(budget=256), extra=drop)", "speculate(over=quest(budget=256), predict=previous)"] {
        let mut cfg = kvsparse::EngineConfig::new(2, 8, 2, 128, 16, DType::BF16);
        cfg.device = Device::Cuda(0);
        cfg.policy = pol.into();
        let e = Engine::new(cfg).err().unwrap_or_else(|| panic!("{pol} accepted"));
        assert_eq!(e.kind, kvsparse::ErrorKind::Unsupported, "{pol}: {e}");
        assert!(e.to_string().contains("CUDA backend"), "{pol}: {e}");
    }
}

fn main() {
    common::run("sparse", vec![
        ("cuda_sparse_decisions_agree_with_the_cpu_engine", cuda_sparse_decisions_agree_with_the_cpu_engine as fn(), true),
        ("cuda_quest_ties_equal_the_cpu_engine", cuda_quest_ties_equal_the_cpu_engine as fn(), true),
        ("cuda_quest_few_rows_agree_with_the_cpu_engine", cuda_quest_few_rows_agree_with_the_cpu_engine as fn(), true),
        ("cuda_decode_step_write_keeps_the_cpu_metadata", cuda_decode_step_write_keeps_the_cpu_metadata as fn(), true),
        ("cuda_step_writes_keep_the_cpu_cache_and_metadata", cuda_step_writes_keep_the_cpu_cache_and_metadata as fn(), true),
        ("cuda_snapkv_decisions_agree_with_the_cpu_engine", cuda_snapkv_decisions_agree_with_the_cpu_engine as fn(), true),
        ("cuda_lossless_policies_equal_dense", cuda_lossless_policies_equal_dense as fn(), true),
        ("cuda_sparse_decode_step_graph_replays_on_new_data", cuda_sparse_decode_step_graph_replays_on_new_data as fn(), true),
        ("cuda_graph_captured_on_a_stream_without_eager_calls", cuda_graph_captured_on_a_stream_without_eager_calls as fn(), true),
        ("cuda_art_stops_at_the_cpu_engine_tile", cuda_art_stops_at_the_cpu_engine_tile as fn(), true),
        ("cuda_sparse_bad_device_metadata_stays_in_bounds", cuda_sparse_bad_device_metadata_stays_in_bounds as fn(), true),
        ("cuda_refuses_policies_it_cannot_run_at_engine_creation", cuda_refuses_policies_it_cannot_run_at_engine_creation as fn(), true),
    ]);
}
