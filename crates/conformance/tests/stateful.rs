//! Stateful policies (PRR speculate/repair, RefreshKV): exactness properties on real traces, and the
//! lifecycle of their per-sequence state.

use std::path::PathBuf;

use kvsparse_conformance::hostbuf::HostBuf;
use kvsparse_conformance::reference::rel_err;
use kvsparse::engine::Engine;
use kvsparse::policy::speculate::{self, SpecBudgetTable};
use kvsparse::policy::refresh;
use kvsparse::rng::Rng;
use kvsparse_conformance::synthetic::{Synth, SynthSpec};
use kvsparse::tensor::DType;
use kvsparse_conformance::traces::{replay, Manifest, ReplayOptions, Trace};
use kvsparse::EngineConfig;

fn trace(name: &str) -> Option<Trace> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    if !dir.join("manifest.json").exists() {
        eprintln!("SKIPPED: no traces in {}", dir.display());
        return None;
    }
    let m = Manifest::load(&dir).expect("manifest");
    let info = m.traces.iter().find(|t| t.name == name).expect("trace in manifest");
    Some(m.load_trace(info).expect("trace"))
}

/// With `extra=drop`, PRR's output is attention over the true (Quest) set whatever the prediction: Holt,
/// the previous step's set, and a deliberately inverted predictor all give Quest's output to f32 summation
/// order (≤ 1e-6), while their hit and repair counts differ as they should. The default (`extra=keep`, the
/// paper's) also attends the predicted pages outside the true set.
#[test]
fn speculate_output_equals_attention_over_the_true_set() {
    let Some(tr) = trace("needle_2k") else { return };
    let opts = ReplayOptions { dtype: DType::F32, threads: 2, ..Default::default() };
    let quest = replay(&tr, "quest(budget=256)", &opts).expect("replay");
    let mut hit_rates = Vec::new();
    for predict in ["holt", "previous", "inverse"] {
        let spec = format!("speculate(over=quest(budget=256), budget=256, predict={predict}, extra=drop)");
        let r = replay(&tr, &spec, &opts).expect("replay");
        let c = r.counters;
        for li in 0..tr.layers.len() {
            let e = rel_err(&r.out[li], &quest.out[li]);
            println!("{spec} layer {}: rel err vs quest {e:.2e}", tr.layers[li].layer);
            assert!(e <= 1e-6, "{spec}: differs from attention over the true set by {e:.3e}");
        }
        assert_eq!(c.policy_rows, quest.counters.policy_rows);
        assert!(c[speculate::TRUE_BLOCKS] > 0);
        assert_eq!(c[speculate::HIT_BLOCKS] + c[speculate::REPAIRED_BLOCKS], c[speculate::TRUE_BLOCKS], "{c:?}");
        let hit = c[speculate::HIT_BLOCKS] as f64 / c[speculate::TRUE_BLOCKS] as f64;
        let reuse = c[speculate::REUSE_HIT_BLOCKS] as f64 / c[speculate::TRUE_BLOCKS] as f64;
        println!("{spec}: hit {hit:.3} reuse-previous {reuse:.3} repaired {} visited {}/{} calib {}", c[speculate::REPAIRED_BLOCKS], c.blocks_visited, c.blocks_eligible, c[speculate::CALIBRATIONS]);
        hit_rates.push(hit);
        if predict == "inverse" {
            assert!(c[speculate::REPAIRED_BLOCKS] > 0, "the inverted predictor repaired nothing: {c:?}");
        }
    }
    assert!(hit_rates[0] > 0.5, "Holt hit rate {:.3}", hit_rates[0]);
    assert!(hit_rates[2] < hit_rates[0] - 0.3, "inverse predictor hits as often as Holt: {hit_rates:?}");
    // Keeping the extra predicted pages changes the output (more context than the true set).
    let keep = replay(&tr, "speculate(over=quest(budget=256), budget=512)", &opts).expect("replay");
    assert!(rel_err(&keep.out[1], &quest.out[1]) > 1e-6, "the default (extra=keep) attended nothing beyond the true set");
    let explicit = replay(&tr, "speculate(over=quest(budget=256), budget=512, extra=keep)", &opts).expect("replay");
    assert_eq!(keep.out, explicit.out, "extra=keep is the default");
    // The true set follows `over`'s sink pages too: the output is `quest(..., sink=16)`'s, not plain Quest's.
    let sunk = replay(&tr, "quest(budget=256, sink=16)", &opts).expect("replay");
    let spec = replay(&tr, "speculate(over=quest(budget=256, sink=16), budget=256, extra=drop)", &opts).expect("replay");
    for li in 0..tr.layers.len() {
        let e = rel_err(&spec.out[li], &sunk.out[li]);
        assert!(e <= 1e-6, "speculate over quest(sink=16) differs from quest(sink=16) by {e:.3e}");
    }
    assert!(rel_err(&sunk.out[0], &quest.out[0]) > 1e-6 || rel_err(&sunk.out[1], &quest.out[1]) > 1e-6, "sink=16 changed no selection on needle_2k");
}

