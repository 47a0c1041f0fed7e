//! Compiles tests/c/abi_test.c with `cc -std=c11 -Wall -Werror` against include/kvsparse.h only, links it
//! to the built cdylib and runs it. Set KVS_VALGRIND=1 to run the program under valgrind (CI does once).

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

#[test]
fn c_program_against_the_header_and_cdylib() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = lib_dir();
    let bin = lib_dir.join("kvs_abi_test");
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g"])
        .arg("-I")
        .arg(root.join("include"))
        .arg(root.join("tests/c/abi_test.c"))
        .arg("-o")
        .arg(&bin)
        .arg("-L")
        .arg(&lib_dir)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lkvsparse", "-lm"])
        .status()
        .expect("a C compiler (cc) is installed");
    assert!(status.success(), "C test failed to compile");
    let mut cmd = if std::env::var_os("KVS_VALGRIND").is_some() {
        let mut c = Command::new("valgrind");
        c.args(["--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=definite"]).arg(&bin);
        c
    } else {
        Command::new(&bin)
    };
    let out = cmd.output().expect("run the C test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "C ABI test failed:\n{stdout}");
    assert!(stdout.contains(" passed, 0 failed"), "unexpected output:\n{stdout}");
}
