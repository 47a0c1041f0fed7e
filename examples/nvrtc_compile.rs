//! Compiles the kernel modules (the variants the dense path, the policies' selection and the cache
//! write use) with NVRTC for `KVS_ARCH` (default sm_90), without a GPU: kernels are compiled at run time
//! on the device, so a syntax error otherwise shows only there. NVRTC alone is enough, e.g. PyPI's
//! `nvidia-cuda-nvrtc` (`pip install --target /tmp/nvrtc nvidia-cuda-nvrtc`, then
//! `LD_LIBRARY_PATH=/tmp/nvrtc/nvidia/cu13/lib`). `KVS_LOG=1` prints ptxas' register and spill counts.
//! With a directory argument, the attention kernels (common.cuh, combine.cuh, attention.cu,
//! attention_mma.cu) are read from there instead, to compare with another commit's.
//! Usage: `cargo run --release --example nvrtc_compile [KERNEL_DIR]`; exits non-zero if any fails.

use kvsparse::cuda::launch;
use kvsparse::cuda::module_cache::cubin;
fn main() {
    let dir = std::env::args().nth(1);
    let rd = |f: &str| std::fs::read_to_string(format!("{}/{f}", dir.as_deref().unwrap())).unwrap();
    let (c_own, att_own, mma_own);
    let (common, att, mma): (&str, &str, &str) = if dir.is_some() {
        c_own = rd("common.cuh");
        att_own = format!("{}\n{}", rd("combine.cuh"), rd("attention.cu"));
        mma_own = format!("{}\n{}", rd("combine.cuh"), rd("attention_mma.cu"));
        (&c_own, &att_own, &mma_own)
    } else {
        (launch::COMMON, launch::ATTENTION, launch::ATTENTION_MMA)
    };
    let arch = std::env::var("KVS_ARCH").unwrap_or_else(|_| "sm_90".to_string());
    let mut fails = 0;
    let mut go = |name: &str, src: &str, defs: Vec<String>| {
        let mut opts: Vec<String> = defs.iter().map(|d| if d.starts_with("--") { d.clone() } else { format!("-D{d}") }).collect();
        opts.push("--std=c++17".into());
        opts.push("--ptxas-options=-v".into());
        let text = format!("{common}\n{src}");
        match cubin(name, &text, &opts, &arch) {
            Ok(b) => println!("ok {name} {defs:?} {} bytes", b.len()),
            Err(e) => { println!("FAIL {name} {defs:?}: {e}"); fails += 1; }
        }
    };
    for dt in [0, 1, 2] {
        for plan in [0, 1] {
            go("attention", att, vec![format!("KVS_DTYPE={dt}"), "HEAD_DIM=128".into(), "GQ=4".into(), "GROUP=4".into(), "LOAD_BYTES=16".into(), "KB=8".into(), format!("PLAN={plan}")]);
        }
    }
    for dt in [1, 2] {
        for (plan, art) in [(0, 0), (1, 0), (1, 1)] {
            go("attention_mma", mma, vec![format!("KVS_DTYPE={dt}"), "HEAD_DIM=128".into(), "GQ=4".into(), "GROUP=4".into(), "NWARPS=4".into(), "NSTAGE=3".into(), "L2_HINT=128".into(), format!("PLAN={plan}"), format!("ART={art}"), "ART_NOPROBE=0".into()]);
        }
    }
    go("cache_write", launch::CACHE_WRITE, vec!["KVS_DTYPE=1".into()]);
    go("slots", kvsparse::cuda::slots::SLOTS, vec![]);
    go("meta", launch::META, vec!["KVS_DTYPE=1".into(), "--fmad=false".into()]);
    go("merge", launch::MERGE, vec![]);
    go("select", launch::SELECT, vec!["KVS_DTYPE=1".into(), "HEAD_DIM=128".into(), "GROUP=4".into(), "--fmad=false".into()]);
    std::process::exit(fails);
}
