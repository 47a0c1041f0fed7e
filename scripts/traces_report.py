#!/usr/bin/env python3
"""Print a Markdown summary of a trace manifest (used for docs/traces.md).

Usage:
    python scripts/traces_report.py [TRACE_DIR]     # default: traces/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    trace_dir = Path(argv[0]) if argv else REPO_ROOT / "traces"
    manifest = json.loads((trace_dir / "manifest.json").read_text())
    rows = manifest["traces"]
    print("| trace | P | T | layers | planted fact (tokens, depth) | dense model answered | "
          "retrieved | eos_step | MB | prefill s | decode s | fp16 err step / layer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    total = 0
    for t in rows:
        fact = t["needle"] or t.get("fact")
        where = (f"[{fact['token_start']}, {fact['token_end']}), {fact['depth']}"
                 if fact else "-")
        if t["needle"]:
            where = f"`{t['needle']['key']}` = {t['needle']['value']} at " + where
        answer = t["answer_text"].strip().replace("\n", " ").replace("|", "\\|")
        if len(answer) > 90:
            answer = answer[:90] + "…"
        total += t["bytes"]
        print(f"| {Path(t['file']).stem} | {t['prompt_len']} | {t['decode_steps']} | "
              f"{', '.join(map(str, t['layers']))} | {where} | {answer!s} | "
              f"{t.get('retrieved', '-')} | {t['eos_step']} | {t['bytes'] / 1e6:.2f} | "
              f"{t['prefill_s']} | {t['decode_s']} | "
              f"{t['check_fp16_max_step_rel_err']:.1e} / {t['check_fp16_layer_rel_err']:.1e} |")
    print(f"\nTotal: {total / 1e6:.2f} MB in {len(rows)} files (+ manifest.json).")

    masses = [(Path(t["file"]).stem, t["fact_attention_mass_by_layer"]) for t in rows
              if "fact_attention_mass_by_layer" in t]
    if masses:
        layers = sorted({int(L) for _, m in masses for L in m})
        print("\nAttention mass on the planted fact (max over the 9 heads, mean over the "
              "last prompt query and the first 8 decode queries):\n")
        print("| layer | " + " | ".join(name for name, _ in masses) + " |")
        print("| --- |" + " --- |" * len(masses))
        for L in layers:
            print(f"| {L} | " + " | ".join(f"{m.get(str(L), float('nan')):.2f}"
                                          for _, m in masses) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
