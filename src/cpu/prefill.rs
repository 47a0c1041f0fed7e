//! Prefill and extend rows (several query tokens of one sequence) on the CPU as tiled matrix products.
//!
//! A work item holds up to [`PREFILL_TILE_ROWS`] query rows (all query heads of a KV group × several
//! tokens). For every KV head and every tile of [`KEY_TILE`] keys: the scores `Sᵀ = K · Qᵀ` (keys × rows,
//! the queries transposed once per item so a vector holds one key's score for 16 or 8 rows), the online
//! softmax across the tile done lane-wise for all rows at once (no horizontal sums), then `acc += P · V`.
//! Both products are register-blocked micro-kernels written once over [`Simd`] (AVX-512, AVX2, portable)
//! with f32 accumulation; fp16/bf16 rows are converted to f32 once per tile and reused by every row.
//!
//! The semantics are those of [`super::attention`]'s chunk update (causal and window limits per row,
//! soft-cap, a non-finite visible logit poisons its row, exact merges of partial states), so the results
//! agree with the decode kernel to f32 rounding; the tile shapes depend only on the call, never on the
//! thread count, so the output bits do not either.

use super::attention::{RowLimits, RowsState, SeqKv};
use super::convert::{load_cache_row, Isa, Portable};
use super::isa::{self, IsaLevel};
pub(crate) use super::simd::Simd;
use super::math::fast_exp;
use crate::tensor::DType;

/// Keys per tile. What is paid once per tile and head (the running maximum's update and the accumulator's
/// rescale per row, the row pointers, the causal test) is spread over this many keys; the tile's scores,
/// `KEY_TILE × 64` f32 (32 KB), stay in L1/L2 between the two products. Measured on the 2-vCPU AVX-512 VM
/// (SmolLM2 shape, f32, one thread): 32-key tiles spent ~30% of the call outside the two products.
pub const KEY_TILE: usize = 128;

/// Query rows per prefill work item: enough rows that each K/V tile, converted once, feeds many FMAs.
pub const PREFILL_TILE_ROWS: usize = 64;

/// Query rows are padded to a multiple of this (the widest vector), padding rows computed and dropped.
const LANE_PAD: usize = 16;


/// `f(a[l], b[l])` on every lane of two portable vectors.
#[inline(always)]
fn lanes8(a: [f32; 8], b: [f32; 8], f: impl Fn(f32, f32) -> f32) -> [f32; 8] {
    std::array::from_fn(|l| f(a[l], b[l]))
}

/// Eight lanes in plain Rust (the portable path; the compiler vectorises what the target allows).
#[derive(Clone, Copy)]
pub(crate) struct Lanes8;

impl Simd for Lanes8 {
    const L: usize = 8;
    type V = [f32; 8];
    #[inline(always)]
    unsafe fn zero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; 8] {
        std::ptr::read_unaligned(p as *const [f32; 8])
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> [f32; 8] {
        [*p; 8]
    }
    #[inline(always)]
    unsafe fn fma(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        let mut r = c;
        for l in 0..8 {
            r[l] = Portable::fma(a[l], b[l], c[l]);
        }
        r
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; 8]) {
        std::ptr::write_unaligned(p as *mut [f32; 8], v)
    }
    #[inline(always)]
    unsafe fn add(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        lanes8(a, b, |x, y| x + y)
    }
    #[inline(always)]
    unsafe fn mul(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        lanes8(a, b, |x, y| x * y)
    }
    #[inline(always)]
    unsafe fn sub(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        lanes8(a, b, |x, y| x - y)
    }
    #[inline(always)]
    unsafe fn max(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        lanes8(a, b, |x, y| if x > y { x } else { y })
    }
    #[inline(always)]
    unsafe fn exp(x: [f32; 8]) -> [f32; 8] {
        x.map(fast_exp)
    }
    #[inline(always)]
    unsafe fn exp_weight(x: [f32; 8], keep: [f32; 8]) -> [f32; 8] {
        lanes8(x, keep, |x, k| if k.to_bits() != 0 && x >= -87.0 { fast_exp(x) } else { 0.0 })
    }
}

