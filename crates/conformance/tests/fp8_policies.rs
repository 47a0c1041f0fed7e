//! Every policy over an FP8 cache reads the dequantized keys and values (issue 28): an engine over an
//! E4M3/E5M2 cache and one over a float32 cache holding exactly the dequantized values (its "twin") keep
//! the same key metadata (Quest bounds, INT4 estimates: bit for bit), select the same positions, and give
//! the same outputs up to float32 summation order. A policy that read raw FP8 codes, or forgot a scale,
//! would differ (the scales are far from 1). Fresh random data; seed printed.

use kvsparse::engine::Engine;
use kvsparse::rng::Rng;
use kvsparse::stats::VisitRecord;
use kvsparse::tensor::DType;
use kvsparse_conformance::fixture::{run_on_engine, CaseSpec, Fixture, Poison};
use kvsparse_conformance::hostbuf::HostBuf;
use kvsparse_conformance::reference::rel_err;

const POLICIES: [&str; 10] = [
    "quest(budget=256); dense_layers=0",
    "quest(budget=256, page=4) > top_p(p=0.9); dense_layers=0",
    "top_p(p=0.9); dense_layers=0",
    "quest(budget=512) > top_p(p=0.95) > art; dense_layers=0",
    "art(patience=2); dense_layers=0",
    "snapkv(budget=256); dense_layers=0",
    "streaming(sink=4, recent=128); dense_layers=0",
    "speculate(over=quest(budget=256), budget=128); dense_layers=0",
    "refresh(k=64); dense_layers=0",
    "predictor(budget=256); dense_layers=0",
];

/// The float32-cache twin of an FP8 fixture: the same rows, each replaced by what the FP8 cache holds
/// for it (dequantized), over a float32 cache; unwritten slots keep their (unscaled) poison.
fn twin(f: &Fixture) -> Fixture {
    let mut t = Fixture::new(&CaseSpec { cache_dtype: None, ..f.spec.clone() }, 0);
    let dt = f.spec.cache_dtype.unwrap();
    let stored = |b: &HostBuf, scale: f32| -> HostBuf {
        let mut o = HostBuf::zeros(DType::F32, b.len());
        for i in 0..b.len() {
            o.set(i, kvsparse::fp8::dequantize(dt, kvsparse::fp8::quantize(dt, b.get(i) as f32, scale), scale) as f64);
        }
        o
    };
    let mut cache = HostBuf::zeros(DType::F32, f.cache.len());
    for i in 0..cache.len() {
        cache.set(i, f.cache.get(i));
    }
    t.cache = cache;
    t.q = f.q.clone();
    (t.num_tokens, t.num_blocks, t.max_blocks, t.cache_shape, t.cache_strides, t.v_offset, t.q_strides) = (f.num_tokens, f.num_blocks, f.max_blocks, f.cache_shape, f.cache_strides, f.v_offset, f.q_strides);
    (t.block_table, t.seq_lens, t.query_start_loc, t.seq_ids) = (f.block_table.clone(), f.seq_lens.clone(), f.query_start_loc.clone(), f.seq_ids.clone());
    (t.slots, t.prior.slots, t.scale) = (f.slots.clone(), f.prior.slots.clone(), f.scale);
    (t.new_k, t.new_v) = (stored(&f.new_k, f.k_scale), stored(&f.new_v, f.v_scale));
    (t.prior.k, t.prior.v) = (stored(&f.prior.k, f.k_scale), stored(&f.prior.v, f.v_scale));
    t
}

struct Run {
    out: Vec<f64>,
    visits: Vec<VisitRecord>,
    meta: Option<kvsparse::meta::MetaSnapshot>,
}

fn run(f: &mut Fixture, policy: &str) -> Run {
    let mut cfg = f.engine_config();
    cfg.policy = policy.to_string();
    let e = Engine::new(cfg).unwrap_or_else(|e| panic!("{policy}: {e}"));
    e.record_visits(true);
    let outs = run_on_engine(&e, f).unwrap_or_else(|e| panic!("{policy}: {e}"));
    let mut visits = e.take_visits();
    visits.sort_by_key(|v| (v.seq_id, v.kv_head));
    Run { out: outs.to_f64(f).0, visits, meta: e.metadata_snapshot(0).unwrap() }
}

#[test]
fn policies_over_fp8_read_the_dequantized_cache() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    for (i, cache) in [DType::F8E4M3, DType::F8E5M2].into_iter().enumerate() {
        // Decode rows with long contexts (the policies' business) plus a prefill row; f32 queries.
        let mut spec = CaseSpec::new(format!("fp8-policies-{}", cache.name()), DType::F32, 128, 8, 2, 16, vec![(1, 1100), (1, 600), (5, 300), (1, 1400)]);
        spec.cache_dtype = Some(cache);
        spec.poison = Poison::NaN;
        spec.reused = true;
        for (j, policy) in POLICIES.iter().enumerate() {
            let mut f = Fixture::new(&spec, seed.wrapping_add((i * 100 + j) as u64));
            let mut t = twin(&f);
            let (a, b) = (run(&mut f, policy), run(&mut t, policy));
            let e = rel_err(&a.out, &b.out);
            let visited: usize = a.visits.iter().map(|v| v.spans.iter().map(|s| s.1 - s.0).sum::<usize>()).sum();
            println!("{:<12} {policy:<62} rel {e:.1e} rows {} positions {visited}", cache.name(), a.visits.len());
            assert!(!a.visits.is_empty(), "{policy}: no policy row recorded");
            assert_eq!(a.meta, b.meta, "{policy} over {}: key metadata differs from the dequantized twin's", cache.name());
            assert_eq!(a.visits, b.visits, "{policy} over {}: selections differ from the dequantized twin's", cache.name());
            assert!(e < 1e-5, "{policy} over {} (seed {seed}): output differs from the twin's by {e}", cache.name());
        }
    }
}
