//! `kvsparse bench --device cuda`: dense paged decode on CUDA device 0 over the grid, achieved
//! bandwidth (KV + q + out bytes per step) against the device-to-device copy bandwidth measured first in
//! the same process. One line per grid point; `--csv` also writes the rows for scripts/compare.py.

use std::io::Write;

use crate::cuda_bench::{bench_point, bench_sparse_point, copy_bandwidth, default_grid, drift_period, free_memory, kv_bytes, Point};

use crate::args::Args;

const HELP: &str = "kvsparse bench --device cuda [--batch 1,4,...] [--ctx 1024,...] [--heads 32/8,64/8]
                    [--max-kv-gib N] [--csv PATH] [--table-width TOKENS] [--cache-dtype bf16|fp8|fp8_e5m2]
                    [--cache-layout nhd|hnd] [--policy SPEC ... [--query-drift DEG]]

Times one dense decode step (query length 1, head 128, bf16, block 16, shuffled block tables) per grid
point with CUDA events (median of 15 groups of 10 steps, inputs rotated so that the set touched is at
least 4x the L2 cache) and prints achieved GB/s and its fraction of the measured copy bandwidth.
Points whose KV cache would exceed --max-kv-gib (default 40) or free memory are listed as skipped.
--table-width T times the step as a serving engine's CUDA graph runs it: block tables T tokens wide
(at least the context) and max_seq_len = 0, so the launch is planned for T keys per row, not the context.
--cache-dtype fp8 (or fp8_e4m3, fp8_e5m2) times dense decode over an FP8 cache (bf16 queries; random
finite FP8 bytes, fixed scales): GB/s counts the bytes the step reads, one per cache element. With
--policy, the policy and its dense baseline both read an FP8 cache (bf16 rows written through the cache
write, which quantizes them and keeps the key metadata).
--cache-layout hnd (dense only) stores each block head-major ([block][head][token][dim], a KV head's rows
contiguous, as FlashInfer's backends allocate it) instead of vLLM's NHD ([block][token][head][dim]).

With --policy (repeatable; `L/16` in a spec stands for the context length over 16 at each point), times
one sparse decode step per policy and point instead (default grid: batch 1,8,32 x context 16K,32K,128K,
heads 32/8): the step's cache write with the policy's metadata upkeep (one row appended per sequence,
as a decode step appends it; also timed rewriting a kept row), the selection kernels, the
attention over the plans, selection + attention in one call, blocks visited, our dense kernel on the
same cache, and the speedups; Quest's selection is also shown against the time to read its page bounds
at the measured copy bandwidth. SnapKV first chooses at a prefill chunk of its window's tokens per
sequence (queries: the decode query repeated); the choice kernels' time is printed below its row.
--query-drift DEG (with --policy): each sequence's decode query turns DEG degrees per step on a great
circle through its first query (the step-to-step cosine cos(DEG), a cycle of 360/DEG steps with no jump),
instead of repeating; what RefreshKV's similarity schedule reacts to.
PRR (`speculate(over=quest(...), ...)`) is timed against the serial `quest` path with the same budget,
page and sink on the same inputs, with the step's timeline on both streams printed below its row.

With --prefill, times causal prefill attention (one layer's call, head 128, bf16, block 16) at --points
BxQ[+P] (B sequences of Q new tokens after a cached prefix of P; default 1x4096,1x32768,8x4096,
1x2048+30720; --cache-dtype fp8 for an FP8 cache) on the prefill kernel and on the decode kernel that served prefill rows before it
(KVS_CUDA_PREFILL=decode; median of --old-reps calls, default 3, 0 = not timed), in TFLOP/s of the causal FLOPs.";

/// Replaces every `L/<n>` in a spec by `ctx / n`.
fn expand(spec: &str, ctx: usize) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = spec;
    while let Some(i) = rest.find("L/") {
        out.push_str(&rest[..i]);
        let tail = &rest[i + 2..];
        let n_end = tail.find(|c: char| !c.is_ascii_digit()).unwrap_or(tail.len());
        let n: usize = tail[..n_end].parse().map_err(|_| format!("{spec:?}: `L/` must be followed by a number"))?;
        if n == 0 {
            return Err(format!("{spec:?}: L/0"));
        }
        out.push_str(&(ctx / n).max(1).to_string());
        rest = &tail[n_end..];
    }
    out.push_str(rest);
    Ok(out)
}

/// `--cache-dtype`: the K/V caches' dtype (bf16 queries either way).
fn cache_dtype(a: &Args) -> Result<kvsparse::DType, String> {
    Ok(match a.str("cache-dtype").unwrap_or("bf16") {
        "bf16" | "auto" => kvsparse::DType::BF16,
        "fp8" | "fp8_e4m3" => kvsparse::DType::F8E4M3,
        "fp8_e5m2" => kvsparse::DType::F8E5M2,
        o => return Err(format!("--cache-dtype {o:?}: use bf16, fp8 (= fp8_e4m3) or fp8_e5m2")),
    })
}

fn run_sparse(a: &Args, policies: &[String]) -> Result<(), String> {
    let batches: Vec<usize> = list(a, "batch", &[1, 8, 32])?;
    let ctxs: Vec<usize> = list(a, "ctx", &[16384, 32768, 131072])?;
    let heads: Vec<String> = list(a, "heads", &["32/8".to_string()])?;
    let max_kv = (a.get("max-kv-gib", 40.0f64)? * (1u64 << 30) as f64) as usize;
    let cache = cache_dtype(a)?;
    let drift: f64 = a.get("query-drift", 0.0f64)?;
    if !(0.0..=90.0).contains(&drift) {
        return Err(format!("--query-drift {drift}: degrees per step, 0 to 90"));
    }
    let _gpu = kvsparse::cuda::context::Gpu::open(0).map_err(|e| e.to_string())?;
    let copy = copy_bandwidth().map_err(|e| e.to_string())?;
    println!("device-to-device copy: {:.0} GB/s (read + write, 1 GiB, median of 20)", copy);
    if drift > 0.0 {
        println!("decode queries drift {drift} degrees per step (each query row turns on a great circle, cycle of {} steps)", drift_period(drift));
    }
    if cache != kvsparse::DType::BF16 {
        println!("cache {} (bf16 queries; the policy and its dense baseline both read it), one byte per K/V element", cache.name());
    }
    let mut csv = match a.str("csv") {
        Some(p) => Some(std::fs::File::create(p).map_err(|e| format!("{p}: {e}"))?),
        None => None,
    };
    if let Some(f) = csv.as_mut() {
        writeln!(f, "policy,batch,ctx,hq,hk,write_us,write_dense_us,select_us,attend_us,forward_us,dense_us,visited,top_p_kept,bound_bytes,bound_floor_us,copy_gbps,rotation,prefill_choice_us,prr_serial_us,prr_spec_hit,prr_timeline,prr_graph_us,prr_serial_graph_us,write_rewrite_us").map_err(|e| e.to_string())?;
    }
    println!(
        "{:<40} {:>5} {:>7} {:>6} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>7} {:>8} {:>8}",
        "policy", "batch", "ctx", "heads", "write", "select", "attend", "sel+att", "dense", "visited", "x dense", "sel/flr", "step x"
    );
    for pol in policies {
        for h in &heads {
            let (hq, hk) = h.split_once('/').ok_or_else(|| format!("--heads wants Q/KV pairs like 32/8, got {h:?}"))?;
            let (hq, hk): (usize, usize) = (hq.parse().map_err(|_| "bad --heads")?, hk.parse().map_err(|_| "bad --heads")?);
            for &b in &batches {
                for &c in &ctxs {
                    let p = Point { batch: b, ctx: c, hq, hk };
                    let spec = expand(pol, c)?;
                    let kv = kv_bytes(&p);
                    let free = free_memory().unwrap_or(0);
                    if kv > max_kv || 2 * kv + (4 << 30) > free {
                        println!("{spec:<40} {b:>5} {c:>7} {hq:>3}/{hk:<2} skipped: {:.1} GiB of KV (limit {:.1}, free {:.1})", kv as f64 / (1u64 << 30) as f64, max_kv as f64 / (1u64 << 30) as f64, free as f64 / (1u64 << 30) as f64);
                        continue;
                    }
                    let r = bench_sparse_point(&p, &spec, 50 << 20, max_kv, 4321 + b as u64 * 7 + c as u64, cache, drift).map_err(|e| format!("{spec} at {p:?}: {e}"))?;
                    let floor_us = r.bound_bytes / (copy * 1e9) * 1e6; // the bounds' bytes at the copy's bytes/s
                    let sel_floor = if floor_us > 0.0 { format!("{:.2}", r.select_us / floor_us) } else { "-".into() };
                    let step_x = (r.write_dense_us + r.dense_us) / (r.write_us + r.forward_us);
                    println!(
                        "{spec:<40} {b:>5} {c:>7} {hq:>3}/{hk:<2} {:>8.1} {:>8.1} {:>8.1} {:>9.1} {:>9.1} {:>7.1}% {:>7.2} {:>8} {:>8.2}",
                        r.write_us,
                        r.select_us,
                        r.attend_us,
                        r.forward_us,
                        r.dense_us,
                        100.0 * r.visited,
                        r.dense_us / r.forward_us,
                        sel_floor,
                        step_x
                    );
                    if r.refresh_full.is_finite() {
                        // The predictor counts its calibration steps as the full ones (`refresh::FULL_STEPS`).
                        let (who, kind) = if spec.starts_with("predictor") { ("AttentionPredictor", "calibration") } else { ("RefreshKV", "full") };
                        println!("{:<40} {who}: mean of {} consecutive steps {:.1} us ({:.2}x dense), {:.1}% of them {kind}", "", r.mean_steps, r.step_mean_us, r.dense_us / r.step_mean_us, 100.0 * r.refresh_full);
                    }
                    if r.serial_us.is_finite() {
                        println!("{:<40} PRR step {:.1} us vs serial quest (select, then attend) {:.1} us: {:.2}x; speculation hit {:.1}% of true pages", "", r.forward_us, r.serial_us, r.serial_us / r.forward_us, 100.0 * r.spec_hit);
                        let tl: Vec<String> = r.timeline.iter().map(|(n, us)| format!("{n} {us:.1}")).collect();
                        println!("{:<40} timeline, phase ends in us after the fork (one step, median of 30): {}", "", tl.join(", "));
                        println!("{:<40} CUDA graphs (GPU time, no launch cost): PRR {:.1} us vs serial quest {:.1} us: {:.2}x", "", r.graph_us, r.serial_graph_us, r.serial_graph_us / r.graph_us);
                        match &r.graph_timeline {
                            Ok(t) => println!("{:<40} timeline of a replayed graph step (us after the fork): {}", "", t.iter().map(|(n, us)| format!("{n} {us:.1}")).collect::<Vec<_>>().join(", ")),
                            Err(e) => println!("{:<40} timeline of a replayed graph step: not available ({e})", ""),
                        }
                    }
                    if r.pred_parts_us[0].is_finite() {
                        let [cnn, sel, hist] = r.pred_parts_us;
                        println!("{:<40} predictor parts: schedule + CNN {cnn:.1} us, selection {sel:.1} us, history row {hist:.1} us", "");
                    }
                    println!("{:<40} write: {:.1} us appending (the step's row in the next slot, \"write\" above), {:.1} us rewriting a kept row; dense engine {:.1} us", "", r.write_us, r.write_rewrite_us, r.write_dense_us);
                    if r.choice_us.is_finite() {
                        println!("{:<40} SnapKV's choice at the prefill chunk (window tokens per sequence): {:.1} us", "", r.choice_us);
                    }
                    if let Some(f) = csv.as_mut() {
                        writeln!(
                            f,
                            "\"{spec}\",{b},{c},{hq},{hk},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.5},{:.5},{:.0},{:.3},{:.1},{},{:.3},{:.3},{:.5},\"{}\",{:.3},{:.3},{:.3}",
                            r.write_us, r.write_dense_us, r.select_us, r.attend_us, r.forward_us, r.dense_us, r.visited, r.top_p_kept, r.bound_bytes, floor_us, copy, r.rotation, r.choice_us, r.serial_us, r.spec_hit,
                            r.timeline.iter().map(|(n, us)| format!("{n}={us:.2}")).collect::<Vec<_>>().join(";"),
                            r.graph_us,
                            r.serial_graph_us,
                            r.write_rewrite_us
                        )
                        .map_err(|e| e.to_string())?;
                    }
                }
            }
        }
    }
    Ok(())
}

pub fn run(argv: &[String]) -> Result<(), String> {
    let a = Args::parse(argv, &["device", "batch", "ctx", "heads", "max-kv-gib", "csv", "policy", "table-width", "points", "old-reps", "cache-dtype", "cache-layout", "query-drift"], &["prefill"], HELP)?;
    if a.str("device") != Some("cuda") {
        return Err(format!("this module serves --device cuda only\n\n{HELP}"));
    }
    if !kvsparse::cuda::device_available() {
        return Err("no CUDA driver/device available".into());
    }
    if a.flag("prefill") {
        return run_prefill(&a);
    }
    let policies = crate::args::policies(&a)?;
    if !policies.is_empty() {
        return run_sparse(&a, &policies);
    }
    if a.str("query-drift").is_some() {
        return Err("--query-drift needs --policy (dense attention reads every key whatever the query)".into());
    }
    let full = default_grid();
    let batches: Vec<usize> = list(&a, "batch", &[1, 4, 16, 32, 64, 128])?;
    let ctxs: Vec<usize> = list(&a, "ctx", &[1024, 4096, 16384, 32768, 131072])?;
    let heads: Vec<String> = list(&a, "heads", &["32/8".to_string(), "64/8".to_string()])?;
    let max_kv = (a.get("max-kv-gib", 40.0f64)? * (1u64 << 30) as f64) as usize;
    let table_width: usize = a.get("table-width", 0usize)?;
    let cache = cache_dtype(&a)?;
    let hnd = match a.str("cache-layout").unwrap_or("nhd") {
        "nhd" => false,
        "hnd" => true,
        o => return Err(format!("--cache-layout {o:?}: use nhd (vLLM's FLASH_ATTN layout) or hnd (FlashInfer's)")),
    };
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
    if cache != kvsparse::DType::BF16 {
        println!("cache {} (bf16 queries), one byte per K/V element", cache.name());
    }
    if hnd {
        println!("cache layout HND: a block's rows of one KV head are contiguous ([block][head][token][dim])");
    }
    if table_width > 0 {
        println!("block tables {table_width} tokens wide, max_seq_len = 0 (as a captured CUDA graph plans)");
    }
    println!("{:>5} {:>7} {:>6} {:>10} {:>9} {:>6}  {:>4}", "batch", "ctx", "heads", "time_us", "GB/s", "copy%", "rot");
    for (i, p) in grid.iter().enumerate() {
        let kv = kv_bytes(p) / 2 * cache.size_bytes();
        let free = free_memory().unwrap_or(0);
        if kv > max_kv || kv + (2 << 30) > free {
            println!("{:>5} {:>7} {:>3}/{:<2} skipped: {:.1} GiB of KV (limit {:.1}, free {:.1})", p.batch, p.ctx, p.hq, p.hk, kv as f64 / (1u64 << 30) as f64, max_kv as f64 / (1u64 << 30) as f64, free as f64 / (1u64 << 30) as f64);
            continue;
        }
        let r = bench_point(p, copy, l2, 1234 + i as u64, table_width, cache, hnd).map_err(|e| format!("point {p:?}: {e}"))?;
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

/// `--prefill`: the prefill kernel against the decode kernel on prefill rows, per point.
fn run_prefill(a: &Args) -> Result<(), String> {
    use crate::cuda_prefill_bench::{bench_prefill_point, PrefillPoint};
    let points: Vec<String> = list(a, "points", &["1x4096".to_string(), "1x32768".into(), "8x4096".into(), "1x2048+30720".into()])?;
    let heads: Vec<String> = list(a, "heads", &["32/8".to_string()])?;
    let old_reps: usize = a.get("old-reps", 3)?;
    let cache = cache_dtype(a)?;
    let _gpu = kvsparse::cuda::context::Gpu::open(0).map_err(|e| e.to_string())?;
    if cache != kvsparse::DType::BF16 {
        println!("cache {} (bf16 queries; random finite FP8 bytes, fixed scales)", cache.name());
    }
    let mut csv = match a.str("csv") {
        Some(p) => Some(std::fs::File::create(p).map_err(|e| format!("{p}: {e}"))?),
        None => None,
    };
    if let Some(f) = csv.as_mut() {
        writeln!(f, "point,hq,hk,tflop,prefill_ms,prefill_tflops,decode_kernel_ms,decode_kernel_tflops,speedup,max_rel_diff").map_err(|e| e.to_string())?;
    }
    println!("{:<14} {:>6} {:>8} {:>11} {:>9} {:>12} {:>9} {:>8} {:>10}", "point", "heads", "TFLOP", "prefill ms", "TFLOP/s", "decode-k ms", "TFLOP/s", "speedup", "max diff");
    for h in &heads {
        let (hq, hk) = h.split_once('/').ok_or_else(|| format!("--heads wants Q/KV pairs like 32/8, got {h:?}"))?;
        let (hq, hk): (usize, usize) = (hq.parse().map_err(|_| "bad --heads")?, hk.parse().map_err(|_| "bad --heads")?);
        for (i, s) in points.iter().enumerate() {
            let p = PrefillPoint::parse(s)?;
            let fl = p.flops(hq);
            let r = bench_prefill_point(&p, hq, hk, old_reps, 0x5eed + i as u64, cache).map_err(|e| format!("{s}: {e}"))?;
            let (tn, to) = (fl / (r.new_ms * 1e-3) / 1e12, fl / (r.old_ms * 1e-3) / 1e12);
            println!("{s:<14} {hq:>3}/{hk:<2} {:>8.2} {:>11.3} {tn:>9.1} {:>12.3} {to:>9.1} {:>7.1}x {:>10.2e}", fl / 1e12, r.new_ms, r.old_ms, r.old_ms / r.new_ms, r.diff);
            if let Some(f) = csv.as_mut() {
                writeln!(f, "{s},{hq},{hk},{:.4},{:.4},{tn:.2},{:.4},{to:.2},{:.3},{:.3e}", fl / 1e12, r.new_ms, r.old_ms, r.old_ms / r.new_ms, r.diff).map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(())
}
