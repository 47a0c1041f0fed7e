#!/usr/bin/env python3
"""End-to-end vLLM CPU generation: kvsparse dense (and optional policies) against vLLM's own CPU attention.

SmolLM2-135M (scripts/convert_model.py), greedy, one request at a time, prompts of fixed token lengths
(seeded random token ids), 64 new tokens with ignore_eos. Each configuration runs in its own process (vLLM
loads plugins and resolves backends once per process), the configurations alternate and their order flips
every repetition, so machine noise hits both alike. Per request the engine is stepped by hand: prefill ends
at the step that returns the first token; decode tokens/s = (new tokens - 1) / time from then to the last.

One command prints the whole comparison:
  PYTHONPATH=python_shim KVSPARSE_LIB=target/release/libkvsparse.so \\
    .venv/bin/python scripts/vllm_e2e_bench.py [--prompts 4096,7168] [--new 64] [--reps 3]
    [--policy 'quest(budget=1024, sink=16)'] [--dtype float32] [--concurrent 1]
The kvsparse package is imported from PYTHONPATH (or the installed package) and its vLLM plugin registered
in the child process (no entry point needed); KVSPARSE_LIB selects the library.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Timers:
    """Accumulated wall time of wrapped callables, by name (only while `on`)."""

    def __init__(self):
        self.on = False
        self.t = {}
        self.n = {}

    def wrap(self, name, f):
        def g(*args, **kw):
            if not self.on:
                return f(*args, **kw)
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
                self.n[name] = self.n.get(name, 0) + 1

        return g

    def reset(self):
        self.t.clear()
        self.n.clear()

    def per_call_us(self):
        return {k: round(self.t[k] / self.n[k] * 1e6, 1) for k in self.t} | {k + " calls": v for k, v in self.n.items()}


class _LibProxy:
    """Stands in for kvsparse's cffi `lib` so the C calls can be timed (cffi libraries take no attributes)."""

    def __init__(self, lib, timers):
        self._lib = lib
        self.kvs_attention_forward = timers.wrap("kvs_attention_forward (C)", lib.kvs_attention_forward)
        self.kvs_cache_write = timers.wrap("kvs_cache_write (C)", lib.kvs_cache_write)

    def __getattr__(self, k):
        return getattr(self._lib, k)


def install_profile(config, timers):
    """Times, per layer call: the backend's forward and cache update (Python + C) and the C calls inside."""
    if config == "vllm":
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends import cpu_attn

        impl = cpu_attn.CPUAttentionBackendImpl
        ops.cpu_attention_with_kv_cache = timers.wrap("cpu_attention_with_kv_cache (C)", ops.cpu_attention_with_kv_cache)
        ops.cpu_attn_reshape_and_cache = timers.wrap("cpu_attn_reshape_and_cache (C)", ops.cpu_attn_reshape_and_cache)
        builder = cpu_attn.CPUAttentionMetadataBuilder
    else:
        from kvsparse import engine as keng
        from kvsparse import step as kstep
        from kvsparse import vllm_backend

        keng.lib = kstep.lib = _LibProxy(keng.lib, timers)
        impl = vllm_backend.KvSparseImpl
        builder = vllm_backend.KvSparseMetadataBuilder
    impl.forward = timers.wrap("impl.forward", impl.forward)
    if hasattr(impl, "do_kv_cache_update"):  # kvsparse writes the cache inside forward
        impl.do_kv_cache_update = timers.wrap("impl.do_kv_cache_update", impl.do_kv_cache_update)
    builder.build = timers.wrap("metadata build (per step)", builder.build)


def child(a):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: plugin registered here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if a.config != "vllm":
        os.environ["KVSPARSE_OVERRIDE_CPU_ATTN"] = "1"
        os.environ["KVSPARSE_LOG_EVERY"] = "0"
        from kvsparse import vllm_plugin

        vllm_plugin.register()
    else:
        os.environ.pop("KVSPARSE_OVERRIDE_CPU_ATTN", None)
    from vllm import LLM, SamplingParams

    timers = Timers()
    if a.profile:
        install_profile(a.config, timers)
    extra = {}
    if a.config not in ("vllm", "kvsparse"):
        extra["additional_config"] = {"kvsparse": {"policy": a.config}}
    max_len = max(a.prompts) + a.new + 16
    llm = LLM(model=a.model, dtype=a.dtype, seed=0, enforce_eager=True, max_model_len=max_len,
              gpu_memory_utilization=0.3, **extra)
    engine = llm.llm_engine
    backend = "vllm CPU_ATTN"
    if a.config != "vllm":
        from kvsparse import vllm_backend

        eng = vllm_backend.get_engine()
        if eng is None:
            raise SystemExit("kvsparse backend was not used")
        backend = f"kvsparse {eng.policy or 'dense'}"
    rng = random.Random(a.seed)
    vocab = llm.get_tokenizer().vocab_size

    def run(prompt_len, new, n_req):
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        for i in range(n_req):
            ids = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
            engine.add_request(f"r{prompt_len}-{i}-{time.time_ns()}", {"prompt_token_ids": ids}, params)
        t0 = time.perf_counter()
        first = None
        steps = []
        counts = {}
        while engine.has_unfinished_requests():
            ts = time.perf_counter()
            outs = engine.step()
            te = time.perf_counter()
            for o in outs:
                counts[o.request_id] = len(o.outputs[0].token_ids)
            if first is None and len(counts) == n_req and all(c >= 1 for c in counts.values()):
                first = te
                timers.reset()
                timers.on = a.profile
            elif first is not None:
                steps.append(te - ts)
        end = time.perf_counter()
        timers.on = False
        toks = sum(counts.values())
        return dict(profile_us=timers.per_call_us() if a.profile else None,prompt=prompt_len, requests=n_req, new=toks, prefill_s=first - t0, decode_s=end - first,
                    decode_tps=(toks - n_req) / (end - first), step_ms_median=statistics.median(steps) * 1e3)

    run(32, 4, 1)  # warm-up
    for p in a.prompts:
        r = run(p, a.new, a.concurrent)
        r.update(config=a.config, backend=backend)
        print("E2E_RESULT " + json.dumps(r), flush=True)


