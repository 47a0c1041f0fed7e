"""Runs a target (a Python callable) over an exported suite and reports, per case, pass / fail / unsupported
/ error with the errors against the float64 reference and, for failures, the diagnosis."""
import datetime
import json
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

from .cases import Suite, write_safetensors
from .diagnose import explain, max_abs, rel_err


class Unsupported(Exception):
    """Raised by an adapter for a case its kernel does not support; the message says what. Reported as
    unsupported, not failed (NotImplementedError is taken the same way)."""


@dataclass
class Outcome:
    name: str
    status: str  # pass | fail | unsupported | error | not run
    out_rel: float = float("nan")
    lse_abs: float = None  # None: the target returns no LSE
    tolerance: dict = None
    message: str = ""
    diagnosis: list = field(default_factory=list)
    features: list = field(default_factory=list)
    rows: str = "all"
    seconds: float = 0.0

    def line(self):
        if self.status in ("pass", "fail"):
            lse = "   -   " if self.lse_abs is None else f"{self.lse_abs:.1e}"
            nums = f"out {self.out_rel:.1e} lse {lse} (tol {self.tolerance['out_rel']:.0e}/{self.tolerance['lse_abs']:.0e})"
        else:
            nums = ""
        rows = "" if self.rows == "all" else f" [{self.rows}]"
        text = f"{self.name:<44} {self.status:<11} {nums}{rows}"
        if self.message:
            text += f"  {self.message}"
        if self.diagnosis:
            text += "\n" + "\n".join(f"{'':<46}- {d}" for d in self.diagnosis)
        return text


@dataclass
class Report:
    target: str
    device: str
    versions: dict
    date: str
    outcomes: list = field(default_factory=list)

    def counts(self):
        c = {k: 0 for k in ("pass", "fail", "unsupported", "error", "not run")}
        for o in self.outcomes:
            c[o.status] += 1
        return c

    def summary(self):
        c = self.counts()
        words = {"pass": "passed", "fail": "failed", "unsupported": "unsupported", "error": "errors", "not run": "not run"}
        return f"{self.target} on {self.device}: " + ", ".join(f"{v} {words[k]}" for k, v in c.items() if v or k in ("pass", "fail", "unsupported"))

    def to_json(self):
        d = asdict(self)
        d["counts"] = self.counts()
        return json.dumps(d, indent=1, default=str)


def versions(extra=None):
    v = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
        v["cuda"] = torch.version.cuda
    v.update(extra or {})
    return v


def _decode_subset(args):
    """The case restricted to its decode sequences (query length 1): (args, token rows) or None."""
    q, kc, vc, bt, lens, qsl, *rest = args
    b = qsl.tolist()
    seqs = [s for s in range(len(b) - 1) if b[s + 1] - b[s] == 1]
    if not seqs:
        return None
    rows = [b[s] for s in seqs]
    idx = torch.tensor(seqs, device=bt.device)
    sub = (q[rows], kc, vc, bt[idx], lens[idx], torch.arange(len(seqs) + 1, dtype=qsl.dtype, device=qsl.device), *rest)
    return sub, rows, len(b) - 1


def _call(fn, args, **kw):
    r = fn(*args, **kw)
    out, lse = r if isinstance(r, tuple) else (r, None)
    if torch.cuda.is_available() and out.is_cuda:
        torch.cuda.synchronize()
    return out, lse


def run(fn, suite, *, target=None, device="cpu", filters=(), diagnose=True, save=None, time_budget=None,
        log=print):
    """Runs `fn(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap) ->
    (out, lse)` (lse may be None) over the cases of `suite` (a Suite or its directory) with the tensors on
    `device`. An adapter with `fn.rows == "decode"` gets only each case's decode sequences; FP8 caches come
    dequantized to the query dtype, or to `fn.fp8_cache` (a torch dtype) where the adapter sets one; with
    `fn.fp8_cache = "native"` the FP8 tensors themselves (torch float8 views) and `k_scale=`, `v_scale=`. `save`: a name
    under suite/results/ to store the outputs in for `check.py`. Returns a Report."""
    suite = suite if isinstance(suite, Suite) else Suite(suite)
    name = target or getattr(fn, "__name__", "target")
    extra = fn.versions() if hasattr(fn, "versions") else {}
    rep = Report(target=name, device=str(device), versions=versions(extra), date=datetime.date.today().isoformat())
    t_start = time.time()
    for entry in suite.select(filters):
        o = Outcome(entry["name"], "not run", tolerance=entry["tolerance"], features=entry["features"])
        rep.outcomes.append(o)
        if time_budget is not None and time.time() - t_start > time_budget:
            o.message = f"time budget of {time_budget:.0f} s spent"
            log(o.line())
            continue
        t0 = time.time()
        case = suite.load(entry, device)
        native = case.fp8 is not None and getattr(fn, "fp8_cache", None) == "native"
        args = case.args(None if native else getattr(fn, "fp8_cache", None), native=native)
        kw = {"k_scale": case.meta["k_scale"], "v_scale": case.meta["v_scale"]} if native else {}
        ref_out, ref_lse = case.ref_out, case.ref_lse
        if getattr(fn, "rows", "all") == "decode":
            sub = _decode_subset(args)
            if sub is None:
                o.status, o.message = "unsupported", "no decode rows (the target serves decode rows only)"
                log(o.line())
                continue
            args, rows, nseq = sub
            ref_out, ref_lse = ref_out[rows], ref_lse[rows]
            o.rows = f"decode rows: {len(rows)} of {nseq} sequences"
        try:
            out, lse = _call(fn, args, **kw)
        except (Unsupported, NotImplementedError) as e:
            o.status, o.message = "unsupported", str(e) or type(e).__name__
        except Exception as e:  # noqa: BLE001 - any failure of the target is reported, not raised
            o.status, o.message = "error", f"{type(e).__name__}: {e}".splitlines()[0][:300]
        else:
            o.out_rel = rel_err(out, ref_out)
            o.lse_abs = None if lse is None else max_abs(lse, ref_lse)
            ok = o.out_rel <= case.tolerance["out_rel"] and (o.lse_abs is None or o.lse_abs <= case.tolerance["lse_abs"])
            o.status = "pass" if ok else "fail"
            if not ok and diagnose:
                o.diagnosis = explain(case, fn, args, out, lse, ref_out, ref_lse, case.tolerance, lambda f, a: _call(f, a, **kw))
            if save and o.rows == "all":
                res = {"out": out.to(case.dtype)}
                if lse is not None:
                    res["lse"] = lse.to(torch.float32)
                write_safetensors(suite.root / "results" / save / f"{case.name}.safetensors", res)
        o.seconds = time.time() - t0
        log(o.line())
    if save:
        p = suite.root / "results" / save / "report.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"target": name, "cases": [{"name": o.name, "verdict": o.status + (": " + o.message if o.message else "")} for o in rep.outcomes]}, indent=1))
    log(rep.summary())
    return rep
