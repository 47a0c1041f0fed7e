#!/usr/bin/env python3
"""Runs `python -m kvsparse.conformance` without installing or importing the kvsparse binding: loads the
subpackage python_shim/kvsparse/conformance on its own (it needs only torch), for machines where the cffi
binding or libkvsparse is not available (e.g. a GPU box that only has torch). Same arguments:

    python3 scripts/conformance_targets.py DIR --device cuda --target reference --target torch-sdpa ...
"""
import importlib.util
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "python_shim" / "kvsparse" / "conformance"


def load():
    spec = importlib.util.spec_from_file_location("kvs_conformance", PKG / "__init__.py", submodule_search_locations=[str(PKG)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvs_conformance"] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module("kvs_conformance.__main__")


if __name__ == "__main__":
    sys.exit(load().main())
