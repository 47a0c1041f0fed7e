//! Helpers shared by the library's integration tests.

use kvsparse::{Engine, ForwardArgs, TensorRef};

/// One decode row of 20 keys over blocks 0 and 1 of the given caches (`[1, heads, dim]` query and out).
pub fn decode_row_of_20(engine: &Engine, query: TensorRef, kc: TensorRef, vc: TensorRef, out: TensorRef, lse: Option<TensorRef>) -> kvsparse::Result<()> {
    let table = [0i32, 1];
    let (lens, qsl) = ([20i32], [0i32, 1]);
    engine
        .attention_forward(&ForwardArgs {
            layer: 0,
            query,
            key_cache: kc,
            value_cache: vc,
            block_table: TensorRef::from_slice(&table, &[1, 2]),
            seq_lens: TensorRef::from_slice(&lens, &[1]),
            query_start_loc: TensorRef::from_slice(&qsl, &[2]),
            seq_ids: None,
            out,
            lse,
            scale: 0.125,
            sliding_window: 0,
            softcap: 0.0,
            max_query_len: 1,
            max_seq_len: 20,
            stream: std::ptr::null_mut(),
        })
        .map(|_| ())
}
