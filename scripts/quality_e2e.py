#!/usr/bin/env python3
"""End-to-end quality of the kvsparse decode policies on the real model.

SmolLM2-135M-Instruct (the converted checkpoint in .cache/smollm2, float32,
CPU, HF transformers) runs with the DECODE attention of every layer served by
a kvsparse engine configured with a policy; the prefill is dense (torch SDPA).
Two measurements per policy:

* needle retrieval: RULER-style needles (scripts/trace_prompts.py:needle_prompt)
  at contexts 2K/4K/8K and depths 0.1..0.9, greedy decoding, correct when the
  needle's 7-digit value appears in the answer;
* perplexity of a held-out text (CPython's pydoc_data/topics.py, the Python
  documentation's help topics): a dense prefill of a prefix, then the next N
  tokens teacher-forced ONE AT A TIME as decode steps through the policy.

How one prompt runs (shared by all policies):
 1. dense prefill with the model (registered attention function `kvs_e2e` =
    transformers' SDPA path + capture of the post-RoPE queries and outputs of
    the last `--tail` prompt positions of every layer); keep the post-RoPE K/V
    of every layer and the last position's logits.
 2. per policy: a fresh kvsparse Engine (30 layers, blocks of 16, f32); every
    layer's prompt K/V is written into a paged cache (physical blocks in a
    seeded random order) with cache_write (which maintains Quest / INT4
    metadata); then one forward per layer over the last `--tail` prompt
    queries as a prefill chunk (query length > 1, seq_len = P), exactly the
    last chunk of a chunked prefill: SnapKV chooses, PRR calibrates and the
    predictor seeds its history there. Its output is checked against the
    dense prefill's (prefill rows are dense for every policy).
 3. decode with the HF model without an HF cache (use_cache=False, explicit
    position ids): for query length 1 the attention function writes the new
    K/V row through cache_write and calls kvsparse forward (seq_ids set).

Check (always run on the first needle and on the perplexity text): with
policy `dense` the kvsparse decode reproduces HF's own attention (HF decode
with its DynamicCache teacher-forced on the same tokens; full-sequence HF
forward for the perplexity).

Needles run depth-major, the contexts interleaved (2K, 4K, 8K at depth 0.1, then at the next depth...),
and the CSV and the markdown report are rewritten after every needle and after the perplexity run, so a
run cut off part-way leaves a (marked partial) report covering the contexts evenly.

Usage:
    .venv/bin/python scripts/quality_e2e.py                   # full run, B=1024
    .venv/bin/python scripts/quality_e2e.py --budgets 1024,256
    .venv/bin/python scripts/quality_e2e.py --policies dense,art,art_1e-6,art_1e-4   # ART's tau sweep
    .venv/bin/python scripts/quality_e2e.py --quick           # smoke run (to out/quality-e2e-quick.*)
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_prompts  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / ".cache" / "smollm2"
NUM_LAYERS, HQ, HKV, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
SCALE = 0.125

# name -> spec template ({B} = budget, {B64} = budget - 64, {TAU} = ART tau, {N/k} = the prompt's
# token count / k rounded up to a multiple of 16, per prompt: see expand_n).
# A name `<name>_<tau>` of a template with {TAU} (e.g. `art_1e-6`, `snapkv_art_1e-4`) is that template
# with the literal tau, so one run can sweep ART's tau with distinctly named rows.
POLICIES = {
    "dense": "dense",
    "streaming": "streaming(sink=64, recent={B64})",
    "quest": "quest(budget={B})",
    "quest_top_p": "quest(budget={B}) > top_p(p=0.95)",
    "twilight": "quest(budget={N/4}) > top_p(p=0.95)",  # Twilight's recipe: conservative base, top-p
    "top_p": "top_p(p=0.95)",                             # top-p alone (selector `all`)
    "quest_art": "quest(budget={B}) > art(tau={TAU}, phi=1e-3, patience=5)",
    "art": "art(tau={TAU}, phi=1e-3, patience=5)",
    "streaming_art": "streaming(sink=64, recent={B64}) > art(tau={TAU}, phi=1e-3, patience=5)",
    "snapkv_art": "snapkv(budget={B}) > art(tau={TAU}, phi=1e-3, patience=5)",
    "snapkv": "snapkv(budget={B})",
    "speculate": "speculate(over=quest(budget={B}), budget={B})",
    "refresh": "refresh(k={B}, stride=5, s=0.85)",
    "predictor": "predictor(budget={B})",
}
STAT_KEYS = ("policy_rows", "blocks_eligible", "blocks_visited", "blocks_skipped_termination",
             "top_p_candidates", "top_p_kept", "spec_true_blocks", "spec_hit_blocks",
             "refresh_full_steps", "refresh_partial_steps", "kv_bytes_read")
# ART's default probe (the paper's 32-lane probe): dims 0, 2, 4, 6 of each query head (docs/policies.md)
PROBE_DIMS = [0, 2, 4, 6]


# --------------------------------------------------------------------------
# attention function
# --------------------------------------------------------------------------


class Ctx:
    """Global state read by the registered attention function."""

    mode = "hf"          # hf | prefill | kvs
    tail = 64
    q_tail: dict = {}    # layer -> [tail, 9, 64] post-RoPE queries of the last prompt positions
    o_tail: dict = {}    # layer -> [tail, 9, 64] dense attention output of those positions
    run = None           # KvsRun serving decode rows in mode "kvs"


CTX = Ctx()


def register_attention() -> str:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def kvs_e2e(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        layer = module.layer_idx
        if CTX.mode == "kvs":
            if query.shape[2] != 1:
                raise RuntimeError("kvs_e2e: kvsparse mode serves decode rows only (query length 1)")
            return CTX.run.decode_layer(layer, query, key, value, scaling), None
        if query.shape[2] > 1 and attention_mask is None and CTX.mode == "prefill" \
                and key.shape[2] != query.shape[2]:
            raise RuntimeError("kvs_e2e: chunked prefill without a causal mask")
        out, w = sdpa_attention_forward(module, query, key, value, attention_mask,
                                        dropout=dropout, scaling=scaling, **kwargs)
        if CTX.mode == "prefill":
            # query [1, 9, S, 64]; out [1, S, 9, 64]. Keep the last `tail` rows over chunks.
            q = query[0, :, -CTX.tail:, :].transpose(0, 1).detach().clone()
            o = out[0, -CTX.tail:].detach().clone()
            if layer in CTX.q_tail:
                q = torch.cat([CTX.q_tail[layer], q])[-CTX.tail:]
                o = torch.cat([CTX.o_tail[layer], o])[-CTX.tail:]
            CTX.q_tail[layer], CTX.o_tail[layer] = q, o
        return out, w

    AttentionInterface.register("kvs_e2e", kvs_e2e)
    # transformers builds no causal mask for an attention name it does not know
    # (docs/traces.md); ours is SDPA for prefill, so it gets SDPA's mask builder.
    AttentionMaskInterface.register("kvs_e2e", sdpa_mask)
    return "kvs_e2e"


def load_model(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    impl = register_attention()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=impl)
    model.eval()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (NUM_LAYERS, HQ, HKV, HEAD_DIM), cfg
    assert abs(model.model.layers[0].self_attn.scaling - SCALE) < 1e-12
    return tok, model


# --------------------------------------------------------------------------
# prefill (dense) and one kvsparse run
# --------------------------------------------------------------------------


@dataclass
class Prefill:
    ids: list[int]               # prompt tokens (P)
    k: list[torch.Tensor]        # per layer [P, 3, 64] post-RoPE keys
    v: list[torch.Tensor]
    q_tail: list[torch.Tensor]   # per layer [tail, 9, 64]
    o_tail: list[torch.Tensor]
    last_logits: torch.Tensor    # [vocab] logits of the last prompt position
    cache: object                # HF DynamicCache (for the reference check)
    seconds: float


@torch.no_grad()
def prefill(model, ids: list[int], tail: int, chunk: int) -> Prefill:
    from transformers import DynamicCache

    P = len(ids)
    CTX.mode, CTX.tail, CTX.q_tail, CTX.o_tail = "prefill", tail, {}, {}
    cache = DynamicCache(config=model.config)
    t0 = time.time()
    for c0 in range(0, P, chunk):
        c1 = min(P, c0 + chunk)
        out = model(input_ids=torch.tensor([ids[c0:c1]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.arange(c0, c1)[None], logits_to_keep=1)
    secs = time.time() - t0
    CTX.mode = "hf"
    ks, vs = [], []
    for L in range(NUM_LAYERS):
        layer = cache.layers[L]
        assert layer.keys.shape == (1, HKV, P, HEAD_DIM), layer.keys.shape
        ks.append(layer.keys[0].transpose(0, 1).contiguous())
        vs.append(layer.values[0].transpose(0, 1).contiguous())
    pf = Prefill(ids, ks, vs, [CTX.q_tail[L].contiguous() for L in range(NUM_LAYERS)],
                 [CTX.o_tail[L].contiguous() for L in range(NUM_LAYERS)],
                 out.logits[0, -1].clone(), cache, secs)
    CTX.q_tail, CTX.o_tail = {}, {}
    return pf


class PagedStore:
    """Paged K/V caches of all layers for one prompt (reused by the policies' engines)."""

    def __init__(self, capacity: int, seed: int):
        nblk = math.ceil(capacity / BLOCK)
        self.num_blocks = nblk + 7  # spare physical blocks, so the shuffle is a real scatter
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(self.num_blocks, generator=g)[:nblk]
        self.block_table = perm.to(torch.int32)[None].contiguous()  # [1, nblk]
        self.capacity = nblk * BLOCK
        shape = (self.num_blocks, BLOCK, HKV, HEAD_DIM)
        self.kc = [torch.zeros(shape) for _ in range(NUM_LAYERS)]
        self.vc = [torch.zeros(shape) for _ in range(NUM_LAYERS)]

    def slots(self, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return (self.block_table[0, pos // BLOCK].to(torch.int64) * BLOCK + pos % BLOCK).contiguous()


_SEQ_ID = [1000]


class KvsRun:
    """One policy on one prompt: a fresh engine, the prompt written, the tail chunk, decode rows."""

    def __init__(self, spec: str, pf: Prefill, store: PagedStore, threads: int):
        from kvsparse.engine import Engine

        self.spec, self.store = spec, store
        self.P = len(pf.ids)
        _SEQ_ID[0] += 1
        self.sid = _SEQ_ID[0]
        self.seq_ids = torch.tensor([self.sid], dtype=torch.int64)
        self.stats = {k: 0 for k in STAT_KEYS}
        self.decode_rows = 0
        self.kvs_decode_s = 0.0
        t0 = time.time()
        self.eng = Engine(num_layers=NUM_LAYERS, num_q_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                          block_size=BLOCK, dtype=torch.float32, policy=spec, num_threads=threads)
        slots = store.slots(0, self.P)
        for L in range(NUM_LAYERS):
            self.eng.cache_write(L, pf.k[L], pf.v[L], store.kc[L], store.vc[L], slots)
        # the last prefill chunk: dense rows; SnapKV / PRR / predictor observe it
        W = pf.q_tail[0].shape[0]
        seq_lens = torch.tensor([self.P], dtype=torch.int32)
        qsl = torch.tensor([0, W], dtype=torch.int32)
        self.tail_rel_err = 0.0
        for L in range(NUM_LAYERS):
            out = torch.empty(W, HQ, HEAD_DIM)
            self.eng.forward(L, pf.q_tail[L], store.kc[L], store.vc[L], store.block_table, seq_lens,
                             qsl, out, seq_ids=self.seq_ids, scale=SCALE)
            ref = pf.o_tail[L]
            self.tail_rel_err = max(self.tail_rel_err, float((out - ref).norm() / ref.norm()))
        self.setup_s = time.time() - t0
        self._qsl1 = torch.tensor([0, 1], dtype=torch.int32)
        self.pos = None

    def decode_layer(self, layer: int, query, key, value, scaling):
        """query [1, 9, 1, 64], key/value [1, 3, 1, 64] (no HF cache): the row at self.pos."""
        assert abs(scaling - SCALE) < 1e-12
        t0 = time.perf_counter()
        st = self.store
        pos = self.pos
        if pos >= st.capacity:
            raise RuntimeError(f"position {pos} beyond the paged cache ({st.capacity})")
        k = key[0, :, -1, :].unsqueeze(0).contiguous()
        v = value[0, :, -1, :].unsqueeze(0).contiguous()
        self.eng.cache_write(layer, k, v, st.kc[layer], st.vc[layer], st.slots(pos, pos + 1))
        q = query[0, :, 0, :].unsqueeze(0).contiguous()
        out = torch.empty(1, HQ, HEAD_DIM)
        cs = self.eng.forward(layer, q, st.kc[layer], st.vc[layer], st.block_table,
                              torch.tensor([pos + 1], dtype=torch.int32), self._qsl1, out,
                              seq_ids=self.seq_ids, scale=SCALE, call_stats=True)
        for k_ in STAT_KEYS:
            self.stats[k_] += cs[k_]
        self.decode_rows += 1
        self.kvs_decode_s += time.perf_counter() - t0
        return out.view(1, 1, HQ, HEAD_DIM)

    @torch.no_grad()
    def step(self, model, token: int, pos: int) -> torch.Tensor:
        """One decode step of the model at `pos` with attention through kvsparse; returns logits."""
        self.pos = pos
        CTX.mode, CTX.run = "kvs", self
        try:
            out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[pos]]),
                        use_cache=False)
        finally:
            CTX.mode, CTX.run = "hf", None
        return out.logits[0, -1]

    def close(self):
        self.eng.release(self.sid)
        self.eng = None


# --------------------------------------------------------------------------
# tasks
# --------------------------------------------------------------------------


@dataclass
class Needle:
    context: int
    depth: float
    seed: int
    prompt: object = None

    @property
    def name(self) -> str:
        return f"{self.context // 1024}K@{self.depth:.2f}"


def make_needles(contexts, n_depths: int, seed0: int) -> list[Needle]:
    """Depth-major with the contexts interleaved (2K@0.1, 4K@0.1, 8K@0.1, 2K@0.19, ...), so that the
    first needles of a run cover every context evenly; the seeds (seed0 + 100 * context index + depth
    index) do not depend on the order."""
    depths = [0.5] if n_depths == 1 else [0.1 + 0.8 * i / (n_depths - 1) for i in range(n_depths)]
    out = []
    for di, d in enumerate(depths):
        for ci, ctx in enumerate(contexts):
            out.append(Needle(ctx, round(d, 3), seed0 + 100 * ci + di))
    return out


def greedy(run_step, first: int, max_new: int, specials: set[int]) -> list[int]:
    """Greedy tokens (first from the prefill logits), stopping at a special token (EOS)."""
    gen = [first]
    while len(gen) < max_new and gen[-1] not in specials:
        logits = run_step(gen[-1], len(gen) - 1)
        gen.append(int(torch.argmax(logits)))
    return gen


def answer_of(tok, gen: list[int], specials: set[int]) -> str:
    cut = next((i for i, t in enumerate(gen) if t in specials), len(gen))
    return tok.decode(gen[:cut], skip_special_tokens=True)


@torch.no_grad()
def hf_reference_check(model, pf: Prefill, tokens: list[int], logits_kvs: list[torch.Tensor]):
    """Teacher-force HF (SDPA + its own cache) on `tokens` from position P; compare logits."""
    P = len(pf.ids)
    worst, agree = 0.0, True
    cache = pf.cache
    for t, (tkn, lk) in enumerate(zip(tokens, logits_kvs)):
        out = model(input_ids=torch.tensor([[tkn]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[P + t]]))
        lh = out.logits[0, -1]
        worst = max(worst, float((lh - lk).abs().max()))
        agree &= int(torch.argmax(lh)) == int(torch.argmax(lk))
    pf.cache = None  # consumed (it now holds the decoded tokens too)
    return worst, agree


def ppl_text(tok, n_tokens: int) -> tuple[list[int], str]:
    """Tokens of CPython's pydoc topics (sorted keys, blank line between topics)."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k].strip() for k in sorted(topics.topics))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise SystemExit(f"pydoc topics text has only {len(ids)} tokens, need {n_tokens}")
    ids = list(ids[:n_tokens])
    return ids, hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


@dataclass
class Result:
    budget: int | None
    name: str
    spec: str
    expanded: dict = field(default_factory=dict)      # prompt length -> spec with {N/k} resolved
    needles: dict = field(default_factory=dict)       # needle name -> (correct, answer)
    needle_stats: dict = field(default_factory=lambda: {k: 0 for k in STAT_KEYS})
    ppl_stats: dict = field(default_factory=lambda: {k: 0 for k in STAT_KEYS})
    nll: list = field(default_factory=list)
    needle_s: float = 0.0
    ppl_s: float = 0.0
    decode_rows: int = 0
    kvs_decode_s: float = 0.0
    steps: int = 0
    tail_rel_err: float = 0.0
    error: str | None = None


_N_FRAC = re.compile(r"\{N/(\d+)\}")


def fmt_spec(template: str, budget: int, tau: str) -> str:
    """The spec of a template at a budget; `{N/k}` stays for expand_n (it depends on the prompt)."""
    template = _N_FRAC.sub(lambda m: "{{N/" + m.group(1) + "}}", template)
    return template.format(B=budget, B64=budget - 64, TAU=tau)


def expand_n(spec: str, n: int) -> str:
    """Replaces every `{N/k}` by n/k rounded up to a multiple of 16 (the block size), at least 16."""
    def one(m):
        k = int(m.group(1))
        if k < 1:
            raise ValueError(f"{spec!r}: {{N/{k}}} needs k >= 1")
        return str(max(BLOCK, BLOCK * math.ceil(n / (k * BLOCK))))
    return _N_FRAC.sub(one, spec)


def tau_variant(name: str) -> str | None:
    """`art_1e-6` -> the `art` template with tau=1e-6 (None if `name` is not such a variant)."""
    base, sep, tau = name.rpartition("_")
    if not sep or base not in POLICIES or "{TAU}" not in POLICIES[base]:
        return None
    try:
        if not math.isfinite(float(tau)) or float(tau) < 0:
            return None
    except ValueError:
        return None
    return POLICIES[base].replace("{TAU}", tau)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--budgets", default="1024", help="comma-separated token budgets B")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated policy names from: {', '.join(POLICIES)}")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=TEMPLATE",
                    help="an extra policy, e.g. 'quest_sink=quest(budget={B}, sink=16)' "
                         "({B} budget, {B64} budget-64, {TAU} ART tau, {N/k} the prompt's tokens / k "
                         "rounded up to a multiple of 16); repeatable. ART's tau sweep needs no --extra: "
                         "name `art_1e-6`, `streaming_art_1e-4`, ... in --policies")
    ap.add_argument("--contexts", default="2048,4096,8192", help="needle contexts (tokens)")
    ap.add_argument("--depths", type=int, default=10,
                    help="needle depths per context, evenly spaced in [0.1, 0.9]")
    ap.add_argument("--needles", type=int, default=0,
                    help="use only the first N needles of the list (0 = all)")
    ap.add_argument("--gen-tokens", type=int, default=12, help="max generated tokens per needle")
    ap.add_argument("--ppl-prefix", type=int, default=3072, help="dense prefill tokens of the text")
    ap.add_argument("--ppl-tokens", type=int, default=512,
                    help="teacher-forced decode steps (predicted tokens); 0 = skip")
    ap.add_argument("--tail", type=int, default=64, help="prompt queries of the last prefill chunk")
    ap.add_argument("--chunk", type=int, default=8192, help="dense prefill chunk (tokens)")
    ap.add_argument("--art-tau", default="1e-5", help="ART tau (absolute, output units; the paper's default)")
    ap.add_argument("--threads", type=int, default=2, help="torch and kvsparse threads")
    ap.add_argument("--seed", type=int, default=7000, help="first needle seed")
    ap.add_argument("--csv", type=Path, default=REPO_ROOT / "docs/quality-data/e2e.csv")
    ap.add_argument("--md", type=Path, default=REPO_ROOT / "docs/quality-data/e2e-report.md")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 needle (2K), dense+quest unless --policies, 1024+16 ppl tokens; "
                         "writes to /tmp")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.depths = "2048", 1
        if args.policies == ",".join(POLICIES):
            args.policies = "dense,quest"
        if args.ppl_prefix == ap.get_default("ppl_prefix"):
            args.ppl_prefix = 1024
        if args.ppl_tokens == ap.get_default("ppl_tokens"):
            args.ppl_tokens = 16
        if args.csv == ap.get_default("csv"):
            args.csv = REPO_ROOT / "out" / "quality-e2e-quick.csv"
        if args.md == ap.get_default("md"):
            args.md = REPO_ROOT / "out" / "quality-e2e-quick.md"

    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    for e in args.extra:
        name, _, template = e.partition("=")
        if not template or name in POLICIES:
            ap.error(f"--extra {e!r}: expected NAME=TEMPLATE with a new NAME")
        POLICIES[name] = template
        names.append(name)
    for n in names:
        if n not in POLICIES and tau_variant(n):
            POLICIES[n] = tau_variant(n)
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}")
    if "dense" not in names:
        names.insert(0, "dense")  # the reference for deltas
    contexts = [int(c) for c in args.contexts.split(",") if c]
    needles = make_needles(contexts, args.depths, args.seed)
    if args.needles:
        needles = needles[:args.needles]

    t_start = time.time()
    import kvsparse
    from kvsparse.engine import KvsError

    tok, model = load_model(args.model)
    specials = set(tok.all_special_ids)
    print(f"[e2e] model loaded in {time.time() - t_start:.1f} s; kvsparse library {kvsparse._ffi.LIB_PATH}",
          flush=True)

    # the runs: dense once, every other policy per budget
    results: dict[tuple, Result] = {("dense", None): Result(None, "dense", "dense")}
    for b in budgets:
        for n in names:
            if n != "dense":
                results[(n, b)] = Result(b, n, fmt_spec(POLICIES[n], b, args.art_tau))
    order = list(results)
    checks = {}
    prefill_s = {}
    out_scale = []

    def run_policy(res: Result, pf: Prefill, store: PagedStore, body, kind: str):
        if res.error:
            return None
        t0 = time.time()
        spec = expand_n(res.spec, len(pf.ids))
        res.expanded[len(pf.ids)] = spec
        try:
            run = KvsRun(spec, pf, store, args.threads)
            value = body(run)
            run.close()
        except KvsError as e:
            res.error = f"{e} (kind={kind}, prompt len {len(pf.ids)}, spec {spec})"
            print(f"[e2e] KVSPARSE ERROR {res.spec}: {res.error}", flush=True)
            return None
        secs = time.time() - t0
        stats = res.needle_stats if kind == "needle" else res.ppl_stats
        for k in STAT_KEYS:
            stats[k] += run.stats[k]
        res.decode_rows += run.decode_rows
        res.kvs_decode_s += run.kvs_decode_s
        res.steps += run.decode_rows // NUM_LAYERS
        res.tail_rel_err = max(res.tail_rel_err, run.tail_rel_err)
        if kind == "needle":
            res.needle_s += secs
        else:
            res.ppl_s += secs
        return value

    def probe_scale():
        scale = torch.cat(out_scale) if out_scale else torch.zeros(1)
        return float(scale.median()), float(scale.quantile(0.1)), float(scale.quantile(0.9))

    def report(n_done: int, ppl_state: str, final: bool = False):
        """(Re)write the CSV and the report: the first n_done needles; ppl_state not run/partial/done."""
        write_outputs(args, results, order, needles[:n_done], contexts, checks, ppl_info, prefill_s,
                      probe_scale()[0], time.time() - t_start, budgets, str(kvsparse._ffi.LIB_PATH),
                      progress=None if final else (n_done, len(needles), ppl_state))

    ppl_info = None
    # ---------------- needles ----------------
    for i, nd in enumerate(needles):
        target = nd.context - 32
        nd.prompt = trace_prompts.needle_prompt(tok, target, nd.depth, nd.seed)
        ids = nd.prompt.token_ids
        value = nd.prompt.info["value"]
        pf = prefill(model, ids, args.tail, args.chunk)
        if i != 0:
            pf.cache = None  # only the first needle's HF cache is needed (reference check)
        prefill_s.setdefault(nd.context, []).append(pf.seconds)
        for L in range(2, NUM_LAYERS):
            # ART's lane probe of one KV head: dims PROBE_DIMS of the group's 3 query heads (12 values)
            o = pf.o_tail[L].view(-1, HKV, HQ // HKV, HEAD_DIM)[..., PROBE_DIMS]
            out_scale.append(o.flatten(2).norm(dim=-1).flatten())
        logits0 = pf.last_logits
        first = int(torch.argmax(logits0))
        store = PagedStore(len(ids) + args.gen_tokens + 1, seed=nd.seed)
        t_needle = time.time()
        line = []
        for key in order:
            res = results[key]
            logits_seen = []

            def body(run, _logits=logits_seen):
                def step(tkn, t):
                    lg = run.step(model, tkn, len(ids) + t)
                    _logits.append(lg)
                    return lg
                return greedy(step, first, args.gen_tokens, specials)

            gen = run_policy(res, pf, store, body, "needle")
            if gen is None:
                line.append(f"{res.name}{'' if res.budget is None else res.budget}=ERR")
                continue
            ans = answer_of(tok, gen, specials)
            ok = value in ans
            res.needles[nd.name] = (ok, ans)
            line.append(f"{res.name}{'' if res.budget is None else '@' + str(res.budget)}="
                        f"{'ok' if ok else 'MISS'}")
            if i == 0 and key == ("dense", None):
                worst, agree = hf_reference_check(model, pf, gen[:-1], logits_seen)
                checks["needle"] = (worst, agree, len(logits_seen))
                print(f"[e2e] check: kvsparse dense vs HF SDPA decode, {len(logits_seen)} steps: "
                      f"max |logit diff| {worst:.2e}, argmax agree {agree}", flush=True)
        print(f"[e2e] needle {i + 1}/{len(needles)} {nd.name} P={len(ids)} value={value} "
              f"prefill {pf.seconds:.1f}s policies {time.time() - t_needle:.1f}s "
              f"dense answer {results[('dense', None)].needles.get(nd.name, (None, ''))[1]!r}: "
              + " ".join(line), flush=True)
        del pf, store
        report(i + 1, "not run yet" if args.ppl_tokens > 0 else "skipped")

    # ---------------- perplexity ----------------
    if args.ppl_tokens > 0:
        Pp, N = args.ppl_prefix, args.ppl_tokens
        ids, digest = ppl_text(tok, Pp + N + 1)
        pf = prefill(model, ids[:Pp], args.tail, args.chunk)
        pf.cache = None
        store = PagedStore(Pp + N + 1, seed=12345)
        targets = torch.tensor(ids[Pp + 1:Pp + N + 1])
        # HF's own perplexity on the same predicted tokens (one full dense forward)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids[:Pp + N]]), use_cache=False, logits_to_keep=N)
        hf_nll = torch.nn.functional.cross_entropy(out.logits[0].double(), targets, reduction="none")
        hf_ppl = math.exp(float(hf_nll.mean()))
        del out
        ppl_info = {"prefix": Pp, "tokens": N, "sha": digest, "prefill_s": pf.seconds,
                    "hf_ppl": hf_ppl}
        t_ppl = time.time()
        for key in order:
            res = results[key]

            def body(run):
                nll = []
                for t in range(N):
                    lg = run.step(model, ids[Pp + t], Pp + t)
                    nll.append(float(torch.nn.functional.cross_entropy(
                        lg.double()[None], targets[t:t + 1])))
                return nll

            nll = run_policy(res, pf, store, body, "ppl")
            if nll is None:
                continue
            res.nll = nll
            print(f"[e2e] ppl {res.spec}: {math.exp(sum(nll) / len(nll)):.4f}", flush=True)
            report(len(needles), "partial (the policies with a ppl value are done)")
        d = results[("dense", None)]
        dense_ppl = math.exp(sum(d.nll) / len(d.nll))
        checks["ppl"] = (hf_ppl, dense_ppl, float((torch.tensor(d.nll, dtype=torch.float64)
                                                    - hf_nll).abs().max()))
        print(f"[e2e] check: HF full-forward ppl {hf_ppl:.6f} vs kvsparse dense decode "
              f"{dense_ppl:.6f} (max per-token |NLL diff| {checks['ppl'][2]:.2e}); "
              f"{time.time() - t_ppl:.1f}s for all policies", flush=True)
        del pf, store

    med, p10, p90 = probe_scale()
    print(f"[e2e] ART probe scale: median L2 norm of the lane probe (dims {PROBE_DIMS} of a KV head's "
          f"{HQ // HKV} query heads) = {med:.4f} over layers 2..29 (p10 {p10:.4f}, p90 {p90:.4f})")
    print(f"[e2e] total {time.time() - t_start:.0f} s")
    report(len(needles), "done", final=True)
    return 0


# --------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------


def _pct(a, b):
    return f"{100.0 * a / b:.1f}%" if b else "-"


def write_outputs(args, results, order, needles, contexts, checks, ppl_info, prefill_s,
                  scale_med, total_s, budgets, kvs_path, progress=None):
    """`needles`: the needles done so far; `progress`: None for a finished run, else
    (needles done, needles planned, perplexity state) for a partial report."""
    so = Path(kvs_path)
    so_sha = hashlib.sha256(so.read_bytes()).hexdigest()[:12] if so.is_file() else "?"
    dense = results[("dense", None)]
    dense_ppl = math.exp(sum(dense.nll) / len(dense.nll)) if dense.nll else None
    rows = []
    for key in order:
        r = results[key]
        # the budget column only where the spec depends on it (not for `top_p`, `art`, `{N/k}` specs)
        uses_b = "{B}" in POLICIES[r.name] or "{B64}" in POLICIES[r.name]
        row = {"budget": (r.budget or "") if uses_b else "", "policy": r.name, "spec": r.spec}
        tot_ok = 0
        for c in contexts:
            names = [n.name for n in needles if n.context == c]
            ok = sum(1 for n in names if r.needles.get(n, (False,))[0])
            row[f"needle_{c // 1024}k"] = f"{ok}/{len(names)}"
            tot_ok += ok
        row["needle_correct"], row["needle_total"] = tot_ok, len(needles)
        row["needle_acc"] = round(tot_ok / len(needles), 4) if needles else ""
        s = r.needle_stats
        row["needle_blocks_visited"], row["needle_blocks_eligible"] = s["blocks_visited"], s["blocks_eligible"]
        row["needle_visited_pct"] = round(100 * s["blocks_visited"] / s["blocks_eligible"], 2) \
            if s["blocks_eligible"] else ""
        p = r.ppl_stats
        row["ppl_blocks_visited"], row["ppl_blocks_eligible"] = p["blocks_visited"], p["blocks_eligible"]
        row["ppl_visited_pct"] = round(100 * p["blocks_visited"] / p["blocks_eligible"], 2) \
            if p["blocks_eligible"] else ""
        if r.nll and dense_ppl:
            ppl = math.exp(sum(r.nll) / len(r.nll))
            row["ppl"] = round(ppl, 4)
            row["ppl_delta"] = round(ppl - dense_ppl, 4)
            row["ppl_delta_pct"] = round(100 * (ppl - dense_ppl) / dense_ppl, 2)
        else:
            row["ppl"] = row["ppl_delta"] = row["ppl_delta_pct"] = ""
        both = {k: s[k] + p[k] for k in STAT_KEYS}
        row["top_p_kept_pct"] = round(100 * both["top_p_kept"] / both["top_p_candidates"], 2) \
            if both["top_p_candidates"] else ""
        row["art_skipped_pct"] = round(100 * both["blocks_skipped_termination"] / both["blocks_eligible"], 2) \
            if both["blocks_skipped_termination"] and both["blocks_eligible"] else ""
        row["spec_hit_rate"] = round(both["spec_hit_blocks"] / both["spec_true_blocks"], 4) \
            if both["spec_true_blocks"] else ""
        full, part = both["refresh_full_steps"], both["refresh_partial_steps"]
        row["full_steps_pct"] = round(100 * full / (full + part), 2) if full + part else ""
        row["decode_steps"] = r.steps
        row["kvs_ms_per_step"] = round(1000 * r.kvs_decode_s / r.steps, 2) if r.steps else ""
        row["needle_s"], row["ppl_s"] = round(r.needle_s, 1), round(r.ppl_s, 1)
        row["prefill_chunk_max_rel_err"] = f"{r.tail_rel_err:.1e}"
        row["specs_resolved"] = "; ".join(f"P={n}: {v}" for n, v in sorted(r.expanded.items())) \
            if any(v != r.spec for v in r.expanded.values()) else ""
        row["error"] = r.error or ""
        row["library"] = f"sha256 {so_sha}"
        rows.append(row)

    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    # printed + markdown tables
    date = subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "src"],
                           capture_output=True, text=True).stdout.strip()
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ctx_cols = [f"needle_{c // 1024}k" for c in contexts]
    hdr = ["policy", "B", "needles"] + [c.replace("needle_", "").upper() for c in ctx_cols] + \
          ["blocks visited (needles)", "blocks visited (ppl)", "ppl", "Δppl", "Δppl %",
           "kvsparse ms/step", "runtime s"]
    table = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for row in rows:
        spec = f"`{row['spec']}`"
        if row["error"]:
            table.append(f"| {spec} | {row['budget']} | ERROR: {row['error']} |" + " |" * (len(hdr) - 3))
            continue
        def vis(pct, ran):
            if not ran:
                return "-"
            return f"{pct}%" if pct != "" else "100% (dense)"
        vis_n = vis(row["needle_visited_pct"], bool(row["needle_total"]))
        vis_p = vis(row["ppl_visited_pct"], row["ppl"] != "")
        dp = "" if row["ppl_delta"] == "" else f"{row['ppl_delta']:+.4f}"
        dpp = "" if row["ppl_delta_pct"] == "" else f"{row['ppl_delta_pct']:+.2f}%"
        table.append("| " + " | ".join(str(x) for x in [
            spec, row["budget"] or "-", f"{row['needle_correct']}/{row['needle_total']}"]
            + [row[c] for c in ctx_cols]
            + [vis_n, vis_p, row["ppl"], dp, dpp, row["kvs_ms_per_step"],
               round(row["needle_s"] + row["ppl_s"], 1)]) + " |")
    extra_hdr = ["policy", "B", "top-p kept", "ART skipped", "PRR hit rate", "full steps",
                 "prefill-chunk rel err vs SDPA"]
    extra = ["| " + " | ".join(extra_hdr) + " |", "|" + "---|" * len(extra_hdr)]
    for row in rows:
        extra.append("| " + " | ".join(str(x) if x != "" else "-" for x in [
            f"`{row['spec']}`", row["budget"] or "-",
            f"{row['top_p_kept_pct']}%" if row["top_p_kept_pct"] != "" else "",
            f"{row['art_skipped_pct']}%" if row["art_skipped_pct"] != "" else "",
            row["spec_hit_rate"], f"{row['full_steps_pct']}%" if row["full_steps_pct"] != "" else "",
            row["prefill_chunk_max_rel_err"]]) + " |")
    # per-needle matrix
    cols = [(key, results[key]) for key in order]
    nh = ["needle", "P", "value", "dense answer"] + \
         [f"{r.name}{'' if r.budget is None else '@' + str(r.budget)}" for _, r in cols[1:]]
    nt = ["| " + " | ".join(nh) + " |", "|" + "---|" * len(nh)]
    for nd in needles:
        d_ok, d_ans = dense.needles.get(nd.name, (False, ""))
        cells = [nd.name, str(len(nd.prompt.token_ids)), nd.prompt.info["value"],
                 ("✓ " if d_ok else "✗ ") + repr(d_ans.strip()[:40]).replace("|", "\\|")]
        for _, r in cols[1:]:
            ok = r.needles.get(nd.name)
            cells.append("err" if ok is None else ("✓" if ok[0] else
                         "✗ " + repr(ok[1].strip()[:16]).replace("|", "\\|")))
        nt.append("| " + " | ".join(cells) + " |")

    if progress is None:
        print("\n" + "\n".join(table) + "\n\n" + "\n".join(extra) + "\n\n" + "\n".join(nt) + "\n")

    cmd = "python scripts/quality_e2e.py " + " ".join(sys.argv[1:])
    pre = ", ".join(f"{c // 1024}K {sum(v) / len(v):.1f} s" for c, v in sorted(prefill_s.items()))
    nchk = checks.get("needle")
    pchk = checks.get("ppl")
    md = []
    md.append("## End to end: needle retrieval and perplexity on the real model\n")
    if progress is not None:
        md.append(f"**PARTIAL REPORT** (rewritten as the run goes): {progress[0]} of {progress[1]} "
                  f"needles done (depth-major, contexts interleaved); perplexity: {progress[2]}. "
                  f"The needle columns count the needles done so far.\n")
    md.append(f"Measured {date} at commit `{commit}`"
              + (" (src/ had uncommitted changes of another branch of work)" if dirty else "")
              + f", on the 2-core development VM ({cpu}, no GPU), {args.threads} torch / "
              f"kvsparse threads; library `{kvs_path}` (sha256 {so_sha}…); "
              f"{'wall time so far' if progress else 'total wall time'} {total_s / 60:.1f} min. Command:\n")
    md.append(f"```sh\n.venv/bin/{cmd}\n```\n")
    md.append("**Method.** SmolLM2-135M-Instruct (`.cache/smollm2`, float32, 30 layers, 9 query / "
              "3 KV heads, head size 64) runs under HF transformers on the CPU. The prompt is "
              "prefilled **densely** (torch SDPA, one pass). Then, per policy, a fresh kvsparse "
              "`Engine` (f32, blocks of 16, default `dense_layers=2`: layers 0 and 1 stay dense) gets "
              "every layer's post-RoPE prompt K/V through `cache_write` into a paged cache whose "
              "physical blocks are in a random order, then one `forward` per layer over the last "
              f"{args.tail} prompt queries as a prefill chunk (query length {args.tail}, "
              "seq_len = P) — the last chunk of a chunked prefill, where SnapKV chooses, PRR "
              "calibrates and the predictor seeds its history. Its output matches the dense SDPA "
              "prefill (column *prefill-chunk rel err*). Every **decode** step then runs the HF model "
              "with no HF cache: the attention of each of the 30 layers writes the new K/V row with "
              "`cache_write` and calls kvsparse `forward` with the sequence id; its output goes to "
              "`o_proj`. So everything after the prompt is attended through the policy.\n")
    if nchk:
        md.append(f"*Check:* with `dense`, the kvsparse decode reproduces HF's own attention "
                  f"(SDPA with its DynamicCache, teacher-forced on the same tokens) on the first "
                  f"needle: max |logit difference| {nchk[0]:.1e} over {nchk[2]} steps, argmax "
                  f"{'identical' if nchk[1] else 'DIFFERENT'} at every step"
                  + (f"; on the perplexity text HF's full-forward perplexity is {pchk[0]:.6f} and "
                     f"kvsparse-dense decode gives {pchk[1]:.6f} (max per-token |ΔNLL| {pchk[2]:.1e})"
                     if pchk else "") + ".\n")
    md.append(f"**Needles.** `scripts/trace_prompts.py:needle_prompt` (RULER niah_single: repeated "
              f"filler sentences, one \"special magic number\" needle with a 7-digit value, question, "
              f"RULER answer prefix; chat template), {len(needles)} needles"
              + (f" (of {progress[1]})" if progress else "") + f": contexts "
              f"{', '.join(str(c) for c in contexts)} (prompt ≤ context − 32 tokens), "
              f"{args.depths} depths per context evenly spaced in [0.1, 0.9], seeds "
              f"{args.seed}… (one per needle: seed + 100 × context index + depth index; run depth-major, "
              f"the contexts interleaved). Greedy decoding of at most {args.gen_tokens} "
              f"tokens, stopping at a special token; correct when the needle's value appears in the "
              f"answer. Prefill time per prompt: {pre}.\n")
    if ppl_info:
        md.append(f"**Perplexity.** Text: CPython {platform.python_version()}'s "
                  f"`pydoc_data/topics.py` (the help topics of the Python documentation: English "
                  f"prose about the language with some code; part of every CPython install, "
                  f"unrelated to our prompts; it may well be in the model's pretraining data, "
                  f"which affects dense and the policies alike — the point is the delta). Topics in "
                  f"sorted key order joined by blank lines, tokens 0…{ppl_info['prefix'] + ppl_info['tokens']} "
                  f"(sha256 of the token ids {ppl_info['sha']}). The first {ppl_info['prefix']} "
                  f"tokens are prefilled densely; the next {ppl_info['tokens']} are teacher-forced "
                  f"one at a time as decode steps through the policy (context "
                  f"{ppl_info['prefix']}…{ppl_info['prefix'] + ppl_info['tokens'] - 1}), and the "
                  f"perplexity is exp(mean NLL) of the {ppl_info['tokens']} tokens they predict.\n")
    nfrac = []
    for key in order:
        r = results[key]
        if r.expanded and any(v != r.spec for v in r.expanded.values()):
            nfrac.append(f"`{r.spec}`: " + ", ".join(f"P={n} → `{v}`" for n, v in sorted(r.expanded.items())))
    md.append(f"**Policies.** Specs as in docs/policies.md; `{{B}}` is the budget in tokens; `{{N/k}}` is "
              f"the prompt's token count N (the needle prompt, or the perplexity prefix) divided by k and "
              f"rounded up to a multiple of 16, resolved per prompt"
              + (" (" + "; ".join(nfrac) + ")" if nfrac else "") + ". ART's "
              f"`tau` is absolute (output units): the median L2 norm of ART's lane probe (dims "
              f"{', '.join(map(str, PROBE_DIMS))} of the {HQ // HKV} query heads of a KV head, 12 values; "
              f"layers 2–29, dense prefill tail) is {scale_med:.3f} for this model, so "
              f"`tau={args.art_tau}` is ≈ {float(args.art_tau) / scale_med:.1e} of it.\n")
    md.append("*blocks visited* is `blocks_visited / blocks_eligible` summed over the decode rows "
              "served by the policy (layers 2–29 × KV heads); *kvsparse ms/step* is the time in "
              "`cache_write` + `forward` for the 30 layers of one decode step (the rest of a step "
              "is the model's own matmuls); *runtime* is the policy's own time (engine setup, "
              "prompt writes, the prefill chunk, all decode steps, over all needles and the "
              "perplexity run; the shared dense prefills are not included).\n")
    md.append("\n".join(table) + "\n")
    md.append("Policy counters (needles and perplexity together):\n")
    md.append("\n".join(extra) + "\n")
    md.append("Per needle (✓ retrieved, ✗ missed, with the start of the answer):\n")
    md.append("\n".join(nt) + "\n")
    args.md.parent.mkdir(parents=True, exist_ok=True)
    args.md.write_text("\n".join(md))
    print(f"[e2e] wrote {args.csv} and {args.md}")


if __name__ == "__main__":
    sys.exit(main())
