//! The policy spec language (grammar in docs/policies.md):
//!
//! ```text
//! spec     := pipeline [ ';' option { (',' | ';') option } ]
//! pipeline := 'dense' | stage { '>' stage }
//! stage    := name [ '(' [ key '=' value { ',' key '=' value } ] ')' ]
//! option   := key '=' value                       (dense_layers=N, max_seqs=N)
//! value    := number | 'inf' | name
//! ```
//!
//! Every error names the byte position in the spec and what was expected there; unknown stages, keys and
//! out-of-range values are errors, never ignored.
//!
//! This file is the generic grammar only (names, `>` composition, `key=value` lists, options): it names no
//! policy. Each stage's arguments are parsed in its folder (`src/policy/<name>/mod.rs`, `parse`, into the
//! folder's own parsed form), which the registry's table names (src/policy/registry.rs, `Spec::parse`,
//! which also assembles the stages' values into a `Pipeline`).

use crate::error::{Error, ErrorKind, Result};

/// Default number of leading layers kept dense.
pub const DEFAULT_DENSE_LAYERS: usize = 2;
/// Default of the option `max_seqs` (sequences with per-sequence state on a CUDA engine at once).
pub const DEFAULT_MAX_SEQS: usize = 256;
/// Largest `max_seqs` accepted.
pub const MAX_MAX_SEQS: usize = 1 << 20;

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tok {
    Name(String),
    Num(f64, String),
    /// A double-quoted string (no escapes; only `predictor.weights` takes one: a file path).
    Str(String),
    Sym(char),
    End,
}

impl Tok {
    pub(crate) fn describe(&self) -> String {
        match self {
            Tok::Name(n) => format!("`{n}`"),
            Tok::Num(_, s) => format!("number {s}"),
            Tok::Str(s) => format!("string {s:?}"),
            Tok::Sym(c) => format!("`{c}`"),
            Tok::End => "end of spec".to_string(),
        }
    }
}

struct Parser<'a> {
    src: &'a str,
    toks: Vec<(usize, Tok)>,
    i: usize,
    /// Argument lists open around the current position (parsing recurses once per level).
    depth: usize,
}

/// Longest string value (a weights file path).
pub const MAX_STRING: usize = 4096;

/// Deepest nesting of argument lists (`speculate(over=quest(...))` needs 2): the parser recurses per
/// level, so the bound keeps any spec from exhausting the stack.
pub const MAX_NESTING: usize = 4;

fn lex(src: &str) -> Result<Vec<(usize, Tok)>> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i] as char;
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_alphabetic() || c == '_' {
            let s = i;
            while i < b.len() && ((b[i] as char).is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push((s, Tok::Name(src[s..i].to_string())));
        } else if c.is_ascii_digit() || c == '.' || c == '-' || c == '+' {
            let s = i;
            i += 1;
            while i < b.len() {
                let d = b[i] as char;
                let exp_sign = (d == '-' || d == '+') && matches!(b[i - 1], b'e' | b'E');
                if d.is_ascii_digit() || d == '.' || d == 'e' || d == 'E' || exp_sign {
                    i += 1;
                } else {
                    break;
                }
            }
            let text = &src[s..i];
            match text.parse::<f64>() {
                Ok(v) => out.push((s, Tok::Num(v, text.to_string()))),
                Err(_) => return Err(err(src, s, "a number", &format!("`{text}`"))),
            }
        } else if c == '"' {
            let s = i + 1;
            let Some(len) = src[s..].find('"') else {
                return Err(err(src, i, "a closing `\"` of the string", "end of spec"));
            };
            if len > MAX_STRING {
                return Err(err(src, i, &format!("a string of at most {MAX_STRING} bytes"), &format!("{len} bytes")));
            }
            let text = &src[s..s + len];
            if let Some(bad) = text.chars().find(|c| c.is_control()) {
                return Err(err(src, i, "a string without control characters", &format!("{bad:?}")));
            }
            out.push((i, Tok::Str(text.to_string())));
            i = s + len + 1;
        } else if "()=,>;".contains(c) {
            out.push((i, Tok::Sym(c)));
            i += 1;
        } else {
            let ch = src[i..].chars().next().unwrap_or('?');
            return Err(err(src, i, "a stage name, `(`, `)`, `=`, `,`, `>` or `;`", &format!("`{ch}`")));
        }
    }
    out.push((src.len(), Tok::End));
    Ok(out)
}

pub(crate) fn err(src: &str, pos: usize, expected: &str, found: &str) -> Error {
    Error::new(ErrorKind::InvalidArgument, format!("policy spec {}: at position {pos} expected {expected}, found {found}", quoted(src)))
}

