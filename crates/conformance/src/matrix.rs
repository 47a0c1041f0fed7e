//! The case matrix, deterministic given a seed: every head size × dtype on a mixed batch, every block size
//! at its boundaries, GQA ratios with window and soft-cap, and serving batches that combine prefix sharing,
//! reused blocks, NaN in unwritten slots and strided views. `extended` adds cases outside what kvsparse
//! serves (other implementations do), so exported suites hold them and kvsparse reports them unsupported.

use super::fixture::{CaseSpec, Columns, Poison};
use kvsparse::config::SUPPORTED_HEAD_DIMS;
use kvsparse::tensor::DType;

pub fn dtype_tag(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F8E4M3 => "e4m3",
        DType::F8E5M2 => "e5m2",
        _ => "?",
    }
}

/// The cases kvsparse serves. `quick` keeps one representative per axis (for sanitizers and smoke runs).
pub fn matrix(quick: bool) -> Vec<CaseSpec> {
    let mut cases = Vec::new();
    // 1. Every head size × dtype, a mixed batch: decode at 1000+, q=2, q=7, whole prefill, chunked q=64.
    //    Rotating through NaN in unwritten slots, a shared prefix (4 blocks), and reused blocks.
    let dtypes = [DType::F32, DType::F16, DType::BF16];
    for (i, &hd) in SUPPORTED_HEAD_DIMS.iter().enumerate() {
        for (j, &dt) in dtypes.iter().enumerate() {
            if quick && (i + j) % 4 != 0 {
                continue;
            }
            // Block size 16 (GPU engines' default) except fp16 at 32 (the smallest vLLM's CPU kernel declares).
            let bs = if dt == DType::F16 { 32 } else { 16 };
            let mut c = CaseSpec::new(format!("mixed-h{hd}-{}-gqa4-bs{bs}", dtype_tag(dt)), dt, hd, 8, 2, bs, vec![(1, 1037), (2, 40), (7, 300), (96, 96), (64, 1100)]);
            c.strided = (i + j) % 2 == 1;
            match (i + j) % 3 {
                0 => c.poison = Poison::NaN,
                1 => c.shared_prefix_blocks = 4,
                _ => c.reused = true,
            }
            if j == 2 {
                c.columns = Columns::Pad;
            }
            if c.strided {
                c.name.push_str("-strided");
            }
            cases.push(c);
        }
    }
    // 2. Every block size: sequence lengths 1, bs-1, bs+1 and 1000+, decode and short prefill rows; the
    //    tails of partly filled blocks hold NaN or an earlier sequence's rows.
    for (k, bs) in [1usize, 2, 4, 8, 16, 32, 64, 128, 256].into_iter().enumerate() {
        if quick && ![1, 16, 256].contains(&bs) {
            continue;
        }
        let mut seqs = vec![(1, 1), (1, bs + 1), (2, bs + 1), (1, 1029)];
        if bs > 1 {
            seqs.push((1, bs - 1));
        }
        let mut c = CaseSpec::new(format!("blocks-bs{bs}-f16-gqa8"), DType::F16, 128, 8, 1, bs, seqs);
        c.strided = bs % 32 == 0;
        if k % 2 == 0 {
            c.poison = Poison::NaN;
        } else {
            c.reused = true;
        }
        if [8, 32, 128].contains(&bs) {
            c.shared_prefix_blocks = 1;
        }
        cases.push(c);
    }
    // 3. GQA ratios 1, 4, 8 with sliding window and soft-cap, in fp32 (tightest tolerance).
    for (hq, hk) in [(4usize, 4usize), (8, 2), (16, 2)] {
        let g = hq / hk;
        let seqs = vec![(1, 777), (7, 200), (64, 64), (1, 17)];
        let mut c = CaseSpec::new(format!("window-gqa{g}-f32"), DType::F32, 64, hq, hk, 16, seqs.clone());
        c.window = 100;
        c.poison = Poison::NaN;
        cases.push(c);
        let mut c = CaseSpec::new(format!("softcap-gqa{g}-f32-strided"), DType::F32, 128, hq, hk, 16, seqs.clone());
        c.softcap = 30.0;
        c.strided = true;
        c.columns = Columns::Pad;
        cases.push(c);
        if !quick {
            let mut c = CaseSpec::new(format!("window-softcap-gqa{g}-bf16"), DType::BF16, 96, hq, hk, 32, seqs);
            c.window = 33;
            c.softcap = 5.0;
            c.reused = true;
            cases.push(c);
        }
    }
    // 4. GQA 3 (SmolLM2's 9/3 heads, head 64) in vLLM's CPU block size 128 over a strided cache: query
    //    rows per KV head 3 (decode), 6, 9, 21 and 30 (prefill tiles), so every row-block remainder of the
    //    CPU kernels (4 + 3, 2 or 1) meets keys in full and partial chunks.
    //    Also over head-major blocks (vLLM's CPU layout, which the CPU kernel reads a block's worth of
    //    chunks per head at a time), where a window makes spans start inside a block.
    for head_major in [false, true] {
        for (dt, win) in [(DType::F32, 0usize), (DType::BF16, 0), (DType::F32, 300)] {
            // Quick: f32 without a window in both layouts, and head-major with a window.
            if quick && !(dt == DType::F32 && (win == 0 || head_major)) {
                continue;
            }
            let seqs = vec![(1, 2100), (2, 130), (3, 77), (7, 300), (1, 1), (40, 200)];
            let hm = if head_major { "-headmajor" } else { "" };
            let mut c = CaseSpec::new(format!("gqa3-bs128-{}{}{hm}-strided", dtype_tag(dt), if win > 0 { "-window" } else { "" }), dt, 64, 9, 3, 128, seqs);
            c.window = win;
            c.strided = true;
            c.head_major = head_major;
            cases.push(c);
        }
    }
    // The Llama-8B shape's group and head size over head-major blocks of 64 (f16, decode and a prefill).
    let mut c = CaseSpec::new("gqa4-h128-bs64-f16-headmajor", DType::F16, 128, 16, 4, 64, vec![(1, 1500), (1, 65), (33, 400), (1, 64)]);
    c.head_major = true;
    cases.push(c);
    // 5. In-order (unshuffled) table, MQA, single decode row of length 1.
    let mut c = CaseSpec::new("mqa-inorder-f32", DType::F32, 256, 8, 1, 8, vec![(1, 1), (3, 3), (1, 2048)]);
    c.shuffled = false;
    c.columns = Columns::Pad;
    cases.push(c);
    // 6. Serving batches: everything at once.
    cases.extend(serving(quick));
    cases
}

