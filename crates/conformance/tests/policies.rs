//! Policy properties on fresh random data (seed printed; replay with KVS_SEED=<seed>):
//! pipelines that cannot drop anything equal dense; ART stops early exactly when the output converges;
//! a sparse selection equals a float64 reference over the selected tokens; Quest's bound holds, also after
//! block reuse; bad specs and missing metadata fail cleanly.

use kvsparse_conformance::fixture::{run_on_engine, Fixture};
use kvsparse_conformance::hostbuf::HostBuf;
use kvsparse_conformance::matrix;
use kvsparse_conformance::reference::{attention_f64, rel_err, RefParams, SeqRef};
use kvsparse::cpu::metadata::{CacheMeta, MetaNeeds};
use kvsparse::policy::quest::cpu::quest_bound;
use kvsparse::policy::top_p;
use kvsparse::engine::{CacheWriteArgs, Engine};
use kvsparse::layout::KvCache;
use kvsparse::rng::Rng;
use kvsparse::stats::Counters;
use kvsparse_conformance::synthetic::{Synth, SynthSpec};
use kvsparse::tensor::{DType, Device, TensorRef};
use kvsparse::{EngineConfig, ErrorKind};

fn seed() -> u64 {
    let s = Rng::fresh_seed();
    println!("seed {s}");
    s
}

/// Output of a conformance fixture (mixed prefill + decode batch) under `policy`, and the call's counters.
fn fixture_run(f: &mut Fixture, policy: &str) -> (Vec<f64>, Counters) {
    let mut cfg = f.engine_config();
    cfg.policy = policy.to_string();
    let e = Engine::new(cfg).unwrap();
    let outs = run_on_engine(&e, f).unwrap();
    (outs.to_f64(f).0, e.stats().total)
}

#[test]
fn lossless_pipelines_equal_dense() {
    let s = seed();
    let cases: Vec<_> = matrix(false).into_iter().filter(|c| c.dtype == DType::F32).collect();
    assert!(cases.len() >= 5);
    let specs = [
        "art(patience=inf); dense_layers=0",
        "art(patience=inf, order=priority, probe=full); dense_layers=0",
        "art(patience=inf, segment=128); dense_layers=0",
        "top_p(p=1.0); dense_layers=0",
        "quest(budget=100000) > top_p(p=1) > art(patience=inf); dense_layers=0",
        "quest(budget=100000, page=4); dense_layers=0",
        "quest(budget=100000, page=64); dense_layers=0",
        "streaming(sink=4, recent=100000); dense_layers=0",
        "snapkv(budget=100000); dense_layers=0",
    ];
    for (i, case) in cases.iter().enumerate() {
        let mut f = Fixture::new(case, s.wrapping_add(i as u64));
        let (dense, _) = fixture_run(&mut f, "");
        let dense_vs_ref = rel_err(&dense, &f.ref_out);
        assert!(dense_vs_ref < 1e-5, "{}: dense vs f64 {dense_vs_ref}", case.name);
        for spec in specs {
            let (out, c) = fixture_run(&mut f, spec);
            let e = rel_err(&out, &dense);
            println!("{:<32} {:<72} rel vs dense {:.1e} rows {} visited {}/{}", case.name, spec, e, c.policy_rows, c.blocks_visited, c.blocks_eligible);
            assert!(c.policy_rows > 0, "{}: {spec} served no decode row through the policy", case.name);
            assert_eq!(c.blocks_visited, c.blocks_eligible, "{}: {spec}", case.name);
            assert!(e <= 1e-6, "{} (seed {s}): {spec} differs from dense by {e}", case.name);
        }
    }
}

/// A small f32 synthetic batch; `edit` may rewrite staging keys/values and queries before the cache write.
fn small_synth(seed: u64, context: usize) -> Synth {
    let spec = SynthSpec { num_seqs: 3, context, num_q_heads: 4, num_kv_heads: 2, head_dim: 64, block_size: 16, dtype: DType::F32, sinks: 4, needles: 4, window: 16 };
    Synth::generate(&spec, seed)
}

fn engine(syn: &Synth, policy: &str) -> Engine {
    let s = &syn.spec;
    let mut cfg = EngineConfig::new(1, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size, s.dtype);
    cfg.policy = format!("{policy}; dense_layers=0");
    cfg.num_threads = 2;
    Engine::new(cfg).unwrap()
}

