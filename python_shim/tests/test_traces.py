"""Checks the committed attention traces (traces/, see docs/traces.md).

For every trace and recorded layer, the model's attention output of each
decode step is recomputed in float64 from the stored float16 q/k/v (GQA:
query head h reads kv head h // 3; scale 1/8; query at position P+t attends
keys 0..=P+t) and compared with the stored float32 `out`.

The only difference between the two is the float16 rounding of q/k/v in
storage (the capture script checks the unrounded float32 tensors to 1e-5).
That rounding moves attention logits of magnitude ~30 by ~1e-2, so
individual steps can differ by a few 1e-3; over a layer's whole output the
relative error stays below 1e-3.

Needs only numpy and safetensors. Run:  python -m pytest python_shim/tests
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

REPO_ROOT = Path(__file__).resolve().parents[2]
TRACES = REPO_ROOT / "traces"

LAYER_REL_TOL = 1e-3   # ||ref - out|| / ||ref|| over a layer's [T, 9, 64]
STEP_REL_TOL = 1e-2    # same, over one decode step's [9, 64]


def load_manifest() -> dict:
    return json.loads((TRACES / "manifest.json").read_text())


def trace_entries() -> list[dict]:
    if not (TRACES / "manifest.json").is_file():
        return []
    return load_manifest()["traces"]


def recompute(q: np.ndarray, k: np.ndarray, v: np.ndarray, P: int, scale: float,
              group: int) -> np.ndarray:
    """Dense causal attention output [T, Hq, D] for decode queries q[t] at P+t."""
    T, Hq, D = q.shape
    ref = np.empty((T, Hq, D))
    for t in range(T):
        n = P + t + 1
        kk = np.repeat(k[:n], group, axis=1)  # [n, Hq, D]
        vv = np.repeat(v[:n], group, axis=1)
        s = np.einsum("hd,nhd->hn", q[t], kk) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ref[t] = np.einsum("hn,nhd->hd", p, vv)
    return ref


def test_manifest_header():
    m = load_manifest()
    assert m["num_q_heads"] == 9 and m["num_kv_heads"] == 3 and m["head_dim"] == 64
    assert m["scale"] == 0.125 and m["dtype"] == "float16"
    kinds = {t["kind"] for t in m["traces"]}
    assert kinds == {"needle", "document", "generation"}
    total = sum((TRACES / t["file"]).stat().st_size for t in m["traces"])
    assert total <= 25 * 1000 * 1000, f"committed traces take {total / 1e6:.1f} MB"


@pytest.mark.parametrize("entry", trace_entries(), ids=lambda e: e["file"])
def test_trace(entry):
    m = load_manifest()
    Hq, Hkv, D = m["num_q_heads"], m["num_kv_heads"], m["head_dim"]
    P, T = entry["prompt_len"], entry["decode_steps"]
    assert P + T <= entry["context"]
    assert all(L not in (0, 1) for L in entry["layers"])
    if entry["kind"] == "generation":
        assert T >= 256
    if entry["needle"] is not None:
        nd = entry["needle"]
        assert 0 < nd["token_start"] < nd["token_end"] <= P
        assert len(nd["value"]) == 7 and nd["value"].isdigit()

    tensors = load_file(str(TRACES / entry["file"]))
    assert tensors["token_ids"].shape == (P + T + 1,)
    for L in entry["layers"]:
        k, v = tensors[f"layer{L}.k"], tensors[f"layer{L}.v"]
        q, out = tensors[f"layer{L}.q"], tensors[f"layer{L}.out"]
        tail = tensors[f"layer{L}.q_prompt_tail"]
        assert k.dtype == v.dtype == q.dtype == tail.dtype == np.float16
        assert out.dtype == np.float32
        assert k.shape == v.shape == (P + T, Hkv, D)
        assert q.shape == out.shape == (T, Hq, D)
        assert tail.shape == (32, Hq, D)

        ref = recompute(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                        P, m["scale"], Hq // Hkv)
        out64 = out.astype(np.float64)
        diff = np.linalg.norm((ref - out64).reshape(T, -1), axis=1)
        norm = np.linalg.norm(ref.reshape(T, -1), axis=1)
        layer_err = np.sqrt((diff ** 2).sum() / (norm ** 2).sum())
        step_err = (diff / norm).max()
        assert layer_err <= LAYER_REL_TOL, f"layer {L}: relative error {layer_err:.2e}"
        assert step_err <= STEP_REL_TOL, f"layer {L}: worst step relative error {step_err:.2e}"


def test_recompute_detects_wrong_alignment():
    """Sanity check of the check itself: shifting the keys by one position
    (an off-by-one in the decode position) must be caught."""
    entry = next(e for e in trace_entries() if e["kind"] == "needle")
    tensors = load_file(str(TRACES / entry["file"]))
    L, P = entry["layers"][0], entry["prompt_len"]
    q = tensors[f"layer{L}.q"].astype(np.float64)[:4]
    k = tensors[f"layer{L}.k"].astype(np.float64)
    v = tensors[f"layer{L}.v"].astype(np.float64)
    out = tensors[f"layer{L}.out"].astype(np.float64)[:4]
    ref = recompute(q, k, v, P - 1, 0.125, 3)  # attends one key too few
    err = np.linalg.norm(ref - out) / np.linalg.norm(ref)
    assert err > 10 * LAYER_REL_TOL
