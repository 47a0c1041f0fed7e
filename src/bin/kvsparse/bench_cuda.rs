//! `kvsparse bench --device cuda`: dense paged decode on CUDA device 0 over the grid, achieved
//! bandwidth (KV + q + out bytes per step) against the device-to-device copy bandwidth measured first in
//! the same process. One line per grid point; `--csv` also writes the rows for scripts/compare.py.

use std::io::Write;

use kvsparse::cuda::bench::{bench_point, copy_bandwidth, default_grid, free_memory, kv_bytes, Point};

use crate::args::Args;

const HELP: &str = "kvsparse bench --device cuda [--batch 1,4,...] [--ctx 1024,...] [--heads 32/8,64/8]
                    [--max-kv-gib N] [--csv PATH]

Times one dense decode step (query length 1, head 128, bf16, block 16, shuffled block tables) per grid
point with CUDA events (median of 15 groups of 10 steps, inputs rotated so that the set touched is at
least 4x the L2 cache) and prints achieved GB/s and its fraction of the measured copy bandwidth.
Points whose KV cache would exceed --max-kv-gib (default 40) or free memory are listed as skipped.";

pub fn run(argv: &[String]) -> Result<(), String> {
    let a = Args::parse(argv, &["device", "batch", "ctx", "heads", "max-kv-gib", "csv"], &[], HELP)?;
    if a.str("device") != Some("cuda") {
        return Err(format!("this module serves --device cuda only\n\n{HELP}"));
    }
    if !kvsparse::cuda::device_available() {
        return Err("no CUDA driver/device available".into());
    }
    let full = default_grid();
    let batches: Vec<usize> = list(&a, "batch", &[1, 4, 16, 32, 64, 128])?;
    let ctxs: Vec<usize> = list(&a, "ctx", &[1024, 4096, 16384, 32768, 131072])?;
    let heads: Vec<String> = list(&a, "heads", &["32/8".to_string(), "64/8".to_string()])?;
    let max_kv = (a.get("max-kv-gib", 40.0f64)? * (1u64 << 30) as f64) as usize;
    let mut grid: Vec<Point> = Vec::new();
    for h in &heads {
        let (hq, hk) = h.split_once('/').ok_or_else(|| format!("--heads wants Q/KV pairs like 32/8, got {h:?}"))?;
        let (hq, hk): (usize, usize) = (hq.parse().map_err(|_| "bad --heads")?, hk.parse().map_err(|_| "bad --heads")?);
        for &b in &batches {
            for &c in &ctxs {
                grid.push(Point { batch: b, ctx: c, hq, hk });
            }
        }
    }
    if grid.is_empty() {
        grid = full;
    }
    // Keep the primary context alive (and current) for the whole run, between the per-point engines.
    let _gpu = kvsparse::cuda::context::Gpu::open(0).map_err(|e| e.to_string())?;
    let copy = copy_bandwidth().map_err(|e| e.to_string())?;
    println!("device-to-device copy: {:.0} GB/s (read + write, 1 GiB, median of 20)", copy);
    let l2 = 50 << 20;
    let mut csv = match a.str("csv") {
        Some(p) => Some(std::fs::File::create(p).map_err(|e| format!("{p}: {e}"))?),
        None => None,
    };
    if let Some(f) = csv.as_mut() {
        writeln!(f, "batch,ctx,hq,hk,us,bytes,gbps,frac_copy,copy_gbps,rotation").map_err(|e| e.to_string())?;
    }
    println!("{:>5} {:>7} {:>6} {:>10} {:>9} {:>6}  {:>4}", "batch", "ctx", "heads", "time_us", "GB/s", "copy%", "rot");
    for (i, p) in grid.iter().enumerate() {
        let kv = kv_bytes(p);
        let free = free_memory().unwrap_or(0);
        if kv > max_kv || kv + (2 << 30) > free {
            println!("{:>5} {:>7} {:>3}/{:<2} skipped: {:.1} GiB of KV (limit {:.1}, free {:.1})", p.batch, p.ctx, p.hq, p.hk, kv as f64 / (1u64 << 30) as f64, max_kv as f64 / (1u64 << 30) as f64, free as f64 / (1u64 << 30) as f64);
            continue;
        }
        let r = bench_point(p, copy, l2, 1234 + i as u64).map_err(|e| format!("point {p:?}: {e}"))?;
        println!("{:>5} {:>7} {:>3}/{:<2} {:>10.1} {:>9.0} {:>5.1}%  {:>4}", p.batch, p.ctx, p.hq, p.hk, r.us, r.gbps, 100.0 * r.frac_copy, r.rotation);
        if let Some(f) = csv.as_mut() {
            writeln!(f, "{},{},{},{},{:.3},{:.0},{:.1},{:.4},{:.1},{}", p.batch, p.ctx, p.hq, p.hk, r.us, r.bytes, r.gbps, r.frac_copy, copy, r.rotation).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// A comma-separated option, e.g. `--batch 1,8,32`, or `default`.
fn list<T: std::str::FromStr + Clone>(a: &Args, name: &str, default: &[T]) -> Result<Vec<T>, String> {
    match a.str(name) {
        None => Ok(default.to_vec()),
        Some(s) => s.split(',').map(|x| x.trim().parse().map_err(|_| format!("--{name}: cannot parse {x:?}"))).collect(),
    }
}
