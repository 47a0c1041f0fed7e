//! A deliberately small `--key value` / `--flag` parser: the CLI has few options, and every one of them
//! is listed in its command's help text, so unknown options are errors, never silently ignored.

use std::collections::HashMap;
use std::str::FromStr;

pub struct Args {
    values: HashMap<String, Vec<String>>,
    flags: Vec<String>,
}

impl Args {
    /// Parses `argv` given the option names that take a value and the flags; anything else is an error.
    pub fn parse(argv: &[String], with_value: &[&str], flags: &[&str], help: &str) -> Result<Args, String> {
        let mut a = Args { values: HashMap::new(), flags: Vec::new() };
        let mut i = 0;
        while i < argv.len() {
            let arg = &argv[i];
            if arg == "-h" || arg == "--help" {
                println!("{help}");
                std::process::exit(0);
            }
            let Some(name) = arg.strip_prefix("--") else {
                return Err(format!("unexpected argument {arg:?}\n\n{help}"));
            };
            let (name, inline) = match name.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (name, None),
            };
            if with_value.contains(&name) {
                let v = match inline {
                    Some(v) => v,
                    None => {
                        i += 1;
                        argv.get(i).cloned().ok_or_else(|| format!("--{name} needs a value"))?
                    }
                };
                a.values.entry(name.to_string()).or_default().push(v);
            } else if flags.contains(&name) && inline.is_none() {
                a.flags.push(name.to_string());
            } else {
                return Err(format!("unknown option --{name}\n\n{help}"));
            }
            i += 1;
        }
        Ok(a)
    }

    pub fn flag(&self, name: &str) -> bool {
        self.flags.iter().any(|f| f == name)
    }

    /// Every value given for a repeatable option, in order.
    pub fn values_of(&self, name: &str) -> Vec<String> {
        self.values.get(name).cloned().unwrap_or_default()
    }

    pub fn str(&self, name: &str) -> Option<&str> {
        self.values.get(name).and_then(|v| v.last()).map(|s| s.as_str())
    }

    /// The last value of `name` parsed as `T`, or `default`.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> Result<T, String> {
        match self.str(name) {
            None => Ok(default),
            Some(s) => s.parse().map_err(|_| format!("--{name}: cannot parse {s:?}")),
        }
    }
}

/// The `--policy` values. An empty spec would be dense again under an empty name (dense always runs as
/// the reference), so it is an error, not a silent extra row.
pub fn policies(a: &Args) -> Result<Vec<String>, String> {
    let v = a.values_of("policy");
    match v.iter().find(|p| p.trim().is_empty()) {
        Some(p) => Err(format!("--policy {p:?}: empty policy spec (dense always runs first as the reference; docs/policies.md lists the policies)")),
        None => Ok(v),
    }
}

/// Parses a dtype name as the CLI spells it.
pub fn dtype(s: &str) -> Result<kvsparse::DType, String> {
    match s {
        "f32" | "float32" => Ok(kvsparse::DType::F32),
        "f16" | "float16" | "half" => Ok(kvsparse::DType::F16),
        "bf16" | "bfloat16" => Ok(kvsparse::DType::BF16),
        other => Err(format!("unknown dtype {other:?} (use f32, f16 or bf16)")),
    }
}