/// Attends the query rows `qs[h]` (`rows × dim`, scaled) of every KV head `h` (`states[h]`) to the keys
/// `[k0, k1)` of `kv`'s sequence, each row masked by its `limits`. Same contract as
/// [`super::attention::attend_spans_heads`] with one span.
pub fn attend_prefill_heads(states: &mut [RowsState], qs: &[Vec<f32>], limits: &[RowLimits], kv: &SeqKv, keys: (usize, usize), softcap: f32) {
    match isa::detected() {
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx512 => unsafe { prefill_avx512(states, qs, limits, kv, keys, softcap) },
        #[cfg(target_arch = "x86_64")]
        IsaLevel::Avx2 => unsafe { prefill_avx2(states, qs, limits, kv, keys, softcap) },
        IsaLevel::Portable => prefill_generic::<Portable, Lanes8, 4, 4, 4, 2>(states, qs, limits, kv, keys, softcap),
    }
}

// Blocking per ISA: scores `SV` vectors of rows × `SK` keys; values `PR` rows × `PW` vectors of columns.
// AVX-512 (32 registers): 2 × 8 and 6 × 4, 16 and 24 accumulators; AVX2 (16 registers): 2 × 4 and 4 × 2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn prefill_avx512(states: &mut [RowsState], qs: &[Vec<f32>], limits: &[RowLimits], kv: &SeqKv, keys: (usize, usize), softcap: f32) {
    prefill_generic::<super::convert::Avx512, super::avx512::Zmm, 2, 8, 6, 4>(states, qs, limits, kv, keys, softcap)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefill_avx2(states: &mut [RowsState], qs: &[Vec<f32>], limits: &[RowLimits], kv: &SeqKv, keys: (usize, usize), softcap: f32) {
    prefill_generic::<super::convert::Avx2, super::avx2::Ymm, 2, 4, 4, 2>(states, qs, limits, kv, keys, softcap)
}

/// Per-item scratch (rows padded to [`LANE_PAD`]): queries transposed, the tile's scores, staged K/V rows, lane state.
struct Scratch {
    /// Per head: `d × rp`, `qt[c * rp + r] = q[r][c]`.
    qt: Vec<Vec<f32>>,
    /// Per head: running max and sum per padded row.
    m: Vec<Vec<f32>>,
    l: Vec<Vec<f32>>,
    /// `KEY_TILE × rp` scores, then weights.
    s: Vec<f32>,
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    zero_row: Vec<f32>,
    /// The tile's cache rows (K, then V) as raw addresses.
    rows: Vec<*const u8>,
    lo: Vec<u32>,
    hi: Vec<u32>,
    lane: LaneState,
}

/// Per-row temporaries of one tile's softmax.
struct LaneState {
    bad: Vec<u32>,
    /// Sum of `x - x` over the row's scores (NaN iff one is not finite).
    check: Vec<f32>,
    cmax: Vec<f32>,
    /// Whether the row gets weight, as a lane mask (all ones or zero).
    keep: Vec<f32>,
    alpha: Vec<f32>,
    sum: Vec<f32>,
    /// `m_old - m_new`, whose exponential is the rescale factor.
    diff: Vec<f32>,
}

