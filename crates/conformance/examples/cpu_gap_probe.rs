//! Experiment (issue 16): latency of a small dense decode call on 1 and 2 threads when the caller does
//! other work between calls (a busy gap, as a model's per-layer Python does), the two engines interleaved.
//! `cargo run --release --example cpu_gap_probe -- CONTEXT BATCH GAP_US` (Llama-8B shape, bf16, 8 layers'
//! caches rotated so a step does not run from the last-level cache). Prints the median call time of each.
use kvsparse_conformance::hostbuf::HostBuf;
use kvsparse::rng::Rng;
use kvsparse::{DType, Engine, EngineConfig, ForwardArgs, TensorRef};
use std::time::{Duration, Instant};

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let ctx: usize = argv.get(1).and_then(|s| s.parse().ok()).unwrap_or(2048);
    let batch: usize = argv.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let gap_us: u64 = argv.get(3).and_then(|s| s.parse().ok()).unwrap_or(100);
    let (hq, hk, d, bs, dt) = (32usize, 8usize, 128usize, 16usize, DType::BF16);
    let mut rng = Rng::new(1);
    let per_seq = ctx.div_ceil(bs);
    let nb = batch * per_seq;
    let row = hk * d;
    // Several layers' caches so the step does not run from L3.
    let layers = 8;
    let mut caches = Vec::new();
    for _ in 0..layers {
        let mut kc = HostBuf::zeros(dt, nb * bs * row);
        let mut vc = HostBuf::zeros(dt, nb * bs * row);
        for i in 0..kc.len() {
            kc.set(i, rng.normal());
            vc.set(i, rng.normal());
        }
        caches.push((kc, vc));
    }
    let ids: Vec<i32> = (0..nb as i32).collect();
    let mut q = HostBuf::zeros(dt, batch * hq * d);
    for i in 0..q.len() {
        q.set(i, rng.normal());
    }
    let seq_lens = vec![ctx as i32; batch];
    let qsl: Vec<i32> = (0..=batch as i32).collect();
    let mut out = HostBuf::nans(dt, batch * hq * d);
    let mk = |t: usize| {
        let mut c = EngineConfig::new(1, hq, hk, d, bs, dt);
        c.num_threads = t;
        Engine::new(c).unwrap()
    };
    let engines = [mk(1), mk(2)];
    let shape = [nb as i64, bs as i64, hk as i64, d as i64];
    let mut times = [Vec::new(), Vec::new()];
    for rep in 0..60 {
        for e in 0..2 {
            let which = if rep % 2 == 0 { e } else { 1 - e };
            for l in 0..layers {
                let (kc, vc) = &mut caches[l];
                let args = ForwardArgs {
                    layer: 0,
                    query: q.view_contiguous(&[batch as i64, hq as i64, d as i64]),
                    key_cache: kc.view_contiguous(&shape),
                    value_cache: vc.view_contiguous(&shape),
                    block_table: TensorRef::from_slice(&ids, &[batch as i64, per_seq as i64]),
                    seq_lens: TensorRef::from_slice(&seq_lens, &[batch as i64]),
                    query_start_loc: TensorRef::from_slice(&qsl, &[batch as i64 + 1]),
                    seq_ids: None,
                    out: out.view_contiguous(&[batch as i64, hq as i64, d as i64]),
                    lse: None,
                    scale: 0.088,
                    sliding_window: 0,
                    softcap: 0.0,
                    max_query_len: 1,
                    max_seq_len: ctx as i32,
                    stream: std::ptr::null_mut(),
                };
                let t = Instant::now();
                engines[which].attention_forward(&args).unwrap();
                times[which].push(t.elapsed().as_secs_f64() * 1e6);
                let g = Instant::now();
                while g.elapsed() < Duration::from_micros(gap_us) {
                    std::hint::spin_loop();
                }
            }
        }
    }
    for t in times.iter_mut() {
        t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    let med = |t: &Vec<f64>| t[t.len() / 2];
    println!(
        "ctx {ctx} batch {batch} gap {gap_us}us: 1 thread {:.0} us, 2 threads {:.0} us, speedup {:.2}",
        med(&times[0]),
        med(&times[1]),
        med(&times[0]) / med(&times[1])
    );
}
