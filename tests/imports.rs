//! No import circle between the library's files: a file that names another file's items (`use crate::...`,
//! `super::...`, or a path written inline) must not be named back by it, directly or through others; and
//! the engine reaches the backends only through their trait and registry (src/backend/mod.rs).
//!
//! Paths are resolved to files by the module tree (src/a/b.rs or src/a/b/mod.rs), following a module's
//! `pub use` re-exports to the file that defines the item. `mod x;` declarations are not uses.
//! `cargo test --release --test imports -- --nocapture` prints the graph's cycles when there are some.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path (without `crate`) -> file, for every .rs file under src/.
fn modules(root: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.join("src")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("read src") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(root.join("src")).expect("under src");
                let mut segs: Vec<String> = rel.iter().map(|s| s.to_string_lossy().trim_end_matches(".rs").to_string()).collect();
                if matches!(segs.last().map(String::as_str), Some("mod") | Some("lib")) {
                    segs.pop();
                }
                out.insert(segs, p);
            }
        }
    }
    out
}

/// The code of a file without comments, string literals (so doc text naming a path is not a use) and
/// `#[cfg(test)] mod` blocks (a test module's `super` is its own file).
fn code_of(text: &str) -> String {
    let text = &without_test_modules(text);
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut s = String::new();
        let mut in_str = false;
        let mut prev = ' ';
        let chars: Vec<char> = line.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            if !in_str && c == '/' && chars.get(i + 1) == Some(&'/') {
                break;
            }
            if c == '"' && prev != '\\' && !(prev == '\'' && chars.get(i + 1) == Some(&'\'')) {
                in_str = !in_str;
            } else if !in_str {
                s.push(c);
            }
            prev = c;
            i += 1;
        }
        out.push_str(&s);
        out.push('\n');
    }
    out
}

fn without_test_modules(text: &str) -> String {
    let mut s = text.to_string();
    while let Some(at) = s.find("#[cfg(test)]") {
        let rest = s[at + 12..].trim_start();
        if !rest.starts_with("mod ") {
            // Not a module: drop the attribute only (the item stays a use of what it names).
            s.replace_range(at..at + 12, "");
            continue;
        }
        let Some(open) = s[at..].find('{').map(|i| at + i) else { break };
        let mut depth = 0;
        let mut end = s.len();
        for (i, c) in s[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        s.replace_range(at..end, "");
    }
    s
}

/// Every path the code names that starts at `crate::` or `super::`, expanded over `{a, b::c}` groups.
fn paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = code.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let start_ok = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b':');
        let rest = &code[i..];
        if start_ok && (rest.starts_with("crate::") || rest.starts_with("super::") || rest.starts_with("self::")) {
            let (p, used) = read_path(rest);
            out.extend(p);
            i += used.max(1);
        } else {
            i += 1;
        }
    }
    out
}

/// Reads one path (with brace groups) at the start of `s`: the expanded paths and the bytes used.
fn read_path(s: &str) -> (Vec<String>, usize) {
    let b = s.as_bytes();
    let mut i = 0;
    let mut prefix = String::new();
    while i < b.len() {
        let c = b[i] as char;
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            prefix.push(c);
            i += 1;
        } else if c == '{' && prefix.ends_with("::") {
            // A group: split at top-level commas.
            let mut depth = 0;
            let mut j = i;
            let mut parts = Vec::new();
            let mut cur = String::new();
            while j < b.len() {
                let c = b[j] as char;
                match c {
                    '{' => {
                        depth += 1;
                        if depth > 1 {
                            cur.push(c);
                        }
                    }
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            parts.push(std::mem::take(&mut cur));
                            break;
                        }
                        cur.push(c);
                    }
                    ',' if depth == 1 => parts.push(std::mem::take(&mut cur)),
                    _ => cur.push(c),
                }
                j += 1;
            }
            let mut out = Vec::new();
            for part in parts {
                let part: String = part.split_whitespace().collect::<Vec<_>>().join(" ");
                let part = if part.contains('{') { part } else { part.split(" as ").next().unwrap_or("").trim().to_string() };
                if part.is_empty() {
                    continue;
                }
                let (sub, _) = read_path(&format!("{prefix}{part}"));
                out.extend(sub);
            }
            return (out, j + 1);
        } else {
            break;
        }
    }
    (vec![prefix.trim_end_matches(':').to_string()], i)
}

