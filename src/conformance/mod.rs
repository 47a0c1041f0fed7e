//! The conformance suite: a matrix of cases (head sizes, dtypes, GQA ratios, block sizes, query and
//! sequence lengths, windows, soft-caps, shuffled tables, strided tensors) checked against a float64
//! reference on fresh random data. Used by `cargo test`, by `kvsparse conformance`, and by the CUDA backend.

pub mod cuda;
pub mod fixture;
pub mod hostbuf;
pub mod reference;

use crate::config::SUPPORTED_HEAD_DIMS;
use crate::engine::Engine;
use crate::tensor::DType;
pub use fixture::{CaseSpec, Fixture, Outputs};

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
    pub error: Option<String>,
}

/// Compares a run's outputs with the fixture's reference.
pub fn judge(f: &Fixture, outs: &Outputs, seed: u64) -> CaseResult {
    let (o, l) = outs.to_f64(f);
    let rel = reference::rel_err(&o, &f.ref_out);
    let lse = reference::max_abs_err(&l, &f.ref_lse);
    let (tol_o, tol_l) = tolerance(f.spec.dtype);
    CaseResult { name: f.spec.name.clone(), seed, rel_err: rel, lse_err: lse, pass: rel <= tol_o && lse <= tol_l, error: None }
}

/// Runs one case on a fresh CPU engine.
pub fn run_case_cpu(spec: &CaseSpec, seed: u64) -> CaseResult {
    let mut f = Fixture::new(spec, seed);
    let res = Engine::new(f.engine_config()).and_then(|e| fixture::run_on_engine(&e, &mut f));
    match res {
        Ok(outs) => judge(&f, &outs, seed),
        Err(e) => CaseResult { name: spec.name.clone(), seed, rel_err: f64::NAN, lse_err: f64::NAN, pass: false, error: Some(e.to_string()) },
    }
}

fn dtype_tag(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => "?",
    }
}

/// The case matrix. `quick` keeps one representative per axis (for sanitizers and smoke runs).
pub fn matrix(quick: bool) -> Vec<CaseSpec> {
    let mut cases = Vec::new();
    let base = |name: String, dtype, head_dim, hq, hk, bs, seqs: Vec<(usize, usize)>| CaseSpec {
        name,
        dtype,
        head_dim,
        num_q_heads: hq,
        num_kv_heads: hk,
        block_size: bs,
        seqs,
        window: 0,
        softcap: 0.0,
        strided: false,
        shuffled: true,
    };
    // 1. Every head size × dtype, a mixed batch: decode at 1000+, q=2, q=7, whole prefill, chunked q=64.
    let dtypes = [DType::F32, DType::F16, DType::BF16];
    for (i, &hd) in SUPPORTED_HEAD_DIMS.iter().enumerate() {
        for (j, &dt) in dtypes.iter().enumerate() {
            if quick && (i + j) % 4 != 0 {
                continue;
            }
            let mut c = base(format!("mixed-h{hd}-{}-gqa4", dtype_tag(dt)), dt, hd, 8, 2, 16, vec![(1, 1037), (2, 40), (7, 300), (96, 96), (64, 1100)]);
            c.strided = (i + j) % 2 == 1;
            if c.strided {
                c.name.push_str("-strided");
            }
            cases.push(c);
        }
    }
    // 2. Every block size: sequence lengths 1, bs-1, bs+1 and 1000+, decode and short prefill rows.
    for bs in [1usize, 2, 4, 8, 16, 32, 64, 128, 256] {
        if quick && ![1, 16, 256].contains(&bs) {
            continue;
        }
        let mut seqs = vec![(1, 1), (1, bs + 1), (2, bs + 1), (1, 1029)];
        if bs > 1 {
            seqs.push((1, bs - 1));
        }
        let mut c = base(format!("blocks-bs{bs}-f16-gqa8"), DType::F16, 128, 8, 1, bs, seqs);
        c.strided = bs % 32 == 0;
        cases.push(c);
    }
    // 3. GQA ratios 1, 4, 8 with sliding window and soft-cap, in fp32 (tightest tolerance).
    for (hq, hk) in [(4usize, 4usize), (8, 2), (16, 2)] {
        let g = hq / hk;
        let seqs = vec![(1, 777), (7, 200), (64, 64), (1, 17)];
        let mut c = base(format!("window-gqa{g}-f32"), DType::F32, 64, hq, hk, 16, seqs.clone());
        c.window = 100;
        cases.push(c);
        let mut c = base(format!("softcap-gqa{g}-f32-strided"), DType::F32, 128, hq, hk, 16, seqs.clone());
        c.softcap = 30.0;
        c.strided = true;
        cases.push(c);
        if !quick {
            let mut c = base(format!("window-softcap-gqa{g}-bf16"), DType::BF16, 96, hq, hk, 32, seqs);
            c.window = 33;
            c.softcap = 5.0;
            cases.push(c);
        }
    }
    // 4. GQA 3 (SmolLM2's 9/3 heads, head 64) in vLLM's CPU block size 128 over a strided cache: query
    //    rows per KV head 3 (decode), 6, 9, 21 and 30 (prefill tiles), so every row-block remainder of the
    //    CPU kernels (4 + 3, 2 or 1) meets keys in full and partial chunks.
    for (dt, win) in [(DType::F32, 0usize), (DType::BF16, 0), (DType::F32, 300)] {
        if quick && (dt != DType::F32 || win > 0) {
            continue;
        }
        let seqs = vec![(1, 2100), (2, 130), (3, 77), (7, 300), (1, 1), (40, 200)];
        let mut c = base(format!("gqa3-bs128-{}{}-strided", dtype_tag(dt), if win > 0 { "-window" } else { "" }), dt, 64, 9, 3, 128, seqs);
        c.window = win;
        c.strided = true;
        cases.push(c);
    }
    // 5. In-order (unshuffled) table, MQA, single decode row of length 1.
    let mut c = base("mqa-inorder-f32".to_string(), DType::F32, 256, 8, 1, 8, vec![(1, 1), (3, 3), (1, 2048)]);
    c.shuffled = false;
    cases.push(c);
    cases
}