def parent(a):
    configs = ["vllm", "kvsparse"] + [f"kvsparse@{e}" for e in a.kvs_env] + a.policy
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(REPO / "python_shim"))
    env.setdefault("KVSPARSE_LIB", str(REPO / "target" / "release" / "libkvsparse.so"))
    print(f"model {a.model}, {a.dtype}, prompts {a.prompts}, {a.new} new tokens, {a.concurrent} concurrent "
          f"request(s), {a.reps} repetitions, KVSPARSE_LIB={env['KVSPARSE_LIB']}", flush=True)
    res = []
    for rep in range(a.reps):
        order = configs if rep % 2 == 0 else configs[::-1]
        for c in order:
            cmd = [sys.executable, __file__, "--child", c, "--model", a.model, "--dtype", a.dtype,
                   "--prompts", ",".join(map(str, a.prompts)), "--new", str(a.new), "--concurrent",
                   str(a.concurrent), "--seed", str(a.seed)] + (["--profile"] if a.profile else [])
            cenv = dict(env)
            if c.startswith("kvsparse@"):
                cmd[3] = "kvsparse"
                cenv.update(kv.split("=", 1) for kv in c[len("kvsparse@"):].split(","))
            t0 = time.time()
            p = subprocess.run(cmd, env=cenv, capture_output=True, text=True)
            lines = [l for l in p.stdout.splitlines() if l.startswith("E2E_RESULT ")]
            if p.returncode != 0 or not lines:
                sys.stderr.write(p.stdout[-3000:] + p.stderr[-5000:])
                raise SystemExit(f"configuration {c} failed (exit {p.returncode})")
            for l in lines:
                r = json.loads(l[len("E2E_RESULT "):])
                r["rep"], r["config"] = rep, c
                res.append(r)
                print(f"  rep {rep} {c:>24}: prompt {r['prompt']:>5}  decode {r['decode_tps']:6.2f} tok/s "
                      f"(median step {r['step_ms_median']:.1f} ms)  prefill {r['prefill_s']:.2f} s", flush=True)
                if r.get("profile_us"):
                    print(f"      decode-phase µs per call: {r['profile_us']}", flush=True)
            print(f"  ({c}: {time.time() - t0:.0f} s with start-up)", flush=True)
    print()
    print("| prompt tokens | configuration | decode tok/s per repetition | median | vs vLLM | median step ms |")
    print("|---:|---|---|---:|---:|---:|")
    for p in a.prompts:
        base = statistics.median(r["decode_tps"] for r in res if r["prompt"] == p and r["config"] == "vllm")
        for c in configs:
            rs = [r for r in res if r["prompt"] == p and r["config"] == c]
            tps = [r["decode_tps"] for r in rs]
            med = statistics.median(tps)
            step = statistics.median(r["step_ms_median"] for r in rs)
            name = {"vllm": "vLLM CPU_ATTN", "kvsparse": "kvsparse dense"}.get(c) or (
                f"kvsparse dense, {c[len('kvsparse@'):]}" if c.startswith("kvsparse@") else f"kvsparse `{c}`")
            print(f"| {p} | {name} | {' / '.join(f'{x:.2f}' for x in tps)} | {med:.2f} | {med / base:.2f}x | "
                  f"{step:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("KVSPARSE_MODEL", str(REPO / ".cache" / "smollm2")))
    ap.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 7168])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=1, help="requests of each prompt length at once")
    ap.add_argument("--policy", action="append", default=[], help="also run kvsparse with this policy")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="time the backend's forward / cache update per layer call and the C calls inside them "
                         "(decode phase; a few µs of timer overhead per call)")
    ap.add_argument("--kvs-env", action="append", default=[],
                    help="also run kvsparse dense with these environment settings, e.g. KVSPARSE_NUM_THREADS=1 "
                         "(comma-separated KEY=VALUE)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not (Path(a.model) / "config.json").is_file():
        raise SystemExit(f"no model at {a.model}: run scripts/convert_model.py (or set KVSPARSE_MODEL)")
    if a.child:
        a.config = a.child
        child(a)
    else:
        parent(a)


if __name__ == "__main__":
    main()