/// The speculation budget comes from the engine's table when one is loaded.
#[test]
fn speculation_budget_table_is_used() {
    let s = small_synth(11, 512);
    let mut syn = s;
    let e = engine(&syn, "speculate(over=quest(budget=64), budget=64)");
    syn.write_cache(&e, 0).unwrap();
    let run = |e: &Engine, syn: &mut Synth| {
        let tabs = syn.tables(syn.spec.context, 1);
        let mut out = HostBuf::zeros(syn.spec.dtype, syn.spec.num_seqs * syn.spec.num_q_heads * syn.spec.head_dim);
        let args = syn.decode_args(0, &tabs, &mut out);
        e.attention_forward(&args).unwrap()
    };
    let c = run(&e, &mut syn);
    let rows = c.policy_rows;
    assert_eq!(c[speculate::PREDICTED_BLOCKS], rows * 4, "constant budget of 64 tokens = 4 pages");
    let c = run(&e, &mut syn);
    assert_eq!(c[speculate::PREDICTED_BLOCKS], rows * 4, "constant budget of 64 tokens = 4 pages");
    e.set_speculation_budgets(Some(SpecBudgetTable::new(vec![(0, 16), (256, 128)]).unwrap()));
    let c = run(&e, &mut syn);
    assert_eq!(c[speculate::PREDICTED_BLOCKS], rows * 8, "table budget for 512 tokens = 128 tokens = 8 pages");
}

/// RefreshKV with `s = 1` and `stride = 1` refreshes at every step: dense attention (bit for bit the
/// policy path's `all` pipeline), every block visited.
/// With the defaults it runs partial steps and visits fewer blocks.
#[test]
fn refresh_with_s1_stride1_is_dense() {
    let Some(tr) = trace("needle_2k") else { return };
    let opts = ReplayOptions { dtype: DType::F32, threads: 2, ..Default::default() };
    let dense = replay(&tr, "dense", &opts).expect("replay");
    let all = replay(&tr, "all", &opts).expect("replay");
    let r = replay(&tr, "refresh(k=64, stride=1, s=1.0)", &opts).expect("replay");
    for li in 0..tr.layers.len() {
        let e = rel_err(&r.out[li], &dense.out[li]);
        let e_all = rel_err(&r.out[li], &all.out[li]);
        let all_dense = rel_err(&all.out[li], &dense.out[li]);
        println!("refresh(s=1, stride=1) layer {}: rel err vs dense {e:.2e}, vs `all` {e_all:.2e} (`all` vs dense {all_dense:.2e})", tr.layers[li].layer);
        // Bit for bit the policy path's dense pipeline (`all`); vs the dense path (another summation order,
        // as in crates/conformance/tests/traces.rs for full-budget Quest) within f32 accumulation error.
        assert_eq!(e_all, 0.0, "refresh(s=1, stride=1) differs from the `all` pipeline");
        assert!(e <= 1e-5, "refresh(s=1, stride=1) differs from dense by {e:.3e}");
    }
    let c = r.counters;
    assert_eq!(c.blocks_visited, c.blocks_eligible);
    assert_eq!(c[refresh::PARTIAL_STEPS], 0);
    assert_eq!(c[refresh::FULL_STEPS], (r.steps.len() * tr.layers.len()) as u64);
    let p = replay(&tr, "refresh(k=256, stride=5, s=0.85)", &opts).expect("replay").counters;
    println!("refresh(k=256): full {} partial {} visited {}/{}", p[refresh::FULL_STEPS], p[refresh::PARTIAL_STEPS], p.blocks_visited, p.blocks_eligible);
    assert!(p[refresh::PARTIAL_STEPS] > 0 && p[refresh::FULL_STEPS] > 0);
    assert_eq!(p[refresh::FULL_STEPS] + p[refresh::PARTIAL_STEPS], (r.steps.len() * tr.layers.len()) as u64);
    assert!(p.blocks_visited < p.blocks_eligible);
    // A fixed schedule refreshes exactly every N steps.
    let f = replay(&tr, "refresh(k=256, every=4)", &opts).expect("replay").counters;
    assert_eq!(f[refresh::FULL_STEPS], (r.steps.len().div_ceil(4) * tr.layers.len()) as u64);
}