/// The code with its `pub use` re-exports left out (a re-export is namespace plumbing, followed by
/// [`resolve`]), and a `use child::...` of a child module written as `self::child::...`.
fn uses_of(code: &str, m: &[String], mods: &BTreeMap<Vec<String>, PathBuf>) -> String {
    let mut out = String::new();
    for stmt in code.split_inclusive(';') {
        let t = stmt.trim_start();
        if t.starts_with("pub use ") || t.starts_with("pub(crate) use ") {
            continue;
        }
        if let Some(rest) = t.strip_prefix("use ") {
            let first: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let mut child = m.to_vec();
            child.push(first.clone());
            if mods.contains_key(&child) {
                let r = rest.trim_end_matches(';');
                out.push_str(&format!("use self::{r};"));
                continue;
            }
        }
        out.push_str(stmt);
    }
    out
}

/// `pub use` re-exports of a module file: item name -> the path it names.
fn reexports(code: &str, here: &[String]) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for stmt in code.split(';') {
        let t = stmt.trim();
        let Some(rest) = t.strip_prefix("pub use ").or_else(|| t.strip_prefix("pub(crate) use ")) else { continue };
        let rest = rest.trim();
        let rest = if rest.starts_with("crate::") || rest.starts_with("super::") || rest.starts_with("self::") { rest.to_string() } else { format!("self::{rest}") };
        let rest = rest.replacen("self::", "crate::__self__::", 1);
        let glob = rest.trim_end().ends_with("::*");
        let (ps, _) = read_path(&rest);
        for p in ps {
            let segs: Vec<String> = p.split("::").map(str::to_string).collect();
            let Some(name) = segs.last().cloned() else { continue };
            let mut abs = Vec::new();
            for s in &segs[1..] {
                if s == "__self__" {
                    abs.extend(here.iter().cloned());
                } else {
                    abs.push(s.clone());
                }
            }
            if glob {
                // `pub use a::*`: under the name "*", the path a::* (see `resolve`).
                abs.push("*".into());
                out.insert("*".into(), abs);
            } else {
                out.insert(name, abs);
            }
        }
    }
    out
}

/// Whether a file's code defines the item `name` (a type, trait, function, constant, static, macro).
fn defines(code: &str, name: &str) -> bool {
    ["struct ", "enum ", "trait ", "type ", "fn ", "const ", "static ", "union ", "macro_rules! "].iter().any(|k| {
        code.match_indices(&format!("{k}{name}")).any(|(i, m)| {
            let after = code[i + m.len()..].chars().next().unwrap_or(' ');
            let before = code[..i].chars().next_back().unwrap_or(' ');
            !(after.is_ascii_alphanumeric() || after == '_') && !(before.is_ascii_alphanumeric() || before == '_')
        })
    })
}

/// The file a module path resolves to: the longest module prefix, through re-exports, named ones first,
/// then glob re-exports (`pub use x::*`) to a module that defines or re-exports the item.
fn resolve(path: &[String], mods: &BTreeMap<Vec<String>, PathBuf>, re: &BTreeMap<Vec<String>, BTreeMap<String, Vec<String>>>, codes: &BTreeMap<Vec<String>, String>, depth: usize) -> Option<Vec<String>> {
    let mut n = path.len();
    while n > 0 && !mods.contains_key(&path[..n]) {
        n -= 1;
    }
    let m = path[..n].to_vec();
    if depth < 8 && n < path.len() {
        let r = re.get(&m);
        if let Some(target) = r.and_then(|r| r.get(&path[n])) {
            let mut full = target.clone();
            full.extend_from_slice(&path[n + 1..]);
            if full != path {
                return resolve(&full, mods, re, codes, depth + 1);
            }
        }
        let here = codes.get(&m).is_some_and(|c| defines(c, &path[n]));
        if !here {
            // `pub use a::*` is recorded under the name "*" with the path a::* (its last segment "*").
            let globs: Vec<Vec<String>> = r.map(|r| r.iter().filter(|(k, _)| k.as_str() == "*").map(|(_, v)| v[..v.len() - 1].to_vec()).collect()).unwrap_or_default();
            for g in globs {
                let holds = codes.get(&g).is_some_and(|c| defines(c, &path[n])) || re.get(&g).is_some_and(|r| r.contains_key(&path[n]));
                if holds {
                    let mut full = g.clone();
                    full.extend_from_slice(&path[n..]);
                    return resolve(&full, mods, re, codes, depth + 1);
                }
            }
        }
    }
    Some(m)
}