#[inline(always)]
fn prefill_generic<I: Isa, S: Simd, const SV: usize, const SK: usize, const PR: usize, const PW: usize>(
    states: &mut [RowsState],
    qs: &[Vec<f32>],
    limits: &[RowLimits],
    kv: &SeqKv,
    (k0, k1): (usize, usize),
    softcap: f32,
) {
    let Some(st0) = states.first() else { return };
    let (rows, d) = (st0.rows, st0.dim);
    if rows == 0 || k0 >= k1 {
        return;
    }
    debug_assert_eq!(limits.len(), rows);
    let rp = rows.div_ceil(LANE_PAD) * LANE_PAD;
    let mut sc = Scratch {
        qt: Vec::with_capacity(states.len()),
        m: states.iter().map(|st| pad(&st.m, rp, f32::NEG_INFINITY)).collect(),
        l: states.iter().map(|st| pad(&st.l, rp, 0.0)).collect(),
        s: vec![0.0; KEY_TILE * rp],
        kbuf: Vec::new(),
        vbuf: Vec::new(),
        zero_row: vec![0.0; d],
        rows: vec![std::ptr::null(); KEY_TILE],
        // Padding rows repeat the last row's limits (computed like it, never stored).
        lo: (0..rp).map(|r| limits[r.min(rows - 1)].lo as u32).collect(),
        hi: (0..rp).map(|r| limits[r.min(rows - 1)].hi as u32).collect(),
        lane: LaneState { bad: vec![0; rp], check: vec![0.0; rp], cmax: vec![0.0; rp], keep: vec![0.0; rp], alpha: vec![1.0; rp], sum: vec![0.0; rp], diff: vec![0.0; rp] },
    };
    for q in qs.iter().take(states.len()) {
        let mut t = vec![0.0f32; d * rp];
        for r in 0..rows {
            for c in 0..d {
                t[c * rp + r] = q[r * d + c];
            }
        }
        sc.qt.push(t);
    }
    let cache = kv.cache;
    let in_place = cache.dtype == DType::F32;
    let (kst, vst) = (cache.k_dim_stride(), cache.v_dim_stride());
    // Bytes between two token rows of one block (consecutive positions inside a block).
    let (k_step, v_step) = (cache.k_byte_stride(1), cache.v_byte_stride(1));
    let mut c0 = k0;
    while c0 < k1 {
        let c1 = (c0 + KEY_TILE).min(k1);
        let n = c1 - c0;
        c0 = c1;
        let t0 = c1 - n;
        if !limits.iter().any(|lim| lim.lo < c1 && lim.hi >= t0) {
            continue;
        }
        // Every row sees every key of the tile: no per-key mask.
        let full = limits.iter().all(|lim| lim.lo <= t0 && lim.hi + 1 >= c1);
        for (h, st) in states.iter_mut().enumerate() {
            let hkv = SeqKv { head: h, ..*kv };
            let mut kp = [sc.zero_row.as_ptr(); KEY_TILE];
            // SAFETY: positions < seq_len, whose blocks were validated against the cache.
            unsafe {
                row_ptrs(&mut sc.rows[..n], t0, cache.block_size, |p| hkv.k_row(p), k_step);
                stage::<I>(&mut kp[..n], &sc.rows[..n], cache.dtype, cache.k_scale, kst, in_place, d, &mut sc.kbuf);
            }
            let nk = n.div_ceil(SK) * SK;
            unsafe { scores_t::<S, SV, SK>(sc.s.as_mut_ptr(), sc.qt[h].as_ptr(), &kp[..nk], rp, d) };
            if !softmax_tile::<S>(&mut sc.s, rp, n, t0 as u32, (&sc.lo, &sc.hi), full, softcap, &mut sc.m[h], &mut sc.l[h], &mut sc.lane) {
                continue;
            }
            let mut vp = [sc.zero_row.as_ptr(); KEY_TILE];
            // SAFETY: as for K; the accumulator is rescaled by `lane.alpha` as the products load it.
            unsafe {
                row_ptrs(&mut sc.rows[..n], t0, cache.block_size, |p| hkv.v_row(p), v_step);
                stage::<I>(&mut vp[..n], &sc.rows[..n], cache.dtype, cache.v_scale, vst, in_place, d, &mut sc.vbuf);
                values::<S, PR, PW>(st.acc.as_mut_ptr(), sc.s.as_ptr(), &vp[..n], rows, rp, d, sc.lane.alpha.as_ptr());
            }
        }
    }
    for (h, st) in states.iter_mut().enumerate() {
        st.m.copy_from_slice(&sc.m[h][..rows]);
        st.l.copy_from_slice(&sc.l[h][..rows]);
    }
}

fn pad(x: &[f32], n: usize, fill: f32) -> Vec<f32> {
    let mut v = x.to_vec();
    v.resize(n, fill);
    v
}