/// Writes the cache through a fresh engine for `policy`, runs the decode call; returns output and counters.
fn decode(syn: &mut Synth, policy: &str) -> (Vec<f64>, Counters) {
    let e = engine(syn, policy);
    syn.write_cache(&e, 0).unwrap();
    let s = syn.spec.clone();
    if e.policy().is_stateful() {
        let w = s.window.min(s.context - 1);
        let tabs = syn.tables(s.context - 1, w);
        let mut out = HostBuf::zeros(s.dtype, s.num_seqs * w * s.num_q_heads * s.head_dim);
        let args = syn.observe_args(0, &tabs, &mut out);
        e.attention_forward(&args).unwrap();
    }
    let tabs = syn.tables(s.context, 1);
    let mut out = HostBuf::nans(s.dtype, s.num_seqs * s.num_q_heads * s.head_dim);
    let args = syn.decode_args(0, &tabs, &mut out);
    let c = e.attention_forward(&args).unwrap();
    ((0..out.len()).map(|i| out.get(i)).collect(), c)
}

/// Rewrites the synthetic batch so that query rows are `√d·e0` and key `j` of every head is
/// `logit(j)·e0 + noise in the other channels`: the scaled logit of key j is exactly `logit(j)`.
fn set_logits(syn: &mut Synth, logit: impl Fn(usize) -> f64, value: impl Fn(usize, usize) -> f64, rng: &mut Rng) {
    let s = syn.spec.clone();
    let (hk, d) = (s.num_kv_heads, s.head_dim);
    for q in 0..s.num_seqs * s.num_q_heads {
        for i in 0..d {
            syn.query.set(q * d + i, if i == 0 { (d as f64).sqrt() } else { 0.0 });
        }
    }
    for sq in 0..s.num_seqs {
        for j in 0..s.context {
            for h in 0..hk {
                let row = ((sq * s.context + j) * hk + h) * d;
                for i in 0..d {
                    syn.new_k.set(row + i, if i == 0 { logit(j) } else { rng.normal() });
                    syn.new_v.set(row + i, value(j, i));
                }
            }
        }
    }
}

#[test]
fn art_stops_early_when_the_output_converges() {
    let s = seed();
    let mut rng = Rng::new(s);
    let mut syn = small_synth(s, 1024);
    let n = syn.spec.context;
    // Sinks and the last 40 tokens carry all the mass; everything else is e^-40 below.
    let phases: Vec<f64> = (0..64).map(|_| rng.normal()).collect();
    set_logits(&mut syn, |j| if j < 4 || j + 40 >= n { 10.0 } else { -30.0 }, |j, i| (j as f64 * 0.1 + phases[i]).sin(), &mut rng);
    let (dense, _) = decode(&mut syn, "all");
    for spec in ["art(tau=1e-5, phi=1e-3, patience=5)", "art(patience=3, order=priority)", "art(patience=2, probe=full)"] {
        let (out, c) = decode(&mut syn, spec);
        println!("{spec}: visited {} of {} (skipped {}), rel err {:.2e}", c.blocks_visited, c.blocks_eligible, c.blocks_skipped_termination, rel_err(&out, &dense));
        assert!(c.blocks_visited < c.blocks_eligible, "seed {s}: {spec} visited everything");
        assert_eq!(c.blocks_visited + c.blocks_skipped_termination, c.blocks_eligible);
        assert!(rel_err(&out, &dense) < 1e-5, "seed {s}: {spec} stopped too early");
    }
    // With patience=inf it never stops.
    let (_, c) = decode(&mut syn, "art(patience=inf)");
    assert_eq!((c.blocks_visited, c.blocks_skipped_termination), (c.blocks_eligible, 0));
}

#[test]
fn art_never_stops_while_values_keep_rotating() {
    let s = seed();
    let mut rng = Rng::new(s);
    let mut syn = small_synth(s, 1024);
    let bs = syn.spec.block_size;
    // Block b's values point at angle b (radians) in every channel (random phases), and each block the
    // traversal reaches next (most recent first, after the sink block) outweighs all earlier ones 4:1, so
    // the running output keeps turning by about a radian per block. The sink block gets no weight. With
    // tau huge only the direction test can stop it, with phi huge only the scale test; neither may.
    let phases: Vec<f64> = (0..64).map(|_| rng.normal() * 3.0).collect();
    let n_blocks = syn.spec.context / bs;
    set_logits(
        &mut syn,
        |j| if j < bs { -100.0 } else { (n_blocks - 1 - j / bs) as f64 * 4f64.ln() },
        |j, i| 100.0 * ((j / bs) as f64 + phases[i]).cos(),
        &mut rng,
    );
    for spec in ["art(tau=1e9, phi=1e-3, patience=1)", "art(tau=1e9, phi=1e-3, patience=1, probe=full)", "art(tau=1e-5, phi=1e9, patience=1)"] {
        let (_, c) = decode(&mut syn, spec);
        println!("{spec}: visited {} of {}", c.blocks_visited, c.blocks_eligible);
        assert_eq!(c.blocks_visited, c.blocks_eligible, "seed {s}: {spec} stopped");
        assert_eq!(c.blocks_skipped_termination, 0);
    }
}

