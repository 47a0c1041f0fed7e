"""Runs vLLM (CPU) greedy generation in this process and prints one JSON result.

A separate process per configuration because vLLM loads plugins and overrides
backends once per process. Usage:
  python vllm_generate.py MODEL_DIR REQUESTS_JSON [--kvsparse] [--policy SPEC] [--staggered] [--profile]
REQUESTS_JSON: [{"prompt_token_ids": [...], "max_tokens": N}, ...]
An exception from LLM(...) is printed as one line `KVS_RAISED {"type": ..., "text": str(exception)}`.
"""
import argparse
import json
import os
import sys
import time
import traceback
from collections import Counter


class _TimedLib:
    """Stands in for the cffi `lib` in kvsparse's modules: times the two per-layer C calls."""

    TIMED = ("kvs_attention_forward", "kvs_cache_write")

    def __init__(self, lib):
        self._lib, self.ns, self.n = lib, Counter(), Counter()

    def __getattr__(self, name):
        c_fn = getattr(self._lib, name)
        f = c_fn
        if name in self.TIMED:
            ns, n, clock = self.ns, self.n, time.perf_counter_ns

            def f(*a):
                t0 = clock()
                r = c_fn(*a)
                ns[name] += clock() - t0
                n[name] += 1
                return r

        setattr(self, name, f)  # later lookups skip __getattr__
        return f


def _install_profile():
    """Per-layer cost of the backend in decode steps: wall time of each KvSparseImpl.forward /
    do_kv_cache_update call and of the C call inside; Python = wall - C. Medians (and means), per call: on a
    shared machine the means carry the scheduler's preemptions, the medians do not. Returns a function that
    gives the summary."""
    import statistics

    import kvsparse.engine
    from kvsparse import vllm_backend

    timed = _TimedLib(kvsparse.engine.lib)
    for mod in ("kvsparse.engine", "kvsparse.step"):
        m = sys.modules.get(mod)
        if m is not None:
            m.lib = timed
    samples = {}  # name -> [(wall ns, C ns)]
    decode = {"on": False}
    impl = vllm_backend.KvSparseImpl
    builder = vllm_backend.KvSparseMetadataBuilder

    def wrap(cls, name, cnames, gate):
        orig = getattr(cls, name)
        rows = samples.setdefault(name, [])

        def w(self, *a, **kw):
            if not gate(a):
                return orig(self, *a, **kw)
            c0 = sum(timed.ns[c] for c in cnames)
            t0 = time.perf_counter_ns()
            r = orig(self, *a, **kw)
            t1 = time.perf_counter_ns()
            rows.append((t1 - t0, sum(timed.ns[c] for c in cnames) - c0))
            return r

        setattr(cls, name, w)

    def is_decode_build(a):
        decode["on"] = a[1].max_query_len == 1  # build(common_prefix_len, common_attn_metadata)
        return decode["on"]

    wrap(builder, "build", (), is_decode_build)
    # forward(layer, query, key, value, kv_cache, attn_metadata, output): the cache write and attention.
    wrap(impl, "forward", _TimedLib.TIMED, lambda a: decode["on"] and a[5] is not None)
    if hasattr(impl, "do_kv_cache_update"):  # backends that write the cache in a separate call
        wrap(impl, "do_kv_cache_update", ("kvs_cache_write",), lambda a: decode["on"])

    def summary():
        out = {}
        for name, rows in samples.items():
            if rows:
                py = [w - c for w, c in rows]
                out[name] = {"calls": len(rows), "python_us_median": statistics.median(py) / 1e3,
                             "python_us_mean": statistics.fmean(py) / 1e3,
                             "c_us_median": statistics.median(c for _, c in rows) / 1e3,
                             "wall_us_median": statistics.median(w for w, _ in rows) / 1e3}
        return out

    return summary


