//! A serving engine's CUDA graph pads a decode batch to a captured size: `query_start_loc` ends at the real
//! tokens while the query holds the padded count (vLLM 0.26 passes exactly that). With the engine option
//! `padded_batches` the rows past the end are padding: not attended, not written, no error; without it the
//! call is refused and writes nothing (issue 33's promise for a bad batch description).

use kvsparse::rng::Rng;
use kvsparse::{DType, Engine, EngineConfig, ErrorKind, ForwardArgs, TensorRef};

const HQ: usize = 4;
const HK: usize = 2;
const D: usize = 64;
const BS: usize = 16;
const NB: usize = 6;
const SENTINEL: f32 = 7.0;

fn engine(padded: bool) -> Engine {
    let mut cfg = EngineConfig::new(1, HQ, HK, D, BS, DType::F32);
    cfg.num_threads = 1;
    cfg.padded_batches = padded;
    Engine::new(cfg).unwrap()
}

/// Deterministic values in [-1, 1) (the project's generator, fixed seed).
fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (2.0 * rng.uniform() - 1.0) as f32).collect()
}

/// Two decode rows (sequences of 20 and 37 keys) in a query of `rows` rows; `query_start_loc` ends at 2.
fn decode(e: &Engine, rows: usize, out: &mut [f32], lse: &mut [f32]) -> kvsparse::Result<()> {
    let cache = fill(2 * NB * BS * HK * D, 1);
    let (kc, vc) = cache.split_at(NB * BS * HK * D);
    let shape = [NB as i64, BS as i64, HK as i64, D as i64];
    let q = fill(rows * HQ * D, 2);
    let table = [0i32, 1, 2, 3, 4, 5];
    let (lens, qsl) = ([20i32, 37], [0i32, 1, 2]);
    e.attention_forward(&ForwardArgs {
        layer: 0,
        query: TensorRef::from_slice(&q, &[rows as i64, HQ as i64, D as i64]),
        key_cache: TensorRef::from_slice(kc, &shape),
        value_cache: TensorRef::from_slice(vc, &shape),
        block_table: TensorRef::from_slice(&table, &[2, 3]),
        seq_lens: TensorRef::from_slice(&lens, &[2]),
        query_start_loc: TensorRef::from_slice(&qsl, &[3]),
        seq_ids: None,
        out: TensorRef::from_slice_mut(out, &[rows as i64, HQ as i64, D as i64]),
        lse: Some(TensorRef::from_slice_mut(lse, &[rows as i64, HQ as i64])),
        scale: 0.125,
        sliding_window: 0,
        softcap: 0.0,
        max_query_len: 1,
        max_seq_len: 37,
        stream: std::ptr::null_mut(),
    })
    .map(|_| ())
}

#[test]
fn padding_rows_are_neither_attended_nor_written_and_the_real_rows_are_unchanged() {
    let (mut exact, mut exact_lse) = (vec![SENTINEL; 2 * HQ * D], vec![SENTINEL; 2 * HQ]);
    decode(&engine(false), 2, &mut exact, &mut exact_lse).unwrap();
    assert!(exact.iter().all(|v| v.is_finite() && *v != SENTINEL));
    let e = engine(true);
    let (mut padded, mut padded_lse) = (vec![SENTINEL; 4 * HQ * D], vec![SENTINEL; 4 * HQ]);
    decode(&e, 4, &mut padded, &mut padded_lse).unwrap();
    assert_eq!(&padded[..2 * HQ * D], &exact[..], "real rows equal the unpadded call's");
    assert_eq!(&padded_lse[..2 * HQ], &exact_lse[..]);
    assert!(padded[2 * HQ * D..].iter().all(|&v| v == SENTINEL), "padding rows untouched");
    assert!(padded_lse[2 * HQ..].iter().all(|&v| v == SENTINEL));
    // The exact batch still works on a padded-batches engine.
    let (mut again, mut again_lse) = (vec![SENTINEL; 2 * HQ * D], vec![SENTINEL; 2 * HQ]);
    decode(&e, 2, &mut again, &mut again_lse).unwrap();
    assert_eq!(again, exact);
}

#[test]
fn without_the_option_a_short_query_start_loc_is_refused_and_nothing_is_written() {
    let (mut out, mut lse) = (vec![SENTINEL; 4 * HQ * D], vec![SENTINEL; 4 * HQ]);
    let err = decode(&engine(false), 4, &mut out, &mut lse).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidShape, "{err}");
    assert!(err.message.contains("query_start_loc ends at 2"), "{err}");
    assert!(out.iter().all(|&v| v == SENTINEL) && lse.iter().all(|&v| v == SENTINEL));
}

#[test]
fn with_the_option_a_query_start_loc_beyond_the_query_is_still_refused() {
    // query_start_loc ends at 2 but the query has one row.
    let (mut out, mut lse) = (vec![SENTINEL; HQ * D], vec![SENTINEL; HQ]);
    let err = decode(&engine(true), 1, &mut out, &mut lse).unwrap_err();
    assert!(matches!(err.kind, ErrorKind::OutOfRange | ErrorKind::InvalidShape), "{err}");
    assert!(out.iter().all(|&v| v == SENTINEL));
}