/// f64 attention of the decode rows over the given positions of each sequence (from the staging rows).
fn reference_over(syn: &Synth, keep: impl Fn(usize, usize) -> bool) -> Vec<f64> {
    let s = &syn.spec;
    let (hq, hk, d) = (s.num_q_heads, s.num_kv_heads, s.head_dim);
    let mut out = Vec::new();
    for sq in 0..s.num_seqs {
        let pos: Vec<usize> = (0..s.context).filter(|&j| keep(sq, j)).collect();
        let mut k = Vec::new();
        let mut v = Vec::new();
        for &j in &pos {
            for i in 0..hk * d {
                k.push(syn.new_k.get((sq * s.context + j) * hk * d + i));
                v.push(syn.new_v.get((sq * s.context + j) * hk * d + i));
            }
        }
        let q: Vec<f64> = (0..hq * d).map(|i| syn.query.get(sq * hq * d + i)).collect();
        let p = RefParams { num_q_heads: hq, num_kv_heads: hk, dim: d, scale: syn.scale as f64, softcap: 0.0, window: 0 };
        let (o, _) = attention_f64(&SeqRef { q: &q, k: &k, v: &v, q_len: 1, seq_len: pos.len() }, &p);
        out.extend(o);
    }
    out
}

#[test]
fn streaming_equals_float64_attention_over_sinks_and_recent_tokens() {
    let s = seed();
    let mut syn = small_synth(s, 777);
    let (out, c) = decode(&mut syn, "streaming(sink=4, recent=100)");
    let n = syn.spec.context;
    let want = reference_over(&syn, |_, j| j < 4 || j + 100 >= n);
    let e = rel_err(&out, &want);
    println!("streaming vs f64 over the kept tokens: {e:.2e}; visited {}/{}", c.blocks_visited, c.blocks_eligible);
    assert!(e < 1e-5, "seed {s}: {e}");
    // Blocks: the sink block plus the blocks holding the last 100 tokens.
    let bs = syn.spec.block_size;
    let recent_blocks = (n - 1) / bs - (n - 100) / bs + 1;
    assert_eq!(c.blocks_visited, (syn.spec.num_seqs * syn.spec.num_kv_heads * (1 + recent_blocks)) as u64);
}

#[test]
fn sparse_policies_are_close_on_llm_like_data_and_report_stats() {
    let s = seed();
    let mut syn = small_synth(s, 2048);
    let (dense, _) = decode(&mut syn, "all");
    let rows = (syn.spec.num_seqs * syn.spec.num_kv_heads) as u64;
    for spec in ["quest(budget=512)", "quest(budget=512) > top_p(p=0.95)", "top_p(p=0.9)", "snapkv(budget=512)", "quest(budget=512) > top_p(p=0.95) > art"] {
        let (out, c) = decode(&mut syn, spec);
        let e = rel_err(&out, &dense);
        println!("{spec:<45} rel {e:.2e} visited {:>4}/{} kept {}/{}", c.blocks_visited, c.blocks_eligible, c[top_p::KEPT], c[top_p::CANDIDATES]);
        assert_eq!(c.policy_rows, rows);
        assert!(c.blocks_visited < c.blocks_eligible, "{spec}");
        assert!(out.iter().all(|x| x.is_finite()));
        if spec.contains("top_p") {
            assert!(c[top_p::KEPT] > 0 && c[top_p::KEPT] < c[top_p::CANDIDATES], "{spec}: {c:?}");
        }
        assert!(e < 0.5, "seed {s}: {spec} error {e}");
    }
}

#[test]
fn snapkv_state_lives_until_release() {
    let s = seed();
    let mut syn = small_synth(s, 1024);
    let e = engine(&syn, "snapkv(budget=128, window=16, pool=7)");
    syn.write_cache(&e, 0).unwrap();
    let sp = syn.spec.clone();
    let tabs = syn.tables(sp.context - 1, 16);
    let mut out = HostBuf::zeros(sp.dtype, sp.num_seqs * 16 * sp.num_q_heads * sp.head_dim);
    let args = syn.observe_args(0, &tabs, &mut out);
    e.attention_forward(&args).unwrap();
    assert!(e.stats().state_bytes > 0);
    let tabs = syn.tables(sp.context, 1);
    let mut out = HostBuf::zeros(sp.dtype, sp.num_seqs * sp.num_q_heads * sp.head_dim);
    let args = syn.decode_args(0, &tabs, &mut out);
    let c = e.attention_forward(&args).unwrap();
    // 128 prompt tokens plus the generated one: at most 129 blocks' worth, far below 64 per row.
    assert!(c.blocks_visited < c.blocks_eligible, "{c:?}");
    for id in &syn.seq_ids {
        e.release_sequence(*id as u64).unwrap();
    }
    assert_eq!(e.stats().state_bytes, 0);
    assert_eq!(e.stats().live_sequences, 0);
}

