//! Dense paged attention vs the float64 reference over the whole conformance matrix, on fresh random
//! data each run (the seed is printed; rerun with KVS_SEED=<seed> to replay); the export round trip; the
//! suite through the C ABI of the built cdylib (`--lib`); the sparse contract on the CPU engine.

use std::path::PathBuf;

use half::{bf16, f16};
use kvsparse_conformance::dylib::{run_case_lib, Lib};
use kvsparse_conformance::export::{export, KVSPARSE_RESULTS};
use kvsparse_conformance::reference::{attention_f64, rel_err, RefParams, SeqRef};
use kvsparse_conformance::{extended, fp8, matrix, run_case_cpu, sparse, tolerance};
use kvsparse_conformance::nonfinite::{check_all_attention, check_merge, merge_on_cpu};
use kvsparse_conformance::fixture::Fixture;
use kvsparse_conformance::run_fixture_cpu;
use kvsparse::rng::Rng;
use kvsparse::DType;
use safetensors::SafeTensors;
use serde_json::Value;

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

/// FP8 caches: the output matches the float64 reference over the dequantized cache within the query
/// dtype's tolerance, and `cache_write` stored exactly vLLM's quantization (`fp8::quantize`, saturating)
/// of every row, byte for byte; the quantization itself is visible (the cache differs from the rows).
#[test]
fn cpu_matches_float64_reference_on_fp8_caches() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failures = Vec::new();
    let mut saturated_e4m3 = 0;
    for (i, spec) in fp8(false).iter().enumerate() {
        let case_seed = seed.wrapping_add(i as u64);
        let mut f = Fixture::new(spec, case_seed);
        let outs = run_fixture_cpu(&mut f).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
        let r = kvsparse_conformance::judge(&f, &outs, case_seed);
        println!("{:<40} rel_err {:.2e} lse_err {:.2e} {}", r.name, r.rel_err, r.lse_err, if r.pass { "ok" } else { "FAIL" });
        if !r.pass {
            failures.push(format!("{} (seed {case_seed}): rel {:.3e} lse {:.3e}", r.name, r.rel_err, r.lse_err));
        }
        let want = f.written_cache();
        assert_eq!(f.cache.as_bytes(), want.as_bytes(), "{}: the cache bytes are not vLLM's quantization of the rows", spec.name);
        // How many written key elements saturated (past the format's largest value after the scale).
        let max = if spec.cache_dtype == Some(DType::F8E4M3) { kvsparse::fp8::E4M3_MAX } else { kvsparse::fp8::E5M2_MAX } as f64;
        let row = spec.num_kv_heads * spec.head_dim;
        let written = f.slots.iter().enumerate().filter(|&(_, &s)| s >= 0).flat_map(|(r, _)| r * row..(r + 1) * row);
        let saturated = written.filter(|&i| f.new_k.get(i).abs() / f.k_scale as f64 > max).count();
        println!("  k_scale {} v_scale {}: {saturated} written key elements saturated", f.k_scale, f.v_scale);
        if spec.cache_dtype == Some(DType::F8E4M3) {
            saturated_e4m3 += saturated;
        }
    }
    assert!(saturated_e4m3 > 0, "no E4M3 case saturated: the byte comparison did not cover saturation");
    assert!(failures.is_empty(), "failing cases:\n{}", failures.join("\n"));
}

#[test]
fn extended_cases_are_unsupported_not_failed() {
    for spec in extended() {
        let r = run_case_cpu(&spec, 1);
        assert!(!r.pass && r.unsupported, "{}: {r:?}", spec.name);
        assert!(r.verdict().starts_with("unsupported: "), "{}", r.verdict());
    }
}

#[test]
fn portable_and_simd_paths_agree() {
    // The same case through the run-time-selected path must match the reference; the portable path is
    // exercised by running the whole binary with KVS_CPU_PORTABLE=1 (done in .ci/run).
    let spec = &matrix(true)[0];
    let r = run_case_cpu(spec, Rng::fresh_seed());
    assert!(r.pass, "{r:?}");
}

