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

/// README's C example, built and run exactly as README.md says (its `cc` line is read from README.md, so
/// the two cannot drift), from a scratch directory laid out like the repository (`include`, `examples`,
/// `target/release` holding the library this test run built), without cargo's LD_LIBRARY_PATH: the rpath
/// of README's line must find the library. The program's excerpt in README must be lines of the file.
#[test]
fn readme_c_example_builds_and_runs_with_the_readme_command() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let example = std::fs::read_to_string(root.join("examples/c/decode.c")).unwrap();
    let cc_line = readme.lines().map(str::trim).find(|l| l.starts_with("cc ") && l.contains("examples/c/decode.c")).expect("README.md has the `cc ... examples/c/decode.c` line");
    let run_line = readme.lines().map(str::trim).find(|l| l.starts_with("./decode")).expect("README.md has the `./decode` line");

    // The ```c block of README's C section: each line (but `/* ... */` elisions) is a line of the file,
    // in the file's order.
    let block = readme.split("```c\n").nth(1).and_then(|b| b.split("```").next()).expect("README.md has a ```c block");
    let mut file_lines = example.lines();
    for line in block.lines().filter(|l| l.trim() != "/* ... */") {
        assert!(file_lines.any(|f| f == line), "README's C excerpt line {line:?} is not (in order) in examples/c/decode.c");
    }

    let dir = std::env::temp_dir().join(format!("kvs-readme-c-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("target")).unwrap();
    for (link, to) in [("include", root.join("include")), ("examples", root.join("examples")), ("target/release", lib_dir())] {
        std::os::unix::fs::symlink(to, dir.join(link)).unwrap();
    }
    let sh = |line: &str| Command::new("sh").arg("-c").arg(line).current_dir(&dir).env("PWD", &dir).env_remove("LD_LIBRARY_PATH").output().expect("sh runs");
    let built = sh(cc_line);
    assert!(built.status.success(), "README's line failed: {cc_line}\n{}", String::from_utf8_lossy(&built.stderr));
    let ran = sh(run_line);
    let stdout = String::from_utf8_lossy(&ran.stdout).to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(ran.status.success(), "{run_line} failed:\n{stdout}{}", String::from_utf8_lossy(&ran.stderr));
    // Layers 0 and 1 dense (Quest's default dense_layers=2); layers 2 and 3 read Quest's 8 blocks of each
    // (sequence, KV head) of the 51 it could: 32 of 102.
    let sparse: Vec<&str> = stdout.lines().filter(|l| l.contains("KV blocks")).collect();
    assert_eq!(stdout.lines().filter(|l| l.contains(": dense")).count(), 2, "{stdout}");
    assert_eq!(sparse, ["layer 2: read 32 of 102 KV blocks", "layer 3: read 32 of 102 KV blocks"], "{stdout}");
}
