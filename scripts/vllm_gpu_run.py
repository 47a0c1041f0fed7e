#!/usr/bin/env python3
"""kvsparse inside real vLLM on a GPU (issue 32): one process runs vLLM engines one after another (offline
`vllm.LLM`, a Llama-3-8B-shaped config with `load_format="dummy"`, token-id prompts, vLLM's default
compilation and CUDA-graph mode) and measures, per part (--parts):

  tokens    greedy tokens of each engine vs FLASH_ATTN for a batch of prompts (the first engine listed is
            the reference): tokens that agree, and at a first divergence the reference's top-2 logprob gap
            (a gap within bf16 rounding of the logits is a tie, not an error) and the rank of the token
            the engine chose there.
  preempt   the same engines with a KV cache too small for the batch (num_gpu_blocks_override) and prefix
            caching on (half of the prompts share a prefix): more sequences than fit, so vLLM preempts and
            recomputes; every request's output vs the same request run alone afterwards on the same engine
            (a prefix-cache hit); then the plugin's engine counters and sequence-id lifecycle from every
            worker (`kvsparse.vllm_backend.worker_report`): preemptions seen, ids live, state released.
  badconfig bad kvsparse configurations (unknown policy, head size 72, a policy the CUDA engine refuses, a
            policy without the kvsparse backend; every policy has an FP8 path on CUDA since issue 28): `LLM(...)` must raise kvsparse's message within
            seconds (before any worker starts).
  speed     decode tokens/s with CUDA graphs at batch x context points (--points), per engine, from the
            arrival times of the tokens (vLLM's LLMEngine.step loop): decode starts when the last
            sequence got its first token; prefill seconds reported too. A point `BxL+M` adds one M-token
            prompt when decode starts (chunked prefill mixed with decode): decode tok/s while it prefills.
            Policies with `{L16}` in their spec get budget = context / 16 (one engine per context).

Every engine runs in try/except: a failure is recorded (with its traceback) and the run goes on. Results go
to $OUT (--out): vllm_gpu_run.json (everything, rewritten after every engine), speed.csv, tokens.csv, and a
summary table at the end. --budget-s: no engine starts, and no point runs, past this many seconds.

Engines (--engines): FLASH_ATTN, FLASHINFER (vLLM's) and the kvsparse policies in ENGINES.
"""
import argparse
import csv
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
import zlib

T0 = time.monotonic()
# worker_report travels to the workers as a pickled function (LLM.collective_rpc).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", torch_dtype="bfloat16", bos_token_id=128000,
    eos_token_id=128001, tie_word_embeddings=False, max_position_embeddings=131072 + 1024)

# name -> (vLLM attention_backend, kvsparse policy spec or None). `{L16}`: context / 16 of the speed point
# (the correctness parts use SMALL_L16).
ENGINES = {
    "FLASH_ATTN": ("FLASH_ATTN", None),
    "FLASHINFER": ("FLASHINFER", None),
    "dense": ("CUSTOM", ""),
    "quest": ("CUSTOM", "quest(budget={L16})"),
    "snapkv": ("CUSTOM", "snapkv(budget={L16})"),
    "streaming": ("CUSTOM", "streaming(sink=64, recent={L16})"),
    "quest_art": ("CUSTOM", "quest(budget={L16}, sink=16) > art(tau=1e-3, phi=1e-2, patience=2)"),
    "refresh": ("CUSTOM", "refresh(k={L16}, every=4)"),
    # FP8 (E4M3) KV cache, vLLM's kv_cache_dtype="fp8" with its per-layer scales (dense, streaming and Quest on CUDA).
    "FLASH_ATTN_fp8": ("FLASH_ATTN", None),
    "dense_fp8": ("CUSTOM", ""),
    "quest_fp8": ("CUSTOM", "quest(budget={L16})"),
    "streaming_fp8": ("CUSTOM", "streaming(sink=64, recent={L16})"),
    # float32 model (FLASH_ATTN has no f32): the preempt part's batch-vs-alone check without bf16 ties.
    "dense_f32": ("CUSTOM", ""),
    "quest_f32": ("CUSTOM", "quest(budget={L16})"),
}
# Engine options beside the backend and policy.
ENGINE_OPTS = {"FLASH_ATTN_fp8": dict(kv_cache_dtype="fp8"), "dense_fp8": dict(kv_cache_dtype="fp8"),
               "quest_fp8": dict(kv_cache_dtype="fp8"), "streaming_fp8": dict(kv_cache_dtype="fp8"),
               "dense_f32": dict(dtype="float32"), "quest_f32": dict(dtype="float32")}
