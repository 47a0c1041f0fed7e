#!/usr/bin/env python3
"""Capture attention traces of SmolLM2-135M-Instruct (real model, CPU, HF
transformers, eager attention, float32) for the sparse-attention policies.

Usage:
    python scripts/capture_traces.py            # committed set -> traces/
    python scripts/capture_traces.py --full     # bigger set -> .cache/traces-full/
    python scripts/capture_traces.py --only needle_2k   # one trace of the set

Needs the converted model (scripts/convert_model.py). See docs/traces.md for
the file format; in short, per recorded layer L of each trace:

    layer{L}.k, layer{L}.v   float16 [P+T, 3, 64]  post-RoPE keys / values
    layer{L}.q               float16 [T, 9, 64]    post-RoPE decode queries
    layer{L}.out             float32 [T, 9, 64]    attention output (before o_proj)
    layer{L}.q_prompt_tail   float16 [32, 9, 64]   queries of positions P-32..P-1
    token_ids                int32   [P+T+1]       prompt + generated tokens

Decode step t feeds the token generated at step t-1 (the first generated
token, from the prefill logits, at t = 0) at position P+t; its query attends
keys 0..=P+t. Decoding is greedy; end-of-turn / special tokens are masked so
that every trace has exactly T steps. The manifest records at which step the
unmasked greedy argmax would first have been a special token (`eos_step`) and
`answer_text` is the text generated before that point.

How it hooks the model: transformers' LlamaAttention computes q/k/v, applies
RoPE, appends k/v to the cache and then calls the registered attention
function with (query [1,9,S,64], key [1,3,P+t+1,64], value, mask, scaling).
We register a function "kvs_capture" that calls transformers' own
eager_attention_forward and records its inputs and output, so the recorded
tensors are exactly what the model used.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_prompts  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / ".cache" / "smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
PROMPT_TAIL = 32
PREFILL_CHUNK = 1024  # prompt tokens per forward pass during prefill
BUDGET_BYTES = 25 * 1000 * 1000  # committed traces must stay under this


@dataclass(frozen=True)
class TraceSpec:
    """One trace to capture: prompt kind, nominal context, decode steps, layers."""

    name: str
    kind: str          # needle | document | generation
    context: int       # nominal context (prompt_len + decode_steps <= context)
    steps: int         # decode steps T
    layers: tuple[int, ...]
    depth: float = 0.5  # needle / fact depth
    seed: int = 0


# Committed set (traces/, <= 25 MB). K+V cost 768 bytes per position per
# layer, so ~20K positions of traces allow only ~1.5 layers on average:
# layer 20 (the layer with the most attention on the needle in the dense
# model, see docs/traces.md) is recorded everywhere, layer 7 (an early layer
# that also attends to the needle) in the cheaper 2K traces.
LAYER_EARLY, LAYER_MAIN = 7, 20
COMMITTED = (
    TraceSpec("needle_2k", "needle", 2048, 48, (LAYER_EARLY, LAYER_MAIN), depth=0.25, seed=2),
    TraceSpec("needle_4k", "needle", 4096, 48, (LAYER_MAIN,), depth=0.5, seed=4),
    TraceSpec("needle_8k", "needle", 8192, 48, (LAYER_MAIN,), depth=0.75, seed=8),
    TraceSpec("document_4k", "document", 4096, 48, (LAYER_MAIN,), depth=0.4, seed=40),
    TraceSpec("generation_2k", "generation", 2048, 256, (LAYER_EARLY, LAYER_MAIN), seed=20),
)


def full_set() -> tuple[TraceSpec, ...]:
    """Bigger set for training / evaluation: layers 2..29, more steps and depths."""
    layers = tuple(range(2, 30))
    specs = []
    for ctx, tag in ((2048, "2k"), (4096, "4k"), (8192, "8k")):
        for depth in (0.1, 0.5, 0.9):
            specs.append(TraceSpec(f"needle_{tag}_d{int(depth * 100):02d}", "needle", ctx, 128,
                                   layers, depth=depth, seed=ctx + int(depth * 100)))
        specs.append(TraceSpec(f"document_{tag}", "document", ctx, 128, layers, depth=0.5,
                               seed=ctx + 1))
        specs.append(TraceSpec(f"generation_{tag}", "generation", ctx, 512, layers,
                               seed=ctx + 2))
    return tuple(specs)


# --------------------------------------------------------------------------
# recording attention function
# --------------------------------------------------------------------------


class Recorder:
    """Collects per-layer tensors while the model runs (one trace at a time)."""

    def __init__(self) -> None:
        self.layers: set[int] = set()
        self.phase = "off"          # off | prefill | decode
        self.fact_span: tuple[int, int] | None = None
        self.reset()

    def reset(self) -> None:
        self.q: dict[int, list[torch.Tensor]] = {}
        self.out: dict[int, list[torch.Tensor]] = {}
        self.q_tail: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        # attention mass on the planted fact, per layer, per query (all layers)
        self.fact_mass: dict[int, list[torch.Tensor]] = {}

    def record(self, layer: int, query, key, value, out, weights) -> None:
        if self.phase == "off":
            return
        if self.fact_span is not None and weights is not None:
            s, e = self.fact_span
            # weights [1, 9, S, kv_len]; mass of the last query row on the fact
            self.fact_mass.setdefault(layer, []).append(weights[0, :, -1, s:e].sum(-1).detach().clone())
        if layer not in self.layers:
            return
        if self.phase == "prefill":
            # query [1, 9, chunk, 64]; keep the last 32 prompt queries -> [32, 9, 64]
            new = query[0, :, -PROMPT_TAIL:, :].transpose(0, 1).detach().clone()
            prev = self.q_tail.get(layer)
            self.q_tail[layer] = new if prev is None else torch.cat([prev, new])[-PROMPT_TAIL:]
        else:
            if query.shape[2] != 1:
                raise RuntimeError("decode step with more than one query")
            self.q.setdefault(layer, []).append(query[0, :, 0, :].detach().clone())
            self.out.setdefault(layer, []).append(out[0, 0, :, :].detach().clone())
        # key/value [1, 3, kv_len, 64]: the whole cache so far; keep the latest
        self.k[layer] = key[0]
        self.v[layer] = value[0]


RECORDER = Recorder()


def register_capture_attention() -> str:
    """Register the recording attention function with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def kvs_capture(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if query.shape[2] > 1 and attention_mask is None:
            # A prefill without a causal mask would silently attend to the future.
            raise RuntimeError("kvs_capture: prefill called without a causal mask")
        out, weights = eager_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        RECORDER.record(module.layer_idx, query, key, value, out, weights)
        return out, weights

    AttentionInterface.register("kvs_capture", kvs_capture)
    # transformers builds no mask at all for attention functions it does not
    # know (it assumes they handle causality themselves). Ours is eager
    # attention, so it needs eager's additive causal mask.
    AttentionMaskInterface.register("kvs_capture", eager_mask)
    return "kvs_capture"


def load_model(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    impl = register_capture_attention()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=impl)
    model.eval()
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64), cfg
    return tok, model


