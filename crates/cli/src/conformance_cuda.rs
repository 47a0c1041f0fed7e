//! The CUDA half of `kvsparse conformance`: the same matrix on CUDA device 0 when one is present, plus
//! the CUDA-graph replay case, and a line saying how many kernel modules this process compiled versus
//! loaded from the disk cache (a second process should compile none).

use std::time::Instant;

use kvsparse_conformance::cuda::{cuda_required, cuda_session, graph_replay, run_case_cuda};
use kvsparse_conformance::sparse::{self, ContractResult};
use kvsparse_conformance::{suite, CaseResult, CaseSpec};
use kvsparse::cuda::module_cache;
use kvsparse::DType;

use crate::conformance::{print_contract, print_row, selected};

pub fn run_matrix(quick: bool, seed: u64, filter: &str) -> Result<Vec<(String, CaseResult)>, String> {
    if !kvsparse::cuda::device_available() {
        if cuda_required() {
            return Err("KVS_REQUIRE_CUDA=1 but no CUDA driver/device is available".into());
        }
        println!("cuda: no device, skipped (KVS_REQUIRE_CUDA=1 makes this a failure)");
        return Ok(Vec::new());
    }
    let t0 = Instant::now();
    let mut results = Vec::new();
    for (i, spec) in suite(quick).iter().filter(|c| selected(&c.name, filter)).enumerate() {
        let r = run_case_cuda(spec, seed.wrapping_add(i as u64));
        if i == 0 {
            let (c, d) = module_cache::counts();
            println!("cuda: first case done in {:.0} ms ({c} kernel modules compiled, {d} loaded from the disk cache)", t0.elapsed().as_secs_f64() * 1e3);
        }
        print_row("cuda", &r);
        results.push(("cuda".to_string(), r));
    }
    if selected("graph-decode", filter) {
        let spec = CaseSpec::new("graph-decode-bf16-gqa4", DType::BF16, 128, 32, 8, 16, vec![(1, 4000), (1, 1), (1, 17), (1, 1500)]);
        for r in graph_replay(&spec, seed, seed.wrapping_add(7919)) {
            print_row("cuda", &r);
            results.push(("cuda".to_string(), r));
        }
    }
    let (c, d) = module_cache::counts();
    let dir = module_cache::cache_dir().map(|p| p.display().to_string()).unwrap_or_else(|| "off".into());
    println!("cuda: kernel modules compiled {c}, loaded from disk cache {d} (cache: {dir})");
    Ok(results)
}

/// The sparse contract on CUDA device 0 when one is present.
pub fn run_sparse(seed: u64, filter: &str) -> Result<Vec<ContractResult>, String> {
    if !kvsparse::cuda::device_available() {
        if cuda_required() {
            return Err("KVS_REQUIRE_CUDA=1 but no CUDA driver/device is available".into());
        }
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for check in sparse::checks(seed).into_iter().filter(|c| selected(&c.name, filter)) {
        let r = check.run(&mut cuda_session);
        print_contract("cuda", &r);
        out.push(r);
    }
    Ok(out)
}
