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
enum Tok {
    Name(String),
    Num(f64, String),
    /// A double-quoted string (no escapes; only `predictor.weights` takes one: a file path).
    Str(String),
    Sym(char),
    End,
}

impl Tok {
    fn describe(&self) -> String {
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

fn err(src: &str, pos: usize, expected: &str, found: &str) -> Error {
    Error::new(ErrorKind::InvalidArgument, format!("policy spec {}: at position {pos} expected {expected}, found {found}", quoted(src)))
}

/// The spec as quoted in messages, cut after 120 bytes (a spec may be long; the position says where).
fn quoted(src: &str) -> String {
    const KEEP: usize = 120;
    if src.len() <= KEEP {
        return format!("{src:?}");
    }
    let cut = (0..=KEEP).rev().find(|&i| src.is_char_boundary(i)).unwrap_or(0);
    format!("{:?}... ({} bytes)", &src[..cut], src.len())
}

/// One `key=value` argument with the position of its value.
struct Arg {
    key: String,
    key_pos: usize,
    val: Tok,
    val_pos: usize,
    /// `key=name(args)`: the nested stage's arguments (only `speculate.over` takes one).
    nested: Option<Vec<Arg>>,
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
struct Args<'a> {
    src: &'a str,
    stage: &'a str,
    args: Vec<Arg>,
}

impl<'a> Args<'a> {
    fn new(src: &'a str, stage: &'a str, args: Vec<Arg>, allowed: &[&str]) -> Result<Self> {
        for (i, a) in args.iter().enumerate() {
            if !allowed.contains(&a.key.as_str()) {
                return Err(err(src, a.key_pos, &format!("a key of `{stage}` ({})", allowed.join(", ")), &format!("unknown key `{}`", a.key)));
            }
            if args[..i].iter().any(|b| b.key == a.key) {
                return Err(err(src, a.key_pos, &format!("each key of `{stage}` at most once"), &format!("`{}` again", a.key)));
            }
            if a.nested.is_some() && !(stage == "speculate" && a.key == "over") {
                return Err(err(src, a.val_pos, &format!("a plain value for `{stage}.{}` (only `speculate.over` takes a stage)", a.key), &format!("stage `{}`", a.val.describe())));
            }
        }
        Ok(Args { src, stage, args })
    }

    fn find(&mut self, key: &str) -> Option<usize> {
        self.args.iter().position(|a| a.key == key)
    }

    fn bad(&self, a: &Arg, expected: &str) -> Error {
        err(self.src, a.val_pos, &format!("{expected} for `{}.{}`", self.stage, a.key), &a.val.describe())
    }

    /// A number, `inf` allowed when `allow_inf`; checks `ok` on the value.
    fn num(&mut self, key: &str, default: Option<f64>, allow_inf: bool, expected: &str, ok: impl Fn(f64) -> bool) -> Result<f64> {
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

    fn int(&mut self, key: &str, default: Option<usize>, min: usize, extra: &str, ok: impl Fn(usize) -> bool) -> Result<usize> {
        let expected = format!("an integer >= {min}{extra}");
        let v = self.num(key, default.map(|d| d as f64), false, &expected, |v| v.fract() == 0.0 && v >= min as f64 && v <= u32::MAX as f64 && ok(v as usize))?;
        Ok(v as usize)
    }

    /// An optional number where `auto` (or no value) means `None`.
    fn auto_num(&mut self, key: &str, expected: &str, ok: impl Fn(f64) -> bool) -> Result<Option<f32>> {
        match self.find(key) {
            None => Ok(None),
            Some(i) if self.args[i].val == Tok::Name("auto".into()) => Ok(None),
            Some(_) => Ok(Some(self.num(key, None, false, expected, ok)? as f32)),
        }
    }

    /// An optional string value.
    fn string(&mut self, key: &str, expected: &str) -> Result<Option<String>> {
        let Some(i) = self.find(key) else { return Ok(None) };
        match &self.args[i].val {
            Tok::Str(v) if !v.is_empty() => Ok(Some(v.clone())),
            _ => Err(self.bad(&self.args[i], expected)),
        }
    }

    fn word(&mut self, key: &str, default: &'static str, choices: &[&'static str]) -> Result<&'static str> {
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

/// Parses a whole spec.
pub fn parse(src: &str) -> Result<Spec> {
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
    loop {
        let (pos, name) = match p.peek().clone() {
            (pos, Tok::Name(n)) => (pos, n),
            _ => return p.fail("a stage name (dense, all, streaming, quest, snapkv, speculate, refresh, predictor, top_p, art)"),
        };
        p.next();
        let raw = p.args()?;
        let late = |what: &str| err(src, pos, what, &format!("`{name}`"));
        if dense || (name == "dense" && n_stages > 0) {
            return Err(late("`dense` alone (it is the empty pipeline)"));
        }
        let is_selector = matches!(name.as_str(), "all" | "streaming" | "quest" | "snapkv" | "speculate" | "refresh" | "predictor");
        let stateful_sel = matches!(selector, Some(Selector::Speculate(_) | Selector::Refresh(_) | Selector::Predictor(_)));
        if stateful_sel && (name == "top_p" || name == "art") {
            return Err(late("nothing after `speculate`, `refresh` or `predictor` (they are whole pipelines)"));
        }
        if is_selector && (selector.is_some() || top_p.is_some() || art.is_some()) {
            return Err(late("at most one selector, as the first stage"));
        }
        if name == "top_p" && (top_p.is_some() || art.is_some()) {
            return Err(late("at most one `top_p`, before `art`"));
        }
        if name == "art" && art.is_some() {
            return Err(late("at most one `art`, as the last stage"));
        }
        match name.as_str() {
            "dense" => {
                Args::new(src, "dense", raw, &[])?;
                dense = true;
            }
            "all" => {
                Args::new(src, "all", raw, &[])?;
                selector = Some(Selector::All);
            }
            "streaming" => {
                let mut a = Args::new(src, "streaming", raw, &["sink", "recent"])?;
                let sink = a.int("sink", Some(4), 0, "", |_| true)?;
                let recent = a.int("recent", None, 1, "", |_| true)?;
                selector = Some(Selector::Streaming { sink, recent });
            }
            "quest" => {
                let mut a = Args::new(src, "quest", raw, &["budget", "page", "sink"])?;
                let budget = a.int("budget", None, 1, "", |_| true)?;
                let page = a.int("page", Some(16), 1, ", a power of two", |v| v.is_power_of_two())?;
                let sink = a.int("sink", Some(0), 0, "", |_| true)?;
                selector = Some(Selector::Quest { budget, page, sink });
            }
            "snapkv" => {
                let mut a = Args::new(src, "snapkv", raw, &["budget", "window", "pool"])?;
                let budget = a.int("budget", None, 1, "", |_| true)?;
                let window = a.int("window", Some(32), 1, "", |_| true)?;
                let pool = a.int("pool", Some(7), 1, ", odd", |v| v % 2 == 1)?;
                selector = Some(Selector::SnapKv { budget, window, pool });
            }
            "top_p" => {
                let mut a = Args::new(src, "top_p", raw, &["p"])?;
                let v = a.num("p", Some(0.95), false, "a number in (0, 1]", |v| v > 0.0 && v <= 1.0)?;
                top_p = Some(TopP { p: v as f32 });
            }
            "art" => {
                let mut a = Args::new(src, "art", raw, &["tau", "phi", "patience", "order", "probe", "segment"])?;
                let tau = a.num("tau", Some(1e-5), false, "a finite number >= 0", |v| v.is_finite() && v >= 0.0)?;
                let phi = a.num("phi", Some(1e-3), false, "a finite number >= 0", |v| v.is_finite() && v >= 0.0)?;
                let pat = a.num("patience", Some(5.0), true, "an integer >= 1 or `inf`", |v| v == f64::INFINITY || (v.fract() == 0.0 && v >= 1.0 && v <= u32::MAX as f64))?;
                let order = match a.word("order", "auto", &["auto", "recent", "priority"])? {
                    "priority" => Some(Order::Priority),
                    "recent" => Some(Order::Recent),
                    _ => None,
                };
                art_order = order;
                let probe = match a.word("probe", "lanes", &["lanes", "full"])? {
                    "full" => Probe::Full,
                    _ => Probe::Lanes,
                };
                let seg = a.num("segment", Some(f64::INFINITY), true, "a multiple of 64 (keys), at least 64, or `inf`", |v| {
                    v == f64::INFINITY || (v.fract() == 0.0 && v >= 64.0 && v <= (1u64 << 30) as f64 && v % 64.0 == 0.0)
                })?;
                let patience = if pat.is_infinite() { None } else { Some(pat as u32) };
                let segment = if seg.is_infinite() { None } else { Some(seg as u32) };
                art = Some(Art { tau: tau as f32, phi: phi as f32, patience, order: Order::Recent, probe, segment });
            }
            "speculate" => {
                let mut raw = raw;
                let over = raw.iter().position(|a| a.key == "over");
                let over_arg = over.map(|i| raw.remove(i));
                let mut a = Args::new(src, "speculate", raw, &["alpha", "beta", "gamma", "budget", "predict", "extra"])?;
                let (quest_budget, page, quest_sink) = match over_arg {
                    None => return Err(Error::new(ErrorKind::InvalidArgument, format!("policy spec {}: stage `speculate` needs `over=quest(budget=...)`", quoted(src)))),
                    Some(o) => {
                        if o.val != Tok::Name("quest".into()) {
                            return Err(err(src, o.val_pos, "`quest(...)` for `speculate.over`", &o.val.describe()));
                        }
                        let mut q = Args::new(src, "quest", o.nested.unwrap_or_default(), &["budget", "page", "sink"])?;
                        let budget = q.int("budget", None, 1, "", |_| true)?;
                        let page = q.int("page", Some(16), 1, ", a power of two", |v| v.is_power_of_two())?;
                        let sink = q.int("sink", Some(0), 0, "", |_| true)?;
                        (budget, page, sink)
                    }
                };
                let alpha = a.auto_num("alpha", "a number in [0, 1] or `auto`", |v| (0.0..=1.0).contains(&v))?;
                let beta = a.auto_num("beta", "a number in [0, 1] or `auto`", |v| (0.0..=1.0).contains(&v))?;
                let gamma = a.auto_num("gamma", "a number in [0, 4] or `auto`", |v| (0.0..=4.0).contains(&v))?;
                let budget = match a.find("budget") {
                    Some(_) => Some(a.int("budget", None, 1, "", |_| true)?),
                    None => None,
                };
                let predict = match a.word("predict", "holt", &["holt", "previous", "inverse"])? {
                    "previous" => Predict::Previous,
                    "inverse" => Predict::Inverse,
                    _ => Predict::Holt,
                };
                let keep_extra = a.word("extra", "keep", &["drop", "keep"])? == "keep";
                selector = Some(Selector::Speculate(Speculate { quest_budget, page, quest_sink, alpha, beta, gamma, budget, predict, keep_extra }));
            }
            "refresh" => {
                let mut a = Args::new(src, "refresh", raw, &["k", "stride", "s", "pool", "every"])?;
                let k = a.int("k", Some(2048), 1, "", |_| true)?;
                let stride = a.int("stride", Some(5), 1, "", |_| true)?;
                let sim = a.num("s", Some(0.85), false, "a number in [-1, 1]", |v| (-1.0..=1.0).contains(&v))? as f32;
                let pool = a.int("pool", Some(7), 1, ", odd", |v| v % 2 == 1)?;
                let every = match a.find("every") {
                    Some(_) => Some(a.int("every", None, 1, "", |_| true)?),
                    None => None,
                };
                selector = Some(Selector::Refresh(Refresh { k, stride, s: sim, pool, every }));
            }
            "predictor" => {
                let mut a = Args::new(src, "predictor", raw, &["budget", "block", "history", "calib", "sink", "local", "weights"])?;
                let budget = a.int("budget", None, 1, "", |_| true)?;
                let block = a.int("block", Some(16), 1, ", a power of two", |v| v.is_power_of_two())?;
                let history = a.int("history", Some(64), 2, "", |v| v <= 4096)?;
                let calib = a.int("calib", Some(5), 1, "", |_| true)?;
                let sink = a.int("sink", Some(64), 0, "", |_| true)?;
                let local = a.int("local", Some(64), 1, "", |_| true)?;
                predictor_weights = a.string("weights", "a non-empty \"path\" of a safetensors file")?;
                selector = Some(Selector::Predictor(PredictorSpec { budget, block, history, calib, sink, local }));
            }
            _ => return Err(err(src, pos, "a stage name (dense, all, streaming, quest, snapkv, speculate, refresh, predictor, top_p, art)", &format!("unknown stage `{name}`"))),
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
    if let Some(a) = art.as_mut() {
        a.order = art_order.unwrap_or_else(|| default_order(&selector, top_p.is_some()));
    }
    let pipeline = if dense { None } else { Some(Pipeline { selector, top_p, art }) };
    Ok(Spec { pipeline, dense_layers, predictor_weights, max_seqs })
}

/// ART's default traversal (paper §3.3): recency-first for full and pattern-based selections, the
/// selector's priority for the scored ones.
pub fn default_order(selector: &Selector, top_p: bool) -> Order {
    match selector {
        _ if top_p => Order::Priority,
        Selector::All | Selector::Streaming { .. } => Order::Recent,
        _ => Order::Priority,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
