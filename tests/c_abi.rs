//! Compiles the C programs in tests/c/ with `cc -std=c11 -Wall -Werror` against include/kvsparse.h only,
//! links them to the built cdylib and runs them. Set KVS_VALGRIND=1 to run the program under valgrind (CI does once).

use std::path::PathBuf;
use std::process::Command;

/// Directory holding libkvsparse.so: `cargo test` leaves it next to the test binary in
/// target/<profile>/deps/; `cargo build` also copies it up to target/<profile>/.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    let profile = deps.parent().unwrap().to_path_buf();
    [deps, profile].into_iter().find(|d| d.join("libkvsparse.so").exists()).expect("libkvsparse.so next to the test binary")
}

/// Compiles `tests/c/<name>.c` against the header, links the cdylib, runs it (under valgrind with
/// KVS_VALGRIND=1) and expects its "N passed, 0 failed" line.
fn run_c_program(name: &str) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = lib_dir();
    let bin = lib_dir.join(format!("kvs_{name}"));
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-D_POSIX_C_SOURCE=199309L", "-Wall", "-Wextra", "-Werror", "-O1", "-g"])
        .arg("-I")
        .arg(root.join("include"))
        .arg(root.join(format!("tests/c/{name}.c")))
        .arg("-o")
        .arg(&bin)
        .arg("-L")
        .arg(&lib_dir)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lkvsparse", "-lm"])
        .status()
        .expect("a C compiler (cc) is installed");
    assert!(status.success(), "{name}.c failed to compile");
    let mut cmd = if std::env::var_os("KVS_VALGRIND").is_some() {
        let mut c = Command::new("valgrind");
        c.args(["--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=definite"]).arg(&bin);
        c
    } else {
        Command::new(&bin)
    };
    // cargo's LD_LIBRARY_PATH may list target/<profile>/ (an older `cargo build`) before deps/: make the
    // program load the library it was linked against.
    cmd.env("LD_LIBRARY_PATH", &lib_dir);
    let out = cmd.output().expect("run the C test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{name} failed:\n{stdout}");
    assert!(stdout.contains(" passed, 0 failed"), "unexpected output:\n{stdout}");
}

#[test]
fn c_program_against_the_header_and_cdylib() {
    run_c_program("abi_test");
}

/// Issue 12's classes from C: overflowing sizes, limits, deep specs, aliasing layouts, broadcast inputs
/// with huge extents, NaN and infinity (each bad call: its status, quickly, nothing written).
#[test]
fn c_hardening_cases() {
    run_c_program("hardening_test");
}
