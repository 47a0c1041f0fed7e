#!/usr/bin/env python3
"""End to end through the Python package: decode steps of a Llama-3-8B-shaped decoder whose attention is
kvsparse (dense and each GPU policy) or PyTorch SDPA, eager and CUDA-graph replay (issue 15).

The model is plain PyTorch: 32 layers, 32 query / 8 KV heads, head 128, hidden 4096, MLP 14336 (SwiGLU),
vocabulary 128256, RMSNorm, RoPE (theta 500000), bf16, **random weights** (seeded; no 8B checkpoint can reach
the GPU machine). Its attention is one of:
  none      attention skipped (the layer's output is its query): the rest of the step alone, to split the
            step into attention and everything else (weights, MLP, norms, RoPE, lm_head, argmax).
  dense     kvsparse, no policy, over a paged cache (block 16, shuffled block table).
  <spec>    kvsparse with a policy (`L/N` in a spec is the context over N at each point).
  sdpa      torch.nn.functional.scaled_dot_product_attention over contiguous [B, 8, L+1, 128] K/V with
            enable_gqa, the cuDNN backend forced (--sdpa-backend), the alternative a user has at hand.

Per grid point (batch x context L): prefill of B random prompts of L tokens through the model (per sequence,
projections and MLP in token chunks, causal SDPA) writes each layer's K/V into the paged cache, and its last
logits give each sequence's first decode token. The kvsparse backends run on that cache (a policy engine
first rewrites it through its own cache_write, which builds its key metadata, then takes the prompts' last
`--prefill-tail` positions as a prefill chunk of its own, so that SnapKV chooses, RefreshKV builds its first
set, and the predictor and PRR seed their history as they would in serving); then the cache is gathered
layer by layer into the contiguous K/V SDPA reads (the same prefill K/V), the paged one freed.

A timed decode step is the whole model for B tokens at position L: embedding, per layer norm, QKV, RoPE,
cache write of the step's K/V at position L and attention over L+1 keys, output projection, MLP; final norm,
lm_head, argmax fed back as the next step's token (on the device, inside the step). Every step of every
backend writes its K/V at the same position L (it overwrites the previous step's), so every backend and
mode times the same work, a step at context L+1, and the graph needs no host input between replays.
Eager: the step's Python issuing kernels (as a framework without graphs would); graph: the whole step
captured once with torch.cuda.graph and replayed. Times from CUDA events on one stream: the median over
groups of back-to-back steps.

Checks printed with the table (exit status 1 if one fails for a kvsparse backend; `none` and `sdpa` are
torch's own and only reported):
  graph==eager  from the same first token, N eager steps and N graph replays give the same greedy tokens,
                and the logits are compared (max |diff|); for every backend (acceptance 2: dense and quest).
  no-sync       one eager step under torch.cuda.set_sync_debug_mode("error") (the capture itself fails on
                any synchronization inside kvsparse).
  vs dense      the first step's logits of each backend against kvsparse dense (relative L2 error, greedy
                token agreement): SDPA vs dense is the wiring check, a policy's is its approximation.

On the CPU (`--device cpu --tiny`: 2 layers, 4/2 heads, head 64, fp32, small contexts) the same code runs
with kvsparse's CPU engine and torch SDPA, without graphs, and SDPA vs dense must agree within 1e-4.

A backend that fails (out of memory, a spec the engine refuses, cuDNN refusing a shape: then flash) is skipped
with its reason in the table's notes, a grid point that fails (e.g. out of memory for its cache) likewise,
and with --budget-s nothing new starts after that many seconds; the CSV is written point by point.

Usage (GPU): python3 scripts/gpu_e2e.py [--grid 1x32768,1x131072,8x32768,32x8192] [--csv FILE]
($OUT/gpu_e2e.csv by default when $OUT is set). Needs KVSPARSE_LIB (a CUDA build) and cffi.
"""
import argparse
import contextlib
import gc
import math
import os
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python_shim"))

from kvsparse import Engine  # noqa: E402
from kvsparse.engine import with_max_seqs  # noqa: E402
from kvsparse.step import LayerCall, StepMeta, raw_stream  # noqa: E402

BLOCK = 16


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    rope_theta: float
    eps: float = 1e-5


LLAMA3_8B = Shape(32, 4096, 32, 8, 128, 14336, 128256, 500000.0)
TINY = Shape(2, 256, 4, 2, 64, 512, 512, 10000.0)

DEFAULT_POLICIES = ["streaming(sink=64, recent=L/16)", "quest(budget=L/16)", "quest(budget=L/4) > top_p(p=0.95)",
                    "top_p(p=0.95)", "speculate(over=quest(budget=L/16), budget=L/16)", "snapkv(budget=L/16)",
                    "refresh(k=L/16, every=5)", "predictor(budget=L/32)"]


