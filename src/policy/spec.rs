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
//! This file is the generic grammar (names, `>` composition, `key=value` lists, options) and the parsed
//! forms; each stage's arguments are parsed in its folder (`src/policy/<name>/mod.rs`, `parse`), which the
//! registry's table names (src/policy/registry.rs, `Spec::parse`).

use crate::error::{Error, ErrorKind, Result};

/// Which blocks/tokens are eligible for a decode row.
#[derive(Clone, Debug, PartialEq)]
pub enum Selector {
    /// Every position the row may see (dense).
    All,
    /// The first `sink` and the last `recent` tokens.
    Streaming { sink: usize, recent: usize },
    /// The `ceil(budget / page)` pages with the highest upper-bound score `Σ_i max(q_i·max_i, q_i·min_i)`;
    /// the page of the decode token and the pages holding the first `sink` tokens are always kept.
    Quest { budget: usize, page: usize, sink: usize },
    /// Tokens chosen at prefill from the attention of the last `window` prompt queries, max-pooled over `pool`.
    SnapKv { budget: usize, window: usize, pool: usize },
    /// PRR: Quest's true selection `over`, attended as a speculative (predicted) set plus repaired misses.
    Speculate(Speculate),
    /// RefreshKV: a per-(sequence, layer) partial token set rebuilt at full-attention steps.
    Refresh(Refresh),
    /// AttentionPredictor: a small CNN predicts the next step's block attention from its history.
    Predictor(PredictorSpec),
}

/// How PRR predicts the speculative block set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Predict {
    /// Holt double exponential smoothing of each block's score (the method).
    Holt,
    /// The previous step's true set (the baseline the method is compared with).
    Previous,
    /// The lowest-predicted blocks: a deliberately bad predictor, for testing the repair path.
    Inverse,
}

/// `speculate(over=quest(budget, page), alpha, beta, gamma, budget, predict, extra)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Speculate {
    /// The true selector: Quest with this token budget, page size and sink (tokens).
    pub quest_budget: usize,
    pub page: usize,
    pub quest_sink: usize,
    /// Holt parameters; `None` = calibrated at the sequence's prefill (see `policy::speculate`).
    pub alpha: Option<f32>,
    pub beta: Option<f32>,
    pub gamma: Option<f32>,
    /// Speculation budget in tokens (the constant of the default latency table); `None` = the Quest budget.
    pub budget: Option<usize>,
    pub predict: Predict,
    /// Keep predicted blocks outside the true set as extra context (`extra=keep`, the paper's behaviour and
    /// the default); `extra=drop` makes the output attention over the true set only.
    pub keep_extra: bool,
}

/// `refresh(k, stride, s, pool, every)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Refresh {
    /// Tokens kept per KV head at partial steps.
    pub k: usize,
    /// Steps between similarity checks.
    pub stride: usize,
    /// Cosine threshold: a check keeps the partial set only while the similarity stays above `s`.
    pub s: f32,
    /// Max-pooling width (odd) of the full step's attention scores.
    pub pool: usize,
    /// Fixed schedule: a full step every `every` steps (no similarity check).
    pub every: Option<usize>,
}

/// `predictor(budget, block, history, calib, sink, local)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictorSpec {
    pub budget: usize,
    pub block: usize,
    pub history: usize,
    pub calib: usize,
    pub sink: usize,
    pub local: usize,
}

/// Twilight's select-then-prune: keep the smallest set whose estimated attention mass reaches `p`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopP {
    pub p: f32,
}

/// Traversal order of ART (sink units always come first). The spec's `order=auto` (default) is resolved
/// at parse time from the selector (ART paper §3.3): recency for `all`/`streaming`, priority for the
/// scored selectors (`quest`, `snapkv`, and any pipeline with `top_p`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    Recent,
    Priority,
}

/// What ART compares between tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The paper's probe (§3.2): the leading accumulator element of each of the 32 lanes of warp 0 in the
    /// tensor-core layout (see `termination::probe_lanes`).
    Lanes,
    /// The whole normalised output of every query row of the group (the paper's oracle, Appendix B).
    Full,
}

