//! `kvsparse`: the command-line face of the library — demo, conformance, benchmarks and evaluation.
//! Each subcommand lives in its own module; this file only dispatches.

mod args;
mod bench;
mod bench_cuda;
mod bench_prefill;
mod cuda_bench;
mod cuda_prefill_bench;
mod conformance;
mod conformance_cuda;
mod demo;
mod eval;
mod fma_peak;
mod plot;

use std::process::ExitCode;

const USAGE: &str = "usage: kvsparse <command> [options]

commands:
  demo          synthetic long-context decode batch on the CPU: tokens/s, GB/s of KV read vs the
                machine's streaming-read bandwidth, max error vs a float64 reference
  eval          replay the real attention traces (traces/) for dense and each policy: blocks visited,
                error vs dense, attention mass recovered, time; --out DIR adds a sweep, CSV and PNG
  conformance   paged attention vs the float64 reference over the case suite (per device, or through
                another library's C ABI with --lib), the sparse contract of the policies; --export DIR
                writes the suite as files for other implementations (docs/conformance.md)
  bench         dense vs decode policies (--policy SPEC) on one synthetic batch: time, KV bytes,
                blocks visited, relative error vs dense; with --device cuda: paged decode on the GPU
                over a grid vs the device copy bandwidth; with --prefill: CPU prompt-chunk attention in
                GFLOP/s vs the machine's measured f32 FMA peak

run `kvsparse <command> --help` for the options of a command";

fn main() -> ExitCode {
    quiet_on_closed_pipe();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = argv.first() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let rest = &argv[1..];
    let result = match cmd.as_str() {
        "demo" => demo::run(rest),
        "eval" => eval::run(rest),
        "conformance" => conformance::run(rest),
        "bench" if rest.iter().any(|a| a == "cuda" || a == "--device=cuda") => bench_cuda::run(rest),
        "bench" if rest.iter().any(|a| a == "--prefill") => bench_prefill::run(rest),
        "bench" => bench::run(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command {other:?}\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("kvsparse {cmd}: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// `kvsparse ... | head -1`: Rust ignores SIGPIPE, so a write to a closed pipe is an error and `println!`
/// panics ("failed printing to stdout"). A command-line tool ends quietly instead, as `cat` does: restore
/// the default action (the process ends on SIGPIPE, the shell reports 141).
fn quiet_on_closed_pipe() {
    // SAFETY: setting a signal's disposition to the default at start-up, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