def spec_at(spec: str, ctx: int) -> str:
    """`L/N` in a spec -> ctx // N."""
    return re.sub(r"L/(\d+)", lambda m: str(max(1, ctx // int(m.group(1)))), spec)


# ---------------------------------------------------------------------------------------------------------
# The model

class Weights:
    """Random (seeded) weights of the decoder, stored [in, out] so that a projection is `x @ w`."""

    def __init__(self, sh: Shape, dtype, device, seed):
        g = torch.Generator(device=device)
        g.manual_seed(seed)

        def rnd(rows, cols, scale):
            t = torch.randn(rows, cols, generator=g, device=device, dtype=dtype)
            return t.mul_(scale)

        hd = sh.head_dim
        qkv = (sh.heads + 2 * sh.kv_heads) * hd
        self.embed = rnd(sh.vocab, sh.hidden, 1.0)
        self.layers = []
        for _ in range(sh.layers):
            self.layers.append(dict(
                ln1=torch.ones(sh.hidden, dtype=dtype, device=device),
                wqkv=rnd(sh.hidden, qkv, sh.hidden ** -0.5),
                wo=rnd(sh.heads * hd, sh.hidden, (sh.heads * hd) ** -0.5),
                ln2=torch.ones(sh.hidden, dtype=dtype, device=device),
                wgu=rnd(sh.hidden, 2 * sh.mlp, sh.hidden ** -0.5),
                wd=rnd(sh.mlp, sh.hidden, sh.mlp ** -0.5)))
        self.norm = torch.ones(sh.hidden, dtype=dtype, device=device)
        self.lm_head = rnd(sh.hidden, sh.vocab, sh.hidden ** -0.5)

    def bytes(self):
        ts = [self.embed, self.norm, self.lm_head] + [t for l in self.layers for t in l.values()]
        return sum(t.numel() * t.element_size() for t in ts)


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_tables(positions, sh: Shape):
    """cos, sin [n, head_dim/2] (float32) for integer positions [n]."""
    hd = sh.head_dim
    inv = sh.rope_theta ** (-torch.arange(0, hd, 2, device=positions.device, dtype=torch.float64) / hd)
    ang = positions.double()[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def rope(x, cos, sin):
    """Rotates x [n, heads, head_dim] (Llama's rotate-half layout) by per-row angles cos/sin [n or 1, hd/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def split_qkv(qkv, sh: Shape):
    hd, hq, hk = sh.head_dim, sh.heads, sh.kv_heads
    n = qkv.shape[0]
    q = qkv[:, :hq * hd].view(n, hq, hd)
    k = qkv[:, hq * hd:(hq + hk) * hd].view(n, hk, hd)
    v = qkv[:, (hq + hk) * hd:].view(n, hk, hd)
    return q, k, v


def mlp(h, lw, sh: Shape):
    g, u = (h @ lw["wgu"]).chunk(2, dim=-1)
    return (F.silu(g) * u) @ lw["wd"]


class Decoder:
    """One decode step of B sequences at position L, attention from `attn(layer, q, k, v) -> [B, heads*hd]`.
    The token buffer is fed back inside the step, so repeated steps (or replays) generate greedily."""

    def __init__(self, w: Weights, sh: Shape, tok0, ctx):
        self.w, self.sh = w, sh
        self.tok0 = tok0.clone()
        self.tok = tok0.clone()  # the step's input token per sequence; the step writes the next one here
        self.logits = torch.empty(tok0.shape[0], sh.vocab, dtype=torch.float32, device=tok0.device)
        self.cos, self.sin = rope_tables(torch.tensor([ctx], device=tok0.device), sh)
        self.attn = None

    def reset(self):
        self.tok.copy_(self.tok0)

    def step(self):
        w, sh = self.w, self.sh
        B = self.tok.shape[0]
        x = F.embedding(self.tok, w.embed)
        for layer, lw in enumerate(w.layers):
            h = rms_norm(x, lw["ln1"], sh.eps)
            q, k, v = split_qkv(h @ lw["wqkv"], sh)
            q, k = rope(q, self.cos, self.sin), rope(k, self.cos, self.sin)
            o = self.attn(layer, q, k, v)
            x = x + o.reshape(B, -1) @ lw["wo"]
            x = x + mlp(rms_norm(x, lw["ln2"], sh.eps), lw, sh)
        logits = rms_norm(x, w.norm, sh.eps) @ w.lm_head
        self.logits.copy_(logits)
        self.tok.copy_(self.logits.argmax(dim=-1))


# ---------------------------------------------------------------------------------------------------------
# Caches, prefill

class Paged:
    """Per-layer paged K/V caches [num_blocks, 16, kv_heads, hd] and a shuffled block table [B, cols]."""

    def __init__(self, B, ctx, sh: Shape, dtype, device, gen):
        self.B, self.ctx = B, ctx
        self.cols = (ctx + 1 + BLOCK - 1) // BLOCK  # the prompt and the decode position
        nb = B * self.cols
        perm = torch.randperm(nb, generator=gen).to(device)
        self.table = perm.view(B, self.cols).to(torch.int32)
        self.k = [torch.empty(nb, BLOCK, sh.kv_heads, sh.head_dim, dtype=dtype, device=device) for _ in range(sh.layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.decode_slots = self.slots_of(torch.full((B,), ctx, dtype=torch.int64, device=device))

    def slots_of(self, pos, seq=None):
        """Slots of positions `pos` ([B] per sequence when seq is None, else [n] of sequence `seq`)."""
        t = self.table.long()
        blocks = t[torch.arange(self.B, device=pos.device), pos // BLOCK] if seq is None else t[seq, pos // BLOCK]
        return blocks * BLOCK + pos % BLOCK

    def prompt_slots(self):
        """[B, ctx] slots of every prompt position, in position order."""
        pos = torch.arange(self.ctx, device=self.table.device)
        return torch.stack([self.slots_of(pos, s) for s in range(self.B)])

    def flat(self, layer):
        sh = self.k[layer].shape
        return self.k[layer].view(-1, sh[2], sh[3]), self.v[layer].view(-1, sh[2], sh[3])


def fused_sdpa(dev):
    """On CUDA, SDPA without the math backend (its L x L scores do not fit at 128K: fail, never thrash)."""
    if dev.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


def prefill(w: Weights, sh: Shape, cache: Paged, tokens, chunk, tail):
    """Runs the prompts [B, ctx] through the model, writing every layer's K/V into the paged cache; returns
    each sequence's greedy next token [B] and, per layer, the queries of the last `tail` prompt positions
    [B, tail, heads, hd] (after RoPE), for the kvsparse backends' own prefill chunk (`prefill_tail`)."""
    B, L = tokens.shape
    dev = tokens.device
    cos, sin = rope_tables(torch.arange(L, device=dev), sh)
    slots = cache.prompt_slots()
    out = torch.empty(B, dtype=torch.int64, device=dev)
    group = sh.heads // sh.kv_heads
    q_tail = [torch.empty(B, tail, sh.heads, sh.head_dim, dtype=w.embed.dtype, device=dev) for _ in w.layers]
    for b in range(B):
        x = w.embed[tokens[b]]
        for layer, lw in enumerate(w.layers):
            kf, vf = cache.flat(layer)
            q_all = torch.empty(L, sh.heads, sh.head_dim, dtype=x.dtype, device=dev)
            k_all = torch.empty(L, sh.kv_heads, sh.head_dim, dtype=x.dtype, device=dev)
            v_all = torch.empty_like(k_all)
            for c0 in range(0, L, chunk):
                c1 = min(L, c0 + chunk)
                q, k, v = split_qkv(rms_norm(x[c0:c1], lw["ln1"], sh.eps) @ lw["wqkv"], sh)
                q_all[c0:c1] = rope(q, cos[c0:c1], sin[c0:c1])
                k_all[c0:c1] = rope(k, cos[c0:c1], sin[c0:c1])
                v_all[c0:c1] = v
            kf[slots[b]] = k_all
            vf[slots[b]] = v_all
            q_tail[layer][b] = q_all[L - tail:]
            # Causal attention of the whole prompt (GQA expanded: flash/efficient SDPA without enable_gqa).
            qh = q_all.transpose(0, 1).unsqueeze(0)
            kh = k_all.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
            vh = v_all.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
            del q_all, k_all, v_all
            with fused_sdpa(dev):
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            del qh, kh, vh
            o = o[0].transpose(0, 1).reshape(L, sh.heads * sh.head_dim)
            for c0 in range(0, L, chunk):
                c1 = min(L, c0 + chunk)
                xc = x[c0:c1] + o[c0:c1] @ lw["wo"]
                x[c0:c1] = xc + mlp(rms_norm(xc, lw["ln2"], sh.eps), lw, sh)
            del o
        out[b] = (rms_norm(x[-1:], w.norm, sh.eps) @ w.lm_head).float().argmax(-1)[0]
        del x
    return out, q_tail


# ---------------------------------------------------------------------------------------------------------
# Attention backends

class NoAttention:
    name, spec = "none", "attention skipped"

    def __call__(self, layer, q, k, v):
        return q


class KvsAttention:
    """kvsparse through the package's per-step module (one LayerCall per layer, one StepMeta for the step),
    as the vLLM/SGLang backends call it, on torch's current stream."""

    def __init__(self, name, spec, sh: Shape, cache: Paged, dtype, device, threads):
        self.name, self.spec = name, spec
        # Per-sequence policy state for the batch's sequences only, as the serving plugins size it (the default,
        # 256, would give the predictor 8.6 GB of history per layer at 128K: more than the GPU holds).
        spec = with_max_seqs(spec, cache.B)
        self.engine = Engine(num_layers=sh.layers, num_q_heads=sh.heads, num_kv_heads=sh.kv_heads,
                             head_dim=sh.head_dim, block_size=BLOCK, dtype=dtype, device=device, policy=spec,
                             num_threads=threads)
        self.dev = torch.device(device)
        self.cache = cache
        B = cache.B
        self.calls = []
        for layer in range(sh.layers):
            c = LayerCall(self.engine, layer, scale=sh.head_dim ** -0.5)
            c.set_caches(cache.k[layer], cache.k[layer], cache.v[layer])
            self.calls.append(c)
        self.seq_lens = torch.full((B,), cache.ctx + 1, dtype=torch.int32, device=self.dev)
        self.qsl = torch.arange(B + 1, dtype=torch.int32, device=self.dev)
        self.ids = torch.arange(B, dtype=torch.int64, device=self.dev)
        # max_seq_len 0: plan for the block table's width, as a captured step must (eager does the same, so
        # both run the same launches).
        self.meta = StepMeta(cache.table, self.seq_lens, self.qsl, self.ids, num_tokens=B, max_query_len=1,
                             max_seq_len=0)
        self.outs = [torch.empty(B, sh.heads, sh.head_dim, dtype=dtype, device=self.dev) for _ in range(sh.layers)]

    def rewrite_cache(self, chunk=1 << 18):
        """The prompt K/V again through this engine's cache_write, which builds its key metadata (Quest page
        bounds, top-p's INT4 copy); the values written are the ones already there."""
        slots = self.cache.prompt_slots().reshape(-1)
        s = raw_stream(self.dev)
        for layer, c in enumerate(self.calls):
            kf, vf = self.cache.flat(layer)
            for c0 in range(0, slots.numel(), chunk):
                idx = slots[c0:c0 + chunk]
                c.write(kf[idx], vf[idx], idx, s)

    def prefill_tail(self, q_tail):
        """The prompts' last `tail` positions as one prefill chunk through this engine, layer by layer (the
        queries `q_tail[layer]` [B, tail, heads, hd] from the shared prefill, their K/V already in the cache,
        written again through cache_write): what a serving engine's last prefill chunk gives a policy, so
        one that decides or seeds its state at prefill (SnapKV's choice from its observation window,
        RefreshKV's first set, the predictor's and PRR's history) starts its decode steps as it would in
        serving. The outputs are dropped (the shared prefill's SDPA already fed the model)."""
        B, T = q_tail[0].shape[:2]
        if T == 0:
            return
        L = self.cache.ctx
        slots = self.cache.prompt_slots()[:, L - T:].reshape(-1)
        seq_lens = torch.full((B,), L, dtype=torch.int32, device=self.dev)
        qsl = torch.arange(B + 1, dtype=torch.int32, device=self.dev) * T
        meta = StepMeta(self.cache.table, seq_lens, qsl, self.ids, num_tokens=B * T, max_query_len=T, max_seq_len=L)
        out = torch.empty(B * T, *q_tail[0].shape[2:], dtype=q_tail[0].dtype, device=self.dev)
        s = raw_stream(self.dev)
        for layer, c in enumerate(self.calls):
            kf, vf = self.cache.flat(layer)
            c.write(kf[slots], vf[slots], slots, s)
            c.attend(q_tail[layer].reshape(B * T, *q_tail[layer].shape[2:]), out, meta, s)

    def __call__(self, layer, q, k, v):
        s = raw_stream(self.dev)
        c = self.calls[layer]
        c.write(k, v, self.cache.decode_slots, s)
        c.attend(q, self.outs[layer], self.meta, s)
        return self.outs[layer]

    def visited(self):
        """Blocks read over blocks eligible, all policy calls so far (synchronizes; outside timing)."""
        st = self.engine.stats()
        return st["blocks_visited"] / st["blocks_eligible"] if st["blocks_eligible"] else float("nan")


class SdpaAttention:
    """SDPA over contiguous K/V [B, kv_heads, L+1, hd] per layer; the step's K/V written at position L."""

    name = "sdpa"

    def __init__(self, ks, vs, ctx, backend):
        self.k, self.v, self.ctx = ks, vs, ctx
        self.backend = backend
        self.spec = f"SDPA {backend or 'default'}"

    def context(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if self.backend is None:
            return contextlib.nullcontext()
        return sdpa_kernel([getattr(SDPBackend, self.backend.upper() + "_ATTENTION")])

    def __call__(self, layer, q, k, v):
        kc, vc = self.k[layer], self.v[layer]
        kc[:, :, self.ctx].copy_(k)
        vc[:, :, self.ctx].copy_(v)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, enable_gqa=True)
        return o.reshape(q.shape)


def to_contiguous(cache: Paged, sh: Shape):
    """Gathers the prompt K/V of the paged cache into [B, kv_heads, L+1, hd] per layer, freeing each paged
    layer as it goes (both at once do not fit at batch 8 x 32K)."""
    slots = cache.prompt_slots()
    B, L = slots.shape
    ks, vs = [], []
    for layer in range(sh.layers):
        kf, vf = cache.flat(layer)
        kc = torch.empty(B, sh.kv_heads, L + 1, sh.head_dim, dtype=kf.dtype, device=kf.device)
        vc = torch.empty_like(kc)
        kc[:, :, :L] = kf[slots].transpose(1, 2)
        vc[:, :, :L] = vf[slots].transpose(1, 2)
        cache.k[layer] = cache.v[layer] = None
        del kf, vf
        ks.append(kc)
        vs.append(vc)
    return ks, vs


# ---------------------------------------------------------------------------------------------------------
# Timing and checks

class Runner:
    def __init__(self, a, dev):
        self.a, self.dev = a, dev
        self.cuda = dev.type == "cuda"
        self.stream = torch.cuda.Stream() if self.cuda else None

    def on_stream(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn, groups, per):
        """Median ms per call over `groups` groups of `per` back-to-back calls."""
        times = []
        for _ in range(groups):
            if self.cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(self.stream)
                for _ in range(per):
                    fn()
                e1.record(self.stream)
                e1.synchronize()
                times.append(e0.elapsed_time(e1) / per)
            else:
                t0 = time.perf_counter()
                for _ in range(per):
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / per)
        return statistics.median(times)

    def run_steps(self, fn, model, n):
        """n steps from the first token; the tokens fed and logits of each."""
        model.reset()
        toks, logits = [], []
        for _ in range(n):
            fn()
            toks.append(model.tok.clone())
            logits.append(model.logits.clone())
        return torch.stack(toks), torch.stack(logits)

    def measure(self, model: Decoder, attn, result, reseed=None):
        """Fills result with first-step logits, eager and graph times, checks. `reseed`, for a policy with
        per-sequence state (PRR's predictor, RefreshKV's set, the predictor's history): brings that state
        back to what the prefill left, before the eager and before the graph check runs, so both start
        from the same state (the timed steps before them have moved it on)."""
        a = self.a
        model.attn = attn
        ctx = attn.context() if hasattr(attn, "context") else contextlib.nullcontext()
        with self.on_stream(), ctx:
            model.reset()
            model.step()  # warm-up: kernel JIT, workspaces on this stream
            self.sync()
            model.reset()
            model.step()
            result["first_logits"] = model.logits.clone()
            result["first_tok"] = model.tok.clone()
            if self.cuda:
                try:
                    torch.cuda.set_sync_debug_mode("error")
                    model.step()
                    result["no_sync"] = True
                except RuntimeError as e:
                    result["no_sync"] = False
                    result["note"] += f" sync in eager step: {str(e).splitlines()[0][:100]};"
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            model.step()
            result["eager_ms"] = self.time_ms(model.step, a.groups, a.eager_steps)
            if not self.cuda or a.no_graph:
                return
            if reseed:
                reseed()
            eager_tok, eager_logits = self.run_steps(model.step, model, a.check_steps)
            self.sync()
            g = torch.cuda.CUDAGraph()
            try:
                model.reset()
                with torch.cuda.graph(g, stream=self.stream):
                    model.step()
            except Exception as e:  # noqa: BLE001 - reported, the other backends go on
                result["note"] += f" graph capture failed: {str(e).splitlines()[0][:160]};"
                result["graph_ok"] = False
                del g
                return
            g.replay()
            if reseed:
                self.sync()
                reseed()
            graph_tok, graph_logits = self.run_steps(g.replay, model, a.check_steps)
            self.sync()
            same = torch.equal(eager_tok, graph_tok)
            diff = (eager_logits - graph_logits).abs().max().item()
            result["graph_ok"] = same
            result["graph_logit_diff"] = diff
            result["graph_ms"] = self.time_ms(g.replay, a.groups, a.graph_steps)
            del g


# ---------------------------------------------------------------------------------------------------------
# Report

COLUMNS = ["device", "batch", "ctx", "backend", "spec", "eager_ms", "eager_tok_s", "graph_ms", "graph_tok_s",
           "attn_share_eager", "attn_share_graph", "x_sdpa_eager", "x_sdpa_graph", "x_dense_eager", "x_dense_graph",
           "kv_visited", "logit_err_vs_dense", "top1_vs_dense", "graph_eq_eager", "graph_logit_maxdiff", "no_sync",
           "note"]


def fmt(v, spec=".2f"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def derive(rows):
    """Tokens/s, attention share and speedups of one grid point's rows (in place)."""
    by = {r["backend"]: r for r in rows}
    for r in rows:
        for mode in ("eager", "graph"):
            ms = r.get(f"{mode}_ms")
            r[f"{mode}_tok_s"] = r["batch"] * 1e3 / ms if ms else None
            none = by.get("none", {}).get(f"{mode}_ms")
            r[f"attn_share_{mode}"] = (ms - none) / ms if ms and none and r["backend"] != "none" else None
            for ref in ("sdpa", "dense"):
                base = by.get(ref, {}).get(f"{mode}_ms")
                r[f"x_{ref}_{mode}"] = base / ms if ms and base and r["backend"] != "none" else None


def print_table(rows):
    head = ["B", "ctx", "backend", "eager ms", "tok/s", "graph ms", "tok/s", "attn% e/g", "x sdpa e/g",
            "x dense e/g", "visited", "err vs dense", "top1", "graph==eager"]
    lines = [head]
    for r in rows:
        share = f"{fmt(pct(r.get('attn_share_eager')), '.0f')}/{fmt(pct(r.get('attn_share_graph')), '.0f')}"
        lines.append([str(r["batch"]), str(r["ctx"]), r["backend"], fmt(r.get("eager_ms")), fmt(r.get("eager_tok_s"), ".0f"),
                      fmt(r.get("graph_ms")), fmt(r.get("graph_tok_s"), ".0f"), share,
                      f"{fmt(r.get('x_sdpa_eager'))}/{fmt(r.get('x_sdpa_graph'))}",
                      f"{fmt(r.get('x_dense_eager'))}/{fmt(r.get('x_dense_graph'))}",
                      fmt(r.get("kv_visited"), ".3f"), fmt(r.get("logit_err_vs_dense"), ".1e"),
                      fmt(r.get("top1_vs_dense"), ".2f"),
                      "-" if r.get("graph_eq_eager") is None else
                      f"{fmt(r['graph_eq_eager'])} ({fmt(r.get('graph_logit_maxdiff'), '.1e')})"])
    widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
    for i, l in enumerate(lines):
        print("  ".join(c.rjust(wd) if j not in (2,) else c.ljust(wd) for j, (c, wd) in enumerate(zip(l, widths))))
        if i == 0:
            print("  ".join("-" * wd for wd in widths))
    for r in rows:
        if r.get("note"):
            print(f"  note B={r['batch']} ctx={r['ctx']} {r['backend']}: {r['note'].strip()}")


def pct(x):
    return None if x is None else 100 * x


class Csv:
    def __init__(self, path):
        self.path = path
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(",".join(COLUMNS) + "\n")

    def add(self, rows):
        if not self.path:
            return
        with open(self.path, "a") as f:
            for r in rows:
                vals = []
                for c in COLUMNS:
                    v = r.get(c)
                    v = "" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
                    vals.append('"' + v.replace('"', "'") + '"' if "," in v else v)
                f.write(",".join(vals) + "\n")


# ---------------------------------------------------------------------------------------------------------

def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_point(a, sh, w, dev, runner, B, L, t_start, device_name):
    rows = []

    def row(backend, spec):
        r = dict(device=device_name, batch=B, ctx=L, backend=backend, spec=spec, note="")
        rows.append(r)
        return r

    def over_budget():
        return a.budget_s and time.monotonic() - t_start > a.budget_s

    gen = torch.Generator().manual_seed(a.seed * 1000 + B * 7 + L)
    tokens = torch.randint(0, sh.vocab, (B, L), generator=gen).to(dev)
    cache = Paged(B, L, sh, a.dtype, dev, gen)
    t0 = time.monotonic()
    tail = min(a.prefill_tail, L)
    with runner.on_stream():
        tok0, q_tail = prefill(w, sh, cache, tokens, a.chunk, tail)
    runner.sync()
    print(f"[B={B} L={L}] prefill {time.monotonic() - t0:.1f} s", flush=True)
    model = Decoder(w, sh, tok0, L)
    del tokens

    backends = [("none", None), ("dense", "")] + [(spec_at(p, L), spec_at(p, L)) for p in a.policy]
    dense_first = None
    for name, spec in backends:
        if over_budget():
            row(name, spec or "").update(note=f"skipped: time budget of {a.budget_s} s spent")
            continue
        r = row(name, "dense" if spec == "" else (spec or "attention skipped"))
        attn = None
        t0 = time.monotonic()
        try:
            free()
            if spec is None:
                attn = NoAttention()
            else:
                attn = KvsAttention(name, spec, sh, cache, a.dtype, a.device, a.threads)
                if spec:
                    with runner.on_stream():
                        attn.rewrite_cache()
                        attn.prefill_tail(q_tail)
            reseed = (lambda: attn.prefill_tail(q_tail)) if spec else None
            runner.measure(model, attn, r, reseed)
            if isinstance(attn, KvsAttention) and spec:
                r["kv_visited"] = attn.visited()
        except Exception as e:  # noqa: BLE001 - one backend failing (OOM, refused spec) skips only itself
            r["note"] += f" skipped: {type(e).__name__}: {str(e).splitlines()[0][:200]};"
            print(f"[B={B} L={L}] {name}: {r['note'].strip()}", flush=True)
            if a.verbose:
                traceback.print_exc()
        finally:
            model.attn = None
            attn = None
            free()
        if name == "dense" and "first_logits" in r:
            dense_first = (r["first_logits"], r["first_tok"])
        print(f"[B={B} L={L}] {name}: eager {fmt(r.get('eager_ms'))} ms, graph {fmt(r.get('graph_ms'))} ms "
              f"({time.monotonic() - t0:.1f} s)", flush=True)

    del q_tail
    # SDPA over contiguous K/V gathered from the same cache.
    r = row("sdpa", "")
    if over_budget():
        r["note"] = f"skipped: time budget of {a.budget_s} s spent"
    else:
        t0 = time.monotonic()
        try:
            with runner.on_stream():
                ks, vs = to_contiguous(cache, sh)
            del cache
            free()
            # The forced backend first; should it refuse this shape, flash, said in the note.
            tries = [a.sdpa_backend if a.device == "cuda" else None]
            if a.device == "cuda" and a.sdpa_backend != "flash":
                tries.append("flash")
            for i, be in enumerate(tries):
                attn = SdpaAttention(ks, vs, L, be)
                r["spec"] = attn.spec
                try:
                    runner.measure(model, attn, r)
                except Exception as e:  # noqa: BLE001
                    if i + 1 == len(tries):
                        raise
                    r["note"] += f" {attn.spec} failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}), retried;"
                    print(f"[B={B} L={L}] sdpa: {r['note'].strip()}", flush=True)
                    continue
                break
        except Exception as e:  # noqa: BLE001
            r["note"] += f" skipped: {type(e).__name__}: {str(e).splitlines()[0][:200]};"
            print(f"[B={B} L={L}] sdpa: {r['note'].strip()}", flush=True)
            if a.verbose:
                traceback.print_exc()
        finally:
            model.attn = attn = ks = vs = None
            free()
        print(f"[B={B} L={L}] sdpa: eager {fmt(r.get('eager_ms'))} ms, graph {fmt(r.get('graph_ms'))} ms "
              f"({time.monotonic() - t0:.1f} s)", flush=True)

    for r in rows:
        if dense_first is not None and "first_logits" in r and r["backend"] != "none":
            lg, tk = dense_first
            d = (r["first_logits"].double() - lg.double()).norm() / lg.double().norm()
            r["logit_err_vs_dense"] = d.item()
            r["top1_vs_dense"] = (r["first_tok"] == tk).double().mean().item()
        r.pop("first_logits", None)
        r.pop("first_tok", None)
        r["graph_eq_eager"] = r.pop("graph_ok", None)
        r["graph_logit_maxdiff"] = r.pop("graph_logit_diff", None)
    derive(rows)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="2 layers, 4/2 heads, head 64, fp32: a CPU test size")
    p.add_argument("--grid", default=None, help="BxL,... (default 1x32768,1x131072,8x32768,32x8192; tiny 1x512,3x200)")
    p.add_argument("--policy", action="append", default=None, help=f"policy spec, repeatable (default {DEFAULT_POLICIES})")
    p.add_argument("--sdpa-backend", default="cudnn", help="cudnn, flash, efficient, math or default")
    p.add_argument("--eager-steps", type=int, default=5, help="steps per timed group, eager")
    p.add_argument("--graph-steps", type=int, default=10, help="replays per timed group")
    p.add_argument("--groups", type=int, default=3, help="timed groups (the median is reported)")
    p.add_argument("--check-steps", type=int, default=4, help="steps compared between eager and graph replay")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--chunk", type=int, default=8192, help="prefill token chunk for projections and MLP")
    p.add_argument("--prefill-tail", type=int, default=64,
                   help="the prompt's last N positions go through each policy engine as its prefill chunk (default "
                        "64: SnapKV's default window of 32 and more; 0 = the policies never see a prefill)")
    p.add_argument("--threads", type=int, default=0, help="CPU engine threads (0 = all cores)")
    p.add_argument("--budget-s", type=float, default=0, help="skip what starts after this many seconds (0 = none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=None, help="CSV path (default $OUT/gpu_e2e.csv when $OUT is set)")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    t_start = time.monotonic()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu --tiny here)")
        return 2
    sh = TINY if a.tiny else LLAMA3_8B
    if a.device == "cpu" and a.tiny:
        torch.set_num_threads(1)  # tiny matrices: more threads only contend with the engine's workers
    a.dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    # The library's default keeps the first 2 layers dense (dense_layers=2, as Quest does); the tiny model has
    # only 2 layers, so there its policies run on every layer.
    a.policy = a.policy or ([p + "; dense_layers=0" for p in DEFAULT_POLICIES] if a.tiny else DEFAULT_POLICIES)
    a.sdpa_backend = None if a.sdpa_backend == "default" else a.sdpa_backend
    grid = a.grid or ("1x512,3x200" if a.tiny else "1x32768,1x131072,8x32768,32x8192")
    points = [tuple(int(x) for x in g.split("x")) for g in grid.split(",") if g]
    csv_path = a.csv or (str(Path(os.environ["OUT"]) / "gpu_e2e.csv") if os.environ.get("OUT") else None)
    out = Csv(csv_path)
    dev = torch.device(a.device)
    if a.device == "cuda":
        name = torch.cuda.get_device_name()
        print(f"device {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
              f"{torch.backends.cudnn.version()}, {torch.cuda.mem_get_info()[1] / 2**30:.0f} GiB", flush=True)
    else:
        name = "cpu"
        print(f"device cpu, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    import kvsparse._ffi as kffi
    print(f"kvsparse {kffi.LIB_PATH}", flush=True)
    print(f"model {sh}, {a.dtype}, random weights (seed {a.seed}); grid {grid}; policies {a.policy}", flush=True)
    runner = Runner(a, dev)
    # Everything (allocations, prefill, steps, captures, kvsparse calls) on one stream.
    with runner.on_stream():
        all_rows = run_grid(a, sh, dev, runner, points, out, t_start, name)
    return report(a, sh, all_rows, name, csv_path, t_start)


def run_grid(a, sh, dev, runner, points, out, t_start, name):
    w = Weights(sh, a.dtype, dev, a.seed)
    runner.sync()
    print(f"weights {w.bytes() / 2**30:.1f} GiB ready after {time.monotonic() - t_start:.1f} s", flush=True)
    all_rows = []
    for B, L in points:
        if a.budget_s and time.monotonic() - t_start > a.budget_s:
            print(f"[B={B} L={L}] skipped: time budget of {a.budget_s} s spent", flush=True)
            continue
        try:
            rows = run_point(a, sh, w, dev, runner, B, L, t_start, name)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for the cache: skip the point, go on
            print(f"[B={B} L={L}] skipped: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            if a.verbose:
                traceback.print_exc()
            rows = [dict(device=name, batch=B, ctx=L, backend="*", spec="", note=f"skipped: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}")]
        free()  # here, not in the except block: its traceback holds the point's tensors until the block ends
        out.add(rows)
        all_rows += rows
    return all_rows


def report(a, sh, all_rows, name, csv_path, t_start):
    print()
    print(f"Decode step, {sh.layers} layers {sh.heads}/{sh.kv_heads} heads, head {sh.head_dim}, hidden {sh.hidden}, "
          f"MLP {sh.mlp}, vocab {sh.vocab}, {str(a.dtype).replace('torch.', '')}, random weights; {name}")
    print("attn% = (step - step without attention) / step; x sdpa, x dense = their step time / this one; "
          "visited = KV blocks read / blocks dense reads; err vs dense = first step's logits, relative L2")
    print_table(all_rows)
    fails = []
    for r in all_rows:
        if r["backend"] in ("none", "sdpa", "*"):  # torch's own: reported in the table, not ours to fail
            continue
        if r.get("graph_eq_eager") is False:
            fails.append(f"graph!=eager B={r['batch']} L={r['ctx']} {r['backend']}")
        if r.get("no_sync") is False:
            fails.append(f"sync in step B={r['batch']} L={r['ctx']} {r['backend']}")
    for r in all_rows:  # the wiring check: the same model over the paged cache and over the contiguous copy
        if (a.device == "cpu" and r["backend"] == "sdpa" and r.get("logit_err_vs_dense") is not None
                and not r["logit_err_vs_dense"] < 1e-4):
            fails.append(f"sdpa vs dense {r['logit_err_vs_dense']:.1e} B={r['batch']} L={r['ctx']}")
    acc = []
    if a.device == "cuda" and not a.no_graph:
        for want in ("dense", "quest"):
            got = [r for r in all_rows if r["backend"].startswith(want) and r.get("graph_eq_eager") is not None]
            acc.append(f"{want}: " + (", ".join(f"B={r['batch']} L={r['ctx']} {'PASS' if r['graph_eq_eager'] else 'FAIL'}"
                                                for r in got) or "not run"))
        print("graph replay == eager (acceptance 2): " + "; ".join(acc))
    skipped = [f"B={r['batch']} L={r['ctx']} {r['backend']}" for r in all_rows if "skipped" in (r.get("note") or "")]
    if skipped:
        print(f"SKIPPED ({len(skipped)}, reasons in the notes above): " + "; ".join(skipped))
    if csv_path:
        print(f"csv: {csv_path}")
    print(f"total {time.monotonic() - t_start:.0f} s")
    if fails:
        print("FAILED: " + "; ".join(fails))
        return 1
    print("E2E DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