# --------------------------------------------------------------------------
# capture one trace
# --------------------------------------------------------------------------


def build_prompt(tok, spec: TraceSpec) -> trace_prompts.Prompt:
    target = spec.context - spec.steps
    if spec.kind == "needle":
        return trace_prompts.needle_prompt(tok, target, spec.depth, spec.seed)
    if spec.kind == "document":
        return trace_prompts.document_prompt(tok, target, spec.depth, spec.seed)
    if spec.kind == "generation":
        return trace_prompts.generation_prompt(tok, target, spec.seed)
    raise ValueError(spec.kind)


@torch.no_grad()
def run_trace(tok, model, spec: TraceSpec, prompt: trace_prompts.Prompt):
    """Prefill + T greedy decode steps with recording. Returns tensors and info."""
    from transformers import DynamicCache

    ids = prompt.token_ids
    P, T = len(ids), spec.steps
    assert P + T <= spec.context <= model.config.max_position_embeddings
    fact_span = prompt.fact_token_span(tok)
    banned = sorted(set(tok.all_special_ids))

    RECORDER.reset()
    RECORDER.layers = set(spec.layers)
    RECORDER.fact_span = fact_span
    cache = DynamicCache(config=model.config)

    def pick(logits: torch.Tensor) -> tuple[int, int]:
        """(masked greedy token, unmasked greedy token)."""
        raw = int(torch.argmax(logits))
        masked = logits.clone()
        masked[banned] = float("-inf")
        return int(torch.argmax(masked)), raw

    # Chunked prefill: same causal eager attention, but the score matrices are
    # [9, chunk, kv_len] instead of [9, P, P] (2.4 GB per layer at 8K), and
    # only the last position's logits are computed.
    t0 = time.time()
    RECORDER.phase = "prefill"
    for c0 in range(0, P, PREFILL_CHUNK):
        c1 = min(P, c0 + PREFILL_CHUNK)
        out = model(input_ids=torch.tensor([ids[c0:c1]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.arange(c0, c1)[None], logits_to_keep=1)
    t_prefill = time.time() - t0
    nxt, raw = pick(out.logits[0, -1])
    generated, raw_first = [nxt], [raw]
    del out

    RECORDER.phase = "decode"
    t1 = time.time()
    for t in range(T):
        pos = P + t
        out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache,
                    use_cache=True, position_ids=torch.tensor([[pos]]))
        nxt, raw = pick(out.logits[0, -1])
        generated.append(nxt)
        raw_first.append(raw)
    t_decode = time.time() - t1
    RECORDER.phase = "off"

    # Assemble [P+T, 3, 64] etc. Cache after the last step covers P+T positions.
    tensors: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}  # float32, as the model computed them
    for L in spec.layers:
        k, v = RECORDER.k[L], RECORDER.v[L]
        assert k.shape == (3, P + T, 64), k.shape
        exact[f"layer{L}.k"] = k.transpose(0, 1)
        exact[f"layer{L}.v"] = v.transpose(0, 1)
        exact[f"layer{L}.q"] = torch.stack(RECORDER.q[L])
        exact[f"layer{L}.out"] = torch.stack(RECORDER.out[L])
        tensors[f"layer{L}.k"] = k.transpose(0, 1).to(torch.float16).contiguous()
        tensors[f"layer{L}.v"] = v.transpose(0, 1).to(torch.float16).contiguous()
        tensors[f"layer{L}.q"] = torch.stack(RECORDER.q[L]).to(torch.float16).contiguous()
        tensors[f"layer{L}.out"] = torch.stack(RECORDER.out[L]).to(torch.float32).contiguous()
        tensors[f"layer{L}.q_prompt_tail"] = RECORDER.q_tail[L].to(torch.float16).contiguous()
        assert tensors[f"layer{L}.q"].shape == (T, 9, 64)
        assert tensors[f"layer{L}.q_prompt_tail"].shape == (PROMPT_TAIL, 9, 64)
    tensors["token_ids"] = torch.tensor(ids + generated, dtype=torch.int32)

    specials = set(banned)
    eos_step = next((i for i, r in enumerate(raw_first) if r in specials), None)
    answer_ids = generated if eos_step is None else generated[:eos_step]
    info = {
        "prompt_len": P,
        "decode_steps": T,
        "fact_span": fact_span,
        "eos_step": eos_step,
        "answer_text": tok.decode(answer_ids, skip_special_tokens=True),
        "generated_text": tok.decode(generated, skip_special_tokens=True),
        "prefill_s": round(t_prefill, 2),
        "decode_s": round(t_decode, 2),
    }
    # Attention mass on the needle/fact, all layers: max over heads of the
    # mass, for the last prompt query and for the first 8 decode queries.
    if fact_span is not None:
        mass = {}
        for L, rows in sorted(RECORDER.fact_mass.items()):
            m = torch.stack(rows[: 1 + 8])  # prefill row, then decode steps 0..7
            mass[L] = round(float(m.max(dim=1).values.mean()), 4)
        info["fact_attention_mass_by_layer"] = mass
    RECORDER.reset()
    return tensors, exact, info