/// File-level use graph: module -> modules it names.
fn graph(root: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mods = modules(root);
    let codes: BTreeMap<Vec<String>, String> = mods.iter().map(|(m, p)| (m.clone(), code_of(&std::fs::read_to_string(p).expect("read")))).collect();
    let re: BTreeMap<Vec<String>, BTreeMap<String, Vec<String>>> = codes.iter().map(|(m, c)| (m.clone(), reexports(c, m))).collect();
    let mut g: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (m, code) in &codes {
        let mut edges = BTreeSet::new();
        for p in paths(&uses_of(code, m, &mods)) {
            let segs: Vec<String> = p.split("::").filter(|s| !s.is_empty()).map(str::to_string).collect();
            // `crate::x` is absolute; each leading `super` is one level up from this file's module; `self::x`
            // is inside it.
            let mut abs: Vec<String> = match segs.first().map(String::as_str) {
                Some("crate") => Vec::new(),
                _ => m.clone(),
            };
            for s in segs.iter().skip_while(|s| *s == "crate") {
                match s.as_str() {
                    "super" => {
                        abs.pop();
                    }
                    "self" => {}
                    _ => abs.push(s.clone()),
                }
            }
            if let Some(t) = resolve(&abs, &mods, &re, &codes, 0) {
                if &t != m {
                    edges.insert(t);
                }
            }
        }
        g.insert(m.clone(), edges);
    }
    g
}

/// Strongly connected components with more than one file (Tarjan).
fn cycles(g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    struct T<'a> {
        g: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        idx: BTreeMap<Vec<String>, usize>,
        low: BTreeMap<Vec<String>, usize>,
        on: BTreeSet<Vec<String>>,
        st: Vec<Vec<String>>,
        n: usize,
        out: Vec<Vec<Vec<String>>>,
    }
    fn go(t: &mut T, v: &Vec<String>) {
        t.idx.insert(v.clone(), t.n);
        t.low.insert(v.clone(), t.n);
        t.n += 1;
        t.st.push(v.clone());
        t.on.insert(v.clone());
        let succ: Vec<Vec<String>> = t.g.get(v).map(|s| s.iter().cloned().collect()).unwrap_or_default();
        for w in succ {
            if !t.idx.contains_key(&w) {
                go(t, &w);
                let lw = t.low[&w];
                let lv = t.low.get_mut(v).expect("set");
                *lv = (*lv).min(lw);
            } else if t.on.contains(&w) {
                let iw = t.idx[&w];
                let lv = t.low.get_mut(v).expect("set");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.idx[v] {
            let mut comp = Vec::new();
            loop {
                let w = t.st.pop().expect("on stack");
                t.on.remove(&w);
                let done = &w == v;
                comp.push(w);
                if done {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T { g, idx: BTreeMap::new(), low: BTreeMap::new(), on: BTreeSet::new(), st: Vec::new(), n: 0, out: Vec::new() };
    for v in g.keys() {
        if !t.idx.contains_key(v) {
            go(&mut t, v);
        }
    }
    t.out
}

fn name(m: &[String]) -> String {
    if m.is_empty() {
        "lib".into()
    } else {
        m.join("::")
    }
}

#[test]
fn no_import_circle_between_files() {
    let g = graph(Path::new(env!("CARGO_MANIFEST_DIR")));
    let edges: usize = g.values().map(|s| s.len()).sum();
    let cyc = cycles(&g);
    println!("{} files, {} use edges, {} cycles", g.len(), edges, cyc.len());
    for c in &cyc {
        println!("cycle: {}", c.iter().map(|m| name(m)).collect::<Vec<_>>().join(", "));
        for a in c {
            for b in &g[a] {
                if c.contains(b) {
                    println!("  {} -> {}", name(a), name(b));
                }
            }
        }
    }
    let found: Vec<String> = cyc.iter().map(|c| c.iter().map(|m| name(m)).collect::<Vec<_>>().join(", ")).collect();
    assert!(found.is_empty(), "import circles between files (see above): {found:?}");
}

#[test]
fn the_engine_reaches_backends_only_through_the_registry() {
    let g = graph(Path::new(env!("CARGO_MANIFEST_DIR")));
    let engine = g.get(&vec!["engine".to_string()]).expect("src/engine.rs");
    let direct: Vec<String> = engine.iter().filter(|m| matches!(m.first().map(String::as_str), Some("cpu") | Some("cuda"))).map(|m| name(m)).collect();
    assert!(direct.is_empty(), "engine.rs names backend modules directly: {direct:?}");
}

#[test]
fn the_path_reader_expands_groups() {
    let p = paths("use crate::a::{b, c::{d, e as f}};\nlet x = super::g::h(1);");
    assert_eq!(p, vec!["crate::a::b", "crate::a::c::d", "crate::a::c::e", "super::g::h"]);
}