SMALL_L16 = 256
ENGINE_START_S = 75  # what one engine start may take (38-68 s measured for FLASH_ATTN), for the budget

RESULTS = {"device": None, "vllm": None, "args": None, "engines": [], "tokens": [], "preempt": [], "badconfig": [],
           "speed": [], "errors": []}


def now():
    return time.monotonic() - T0


def log(*a):
    print(f"[{now():7.1f}s]", *a, flush=True)


def save(out):
    with open(os.path.join(out, "vllm_gpu_run.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def record_error(where, exc):
    tb = traceback.format_exc()
    log(f"FAILED {where}: {type(exc).__name__}: {str(exc)[:400]}")
    RESULTS["errors"].append({"where": where, "type": type(exc).__name__, "message": str(exc)[:4000],
                              "traceback": tb[-8000:], "t": now()})


def model_dir(root, **over):
    d = tempfile.mkdtemp(prefix="llama3-8b-shape-", dir=root)
    cfg = dict(LLAMA3_8B, **over)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def gpu_mem_used_mib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return [int(x) for x in out.split()]
    except Exception:
        return []


def wait_gpu_free(limit_mib=2000, timeout=30):
    """Waits for the last engine's processes to give the GPU memory back (the next engine profiles it)."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        used = gpu_mem_used_mib()
        if used and max(used) < limit_mib:
            return used
        time.sleep(1)
    return gpu_mem_used_mib()


def is_kvsparse(name):
    return ENGINES[name][1] is not None


def policy_for(name, l16):
    backend, spec = ENGINES[name]
    return backend, (None if spec is None else spec.replace("{L16}", str(l16)))


def make_llm(args, mdir, name, l16, **kw):
    from vllm import LLM

    backend, policy = policy_for(name, l16)
    opts = dict(model=mdir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                attention_backend=backend, tensor_parallel_size=args.tp,
                gpu_memory_utilization=args.gpu_mem, max_num_seqs=args.max_num_seqs)
    if policy is not None:
        opts["additional_config"] = {"kvsparse": {"policy": policy}}
    opts.update(ENGINE_OPTS.get(name, {}))
    opts.update(kw)
    t = time.monotonic()
    llm = LLM(**opts)
    start_s = time.monotonic() - t
    RESULTS["engines"].append({"engine": name, "policy": policy, "backend": backend, "start_s": round(start_s, 1),
                               "options": {k: v for k, v in opts.items() if k != "model"}})
    log(f"engine {name} policy={policy!r} up in {start_s:.1f} s")
    return llm, policy


def close(llm):
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    wait_gpu_free()


def sampling(max_tokens, logprobs=None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          logprobs=logprobs)


def random_prompts(seed, lengths, prefix=None):
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(10, LLAMA3_8B["vocab_size"] - 10) for _ in range(n)]
        out.append((prefix or []) + ids)
    return out


def worker_reports(llm):
    """The plugin's per-worker report (kvsparse.vllm_backend.worker_report), one per rank; [] for vLLM's own
    backends."""
    from kvsparse.vllm_backend import worker_report

    return llm.collective_rpc(worker_report)


def realistic_weights(worker, seed=0):
    """Runs in each worker (LLM.collective_rpc): replaces vLLM's dummy weights (uniform in +-1e-3, which
    make the logits nearly uniform, so that almost every greedy step is a tie) by seeded N(0, 0.02) matrices
    and unit norm weights, in place (captured graphs keep their addresses). The same seed gives every
    engine the same model."""
    import torch

    model = worker.model_runner.model
    rank = getattr(worker, "rank", 0) or 0
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters())):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                g = torch.Generator(device=p.device).manual_seed(seed * 1000003 + rank * 10007 + i)
                p.normal_(0.0, 0.02, generator=g)
    return True


# -- tokens -----------------------------------------------------------------------------------------------

def top2(lp_step):
    items = sorted(((getattr(v, "logprob", v), tid) for tid, v in lp_step.items()), reverse=True)
    return items[:2]


def compare(ref_out, out):
    """Per prompt: tokens agreeing before the first divergence, and the logprobs there."""
    rows = []
    for i, (r, o) in enumerate(zip(ref_out, out)):
        rt, ot = list(r.outputs[0].token_ids), list(o.outputs[0].token_ids)
        k = next((j for j, (a, b) in enumerate(zip(rt, ot)) if a != b), None)
        row = {"prompt": i, "prompt_len": len(r.prompt_token_ids), "tokens": len(rt),
               "agree": len(rt) if k is None and len(rt) == len(ot) else (k if k is not None else min(len(rt), len(ot)))}
        if k is not None:
            (l1, t1), (l2, t2) = top2(r.outputs[0].logprobs[k])
            mine = top2(o.outputs[0].logprobs[k])
            row.update(first_divergence=k, ref_token=rt[k], token=ot[k], ref_top2=[[t1, l1], [t2, l2]],
                       ref_gap=l1 - l2, chosen_is_ref_second=ot[k] == t2,
                       own_top2=[[t, l] for l, t in mine], own_gap=mine[0][0] - mine[1][0])
        rows.append(row)
    return rows


def part_tokens(args, llm, name, ref_outputs, prompts):
    t = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling(args.gen, logprobs=2),
                        use_tqdm=False)
    secs = time.monotonic() - t
    if ref_outputs is None:
        log(f"tokens: {name} is the reference ({secs:.1f} s)")
        return outs
    rows = compare(ref_outputs, outs)
    total, agree = sum(r["tokens"] for r in rows), sum(r["agree"] for r in rows)
    ties = [r for r in rows if "first_divergence" in r]
    RESULTS["tokens"].append({"engine": name, "reference": args.engines[0], "agree": agree, "total": total,
                              "prompts": rows, "seconds": round(secs, 2)})
    log(f"tokens {name} vs {args.engines[0]}: {agree}/{total} agree before the first divergence; "
        f"{len(ties)} prompt(s) diverge" + "".join(
            f"\n    prompt {r['prompt']} (len {r['prompt_len']}) at token {r['first_divergence']}: ref top-2 gap "
            f"{r['ref_gap']:.4f} (chose ref's 2nd: {r['chosen_is_ref_second']}), own gap {r['own_gap']:.4f}"
            for r in ties))
    return None


# -- preemption + prefix caching ----------------------------------------------------------------------------

def preempt_prompts(seed):
    """12 prompts of ~300 tokens, 6 of them sharing a 160-token prefix (10 blocks): all fit in the cache at
    once, their generations do not (12 x (300 + 256) tokens = 420 blocks > 360), so vLLM must preempt."""
    shared = random_prompts(seed + 1, [160])[0]
    with_prefix = random_prompts(seed + 2, [140, 150, 130, 145, 135, 155], prefix=shared)
    alone = random_prompts(seed + 3, [300, 280, 320, 260, 340, 290])
    return with_prefix + alone


def part_preempt(args, llm, name):
    prompts = preempt_prompts(args.seed)
    sp = sampling(args.preempt_gen, logprobs=2)
    t = time.monotonic()
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    batch_s = time.monotonic() - t
    alone = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p in prompts]
    # Alone is the reference: at a divergence, its top-2 gap says whether the batch's token was a bf16 tie.
    rows = compare(alone, batch)
    for r, a in zip(rows, alone):
        r["equal"] = "first_divergence" not in r and r["agree"] == r["tokens"]
        r["prefix_cached_alone"] = getattr(a, "num_cached_tokens", None)
    rep = None
    if is_kvsparse(name):
        rep = worker_reports(llm)
    equal = sum(r["equal"] for r in rows)
    RESULTS["preempt"].append({"engine": name, "requests": len(rows), "equal_to_alone": equal, "rows": rows,
                               "batch_s": round(batch_s, 1), "worker_reports": rep,
                               "kv_blocks": args.preempt_blocks})
    summary = ""
    if rep:
        for w in rep:
            if w:
                summary += (f"\n    rank {w.get('rank')}: preemptions seen {w['restarts']}, request ids live "
                            f"{w['live_ids']}, engine sequences live {w['stats']['live_sequences']} "
                            f"created {w['stats']['sequences_created']} released {w['stats']['sequences_released']}")
    summary += "".join(f"\n    request {r['prompt']} diverges at token {r['first_divergence']}: alone's top-2 gap "
                       f"{r['ref_gap']:.4f} (batch chose alone's 2nd: {r['chosen_is_ref_second']})"
                       for r in rows if "first_divergence" in r)
    log(f"preempt {name}: {equal}/{len(rows)} requests equal to the same request run alone "
        f"(batch {batch_s:.1f} s; KV {args.preempt_blocks} blocks){summary}")


# -- bad configuration --------------------------------------------------------------------------------------

def part_badconfig(args, root):
    from vllm import LLM

    tiny = dict(num_hidden_layers=2)
    cases = [
        ("unknown policy", {}, dict(attention_backend="CUSTOM",
                                    additional_config={"kvsparse": {"policy": "nosuchpolicy(budget=1)"}})),
        ("head size 72", dict(head_dim=72), dict(attention_backend="CUSTOM")),
        ("policy the CUDA engine refuses", {}, dict(
            attention_backend="CUSTOM",
            additional_config={"kvsparse": {"policy": "snapkv(budget=256) > art(tau=1e-3, phi=1e-2, patience=2)"}})),
        ("policy without the kvsparse backend", {}, dict(
            attention_backend="FLASH_ATTN", additional_config={"kvsparse": {"policy": "quest(budget=256)"}})),
    ]
    for what, cfg_over, opts in cases:
        mdir = model_dir(root, **tiny, **cfg_over)
        t = time.monotonic()
        row = {"case": what}
        try:
            llm = LLM(model=mdir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                      gpu_memory_utilization=0.3, max_model_len=4096, **opts)
            row.update(raised=False, seconds=round(time.monotonic() - t, 1), ok=False)
            close(llm)
        except Exception as e:  # the point of the case
            msg = str(e)
            row.update(raised=True, type=type(e).__name__, message=msg[:1000],
                       seconds=round(time.monotonic() - t, 1),
                       ok=msg.startswith("kvsparse") and time.monotonic() - t < 30)
        RESULTS["badconfig"].append(row)
        log(f"badconfig {what}: {'OK' if row['ok'] else 'NOT OK'} in {row['seconds']} s: "
            f"{row.get('type', 'no exception')}: {row.get('message', '')[:300]}")


# -- speed --------------------------------------------------------------------------------------------------

def parse_point(text):
    """'8x32768' -> (8, 32768, 0); '8x32768+32768' -> (8, 32768, 32768)."""
    main, _, extra = text.partition("+")
    b, _, l = main.partition("x")
    return int(b), int(l), int(extra or 0)


def timed_decode(llm, prompts, n_decode, interloper, timeout_s, tag):
    """Adds the prompts, steps the engine and times token arrivals (see the module doc)."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=n_decode + 1, ignore_eos=True, detokenize=False)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    t_start = time.monotonic()
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    seen, first, events = {}, {}, []
    inter_id, t_inter = None, None
    timed_out = False
    while eng.has_unfinished_requests():
        outs = eng.step()
        t = time.monotonic()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            d = n - seen.get(o.request_id, 0)
            if d > 0:
                seen[o.request_id] = n
                events.append((t, o.request_id, d))
                first.setdefault(o.request_id, t)
        if interloper and inter_id is None and all(r in first for r in ids):
            inter_id, t_inter = f"{tag}-interloper", t
            eng.add_request(inter_id, {"prompt_token_ids": interloper}, SamplingParams(
                temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False))
        if t - t_start > timeout_s:
            timed_out = True
            eng.abort_request(ids + ([inter_id] if inter_id else []))
            while eng.has_unfinished_requests():
                eng.step()
            break
    res = {"timed_out": timed_out, "elapsed_s": round(time.monotonic() - t_start, 2),
           "first_tokens": sum(r in first for r in ids)}
    if not all(r in first for r in ids):
        return res
    t0 = max(first[r] for r in ids)
    dec = [(t, d) for t, r, d in events if r in ids and t > t0]
    res["prefill_s"] = round(t0 - t_start, 2)
    if dec:
        span = dec[-1][0] - t0
        res["decode_tokens"] = sum(d for _, d in dec)
        res["decode_tok_s"] = round(res["decode_tokens"] / span, 1) if span > 0 else None
    if inter_id is not None:
        t1 = first.get(inter_id)
        res["interloper_prefill_s"] = None if t1 is None else round(t1 - t_inter, 2)
        # The decoders' tokens while the interloper prefills (until its first token or their last one).
        t_end = min(t1 or float("inf"), dec[-1][0] if dec else t_inter)
        mixed = [(t, d) for t, d in dec if t_inter < t <= t_end]
        if mixed and t_end > t_inter:
            res["mixed_decode_tokens"] = sum(d for _, d in mixed)
            res["mixed_decode_tok_s"] = round(res["mixed_decode_tokens"] / (t_end - t_inter), 1)
            res["mixed_window_s"] = round(t_end - t_inter, 2)
    return res


def part_speed(args, root, mdir):
    points = [parse_point(p) for p in args.points]
    for name in args.engines:
        # One engine per distinct policy spec (a spec with {L16} differs by context).
        groups = {}
        for b, l, extra in points:
            groups.setdefault(policy_for(name, l // 16)[1], []).append((b, l, extra))
        for policy, pts in groups.items():
            if now() + ENGINE_START_S > args.budget_s:
                RESULTS["speed"].append({"engine": name, "policy": policy, "skipped": "budget"})
                log(f"speed {name} {policy!r}: skipped (budget)")
                continue
            max_len = max(l + e for _, l, e in pts) + args.decode_tokens + 64
            llm = None
            try:
                llm, _ = make_llm(args, mdir, name, pts[0][1] // 16, max_model_len=max_len,
                                  enable_prefix_caching=False)
                llm.generate([{"prompt_token_ids": p} for p in random_prompts(7, [300, 200])], sampling(4),
                             use_tqdm=False)  # warm-up: first-use work outside the timed points
                for b, l, extra in pts:
                    left = args.budget_s - now() - 10
                    tag = f"{b}x{l}" + (f"+{extra}" if extra else "")
                    if left < 20:
                        RESULTS["speed"].append({"engine": name, "policy": policy, "point": tag, "skipped": "budget"})
                        continue
                    prompts = random_prompts(zlib.crc32(tag.encode()), [l] * b)
                    inter = random_prompts(99, [extra])[0] if extra else None
                    before = worker_reports(llm) if is_kvsparse(name) else None
                    r = timed_decode(llm, prompts, args.decode_tokens, inter, min(args.point_timeout_s, left), tag)
                    after = worker_reports(llm) if is_kvsparse(name) else None
                    if before and after and before[0] and after[0]:
                        sb, sa = before[0]["stats"], after[0]["stats"]
                        vis = sa["blocks_visited"] - sb["blocks_visited"]
                        eli = sa["blocks_eligible"] - sb["blocks_eligible"]
                        r["blocks_visited_over_eligible"] = round(vis / eli, 4) if eli else None
                    row = {"engine": name, "policy": policy, "point": tag, "batch": b, "context": l, **r}
                    RESULTS["speed"].append(row)
                    log(f"speed {name} {tag}: {r}")
                    save(args.out)
            except Exception as e:
                record_error(f"speed {name} {policy!r}", e)
                RESULTS["speed"].append({"engine": name, "policy": policy, "failed": f"{type(e).__name__}: {e}"[:500]})
            finally:
                if llm is not None:
                    close(llm)
                save(args.out)


# -- driver -------------------------------------------------------------------------------------------------

def part_engines(args, root, mdir):
    """tokens and preempt, one engine per name, the first engine the tokens reference."""
    prompts = random_prompts(args.seed, args.prompt_lens)
    ref = None
    for name in args.engines:
        if now() + ENGINE_START_S > args.budget_s:
            RESULTS["errors"].append({"where": f"engine {name}", "type": "skipped", "message": "budget"})
            log(f"engine {name}: skipped (budget)")
            continue
        llm = None
        try:
            kw = dict(max_model_len=2048, enable_prefix_caching=True)  # must fit in --preempt-blocks (vLLM checks)
            if "preempt" in args.parts:
                kw["num_gpu_blocks_override"] = args.preempt_blocks
            llm, _ = make_llm(args, mdir, name, SMALL_L16, **kw)
            if args.weights == "realistic":
                llm.collective_rpc(realistic_weights, args=(args.seed,))
            if "tokens" in args.parts:
                out = part_tokens(args, llm, name, ref, prompts)
                if ref is None:
                    ref = out
            if "preempt" in args.parts:
                part_preempt(args, llm, name)
        except Exception as e:
            record_error(f"engine {name}", e)
        finally:
            if llm is not None:
                close(llm)
            save(args.out)


def summary(args):
    print("\n==== summary ====")
    for e in RESULTS["engines"]:
        print(f"engine {e['engine']:<11} policy {str(e['policy']):<45} start {e['start_s']:6.1f} s")
    for t in RESULTS["tokens"]:
        div = [p for p in t["prompts"] if "first_divergence" in p]
        print(f"tokens   {t['engine']:<11} vs {t['reference']}: {t['agree']}/{t['total']} agree; divergences: " +
              (", ".join(f"p{p['prompt']}@{p['first_divergence']} gap {p['ref_gap']:.4f}" for p in div) or "none"))
    for p in RESULTS["preempt"]:
        reps = [w for w in (p["worker_reports"] or []) if w]
        extra = "; ".join(f"preemptions {w['restarts']} ids live {w['live_ids']} seqs live "
                          f"{w['stats']['live_sequences']}" for w in reps)
        print(f"preempt  {p['engine']:<11} {p['equal_to_alone']}/{p['requests']} equal to alone  {extra}")
    for b in RESULTS["badconfig"]:
        print(f"badconfig {b['case']:<36} {'OK ' if b['ok'] else 'BAD'} {b['seconds']:5.1f} s  "
              f"{b.get('type', '-')}: {b.get('message', '')[:120]}")
    if RESULTS["speed"]:
        print(f"{'engine':<11} {'policy':<40} {'point':<14} {'prefill s':>9} {'decode tok/s':>12} {'mixed tok/s':>11} "
              f"{'visited':>8}")
        for s in RESULTS["speed"]:
            if "point" not in s or "skipped" in s:
                print(f"{s['engine']:<11} {str(s.get('policy')):<40} {s.get('point', '-'):<14} "
                      f"{s.get('skipped') or s.get('failed', '')}")
                continue
            print(f"{s['engine']:<11} {str(s['policy']):<40} {s['point']:<14} {str(s.get('prefill_s')):>9} "
                  f"{str(s.get('decode_tok_s')):>12} {str(s.get('mixed_decode_tok_s', '')):>11} "
                  f"{str(s.get('blocks_visited_over_eligible', '')):>8}" + (" TIMED OUT" if s.get("timed_out") else ""))
        with open(os.path.join(args.out, "speed.csv"), "w", newline="") as f:
            keys = sorted({k for s in RESULTS["speed"] for k in s})
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(RESULTS["speed"])
    if RESULTS["tokens"]:
        with open(os.path.join(args.out, "tokens.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["engine", "prompt", "prompt_len", "tokens", "agree", "first_divergence", "ref_gap",
                        "chosen_is_ref_second", "own_gap"])
            for t in RESULTS["tokens"]:
                for p in t["prompts"]:
                    w.writerow([t["engine"], p["prompt"], p["prompt_len"], p["tokens"], p["agree"],
                                p.get("first_divergence"), p.get("ref_gap"), p.get("chosen_is_ref_second"),
                                p.get("own_gap")])
    for e in RESULTS["errors"]:
        print(f"ERROR {e['where']}: {e['type']}: {e['message'][:300]}")
    print(f"done in {now():.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="tokens,preempt,badconfig", help="tokens,preempt,badconfig,speed")
    ap.add_argument("--engines", default="FLASH_ATTN,dense,quest,refresh",
                    help=f"comma list of {', '.join(ENGINES)}; the first is the tokens reference")
    ap.add_argument("--points", default="1x32768,32x8192,8x32768,8x32768+32768,1x131072",
                    help="speed points BxL or BxL+M (M-token prompt interleaved)")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--gen", type=int, default=48, help="greedy tokens per prompt in the tokens part")
    ap.add_argument("--prompt-lens", default="32,100,250,400,600,800,1000,1400,50",
                    help="tokens part: prompt lengths (9 by default, not a CUDA-graph capture size: FULL graphs replay a padded batch; with --gen, they must fit in --preempt-blocks together)")
    ap.add_argument("--preempt-gen", type=int, default=256)
    ap.add_argument("--preempt-blocks", type=int, default=360,
                    help="KV blocks (of 16 tokens) of the tokens/preempt engines: the tokens batch needs ~320, "
                         "the preempt batch ~420 at its end")
    ap.add_argument("--weights", choices=["realistic", "dummy"], default="realistic",
                    help="tokens/preempt engines: seeded N(0, 0.02) weights (see realistic_weights) or vLLM's dummy ones")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--gpu-mem", type=float, default=0.85, help="gpu_memory_utilization")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--point-timeout-s", type=float, default=240)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "vllm-gpu-out"))
    args = ap.parse_args()
    args.parts = [p for p in args.parts.split(",") if p]
    args.engines = [e for e in args.engines.split(",") if e]
    args.points = [p for p in args.points.split(",") if p]
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        sys.exit(f"unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="vllm-gpu-run-")
    mdir = model_dir(root)
    RESULTS["args"] = vars(args)
    try:
        import vllm

        RESULTS["vllm"] = vllm.__version__
    except Exception as e:
        record_error("import vllm", e)
    try:
        RESULTS["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError as e:
        RESULTS["device"] = f"unknown ({e})"
    log(f"vLLM {RESULTS['vllm']} on {RESULTS['device']}; parts {args.parts}; engines {args.engines}")
    if "badconfig" in args.parts:
        try:
            part_badconfig(args, root)
        except Exception as e:
            record_error("badconfig", e)
        save(args.out)
    if "tokens" in args.parts or "preempt" in args.parts:
        part_engines(args, root, mdir)
    if "speed" in args.parts:
        part_speed(args, root, mdir)
    save(args.out)
    summary(args)
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
