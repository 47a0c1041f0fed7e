#!/usr/bin/env python3
"""Self-check of the Python shim's shared per-step module (python_shim/kvsparse/step.py) on a GPU.

Drives `StepMeta`, `LayerCall` and `IdBuffer` with torch CUDA tensors the way the vLLM and SGLang backends
do (vLLM's cache layout: K and V as strided halves of one [blocks, block_size, kv_heads, 2*head_dim]
buffer; metadata in persistent buffers refreshed from pinned host memory; every call on the current
stream) and checks, for dense attention and for one policy (--policy, default quest(budget=256)):

  vs-cpu     a prefill step and decode steps, several layers: the CUDA engine's outputs equal the CPU
             engine's (same library, same inputs) within the dtype's tolerance; dense also vs float64.
  no-sync    the decode steps' module calls run under torch.cuda.set_sync_debug_mode("error").
  graph      a decode step of every layer (cache write + attention) captured in torch.cuda.graph and
             replayed on new data three times (sequences growing across a block boundary, new ids):
             each replay equals the same step run eagerly (bit for bit, outputs and caches) and the CPU
             engine within tolerance. A capture fails on any host sync inside the step.
  graph-ws   after an eager call that needs more split-KV workspace than the captured one on the capture
             stream, a replay still equals eager and wrote nothing into memory torch allocated since.
  host-us    host time per layer of the eager decode step's module calls (informational).

Prints one table; exit status 0 only if every check passed. Needs the library (KVSPARSE_LIB, built with
CUDA support; the CUDA kernels compile with NVRTC at first use), the header (include/kvsparse.h, found
from this checkout) and cffi importable. On a machine without a GPU, `--device cpu` runs the same steps
against the float64 reference only (no graphs), as tests/test_step.py does in CI.
"""
import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python_shim"))

from kvsparse import Engine  # noqa: E402
from kvsparse.step import IdBuffer, LayerCall, StepMeta, raw_stream  # noqa: E402