/// Adaptive (early) termination of the block traversal.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Art {
    pub tau: f32,
    pub phi: f32,
    /// Consecutive stable blocks before stopping; `None` = never stop (`patience=inf`).
    pub patience: Option<u32>,
    pub order: Order,
    pub probe: Probe,
    /// Keys per independent segment of the traversal (a multiple of the 64-key tile), each terminated on
    /// its own and merged by log-sum-exp; `None` = one segment (the paper). Lets a GPU split the row.
    pub segment: Option<u32>,
}

/// A non-dense pipeline: select, then optionally prune (top-p), then optionally terminate (ART).
#[derive(Clone, Debug, PartialEq)]
pub struct Pipeline {
    pub selector: Selector,
    pub top_p: Option<TopP>,
    pub art: Option<Art>,
}

/// A parsed spec: `pipeline == None` is dense attention everywhere.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub pipeline: Option<Pipeline>,
    pub dense_layers: usize,
    /// `predictor(weights="...")`: the weights file the engine loads (None = the built-in weights).
    pub predictor_weights: Option<String>,
    /// Option `max_seqs`: the most sequences a CUDA engine keeps per-sequence policy state for at once
    /// (its device slot map, src/cuda/slots.rs); the CPU engine's state is bounded by `max_state_bytes`.
    pub max_seqs: usize,
}

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
                return Err(err(src, a.val_pos, &format!("a plain value for `{stage}.{}` (only `speculate.over` takes a stage)", a.key), &format!("stage `{}`", a.val.describe())));
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

/// Parses a whole spec: the stages' names, their `>` composition and `key=value` lists, and the options;
/// each stage's arguments are parsed by its entry in `stages` (the registry's table, one per policy).
/// `finish` completes the pipeline from the stages' results (ART's default order follows the selector).
pub(crate) fn parse_with(src: &str, stages: &[StageDef], finish: fn(&mut Pipeline, Option<Order>)) -> Result<Spec> {
    let mut p = Parser { src, toks: lex(src)?, i: 0, depth: 0 };
    let mut dense_layers = DEFAULT_DENSE_LAYERS;
    let mut max_seqs = DEFAULT_MAX_SEQS;
    if p.peek().1 == Tok::End {
        return Ok(Spec { pipeline: None, dense_layers, predictor_weights: None, max_seqs: DEFAULT_MAX_SEQS });
    }
    let mut selector: Option<Selector> = None;
    let mut top_p: Option<TopP> = None;
    let mut art: Option<Art> = None;
    let mut art_order: Option<Order> = None;
    let mut dense = false;
    let mut n_stages = 0;
    let mut predictor_weights = None;
    // The selector is a whole pipeline (nothing may follow it).
    let mut whole = false;
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
        if whole && matches!(role, Some(Role::TopP | Role::Art)) {
            let names: Vec<String> = stages.iter().filter(|d| d.whole_pipeline).map(|d| format!("`{}`", d.name)).collect();
            return Err(late(&format!("nothing after {} (they are whole pipelines)", or_list(&names))));
        }
        if role == Some(Role::Selector) && (selector.is_some() || top_p.is_some() || art.is_some()) {
            return Err(late("at most one selector, as the first stage"));
        }
        if role == Some(Role::TopP) && (top_p.is_some() || art.is_some()) {
            return Err(late("at most one `top_p`, before `art`"));
        }
        if role == Some(Role::Art) && art.is_some() {
            return Err(late("at most one `art`, as the last stage"));
        }
        let Some(def) = def else {
            return Err(err(src, pos, &expected_stage(stages), &format!("unknown stage `{name}`")));
        };
        match (def.parse)(src, raw)? {
            Parsed::Dense => dense = true,
            Parsed::Selector(s, weights) => {
                selector = Some(s);
                whole = def.whole_pipeline;
                if weights.is_some() {
                    predictor_weights = weights;
                }
            }
            Parsed::TopP(t) => top_p = Some(t),
            Parsed::Art(a, order) => {
                art = Some(a);
                art_order = order;
            }
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
    let selector = selector.unwrap_or(Selector::All);
    let pipeline = if dense {
        None
    } else {
        let mut p = Pipeline { selector, top_p, art };
        finish(&mut p, art_order);
        Some(p)
    };
    Ok(Spec { pipeline, dense_layers, predictor_weights, max_seqs })
}

/// What a stage is in the pipeline `selector [> top_p] [> art]` (or `dense`, alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Dense,
    Selector,
    TopP,
    Art,
}