def attention_errors(tensors: dict[str, torch.Tensor], layers, P: int) -> tuple[float, float]:
    """Recompute every decode step's attention output in float64 from the
    q/k/v in `tensors` and compare with the recorded output.

    Returns (worst per-step relative error, worst per-layer aggregate relative
    error), relative errors being ||ref - out|| / ||ref|| over a step's
    [9, 64] output, resp. over a layer's whole [T, 9, 64] output.
    The same computation lives in python_shim/tests/test_traces.py.
    """
    worst_step = worst_layer = 0.0
    for L in layers:
        q = tensors[f"layer{L}.q"].double().numpy()
        k = tensors[f"layer{L}.k"].double().numpy()
        v = tensors[f"layer{L}.v"].double().numpy()
        out = tensors[f"layer{L}.out"].double().numpy()
        num = den = 0.0
        for t in range(q.shape[0]):
            n = P + t + 1
            kk = np.repeat(k[:n], 3, axis=1)  # GQA: q head h uses kv head h // 3
            vv = np.repeat(v[:n], 3, axis=1)
            s = np.einsum("hd,nhd->hn", q[t], kk) * 0.125
            s = np.exp(s - s.max(-1, keepdims=True))
            p = s / s.sum(-1, keepdims=True)
            ref = np.einsum("hn,nhd->hd", p, vv)
            d2, r2 = float(((ref - out[t]) ** 2).sum()), float((ref ** 2).sum())
            worst_step = max(worst_step, (d2 / r2) ** 0.5)
            num, den = num + d2, den + r2
        worst_layer = max(worst_layer, (num / den) ** 0.5)
    return worst_step, worst_layer


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true",
                        help="capture the bigger set into .cache/traces-full/")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=None,
                        help="output dir (default traces/ or .cache/traces-full/)")
    parser.add_argument("--only", nargs="*", default=None, help="capture only these trace names")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on the shared 2-core dev machine 1 thread "
                             "ran 2-3x faster than 2; try 2 on an idle machine)")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = args.out or (REPO_ROOT / (".cache/traces-full" if args.full else "traces"))
    specs = full_set() if args.full else COMMITTED
    if args.only:
        unknown = set(args.only) - {s.name for s in specs}
        if unknown:
            parser.error(f"unknown trace names: {sorted(unknown)}")
        specs = tuple(s for s in specs if s.name in args.only)
    out_dir.mkdir(parents=True, exist_ok=True)

    if not (args.model / "config.json").is_file():
        print(f"model not found at {args.model}; run scripts/convert_model.py", file=sys.stderr)
        return 1
    t_start = time.time()
    tok, model = load_model(args.model)

    manifest_path = out_dir / "manifest.json"
    manifest = {
        "model": MODEL_NAME,
        "num_q_heads": 9,
        "num_kv_heads": 3,
        "head_dim": 64,
        "scale": 0.125,
        "dtype": "float16",
        "traces": [],
    }
    if args.only and manifest_path.is_file():  # update entries in place
        manifest["traces"] = [t for t in json.loads(manifest_path.read_text())["traces"]
                              if Path(t["file"]).stem not in args.only]

    for spec in specs:
        prompt = build_prompt(tok, spec)
        print(f"[capture] {spec.name}: prompt {len(prompt.token_ids)} tokens, "
              f"{spec.steps} steps, layers {list(spec.layers)}", flush=True)
        tensors, exact, info = run_trace(tok, model, spec, prompt)
        # Exactness: from the float32 q/k/v the model used, our float64
        # recomputation must reproduce its output to float32 accuracy.
        err32, _ = attention_errors(exact, spec.layers, info["prompt_len"])
        if err32 > 1e-5:
            raise SystemExit(f"{spec.name}: capture check failed, fp32 relative error {err32:.2e}")
        # What a reader of the stored (fp16 q/k/v) tensors will see.
        err16_step, err16_layer = attention_errors(tensors, spec.layers, info["prompt_len"])
        del exact
        path = out_dir / f"{spec.name}.safetensors"
        save_file(tensors, str(path), metadata={"trace": spec.name, "model": MODEL_NAME})

        needle = None
        if spec.kind == "needle":
            s, e = info["fact_span"]
            needle = {"key": prompt.info["key"], "value": prompt.info["value"],
                      "depth": spec.depth, "token_start": s, "token_end": e}
        entry = {
            "file": path.name,
            "kind": spec.kind,
            "context": spec.context,
            "prompt_len": info["prompt_len"],
            "decode_steps": info["decode_steps"],
            "layers": list(spec.layers),
            "needle": needle,
            "answer_text": info["answer_text"],
            # extras (not needed by the Rust reader)
            "eos_step": info["eos_step"],
            "generated_text": info["generated_text"],
            "bytes": path.stat().st_size,
            "check_fp32_max_rel_err": float(f"{err32:.3g}"),
            "check_fp16_max_step_rel_err": float(f"{err16_step:.3g}"),
            "check_fp16_layer_rel_err": float(f"{err16_layer:.3g}"),
            "prefill_s": info["prefill_s"],
            "decode_s": info["decode_s"],
        }
        if spec.kind == "needle":
            entry["retrieved"] = prompt.info["value"] in info["answer_text"]
        if spec.kind == "document":
            s, e = info["fact_span"]
            entry["fact"] = {"text": prompt.info["fact"], "depth": spec.depth,
                             "token_start": s, "token_end": e,
                             "expected": [prompt.info["year"], prompt.info["keeper"]]}
            entry["retrieved"] = all(x in info["answer_text"] for x in entry["fact"]["expected"])
        if "fact_attention_mass_by_layer" in info:
            entry["fact_attention_mass_by_layer"] = info["fact_attention_mass_by_layer"]
        manifest["traces"].append(entry)
        manifest["traces"].sort(key=lambda t: t["file"])
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"[capture] {spec.name}: {entry['bytes'] / 1e6:.2f} MB, prefill {info['prefill_s']} s,"
              f" decode {info['decode_s']} s, rel err fp32 {err32:.1e} fp16 step/layer "
              f"{err16_step:.1e}/{err16_layer:.1e}, eos_step {info['eos_step']},"
              f" answer {info['answer_text'][:120]!r}", flush=True)

    total = sum(t["bytes"] for t in manifest["traces"])
    print(f"[capture] done in {time.time() - t_start:.0f} s; {len(manifest['traces'])} traces, "
          f"{total / 1e6:.2f} MB in {out_dir}")
    if not args.full and total > BUDGET_BYTES:
        print(f"[capture] committed traces exceed the {BUDGET_BYTES / 1e6:.0f} MB budget",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