/// `out[j]` = the cache row of position `p0 + j`: `first(p)` (block table and strides) once per block the
/// positions cross, then `step` bytes per position inside it (rows of one block are `step` apart).
///
/// # Safety
/// `first(p)` must be the row of `p` and rows of one block `step` bytes apart.
#[inline(always)]
unsafe fn row_ptrs(out: &mut [*const u8], p0: usize, block_size: usize, first: impl Fn(usize) -> *const u8, step: isize) {
    let mut j = 0;
    while j < out.len() {
        let p = p0 + j;
        let run = (block_size - (p & (block_size - 1))).min(out.len() - j);
        let base = first(p);
        for (i, o) in out[j..j + run].iter_mut().enumerate() {
            *o = base.wrapping_offset(i as isize * step);
        }
        j += run;
    }
}

/// Points `ptrs[j]` at row `rows[j]` as contiguous f32: the cache row itself for f32 caches read with unit
/// stride, else a converted (an FP8 cache: dequantized by `scale`) copy in `buf`.
///
/// # Safety
/// Every `rows[j]` must address `d` elements of `dtype` at element stride `stride`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn stage<I: Isa>(ptrs: &mut [*const f32], rows: &[*const u8], dtype: DType, scale: f32, stride: isize, in_place: bool, d: usize, buf: &mut Vec<f32>) {
    if in_place && stride == 1 {
        for (p, &r) in ptrs.iter_mut().zip(rows) {
            *p = r as *const f32;
        }
        return;
    }
    if buf.len() < KEY_TILE * d {
        buf.resize(KEY_TILE * d, 0.0);
    }
    for (j, &r) in rows.iter().enumerate() {
        load_cache_row::<I>(r, dtype, scale, stride, d, &mut buf[j * d..(j + 1) * d]);
        ptrs[j] = buf[j * d..].as_ptr();
    }
}

/// `s[j * rp + r] = Σ_c k_j[c] · qt[c * rp + r]` for every key pointer `kp[j]` (`kp.len()` a multiple of
/// `SK`) and every padded row `r < rp`. Blocks of `SV` vectors of rows × `SK` keys (each key element
/// broadcast once per block), the last rows in blocks of one vector.
///
/// # Safety
/// `qt` holds `d × rp`, `s` `kp.len() × rp`; every `kp[j]` addresses `d` f32; `rp % S::L == 0`.
#[inline(always)]
unsafe fn scores_t<S: Simd, const SV: usize, const SK: usize>(s: *mut f32, qt: *const f32, kp: &[*const f32], rp: usize, d: usize) {
    let mut r0 = 0;
    while r0 + SV * S::L <= rp {
        scores_block::<S, SV, SK>(s, qt, kp, rp, d, r0);
        r0 += SV * S::L;
    }
    while r0 < rp {
        scores_block::<S, 1, SK>(s, qt, kp, rp, d, r0);
        r0 += S::L;
    }
}

#[inline(always)]
unsafe fn scores_block<S: Simd, const V: usize, const K: usize>(s: *mut f32, qt: *const f32, kp: &[*const f32], rp: usize, d: usize, r0: usize) {
    let mut j = 0;
    while j < kp.len() {
        let mut acc = [[S::zero(); V]; K];
        // (plain loops, not `array::from_fn`: the compiler left some of those calls out of line, spilling
        // every accumulator around them)
        let mut k = [std::ptr::null::<f32>(); K];
        k.copy_from_slice(&kp[j..j + K]);
        for c in 0..d {
            let mut q = [S::zero(); V];
            for (v, qv) in q.iter_mut().enumerate() {
                *qv = S::load(qt.add(c * rp + r0 + v * S::L));
            }
            for b in 0..K {
                let x = S::splat(k[b].add(c));
                for v in 0..V {
                    acc[b][v] = S::fma(x, q[v], acc[b][v]);
                }
            }
        }
        for b in 0..K {
            for v in 0..V {
                S::store(s.add((j + b) * rp + r0 + v * S::L), acc[b][v]);
            }
        }
        j += K;
    }
}

