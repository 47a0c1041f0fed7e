//! `kvsparse conformance --export DIR`: the suite as files any language can read. Per case one safetensors
//! file (inputs as flat storages plus strided views of them, float64 reference output and LSE), one JSON
//! manifest (geometry, views, features, tolerances by dtype), kvsparse's own outputs in the same shape as any
//! other implementation's would be stored, and `check.py`, a numpy-only checker of those outputs.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};

use super::fixture::{run_on_engine, Fixture, Outputs};
use super::hostbuf::HostBuf;
use super::{judge, tolerance, CaseResult, CaseSpec};
use kvsparse::engine::Engine;
use kvsparse::tensor::DType;

/// Format name and version written into the manifest; readers refuse what they do not know.
pub const FORMAT: &str = "kvsparse-conformance";
/// 2: FP8 caches (`cache_dtype`, `k_scale`, `v_scale`, float8 storages); readers of 2 read 1.
pub const FORMAT_VERSION: u32 = 2;
/// The numpy-only checker, copied into every export as `check.py`.
pub const CHECKER: &str = include_str!("../../../scripts/conformance_check.py");
/// Folder (under `results/`) of the outputs of kvsparse's in-process CPU engine.
pub const KVSPARSE_RESULTS: &str = "kvsparse-cpu";

const CONVENTIONS: &str = "Causal paged attention over a varlen batch. Sequence s owns query rows \
[query_start_loc[s], query_start_loc[s+1]); seq_lens[s] counts its cached and new tokens, so query row i of a \
sequence with q_len rows sits at position seq_len-q_len+i and attends keys 0..=position, or only the last \
sliding_window of them (itself included) when sliding_window > 0. Logits are scale*q.k, then \
softcap*tanh(logit/softcap) when softcap > 0. Query head h reads KV head h / (num_q_heads/num_kv_heads). \
Token j of sequence s lives in k_cache/v_cache[block_table[s][j // block_size], j % block_size]; only the first \
ceil(seq_len/block_size) entries of a table row are meaningful: the rest hold stale ids or -1. Cache slots no \
live token maps to hold garbage or NaN and must not influence the output. Tensors are flat storages; a view \
{storage, offset, shape, strides} (in elements) is torch.as_strided(storage, shape, strides, offset). k_cache \
and v_cache are views of one storage. A case with cache_dtype float8_e4m3fn or float8_e5m2 stores the cache as \
FP8 codes (safetensors F8_E4M3 / F8_E5M2): a key is float32(decode(code) * k_scale), a value \
float32(decode(code) * v_scale), computed in float32; its tolerances are the query dtype's. ref_out [tokens, q_heads, head_dim] and ref_lse [tokens, q_heads] \
(natural log of the sum of exp of the final logits) are float64, computed from the stored (rounded) inputs. \
A target passes a case when out_rel = ||out-ref_out||_2/||ref_out||_2 <= tolerance.out_rel and, if it returns an \
LSE, max|lse-ref_lse| <= tolerance.lse_abs.";

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::F8E4M3 => Dtype::F8_E4M3,
        DType::F8E5M2 => Dtype::F8_E5M2,
        _ => Dtype::U64,
    }
}

fn torch_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::F16 => "float16",
        _ => "bfloat16",
    }
}

fn le_bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

/// One tensor to serialise: name, dtype, shape, little-endian bytes.
struct Blob(String, Dtype, Vec<usize>, Vec<u8>);

fn write_safetensors(path: &Path, blobs: &[Blob]) -> Result<u64, String> {
    let views: Vec<(String, TensorView)> = blobs
        .iter()
        .map(|b| TensorView::new(b.1, b.2.clone(), &b.3).map(|v| (b.0.clone(), v)).map_err(|e| format!("{}: {e}", b.0)))
        .collect::<Result<_, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(std::fs::metadata(path).map(|m| m.len()).unwrap_or(0))
}

fn view(storage: &str, offset: usize, shape: &[i64], strides: &[i64]) -> Value {
    json!({"storage": storage, "offset": offset, "shape": shape, "strides": strides})
}

