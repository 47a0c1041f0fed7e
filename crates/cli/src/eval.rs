//! `kvsparse eval`: replays every decode step of the real attention traces (traces/, docs/traces.md)
//! through the engine for dense and each policy, and prints one table: blocks visited, output error vs
//! dense (median, p99 over layer × step × query head), attention mass recovered, time, and each stateful
//! policy's own figures. `--out DIR` adds a sweep of every policy family's main knob and writes the
//! numbers as CSV plus a PNG of error against blocks visited.

use std::path::{Path, PathBuf};
use std::time::Instant;

use kvsparse_conformance::reference::rel_err;
use kvsparse_conformance::eval::{mean, quantile, recovered_mass, row_errors};
use kvsparse::policy::{refresh, speculate, top_p, Policy};
use kvsparse::stats::Counters;
use kvsparse_conformance::traces::{replay, Manifest, Replay, ReplayOptions, Trace};

use crate::args::{dtype, policies, Args};
use crate::plot;

const HELP: &str = "usage: kvsparse eval [options]

Replays every decode step of the recorded attention traces of a real model through the engine, for dense
attention and each policy, and prints per policy: blocks visited (% of eligible), relative output error vs
dense per row (median, p99; a row = layer x step x query head), attention mass recovered (true softmax
weight on the positions attended: mean and 1st percentile), time per decode call, and the policy's own
figures (top-p kept, ART skipped, PRR hit rate vs reusing the previous selection, refresh/calibration steps).

