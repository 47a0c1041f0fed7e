"""Why a case failed, found by rerunning the target on variants of the case and by comparing its output with
variants of the reference: so each failure in a report comes with the likely cause (the target's, ours, or
a tolerance question) rather than a bare number."""
import math

import torch

from .reference import attention


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in float64 (NaN if out has any NaN or inf)."""
    out = out.detach().to("cpu", torch.float64)
    if not torch.isfinite(out).all():
        return float("nan")
    return float(torch.linalg.vector_norm(out - ref) / max(float(torch.linalg.vector_norm(ref)), 1e-300))


def max_abs(x, ref):
    x = x.detach().to("cpu", torch.float64)
    if not torch.isfinite(x).all():
        return float("nan")
    return float((x - ref).abs().max()) if x.numel() else 0.0


def _views(case, storage):
    kv = case.meta["views"]
    return tuple(torch.as_strided(storage, kv[n]["shape"], kv[n]["strides"], kv[n]["offset"]) for n in ("k_cache", "v_cache"))


def variant(case, args, tails=False, outside=False, columns=False):
    """The case's arguments with some of what no live token maps to made harmless: `tails` zeroes the
    unwritten slots of each sequence's last block, `outside` zeroes all memory outside the blocks the
    sequences use (other blocks, stride padding), `columns` points unused table columns at block 0."""
    q, kc, vc, bt, lens, qsl, *rest = args
    st = case.storages["kv_storage"]
    bs = kc.shape[1]
    if kc.dtype != st.dtype:  # an FP8 case's caches as the adapter got them (dequantized, compact)
        k2, v2 = (torch.zeros_like(kc), torch.zeros_like(vc)) if outside else (kc.clone(), vc.clone())
    else:
        k2, v2 = _views(case, torch.zeros_like(st) if outside else st.clone())
    if outside:
        for s, n in enumerate(lens.tolist()):
            used = bt[s, :-(-n // bs)].long()
            k2[used], v2[used] = kc[used], vc[used]
    if tails:
        for s, n in enumerate(lens.tolist()):
            if n % bs:
                b = int(bt[s, n // bs])
                k2[b, n % bs:] = 0
                v2[b, n % bs:] = 0
    bt2 = bt
    if columns:
        bt2 = bt.clone()
        for s, n in enumerate(lens.tolist()):
            bt2[s, -(-n // bs):] = 0
    return (q, k2, v2, bt2, lens, qsl, *rest)


VARIANTS = [
    (dict(tails=True), "reads the unwritten tail slots of a sequence's last block (NaN or garbage there reaches the output)"),
    (dict(outside=True), "reads memory outside the blocks the sequence uses (other blocks or stride padding)"),
    (dict(columns=True), "reads block-table columns past the sequence"),
    (dict(tails=True, outside=True, columns=True), "reads memory outside the sequence (several of: unwritten tails, other blocks, unused columns)"),
]


def row_kinds(qsl):
    """Token rows of decode sequences (q_len 1) and of prefill / chunked-prefill ones."""
    dec, pre = [], []
    b = qsl.tolist()
    for s in range(len(b) - 1):
        (dec if b[s + 1] - b[s] == 1 else pre).extend(range(b[s], b[s + 1]))
    return dec, pre


def explain(case, fn, args, out, lse, ref_out, ref_lse, tol, call):
    """A list of findings for a failing output. `call(fn, args)` reruns the target."""
    notes = []
    o = out.detach().to("cpu", torch.float64)
    nan_rows = int((~torch.isfinite(o)).flatten(1).any(1).sum())
    if nan_rows:
        notes.append(f"{nan_rows} of {o.shape[0]} rows NaN/inf")
    e = rel_err(out, ref_out)
    if e == e and e <= 5 * tol["out_rel"]:
        notes.append(f"tolerance question: out_rel {e:.2e} is {e / tol['out_rel']:.1f}x the {tol['out_rel']:.0e} allowed for {case.meta['dtype']}")
    dec, pre = row_kinds(args[5])
    for kind, rows in (("decode", dec), ("prefill", pre)):
        if rows and len(rows) < o.shape[0]:
            notes.append(f"{kind} rows out_rel {rel_err(o[rows], ref_out[rows]):.1e}")
    # Does the output depend on memory no live token maps to? The first variant that makes it pass says where.
    if not (e == e and e <= tol["out_rel"]):
        for kw, finding in VARIANTS:
            try:
                o2, _ = call(fn, variant(case, args, **kw))
            except Exception as ex:  # noqa: BLE001 - the target may fail differently on the variant
                notes.append(f"rerun with {kw} raised {type(ex).__name__}: {ex}"[:200])
                break
            e2 = rel_err(o2, ref_out)
            if e2 == e2 and e2 <= tol["out_rel"]:
                notes.append(f"passes once that memory is zeroed / made valid ({', '.join(kw)}): {finding}")
                break
    # Another convention?
    q, kc, vc, bt, lens, qsl, scale, window, cap = args
    variants = [("top-left causal alignment", dict(window=window, align="top"))]
    if window > 0:
        variants += [(f"window {window - 1} (one key fewer)", dict(window=window - 1)), (f"window {window + 1} (one key more)", dict(window=window + 1))]
    if cap > 0:
        variants += [("no soft-cap", dict(window=window, softcap=0.0))]
    for label, kw in variants:
        kw.setdefault("softcap", cap)
        r, _ = attention(q, kc, vc, bt, lens, qsl, scale, kw.pop("window"), kw.pop("softcap"), **kw)
        if rel_err(out, r.cpu()) <= tol["out_rel"]:
            notes.append(f"matches the reference with {label}")
    if lse is not None:
        le = max_abs(lse, ref_lse)
        if not le <= tol["lse_abs"]:
            for label, f in (("base 2", math.log(2)), ("base 2 (inverse)", 1 / math.log(2))):
                if max_abs(lse.to("cpu", torch.float64) * f, ref_lse) <= tol["lse_abs"]:
                    notes.append(f"LSE is in {label}")
    return notes