/// AttentionPredictor: with a budget covering everything it is the `all` pipeline bit for bit (full and
/// predicted steps alike); with a small budget it visits fewer blocks, calibrates every `calib` steps, and
/// still recovers most of the attention mass on a real trace.
#[test]
fn predictor_schedule_and_full_budget() {
    let Some(tr) = trace("needle_2k") else { return };
    let opts = ReplayOptions { dtype: DType::F32, threads: 2, record_visits: true, ..Default::default() };
    let all = replay(&tr, "all", &opts).expect("replay");
    let full = replay(&tr, "predictor(budget=100000)", &opts).expect("replay");
    for li in 0..tr.layers.len() {
        assert_eq!(rel_err(&full.out[li], &all.out[li]), 0.0, "predictor with an unlimited budget differs from `all`");
    }
    let r = replay(&tr, "predictor(budget=256, calib=5)", &opts).expect("replay");
    let c = r.counters;
    let heads = (tr.layers.len() * tr.hk) as u64;
    // The prefill seeds the history, so the first full step is the 5th decode step.
    assert_eq!(c[refresh::FULL_STEPS], (r.steps.len() / 5) as u64 * heads, "{c:?}");
    assert_eq!(c[refresh::FULL_STEPS] + c[refresh::PARTIAL_STEPS], r.steps.len() as u64 * heads);
    assert!(c.blocks_visited < c.blocks_eligible / 2, "{c:?}");
    let p = tr.info.prompt_len;
    let (mut mass, mut rows) = (0f64, 0usize);
    for li in 0..tr.layers.len() {
        for (si, &t) in r.steps.iter().enumerate() {
            let w = tr.dense_weights(li, t);
            let n = p + t + 1;
            for h in 0..tr.hk {
                let spans = r.visits[r.visit_index(tr.hk, li, si, h)].as_ref().expect("recorded");
                let tokens: usize = spans.iter().map(|(a, b)| b - a).sum();
                // Calibration steps (every 5th) stay sparse too: only their history row sees every key.
                assert!(tokens <= 256 + 16, "step {t}: {tokens} tokens over a 256 budget");
                for qh in h * tr.hq / tr.hk..(h + 1) * tr.hq / tr.hk {
                    mass += kvsparse_conformance::traces::mass_in_spans(&w[qh * n..(qh + 1) * n], spans);
                    rows += 1;
                }
            }
        }
    }
    let rec = mass / rows as f64;
    println!("predictor(budget=256) on needle_2k: recovery {rec:.3}, visited {}/{}", c.blocks_visited, c.blocks_eligible);
    assert!(rec > 0.5 && rec < 1.0, "recovery {rec}");
    // Calibration feeds the full row into the history: with calib=1 every history row is the true one,
    // so the selections differ from calib=1000 (history rows of attended tokens only) while both stay
    // within the budget.
    let every = replay(&tr, "predictor(budget=256, calib=1)", &opts).expect("replay");
    let never = replay(&tr, "predictor(budget=256, calib=1000)", &opts).expect("replay");
    assert_eq!(every.counters[refresh::PARTIAL_STEPS], 0);
    assert_eq!(never.counters[refresh::FULL_STEPS], 0);
    assert!(every.counters.blocks_visited <= every.counters.blocks_eligible / 2);
    assert_ne!(every.visits, never.visits, "calibration steps changed no selection");
    // The K read for the full history rows is counted: calib=1 reads more than calib=1000.
    assert!(every.counters.kv_bytes_read > never.counters.kv_bytes_read);
    // A weights file named in the spec is used (here the built-in weights, written out: same output),
    // and a bad one fails engine creation with a message naming the file.
    let dir = std::env::temp_dir().join(format!("kvsparse-pred-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("w.safetensors");
    std::fs::write(&file, include_bytes!("../../../src/policy/predictor/weights.safetensors")).unwrap();
    let named = replay(&tr, &format!("predictor(budget=256, calib=5, weights=\"{}\")", file.display()), &opts).expect("replay");
    assert_eq!(named.out, r.out);
    std::fs::write(&file, b"not safetensors").unwrap();
    let Err(e) = replay(&tr, &format!("predictor(budget=256, weights=\"{}\")", file.display()), &opts) else { panic!("bad weights accepted") };
    assert!(e.contains("w.safetensors"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// RefreshKV initialises its partial set at the prefill (the paper's prefilling stage): the first decode
/// step is already partial, and the set it attends is the top `k − 1` positions by the last prompt token's
/// attention (softmax per query head, max over the GQA group, max-pooled over 7) plus the decode token,
/// recomputed here in f64 from the trace.
#[test]
fn refresh_starts_from_the_last_prompt_tokens_attention() {
    let Some(tr) = trace("needle_2k") else { return };
    let opts = ReplayOptions { dtype: DType::F32, threads: 2, record_visits: true, ..Default::default() };
    let k = 256;
    let r = replay(&tr, &format!("refresh(k={k}, every=1000)"), &opts).expect("replay");
    assert_eq!(r.counters[refresh::FULL_STEPS], 0, "a decode step ran full although the prefill initialised the set");
    let (p, hq, hk, d) = (tr.info.prompt_len, tr.hq, tr.hk, tr.d);
    let g = hq / hk;
    for (li, lt) in tr.layers.iter().enumerate() {
        let w_tail = lt.tail_len;
        for h in 0..hk {
            // The last prompt token (position p - 1) sees 0 ..= p - 1.
            let mut agg = vec![0f64; p];
            for qh in h * g..(h + 1) * g {
                let q: Vec<f64> = (0..d).map(|i| lt.q_prompt_tail[((w_tail - 1) * hq + qh) * d + i].to_f64() * tr.scale as f64).collect();
                let logits: Vec<f64> = (0..p).map(|j| q.iter().zip(&lt.k[(j * hk + h) * d..(j * hk + h + 1) * d]).map(|(a, b)| a * b.to_f64()).sum()).collect();
                let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
                let s: f64 = e.iter().sum();
                for (a, x) in agg.iter_mut().zip(&e) {
                    *a = a.max(x / s);
                }
            }
            let pooled: Vec<f64> = (0..p).map(|i| agg[i.saturating_sub(3)..(i + 4).min(p)].iter().cloned().fold(0.0, f64::max)).collect();
            let mut idx: Vec<usize> = (0..p).collect();
            idx.sort_by(|&a, &b| pooled[b].total_cmp(&pooled[a]).then(b.cmp(&a)));
            let mut want: Vec<usize> = idx[..k - 1].to_vec();
            want.push(p); // the decode token, appended with +inf
            want.sort_unstable();
            let spans = r.visits[r.visit_index(hk, li, 0, h)].as_ref().expect("recorded");
            let got: Vec<usize> = spans.iter().flat_map(|&(a, b)| a..b).collect();
            assert_eq!(got.len(), k);
            let missing = want.iter().filter(|x| got.binary_search(x).is_err()).count();
            // Ties and near-ties at the k-th score may order differently in f32: allow two swaps.
            assert!(missing <= 2, "layer {} head {h}: {missing} of {k} positions differ from the reference", lt.layer);
        }
    }
}

fn small_synth(seed: u64, context: usize) -> Synth {
    let spec = SynthSpec { num_seqs: 4, context, num_q_heads: 4, num_kv_heads: 2, head_dim: 64, block_size: 16, dtype: DType::F32, sinks: 4, needles: 4, window: 16 };
    Synth::generate(&spec, seed)
}

fn engine(syn: &Synth, policy: &str) -> Engine {
    let s = &syn.spec;
    let mut cfg = EngineConfig::new(2, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size, s.dtype);
    cfg.policy = format!("{policy}; dense_layers=0");
    cfg.num_threads = 2;
    Engine::new(cfg).unwrap()
}

/// 1000 sequences opened (prefill chunk, then decode steps that grow them across a block boundary, on two
/// layers) and released leave no policy state behind; state exists while they live; a released id that is
/// reused starts from scratch (nothing leaks from the old sequence).
#[test]
fn thousand_sequences_leave_no_state() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    for policy in ["speculate(over=quest(budget=64))", "refresh(k=64, stride=2, s=0.9)", "predictor(budget=64, sink=16, local=16, calib=2)", "snapkv(budget=64, window=16)"] {
        let mut syn = small_synth(seed, 258);
        let e = engine(&syn, policy);
        let sp = syn.spec.clone();
        for layer in 0..2 {
            syn.write_cache(&e, layer).unwrap();
        }
        let mut next_id = 1i64;
        let mut peak_objects = 0;
        for _round in 0..1000 / sp.num_seqs {
            for id in syn.seq_ids.iter_mut() {
                *id = next_id;
                next_id += 1;
            }
            for layer in 0..2 {
                let tabs = syn.tables(256, 16);
                let mut out = HostBuf::zeros(sp.dtype, sp.num_seqs * 16 * sp.num_q_heads * sp.head_dim);
                let args = syn.observe_args(layer, &tabs, &mut out);
                e.attention_forward(&args).unwrap();
            }
            // Decode steps at 257 and 258 tokens: the sequences grow into a new block.
            for len in [256, 257, 258] {
                for layer in 0..2 {
                    let tabs = syn.tables(len, 1);
                    let mut out = HostBuf::zeros(sp.dtype, sp.num_seqs * sp.num_q_heads * sp.head_dim);
                    let args = syn.decode_args(layer, &tabs, &mut out);
                    e.attention_forward(&args).unwrap();
                    assert!((0..out.len()).all(|i| out.get(i).is_finite()));
                }
            }
            peak_objects = peak_objects.max(e.policy_state_objects());
            assert!(e.stats().state_bytes > 0, "{policy}: no state while sequences live");
            for id in syn.seq_ids.clone() {
                e.release_sequence(id as u64).unwrap();
            }
            assert_eq!(e.policy_state_objects(), 0, "{policy}: state left after release");
        }
        if policy.starts_with("speculate") {
            assert_eq!(e.stats().total[speculate::CALIBRATIONS], 1000 * 2 * sp.num_kv_heads as u64, "one calibration per (sequence, layer, KV head)");
        }
        let st = e.stats();
        println!("{policy}: created {} released {} peak state objects {peak_objects}", st.sequences_created, st.sequences_released);
        assert_eq!(st.sequences_created, 1000);
        assert_eq!(st.sequences_released, 1000);
        assert_eq!(st.live_sequences, 0);
        assert_eq!(st.state_bytes, 0);
        assert_eq!(e.policy_state_objects(), 0);
        // 4 sequences × 2 layers × 2 KV heads per-head states (+ 4 × 2 layer schedules for refresh).
        let per_head = (sp.num_seqs * 2 * sp.num_kv_heads) as u64;
        let want = if policy.starts_with("refresh") { per_head + (sp.num_seqs * 2) as u64 } else { per_head };
        assert_eq!(peak_objects, want, "{policy}");
        assert!(e.release_sequence(1).is_err(), "released twice");
    }
}

/// A released id reused by a new sequence starts with a fresh schedule (its first step is a full refresh)
/// and a fresh predictor (no previous true set: the reuse-previous baseline hits nothing on its first step).
#[test]
fn reused_ids_start_fresh() {
    let mut syn = small_synth(5, 256);
    let sp = syn.spec.clone();
    let rows = (sp.num_seqs * sp.num_kv_heads) as u64;
    for policy in ["refresh(k=32, stride=100, s=0.0)", "speculate(over=quest(budget=32), budget=32)"] {
        let e = engine(&syn, policy);
        syn.write_cache(&e, 0).unwrap();
        let step = |e: &Engine, syn: &mut Synth| {
            let tabs = syn.tables(256, 1);
            let mut out = HostBuf::zeros(sp.dtype, sp.num_seqs * sp.num_q_heads * sp.head_dim);
            let args = syn.decode_args(0, &tabs, &mut out);
            e.attention_forward(&args).unwrap()
        };
        let first = step(&e, &mut syn);
        let second = step(&e, &mut syn);
        for id in syn.seq_ids.clone() {
            e.release_sequence(id as u64).unwrap();
        }
        let again = step(&e, &mut syn);
        if policy.starts_with("refresh") {
            assert_eq!((first[refresh::FULL_STEPS], second[refresh::FULL_STEPS]), (sp.num_seqs as u64, 0));
            assert_eq!(again[refresh::FULL_STEPS], sp.num_seqs as u64, "a reused id inherited the old schedule");
        } else {
            assert_eq!(first[speculate::REUSE_HIT_BLOCKS], 0);
            assert_eq!(second[speculate::REUSE_HIT_BLOCKS], rows * 2, "same query twice: the previous set is the true set");
            assert_eq!(again[speculate::REUSE_HIT_BLOCKS], 0, "a reused id inherited the old predictor");
        }
    }
}

/// The stateful specs and the speculation budget table through the C ABI.
#[test]
fn stateful_policies_through_the_c_abi() {
    use kvsparse::ffi::types::{kvs_engine_config, kvs_stats, kvs_status};
    use kvsparse::ffi::{kvs_engine_config_init, kvs_engine_create, kvs_engine_destroy, kvs_engine_stats};
    use kvsparse::policy::speculate::kvs_engine_set_speculation_budgets;
    use std::ffi::CString;
    for spec in ["speculate(over=quest(budget=256), budget=512)", "refresh(k=512, stride=5, s=0.85)", "predictor(budget=512)"] {
        let text = CString::new(spec).unwrap();
        // SAFETY: plain C calls with valid pointers; the engine is destroyed below.
        unsafe {
            let mut cfg: kvs_engine_config = std::mem::zeroed();
            cfg.struct_size = std::mem::size_of::<kvs_engine_config>() as u32;
            assert_eq!(kvs_engine_config_init(&mut cfg), kvs_status::KVS_OK);
            cfg.num_layers = 4;
            cfg.num_q_heads = 8;
            cfg.num_kv_heads = 2;
            cfg.head_dim = 64;
            cfg.block_size = 16;
            cfg.policy = text.as_ptr();
            let mut e = std::ptr::null_mut();
            assert_eq!(kvs_engine_create(&cfg, &mut e), kvs_status::KVS_OK, "{spec}");
            let (ctx, bud) = ([0u64, 4096, 4096], [256u64, 1024, 2048]);
            assert_eq!(kvs_engine_set_speculation_budgets(e, ctx.as_ptr(), bud.as_ptr(), 2), kvs_status::KVS_OK);
            assert_eq!(kvs_engine_set_speculation_budgets(e, ctx.as_ptr(), bud.as_ptr(), 3), kvs_status::KVS_ERR_INVALID_ARGUMENT, "repeated context length");
            assert_eq!(kvs_engine_set_speculation_budgets(e, std::ptr::null(), bud.as_ptr(), 1), kvs_status::KVS_ERR_INVALID_ARGUMENT);
            assert_eq!(kvs_engine_set_speculation_budgets(e, std::ptr::null(), std::ptr::null(), 0), kvs_status::KVS_OK);
            assert_eq!(kvs_engine_set_speculation_budgets(std::ptr::null_mut(), ctx.as_ptr(), bud.as_ptr(), 1), kvs_status::KVS_ERR_INVALID_ARGUMENT);
            let mut st: kvs_stats = std::mem::zeroed();
            st.struct_size = std::mem::size_of::<kvs_stats>() as u32;
            assert_eq!(kvs_engine_stats(e, -1, &mut st), kvs_status::KVS_OK);
            assert_eq!((st.live_sequences, st.state_bytes), (0, 0));
            kvs_engine_destroy(e);
        }
    }
}

/// With a state cap, a call fails with OUT_OF_MEMORY (writing nothing) once the state held exceeds it, and
/// works again after the sequences are released.
#[test]
fn state_cap_is_enforced() {
    let mut syn = small_synth(9, 256);
    let sp = syn.spec.clone();
    let mut cfg = EngineConfig::new(1, sp.num_q_heads, sp.num_kv_heads, sp.head_dim, sp.block_size, sp.dtype);
    cfg.policy = "refresh(k=64); dense_layers=0".into();
    cfg.num_threads = 2;
    cfg.max_state_bytes = 1024;
    let e = Engine::new(cfg).unwrap();
    syn.write_cache(&e, 0).unwrap();
    let tabs = syn.tables(256, 1);
    let mut out = HostBuf::zeros(sp.dtype, sp.num_seqs * sp.num_q_heads * sp.head_dim);
    let args = syn.decode_args(0, &tabs, &mut out);
    e.attention_forward(&args).unwrap();
    assert!(e.stats().state_bytes > 1024, "{} bytes", e.stats().state_bytes);
    let mut out = HostBuf::nans(sp.dtype, sp.num_seqs * sp.num_q_heads * sp.head_dim);
    let args = syn.decode_args(0, &tabs, &mut out);
    let err = e.attention_forward(&args).unwrap_err();
    assert_eq!(err.kind, kvsparse::ErrorKind::OutOfMemory, "{}", err.message);
    assert!((0..out.len()).all(|i| out.get(i).is_nan()), "output written by a refused call");
    for id in syn.seq_ids.clone() {
        e.release_sequence(id as u64).unwrap();
    }
    let args = syn.decode_args(0, &tabs, &mut out);
    e.attention_forward(&args).unwrap();
}
