//! `merge_states` of attention over two disjoint halves of a sequence's KV equals attention over all of it
//! (fresh random data, every float dtype, split at a block boundary and at random block counts).

use kvsparse_conformance::hostbuf::HostBuf;
use kvsparse_conformance::reference::rel_err;
use kvsparse::rng::Rng;
use kvsparse::{DType, Engine, EngineConfig, ForwardArgs, MergeArgs, TensorRef};

/// Decode attention of `q` over the blocks `table` holding `len` keys; returns (out, lse).
fn attend(e: &Engine, q: &mut HostBuf, k: &mut HostBuf, v: &mut HostBuf, table: &[i32], len: usize, dims: (usize, usize, usize, usize, usize)) -> (HostBuf, Vec<f32>) {
    let (nb, bs, hq, hk, d) = dims;
    let mut out = HostBuf::nans(q.dtype(), hq * d);
    let mut lse = vec![f32::NAN; hq];
    let lens = [len as i32];
    let qsl = [0i32, 1];
    let cache = [nb as i64, bs as i64, hk as i64, d as i64];
    e.attention_forward(&ForwardArgs {
        layer: 0,
        query: q.view_contiguous(&[1, hq as i64, d as i64]),
        key_cache: k.view_contiguous(&cache),
        value_cache: v.view_contiguous(&cache),
        block_table: TensorRef::from_slice(table, &[1, table.len() as i64]),
        seq_lens: TensorRef::from_slice(&lens, &[1]),
        query_start_loc: TensorRef::from_slice(&qsl, &[2]),
        seq_ids: None,
        out: out.view_contiguous(&[1, hq as i64, d as i64]),
        lse: Some(TensorRef::from_slice_mut(&mut lse, &[1, hq as i64])),
        scale: 0.1,
        sliding_window: 0,
        softcap: 0.0,
        max_query_len: 0,
        max_seq_len: 0,
        stream: std::ptr::null_mut(),
    })
    .unwrap();
    (out, lse)
}

#[test]
fn merging_two_halves_equals_attention_over_the_whole() {
    let seed = Rng::fresh_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let (bs, hq, hk, d) = (16, 8, 2, 128);
        let nblocks = 20 + rng.below(30);
        let e = Engine::new(EngineConfig::new(1, hq, hk, d, bs, dt)).unwrap();
        let mut k = HostBuf::zeros(dt, nblocks * bs * hk * d);
        let mut v = HostBuf::zeros(dt, nblocks * bs * hk * d);
        for i in 0..k.len() {
            k.set(i, rng.normal());
            v.set(i, rng.normal());
        }
        let mut q = HostBuf::zeros(dt, hq * d);
        for i in 0..q.len() {
            q.set(i, rng.normal() * 2.0);
        }
        let mut table: Vec<i32> = (0..nblocks as i32).collect();
        rng.shuffle(&mut table);
        let len = nblocks * bs - rng.below(bs); // last block partly filled
        let split = 1 + rng.below(nblocks - 1); // blocks in the first half
        let dims = (nblocks, bs, hq, hk, d);
        let (whole, whole_lse) = attend(&e, &mut q, &mut k, &mut v, &table, len, dims);
        let (mut a, mut la) = attend(&e, &mut q, &mut k, &mut v, &table[..split], split * bs, dims);
        let (mut b, mut lb) = attend(&e, &mut q, &mut k, &mut v, &table[split..], len - split * bs, dims);
        let mut m = HostBuf::nans(dt, hq * d);
        let mut lm = vec![f32::NAN; hq];
        let shape = [1i64, hq as i64, d as i64];
        e.merge_states(&MergeArgs {
            out_a: a.view_contiguous(&shape),
            lse_a: TensorRef::from_slice_mut(&mut la, &[1, hq as i64]),
            out_b: b.view_contiguous(&shape),
            lse_b: TensorRef::from_slice_mut(&mut lb, &[1, hq as i64]),
            out: m.view_contiguous(&shape),
            lse_out: Some(TensorRef::from_slice_mut(&mut lm, &[1, hq as i64])),
            stream: std::ptr::null_mut(),
        })
        .unwrap();
        let got: Vec<f64> = (0..m.len()).map(|i| m.get(i)).collect();
        let want: Vec<f64> = (0..whole.len()).map(|i| whole.get(i)).collect();
        let err = rel_err(&got, &want);
        // Halves are rounded to the dtype before merging, so half-precision gets its own rounding budget.
        let tol = if dt == DType::F32 { 1e-6 } else { 5e-3 };
        assert!(err <= tol, "{dt:?}: merged vs whole rel err {err:e} (split {split} of {nblocks})");
        for h in 0..hq {
            assert!((lm[h] - whole_lse[h]).abs() < 1e-4, "{dt:?}: lse {} vs {}", lm[h], whole_lse[h]);
        }
    }
}
