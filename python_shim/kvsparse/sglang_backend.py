"""SGLang attention backend running extend (prefill, chunked prefill, prefix-cache hits) and decode
through kvsparse, registered in SGLang's attention backend registry.

Registration: the entry point `kvsparse = "kvsparse.sglang_backend:register"` in the `sglang.srt.plugins`
group (SGLang's general plugins, loaded in every SGLang process) calls `register()`, which adds
"kvsparse" to `--attention-backend`'s choices and registers a factory with
`sglang.srt.layers.attention.attention_registry.register_attention_backend("kvsparse")`.
Select it with `--attention-backend kvsparse`; the policy comes from `$KVSPARSE_POLICY` (dense if unset).

KV cache: SGLang's MHA pool keeps one `[rows, kv_heads, head_dim]` buffer per layer for K and one for V,
row = page * page_size + offset. kvsparse sees it as `[rows // page_size, page_size, kv_heads, head_dim]`
(a view, no copy) with block size = page size; the block table comes from `req_to_token`
(`sglang_meta.translate`). New K/V are written with `kvs_cache_write` (not the pool's `set_kv_buffer`),
so the policies' key metadata stays in step with the cache.

Sequence ids: SGLang's batch names each row's pool row (`req_pool_indices`). A request holds its row
from its first chunk until it finishes or is retracted; the pool bumps `req_generation[row]` on every
allocation. kvsparse's id is therefore keyed by (row, generation): stable across chunks and decode
steps, new for a retracted-and-resumed request (its KV is recomputed). State is released when the pool
frees the row (`free_rows` is wrapped on the backend's pool instance) or, for pools without that hook,
when the row shows up with a new generation.
"""
import itertools
import os
import threading

import torch

from .engine import Engine, KvsUnsupported
from .sglang_meta import translate

try:  # the real base class when SGLang is importable, so SGLang sees a proper AttentionBackend
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as _Base
except Exception:  # pragma: no cover - exercised where SGLang is not installed
    _Base = object

NAME = "kvsparse"
_EPHEMERAL_BASE = 1 << 62


class PoolRowIds:
    """Stable 64-bit sequence ids keyed by (req_to_token pool row, allocation generation)."""

    def __init__(self, release_fn, generation=None):
        self._lock = threading.Lock()
        self._next = itertools.count(1)
        self._rows = {}  # row -> (generation, seq id)
        self._registered = set()
        self._ephemeral = set()
        self._generation = generation  # tensor [rows] int64 or None
        self.release_fn = release_fn
        self.created = 0
        self.released = 0

    def _release_locked(self, sid):
        if sid in self._registered:
            self._registered.discard(sid)
            self.released += 1
            self.release_fn(sid)

    def ids(self, rows):
        with self._lock:
            for sid in list(self._ephemeral):
                self._release_locked(sid)
            self._ephemeral.clear()
            out = []
            for r in rows:
                gen = int(self._generation[r]) if self._generation is not None else 0
                ent = self._rows.get(r)
                if ent is not None and ent[0] != gen:  # the row was freed and handed to another request
                    self._release_locked(ent[1])
                    ent = None
                if ent is None:
                    ent = self._rows[r] = (gen, next(self._next))
                out.append(ent[1])
            return out

    def ephemeral(self, n):
        """Ids for rows without a pool row (dummy/warm-up batches), released at the next batch."""
        with self._lock:
            ids = [_EPHEMERAL_BASE + i for i in range(n)]
            self._ephemeral.update(ids)
            return ids

    def mark_registered(self, ids):
        with self._lock:
            for sid in ids:
                if sid not in self._registered:
                    self._registered.add(sid)
                    self.created += 1

    def rows_freed(self, rows):
        with self._lock:
            for r in rows:
                ent = self._rows.pop(int(r), None)
                if ent is not None:
                    self._release_locked(ent[1])

    def live(self):
        with self._lock:
            return len(self._registered)


def _hook_free_rows(pool, tracker):
    """Wraps this pool instance's `free_rows` so a finished (or retracted) request's state goes at once."""
    orig = getattr(pool, "free_rows", None)
    if orig is None or getattr(orig, "_kvsparse_hooked", False):
        return False

    def free_rows(indices, *a, **kw):
        tracker.rows_freed(list(indices))
        return orig(indices, *a, **kw)

    free_rows._kvsparse_hooked = True
    pool.free_rows = free_rows
    return True


