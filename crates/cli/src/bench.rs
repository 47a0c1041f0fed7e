//! `kvsparse bench`: dense attention and one or more policies on the same synthetic decode batch
//! (`kvsparse_conformance::synthetic`, LLM-like attention: sinks, recent tokens, planted needles), printing per
//! policy: time per decode call, KV bytes read, blocks visited, what top-p kept and ART skipped, and the
//! relative error of each output row against dense (median and max over rows).

use std::time::Instant;

use kvsparse_conformance::hostbuf::HostBuf;
use kvsparse::engine::Engine;
use kvsparse::policy::{top_p, Policy};
use kvsparse::stats::Counters;
use kvsparse_conformance::synthetic::{Synth, SynthSpec};
use kvsparse::EngineConfig;

use crate::args::{dtype, policies, Args};

const HELP: &str = "usage: kvsparse bench --policy SPEC [--policy SPEC ...] [options]

Runs dense attention and each policy on the same synthetic decode batch and prints, per policy: median
and minimum time per decode call, KV bytes read (K/V rows plus policy metadata), blocks visited (% of eligible),
tokens kept by top-p, blocks skipped by ART, relative error vs dense per output row (median, max).

options:
  --policy SPEC      policy spec (docs/policies.md); repeat for several; dense is always run first
  --context N        tokens per sequence incl. the decode token (default 8192)
  --batch N          sequences (default 4)
  --q-heads N        query heads (default 32)
  --kv-heads N       KV heads (default 8)
  --head-dim N       head size (default 128)
  --block-size N     tokens per KV block (default 16)
  --dtype T          f32, f16 or bf16 (default f16)
  --iters N          timed calls per policy, after one warm-up, interleaved across policies (default 5)
  --threads N        worker threads, 0 = all cores (default 0)
  --seed N           data seed (default: fresh, printed)";

struct Run {
    name: String,
    times: Vec<f64>,
    c: Counters,
    out: Vec<f64>,
}

pub fn run(argv: &[String]) -> Result<(), String> {
    let a = Args::parse(argv, &["policy", "context", "batch", "q-heads", "kv-heads", "head-dim", "block-size", "dtype", "iters", "threads", "seed"], &[], HELP)?;
    let policies: Vec<String> = policies(&a)?;
    if policies.is_empty() {
        return Err(format!("--policy is required\n\n{HELP}"));
    }
    for p in &policies {
        Policy::parse(p).map_err(|e| e.message)?;
    }
    let mut spec = SynthSpec::llama_like(a.get("batch", 4)?, a.get("context", 8192)?);
    spec.num_q_heads = a.get("q-heads", spec.num_q_heads)?;
    spec.num_kv_heads = a.get("kv-heads", spec.num_kv_heads)?;
    spec.head_dim = a.get("head-dim", spec.head_dim)?;
    spec.block_size = a.get("block-size", spec.block_size)?;
    spec.dtype = dtype(a.str("dtype").unwrap_or("f16"))?;
    let iters: usize = a.get("iters", 5)?;
    let threads: usize = a.get("threads", 0)?;
    let seed: u64 = a.get("seed", kvsparse::rng::Rng::fresh_seed())?;
    if spec.context < 2 || spec.num_seqs == 0 || spec.num_kv_heads == 0 || spec.num_q_heads % spec.num_kv_heads != 0 {
        return Err("need --context >= 2, --batch >= 1 and --q-heads a multiple of --kv-heads".into());
    }
    let t = Instant::now();
    let mut syn = Synth::generate(&spec, seed);
    println!(
        "synthetic batch: {} seqs x {} tokens, {}q/{}kv heads, head_dim {}, block {}, {:?}; seed {seed}; generated in {:.1}s; {} threads",
        spec.num_seqs,
        spec.context,
        spec.num_q_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.block_size,
        spec.dtype,
        t.elapsed().as_secs_f64(),
        if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads }
    );

    // One engine per policy, all set up first; then the timed calls are interleaved (dense, p1, p2, ...,
    // dense, p1, ...) so that load from elsewhere on a shared machine hits every policy alike.
    let mut names = vec!["dense".to_string()];
    names.extend(policies.iter().cloned());
    let mut setups = Vec::new();
    for n in &names {
        setups.push(setup_policy(&mut syn, n, threads)?);
    }
    let s = syn.spec.clone();
    let tabs = syn.tables(s.context, 1);
    let mut outs: Vec<HostBuf> = names.iter().map(|_| HostBuf::zeros(s.dtype, s.num_seqs * s.num_q_heads * s.head_dim)).collect();
    let mut runs: Vec<Run> = names.iter().map(|n| Run { name: n.clone(), times: Vec::new(), c: Counters::default(), out: Vec::new() }).collect();
    for i in 0..=iters {
        for (k, (engine, layer)) in setups.iter().enumerate() {
            let args = syn.decode_args(*layer, &tabs, &mut outs[k]);
            let t = Instant::now();
            runs[k].c = engine.attention_forward(&args).map_err(|e| e.message)?;
            if i > 0 {
                runs[k].times.push(t.elapsed().as_secs_f64());
            }
        }
    }
    for (r, o) in runs.iter_mut().zip(&outs) {
        r.out = (0..o.len()).map(|i| o.get(i)).collect();
    }
    let dense_out = runs[0].out.clone();
    let dense_min = quantile(&runs[0].times, 0.0);
    let d = spec.head_dim;
    println!();
    println!("| policy | ms/call median | ms/call min | vs dense (min) | KV MB read | blocks visited | top-p kept | ART skipped | rel err median | rel err max |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &runs {
        let errs = row_errors(&r.out, &dense_out, d);
        let c = &r.c;
        let visited = if c.policy_rows > 0 { format!("{:.1}%", 100.0 * c.visited_fraction()) } else { "100% (dense)".into() };
        let kept = if c[top_p::CANDIDATES] > 0 { format!("{:.1}%", 100.0 * c[top_p::KEPT] as f64 / c[top_p::CANDIDATES] as f64) } else { "-".into() };
        let skipped = if c.blocks_skipped_termination > 0 || r.name.contains("art") {
            format!("{:.1}%", 100.0 * c.blocks_skipped_termination as f64 / c.blocks_eligible.max(1) as f64)
        } else {
            "-".into()
        };
        let tmin = quantile(&r.times, 0.0);
        println!(
            "| `{}` | {:.2} | {:.2} | {:.2}x | {:.1} | {} | {} | {} | {:.2e} | {:.2e} |",
            r.name,
            median(&r.times) * 1e3,
            tmin * 1e3,
            dense_min / tmin,
            c.kv_bytes_read as f64 / 1e6,
            visited,
            kept,
            skipped,
            quantile(&errs, 0.5),
            quantile(&errs, 1.0)
        );
    }
    Ok(())
}

