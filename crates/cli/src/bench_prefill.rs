//! `kvsparse bench --prefill`: the CPU prefill path (a chunk of query tokens over a cached prefix, causal)
//! on synthetic data, in GFLOP/s against the machine's measured f32 FMA peak (see `fma_peak`).
//!
//! FLOPs counted: 4 · head_dim per (query head, visible key) pair (2 for `q · k`, 2 for `p · v`); the
//! softmax is not counted.

use std::time::Instant;

use kvsparse_conformance::hostbuf::HostBuf;
use kvsparse::engine::Engine;
use kvsparse_conformance::synthetic::{Synth, SynthSpec};
use kvsparse::{DType, EngineConfig};

use crate::args::{dtype, Args};
use crate::bench::median;
use crate::fma_peak::{cpu_seconds, fma_peak_gflops};

const HELP: &str = "usage: kvsparse bench --prefill [options]

Times dense CPU attention for one prompt chunk of --chunk tokens over a cached prefix of --prefix tokens
(causal, batch 1) and prints GFLOP/s next to the machine's f32 FMA peak (measured first: a register-resident
FMA loop on the instruction set the kernels use, every thread at once). Without shape options it runs a
grid: SmolLM2 (9/3 heads x 64) and Llama-8B (32/8 x 128) shapes, f32 and bf16, prefixes 4096 and 7168.

options:
  --prefill          select this benchmark
  --chunk N          query tokens of the chunk (default 2048)
  --prefix N         cached tokens before the chunk; repeat for several (default 4096 and 7168)
  --shape S          smollm2 (9/3 x 64) or llama8b (32/8 x 128); repeat for several (default both)
  --dtype T          f32, f16 or bf16; repeat for several (default f32 and bf16)
  --block-size N     tokens per KV block (default 16)
  --iters N          timed calls per row after one warm-up (default 3)
  --threads N        worker threads, 0 = all cores (default 0)
  --seed N           data seed (default: fresh, printed)";

pub fn run(argv: &[String]) -> Result<(), String> {
    let a = Args::parse(argv, &["chunk", "prefix", "shape", "dtype", "block-size", "iters", "threads", "seed"], &["prefill"], HELP)?;
    let chunk: usize = a.get("chunk", 2048)?;
    let mut prefixes: Vec<usize> = a.values_of("prefix").iter().map(|s| s.parse().map_err(|_| format!("--prefix: cannot parse {s:?}"))).collect::<Result<_, _>>()?;
    if prefixes.is_empty() {
        prefixes = vec![4096, 7168];
    }
    let mut shapes = a.values_of("shape");
    if shapes.is_empty() {
        shapes = vec!["smollm2".into(), "llama8b".into()];
    }
    let mut dtypes: Vec<DType> = a.values_of("dtype").iter().map(|s| dtype(s)).collect::<Result<_, _>>()?;
    if dtypes.is_empty() {
        dtypes = vec![DType::F32, DType::BF16];
    }
    let block_size: usize = a.get("block-size", 16)?;
    let iters: usize = a.get("iters", 3)?.max(1);
    let threads: usize = a.get("threads", 0)?;
    let seed: u64 = a.get("seed", kvsparse::rng::Rng::fresh_seed())?;
    if chunk == 0 {
        return Err("--chunk must be at least 1".into());
    }
    let nthreads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
    let (peak, core_peak, isa) = fma_peak_gflops(nthreads);
    println!("f32 FMA peak ({isa}, {nthreads} threads at once): {peak:.1} GFLOP/s of wall time; {core_peak:.1} GFLOP per CPU-second of one thread; seed {seed}");
    println!("(GFLOP/s: wall time of the call; per CPU-s: GFLOP per second of CPU time the process used during the call, idle");
    println!(" workers' spinning included: on a shared machine the second is the steadier, compared with the per-thread peak)");
    println!();
    println!("| shape | dtype | prefix | chunk | ms/call median | ms/call min | GFLOP/s (median) | % of FMA peak | GFLOP per CPU-s (median) | % of per-thread peak |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for shape in &shapes {
        let (hq, hk, d) = match shape.as_str() {
            "smollm2" => (9, 3, 64),
            "llama8b" => (32, 8, 128),
            other => return Err(format!("--shape: unknown {other:?} (use smollm2 or llama8b)")),
        };
        for &dt in &dtypes {
            for &prefix in &prefixes {
                let (times, cpu) = time_chunk(hq, hk, d, dt, block_size, prefix, chunk, iters, threads, seed)?;
                // Query row i of the chunk sits at position prefix + i and sees prefix + i + 1 keys.
                let pairs = (chunk * prefix + chunk * (chunk + 1) / 2) as f64 * hq as f64;
                let gflop = 4.0 * d as f64 * pairs / 1e9;
                let med = median(&times);
                let min = times.iter().copied().fold(f64::INFINITY, f64::min);
                println!(
                    "| {shape} ({hq}/{hk} x {d}) | {} | {prefix} | {chunk} | {:.1} | {:.1} | {:.1} | {:.1}% | {:.1} | {:.1}% |",
                    kvsparse_conformance::matrix::dtype_tag(dt),
                    med * 1e3,
                    min * 1e3,
                    gflop / med,
                    100.0 * gflop / med / peak,
                    gflop / median(&cpu),
                    100.0 * gflop / median(&cpu) / core_peak
                );
            }
        }
    }
    Ok(())
}

/// Wall and process CPU seconds per call of one prompt chunk (`iters` timed calls after a warm-up).
#[allow(clippy::too_many_arguments)]
fn time_chunk(hq: usize, hk: usize, d: usize, dt: DType, block_size: usize, prefix: usize, chunk: usize, iters: usize, threads: usize, seed: u64) -> Result<(Vec<f64>, Vec<f64>), String> {
    // The synthetic batch's observation window is the chunk: `window` queries before the decode token.
    let mut spec = SynthSpec::llama_like(1, prefix + chunk + 1);
    (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype, spec.window) = (hq, hk, d, block_size, dt, chunk);
    let mut syn = Synth::generate(&spec, seed);
    let mut cfg = EngineConfig::new(1, hq, hk, d, block_size, dt);
    cfg.num_threads = threads;
    let engine = Engine::new(cfg).map_err(|e| e.message)?;
    syn.write_cache(&engine, 0).map_err(|e| e.message)?;
    let tabs = syn.tables(prefix + chunk, chunk);
    let mut out = HostBuf::zeros(dt, chunk * hq * d);
    let (mut times, mut cpu) = (Vec::new(), Vec::new());
    for i in 0..=iters {
        let args = syn.observe_args(0, &tabs, &mut out);
        let (t, c) = (Instant::now(), cpu_seconds(true));
        engine.attention_forward(&args).map_err(|e| e.message)?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
            cpu.push(cpu_seconds(true) - c);
        }
    }
    Ok((times, cpu))
}
