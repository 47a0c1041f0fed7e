"""Runs vLLM (CPU) greedy generation in this process and prints one JSON result.

A separate process per configuration because vLLM loads plugins and overrides
backends once per process. Usage:
  python vllm_generate.py MODEL_DIR REQUESTS_JSON [--kvsparse] [--policy SPEC] [--staggered]
REQUESTS_JSON: [{"prompt_token_ids": [...], "max_tokens": N}, ...]
"""
import argparse
import json
import os
import sys


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
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: stats readable here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.kvsparse:
        os.environ["KVSPARSE_OVERRIDE_CPU_ATTN"] = "1"
    else:
        os.environ.pop("KVSPARSE_OVERRIDE_CPU_ATTN", None)
    from vllm import LLM, SamplingParams

    extra = {"additional_config": {"kvsparse": {"policy": a.policy}}} if a.policy is not None else {}
    if a.block_size:
        extra["block_size"] = a.block_size
    if a.num_blocks:
        extra["num_gpu_blocks_override"] = a.num_blocks
    llm = LLM(model=a.model, dtype="float32", seed=0, enforce_eager=True, max_model_len=a.max_model_len,
              gpu_memory_utilization=0.3, max_num_batched_tokens=1024, kv_cache_dtype=a.kv_cache_dtype,
              **extra)
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
    result["tokens"] = [list(o.outputs[0].token_ids) for o in ordered]
    if a.logprobs:
        result["logprobs"] = [[{str(k): v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs]
                              for o in ordered]
    if a.kvsparse and result["backend"] == "kvsparse":
        from kvsparse import vllm_backend
        from kvsparse.seq_ids import TRACKER
        result["stats_after"] = vllm_backend.get_engine().stats()
        result["live_request_ids"] = len(TRACKER.live())
        result["lifecycle"] = TRACKER.lifecycle()
        vllm_backend.log_stats(vllm_backend.get_engine())
    print("KVS_RESULT " + json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
