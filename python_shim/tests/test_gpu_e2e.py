"""scripts/gpu_e2e.py (the end-to-end decode benchmark, run on the GPU machine) stays runnable and wired
right: its tiny CPU run drives the same model, caches and backends through kvsparse's CPU engine and torch
SDPA (about 15 s)."""
import csv
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_e2e.py"


def test_gpu_e2e_tiny_cpu_run(tmp_path):
    out = tmp_path / "e2e.csv"
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--threads", "1", "--csv", str(out),
                        "--grid", "1x512,3x200"], capture_output=True, text=True, timeout=300)
    log = p.stdout[-4000:] + p.stderr[-4000:]
    assert p.returncode == 0 and "E2E DONE" in p.stdout, log
    rows = list(csv.DictReader(out.open()))
    points = {(r["batch"], r["ctx"]) for r in rows}
    assert points == {("1", "512"), ("3", "200")}, log
    for pt in points:
        by = {r["backend"]: r for r in rows if (r["batch"], r["ctx"]) == pt}
        policies = [b for b in by if b not in ("none", "dense", "sdpa")]
        assert len(policies) == 8 and any(b.startswith("quest") for b in policies), by.keys()
        for name, r in by.items():
            assert not r["note"], (name, r["note"])
            assert float(r["eager_ms"]) > 0 and float(r["eager_tok_s"]) > 0, (name, r)
        # The wiring: the same model over the paged cache (kvsparse dense) and over the contiguous copy of the
        # same K/V (torch SDPA) gives the same logits (fp32), and the same greedy tokens.
        assert float(by["dense"]["logit_err_vs_dense"]) == 0.0
        assert float(by["sdpa"]["logit_err_vs_dense"]) < 1e-4 and float(by["sdpa"]["top1_vs_dense"]) == 1.0
        assert float(by["sdpa"]["x_sdpa_eager"]) == 1.0 and float(by["dense"]["x_dense_eager"]) == 1.0
        # The policies really ran sparse: fewer blocks read than dense, different logits. SnapKV reads fewer
        # only if it saw the prompt's end as a prefill chunk through kvsparse (--prefill-tail): without it
        # every step visits every block.
        for name in policies:
            if name.startswith(("quest", "streaming", "snapkv", "refresh", "predictor", "speculate")):
                assert 0 < float(by[name]["kv_visited"]) < 1, (name, by[name]["kv_visited"])
            if name.startswith(("quest", "streaming", "snapkv")):
                assert float(by[name]["logit_err_vs_dense"]) > 1e-4, name