options:
  --traces DIR     trace directory with manifest.json (default: ./traces, else the crate's traces/)
  --policy SPEC    policy spec (docs/policies.md); repeat for several (default: one setting of every
                   policy family at --budget). `{N/k}` in a spec stands for ceil(prompt tokens / k) of
                   each trace, e.g. Twilight's recipe `quest(budget={N/4}) > top_p(p=0.95)`
  --budget N       token budget of the default settings (default 512)
  --only NAME      replay only this trace (repeatable), e.g. --only needle_8k
  --stride N       attend every N-th decode step only (cache writes still every step; default 1)
  --dtype T        engine dtype: f32, f16 or bf16 (default f32; the traces are f16, so f32 is exact; with
                   --device cuda and an FP8 --cache-dtype the default is bf16, and f32 is refused)
  --cache-dtype C  fp8 (= fp8_e4m3) or fp8_e5m2: an FP8 cache under --dtype queries, the traces' K/V
                   quantized on write with k_scale = v_scale = --kv-scale (default 1, vLLM's uncalibrated
                   scale); every row is then measured against dense over that FP8 cache, and one more line
                   gives dense over the FP8 cache against dense over a --dtype cache
  --threads N      engine worker threads, 0 = all cores (default 0)
  --device D       cpu (default) or cuda: replay through the CUDA engine (policies it does not run yet,
                   over the --cache-dtype given, are listed and left out; ms/call then includes the
                   copies to and from the device)
  --out DIR        also sweep each family's main knob, write DIR/eval.csv and DIR/eval.png";

/// A policy family and its main knob, swept for the plot.
struct Family {
    name: &'static str,
    knob: &'static str,
    values: &'static [f64],
    spec: fn(f64) -> String,
}

fn families() -> Vec<Family> {
    vec![
        Family { name: "streaming", knob: "recent", values: &[128.0, 256.0, 512.0, 1024.0, 2048.0], spec: |v| format!("streaming(sink=64, recent={v})") },
        Family { name: "quest", knob: "budget", values: &[64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0], spec: |v| format!("quest(budget={v})") },
        Family { name: "quest sink=16", knob: "budget", values: &[64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0], spec: |v| format!("quest(budget={v}, sink=16)") },
        Family { name: "quest > top_p", knob: "p", values: &[0.8, 0.9, 0.95, 0.99], spec: |v| format!("quest(budget=1024) > top_p(p={v})") },
        Family { name: "quest(N/4) > top_p", knob: "p", values: &[0.8, 0.9, 0.95, 0.99], spec: |v| format!("quest(budget={{N/4}}) > top_p(p={v})") },
        Family { name: "quest > art(priority)", knob: "tau", values: &[0.3, 0.1, 0.03, 0.01, 0.003], spec: |v| format!("quest(budget=2048) > art(tau={v}, phi=1e-2, patience=5, order=priority)") },
        Family { name: "art", knob: "tau", values: &[1e-6, 1e-5, 1e-4, 1e-3, 1e-2], spec: |v| format!("art(tau={v:e}, phi=1e-3, patience=5)") },
        Family { name: "streaming > art", knob: "tau", values: &[1e-6, 1e-5, 1e-4, 1e-3, 1e-2], spec: |v| format!("streaming(sink=64, recent=448) > art(tau={v:e}, phi=1e-3, patience=5)") },
        Family { name: "snapkv > art", knob: "tau", values: &[1e-6, 1e-5, 1e-4, 1e-3, 1e-2], spec: |v| format!("snapkv(budget=512) > art(tau={v:e}, phi=1e-3, patience=5)") },
        Family { name: "snapkv", knob: "budget", values: &[128.0, 256.0, 512.0, 1024.0, 2048.0], spec: |v| format!("snapkv(budget={v})") },
        Family { name: "speculate (PRR)", knob: "budget", values: &[128.0, 256.0, 512.0, 1024.0], spec: |v| format!("speculate(over=quest(budget={v}), budget={})", 2.0 * v) },
        Family { name: "refresh", knob: "k", values: &[128.0, 256.0, 512.0, 1024.0, 2048.0], spec: |v| format!("refresh(k={v}, stride=5, s=0.85)") },
        Family { name: "predictor", knob: "budget", values: &[256.0, 512.0, 1024.0, 2048.0], spec: |v| format!("predictor(budget={v})") },
    ]
}

/// The default table: one setting of every policy the engine has, at a token budget `b`.
fn default_policies(b: usize) -> Vec<String> {
    vec![
        format!("streaming(sink=64, recent={})", b.saturating_sub(64).max(1)),
        format!("quest(budget={b})"),
        format!("quest(budget={b}, sink=16)"),
        "top_p(p=0.95)".to_string(),
        format!("quest(budget={b}) > top_p(p=0.95)"),
        "quest(budget={N/4})".to_string(),
        "quest(budget={N/4}) > top_p(p=0.95)".to_string(),
        // ART at the paper's defaults and its tau sweep (Appendix F), alone and behind streaming/snapkv.
        "art(tau=1e-6, phi=1e-3, patience=5)".to_string(),
        "art(tau=1e-5, phi=1e-3, patience=5)".to_string(),
        "art(tau=1e-4, phi=1e-3, patience=5)".to_string(),
        format!("streaming(sink=64, recent={}) > art(tau=1e-5, phi=1e-3, patience=5)", b.saturating_sub(64).max(1)),
        format!("streaming(sink=64, recent={}) > art(tau=1e-4, phi=1e-3, patience=5)", b.saturating_sub(64).max(1)),
        format!("snapkv(budget={b}) > art(tau=1e-5, phi=1e-3, patience=5)"),
        format!("snapkv(budget={b}) > art(tau=1e-4, phi=1e-3, patience=5)"),
        format!("quest(budget={}) > art(tau=1e-5, phi=1e-3, patience=5)", 4 * b),
        // The old loosened setting, for comparison with the earlier table.
        "art(tau=0.05, phi=1e-2, patience=5)".to_string(),
        format!("snapkv(budget={b})"),
        format!("speculate(over=quest(budget={b}), budget={b})"),
        format!("speculate(over=quest(budget={b}), budget={})", 2 * b),
        format!("refresh(k={b}, stride=5, s=0.85)"),
        format!("predictor(budget={b})"),
    ]
}

/// Everything measured for one policy on one trace (or pooled over traces).
#[derive(Default, Clone)]
pub struct Measure {
    pub counters: Counters,
    pub errs: Vec<f64>,
    pub mass: Vec<f64>,
    pub forward_s: f64,
    /// ART: tiles visited and tiles of the whole traversals, summed over rows.
    pub art_tiles: (u64, u64),
    /// ART: the probe's stop decisions against the oracle's (`probe=full`), when measured.
    pub oracle: Option<OracleCheck>,
}

/// The ART paper's probe–oracle consistency (Appendix B): per (layer, step, KV head), the tile the probe
/// stopped at against the tile the oracle (the same rule on the whole output) stopped at, on the same
/// traversal. Agree: same tile, or neither stopped. False stop (FP): the probe stopped earlier, or
/// stopped where the oracle never did. Missed stop (FN): the other way round. Offsets in tiles, among
/// disagreements where both stopped.
#[derive(Default, Clone)]
pub struct OracleCheck {
    pub n: u64,
    pub agree: u64,
    pub false_stops: u64,
    pub missed_stops: u64,
    pub offsets: Vec<f64>,
}

impl OracleCheck {
    fn compare(probe: &Replay, oracle: &Replay) -> OracleCheck {
        let mut c = OracleCheck::default();
        for (p, o) in probe.art_tiles.iter().zip(&oracle.art_tiles) {
            let (Some((pv, total)), Some((ov, ot))) = (*p, *o) else { continue };
            debug_assert_eq!(total, ot, "same traversal");
            c.n += 1;
            let (ps, os) = (pv < total, ov < ot);
            if pv == ov || (!ps && !os) {
                c.agree += 1;
            } else if pv < ov {
                c.false_stops += 1;
            } else {
                c.missed_stops += 1;
            }
            if ps && os && pv != ov {
                c.offsets.push((pv as f64 - ov as f64).abs());
            }
        }
        c
    }

    fn add(&mut self, o: &OracleCheck) {
        self.n += o.n;
        self.agree += o.agree;
        self.false_stops += o.false_stops;
        self.missed_stops += o.missed_stops;
        self.offsets.extend_from_slice(&o.offsets);
    }

    fn describe(&self) -> String {
        let pct = |a: u64| 100.0 * a as f64 / self.n.max(1) as f64;
        let mut s = format!("probe vs oracle: agree {:.2}%, false stops {:.2}%, missed stops {:.2}% (n={})", pct(self.agree), pct(self.false_stops), pct(self.missed_stops), self.n);
        if !self.offsets.is_empty() {
            let m = mean(&self.offsets);
            let sd = (self.offsets.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / self.offsets.len() as f64).sqrt();
            s += &format!(", Δtiles {m:.2}±{sd:.2}");
        }
        s
    }
}

impl Measure {
    fn add(&mut self, o: &Measure) {
        self.counters.add(&o.counters);
        self.errs.extend_from_slice(&o.errs);
        self.mass.extend_from_slice(&o.mass);
        self.forward_s += o.forward_s;
        self.art_tiles.0 += o.art_tiles.0;
        self.art_tiles.1 += o.art_tiles.1;
        if let Some(oc) = &o.oracle {
            self.oracle.get_or_insert_with(OracleCheck::default).add(oc);
        }
    }

    pub fn visited_pct(&self) -> f64 {
        100.0 * self.counters.visited_fraction()
    }

    fn ms_per_call(&self) -> f64 {
        1e3 * self.forward_s / self.counters.calls.max(1) as f64
    }

    /// The policy's own figures, as one short text (empty for stateless selectors).
    fn notes(&self) -> String {
        let c = &self.counters;
        let pct = |a: u64, b: u64| 100.0 * a as f64 / b.max(1) as f64;
        let mut n = Vec::new();
        if c[top_p::CANDIDATES] > 0 {
            n.push(format!("top-p kept {:.1}%", pct(c[top_p::KEPT], c[top_p::CANDIDATES])));
        }
        if self.art_tiles.1 > 0 {
            n.push(format!(
                "ART skipped {:.1}% of blocks, {:.1}% of tiles",
                pct(c.blocks_skipped_termination, c.blocks_eligible),
                pct(self.art_tiles.1 - self.art_tiles.0, self.art_tiles.1)
            ));
        } else if c.blocks_skipped_termination > 0 {
            n.push(format!("ART skipped {:.1}%", pct(c.blocks_skipped_termination, c.blocks_eligible)));
        }
        if let Some(oc) = &self.oracle {
            n.push(oc.describe());
        }
        if c[speculate::TRUE_BLOCKS] > 0 {
            n.push(format!(
                "PRR hit {:.3} (reuse-prev {:.3}), {:.2} repaired/row",
                c[speculate::HIT_BLOCKS] as f64 / c[speculate::TRUE_BLOCKS] as f64,
                c[speculate::REUSE_HIT_BLOCKS] as f64 / c[speculate::TRUE_BLOCKS] as f64,
                c[speculate::REPAIRED_BLOCKS] as f64 / c.policy_rows.max(1) as f64
            ));
        }
        let steps = c[refresh::FULL_STEPS] + c[refresh::PARTIAL_STEPS];
        if steps > 0 {
            n.push(format!("full steps {}/{} (every {:.1})", c[refresh::FULL_STEPS], steps, steps as f64 / c[refresh::FULL_STEPS].max(1) as f64));
        }
        n.join("; ")
    }
}

/// One evaluated policy setting: per trace and pooled.
pub struct Row {
    /// ART rows with the paper's probe: the same spec with `probe=full`, replayed for the oracle check.
    pub oracle_spec: Option<String>,
    /// Printed in the table (dense and the `--policy`/default settings) or only swept for the plot.
    pub in_table: bool,
    pub spec: String,
    pub family: String,
    pub knob: String,
    pub value: f64,
    pub per_trace: Vec<(String, Measure)>,
    pub pooled: Measure,
}

pub fn run(argv: &[String]) -> Result<(), String> {
    let a = Args::parse(argv, &["traces", "policy", "budget", "only", "stride", "dtype", "threads", "out", "device", "cache-dtype", "kv-scale"], &[], HELP)?;
    let device = match a.str("device").unwrap_or("cpu") {
        "cpu" => kvsparse::Device::Cpu,
        "cuda" => {
            if !kvsparse::cuda::device_available() {
                return Err("--device cuda: no CUDA driver/device available".into());
            }
            kvsparse::Device::Cuda(0)
        }
        other => return Err(format!("--device {other:?}: expected cpu or cuda")),
    };
    let dir = match a.str("traces") {
        Some(d) => PathBuf::from(d),
        None if Path::new("traces/manifest.json").exists() => PathBuf::from("traces"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces"),
    };
    let manifest = Manifest::load(&dir)?;
    let only = a.values_of("only");
    for o in &only {
        if !manifest.traces.iter().any(|t| &t.name == o) {
            return Err(format!("--only {o:?}: no such trace in {} ({})", dir.display(), names(&manifest)));
        }
    }
    let budget: usize = a.get("budget", 512)?;
    if budget == 0 {
        return Err("--budget must be >= 1".into());
    }
    let cache_dtype = match a.str("cache-dtype") {
        None | Some("auto") => None,
        Some("fp8") | Some("fp8_e4m3") => Some(kvsparse::DType::F8E4M3),
        Some("fp8_e5m2") => Some(kvsparse::DType::F8E5M2),
        Some(o) => return Err(format!("--cache-dtype {o:?}: expected fp8, fp8_e4m3 or fp8_e5m2")),
    };
    // The CUDA engine reads FP8 caches under 16-bit queries only: bf16 unless --dtype says f16.
    let fp8_on_cuda = cache_dtype.is_some() && matches!(device, kvsparse::Device::Cuda(_));
    let engine_dtype = match a.str("dtype") {
        Some(t) => dtype(t)?,
        None if fp8_on_cuda => kvsparse::DType::BF16,
        None => kvsparse::DType::F32,
    };
    if fp8_on_cuda && engine_dtype == kvsparse::DType::F32 {
        return Err("--device cuda with an FP8 --cache-dtype needs --dtype f16 or bf16 (the CUDA engine reads FP8 caches under 16-bit queries)".into());
    }
    let opts = ReplayOptions {
        dtype: engine_dtype,
        step_stride: a.get("stride", 1)?,
        threads: a.get("threads", 0)?,
        record_visits: true,
        device,
        cache_dtype,
        kv_scales: {
            let s: f32 = a.get("kv-scale", 1.0f32)?;
            (s, s)
        },
        ..Default::default()
    };
    if opts.step_stride == 0 {
        return Err("--stride must be >= 1".into());
    }
    let out_dir = a.str("out").map(PathBuf::from);

    // The table's settings, then (with --out) the sweep's; every spec is checked before any replay.
    let user = policies(&a)?;
    let table_specs = if user.is_empty() { default_policies(budget) } else { user };
    let row = |in_table: bool, spec: String, family: &str, knob: &str, value: f64| Row { oracle_spec: oracle_spec(&spec), in_table, spec, family: family.to_string(), knob: knob.to_string(), value, per_trace: Vec::new(), pooled: Measure::default() };
    // rows[0] is dense, the reference of every other row.
    let mut rows = vec![row(true, "dense".into(), "dense", "", f64::NAN)];
    rows.extend(table_specs.iter().map(|s| row(true, s.clone(), s, "", f64::NAN)));
    if out_dir.is_some() {
        for f in families() {
            rows.extend(f.values.iter().map(|&v| row(false, (f.spec)(v), f.name, f.knob, v)));
        }
    }
    for r in &rows {
        Policy::parse(&expand(&r.spec, 1024)?).map_err(|e| e.message)?;
    }
    if matches!(device, kvsparse::Device::Cuda(_)) {
        let group = manifest.num_q_heads / manifest.num_kv_heads.max(1);
        let (keep, skip): (Vec<Row>, Vec<Row>) = rows.into_iter().partition(|r| {
            expand(&r.spec, 1024).ok().and_then(|s| Policy::parse(&s).ok()).map_or(true, |p| {
                p.supported_on(device, group).is_ok() && (opts.cache_dtype.is_none() || p.cuda_fp8_cache().is_ok())
            })
        });
        if !skip.is_empty() {
            println!("not on the CUDA backend yet, left out: {}", skip.iter().map(|r| r.spec.as_str()).collect::<Vec<_>>().join(", "));
        }
        rows = keep;
        // The oracle (probe=full) is a CPU measure; the CUDA engine runs the lane probe only.
        for r in rows.iter_mut() {
            r.oracle_spec = None;
        }
    }

    let traces: Vec<_> = manifest.traces.iter().filter(|t| only.is_empty() || only.contains(&t.name)).collect();
    println!(
        "kvsparse eval: {} ({} query / {} KV heads, head {}), traces {} in {}",
        manifest.model,
        manifest.num_q_heads,
        manifest.num_kv_heads,
        manifest.head_dim,
        traces.iter().map(|t| format!("{} ({}+{} tokens, layers {:?})", t.name, t.prompt_len, t.decode_steps, t.layers)).collect::<Vec<_>>().join(", "),
        dir.display()
    );
    // A setting in both the table and the sweep (e.g. `quest(budget=512)`) is replayed once and both rows
    // share that measurement, time included.
    let (specs, replay_of) = distinct_specs(&rows);
    let table_rows = rows.iter().filter(|r| r.in_table).count();
    let sweep_rows = rows.len() - table_rows;
    let shared = rows.iter().filter(|r| !r.in_table && rows.iter().any(|t| t.in_table && t.spec == r.spec)).count();
    let oracles = rows.iter().filter(|r| r.in_table && r.oracle_spec.is_some()).count();
    println!("engine dtype {:?}, blocks of {}, step stride {}", opts.dtype, kvsparse_conformance::traces::BLOCK_SIZE, opts.step_stride);
    if let Some(c) = opts.cache_dtype {
        println!("cache {} (k_scale = v_scale = {}): every row below is measured against dense over this cache", c.name(), opts.kv_scales.0);
    }
    println!(
        "{table_rows} table rows (dense + {} policy settings){}; replays per trace: {} (one per distinct spec){}",
        table_rows - 1,
        if sweep_rows > 0 { format!(", {sweep_rows} sweep settings for the plot ({shared} also in the table: one replay, one measurement)") } else { String::new() },
        specs.len(),
        if oracles > 0 { format!(" + {oracles} ART oracle (probe=full) for the table's ART rows") } else { String::new() }
    );

    let t_all = Instant::now();
    let mut model_errs: Vec<f64> = Vec::new();
    let mut fp8_errs: Vec<f64> = Vec::new();
    for info in &traces {
        let t0 = Instant::now();
        let tr = manifest.load_trace(info)?;
        let runs: Vec<Replay> = specs.iter().map(|s| replay(&tr, &expand(s, info.prompt_len)?, &opts).map_err(|e| format!("{}: {s}: {e}", info.name))).collect::<Result<_, _>>()?;
        let dense = &runs[0];
        model_errs.extend(errors_vs_model(&tr, dense));
        if opts.cache_dtype.is_some() {
            let full = replay(&tr, "dense", &ReplayOptions { cache_dtype: None, record_visits: false, ..opts }).map_err(|e| format!("{}: dense over a {:?} cache: {e}", info.name, opts.dtype))?;
            fp8_errs.extend(row_errors(dense, &full, tr.d));
        }
        let refs: Vec<&Replay> = runs.iter().collect();
        let masses = recovered_mass(&tr, &refs);
        let measures: Vec<Measure> = runs
            .iter()
            .zip(masses)
            .map(|(r, mass)| {
                let art_tiles = r.art_tiles.iter().flatten().fold((0u64, 0u64), |a, &(v, t)| (a.0 + v as u64, a.1 + t as u64));
                Measure { counters: r.counters, errs: row_errors(r, dense, tr.d), mass, forward_s: r.forward_s, art_tiles, oracle: None }
            })
            .collect();
        let mut n_oracle = 0;
        for (row, &k) in rows.iter_mut().zip(&replay_of) {
            let mut m = measures[k].clone();
            // Only the table's rows get the oracle replay (it costs one more replay each).
            if let (Some(os), true) = (&row.oracle_spec, row.in_table) {
                m.oracle = Some(OracleCheck::compare(&runs[k], &replay(&tr, os, &opts).map_err(|e| format!("{}: {os}: {e}", info.name))?));
                n_oracle += 1;
            }
            row.pooled.add(&m);
            row.per_trace.push((info.name.clone(), m));
        }
        eprintln!("  {}: {} replays ({} specs + {n_oracle} ART oracle) in {:.1}s", info.name, runs.len() + n_oracle, runs.len(), t0.elapsed().as_secs_f64());
    }

    println!(
        "dense replay vs the model's recorded attention output: row rel err median {:.1e}, p99 {:.1e} (f16 storage of q/k/v)",
        quantile(&model_errs, 0.5),
        quantile(&model_errs, 0.99)
    );
    if let Some(c) = opts.cache_dtype {
        println!(
            "dense over the {} cache vs dense over a {:?} cache: row rel err median {:.1e}, p99 {:.1e}",
            c.name(),
            opts.dtype,
            quantile(&fp8_errs, 0.5),
            quantile(&fp8_errs, 0.99)
        );
    }
    println!();
    print_table(rows.iter().filter(|r| r.in_table));
    println!();
    println!("rows pooled over traces (generation_2k weighs most: 256 steps); blocks visited counts policy rows only;");
    println!("time is the wall clock of the decode forward calls (one sequence, one layer per call), {} threads", if opts.threads == 0 { "all".to_string() } else { opts.threads.to_string() });

    if let Some(dir) = out_dir {
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let csv = dir.join("eval.csv");
        write_csv(&csv, &rows)?;
        let png = dir.join("eval.png");
        let sweep: Vec<&Row> = rows.iter().filter(|r| !r.in_table).collect();
        plot::error_vs_visited(&png, &sweep, rows[0].pooled.counters.kv_bytes_read as f64, &format!("{} — {}", manifest.model, traces.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")))?;
        println!("wrote {} and {}", csv.display(), png.display());
    }
    println!("eval took {:.1}s", t_all.elapsed().as_secs_f64());
    Ok(())
}

/// The distinct specs of `rows` in order of first appearance (dense first: rows[0]), and for each row the
/// index of its spec there.
fn distinct_specs(rows: &[Row]) -> (Vec<String>, Vec<usize>) {
    let mut specs: Vec<String> = Vec::new();
    let index = rows
        .iter()
        .map(|r| match specs.iter().position(|s| *s == r.spec) {
            Some(i) => i,
            None => {
                specs.push(r.spec.clone());
                specs.len() - 1
            }
        })
        .collect();
    (specs, index)
}

/// Replaces every `{N/k}` in `spec` by `ceil(n / k)` (a budget relative to the context, for the trace at
/// hand: the spec language has only absolute budgets).
fn expand(spec: &str, n: usize) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = spec;
    while let Some(i) = rest.find("{N/") {
        out.push_str(&rest[..i]);
        let tail = &rest[i + 3..];
        let j = tail.find('}').ok_or_else(|| format!("{spec:?}: `{{N/` without a closing `}}`"))?;
        let k: usize = tail[..j].trim().parse().ok().filter(|&k| k >= 1).ok_or_else(|| format!("{spec:?}: `{{N/{}}}` needs an integer >= 1", &tail[..j]))?;
        out.push_str(&n.div_ceil(k).to_string());
        rest = &tail[j + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The oracle of an ART spec with the paper's probe: the same spec with `probe=full` (None otherwise).
fn oracle_spec(spec: &str) -> Option<String> {
    let art = Policy::parse(spec).ok()?.pipeline()?.art?;
    if art.probe != kvsparse::policy::Probe::Lanes {
        return None;
    }
    let (head, tail) = spec.split_at(spec.find("art")?);
    let rest = tail["art".len()..].trim_start();
    let out = if rest.contains("probe=lanes") {
        format!("{head}art{}", rest.replacen("probe=lanes", "probe=full", 1))
    } else if let Some(r) = rest.strip_prefix("()") {
        format!("{head}art(probe=full){r}")
    } else if let Some(r) = rest.strip_prefix('(') {
        format!("{head}art(probe=full, {r}")
    } else {
        format!("{head}art(probe=full){rest}")
    };
    let ok = Policy::parse(&out).ok().and_then(|p| p.pipeline().and_then(|pl| pl.art)).is_some_and(|a| a.probe == kvsparse::policy::Probe::Full);
    ok.then_some(out)
}

fn names(m: &Manifest) -> String {
    m.traces.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
}

/// Per-row relative error of the dense replay against the output the model recorded (acceptance check of
/// the trace format: only the f16 storage of q/k/v separates them).
fn errors_vs_model(tr: &Trace, dense: &Replay) -> Vec<f64> {
    let (hq, d) = (tr.hq, tr.d);
    let mut errs = Vec::new();
    for (li, lt) in tr.layers.iter().enumerate() {
        for (si, &t) in dense.steps.iter().enumerate() {
            for h in 0..hq {
                let ours = &dense.out[li][(si * hq + h) * d..(si * hq + h + 1) * d];
                let model: Vec<f64> = lt.out[(t * hq + h) * d..(t * hq + h + 1) * d].iter().map(|&x| x as f64).collect();
                errs.push(rel_err(ours, &model));
            }
        }
    }
    errs
}

fn print_table<'a>(rows: impl Iterator<Item = &'a Row>) {
    println!("| policy | blocks visited | rel err median | rel err p99 | mass recovered mean | mass p1 | ms/call | policy figures |");
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    for r in rows {
        let m = &r.pooled;
        let visited = if m.counters.policy_rows == 0 { "100% (dense)".to_string() } else { format!("{:.1}%", m.visited_pct()) };
        println!(
            "| `{}` | {visited} | {:.2e} | {:.2e} | {:.4} | {:.4} | {:.3} | {} |",
            r.spec,
            quantile(&m.errs, 0.5),
            quantile(&m.errs, 0.99),
            mean(&m.mass),
            quantile(&m.mass, 0.01),
            m.ms_per_call(),
            m.notes()
        );
    }
}

fn write_csv(path: &Path, rows: &[Row]) -> Result<(), String> {
    let mut s = String::from("set,policy,family,knob,value,trace,rows,policy_rows,blocks_eligible,blocks_visited,visited_pct,err_median,err_p99,err_max,mass_mean,mass_p1,ms_per_call,top_p_kept_pct,art_skipped_pct,prr_hit,prr_reuse_hit,full_steps,partial_steps\n");
    for r in rows {
        let set = if r.in_table { "table" } else { "sweep" };
        let lines = r.per_trace.iter().map(|(n, m)| (n.as_str(), m)).chain(std::iter::once(("all", &r.pooled)));
        for (trace, m) in lines {
            let c = &m.counters;
            let ratio = |a: u64, b: u64| if b == 0 { String::new() } else { format!("{:.6}", a as f64 / b as f64) };
            s += &format!(
                "{set},\"{}\",\"{}\",{},{},{trace},{},{},{},{},{:.4},{:.6e},{:.6e},{:.6e},{:.6},{:.6},{:.4},{},{},{},{},{},{}\n",
                r.spec.replace('"', "\"\""),
                r.family,
                r.knob,
                if r.value.is_nan() { String::new() } else { r.value.to_string() },
                m.errs.len(),
                c.policy_rows,
                c.blocks_eligible,
                c.blocks_visited,
                m.visited_pct(),
                quantile(&m.errs, 0.5),
                quantile(&m.errs, 0.99),
                quantile(&m.errs, 1.0),
                mean(&m.mass),
                quantile(&m.mass, 0.01),
                m.ms_per_call(),
                ratio(c[top_p::KEPT] * 100, c[top_p::CANDIDATES]),
                ratio(c.blocks_skipped_termination * 100, c.blocks_eligible),
                ratio(c[speculate::HIT_BLOCKS], c[speculate::TRUE_BLOCKS]),
                ratio(c[speculate::REUSE_HIT_BLOCKS], c[speculate::TRUE_BLOCKS]),
                c[refresh::FULL_STEPS],
                c[refresh::PARTIAL_STEPS]
            );
        }
    }
    std::fs::write(path, s).map_err(|e| format!("{}: {e}", path.display()))
}
