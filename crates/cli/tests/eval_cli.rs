//! The `kvsparse` binary's eval command end to end on the committed traces.

use std::path::PathBuf;

fn traces_dir() -> Option<PathBuf> {
    kvsparse_conformance::traces::committed_traces_dir()
}

/// `kvsparse eval --out`: the table names every requested policy, the CSV has a pooled row per policy
/// and setting with the same blocks-visited figure as the table, and the PNG is a PNG.
#[test]
fn eval_cli_writes_table_csv_and_png() {
    let Some(dir) = traces_dir() else { return };
    let out = std::env::temp_dir().join(format!("kvsparse-eval-{}", std::process::id()));
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kvsparse"))
        .args(["eval", "--traces"])
        .arg(&dir)
        .args(["--only", "needle_2k", "--stride", "8", "--threads", "2", "--policy", "quest(budget=256)", "--policy", "snapkv(budget=256)", "--out"])
        .arg(&out)
        .output()
        .expect("run kvsparse eval");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "eval failed: {stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    for p in ["`dense`", "`quest(budget=256)`", "`snapkv(budget=256)`"] {
        assert!(stdout.lines().any(|l| l.starts_with(&format!("| {p} |"))), "table lacks {p}:\n{stdout}");
    }
    let csv = std::fs::read_to_string(out.join("eval.csv")).expect("eval.csv");
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no column {name}"));
    // Fields split on commas outside double quotes (policy specs hold commas).
    let split = |l: &str| -> Vec<String> {
        let (mut fields, mut cur, mut quoted) = (Vec::new(), String::new(), false);
        for ch in l.chars() {
            match ch {
                '"' => quoted = !quoted,
                ',' if !quoted => fields.push(std::mem::take(&mut cur)),
                c => cur.push(c),
            }
        }
        fields.push(cur);
        fields
    };
    let pooled: Vec<Vec<String>> = csv.lines().skip(1).map(split).filter(|f| f[col("trace")] == "all").collect();
    assert!(pooled.iter().all(|f| f.len() == header.len()));
    let table = pooled.iter().filter(|f| f[0] == "table").count();
    let sweep = pooled.iter().filter(|f| f[0] == "sweep").count();
    assert_eq!(table, 3, "dense + 2 policies");
    assert!(sweep >= 30, "the sweep has {sweep} settings");
    let quest = pooled.iter().find(|f| f[0] == "table" && f[1] == "quest(budget=256)").expect("quest row");
    let visited: f64 = quest[col("visited_pct")].parse().unwrap();
    assert!(visited > 0.0 && visited < 100.0);
    assert!(stdout.contains(&format!("| {visited:.1}% |")), "CSV visited {visited} not in the table");
    let png = std::fs::read(out.join("eval.png")).expect("eval.png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 20_000, "a plot with curves and text is larger than {} bytes", png.len());
    let _ = std::fs::remove_dir_all(&out);
}