/// A storage tensor of an exported case as f64 (any float dtype).
fn floats(st: &SafeTensors, name: &str) -> Vec<f64> {
    let t = st.tensor(name).unwrap();
    let b = t.data();
    match t.dtype() {
        safetensors::Dtype::F64 => b.chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(),
        safetensors::Dtype::F32 => b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        safetensors::Dtype::F16 => b.chunks(2).map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f64()).collect(),
        safetensors::Dtype::BF16 => b.chunks(2).map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f64()).collect(),
        safetensors::Dtype::F8_E4M3 => b.iter().map(|&c| kvsparse::fp8::decode(DType::F8E4M3, c) as f64).collect(),
        safetensors::Dtype::F8_E5M2 => b.iter().map(|&c| kvsparse::fp8::decode(DType::F8E5M2, c) as f64).collect(),
        other => panic!("{name}: {other:?}"),
    }
}

fn ints(st: &SafeTensors, name: &str) -> Vec<i64> {
    st.tensor(name).unwrap().data().chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect()
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect()
}

/// Element of a view `{storage, offset, shape, strides}` at `idx`.
fn at(storage: &[f64], view: &Value, idx: &[usize]) -> f64 {
    let st = usizes(&view["strides"]);
    storage[view["offset"].as_u64().unwrap() as usize + idx.iter().zip(&st).map(|(i, s)| i * s).sum::<usize>()]
}

/// Reads an exported case back the way a consumer would (views, tables, nothing from the fixture) and
/// recomputes the reference from it.
fn recompute(dir: &std::path::Path, case: &Value) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, usize) {
    let bytes = std::fs::read(dir.join(case["file"].as_str().unwrap())).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (q_st, kv) = (floats(&st, "query_storage"), floats(&st, "kv_storage"));
    let (table, lens, qsl) = (ints(&st, "block_table"), ints(&st, "seq_lens"), ints(&st, "query_start_loc"));
    let g = |k: &str| case[k].as_u64().unwrap() as usize;
    let (hq, hk, d, bs) = (g("num_q_heads"), g("num_kv_heads"), g("head_dim"), g("block_size"));
    let cols = table.len() / lens.len();
    let views = &case["views"];
    // An FP8 cache: code values times the scale, in f32 (the manifest's conventions).
    let scale_of = |k: &str| case.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let (ks, vs) = (scale_of("k_scale"), scale_of("v_scale"));
    assert_eq!(ks.is_some(), case.get("cache_dtype").is_some());
    let deq = |x: f64, s: Option<f32>| s.map_or(x, |s| ((x as f32) * s) as f64);
    let p = RefParams { num_q_heads: hq, num_kv_heads: hk, dim: d, scale: case["scale"].as_f64().unwrap(), softcap: case["softcap"].as_f64().unwrap(), window: g("sliding_window") };
    let (mut out, mut lse) = (Vec::new(), Vec::new());
    for s in 0..lens.len() {
        let (a, b, n) = (qsl[s] as usize, qsl[s + 1] as usize, lens[s] as usize);
        let mut k = Vec::with_capacity(n * hk * d);
        let mut v = Vec::with_capacity(n * hk * d);
        for j in 0..n {
            let blk = table[s * cols + j / bs] as usize;
            for h in 0..hk {
                for i in 0..d {
                    k.push(deq(at(&kv, &views["k_cache"], &[blk, j % bs, h, i]), ks));
                    v.push(deq(at(&kv, &views["v_cache"], &[blk, j % bs, h, i]), vs));
                }
            }
        }
        let q: Vec<f64> = (a..b).flat_map(|t| (0..hq).flat_map(move |h| (0..d).map(move |i| (t, h, i)))).map(|(t, h, i)| at(&q_st, &views["query"], &[t, h, i])).collect();
        let (o, l) = attention_f64(&SeqRef { q: &q, k: &k, v: &v, q_len: b - a, seq_len: n }, &p);
        out.extend(o);
        lse.extend(l);
    }
    (out, lse, floats(&st, "ref_out"), floats(&st, "ref_lse"), kv.iter().filter(|x| x.is_nan()).count())
}