class KvSparseSGLangBackend(_Base):
    """SGLang `AttentionBackend`: init_forward_metadata / forward_extend / forward_decode via kvsparse."""

    def __init__(self, model_runner, policy=None, num_threads=None):
        if _Base is not object:
            super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = int(model_runner.page_size)
        mc = model_runner.model_config
        tp = int(getattr(model_runner, "tp_size", 1) or 1)
        num_q_heads = mc.num_attention_heads // tp
        num_kv_heads = mc.get_num_kv_heads(tp)
        store = getattr(self.token_to_kv_pool, "store_dtype", None) or self.token_to_kv_pool.dtype
        if store not in (torch.float32, torch.float16, torch.bfloat16) or self.token_to_kv_pool.dtype != store:
            raise KvsUnsupported(f"KV cache dtype {self.token_to_kv_pool.dtype} (stored as {store}) is not "
                                 "supported (float32, float16, bfloat16)")
        self.engine = Engine(
            num_layers=mc.num_hidden_layers, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            head_dim=mc.head_dim, block_size=self.page_size, dtype=store,
            device="cpu" if torch.device(self.device).type == "cpu" else "cuda",
            policy=os.environ.get("KVSPARSE_POLICY", "") if policy is None else policy,
            num_threads=int(os.environ.get("KVSPARSE_NUM_THREADS", "0")) if num_threads is None else num_threads)
        self.seq_ids = PoolRowIds(self.engine.release, getattr(self.req_to_token_pool, "req_generation", None))
        self.frees_hooked = _hook_free_rows(self.req_to_token_pool, self.seq_ids)
        self.forward_metadata = None

    # -- metadata -----------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch):
        fb = forward_batch
        mode = fb.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if mode.is_decode():
            ext = None
        elif mode.is_extend() or mode.is_mixed():
            ext = fb.extend_seq_lens
        else:
            raise NotImplementedError(f"kvsparse/sglang: forward mode {mode} is not supported")
        rows = fb.req_pool_indices
        m = translate(rows.cpu(), fb.seq_lens.cpu(), None if ext is None else ext.cpu(),
                      self.req_to_token_pool.req_to_token, self.page_size)
        rows_l = [int(r) for r in rows.tolist()]
        ids = self.seq_ids.ids(rows_l) if getattr(fb, "rids", True) is not None else self.seq_ids.ephemeral(len(rows_l))
        m["seq_ids"] = torch.tensor(ids, dtype=torch.int64)
        m["max_query_len"] = int((m["query_start_loc"][1:] - m["query_start_loc"][:-1]).max()) if rows_l else 0
        m["max_seq_len"] = int(m["seq_lens"].max()) if rows_l else 0
        m["registered"] = False
        self.forward_metadata = m

    # -- forward ------------------------------------------------------------------------------------
    def _caches(self, layer):
        P = self.page_size
        kb = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        vb = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        n = (kb.shape[0] // P) * P
        return (kb[:n].view(n // P, P, kb.shape[1], kb.shape[2]),
                vb[:n].view(n // P, P, vb.shape[1], vb.shape[2]))

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache):
        at = getattr(layer, "attn_type", None)
        if layer.is_cross_attention or (at is not None and getattr(at, "name", str(at)) != "DECODER"):
            raise NotImplementedError("kvsparse/sglang: causal decoder self-attention only")
        if layer.qk_head_dim != layer.v_head_dim:
            raise NotImplementedError("kvsparse/sglang: qk_head_dim != v_head_dim is not supported")
        m = self.forward_metadata
        H, KH, D = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        kc, vc = self._caches(layer)
        if save_kv_cache and k is not None and v is not None:
            loc = forward_batch.out_cache_loc.to(torch.int64)
            self.engine.cache_write(layer.layer_id, k.reshape(-1, KH, D), v.reshape(-1, KH, D), kc, vc, loc)
        q3 = q.reshape(-1, H, D)
        o = q3.new_empty(q3.shape)
        sw = getattr(layer, "sliding_window_size", -1)
        self.engine.forward(
            layer.layer_id, q3, kc, vc, m["block_table"], m["seq_lens"], m["query_start_loc"], o,
            seq_ids=m["seq_ids"], scale=float(layer.scaling),
            # SGLang: key k is visible to query q when q - sw <= k <= q, i.e. sw + 1 keys.
            sliding_window=(int(sw) + 1) if sw is not None and sw > -1 else 0,
            softcap=float(layer.logit_cap or 0.0),
            max_query_len=m["max_query_len"], max_seq_len=m["max_seq_len"])
        if not m["registered"]:
            m["registered"] = True
            self.seq_ids.mark_registered(m["seq_ids"].tolist())
        return o.view(-1, H * D)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        # The base class's dispatcher routes mixed batches to forward_mixed on NPU only; kvsparse serves
        # every non-idle mode with one varlen call.
        if forward_batch.forward_mode.is_idle():
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def support_triton(self):
        return False

    def get_cuda_graph_seq_len_fill_value(self):
        return 1


def create_kvsparse_backend(runner):
    return KvSparseSGLangBackend(runner)


def register():
    """SGLang general-plugin entry point: `--attention-backend kvsparse`."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    try:
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

        if NAME not in ATTENTION_BACKEND_CHOICES:
            add_attention_backend_choices([NAME])
    except ImportError:  # older layouts keep the choices in server_args
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

        if NAME not in ATTENTION_BACKEND_CHOICES:
            ATTENTION_BACKEND_CHOICES.append(NAME)
    register_attention_backend(NAME)(create_kvsparse_backend)