/// `acc[r][c] = alpha[r] · acc[r][c] + Σ_j w[j * rp + r] · v_j[c]` for rows `r < rows`, all `d` columns,
/// keys `vp` (the online softmax's rescale folded into the load: `alpha = 1` leaves the bits as they are).
/// Blocks of `PR` rows × `PW` vectors of columns held in registers across the tile (every V load feeds `PR`
/// rows).
///
/// # Safety
/// `acc` holds `rows × d`, `w` `vp.len() × rp`, `alpha` `rows`; every `vp[j]` addresses `d` f32; `d % S::L == 0`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn values<S: Simd, const PR: usize, const PW: usize>(acc: *mut f32, w: *const f32, vp: &[*const f32], rows: usize, rp: usize, d: usize, alpha: *const f32) {
    let mut r0 = 0;
    while r0 + PR <= rows {
        values_rows::<S, PR, PW>(acc, w, vp, rp, d, r0, alpha);
        r0 += PR;
    }
    match rows - r0 {
        1 => values_rows::<S, 1, PW>(acc, w, vp, rp, d, r0, alpha),
        2 => values_rows::<S, 2, PW>(acc, w, vp, rp, d, r0, alpha),
        3 => values_rows::<S, 3, PW>(acc, w, vp, rp, d, r0, alpha),
        4 => values_rows::<S, 4, PW>(acc, w, vp, rp, d, r0, alpha),
        5 => values_rows::<S, 5, PW>(acc, w, vp, rp, d, r0, alpha),
        _ => debug_assert_eq!(rows, r0, "PR is at most 6"),
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn values_rows<S: Simd, const R: usize, const PW: usize>(acc: *mut f32, w: *const f32, vp: &[*const f32], rp: usize, d: usize, r0: usize, alpha: *const f32) {
    let mut c = 0;
    while c + PW * S::L <= d {
        values_block::<S, R, PW>(acc, w, vp, rp, d, r0, c, alpha);
        c += PW * S::L;
    }
    match (d - c) / S::L {
        1 => values_block::<S, R, 1>(acc, w, vp, rp, d, r0, c, alpha),
        2 => values_block::<S, R, 2>(acc, w, vp, rp, d, r0, c, alpha),
        3 => values_block::<S, R, 3>(acc, w, vp, rp, d, r0, c, alpha),
        _ => {}
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn values_block<S: Simd, const R: usize, const W: usize>(acc: *mut f32, w: *const f32, vp: &[*const f32], rp: usize, d: usize, r0: usize, c: usize, alpha: *const f32) {
    let mut a = [[S::zero(); W]; R];
    for r in 0..R {
        let s = S::splat(alpha.add(r0 + r));
        for x in 0..W {
            a[r][x] = S::mul(S::load(acc.add((r0 + r) * d + c + x * S::L)), s);
        }
    }
    for (j, &v) in vp.iter().enumerate() {
        let mut vv = [S::zero(); W];
        for (x, vx) in vv.iter_mut().enumerate() {
            *vx = S::load(v.add(c + x * S::L));
        }
        for r in 0..R {
            let p = S::splat(w.add(j * rp + r0 + r));
            for x in 0..W {
                a[r][x] = S::fma(p, vv[x], a[r][x]);
            }
        }
    }
    for r in 0..R {
        for x in 0..W {
            S::store(acc.add((r0 + r) * d + c + x * S::L), a[r][x]);
        }
    }
}

/// The online-softmax update of one tile for all rows at once, on the transposed scores `s` (`n` keys at
/// positions `p0..`, `rp` lanes each): per row as [`super::attention`]'s chunk update — a visible raw
/// score that is not finite poisons the row (`l = NaN`, weights 0), then soft-cap, mask, new maximum,
/// rescale factor `lane.alpha` for the row's accumulator (1 when unchanged), and `s` replaced by the
/// unnormalised weights. Returns whether any row got weight. Loops run across rows so they vectorise.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn softmax_tile<S: Simd>(s: &mut [f32], rp: usize, n: usize, p0: u32, lims: (&[u32], &[u32]), full: bool, softcap: f32, m: &mut [f32], l: &mut [f32], lane: &mut LaneState) -> bool {
    if full && softcap == 0.0 {
        // SAFETY: `s` holds `n × rp` and the lane arrays `rp`, `rp % S::L == 0`.
        unsafe { scan_full::<S>(s, rp, n, lane) }
    } else {
        scan_masked(s, rp, n, p0, lims, full, softcap, lane);
    }
    // SAFETY: as above.
    unsafe {
        let any = update_rows::<S>(rp, m, l, lane);
        weights::<S>(s, rp, n, m, l, lane);
        any
    }
}

/// [`softmax_tile`]'s scan of a tile every row sees whole, without soft-cap (all but the diagonal and
/// window edge tiles), in vectors across rows: `lane.cmax` and `lane.bad` (a row's sum of the non-finite
/// check `x - x` is NaN iff one of its scores is not finite).
#[inline(always)]
unsafe fn scan_full<S: Simd>(s: &[f32], rp: usize, n: usize, lane: &mut LaneState) {
    let sp = s.as_ptr();
    let neg_inf = f32::NEG_INFINITY;
    for r0 in (0..rp).step_by(S::L) {
        let (mut bad, mut cm) = (S::zero(), S::splat(&neg_inf));
        for j in 0..n {
            let x = S::load(sp.add(j * rp + r0));
            bad = S::add(bad, S::sub(x, x));
            cm = S::max(cm, x);
        }
        S::store(lane.check.as_mut_ptr().add(r0), bad);
        S::store(lane.cmax.as_mut_ptr().add(r0), cm);
    }
    for r in 0..rp {
        lane.bad[r] = (lane.check[r] != 0.0) as u32;
    }
}

/// [`softmax_tile`]'s scan of a tile with a per-key mask or a soft-cap (few tiles): row by row, the
/// masked scores replaced by -inf (whose weight is exactly 0), the soft-cap applied, `lane.cmax` and
/// `lane.bad` as [`scan_full`]'s.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scan_masked(s: &mut [f32], rp: usize, n: usize, p0: u32, (lo, hi): (&[u32], &[u32]), full: bool, softcap: f32, lane: &mut LaneState) {
    lane.bad.fill(0);
    lane.cmax.fill(f32::NEG_INFINITY);
    for j in 0..n {
        let row = &mut s[j * rp..(j + 1) * rp];
        let pos = p0 + j as u32;
        for r in 0..rp {
            let vis = full || (lo[r] <= pos && pos <= hi[r]);
            // (checked before the soft-cap, which would turn an infinity into a finite value)
            lane.bad[r] |= (vis && !row[r].is_finite()) as u32;
            let x = if softcap > 0.0 { softcap * (row[r] / softcap).tanh() } else { row[r] };
            row[r] = if vis { x } else { f32::NEG_INFINITY };
            lane.cmax[r] = lane.cmax[r].max(row[r]);
        }
    }
}

/// The per-row part of the update, from `lane.bad` and `lane.cmax`: poison, new maximum, rescale factor
/// `lane.alpha` (its exponentials in vectors, bit for bit [`fast_exp`]), and `lane.keep` (a bit mask) for rows that get
/// weight. Returns whether any does.
///
/// # Safety
/// The lane arrays hold `rp` rows, `rp % S::L == 0`.
#[inline(always)]
unsafe fn update_rows<S: Simd>(rp: usize, m: &mut [f32], l: &mut [f32], lane: &mut LaneState) -> bool {
    for r in 0..rp {
        let good = lane.bad[r] == 0 && lane.cmax[r] > f32::NEG_INFINITY;
        let m_new = if good { m[r].max(lane.cmax[r]) } else { m[r] };
        lane.diff[r] = if m_new > m[r] { m[r] - m_new } else { 0.0 };
    }
    for r0 in (0..rp).step_by(S::L) {
        S::store(lane.alpha.as_mut_ptr().add(r0), S::exp(S::load(lane.diff.as_ptr().add(r0))));
    }
    let mut any = false;
    for r in 0..rp {
        let good = lane.bad[r] == 0 && lane.cmax[r] > f32::NEG_INFINITY;
        if lane.bad[r] != 0 {
            l[r] = f32::NAN;
        }
        let m_new = if good { m[r].max(lane.cmax[r]) } else { m[r] };
        if !(good && m_new > m[r] && l[r] > 0.0) {
            lane.alpha[r] = 1.0;
        }
        l[r] *= lane.alpha[r];
        m[r] = m_new;
        lane.keep[r] = f32::from_bits(if good { u32::MAX } else { 0 });
        any |= good;
    }
    any
}

/// `s` replaced by the weights `exp(s - m)` of rows that get weight (0 elsewhere; a masked -inf gives
/// exactly 0; [`Simd::exp_weight`]), their sums added to `l`, in vectors across rows.
///
/// # Safety
/// `s` holds `n × rp`, the lane arrays `rp`, `rp % S::L == 0`.
#[inline(always)]
unsafe fn weights<S: Simd>(s: &mut [f32], rp: usize, n: usize, m: &[f32], l: &mut [f32], lane: &mut LaneState) {
    let sp = s.as_mut_ptr();
    for r0 in (0..rp).step_by(S::L) {
        let (mv, keep) = (S::load(m.as_ptr().add(r0)), S::load(lane.keep.as_ptr().add(r0)));
        let mut sum = S::zero();
        for j in 0..n {
            let p = sp.add(j * rp + r0);
            let e = S::exp_weight(S::sub(S::load(p), mv), keep);
            S::store(p, e);
            sum = S::add(sum, e);
        }
        S::store(lane.sum.as_mut_ptr().add(r0), sum);
    }
    for r in 0..rp {
        l[r] += lane.sum[r];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The classical bound on a sum of `n` rounded products accumulated in f32 (γ_n · Σ|terms|): a wrong
    /// index or a missed term is off by far more.
    fn bound(n: usize, mag: f64) -> f64 {
        (n + 1) as f64 * f32::EPSILON as f64 * mag + 1e-30
    }

    /// The micro-kernels of `S` against f64 on fresh random inputs, every row and column remainder.
    pub(crate) fn check_micro_kernels<S: Simd, const SV: usize, const SK: usize, const PR: usize, const PW: usize>() {
        let mut rng = crate::rng::Rng::new(crate::rng::Rng::fresh_seed());
        for d in [64usize, 80, 96, 112, 128, 192, 256] {
            for rows in [1usize, 3, 5, 6, 7, 16, 17, 31, 33, 63, 64] {
                let rp = rows.div_ceil(LANE_PAD) * LANE_PAD;
                let n = 1 + rng.below(KEY_TILE);
                let q: Vec<f32> = (0..rows * d).map(|_| rng.normal() as f32).collect();
                let k: Vec<f32> = (0..KEY_TILE * d).map(|_| rng.normal() as f32).collect();
                let mut qt = vec![0.0f32; d * rp];
                for r in 0..rows {
                    for c in 0..d {
                        qt[c * rp + r] = q[r * d + c];
                    }
                }
                let nk = n.div_ceil(SK) * SK;
                let kp: Vec<*const f32> = (0..nk).map(|j| k[(j % n) * d..].as_ptr()).collect();
                let mut s = vec![f32::NAN; KEY_TILE * rp];
                unsafe { scores_t::<S, SV, SK>(s.as_mut_ptr(), qt.as_ptr(), &kp, rp, d) };
                for j in 0..n {
                    for r in 0..rows {
                        let want: f64 = (0..d).map(|c| q[r * d + c] as f64 * k[j * d + c] as f64).sum();
                        let mag: f64 = (0..d).map(|c| (q[r * d + c] as f64 * k[j * d + c] as f64).abs()).sum();
                        let got = s[j * rp + r] as f64;
                        assert!((got - want).abs() <= bound(d, mag), "score d {d} rows {rows} ({j},{r}): {got} vs {want}");
                    }
                }
                let w: Vec<f32> = (0..KEY_TILE * rp).map(|_| rng.normal() as f32).collect();
                let acc0: Vec<f32> = (0..rows * d).map(|_| rng.normal() as f32).collect();
                let mut acc = acc0.clone();
                // The rescale factors, some exactly 1 (rows whose maximum did not move).
                let alpha: Vec<f32> = (0..rows).map(|r| if r % 3 == 0 { 1.0 } else { rng.uniform() as f32 }).collect();
                let vp: Vec<*const f32> = (0..n).map(|j| k[j * d..].as_ptr()).collect();
                unsafe { values::<S, PR, PW>(acc.as_mut_ptr(), w.as_ptr(), &vp, rows, rp, d, alpha.as_ptr()) };
                for r in 0..rows {
                    for c in 0..d {
                        let a0 = alpha[r] as f64 * acc0[r * d + c] as f64;
                        let want = a0 + (0..n).map(|j| w[j * rp + r] as f64 * k[j * d + c] as f64).sum::<f64>();
                        let mag = a0.abs() + (0..n).map(|j| (w[j * rp + r] as f64 * k[j * d + c] as f64).abs()).sum::<f64>();
                        let got = acc[r * d + c] as f64;
                        assert!((got - want).abs() <= bound(n + 2, mag), "value d {d} rows {rows} ({r},{c}): {got} vs {want}");
                    }
                }
            }
        }
    }

    /// `S::exp_weight` against f64's `exp` over the weights' whole range (a dense sweep of [-87, 0] and
    /// random points), exactly 0 below -87, at -inf and where the lane is not kept.
    pub(crate) fn check_exp_weight<S: Simd>() {
        let mut rng = crate::rng::Rng::new(crate::rng::Rng::fresh_seed());
        let mut xs: Vec<f32> = (0..=87_000).map(|i| -(i as f32) * 1e-3).collect();
        xs.extend((0..20_000).map(|_| -(rng.uniform() * 87.0) as f32));
        xs.extend([0.0, -0.0, -1e-30, -86.999, -87.0]);
        xs.retain(|&x| x >= -87.0);
        let mut worst = 0f64;
        for ch in xs.chunks(S::L) {
            let mut x = [0f32; 16];
            x[..ch.len()].copy_from_slice(ch);
            let ones = [f32::from_bits(u32::MAX); 16];
            let mut got = [0f32; 16];
            unsafe { S::store(got.as_mut_ptr(), S::exp_weight(S::load(x.as_ptr()), S::load(ones.as_ptr()))) };
            for (&g, &x) in got.iter().zip(&x[..ch.len()]) {
                let want = (x as f64).exp();
                worst = worst.max(((g as f64 - want) / want).abs());
            }
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        let x = [-87.001f32, -1000.0, f32::NEG_INFINITY, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0];
        let keep: [f32; 16] = std::array::from_fn(|l| f32::from_bits(if l < 3 || l % 2 == 0 { u32::MAX } else { 0 }));
        let mut got = [f32::NAN; 16];
        unsafe { S::store(got.as_mut_ptr(), S::exp_weight(S::load(x.as_ptr()), S::load(keep.as_ptr()))) };
        for l in 0..S::L {
            let want = if l >= 3 && l % 2 == 0 { (-1f32).exp() } else { 0.0 };
            assert!((got[l] - want).abs() <= 4e-7 * want && got[l].to_bits() & 0x8000_0000 == 0, "lane {l}: {}", got[l]);
        }
    }

    #[test]
    fn portable_micro_kernels_match_f64() {
        check_micro_kernels::<Lanes8, 4, 4, 4, 2>();
        check_exp_weight::<Lanes8>();
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_micro_kernels_match_f64() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn run() {
            check_micro_kernels::<crate::cpu::avx2::Ymm, 2, 4, 4, 2>();
            check_exp_weight::<crate::cpu::avx2::Ymm>()
        }
        unsafe { run() }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_micro_kernels_match_f64() {
        if !crate::cpu::avx512::available() {
            eprintln!("no AVX-512 on this CPU: the AVX-512 micro-kernels are not tested here");
            return;
        }
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        unsafe fn run() {
            check_micro_kernels::<crate::cpu::avx512::Zmm, 2, 8, 6, 4>();
            check_exp_weight::<crate::cpu::avx512::Zmm>()
        }
        unsafe { run() }
    }
}