/// A stage's parsed arguments.
pub(crate) enum Parsed {
    Dense,
    /// The selector, and a weights file it names (`predictor(weights="...")`).
    Selector(Selector, Option<String>),
    TopP(TopP),
    /// ART, and its order when the spec gives one (else `finish` picks the default).
    Art(Art, Option<Order>),
}

/// One stage name of the grammar and its parser entry (the registry's table, src/policy/registry.rs).
pub(crate) struct StageDef {
    pub name: &'static str,
    pub role: Role,
    /// Nothing may follow this selector (it runs the whole decode row itself).
    pub whole_pipeline: bool,
    /// Parses the stage's `key=value` list (`Args::new` checks the keys).
    pub parse: fn(&str, Vec<Arg>) -> Result<Parsed>,
}

/// "a stage name (dense, all, ...)", from the table.
fn expected_stage(stages: &[StageDef]) -> String {
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

/// `dense` and `all` take no arguments.
pub(crate) fn parse_dense(src: &str, raw: Vec<Arg>) -> Result<Parsed> {
    Args::new(src, "dense", raw, &[])?;
    Ok(Parsed::Dense)
}

pub(crate) fn parse_all(src: &str, raw: Vec<Arg>) -> Result<Parsed> {
    Args::new(src, "all", raw, &[])?;
    Ok(Parsed::Selector(Selector::All, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(src: &str) -> Result<Spec> {
        Spec::parse(src)
    }

    #[test]
    fn parses_the_example() {
        let s = parse("quest(budget=4096) > top_p(p=0.95) > art(tau=1e-5, phi=1e-3, patience=5)").unwrap();
        let p = s.pipeline.unwrap();
        assert_eq!(p.selector, Selector::Quest { budget: 4096, page: 16, sink: 0 });
        assert_eq!(p.top_p, Some(TopP { p: 0.95 }));
        let a = p.art.unwrap();
        assert_eq!((a.tau, a.phi, a.patience, a.order, a.probe), (1e-5, 1e-3, Some(5), Order::Priority, Probe::Lanes));
        let order = |spec: &str| parse(spec).unwrap().pipeline.unwrap().art.unwrap().order;
        assert_eq!(order("art"), Order::Recent);
        assert_eq!(order("streaming(recent=64) > art"), Order::Recent);
        assert_eq!(order("quest(budget=64) > art"), Order::Priority);
        assert_eq!(order("snapkv(budget=64) > art"), Order::Priority);
        assert_eq!(order("top_p > art"), Order::Priority);
        assert_eq!(order("quest(budget=64) > art(order=recent)"), Order::Recent);
        assert_eq!(order("art(order=priority)"), Order::Priority);
        assert_eq!(s.dense_layers, 2);
    }

    #[test]
    fn dense_forms_and_options() {
        assert_eq!(parse("").unwrap().pipeline, None);
        assert_eq!(parse("  dense ").unwrap().pipeline, None);
        assert_eq!(parse("dense; dense_layers=0").unwrap().dense_layers, 0);
        assert_eq!(parse("refresh(k=64); max_seqs=8, dense_layers=1").unwrap().max_seqs, 8);
        assert_eq!(parse("quest(budget=64)").unwrap().max_seqs, DEFAULT_MAX_SEQS);
        let s = parse("art(patience=inf, order=priority, probe=full); dense_layers=3").unwrap();
        assert_eq!(s.dense_layers, 3);
        let p = s.pipeline.unwrap();
        assert_eq!(p.selector, Selector::All);
        assert_eq!(p.art.unwrap().patience, None);
        assert_eq!(parse("streaming(recent=64)").unwrap().pipeline.unwrap().selector, Selector::Streaming { sink: 4, recent: 64 });
        assert_eq!(parse("snapkv(budget=100)").unwrap().pipeline.unwrap().selector, Selector::SnapKv { budget: 100, window: 32, pool: 7 });
        assert_eq!(parse("top_p").unwrap().pipeline.unwrap().top_p, Some(TopP { p: 0.95 }));
    }

    #[test]
    fn stateful_stages() {
        let p = parse("speculate(over=quest(budget=1024, page=32), alpha=0.3, gamma=auto, budget=512)").unwrap().pipeline.unwrap();
        assert_eq!(
            p.selector,
            Selector::Speculate(Speculate { quest_budget: 1024, page: 32, quest_sink: 0, alpha: Some(0.3), beta: None, gamma: None, budget: Some(512), predict: Predict::Holt, keep_extra: true })
        );
        let p = parse("speculate(over=quest(budget=64), predict=inverse, extra=drop)").unwrap().pipeline.unwrap();
        assert!(matches!(p.selector, Selector::Speculate(Speculate { quest_budget: 64, page: 16, quest_sink: 0, predict: Predict::Inverse, keep_extra: false, .. })));
        let p = parse("speculate(over=quest(budget=64, sink=16))").unwrap().pipeline.unwrap();
        assert!(matches!(p.selector, Selector::Speculate(Speculate { quest_budget: 64, quest_sink: 16, .. })));
        let p = parse("refresh").unwrap().pipeline.unwrap();
        assert_eq!(p.selector, Selector::Refresh(Refresh { k: 2048, stride: 5, s: 0.85, pool: 7, every: None }));
        let p = parse("refresh(k=64, stride=1, s=1.0, every=10)").unwrap().pipeline.unwrap();
        assert_eq!(p.selector, Selector::Refresh(Refresh { k: 64, stride: 1, s: 1.0, pool: 7, every: Some(10) }));
        let p = parse("predictor(budget=1024)").unwrap().pipeline.unwrap();
        assert_eq!(p.selector, Selector::Predictor(PredictorSpec { budget: 1024, block: 16, history: 64, calib: 5, sink: 64, local: 64 }));
    }

    #[test]
    fn bad_stateful_specs() {
        assert!(msg("speculate(alpha=0.5)").contains("needs `over=quest"));
        let m = msg("speculate(over=snapkv(budget=8))");
        assert!(m.contains("position 15") && m.contains("`quest(...)`"), "{m}");
        let m = msg("speculate(over=quest(budget=8, pag=16))");
        assert!(m.contains("position 31") && m.contains("unknown key `pag`"), "{m}");
        assert!(msg("speculate(over=quest())").contains("needs `budget="));
        assert!(msg("speculate(over=quest(budget=8), alpha=1.5)").contains("speculate.alpha"));
        assert!(msg("speculate(over=quest(budget=8), gamma=-1)").contains("speculate.gamma"));
        assert!(msg("speculate(over=quest(budget=8), predict=oracle)").contains("holt, previous, inverse"));
        assert!(msg("speculate(over=quest(budget=8), budget=0)").contains("speculate.budget"));
        assert!(msg("speculate(over=quest(budget=8)) > art").contains("nothing after"));
        assert!(msg("refresh(k=0)").contains("refresh.k"));
        assert!(msg("refresh(s=1.5)").contains("refresh.s"));
        assert!(msg("refresh(pool=4)").contains("odd"));
        assert!(msg("refresh(stride=0)").contains("refresh.stride"));
        assert!(msg("refresh(every=0)").contains("refresh.every"));
        assert!(msg("refresh(k=quest(budget=1))").contains("only `speculate.over`"));
        assert!(msg("refresh > top_p").contains("nothing after"));
        assert!(msg("predictor()").contains("needs `budget="));
        assert!(msg("predictor(budget=64, block=12)").contains("power of two"));
        assert!(msg("predictor(budget=64, history=1)").contains("predictor.history"));
        assert!(msg("predictor(budget=64, weights=model)").contains("predictor.weights"));
        assert!(msg("predictor(budget=64, weights=\"\")").contains("predictor.weights"));
        assert!(msg("predictor(budget=64, weights=\"a.safetensors)").contains("closing"));
        assert!(msg("quest(budget=\"64\")").contains("quest.budget"));
        assert!(msg(&format!("predictor(budget=64, weights=\"{}\")", "x".repeat(MAX_STRING + 1))).contains("at most"));
        let s = parse("predictor(budget=64, weights=\"/tmp/my model.safetensors\")").unwrap();
        assert_eq!(s.predictor_weights.as_deref(), Some("/tmp/my model.safetensors"));
        assert_eq!(parse("predictor(budget=64)").unwrap().predictor_weights, None);
        assert!(msg("quest(budget=8) > refresh").contains("at most one selector"));
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        // Each level is `quest(a=`; 100,000 levels would overflow any thread's stack if parsing recursed.
        for levels in [MAX_NESTING + 1, 15_000, 100_000] {
            let spec = "quest(a=".repeat(levels) + &")".repeat(levels);
            let m = msg(&spec);
            assert!(m.contains("nested argument lists"), "{}", &m[m.len().saturating_sub(200)..]);
        }
        // The deepest legal spec still parses.
        assert!(parse("speculate(over=quest(budget=8))").is_ok());
    }

    fn msg(spec: &str) -> String {
        let e = parse(spec).expect_err(spec);
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        e.message
    }

    #[test]
    fn bad_specs_name_position_and_expectation() {
        let m = msg("qest(budget=4)");
        assert!(m.contains("position 0") && m.contains("unknown stage `qest`"), "{m}");
        let m = msg("quest(budget=4, pages=16)");
        assert!(m.contains("position 16") && m.contains("unknown key `pages`") && m.contains("budget, page"), "{m}");
        let m = msg("top_p(p=1.5)");
        assert!(m.contains("(0, 1]") && m.contains("position 8"), "{m}");
        assert!(msg("top_p(p=0)").contains("(0, 1]"));
        assert!(msg("art(tau=-1e-5)").contains("art.tau"));
        assert!(msg("art(phi=-1)").contains("art.phi"));
        assert!(msg("quest(budget=0)").contains("quest.budget"));
        assert!(msg("quest()").contains("needs `budget=")); // nothing defaulted silently
        assert!(msg("quest(budget=64, page=12)").contains("power of two"));
        assert!(msg("snapkv(budget=0)").contains("snapkv.budget"));
        assert!(msg("snapkv(budget=8, pool=4)").contains("odd"));
        assert!(msg("art(patience=0)").contains("patience"));
        assert!(msg("art(segment=100)").contains("art.segment"));
        assert!(msg("art(segment=0)").contains("art.segment"));
        assert_eq!(parse("art(segment=4096)").unwrap().pipeline.unwrap().art.unwrap().segment, Some(4096));
        assert_eq!(parse("art").unwrap().pipeline.unwrap().art.unwrap().segment, None);
        assert_eq!(parse("art(segment=inf)").unwrap().pipeline.unwrap().art.unwrap().segment, None);
        assert!(msg("art(order=oldest)").contains("recent, priority"));
        assert!(msg("art > quest(budget=8)").contains("first stage"));
        assert!(msg("art > top_p").contains("before `art`"));
        assert!(msg("quest(budget=8) > quest(budget=8)").contains("at most one selector"));
        assert!(msg("quest(budget=8) top_p").contains("`>`, `;` or end of spec"));
        assert!(msg("quest(budget=8").contains("`,` or `)`"));
        assert!(msg("quest(budget=8,budget=9)").contains("at most once"));
        assert!(msg("all; dense_layer=2").contains("unknown option `dense_layer`"));
        assert!(msg("all; dense_layers=-1").contains("dense_layers"));
        assert!(msg("all; max_seqs=0").contains("max_seqs"));
        assert!(msg("all; max_seqs=1.5").contains("max_seqs"));
        assert!(msg("all; max_seqs=9999999999").contains("max_seqs"));
        assert!(msg("dense > art").contains("alone"));
        assert!(msg("all ! art").contains("position 4"));
        assert!(msg("streaming(sink=4)").contains("needs `recent="));
    }
}