# Relative error ||a-b|| / ||b|| allowed vs float64: the conformance suite's (crates/conformance/src/lib.rs); an
# engine vs the other engine, each within that of float64: twice it.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Model:
    """One engine, per-layer caches (vLLM's layout) and LayerCalls, persistent metadata buffers."""

    def __init__(self, a, device, policy):
        self.a, self.dev = a, torch.device(device)
        self.engine = Engine(num_layers=a.layers, num_q_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                             block_size=a.block_size, dtype=a.dtype, device=device, policy=policy)
        self.raw, self.calls = [], []
        for layer in range(a.layers):
            raw = torch.zeros(a.blocks, a.block_size, a.kv_heads, 2 * a.head_dim, dtype=a.dtype, device=self.dev)
            kv = raw.permute(0, 2, 1, 3)  # vLLM's logical [blocks, kv_heads, block_size, 2*D] view
            kc, vc = kv.transpose(1, 2).split(a.head_dim, dim=-1)
            c = LayerCall(self.engine, layer, scale=a.head_dim ** -0.5)
            c.set_caches(kv, kc, vc)
            self.raw.append(raw)
            self.calls.append(c)
        rows = a.max_rows
        self.table = torch.zeros(rows, a.max_blocks, dtype=torch.int32, device=self.dev)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=self.dev)
        self.qsl = torch.zeros(rows + 1, dtype=torch.int32, device=self.dev)
        self.slots = torch.zeros(a.max_tokens, dtype=torch.int64, device=self.dev)
        self.ids = IdBuffer(self.dev, rows)
        pin = self.dev.type == "cuda"
        self._host = [torch.zeros_like(t, device="cpu").pin_memory() if pin else torch.zeros_like(t, device="cpu")
                      for t in (self.table, self.seq_lens, self.qsl, self.slots)]

    def set_batch(self, b):
        """The serving engine's part: host metadata into the persistent buffers (pinned, non-blocking)."""
        ht, hl, hq, hs = self._host
        n, t = len(b.lens), len(b.slots)
        ht.zero_()
        for s, blocks in enumerate(b.tables):
            ht[s, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        hl[:n] = torch.tensor(b.lens, dtype=torch.int32)
        hq[0] = 0
        hq[1:n + 1] = torch.cumsum(torch.tensor(b.qlens, dtype=torch.int32), 0)
        hs[:t] = torch.tensor(b.slots, dtype=torch.int64)
        for d, h in zip((self.table, self.seq_lens, self.qsl, self.slots), self._host):
            d.copy_(h, non_blocking=True)

    def meta(self, b, max_seq_len=None):
        """The module's per-step work: ids into the IdBuffer, one StepMeta for every layer."""
        ids = self.ids.put(b.ids)
        return StepMeta(self.table, self.seq_lens, self.qsl, ids, num_seqs=len(b.lens), num_tokens=len(b.slots),
                        max_query_len=max(b.qlens), max_seq_len=max(b.lens) if max_seq_len is None else max_seq_len)

    def step(self, meta, q, k, v, out):
        """Every layer: cache write of the step's new K/V, then attention (as the backends call them)."""
        s = raw_stream(self.dev)
        for layer, c in enumerate(self.calls):
            c.write(k[layer], v[layer], self.slots, s, rows=meta.num_tokens)
            c.attend(q[layer], out[layer], meta, s)


class Batch:
    """Host description of one step: per sequence its blocks, length after the step, query length, id."""

    def __init__(self, tables, lens, qlens, ids, block_size):
        self.tables, self.lens, self.qlens, self.ids = tables, lens, qlens, ids
        self.slots = [tables[s][p // block_size] * block_size + p % block_size
                      for s in range(len(lens)) for p in range(lens[s] - qlens[s], lens[s])]


class World:
    """Sequences, their blocks and everything written so far (for the float64 reference)."""

    def __init__(self, a, gen):
        self.a, self.gen = a, gen
        self.free = list(range(1, a.blocks))[::-1]
        self.tables, self.lens, self.ids = [], [], []
        self.keys = [[[] for _ in range(a.layers)] for _ in range(a.seqs)]
        self.vals = [[[] for _ in range(a.layers)] for _ in range(a.seqs)]
        # Each block's keys get their own scale, so a policy's page scores are well apart (CPU and GPU pick
        # the same pages; near-ties would make a comparison of selections meaningless).
        self.block_scale = torch.rand(a.blocks, generator=gen) * 1.5 + 0.25
        for s in range(a.seqs):
            self.tables.append([])
            self.lens.append(0)
            self.ids.append(1000 + s)

    def grow(self, s, n):
        bs = self.a.block_size
        for p in range(self.lens[s], self.lens[s] + n):
            if p % bs == 0:
                self.tables[s].append(self.free.pop())
        self.lens[s] += n

    def batch(self, qlens):
        for s, n in enumerate(qlens):
            self.grow(s, n)
        return Batch([list(t) for t in self.tables], list(self.lens), list(qlens), list(self.ids), self.a.block_size)

    def data(self, b):
        """Random q/k/v for the step's tokens, per layer (float32 on the host), recorded for the reference."""
        a, g = self.a, self.gen
        t = len(b.slots)
        q = [torch.randn(t, a.heads, a.head_dim, generator=g) for _ in range(a.layers)]
        k = [torch.randn(t, a.kv_heads, a.head_dim, generator=g) for _ in range(a.layers)]
        v = [torch.randn(t, a.kv_heads, a.head_dim, generator=g) for _ in range(a.layers)]
        slots = torch.tensor(b.slots)
        for layer in range(a.layers):
            k[layer] *= self.block_scale[slots // a.block_size][:, None, None]
        return q, k, v

    def record(self, b, k, v):
        off = 0
        for s, n in enumerate(b.qlens):
            for layer in range(self.a.layers):
                self.keys[s][layer].append(k[layer][off:off + n].to(self.a.dtype).double())
                self.vals[s][layer].append(v[layer][off:off + n].to(self.a.dtype).double())
            off += n

    def reference(self, b, q, layer, last=16):
        """Float64 causal attention (dense) of the last `last` query rows of each sequence in the step;
        returns (row indices into the step's rows, outputs [rows, heads*dim])."""
        a = self.a
        rows, outs, off = [], [], 0
        g = a.heads // a.kv_heads
        for s, n in enumerate(b.qlens):
            r = min(n, last)
            kk = torch.cat(self.keys[s][layer]).repeat_interleave(g, 1)
            vv = torch.cat(self.vals[s][layer]).repeat_interleave(g, 1)
            qq = q[layer][off + n - r:off + n].to(a.dtype).double()
            logits = torch.einsum("thd,shd->hts", qq, kk) * a.head_dim ** -0.5
            L = kk.shape[0]
            mask = torch.arange(L)[None, :] > torch.arange(L - r, L)[:, None]
            o = torch.einsum("hts,shd->thd", logits.masked_fill(mask[None], -math.inf).softmax(-1), vv)
            outs.append(o.reshape(r, -1))
            rows += range(off + n - r, off + n)
            off += n
        return rows, torch.cat(outs)


def to_dev(xs, a, dev):
    return [x.to(a.dtype).to(dev) for x in xs]


def outputs(a, t, dev):
    return [torch.zeros(t, a.heads * a.head_dim, dtype=a.dtype, device=dev) for _ in range(a.layers)]


class Report:
    def __init__(self):
        self.rows = []

    def add(self, name, ok, detail):
        self.rows.append((name, "PASS" if ok else ("FAIL" if ok is False else "INFO"), detail))
        print(f"[{self.rows[-1][1]}] {name}: {detail}", flush=True)

    def run(self, name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported, the other checks still run
            traceback.print_exc()
            self.add(name, False, f"{type(e).__name__}: {str(e)[:300]}")


def check_policy(a, policy, rep):
    label = policy or "dense"
    gen = torch.Generator().manual_seed(a.seed)
    world = World(a, gen)
    cuda = a.device == "cuda"
    try:
        gpu = Model(a, a.device, policy)
        cpu = Model(a, "cpu", policy) if cuda else None
        dense_gpu = Model(a, a.device, "") if (policy and cuda) else None
    except Exception as e:  # noqa: BLE001 - e.g. the CUDA engine refusing the policy
        traceback.print_exc()
        rep.add(f"{label}: engine", False, f"{type(e).__name__}: {str(e)[:300]}")
        return
    tol_ref = TOL[a.dtype]
    tol = 2 * tol_ref
    models = [m for m in (gpu, cpu, dense_gpu) if m is not None]

    def run_step(qlens, sync_check=False, max_seq_len=None):
        b = world.batch(qlens)
        q, k, v = world.data(b)
        world.record(b, k, v)
        res = {}
        for m in models:
            qd, kd, vd = to_dev(q, a, m.dev), to_dev(k, a, m.dev), to_dev(v, a, m.dev)
            out = outputs(a, len(b.slots), m.dev)
            m.set_batch(b)
            if sync_check and m.dev.type == "cuda":
                torch.cuda.set_sync_debug_mode("error")
                try:
                    meta = m.meta(b, max_seq_len)
                    m.step(meta, qd, kd, vd, out)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            else:
                m.step(m.meta(b, max_seq_len), qd, kd, vd, out)
            res[id(m)] = out
        if cuda:
            torch.cuda.synchronize()
        return b, q, res

    worst = {"cpu": 0.0, "ref": 0.0, "vs_dense": math.inf}

    def compare(b, q, res):
        for layer in range(a.layers):
            g = res[id(gpu)][layer]
            if cpu is not None:
                worst["cpu"] = max(worst["cpu"], rel_err(g, res[id(cpu)][layer]))
            if not policy:
                rows, ref = world.reference(b, q, layer)
                worst["ref"] = max(worst["ref"], rel_err(g[rows], ref))
            elif dense_gpu is not None and layer >= 2:  # layers 0 and 1 run dense by default
                decode = [i for i, n in enumerate(b.qlens) if n == 1]
                if decode:
                    worst["vs_dense"] = min(worst["vs_dense"], rel_err(g, res[id(dense_gpu)][layer]))

    def vs_cpu():
        prompt = [int(x) for x in torch.randint(a.min_len, a.max_len, (a.seqs,), generator=gen)]
        compare(*run_step(prompt))
        for _ in range(a.decode_steps):
            compare(*run_step([1] * a.seqs, sync_check=cuda))
        ok = worst["cpu"] <= tol and (policy or worst["ref"] <= tol_ref)
        detail = f"max rel err vs CPU engine {worst['cpu']:.2e}" if cuda else "no GPU: CPU engine only"
        if not policy:
            detail += f", vs float64 {worst['ref']:.2e} (tol {tol_ref:g})"
        else:
            st = (cpu or gpu).engine.stats()
            sparse = 0 < st["blocks_visited"] < st["blocks_eligible"]
            detail += f"; CPU engine visited {st['blocks_visited']}/{st['blocks_eligible']} blocks"
            if cuda:
                detail += f"; GPU policy vs GPU dense rel diff {worst['vs_dense']:.2e} (> tol: the policy ran)"
            ok = ok and sparse and (not cuda or worst["vs_dense"] > tol)
        rep.add(f"{label}: vs-cpu", ok, detail + f" (tol {tol:g}; {a.layers} layers, prefill + {a.decode_steps} "
                                           f"decode steps of {a.seqs} sequences)")
        if cuda:
            rep.add(f"{label}: no-sync", True, f"{a.decode_steps} decode steps' module calls under "
                                                f"set_sync_debug_mode('error')")

    rep.run(f"{label}: vs-cpu", vs_cpu)
    if not cuda:
        return

    def host_time():
        b = world.batch([1] * a.seqs)
        q, k, v = world.data(b)
        world.record(b, k, v)
        for m in (cpu, dense_gpu):  # keep the others' caches in step (not timed)
            if m is not None:
                m.set_batch(b)
                m.step(m.meta(b), to_dev(q, a, m.dev), to_dev(k, a, m.dev), to_dev(v, a, m.dev),
                       outputs(a, len(b.slots), m.dev))
        gpu.set_batch(b)
        qd, kd, vd = to_dev(q, a, gpu.dev), to_dev(k, a, gpu.dev), to_dev(v, a, gpu.dev)
        out = outputs(a, len(b.slots), gpu.dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        meta = gpu.meta(b)
        t1 = time.perf_counter()
        gpu.step(meta, qd, kd, vd, out)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        rep.add(f"{label}: host-us", None, f"per step {1e6 * (t1 - t0):.1f} us (ids + StepMeta), per layer "
                                           f"{1e6 * (t2 - t1) / a.layers:.1f} us (write + attend, host side)")

    rep.run(f"{label}: host-us", host_time)

    def graph():
        # Everything on one side stream: the capture stream (the engine keeps split-KV workspace per stream).
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            graph_on(s)

    def graph_on(s):
        n = a.seqs
        q_s = [torch.zeros(n, a.heads, a.head_dim, dtype=a.dtype, device=gpu.dev) for _ in range(a.layers)]
        k_s = [torch.zeros(n, a.kv_heads, a.head_dim, dtype=a.dtype, device=gpu.dev) for _ in range(a.layers)]
        v_s = [torch.zeros_like(x) for x in k_s]
        out_s = outputs(a, n, gpu.dev)

        def load(b, q, k, v):
            for dst, src in zip(q_s + k_s + v_s, to_dev(q, a, gpu.dev) + to_dev(k, a, gpu.dev) + to_dev(v, a, gpu.dev)):
                dst.copy_(src)
            gpu.set_batch(b)
            return gpu.meta(b, max_seq_len=0)  # plan for the table's width: valid as sequences grow

        def others(b, q, k, v):
            res = {}
            for m in (cpu, dense_gpu):
                if m is not None:
                    out = outputs(a, n, m.dev)
                    m.set_batch(b)
                    m.step(m.meta(b), to_dev(q, a, m.dev), to_dev(k, a, m.dev), to_dev(v, a, m.dev), out)
                    res[id(m)] = out
            return res

        # Warm-up (eager, a real decode step), then the capture of the same step.
        b = world.batch([1] * n)
        q, k, v = world.data(b)
        world.record(b, k, v)
        meta = load(b, q, k, v)
        gpu.step(meta, q_s, k_s, v_s, out_s)
        others(b, q, k, v)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            gpu.step(meta, q_s, k_s, v_s, out_s)

        def replay_round(new_ids, guard=None):
            b = world.batch([1] * n)
            if new_ids:  # new sequence ids through the IdBuffer (same address, new contents)
                world.ids = [i + 7 for i in world.ids]
                b.ids = list(world.ids)
            q, k, v = world.data(b)
            world.record(b, k, v)
            load(b, q, k, v)
            before = [r.clone() for r in gpu.raw]
            g.replay()
            torch.cuda.synchronize()
            got = [o.clone() for o in out_s]
            caches = [r.clone() for r in gpu.raw]
            for r, c in zip(gpu.raw, before):
                r.copy_(c)
            gpu.step(meta, q_s, k_s, v_s, out_s)  # the captured step's own StepMeta, run eagerly
            torch.cuda.synchronize()
            same = all(torch.equal(x, y) for x, y in zip(got, out_s)) and all(
                torch.equal(x, y) for x, y in zip(caches, gpu.raw))
            res = others(b, q, k, v)
            err = max(rel_err(got[layer], res[id(cpu)][layer]) for layer in range(a.layers))
            clean = guard is None or guard()
            return same, err, clean, max(b.lens)

        rounds = [replay_round(i == 1) for i in range(3)]
        ok = all(r[0] and r[1] <= tol for r in rounds)
        rep.add(f"{label}: graph", ok, "; ".join(f"replay {i}: {'==' if r[0] else '!='} eager, vs CPU {r[1]:.2e}, "
                                                 f"max len {r[3]}" for i, r in enumerate(rounds)))

        # An eager call on the capture stream needing more split-KV workspace than the captured step, then
        # memory torch allocates afterwards: a replay must equal eager and leave that memory alone.
        big = a.max_rows
        bb = Batch([world.tables[i % n] for i in range(big)], [world.lens[i % n] for i in range(big)], [1] * big,
                   [5000 + i for i in range(big)], a.block_size)
        qb = torch.randn(big, a.heads, a.head_dim, generator=gen).to(a.dtype).to(gpu.dev)
        ob = torch.zeros(big, a.heads * a.head_dim, dtype=a.dtype, device=gpu.dev)
        gpu.set_batch(bb)
        mb = gpu.meta(bb, max_seq_len=0)
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        gpu.calls[-1].attend(qb, ob, mb, raw_stream(gpu.dev))
        torch.cuda.synchronize()
        grew = free0 - torch.cuda.mem_get_info()[0]
        for sid in bb.ids:
            gpu.engine.release(sid, missing_ok=True)
        junk = [torch.full((1 << 20,), 7.0, device=gpu.dev) for _ in range(64)]
        torch.cuda.synchronize()
        same, err, clean, _ = replay_round(False, guard=lambda: all(bool((j == 7.0).all()) for j in junk))
        exercised = grew > 0
        rep.add(f"{label}: graph-ws", (same and err <= tol and clean) if exercised else None,
                f"{big}-row eager call took {grew / 2**20:.1f} MiB more device memory"
                f"{'' if exercised else ' (no workspace growth: not exercised)'}; replay "
                f"{'==' if same else '!='} eager, vs CPU {err:.2e}, memory allocated afterwards "
                f"{'untouched' if clean else 'OVERWRITTEN by the replay'}")

    rep.run(f"{label}: graph", graph)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="quest(budget=256)", help="policy to check besides dense ('' = none)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=6)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=600)
    ap.add_argument("--max-len", type=int, default=3000)
    ap.add_argument("--decode-steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.dtype = DTYPES[a.dtype]
    a.max_rows = 8 * a.seqs
    a.max_blocks = (a.max_len + a.decode_steps + 16) // a.block_size + 2
    a.blocks = a.seqs * a.max_blocks + 8
    a.max_tokens = max(a.seqs * a.max_len, a.max_rows)
    if a.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device visible to torch", file=sys.stderr)
            return 2
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, library "
              f"{os.environ.get('KVSPARSE_LIB', '(default path)')}", flush=True)
    rep = Report()
    for policy in [""] + ([a.policy] if a.policy else []):
        check_policy(a, policy, rep)
    print("\n==== gpu_shim_check summary ====")
    w = max(len(r[0]) for r in rep.rows)
    for name, res, detail in rep.rows:
        print(f"{name:<{w}}  {res:<4}  {detail}")
    failed = [r for r in rep.rows if r[1] == "FAIL"]
    print(f"{'ALL PASSED' if not failed else f'{len(failed)} FAILED'} ({len(rep.rows)} rows)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