/// Batches as a serving engine builds them: many sequences sharing a cached prefix, decode rows next to
/// chunked prefill, blocks reused from finished sequences, NaN where nothing was written.
fn serving(quick: bool) -> Vec<CaseSpec> {
    let mut out = Vec::new();
    let mut c = CaseSpec::new("serving-prefix-f16-gqa4-strided", DType::F16, 128, 16, 4, 16, vec![(1, 2100), (1, 700), (32, 2000), (1, 520), (5, 530), (1, 17)]);
    c.shared_prefix_blocks = 32;
    c.poison = Poison::NaN;
    c.reused = true;
    c.strided = true;
    out.push(c);
    if quick {
        return out;
    }
    let mut c = CaseSpec::new("serving-prefix-bf16-h256-window-softcap", DType::BF16, 256, 8, 4, 32, vec![(1, 1500), (16, 900), (1, 600)]);
    c.shared_prefix_blocks = 8;
    c.window = 512;
    c.softcap = 50.0;
    c.poison = Poison::NaN;
    c.columns = Columns::Pad;
    c.reused = true;
    out.push(c);
    let lens = [1, 2, 15, 16, 17, 31, 33, 100, 255, 256, 257, 600, 1023, 1024, 1025, 3000];
    let mut c = CaseSpec::new("serving-decode-f32-mqa-strided", DType::F32, 64, 8, 1, 16, lens.iter().map(|&l| (1, l)).collect());
    c.shared_prefix_blocks = 1;
    c.poison = Poison::NaN;
    c.reused = true;
    c.strided = true;
    out.push(c);
    out
}

