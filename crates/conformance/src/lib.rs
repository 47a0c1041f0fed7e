//! The conformance suite: a matrix of cases (head sizes, dtypes, GQA ratios, block sizes, query and
//! sequence lengths, windows, soft-caps, and what serving feeds a kernel: shuffled and shared block tables,
//! stale or -1 unused columns, unwritten slots holding garbage or NaN, reused blocks, strided views of one
//! combined cache) checked against a float64 reference on fresh random data. Used by `cargo test`, by
//! `kvsparse conformance` (in process, through any library's C ABI with `--lib`, exported to files with
//! `--export`) and by the CUDA backend; `sparse` checks the contract a serving engine needs from a policy.

pub mod cuda;
pub mod dylib;
pub mod eval;
pub mod export;
pub mod fixture;
pub mod hostbuf;
pub mod matrix;
pub mod nonfinite;
pub mod predictor_agree;
pub mod predictor_cuda;
pub mod prr_cuda;
pub mod quest_agree;
pub mod reference;
pub mod refresh_agree;
pub mod refresh_cuda;
pub mod snapkv_agree;
pub mod snapkv_cuda;
pub mod sparse;
pub mod sparse_cuda;
pub mod step_writes;
pub mod synthetic;
pub mod top_p_agree;
pub mod traces;

use kvsparse::engine::{CacheWriteArgs, Engine, ForwardArgs};
use kvsparse::error::{ErrorKind, Result};
use kvsparse::stats::Counters;
use kvsparse::tensor::DType;
pub use fixture::{CaseSpec, Fixture, Outputs, Plant};
pub use matrix::{extended, fp8, matrix, suite};

/// The calls the suite makes of an implementation: kvsparse's in-process engine, or a library loaded
/// through its C ABI (`dylib::LibEngine`).
pub trait Api {
    fn cache_write(&self, a: &CacheWriteArgs) -> Result<()>;
    /// Runs the call; returns its counters.
    fn attention_forward(&self, a: &ForwardArgs) -> Result<Counters>;
    fn release_sequence(&self, seq_id: u64) -> Result<()>;
    /// Sets an FP8 cache's per-layer dequantization scales (`kvs_engine_set_kv_scales`).
    fn set_kv_scales(&self, layer: usize, k_scale: f32, v_scale: f32) -> Result<()>;
}

impl Api for Engine {
    fn cache_write(&self, a: &CacheWriteArgs) -> Result<()> {
        Engine::cache_write(self, a)
    }
    fn attention_forward(&self, a: &ForwardArgs) -> Result<Counters> {
        Engine::attention_forward(self, a)
    }
    fn release_sequence(&self, seq_id: u64) -> Result<()> {
        Engine::release_sequence(self, seq_id)
    }
    fn set_kv_scales(&self, layer: usize, k_scale: f32, v_scale: f32) -> Result<()> {
        Engine::set_kv_scales(self, Some(layer), k_scale, v_scale)
    }
}

/// Tolerances from the acceptance criteria: relative output error and absolute LSE error.
pub fn tolerance(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (1e-5, 1e-4),
        _ => (5e-3, 1e-3),
    }
}

#[derive(Clone, Debug)]
pub struct CaseResult {
    pub name: String,
    pub seed: u64,
    pub rel_err: f64,
    pub lse_err: f64,
    pub pass: bool,
    /// The target refused the case as unsupported (status UNSUPPORTED): not a failure.
    pub unsupported: bool,
    pub error: Option<String>,
}

impl CaseResult {
    /// A case that produced no output: unsupported when the target said so (the verdict then reads
    /// `unsupported: <why>`), else failed with the error's kind and message.
    pub fn refused(name: &str, seed: u64, e: &kvsparse::Error) -> Self {
        let unsupported = e.kind == ErrorKind::Unsupported;
        let error = if unsupported { e.message.clone() } else { e.to_string() };
        CaseResult { name: name.to_string(), seed, rel_err: f64::NAN, lse_err: f64::NAN, pass: false, unsupported, error: Some(error) }
    }

    /// `pass`, `FAIL ...` or `unsupported: ...` for a report line.
    pub fn verdict(&self) -> String {
        let msg = self.error.clone().unwrap_or_default();
        match (self.pass, self.unsupported) {
            (true, _) => "pass".to_string(),
            (false, true) => format!("unsupported: {msg}"),
            (false, false) => format!("FAIL {msg}").trim_end().to_string(),
        }
    }
}

/// Compares a run's outputs with the fixture's reference.
pub fn judge(f: &Fixture, outs: &Outputs, seed: u64) -> CaseResult {
    let (o, l) = outs.to_f64(f);
    let rel = reference::rel_err(&o, &f.ref_out);
    let lse = reference::max_abs_err(&l, &f.ref_lse);
    let (tol_o, tol_l) = tolerance(f.spec.dtype);
    CaseResult { name: f.spec.name.clone(), seed, rel_err: rel, lse_err: lse, pass: rel <= tol_o && lse <= tol_l, unsupported: false, error: None }
}

/// Cache write + forward of a fixture on a fresh CPU engine (a backend for `nonfinite::check_attention`).
pub fn run_fixture_cpu(f: &mut Fixture) -> kvsparse::Result<Outputs> {
    let e = Engine::new(f.engine_config())?;
    fixture::run_on_engine(&e, f)
}

/// Runs one case on a fresh CPU engine.
pub fn run_case_cpu(spec: &CaseSpec, seed: u64) -> CaseResult {
    let mut f = Fixture::new(spec, seed);
    let res = Engine::new(f.engine_config()).and_then(|e| fixture::run_on_engine(&e, &mut f));
    match res {
        Ok(outs) => judge(&f, &outs, seed),
        Err(e) => CaseResult::refused(&spec.name, seed, &e),
    }
}