#[test]
fn bad_specs_fail_engine_creation() {
    for (spec, needle) in [
        ("quest(budget=0)", "quest.budget"),
        ("top_p(p=1.5)", "(0, 1]"),
        ("top_p(p=0)", "(0, 1]"),
        ("art(tau=-1e-5)", "art.tau"),
        ("frobnicate", "unknown stage `frobnicate`"),
        ("quest(budget=8, colour=red)", "unknown key `colour`"),
        ("art; dense_layer=1", "unknown option"),
    ] {
        let mut cfg = EngineConfig::new(4, 8, 2, 64, 16, DType::F32);
        cfg.policy = spec.to_string();
        let err = Engine::new(cfg).err().unwrap_or_else(|| panic!("{spec} was accepted"));
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(err.message.contains(needle) && err.message.contains("position"), "{spec}: {}", err.message);
    }
}

#[test]
fn missing_metadata_fails_without_writing() {
    let s = seed();
    let mut syn = small_synth(s, 300);
    let writer = engine(&syn, "all");
    syn.write_cache(&writer, 0).unwrap();
    let e = engine(&syn, "quest(budget=64)");
    let sp = syn.spec.clone();
    let tabs = syn.tables(sp.context, 1);
    let mut out = HostBuf::nans(sp.dtype, sp.num_seqs * sp.num_q_heads * sp.head_dim);
    let args = syn.decode_args(0, &tabs, &mut out);
    let err = e.attention_forward(&args).unwrap_err();
    assert!(err.message.contains("kvs_cache_write"), "{}", err.message);
    assert!((0..out.len()).all(|i| out.get(i).is_nan()), "output was written");
}