/// An engine for one policy (serving its first non-dense layer), with the cache written through it (so
/// its metadata is maintained) and, for SnapKV, the last prompt chunk observed. Returns it and the layer.
fn setup_policy(syn: &mut Synth, spec_text: &str, threads: usize) -> Result<(Engine, usize), String> {
    let policy = Policy::parse(spec_text).map_err(|e| e.message)?;
    let layer = if policy.pipeline().is_some() { policy.dense_layers() } else { 0 };
    let s = syn.spec.clone();
    let mut cfg = EngineConfig::new(layer + 1, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size, s.dtype);
    cfg.policy = if spec_text == "dense" { String::new() } else { spec_text.to_string() };
    cfg.num_threads = threads;
    let engine = Engine::new(cfg).map_err(|e| e.message)?;
    syn.write_cache(&engine, layer).map_err(|e| e.message)?;
    if policy.is_stateful() {
        // SnapKV observes the last prompt chunk (the `window` tokens before the decode token).
        let w = s.window.min(s.context - 1);
        let tabs = syn.tables(s.context - 1, w);
        let mut out = HostBuf::zeros(s.dtype, s.num_seqs * w * s.num_q_heads * s.head_dim);
        let args = syn.observe_args(layer, &tabs, &mut out);
        engine.attention_forward(&args).map_err(|e| e.message)?;
    }
    Ok((engine, layer))
}

/// ‖o − o_dense‖ / ‖o_dense‖ per output row (sequence × query head).
fn row_errors(out: &[f64], dense: &[f64], d: usize) -> Vec<f64> {
    out.chunks(d)
        .zip(dense.chunks(d))
        .map(|(a, b)| {
            let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
            let den: f64 = b.iter().map(|y| y * y).sum();
            (num / den.max(1e-300)).sqrt()
        })
        .collect()
}

pub(crate) fn median(v: &[f64]) -> f64 {
    quantile(v, 0.5)
}

fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((s.len() - 1) as f64 * q).round() as usize]
}
