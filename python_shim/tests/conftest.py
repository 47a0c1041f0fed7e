"""Shared fixtures: the model directory and a runner for tests/vllm_generate.py in a subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="session")
def model_dir():
    d = Path(os.environ.get("KVSPARSE_MODEL", REPO / ".cache" / "smollm2"))
    if not (d / "config.json").is_file():
        pytest.skip(f"model not converted at {d} (run scripts/convert_model.py or set KVSPARSE_MODEL)")
    return str(d)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def run_generate(model_dir, requests, tmp_path, *args, timeout=900):
    """Runs vllm_generate.py with the given requests; returns (result dict, combined log)."""
    req = tmp_path / f"requests-{len(list(tmp_path.iterdir()))}.json"
    req.write_text(json.dumps(requests))
    p = subprocess.run([sys.executable, str(HERE / "vllm_generate.py"), model_dir, str(req), *args],
                       capture_output=True, text=True, timeout=timeout)
    log = p.stdout + p.stderr
    lines = [l for l in p.stdout.splitlines() if l.startswith("KVS_RESULT ")]
    return (json.loads(lines[-1][len("KVS_RESULT "):]) if lines else None), log, p.returncode


class NoHostRead(torch.Tensor):
    """A tensor whose values must not be read on the host: what would be a device-to-host sync for a CUDA
    tensor (item, tolist, bool, int, cpu, numpy, iteration) raises. Pointers, shapes and strides are fine."""

    FORBIDDEN = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
                 torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
                 torch.Tensor.__iter__, torch.Tensor.__array__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.FORBIDDEN:
            raise AssertionError(f"host read of a device tensor: {getattr(func, '__name__', func)}")
        return super().__torch_function__(func, types, args, kwargs or {})