/// Cases kvsparse does not serve but other kernels do: head size 32 (small models) and a block size that
/// is not a power of two (vLLM sizes attention blocks of hybrid models to match their state pages).
pub fn extended() -> Vec<CaseSpec> {
    let mut a = CaseSpec::new("ext-h32-f16-gqa4", DType::F16, 32, 16, 4, 16, vec![(1, 900), (9, 300), (1, 33)]);
    a.poison = Poison::NaN;
    let mut b = CaseSpec::new("ext-bs544-bf16-gqa4", DType::BF16, 128, 8, 2, 544, vec![(1, 1200), (9, 600), (1, 30)]);
    b.poison = Poison::NaN;
    b.reused = true;
    vec![a, b]
}

/// FP8 caches (vLLM's `kv_cache_dtype="fp8"`/`"fp8_e5m2"`) under f32, f16 and bf16 queries: mixed
/// batches, decode, GQA/MQA, windows, soft-caps, NaN in unwritten slots, shared and reused blocks, strided
/// and head-major caches; scales near calibrated ones, so the loudest keys saturate on write. The
/// reference reads the dequantized cache; `quick` keeps one case per FP8 format.
pub fn fp8(quick: bool) -> Vec<CaseSpec> {
    let mixed = vec![(1, 1037), (2, 40), (7, 300), (96, 96), (64, 1100)];
    let mut out = Vec::new();
    let mut add = |cache: DType, dt: DType, hd: usize, hq: usize, hk: usize, bs: usize, seqs: Vec<(usize, usize)>, tweak: &dyn Fn(&mut CaseSpec)| {
        let mut c = CaseSpec::new(format!("fp8-{}-h{hd}-{}-q{hq}k{hk}-bs{bs}", dtype_tag(cache), dtype_tag(dt)), dt, hd, hq, hk, bs, seqs);
        c.cache_dtype = Some(cache);
        tweak(&mut c);
        if c.strided {
            c.name.push_str("-strided");
        }
        out.push(c);
    };
    add(DType::F8E4M3, DType::BF16, 128, 8, 2, 16, mixed.clone(), &|c| {
        c.poison = Poison::NaN;
        c.shared_prefix_blocks = 4;
    });
    add(DType::F8E5M2, DType::F16, 128, 8, 2, 16, mixed.clone(), &|c| c.reused = true);
    if !quick {
        add(DType::F8E4M3, DType::F16, 64, 16, 2, 32, vec![(1, 2000), (1, 17), (1, 513), (1, 32)], &|c| {
            c.strided = true;
            c.reused = true;
            c.softcap = 30.0;
        });
        add(DType::F8E4M3, DType::F32, 256, 4, 4, 16, mixed.clone(), &|c| {
            c.head_major = true;
            c.columns = Columns::Pad;
        });
        add(DType::F8E4M3, DType::BF16, 80, 8, 1, 1, vec![(1, 300), (5, 40), (1, 7)], &|c| c.poison = Poison::NaN);
        add(DType::F8E5M2, DType::BF16, 96, 12, 4, 64, mixed.clone(), &|c| {
            c.window = 200;
            c.head_major = true;
        });
        // The head sizes of the CUDA kernel's FP8 fragment paths: whole 32-channel groups (64, 256) and a
        // trailing 16-channel pair of tiles (112), MHA and GQA 8.
        add(DType::F8E4M3, DType::BF16, 256, 16, 2, 16, vec![(1, 3000), (3, 64), (1, 100)], &|_| {});
        add(DType::F8E5M2, DType::F16, 112, 8, 8, 16, vec![(1, 700), (1, 33), (2, 90)], &|_| {});
        add(DType::F8E4M3, DType::BF16, 64, 32, 4, 16, mixed.clone(), &|c| c.softcap = 50.0);
    }
    out
}

/// The whole suite: `matrix`, `fp8` then `extended`.
pub fn suite(quick: bool) -> Vec<CaseSpec> {
    let mut v = matrix(quick);
    v.extend(fp8(quick));
    v.extend(extended());
    v
}