/// The spec as quoted in messages, cut after 120 bytes (a spec may be long; the position says where).
pub(crate) fn quoted(src: &str) -> String {
    const KEEP: usize = 120;
    if src.len() <= KEEP {
        return format!("{src:?}");
    }
    let cut = (0..=KEEP).rev().find(|&i| src.is_char_boundary(i)).unwrap_or(0);
    format!("{:?}... ({} bytes)", &src[..cut], src.len())
}

/// One `key=value` argument with the position of its value.
pub(crate) struct Arg {
    pub key: String,
    pub key_pos: usize,
    pub val: Tok,
    pub val_pos: usize,
    /// `key=name(args)`: the nested stage's arguments (only `speculate.over` takes one).
    pub nested: Option<Vec<Arg>>,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> &(usize, Tok) {
        &self.toks[self.i]
    }
    fn next(&mut self) -> (usize, Tok) {
        let t = self.toks[self.i].clone();
        if self.i + 1 < self.toks.len() {
            self.i += 1;
        }
        t
    }
    fn fail<T>(&self, expected: &str) -> Result<T> {
        let (pos, t) = self.peek();
        Err(err(self.src, *pos, expected, &t.describe()))
    }
    fn eat(&mut self, c: char) -> bool {
        if self.peek().1 == Tok::Sym(c) {
            self.next();
            true
        } else {
            false
        }
    }

    fn arg(&mut self) -> Result<Arg> {
        let (key_pos, key) = match self.peek().clone() {
            (p, Tok::Name(n)) => (p, n),
            _ => return self.fail("a key name"),
        };
        self.next();
        if !self.eat('=') {
            return self.fail("`=`");
        }
        let (val_pos, val) = self.peek().clone();
        let mut nested = None;
        match val {
            Tok::Num(..) | Tok::Str(_) => {
                self.next();
            }
            Tok::Name(_) => {
                self.next();
                if self.peek().1 == Tok::Sym('(') {
                    nested = Some(self.args()?);
                }
            }
            _ => return self.fail("a value (number, `inf`, a name or a \"string\")"),
        }
        Ok(Arg { key, key_pos, val, val_pos, nested })
    }

    fn args(&mut self) -> Result<Vec<Arg>> {
        if self.peek().1 != Tok::Sym('(') {
            return Ok(Vec::new());
        }
        if self.depth >= MAX_NESTING {
            return self.fail(&format!("at most {MAX_NESTING} nested argument lists, not another `(`"));
        }
        self.depth += 1;
        let r = self.args_inner();
        self.depth -= 1;
        r
    }

    fn args_inner(&mut self) -> Result<Vec<Arg>> {
        let mut v = Vec::new();
        self.eat('(');
        if self.eat(')') {
            return Ok(v);
        }
        loop {
            v.push(self.arg()?);
            if self.eat(',') {
                continue;
            }
            if self.eat(')') {
                return Ok(v);
            }
            return self.fail("`,` or `)`");
        }
    }
}

/// Typed access to a stage's arguments; complains about unknown and duplicate keys.
pub(crate) struct Args<'a> {
    src: &'a str,
    stage: &'a str,
    args: Vec<Arg>,
}

impl<'a> Args<'a> {
    pub(crate) fn new(src: &'a str, stage: &'a str, args: Vec<Arg>, allowed: &[&str]) -> Result<Self> {
        for (i, a) in args.iter().enumerate() {
            if !allowed.contains(&a.key.as_str()) {
                return Err(err(src, a.key_pos, &format!("a key of `{stage}` ({})", allowed.join(", ")), &format!("unknown key `{}`", a.key)));
            }
            if args[..i].iter().any(|b| b.key == a.key) {
                return Err(err(src, a.key_pos, &format!("each key of `{stage}` at most once"), &format!("`{}` again", a.key)));
            }
            if a.nested.is_some() {
                return Err(err(src, a.val_pos, &format!("a plain value for `{stage}.{}` (this key takes no stage)", a.key), &format!("stage `{}`", a.val.describe())));
            }
        }
        Ok(Args { src, stage, args })
    }

    pub(crate) fn find(&mut self, key: &str) -> Option<usize> {
        self.args.iter().position(|a| a.key == key)
    }

    fn bad(&self, a: &Arg, expected: &str) -> Error {
        err(self.src, a.val_pos, &format!("{expected} for `{}.{}`", self.stage, a.key), &a.val.describe())
    }

    /// A number, `inf` allowed when `allow_inf`; checks `ok` on the value.
    pub(crate) fn num(&mut self, key: &str, default: Option<f64>, allow_inf: bool, expected: &str, ok: impl Fn(f64) -> bool) -> Result<f64> {
        let Some(i) = self.find(key) else {
            return default.ok_or_else(|| {
                Error::new(ErrorKind::InvalidArgument, format!("policy spec {}: stage `{}` needs `{key}=...` ({expected})", quoted(self.src), self.stage))
            });
        };
        let a = &self.args[i];
        let v = match &a.val {
            Tok::Num(v, _) => *v,
            Tok::Name(n) if allow_inf && n == "inf" => f64::INFINITY,
            _ => return Err(self.bad(a, expected)),
        };
        if !ok(v) {
            return Err(self.bad(a, expected));
        }
        Ok(v)
    }

