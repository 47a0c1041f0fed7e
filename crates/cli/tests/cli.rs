//! The `kvsparse` command line as a new user meets it (issue 29): it ends quietly on a closed pipe, rejects
//! an empty policy and a filter that matches nothing with a message, explains every option its usage line
//! names, reports unsupported cases without repeating the word, and `eval`'s printed counts match its table
//! and CSV (a setting in both the table and the sweep is measured once).

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};

fn kvsparse(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvsparse")).args(args).current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).output().expect("run kvsparse")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `kvsparse ARGS | head -0`: stdout is a pipe whose reading end is already closed, so the first write
/// fails (EPIPE / SIGPIPE). Returns the exit status and stderr.
fn with_closed_stdout(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut fds = [0; 2];
    // SAFETY: pipe() fills two fresh descriptors; the reading one is closed at once, the writing one is
    // owned by the OwnedFd (handed to the child's stdout, closed here after the spawn).
    let write_end = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0, "pipe()");
        libc::close(fds[0]);
        OwnedFd::from_raw_fd(fds[1])
    };
    let out = Command::new(env!("CARGO_BIN_EXE_kvsparse"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .stdout(Stdio::from(write_end))
        .stderr(Stdio::piped())
        .output()
        .expect("run kvsparse");
    (out.status, text(&out.stderr))
}

#[test]
fn a_closed_pipe_ends_the_command_quietly() {
    for args in [&["help"][..], &["bench", "--help"], &["conformance", "--quick", "--dense-only", "--seed", "1"], &["eval", "--only", "needle_2k", "--stride", "8"]] {
        let (status, stderr) = with_closed_stdout(args);
        assert!(!stderr.contains("panicked") && !stderr.contains("failed printing"), "kvsparse {args:?} | (closed): {stderr}");
        // Ended by SIGPIPE, as `cat` is (the shell reports 141), or a clean exit.
        assert!(status.signal() == Some(libc::SIGPIPE) || status.success(), "kvsparse {args:?} | (closed): {status:?}\n{stderr}");
    }
}

#[test]
fn an_empty_policy_is_rejected_with_a_message() {
    for args in [&["bench", "--policy", ""][..], &["bench", "--policy", "quest(budget=64)", "--policy", " "], &["eval", "--policy", ""]] {
        let out = kvsparse(args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "kvsparse {args:?}: {stderr}");
        assert!(stderr.contains("empty policy spec"), "kvsparse {args:?}: {stderr}");
        assert!(!text(&out.stdout).contains("| `"), "kvsparse {args:?} printed a table: {}", text(&out.stdout));
    }
}

#[test]
fn a_filter_that_matches_nothing_is_an_error() {
    for args in [&["conformance", "--filter", "nothingmatches"][..], &["conformance", "--quick", "--dense-only", "--filter", "nothingmatches"]] {
        let out = kvsparse(args);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "kvsparse {args:?} exited 0");
        assert!(stderr.contains("--filter \"nothingmatches\" matches no case"), "kvsparse {args:?}: {stderr}");
        assert!(!text(&out.stdout).contains("passed,"), "kvsparse {args:?} ran something: {}", text(&out.stdout));
    }
}

/// Every `--option` a command's usage line names has a line of its own that says what it does.
#[test]
fn help_explains_every_option_of_the_usage_line() {
    for cmd in ["conformance", "bench", "eval"] {
        let out = kvsparse(&[cmd, "--help"]);
        assert!(out.status.success(), "{cmd} --help");
        let help = text(&out.stdout);
        let usage = help.lines().next().unwrap();
        let named: Vec<&str> = usage.split(|c: char| c.is_whitespace() || "[]|".contains(c)).filter(|w| w.starts_with("--")).collect();
        for opt in named {
            let explained = help.lines().any(|l| l.trim_start().starts_with(opt) && l.trim_start()[opt.len()..].trim().len() > 8);
            assert!(explained, "`kvsparse {cmd} --help` names {opt} but does not explain it:\n{help}");
        }
    }
    let help = text(&kvsparse(&["conformance", "--help"]).stdout);
    for opt in ["--quick", "--seed"] {
        assert!(help.lines().any(|l| l.starts_with(&format!("  {opt} "))), "conformance --help does not explain {opt}:\n{help}");
    }
}

#[test]
fn an_unsupported_case_says_why_once() {
    let out = kvsparse(&["conformance", "--quick", "--dense-only", "--seed", "1", "--filter", "ext-h32"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let line = stdout.lines().find(|l| l.contains("ext-h32")).unwrap_or_else(|| panic!("no ext-h32 case:\n{stdout}"));
    assert!(line.contains("unsupported: head_dim 32 is not supported"), "{line}");
    assert!(!line.to_lowercase().contains("unsupported: unsupported"), "{line}");
}

/// `eval --out` on one short trace: the counts it prints are the table's rows, the CSV's sweep rows and the
/// distinct specs replayed; a policy in both the table and the sweep has one measurement (the same CSV
/// figures, time included).
#[test]
fn eval_counts_match_its_table_and_csv() {
    let dir = std::env::temp_dir().join(format!("kvs-cli-eval-{}", std::process::id()));
    let out = kvsparse(&["eval", "--only", "needle_2k", "--stride", "8", "--out", dir.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let csv = std::fs::read_to_string(dir.join("eval.csv")).unwrap();
    let png = std::fs::read(dir.join("eval.png")).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(png.starts_with(b"\x89PNG"), "eval.png is not a PNG");

    // (set, policy, the figures after set,policy,family,knob,value,trace) of the pooled rows.
    let pooled: Vec<(String, String, String)> = csv
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f = split_csv(l);
            (f[5] == "all").then(|| (f[0].clone(), f[1].clone(), f[6..].join(",")))
        })
        .collect();
    let table: Vec<_> = pooled.iter().filter(|r| r.0 == "table").collect();
    let sweep: Vec<_> = pooled.iter().filter(|r| r.0 == "sweep").collect();
    let shared: Vec<_> = sweep.iter().filter(|s| table.iter().any(|t| t.1 == s.1)).collect();
    let mut distinct: Vec<&String> = pooled.iter().map(|r| &r.1).collect();
    distinct.sort();
    distinct.dedup();
    let expect = format!(
        "{} table rows (dense + {} policy settings), {} sweep settings for the plot ({} also in the table: one replay, one measurement); replays per trace: {} (one per distinct spec)",
        table.len(),
        table.len() - 1,
        sweep.len(),
        shared.len(),
        distinct.len()
    );
    assert!(stdout.contains(&expect), "expected {expect:?} in:\n{stdout}");
    assert_eq!(stdout.lines().filter(|l| l.starts_with("| `")).count(), table.len(), "table rows printed:\n{stdout}");
    assert!(!shared.is_empty(), "the default table and sweep share settings (e.g. quest(budget=512))");
    for s in shared {
        let t = table.iter().find(|t| t.1 == s.1).unwrap();
        assert_eq!(t.2, s.2, "{}: the table's and the sweep's figures differ", s.1);
    }
}

/// Splits one CSV line of eval.csv (quoted fields may hold commas; `""` is a quote).
fn split_csv(line: &str) -> Vec<String> {
    let (mut fields, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => fields.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    fields.push(cur);
    fields
}