/// Writes one case's inputs and reference; returns its manifest entry (without results).
fn write_case(dir: &Path, f: &Fixture, seed: u64) -> Result<(Value, u64), String> {
    let s = &f.spec;
    let (t, hq, d) = (f.num_tokens, s.num_q_heads, s.head_dim);
    let nseq = s.seqs.len();
    let file = format!("cases/{}.safetensors", s.name);
    let kv = f.written_cache();
    let blobs = [
        Blob("query_storage".into(), st_dtype(s.dtype), vec![f.q.len()], f.q.as_bytes().to_vec()),
        Blob("kv_storage".into(), st_dtype(kv.dtype()), vec![kv.len()], kv.as_bytes().to_vec()),
        Blob("block_table".into(), Dtype::I32, vec![nseq, f.max_blocks], le_bytes(&f.block_table, i32::to_le_bytes)),
        Blob("seq_lens".into(), Dtype::I32, vec![nseq], le_bytes(&f.seq_lens, i32::to_le_bytes)),
        Blob("query_start_loc".into(), Dtype::I32, vec![nseq + 1], le_bytes(&f.query_start_loc, i32::to_le_bytes)),
        Blob("ref_out".into(), Dtype::F64, vec![t, hq, d], le_bytes(&f.ref_out, f64::to_le_bytes)),
        Blob("ref_lse".into(), Dtype::F64, vec![t, hq], le_bytes(&f.ref_lse, f64::to_le_bytes)),
    ];
    let bytes = write_safetensors(&dir.join(&file), &blobs)?;
    let (tol_o, tol_l) = tolerance(s.dtype);
    let mut entry = json!({
        "name": s.name,
        "file": file,
        "seed": seed,
        "dtype": torch_name(s.dtype),
        "num_q_heads": hq,
        "num_kv_heads": s.num_kv_heads,
        "head_dim": d,
        "block_size": s.block_size,
        "num_blocks": f.num_blocks,
        "num_seqs": nseq,
        "num_tokens": t,
        "q_lens": s.seqs.iter().map(|&(q, _)| q).collect::<Vec<_>>(),
        "seq_lens": s.seqs.iter().map(|&(_, l)| l).collect::<Vec<_>>(),
        "scale": f.scale,
        "sliding_window": s.window,
        "softcap": s.softcap,
        "features": s.features(),
        "tolerance": {"out_rel": tol_o, "lse_abs": tol_l},
        "views": {
            "query": view("query_storage", 0, &[t as i64, hq as i64, d as i64], &f.q_strides),
            "k_cache": view("kv_storage", 0, &f.cache_shape, &f.cache_strides),
            "v_cache": view("kv_storage", f.v_offset, &f.cache_shape, &f.cache_strides),
        },
    });
    let fp8 = match kv.dtype() {
        DType::F8E4M3 => Some("float8_e4m3fn"),
        DType::F8E5M2 => Some("float8_e5m2"),
        _ => None,
    };
    if let Some(name) = fp8 {
        entry["cache_dtype"] = json!(name);
        entry["k_scale"] = json!(f.k_scale);
        entry["v_scale"] = json!(f.v_scale);
    }
    Ok((entry, bytes))
}

/// Stores one implementation's outputs for a case: `out` `[tokens, q_heads, head_dim]` in the case dtype,
/// `lse` `[tokens, q_heads]` float32 (compact).
fn write_result(path: &Path, f: &Fixture, outs: &Outputs) -> Result<u64, String> {
    let s = &f.spec;
    let (t, hq, d) = (f.num_tokens, s.num_q_heads, s.head_dim);
    let (o, l) = outs.to_f64(f);
    let mut out = HostBuf::zeros(s.dtype, o.len());
    for (i, &x) in o.iter().enumerate() {
        out.set(i, x); // exact: the values came from a buffer of this dtype
    }
    let lse: Vec<f32> = l.iter().map(|&x| x as f32).collect();
    write_safetensors(
        path,
        &[Blob("out".into(), st_dtype(s.dtype), vec![t, hq, d], out.as_bytes().to_vec()), Blob("lse".into(), Dtype::F32, vec![t, hq], le_bytes(&lse, f32::to_le_bytes))],
    )
}

/// Exports `cases` (case `i` drawn from `seed + i`), runs each on kvsparse's CPU engine and stores its outputs
/// under `results/kvsparse-cpu/`; returns kvsparse's own judgement per case and the bytes written.
pub fn export(dir: &Path, cases: &[CaseSpec], seed: u64, mut progress: impl FnMut(&CaseResult)) -> Result<(Vec<CaseResult>, u64), String> {
    let res_dir = dir.join("results").join(KVSPARSE_RESULTS);
    for sub in [dir.join("cases"), res_dir.clone()] {
        std::fs::create_dir_all(&sub).map_err(|e| format!("{}: {e}", sub.display()))?;
    }
    let mut entries = Vec::new();
    let mut verdicts = serde_json::Map::new();
    let mut results = Vec::new();
    let mut total = 0;
    for (i, spec) in cases.iter().enumerate() {
        let case_seed = seed.wrapping_add(i as u64);
        let mut f = Fixture::new(spec, case_seed);
        let (entry, bytes) = write_case(dir, &f, case_seed)?;
        total += bytes;
        entries.push(entry);
        let run = Engine::new(f.engine_config()).and_then(|e| run_on_engine(&e, &mut f));
        let r = match run {
            Ok(outs) => {
                total += write_result(&res_dir.join(format!("{}.safetensors", spec.name)), &f, &outs)?;
                judge(&f, &outs, case_seed)
            }
            Err(e) => CaseResult::refused(&spec.name, case_seed, &e),
        };
        verdicts.insert(spec.name.clone(), json!(r.verdict()));
        progress(&r);
        results.push(r);
    }
    let tolerances: HashMap<&str, Value> = [DType::F32, DType::F16, DType::BF16]
        .iter()
        .map(|&d| {
            let (o, l) = tolerance(d);
            (torch_name(d), json!({"out_rel": o, "lse_abs": l}))
        })
        .collect();
    let manifest = json!({
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "generator": format!("kvsparse {} (kvsparse conformance --export --seed {seed})", env!("CARGO_PKG_VERSION")),
        "seed": seed,
        "conventions": CONVENTIONS,
        "tolerances": tolerances,
        "cases": entries,
        "results": {KVSPARSE_RESULTS: {"producer": "kvsparse in-process CPU engine", "dir": format!("results/{KVSPARSE_RESULTS}"), "self_judgement": verdicts}},
    });
    let text = serde_json::to_string_pretty(&manifest).map_err(|e| e.to_string())?;
    for (name, body) in [("manifest.json", text.as_str()), ("check.py", CHECKER)] {
        std::fs::write(dir.join(name), body).map_err(|e| format!("{}: {e}", dir.join(name).display()))?;
    }
    Ok((results, total))
}