    pub(crate) fn int(&mut self, key: &str, default: Option<usize>, min: usize, extra: &str, ok: impl Fn(usize) -> bool) -> Result<usize> {
        let expected = format!("an integer >= {min}{extra}");
        let v = self.num(key, default.map(|d| d as f64), false, &expected, |v| v.fract() == 0.0 && v >= min as f64 && v <= u32::MAX as f64 && ok(v as usize))?;
        Ok(v as usize)
    }

    /// An optional number where `auto` (or no value) means `None`.
    pub(crate) fn auto_num(&mut self, key: &str, expected: &str, ok: impl Fn(f64) -> bool) -> Result<Option<f32>> {
        match self.find(key) {
            None => Ok(None),
            Some(i) if self.args[i].val == Tok::Name("auto".into()) => Ok(None),
            Some(_) => Ok(Some(self.num(key, None, false, expected, ok)? as f32)),
        }
    }

    /// An optional string value.
    pub(crate) fn string(&mut self, key: &str, expected: &str) -> Result<Option<String>> {
        let Some(i) = self.find(key) else { return Ok(None) };
        match &self.args[i].val {
            Tok::Str(v) if !v.is_empty() => Ok(Some(v.clone())),
            _ => Err(self.bad(&self.args[i], expected)),
        }
    }

    pub(crate) fn word(&mut self, key: &str, default: &'static str, choices: &[&'static str]) -> Result<&'static str> {
        let Some(i) = self.find(key) else { return Ok(default) };
        let a = &self.args[i];
        if let Tok::Name(n) = &a.val {
            if let Some(c) = choices.iter().find(|c| **c == n.as_str()) {
                return Ok(c);
            }
        }
        Err(self.bad(a, &format!("one of {}", choices.join(", "))))
    }
}

/// What a parsed spec is before the registry assembles it (`Spec::parse`): the stage values in spec order
/// (`None`: dense, the empty spec or `dense`) and the options.
pub(crate) struct ParsedStages<P> {
    pub stages: Option<Vec<P>>,
    pub dense_layers: usize,
    pub max_seqs: usize,
}

/// Parses a whole spec: the stages' names, their `>` composition and `key=value` lists, and the options;
/// each stage's arguments are parsed by its entry in `stages` (the registry's table, one per policy),
/// whose values come back in spec order for the registry to assemble.
pub(crate) fn parse_with<P>(src: &str, stages: &[StageDef<P>]) -> Result<ParsedStages<P>> {
    let mut p = Parser { src, toks: lex(src)?, i: 0, depth: 0 };
    let mut dense_layers = DEFAULT_DENSE_LAYERS;
    let mut max_seqs = DEFAULT_MAX_SEQS;
    if p.peek().1 == Tok::End {
        return Ok(ParsedStages { stages: None, dense_layers, max_seqs: DEFAULT_MAX_SEQS });
    }
    let mut values: Vec<P> = Vec::new();
    let (mut selector, mut prune, mut terminate) = (false, false, false);
    let mut dense = false;
    let mut n_stages = 0;
    // The selector is a whole pipeline (nothing may follow it).
    let mut whole = false;
    let named = |role: Role| stages.iter().find(|d| d.role == role).map_or("", |d| d.name);
    loop {
        let (pos, name) = match p.peek().clone() {
            (pos, Tok::Name(n)) => (pos, n),
            _ => return p.fail(&expected_stage(stages)),
        };
        p.next();
        let raw = p.args()?;
        let late = |what: &str| err(src, pos, what, &format!("`{name}`"));
        if dense || (name == "dense" && n_stages > 0) {
            return Err(late("`dense` alone (it is the empty pipeline)"));
        }
        let def = stages.iter().find(|d| d.name == name);
        let role = def.map(|d| d.role);
        if whole && matches!(role, Some(Role::Prune | Role::Terminate)) {
            let names: Vec<String> = stages.iter().filter(|d| d.whole_pipeline).map(|d| format!("`{}`", d.name)).collect();
            return Err(late(&format!("nothing after {} (they are whole pipelines)", or_list(&names))));
        }
        if role == Some(Role::Selector) && (selector || prune || terminate) {
            return Err(late("at most one selector, as the first stage"));
        }
        if role == Some(Role::Prune) && (prune || terminate) {
            return Err(late(&format!("at most one `{}`, before `{}`", named(Role::Prune), named(Role::Terminate))));
        }
        if role == Some(Role::Terminate) && terminate {
            return Err(late(&format!("at most one `{}`, as the last stage", named(Role::Terminate))));
        }
        let Some(def) = def else {
            return Err(err(src, pos, &expected_stage(stages), &format!("unknown stage `{name}`")));
        };
        let value = (def.parse)(src, raw)?;
        match def.role {
            Role::Dense => dense = true,
            Role::Selector => {
                selector = true;
                whole = def.whole_pipeline;
            }
            Role::Prune => prune = true,
            Role::Terminate => terminate = true,
        }
        if def.role != Role::Dense {
            values.push(value);
        }
        n_stages += 1;
        if p.eat('>') {
            continue;
        }
        break;
    }
    if p.eat(';') {
        loop {
            let a = p.arg()?;
            match a.key.as_str() {
                "dense_layers" => match a.val {
                    Tok::Num(v, _) if v.fract() == 0.0 && (0.0..=1e6).contains(&v) => dense_layers = v as usize,
                    _ => return Err(err(src, a.val_pos, "an integer >= 0 for `dense_layers`", &a.val.describe())),
                },
                "max_seqs" => match a.val {
                    Tok::Num(v, _) if v.fract() == 0.0 && (1.0..=MAX_MAX_SEQS as f64).contains(&v) => max_seqs = v as usize,
                    _ => return Err(err(src, a.val_pos, &format!("an integer in 1..={MAX_MAX_SEQS} for `max_seqs`"), &a.val.describe())),
                },
                _ => return Err(err(src, a.key_pos, "an option (dense_layers, max_seqs)", &format!("unknown option `{}`", a.key))),
            }
            if p.eat(',') || p.eat(';') {
                continue;
            }
            break;
        }
    }
    if p.peek().1 != Tok::End {
        return p.fail(if n_stages > 0 { "`>`, `;` or end of spec" } else { "end of spec" });
    }
    Ok(ParsedStages { stages: (!dense).then_some(values), dense_layers, max_seqs })
}

