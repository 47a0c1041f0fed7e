"""Shared fixtures: the model directory and a runner for tests/vllm_generate.py in a subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