def _count_kvsparse_calls():
    """Counts Python function calls whose code lives in the kvsparse package, from now on, in this thread and
    threads started later (sys.setprofile / threading.setprofile); also the model runner's execute_model
    calls, which shows the counter saw the steps' code path. Returns a function that stops counting and gives
    the counts."""
    import threading

    import kvsparse

    root = os.path.dirname(kvsparse.__file__)
    seen = Counter()

    def prof(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(root):
                seen[f"{os.path.basename(f)}:{frame.f_code.co_name}"] += 1
            elif frame.f_code.co_name == "execute_model" and f.endswith("model_runner.py"):
                seen["<vllm model runner>:execute_model"] += 1

    sys.setprofile(prof)
    threading.setprofile(prof)

    def stop():
        sys.setprofile(None)
        threading.setprofile(None)
        return dict(seen)

    return stop


def _registry():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    out = {}
    for name in ("CUSTOM", "CPU_ATTN"):
        try:
            out[name] = AttentionBackendEnum[name].get_path()
        except Exception as e:  # noqa: BLE001 - an unregistered CUSTOM raises
            out[name] = f"<{type(e).__name__}>"
    return out


def _runner(llm):
    """The in-process model runner (None if vLLM's object layout differs)."""
    obj = llm.llm_engine.engine_core
    for attr in ("engine_core", "model_executor", "driver_worker", "worker", "model_runner"):
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj


def _runner_hooked(llm):
    """Whether kvsparse wrapped the in-process model runner's execute_model (None: runner not found)."""
    runner = _runner(llm)
    return None if runner is None else bool(getattr(type(runner).execute_model, "_kvsparse_hooked", False))


def _expect_failures(a):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    out = {}
    for case, c in json.loads(a.expect_failures).items():
        for k, v in c.get("env", {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        extra = {"additional_config": {"kvsparse": c["kvsparse_config"]}} if c.get("kvsparse_config") else {}
        try:
            LLM(model=c.get("model", a.model), dtype="float32", seed=0, enforce_eager=True, max_model_len=512,
                kv_cache_dtype=c.get("kv_cache_dtype", "auto"), **extra)
            out[case] = None
        except Exception as e:  # noqa: BLE001 - what the user would catch
            out[case] = {"type": type(e).__name__, "text": str(e), "traceback": traceback.format_exc()}
    print("KVS_RAISED_CASES " + json.dumps(out))
    sys.stdout.flush()
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("requests")
    ap.add_argument("--kvsparse", action="store_true")
    ap.add_argument("--policy")
    ap.add_argument("--staggered", action="store_true", help="add requests at different engine steps")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--logprobs", type=int, default=0)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=None, help="default: vLLM's (128 on CPU)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (num_gpu_blocks_override)")
    ap.add_argument("--kvsparse-config", default=None, help="JSON for additional_config['kvsparse']")
    ap.add_argument("--profile", action="store_true", help="time the backend's per-layer calls in decode steps")
    ap.add_argument("--count-kvsparse-calls", action="store_true",
                    help="count Python calls into the kvsparse package while generating")
    ap.add_argument("--expect-failures", default=None,
                    help="JSON {case: {env, kvsparse_config, kv_cache_dtype, model}}: create each LLM in turn, "
                         "print what it raised (KVS_RAISED_CASES) and exit; for configurations that fail at "
                         "startup, before any worker or model")
    a = ap.parse_args()
    if a.expect_failures:
        return _expect_failures(a)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: stats readable here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.kvsparse:
        os.environ["KVSPARSE_OVERRIDE_CPU_ATTN"] = "1"
    else:
        os.environ.pop("KVSPARSE_OVERRIDE_CPU_ATTN", None)
    from vllm import LLM, SamplingParams

    section = json.loads(a.kvsparse_config) if a.kvsparse_config else {}
    if a.policy is not None:
        section["policy"] = a.policy
    extra = {"additional_config": {"kvsparse": section}} if section else {}
    if a.block_size:
        extra["block_size"] = a.block_size
    if a.num_blocks:
        extra["num_gpu_blocks_override"] = a.num_blocks
    try:
        llm = LLM(model=a.model, dtype="float32", seed=0, enforce_eager=True, max_model_len=a.max_model_len,
                  gpu_memory_utilization=0.3, max_num_batched_tokens=1024, kv_cache_dtype=a.kv_cache_dtype,
                  **extra)
    except Exception as e:  # noqa: BLE001 - the test reads what the user would catch
        traceback.print_exc()
        print("KVS_RAISED " + json.dumps({"type": type(e).__name__, "text": str(e)}))
        sys.stdout.flush()
        sys.exit(3)
    profile = _install_profile() if a.profile else None
    reqs = json.load(open(a.requests))
    result = {"backend": None, "stats_before": None}
    if a.kvsparse:
        from kvsparse import vllm_backend
        eng = vllm_backend.get_engine()
        result["backend"] = "kvsparse" if eng is not None else "not-used"
        result["stats_before"] = eng.stats() if eng else None

    def params(r):
        return SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], logprobs=a.logprobs or None,
                              ignore_eos=True)

    counter = _count_kvsparse_calls() if a.count_kvsparse_calls else None
    outs = {}
    if a.staggered:
        engine = llm.llm_engine
        pending = list(enumerate(reqs))
        step = 0
        while pending or engine.has_unfinished_requests():
            # one new request every 3 engine steps: requests join while others decode
            if pending and step % 3 == 0:
                i, r = pending.pop(0)
                engine.add_request(str(i), {"prompt_token_ids": r["prompt_token_ids"]}, params(r))
            for o in engine.step():
                if o.finished:
                    outs[int(o.request_id)] = o
            step += 1
        # The offline loop stops once every output is back, but the scheduler still holds the ids of the
        # requests that finished in the last step: it sends them to the workers in the next step's
        # SchedulerOutput.finished_req_ids. vLLM's serving loop (EngineCore.run_busy_loop) keeps stepping
        # while scheduler.has_requests() (unfinished *or finished-not-yet-sent*); do the same here.
        core = engine.engine_core.engine_core
        flush = 0
        while core.scheduler.has_requests() and flush < 8:
            engine.step()
            flush += 1
        result["flush_steps"] = flush
        result["steps"] = step
        ordered = [outs[i] for i in range(len(reqs))]
    else:
        ordered = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs],
                               [params(r) for r in reqs], use_tqdm=False)
    if counter is not None:
        result["kvsparse_calls"] = counter()
    result["registry"] = _registry()
    result["runner_hooked"] = _runner_hooked(llm)
    if profile is not None:
        result["profile"] = profile()
    result["tokens"] = [list(o.outputs[0].token_ids) for o in ordered]
    if a.logprobs:
        result["logprobs"] = [[{str(k): v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs]
                              for o in ordered]
    if a.kvsparse and result["backend"] == "kvsparse":
        from kvsparse import vllm_backend
        try:
            from kvsparse.vllm_runner import TRACKER
        except ImportError:  # an older kvsparse (profiling its backend for comparison)
            from kvsparse.seq_ids import TRACKER
        result["stats_after"] = vllm_backend.get_engine().stats()
        result["live_request_ids"] = len(TRACKER.live())
        result["lifecycle"] = TRACKER.lifecycle()
        vllm_backend.log_stats(vllm_backend.get_engine())
    print("KVS_RESULT " + json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