/// What a stage is in the pipeline `selector [> prune] [> terminate]` (or `dense`, alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Dense,
    /// Chooses the candidate positions (the first stage; `all` when the spec names none).
    Selector,
    /// Prunes the selector's candidates (at most one, before the terminating stage).
    Prune,
    /// Ends a row's traversal early (at most one, the last stage).
    Terminate,
}

/// One stage name of the grammar and its parser entry (the registry's table, src/policy/registry.rs),
/// whose value `P` the registry assembles into a pipeline.
pub(crate) struct StageDef<P> {
    pub name: &'static str,
    pub role: Role,
    /// Nothing may follow this selector (it runs the whole decode row itself).
    pub whole_pipeline: bool,
    /// Parses the stage's `key=value` list (`Args::new` checks the keys).
    pub parse: fn(&str, Vec<Arg>) -> Result<P>,
}

/// "a stage name (dense, all, ...)", from the table.
fn expected_stage<P>(stages: &[StageDef<P>]) -> String {
    format!("a stage name ({})", stages.iter().map(|d| d.name).collect::<Vec<_>>().join(", "))
}

/// "a, b or c".
fn or_list(items: &[String]) -> String {
    match items.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// The grammar's own forms (each stage's arguments are tested in its folder, `spec_tests`).
#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::registry::{parse, refusal as msg};

    #[test]
    fn dense_forms_and_options() {
        assert_eq!(parse("").unwrap().pipeline, None);
        assert_eq!(parse("  dense ").unwrap().pipeline, None);
        assert_eq!(parse("dense; dense_layers=0").unwrap().dense_layers, 0);
        assert_eq!(parse("").unwrap().max_seqs, DEFAULT_MAX_SEQS);
        assert_eq!(parse("all").unwrap().dense_layers, DEFAULT_DENSE_LAYERS);
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        // Each level is `all(a=`; 100,000 levels would overflow any thread's stack if parsing recursed.
        for levels in [MAX_NESTING + 1, 15_000, 100_000] {
            let spec = "all(a=".repeat(levels) + &")".repeat(levels);
            let m = msg(&spec);
            assert!(m.contains("nested argument lists"), "{}", &m[m.len().saturating_sub(200)..]);
        }
    }

    #[test]
    fn bad_specs_name_position_and_expectation() {
        let m = msg("qest(budget=4)");
        assert!(m.contains("position 0") && m.contains("unknown stage `qest`"), "{m}");
        assert!(msg("all; dense_layer=2").contains("unknown option `dense_layer`"));
        assert!(msg("all; dense_layers=-1").contains("dense_layers"));
        assert!(msg("all; max_seqs=0").contains("max_seqs"));
        assert!(msg("all; max_seqs=1.5").contains("max_seqs"));
        assert!(msg("all; max_seqs=9999999999").contains("max_seqs"));
    }
}
