#!/usr/bin/env python3
"""Re-checks an exported kvsparse conformance suite with numpy alone (no kvsparse, no torch).

`kvsparse conformance --export DIR` copies this file to DIR/check.py. For every case it

1. reads the inputs from the case's safetensors file (a small reader below; bfloat16 is widened by hand, FP8
   codes decoded by table and scaled by the case's k_scale / v_scale in float32),
2. recomputes causal paged attention in float64 from them (gathering the pages through the block table) and
   checks the exported reference output and LSE against it,
3. checks each implementation's outputs stored under DIR/results/<name>/<case>.safetensors (`out`
   [tokens, q_heads, head_dim], optional `lse` [tokens, q_heads]) against the reference with the case's
   tolerances (out_rel = ||out - ref||_2 / ||ref||_2; lse_abs = max |lse - ref_lse|).

    python3 check.py [DIR] [--results NAME ...] [--filter SUBSTRING]

Prints one line per case and implementation and exits non-zero on any mismatch or failure. A case an
implementation did not produce is reported with the implementation's own word for it (from the manifest or
DIR/results/<name>/report.json) and is not a failure.
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

FORMAT, VERSIONS = "kvsparse-conformance", (1, 2)
_NP = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I32": "<i4", "I64": "<i8", "U64": "<u8"}


def _fp8_table(exp_bits, man_bits, bias, finite_top):
    """float32 value of each of the 256 codes of an FP8 format (e4m3fn: no infinities, only s.1111.111 is
    NaN; e5m2: IEEE-like, exponent 31 is inf / NaN)."""
    t = np.zeros(256, dtype=np.float32)
    for c in range(256):
        sign = -1.0 if c & 0x80 else 1.0
        e = (c >> man_bits) & ((1 << exp_bits) - 1)
        m = c & ((1 << man_bits) - 1)
        if e == (1 << exp_bits) - 1 and not finite_top:
            t[c] = sign * np.inf if m == 0 else np.nan
        elif finite_top and e == (1 << exp_bits) - 1 and m == (1 << man_bits) - 1:
            t[c] = np.nan
        elif e == 0:
            t[c] = sign * m * 2.0 ** (1 - bias - man_bits)
        else:
            t[c] = sign * (1 + m / 2 ** man_bits) * 2.0 ** (e - bias)
    return t


# FP8 storages come back as their codes' float32 values (exact); the scales apply in reference().
_FP8 = {"F8_E4M3": _fp8_table(4, 3, 7, True), "F8_E5M2": _fp8_table(5, 2, 15, False)}


def read_safetensors(path):
    """{name: numpy array}; BF16 tensors come back as float32 (exact)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = memoryview(raw)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(data[a:b], dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif info["dtype"] in _FP8:
            arr = _FP8[info["dtype"]][np.frombuffer(data[a:b], dtype=np.uint8)]
        else:
            arr = np.frombuffer(data[a:b], dtype=_NP[info["dtype"]])
        out[name] = arr.reshape(info["shape"])
    return out


def as_view(tensors, v):
    """The strided view {storage, offset, shape, strides} (elements) of a flat storage."""
    base = tensors[v["storage"]]
    item = base.itemsize
    return np.lib.stride_tricks.as_strided(base[v["offset"]:], shape=v["shape"], strides=[s * item for s in v["strides"]],
                                           writeable=False)


def reference(case, t):
    """float64 attention of every query row over its sequence's gathered keys; returns (out, lse)."""
    q = as_view(t, case["views"]["query"]).astype(np.float64)
    kc = as_view(t, case["views"]["k_cache"])
    vc = as_view(t, case["views"]["v_cache"])
    if "cache_dtype" in case:  # FP8 codes' values times the scale, in float32 (the manifest's conventions)
        kc = kc * np.float32(case["k_scale"])
        vc = vc * np.float32(case["v_scale"])
    bt, qsl, lens = t["block_table"], t["query_start_loc"], t["seq_lens"]
    hq, hk, d, bs = case["num_q_heads"], case["num_kv_heads"], case["head_dim"], case["block_size"]
    g = hq // hk
    scale, window, cap = case["scale"], case["sliding_window"], case["softcap"]
    out = np.zeros((q.shape[0], hq, d))
    lse = np.zeros((q.shape[0], hq))
    for s in range(len(lens)):
        a, b, n = int(qsl[s]), int(qsl[s + 1]), int(lens[s])
        if b == a:
            continue
        pos = np.arange(n)
        blocks = bt[s, pos // bs]
        k = kc[blocks, pos % bs].astype(np.float64)  # [n, hk, d]: only live slots are gathered
        v = vc[blocks, pos % bs].astype(np.float64)
        qs = q[a:b].reshape(b - a, hk, g, d)
        logits = np.einsum("tkgd,nkd->kgtn", qs, k) * scale
        if cap > 0:
            logits = cap * np.tanh(logits / cap)
        qpos = n - (b - a) + np.arange(b - a)
        allowed = pos[None, :] <= qpos[:, None]
        if window > 0:
            allowed &= pos[None, :] > qpos[:, None] - window
        logits = np.where(allowed[None, None], logits, -np.inf)
        m = logits.max(axis=-1, keepdims=True)
        w = np.exp(logits - m)
        l = w.sum(axis=-1, keepdims=True)
        o = np.einsum("kgtn,nkd->tkgd", w / l, v)
        out[a:b] = o.reshape(b - a, hq, d)
        lse[a:b] = (m + np.log(l))[..., 0].transpose(2, 0, 1).reshape(b - a, hq)
    return out, lse


def rel_err(x, ref):
    if not np.all(np.isfinite(x)):
        return float("nan")
    return float(np.linalg.norm((x - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-300))


def max_abs(x, ref):
    if not np.all(np.isfinite(x)):
        return float("nan")
    return float(np.abs(x - ref).max()) if x.size else 0.0


def own_words(root, manifest, impl):
    """An implementation's verdicts per case: DIR/results/<impl>/report.json or the manifest's."""
    rep = root / "results" / impl / "report.json"
    if rep.is_file():
        return {r["name"]: r.get("verdict", "") for r in json.loads(rep.read_text()).get("cases", [])}
    return manifest.get("results", {}).get(impl, {}).get("self_judgement", {})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--results", nargs="*", help="implementations under DIR/results to check (default: all)")
    ap.add_argument("--filter", default="", help="only cases whose name contains this")
    args = ap.parse_args()
    root = Path(args.dir)
    manifest = json.loads((root / "manifest.json").read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") not in VERSIONS:
        sys.exit(f"{root}: not a {FORMAT} export of a version in {VERSIONS} ({manifest.get('format')} v{manifest.get('version')})")
    res_root = root / "results"
    impls = args.results if args.results is not None else sorted(p.name for p in res_root.iterdir() if p.is_dir()) if res_root.is_dir() else []
    words = {i: own_words(root, manifest, i) for i in impls}
    counts = {i: {"pass": 0, "fail": 0, "not produced": 0} for i in impls}
    bad_refs = 0
    print(f"{'case':<44} {'reference':>10}  " + "  ".join(f"{i:>30}" for i in impls))
    for case in manifest["cases"]:
        if args.filter not in case["name"]:
            continue
        t = read_safetensors(root / case["file"])
        ref_out, ref_lse = t["ref_out"], t["ref_lse"]
        out, lse = reference(case, t)
        ref_diff = max(max_abs(out, ref_out) / max(np.abs(ref_out).max(), 1e-300), max_abs(lse, ref_lse))
        ref_ok = ref_diff <= 1e-9
        bad_refs += not ref_ok
        cells = []
        for impl in impls:
            path = res_root / impl / f"{case['name']}.safetensors"
            if not path.is_file():
                counts[impl]["not produced"] += 1
                cells.append(f"{'- ' + words[impl].get(case['name'], 'not produced')[:28]:>30}")
                continue
            r = read_safetensors(path)
            tol = case["tolerance"]
            e_out = rel_err(r["out"].astype(np.float64), ref_out)
            e_lse = max_abs(r["lse"].astype(np.float64), ref_lse) if "lse" in r else None
            ok = e_out <= tol["out_rel"] and (e_lse is None or e_lse <= tol["lse_abs"])
            counts[impl]["pass" if ok else "fail"] += 1
            lse_txt = "  -    " if e_lse is None else f"{e_lse:.1e}"
            cells.append(f"{('ok' if ok else 'FAIL'):>4} out {e_out:.1e} lse {lse_txt}")
        print(f"{case['name']:<44} {('ok' if ref_ok else 'MISMATCH'):>6} {ref_diff:.0e}  " + "  ".join(cells))
    print(f"reference recomputed with numpy: {'all match' if not bad_refs else f'{bad_refs} MISMATCH'}")
    for impl in impls:
        c = counts[impl]
        print(f"{impl}: {c['pass']} passed, {c['fail']} failed, {c['not produced']} not produced")
    failed = bad_refs + sum(c["fail"] for c in counts.values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