#[test]
fn export_round_trip() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("conformance-export-{seed}"));
    let _ = std::fs::remove_dir_all(&dir);
    // Every serving feature and both unsupported kinds, kept small.
    let mut cases: Vec<_> = matrix(true).into_iter().filter(|c| ["mixed-h64-f32", "blocks-bs16", "softcap-gqa4", "serving-prefix-f16"].iter().any(|n| c.name.starts_with(n))).collect();
    cases.extend(extended());
    cases.extend(fp8(true));
    let (results, bytes) = export(&dir, &cases, seed, |_| {}).unwrap();
    assert!(bytes > 0);
    let manifest: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["format"], "kvsparse-conformance");
    assert!(dir.join("check.py").is_file());
    let entries = manifest["cases"].as_array().unwrap();
    assert_eq!(entries.len(), cases.len());
    for (case, r) in entries.iter().zip(&results) {
        let name = case["name"].as_str().unwrap();
        let (out, lse, ref_out, ref_lse, nans) = recompute(&dir, case);
        // The reference in the file is exactly what the inputs in the file give (same f64 code).
        assert_eq!(out, ref_out, "{name}: exported reference does not follow from the exported inputs");
        assert_eq!(lse, ref_lse, "{name}");
        let feats: Vec<&str> = case["features"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect();
        assert_eq!(feats.contains(&"nan-unwritten"), nans > 0, "{name}: NaN in the storage iff the case says so ({nans})");
        // kvsparse's stored outputs pass the case's tolerance; unsupported cases have none.
        let res = dir.join("results").join(KVSPARSE_RESULTS).join(format!("{name}.safetensors"));
        if r.unsupported {
            assert!(name.starts_with("ext-") && !res.exists(), "{name}");
            continue;
        }
        assert!(r.pass, "{name}: {r:?}");
        let bytes = std::fs::read(&res).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let dt = match case["dtype"].as_str().unwrap() {
            "float32" => DType::F32,
            "float16" => DType::F16,
            _ => DType::BF16,
        };
        let e = rel_err(&floats(&st, "out"), &ref_out);
        assert!(e <= tolerance(dt).0, "{name}: stored output rel err {e}");
        assert_eq!(case["tolerance"]["out_rel"].as_f64().unwrap(), tolerance(dt).0);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Directory holding libkvsparse.so (as in tests/c_abi.rs).
fn cdylib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    let profile = deps.parent().unwrap().to_path_buf();
    [deps, profile].into_iter().map(|d| d.join("libkvsparse.so")).find(|p| p.exists()).expect("libkvsparse.so next to the test binary")
}

#[test]
fn suite_through_the_c_abi_of_the_cdylib() {
    let lib = Lib::open(&cdylib()).unwrap();
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut cases = matrix(true);
    cases.extend(fp8(true));
    cases.extend(extended());
    for (i, spec) in cases.iter().enumerate() {
        let r = run_case_lib(&lib, spec, seed.wrapping_add(i as u64));
        println!("{:<40} {}", r.name, r.verdict());
        if spec.name.starts_with("ext-") {
            assert!(r.unsupported && r.verdict().contains("KVS_ERR_UNSUPPORTED"), "{r:?}");
        } else {
            assert!(r.pass, "{r:?}");
        }
    }
    // Sparse contract through the same C ABI (host memory).
    for check in sparse::checks(seed).into_iter().filter(|c| c.name.starts_with("reused") || c.name.starts_with("per-kv-head")) {
        let r = check.run(&mut |g, p| sparse::lib_session(&lib, g, p));
        println!("{:<64} {}", r.name, r.verdict());
        assert!(r.pass, "{}: {}", r.name, r.verdict());
    }
    assert!(Lib::open(std::path::Path::new("/nonexistent/libkvsparse.so")).is_err());
}

#[test]
fn sparse_contract_on_the_cpu_engine() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut failed = Vec::new();
    for check in sparse::checks(seed) {
        let r = check.run(&mut sparse::cpu_session);
        println!("{:<72} {}", r.name, r.verdict());
        if r.failed() || r.unsupported {
            failed.push(format!("{}: {}", r.name, r.verdict()));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// NaN and infinity in queries, keys and values propagate as the header documents (NaN row and LSE for a
/// non-finite logit, non-finite elements for a non-finite value), and nothing a row does not attend
/// changes it. The same check runs on CUDA (`crates/conformance/tests/cuda.rs`).
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

#[test]
fn head_major_and_token_major_caches_give_identical_outputs() {
    // The CPU kernel consumes head-major blocks a block's worth of chunks per head at a time and token-major
    // ones a chunk per head: each head's state sees the same chunks in the same order either way, so the
    // same logical cache gives the same output bits in both layouts (a window makes spans start mid-block).
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let cases: Vec<_> = matrix(false).into_iter().filter(|c| c.head_major).collect();
    assert!(cases.len() >= 3);
    for hm in cases {
        let mut tm = hm.clone();
        tm.head_major = false;
        let (mut fa, mut fb) = (Fixture::new(&hm, seed), Fixture::new(&tm, seed));
        let (a, b) = (run_fixture_cpu(&mut fa).unwrap(), run_fixture_cpu(&mut fb).unwrap());
        assert!(a.out.as_bytes() == b.out.as_bytes(), "{}: outputs differ between layouts (seed {seed})", hm.name);
        let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.lse), bits(&b.lse), "{}: LSE differs between layouts", hm.name);
    }
}

#[test]
fn prefill_rows_are_the_same_bits_on_any_thread_count() {
    // Prefill work is split by the call's shapes alone (query tiles, and key ranges of short extends over
    // long prefixes: the mixed batches' 64 × 1100 rows are split; the quick matrix), so their outputs and LSE must not move
    // with the pool's size. Decode rows split by the thread count and are not compared.
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut cases: Vec<_> = matrix(true).into_iter().filter(|c| c.seqs.iter().any(|&(q, _)| q > 1)).collect();
    assert!(cases.len() >= 5);
    // A short extend over a long prefix, alone in its call: the case a thread-count split would cut.
    cases.push(kvsparse_conformance::fixture::CaseSpec::new("extend-5-over-3000-f32", DType::F32, 128, 8, 2, 16, vec![(5, 3000)]));
    for case in cases {
        let mut runs = Vec::new();
        for threads in [1usize, 2, 5] {
            let mut f = Fixture::new(&case, seed);
            let mut cfg = f.engine_config();
            cfg.num_threads = threads;
            let engine = kvsparse::Engine::new(cfg).unwrap();
            let outs = kvsparse_conformance::fixture::run_on_engine(&engine, &mut f).unwrap();
            let (o, l) = outs.to_f64(&f);
            let (hq, d) = (case.num_q_heads, case.head_dim);
            // Bits of every prefill row (tokens of sequences with more than one query).
            let mut bits = Vec::new();
            for (s, &(q, _)) in case.seqs.iter().enumerate() {
                if q > 1 {
                    let t0 = f.query_start_loc[s] as usize;
                    bits.extend(o[t0 * hq * d..(t0 + q) * hq * d].iter().map(|x| x.to_bits()));
                    bits.extend(l[t0 * hq..(t0 + q) * hq].iter().map(|x| x.to_bits()));
                }
            }
            runs.push((threads, bits));
        }
        for (threads, bits) in &runs[1..] {
            assert!(*bits == runs[0].1, "{}: prefill rows differ between 1 and {threads} threads (seed {seed})", case.name);
        }
    }
}
