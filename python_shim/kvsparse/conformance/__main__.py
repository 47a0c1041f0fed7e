"""python -m kvsparse.conformance DIR --target NAME [...]: runs adapters over an exported suite."""
import argparse
import json
import sys

from . import adapters
from .runner import run


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvsparse.conformance",
                                 description="Run paged-attention implementations over an exported kvsparse "
                                             "conformance suite (kvsparse conformance --export DIR).")
    ap.add_argument("dir", help="the exported suite")
    ap.add_argument("--target", action="append", required=True,
                    help=f"adapter to run (repeatable): {', '.join(adapters.TARGETS)}, or module:function")
    ap.add_argument("--device", default="cpu", help="where the case tensors live (cpu, cuda, cuda:1, ...)")
    ap.add_argument("--filter", default="", help="comma-separated substrings; a case runs if its name has any")
    ap.add_argument("--save", action="store_true", help="store outputs under DIR/results/<target> for check.py")
    ap.add_argument("--json", help="write the reports to this file (JSON list)")
    ap.add_argument("--time-budget", type=float, help="seconds per target; later cases are reported 'not run'")
    ap.add_argument("--no-diagnose", action="store_true", help="skip the reruns that explain failures")
    ap.add_argument("--fail-on-failure", action="store_true",
                    help="exit 1 if any case fails or errors (default: exit 0 once every report is complete)")
    a = ap.parse_args(argv)
    filters = [f for f in a.filter.split(",") if f]
    reports = []
    for name in a.target:
        print(f"== {name} on {a.device}", flush=True)
        try:
            fn = adapters.load(name)
        except Exception as e:  # noqa: BLE001
            print(f"cannot load target {name}: {type(e).__name__}: {e}")
            reports.append(None)
            continue
        rep = run(fn, a.dir, target=name, device=a.device, filters=filters, diagnose=not a.no_diagnose,
                  save=name if a.save else None, time_budget=a.time_budget, log=lambda s: print(s, flush=True))
        print(f"   versions: {json.dumps(rep.versions)}")
        reports.append(rep)
    print("== summary")
    for name, rep in zip(a.target, reports):
        print(rep.summary() if rep else f"{name}: could not be loaded")
    if a.json:
        with open(a.json, "w") as f:
            f.write("[" + ",\n".join(r.to_json() for r in reports if r) + "]\n")
    bad = any(r is None for r in reports) or (a.fail_on_failure and any(r.counts()["fail"] + r.counts()["error"] for r in reports if r))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