#[test]
fn quest_bound_holds_and_survives_block_reuse() {
    let s = seed();
    let mut rng = Rng::new(s);
    let (nb, bs, hk, d) = (6usize, 16usize, 2usize, 64usize);
    let cfg = EngineConfig::new(1, 4, hk, d, bs, DType::F16);
    let mut kbuf = HostBuf::zeros(DType::F16, nb * bs * hk * d);
    let mut vbuf = HostBuf::zeros(DType::F16, nb * bs * hk * d);
    let shape = [nb as i64, bs as i64, hk as i64, d as i64];
    let (kt, vt) = (kbuf.view_contiguous(&shape), vbuf.view_contiguous(&shape));
    let cache = KvCache::new(&cfg, kt, vt, Device::Cpu).unwrap();
    for page in [4usize, 16] {
        let meta = CacheMeta::new(MetaNeeds { bounds_page: Some(page), int4: true, keep_bits: false }, 1).expect("metadata");
        // First life: fill every block with loud keys; second life: block 2 rewritten from offset 0 with
        // 5 quiet rows only. The bound must follow the second life exactly.
        for life in 0..2 {
            let rows: Vec<(usize, usize)> = if life == 0 { (0..nb).flat_map(|b| (0..bs).map(move |o| (b, o))).collect() } else { (0..5).map(|o| (2, o)).collect() };
            let mut key = HostBuf::zeros(DType::F16, rows.len() * hk * d);
            for i in 0..key.len() {
                key.set(i, rng.normal() * if life == 0 { 10.0 } else { 1.0 });
            }
            let slots: Vec<i64> = rows.iter().map(|&(b, o)| (b * bs + o) as i64).collect();
            let n = rows.len() as i64;
            let kv = key.view_contiguous(&[n, hk as i64, d as i64]);
            let decoded: Vec<Option<(usize, usize)>> = rows.iter().map(|&r| Some(r)).collect();
            let mut g = meta.begin_write(0, &cache).unwrap().unwrap();
            // Same copy the engine does, then the metadata update.
            let args = CacheWriteArgs { layer: 0, key: kv, value: kv, key_cache: kt, value_cache: vt, slot_mapping: TensorRef::from_slice(&slots, &[n]), stream: std::ptr::null_mut() };
            kvsparse::cpu::cache_write::write(&cache, &args.key, &args.value, &decoded);
            CacheMeta::finish_write(&mut g, &cache, &decoded);
        }
        let g = meta.read(0);
        let m = g.as_ref().unwrap();
        assert!(!m.is_filled(2, 5) && m.is_filled(2, 4), "block reuse did not reset the fill mask");
        for _ in 0..20 {
            let q: Vec<f32> = (0..d).map(|_| rng.normal() as f32).collect();
            for b in 0..nb {
                for u in 0..m.units_per_block {
                    for h in 0..hk {
                        let mut best = f64::NEG_INFINITY;
                        for o in u * m.unit..(u + 1) * m.unit {
                            if !m.is_filled(b, o) {
                                continue;
                            }
                            let sc: f64 = (0..d).map(|i| q[i] as f64 * kbuf.get(((b * bs + o) * hk + h) * d + i)).sum();
                            best = best.max(sc);
                        }
                        if best == f64::NEG_INFINITY {
                            continue;
                        }
                        let (mnb, mxb) = m.unit_minmax(b, u, h);
                        let mn: Vec<f32> = mnb.iter().map(|&x| half::f16::from_bits(x).to_f32()).collect();
                        let mx: Vec<f32> = mxb.iter().map(|&x| half::f16::from_bits(x).to_f32()).collect();
                        let bound = quest_bound(&q, &mn, &mx) as f64;
                        assert!(bound >= best - 1e-5 * (1.0 + best.abs()), "seed {s}: page {page} block {b} unit {u}: bound {bound} < max {best}");
                        if b == 2 && u == 0 {
                            // Second life only: the loud first-life rows would make the bound far larger.
                            let loose: f64 = (0..d).map(|i| q[i].abs() as f64 * 8.0).sum();
                            assert!(bound < loose, "seed {s}: stale min/max in a reused block ({bound})");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn policy_specs_through_the_c_abi() {
    use kvsparse::ffi::types::{kvs_engine_config, kvs_status};
    use kvsparse::ffi::{kvs_engine_config_init, kvs_engine_create, kvs_engine_destroy, kvs_last_error};
    use std::ffi::{CStr, CString};
    for (spec, ok) in [("quest(budget=4096) > top_p(p=0.95) > art(tau=1e-5, phi=1e-3, patience=5)", true), ("art(tau=-1)", false), ("top_p(p=2)", false), ("nonsense(", false)] {
        let text = CString::new(spec).unwrap();
        // SAFETY: plain C calls with valid pointers; the engine is destroyed below.
        unsafe {
            let mut cfg: kvs_engine_config = std::mem::zeroed();
            cfg.struct_size = std::mem::size_of::<kvs_engine_config>() as u32;
            assert_eq!(kvs_engine_config_init(&mut cfg), kvs_status::KVS_OK);
            cfg.num_layers = 4;
            cfg.num_q_heads = 8;
            cfg.num_kv_heads = 2;
            cfg.head_dim = 128;
            cfg.block_size = 16;
            cfg.policy = text.as_ptr();
            let mut e = std::ptr::null_mut();
            let st = kvs_engine_create(&cfg, &mut e);
            if ok {
                assert_eq!(st, kvs_status::KVS_OK, "{spec}");
                assert!(!e.is_null());
            } else {
                assert_eq!(st, kvs_status::KVS_ERR_INVALID_ARGUMENT, "{spec}");
                assert!(e.is_null());
                let msg = CStr::from_ptr(kvs_last_error()).to_string_lossy().into_owned();
                assert!(msg.contains("position"), "{spec}: {msg}");
            }
            kvs_engine_destroy(e);
        }
    }
}

/// `kvs_engine_config_check` refuses what `kvs_engine_create` would refuse, for the config's device, without
/// creating anything: on this GPU-less machine a CUDA config is checked (a policy the CUDA backend does not
/// run, a bad spec, an unsupported head size) and a good one passes, although no CUDA engine could be made.
#[test]
fn config_check_refuses_what_creation_would_without_a_device() {
    use kvsparse::ffi::types::{kvs_engine_config, kvs_status};
    use kvsparse::ffi::{kvs_engine_config_check, kvs_engine_config_init, kvs_last_error};
    use std::ffi::{CStr, CString};
    let cases = [
        (2, 128, "", kvs_status::KVS_OK, ""),
        (2, 128, "quest(budget=256)", kvs_status::KVS_OK, ""),
        (1, 128, "snapkv(budget=256) > art(tau=1e-3, phi=1e-2, patience=2)", kvs_status::KVS_OK, ""),
        (2, 128, "snapkv(budget=256) > art(tau=1e-3, phi=1e-2, patience=2)", kvs_status::KVS_ERR_UNSUPPORTED, "CUDA backend"),
        (2, 128, "nonsense(", kvs_status::KVS_ERR_INVALID_ARGUMENT, "position"),
        (2, 72, "", kvs_status::KVS_ERR_UNSUPPORTED, "head_dim 72"),
    ];
    for (device_type, head_dim, spec, want, text) in cases {
        let spec_c = CString::new(spec).unwrap();
        // SAFETY: plain C calls with valid pointers.
        unsafe {
            let mut cfg: kvs_engine_config = std::mem::zeroed();
            cfg.struct_size = std::mem::size_of::<kvs_engine_config>() as u32;
            assert_eq!(kvs_engine_config_init(&mut cfg), kvs_status::KVS_OK);
            cfg.device_type = device_type;
            cfg.num_layers = 32;
            cfg.num_q_heads = 32;
            cfg.num_kv_heads = 8;
            cfg.head_dim = head_dim;
            cfg.block_size = 16;
            cfg.policy = spec_c.as_ptr();
            let st = kvs_engine_config_check(&cfg);
            assert_eq!(st, want, "device {device_type} head_dim {head_dim} {spec:?}");
            if want != kvs_status::KVS_OK {
                let msg = CStr::from_ptr(kvs_last_error()).to_string_lossy().into_owned();
                assert!(msg.contains(text), "{spec:?}: {msg}");
            }
        }
    }
    // SAFETY: a NULL config is refused, not read.
    assert_eq!(unsafe { kvs_engine_config_check(std::ptr::null()) }, kvs_status::KVS_ERR_INVALID_ARGUMENT);
}

/// `kvs_policy_query` and `kvs_engine_policy` report the parsed policy (stages, dense layers, state, graph
/// capture), honour a short `struct_size`, and refuse a bad spec or NULL with the message and nothing written.
#[test]
fn policy_query_reports_the_parsed_policy() {
    use kvsparse::ffi::types::{kvs_engine, kvs_engine_config, kvs_policy_info, kvs_status};
    use kvsparse::ffi::{kvs_engine_config_init, kvs_engine_create, kvs_engine_destroy, kvs_engine_policy, kvs_last_error, kvs_policy_query};
    use std::ffi::{CStr, CString};
    let query = |spec: &str, size: u32| -> (kvs_status, kvs_policy_info) {
        let c = CString::new(spec).unwrap();
        let mut info = kvs_policy_info { struct_size: size, num_stages: 77, dense_layers: 77, stateful: 77, graph_capturable: 77, reserved: 77 };
        // SAFETY: valid pointers.
        (unsafe { kvs_policy_query(c.as_ptr(), &mut info) }, info)
    };
    let full = std::mem::size_of::<kvs_policy_info>() as u32;
    let cases = [
        ("", 0, 2, 0, 1),
        ("dense", 0, 2, 0, 1),
        ("streaming(sink=4, recent=64); dense_layers=0", 1, 0, 0, 1),
        ("quest(budget=256) > top_p(p=0.9) > art", 3, 2, 0, 1),
        ("snapkv(budget=256) > art", 2, 2, 1, 0),
        ("speculate(over=quest(budget=64))", 1, 2, 1, 0),
        ("refresh(k=64, every=4); dense_layers=5", 1, 5, 1, 0),
        ("predictor(budget=64)", 1, 2, 1, 0),
    ];
    for (spec, stages, dense, stateful, capturable) in cases {
        let (st, info) = query(spec, full);
        assert_eq!(st, kvs_status::KVS_OK, "{spec}");
        assert_eq!((info.num_stages, info.dense_layers, info.stateful, info.graph_capturable, info.struct_size), (stages, dense, stateful, capturable, full), "{spec}");
    }
    // A caller that knows only the first three fields gets those, nothing past them.
    let (st, info) = query("refresh(k=64)", 12);
    assert_eq!(st, kvs_status::KVS_OK);
    assert_eq!((info.struct_size, info.num_stages, info.dense_layers, info.stateful, info.graph_capturable), (12, 1, 2, 77, 77));
    let (st, info) = query("quest(budget=", full);
    assert_eq!(st, kvs_status::KVS_ERR_INVALID_ARGUMENT);
    assert_eq!(info.num_stages, 77, "nothing written on failure");
    // SAFETY: the message is a valid C string.
    assert!(unsafe { CStr::from_ptr(kvs_last_error()) }.to_string_lossy().contains("position"));
    assert_eq!(query("quest(budget=8)", 0).0, kvs_status::KVS_ERR_INVALID_ARGUMENT);
    // SAFETY: NULL info is refused, not written; NULL policy is dense.
    unsafe {
        assert_eq!(kvs_policy_query(std::ptr::null(), std::ptr::null_mut()), kvs_status::KVS_ERR_INVALID_ARGUMENT);
        let mut info = kvs_policy_info { struct_size: full, ..Default::default() };
        assert_eq!(kvs_policy_query(std::ptr::null(), &mut info), kvs_status::KVS_OK);
        assert_eq!((info.num_stages, info.graph_capturable), (0, 1));
    }
    // The engine's policy reads the same as its spec's.
    let spec = CString::new("quest(budget=64) > top_p(p=0.5); dense_layers=1").unwrap();
    // SAFETY: plain C calls with valid pointers; the engine is destroyed at the end.
    unsafe {
        let mut cfg: kvs_engine_config = std::mem::zeroed();
        cfg.struct_size = std::mem::size_of::<kvs_engine_config>() as u32;
        assert_eq!(kvs_engine_config_init(&mut cfg), kvs_status::KVS_OK);
        (cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size, cfg.num_threads) = (2, 4, 2, 64, 16, 1);
        cfg.policy = spec.as_ptr();
        let mut e: *mut kvs_engine = std::ptr::null_mut();
        assert_eq!(kvs_engine_create(&cfg, &mut e), kvs_status::KVS_OK);
        let mut info = kvs_policy_info { struct_size: full, ..Default::default() };
        assert_eq!(kvs_engine_policy(e, &mut info), kvs_status::KVS_OK);
        assert_eq!((info.num_stages, info.dense_layers, info.stateful, info.graph_capturable), (2, 1, 0, 1));
        kvs_engine_destroy(e);
        assert_eq!(kvs_engine_policy(std::ptr::null(), &mut info), kvs_status::KVS_ERR_INVALID_ARGUMENT);
    }
}

/// ART's decision (docs/policies.md, "art"): tiles of 64 slots of the visit order, the paper's lane
/// probe, Eq. 2-3 with patience. The engine's stop tile (its visit records) must equal an independent
/// float64 simulation of the same definition on the same inputs, except where a tile's d_scale or d_dir
/// lies within rounding of its threshold (counted and bounded).
#[test]
fn art_stop_tile_matches_a_float64_simulation() {
    let s = seed();
    let mut syn = small_synth(s, 901); // 57 blocks, the last one partial
    let sp = syn.spec.clone();
    let (hq, hk, d, n) = (sp.num_q_heads, sp.num_kv_heads, sp.head_dim, sp.context);
    let g = hq / hk;
    // Visit orders (positions in slot order; None = a masked slot).
    let nb = n.div_ceil(16);
    let all_order: Vec<Option<usize>> = std::iter::once(0).chain((1..nb).rev()).flat_map(|b| (b * 16..b * 16 + 16).map(move |p| (p < n).then_some(p))).collect();
    let recent = 300;
    let stream_order: Vec<Option<usize>> = (0..4).chain((n - recent..n).rev()).map(Some).collect();
    let (mut cases, mut borderline, mut early, mut matched) = (0, 0, 0, 0);
    for (tau, phi, pat) in [(1e-2f64, 1e-1f64, 2u32), (3e-2, 1e-1, 3), (1e-1, 1e-2, 2), (3e-2, 3e-1, 1)] {
        for (sel, order) in [("all", &all_order), (&format!("streaming(sink=4, recent={recent})") as &str, &stream_order)] {
            let spec = format!("{sel} > art(tau={tau}, phi={phi}, patience={pat})");
            let e = engine(&syn, &spec);
            syn.write_cache(&e, 0).unwrap();
            e.record_visits(true);
            let tabs = syn.tables(n, 1);
            let mut out = HostBuf::nans(sp.dtype, sp.num_seqs * hq * d);
            e.attention_forward(&syn.decode_args(0, &tabs, &mut out)).unwrap();
            let recs = e.take_visits();
            assert_eq!(recs.len(), sp.num_seqs * hk);
            for r in &recs {
                let sq = syn.seq_ids.iter().position(|&id| id as u64 == r.seq_id).expect("a sequence of the batch");
                let (eng_tiles, total) = r.traversal_tiles.expect("ART record");
                assert_eq!(total as usize, order.len().div_ceil(64), "{spec}");
                // f64 simulation: running (m, l, acc) per row, probe after each tile.
                let q = |row: usize, i: usize| syn.query.get((sq * hq + r.kv_head * g + row) * d + i) * syn.scale as f64;
                let kv = |p: usize, i: usize, v: bool| {
                    let at = ((sq * n + p) * hk + r.kv_head) * d + i;
                    if v { syn.new_v.get(at) } else { syn.new_k.get(at) }
                };
                let mut acc = vec![vec![0f64; d]; g];
                let mut lsum = vec![0f64; g];
                let mut m = vec![f64::NEG_INFINITY; g];
                let mut prev = vec![0f64; 32];
                let (mut run, mut stop, mut near) = (0u32, order.len().div_ceil(64) as u32, false);
                for (t, tile) in order.chunks(64).enumerate() {
                    for &p in tile.iter().flatten() {
                        for row in 0..g {
                            let x: f64 = (0..d).map(|i| q(row, i) * kv(p, i, false)).sum();
                            let mn = m[row].max(x);
                            let a = (m[row] - mn).exp();
                            let w = (x - mn).exp();
                            lsum[row] = lsum[row] * a + w;
                            for i in 0..d {
                                acc[row][i] = acc[row][i] * a + w * kv(p, i, true);
                            }
                            m[row] = mn;
                        }
                    }
                    let cur: Vec<f64> = (0..32).map(|j| if j / 4 < g.min(8) { acc[j / 4][2 * (j % 4)] / lsum[j / 4] } else { 0.0 }).collect();
                    let dd: f64 = cur.iter().zip(&prev).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
                    let (aa, bb, ab) = (prev.iter().map(|x| x * x).sum::<f64>(), cur.iter().map(|x| x * x).sum::<f64>(), prev.iter().zip(&cur).map(|(a, b)| a * b).sum::<f64>());
                    let dir = if aa == 0.0 && bb == 0.0 { 0.0 } else if aa == 0.0 || bb == 0.0 { 1.0 } else { 1.0 - ab / (aa.sqrt() * bb.sqrt()) };
                    near |= (dd - tau).abs() < 1e-6 + 1e-4 * tau || (dir - phi).abs() < 2e-6;
                    run = if dd < tau && dir < phi { run + 1 } else { 0 };
                    prev = cur;
                    if run >= pat {
                        stop = t as u32 + 1;
                        break;
                    }
                }
                cases += 1;
                if eng_tiles < total {
                    early += 1;
                }
                if eng_tiles == stop {
                    matched += 1;
                } else {
                    assert!(near, "seed {s}: {spec}, seq {sq} head {}: engine stopped after {eng_tiles} tiles, the f64 simulation after {stop}", r.kv_head);
                    borderline += 1;
                }
            }
        }
    }
    println!("{cases} traversals: {matched} same stop tile, {borderline} borderline differences, {early} stopped early");
    assert!(borderline * 10 <= cases, "seed {s}: too many borderline differences ({borderline} of {cases})");
    assert!(early >= cases / 4 && early < cases, "seed {s}: the settings must stop some traversals early and not all ({early} of {cases})");
}

/// `art(segment=K)`: the traversal is cut into segments of K keys (whole 64-key tiles), each terminated on
/// its own from x(0) = 0 and merged by LSE. With thresholds nothing can miss and patience 1, every segment
/// stops after its first tile, so a row visits exactly the first tile of each segment; with patience=inf
/// the merged segments equal dense attention.
#[test]
fn art_segments_stop_on_their_own_and_merge_to_dense() {
    let s = seed();
    let mut syn = small_synth(s, 901); // 57 blocks of 16, the last one partial
    let sp = syn.spec.clone();
    let (hq, hk, d, n) = (sp.num_q_heads, sp.num_kv_heads, sp.head_dim, sp.context);
    let tabs = syn.tables(n, 1);
    for seg in [64usize, 192, 320] {
        let spec = format!("all > art(tau=1e30, phi=1e30, patience=1, segment={seg})");
        let e = engine(&syn, &spec);
        syn.write_cache(&e, 0).unwrap();
        e.record_visits(true);
        let mut out = HostBuf::nans(sp.dtype, sp.num_seqs * hq * d);
        let c = e.attention_forward(&syn.decode_args(0, &tabs, &mut out)).unwrap();
        // Slots in ART's order: every block of 16 slots (the last one partly masked).
        let slots = n.div_ceil(16) * 16;
        let tiles = slots.div_ceil(64);
        let per_seg = seg / 64;
        let visited = tiles.div_ceil(per_seg);
        // Keys read: the visited slots of each segment, less the 11 masked slots of the newest block
        // (901 = 56 * 16 + 5), which comes second in ART's order (after the sink block): in tile 0.
        let keys: usize = (0..slots.div_ceil(seg)).map(|k| (slots - k * seg).min(64)).sum::<usize>() - 11;
        for r in e.take_visits() {
            assert_eq!(r.traversal_tiles, Some((visited as u32, tiles as u32)), "{spec}");
            let toks: usize = r.spans.iter().map(|(a, b)| b - a).sum();
            assert_eq!(toks, keys, "{spec}: keys read");
        }
        assert_eq!(c.traversal_tiles_visited, (visited * sp.num_seqs * hk) as u64, "{spec}");
        assert_eq!(c.blocks_skipped_termination > 0, visited < tiles, "{spec}");
        assert!((0..out.len()).all(|i| out.get(i).is_finite()), "{spec}: every output written");
    }
    let dense = decode(&mut syn, "all");
    for seg in [64usize, 192] {
        let (out, c) = decode(&mut syn, &format!("all > art(patience=inf, segment={seg})"));
        let err = rel_err(&out, &dense.0);
        // Up to 15 LSE merges in f32, each a few ulps (2^-24) of the output: 1e-6 failed on one fresh seed
        // (1.02e-6); a wrong merge is off by orders of magnitude more.
        assert!(err < 4e-6, "segment={seg} (seed {s}): {err} vs dense");
        assert_eq!(c.blocks_skipped_termination, 0);
    }
}
