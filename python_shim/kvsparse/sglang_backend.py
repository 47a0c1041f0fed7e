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
(`sglang_meta.gather_block_table`). New K/V are written with `kvs_cache_write` (not the pool's
`set_kv_buffer`), so the policies' key metadata stays in step with the cache.

Per step, `init_forward_metadata_out_graph` builds the metadata on the device from SGLang's device tensors
with torch ops only (lengths and widths from SGLang's host mirrors `seq_lens_cpu` / `extend_seq_lens_cpu`),
so nothing waits for the GPU; per layer, one `kvs_cache_write` and one `kvs_attention_forward` go through a
`step.LayerCall` on the current stream.

Sequence ids: a request holds its `req_to_token` pool row from its first chunk until it finishes or is
retracted, and the pool hands the row out again only after `free_rows`. kvsparse's id is the pool row
(`req_pool_indices`, used as the ids tensor as it is: no host work, capturable); the backend wraps
`free_rows` on its pool instance and releases a freed row's state there, so the next request on that row
starts fresh. A pool without `free_rows` is refused (its requests' ends would be invisible).

CUDA graphs (decode): `init_cuda_graph_state` allocates persistent metadata (block table of the pool's full
width, lengths, ids, query offsets) and per-layer output buffers; decode batches up to the captured size
fill them in place, and the capture plans for the block table's whole width (max_seq_len = 0), so a replay
is valid for any length the pool holds.
"""
import os

import torch

from .engine import Engine, KvsUnsupported, with_max_seqs
from .sglang_meta import check_page_aligned, gather_block_table
from .step import LayerCall, StepMeta, raw_stream

try:  # the real base class when SGLang is importable, so SGLang sees a proper AttentionBackend
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend as _Base
except Exception:  # pragma: no cover - exercised where SGLang is not installed
    _Base = object

NAME = "kvsparse"


def _hook_free_rows(pool, release):
    """Wraps this pool instance's `free_rows` so a finished (or retracted) request's state goes at once."""
    orig = getattr(pool, "free_rows", None)
    if orig is None:
        return False
    if getattr(orig, "_kvsparse_hooked", False):
        return True

    def free_rows(indices, *a, **kw):
        for r in indices:
            release(int(r))
        return orig(indices, *a, **kw)

    free_rows._kvsparse_hooked = True
    pool.free_rows = free_rows
    return True


class KvSparseSGLangBackend(_Base):
    """SGLang `AttentionBackend`: metadata (eager and CUDA-graph), forward_extend / forward_decode via kvsparse."""

    def __init__(self, model_runner, policy=None, num_threads=None):
        if _Base is not object:
            super().__init__()
        self.device = torch.device(model_runner.device)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = int(model_runner.page_size)
        mc = model_runner.model_config
        tp = int(getattr(model_runner, "tp_size", 1) or 1)
        self.num_q_heads = mc.num_attention_heads // tp
        num_kv_heads = mc.get_num_kv_heads(tp)
        self.head_dim = mc.head_dim
        self.num_layers = mc.num_hidden_layers
        store = getattr(self.token_to_kv_pool, "store_dtype", None) or self.token_to_kv_pool.dtype
        if store not in (torch.float32, torch.float16, torch.bfloat16) or self.token_to_kv_pool.dtype != store:
            raise KvsUnsupported(f"KV cache dtype {self.token_to_kv_pool.dtype} (stored as {store}) is not "
                                 "supported (float32, float16, bfloat16)")
        self.engine = Engine(
            num_layers=mc.num_hidden_layers, num_q_heads=self.num_q_heads, num_kv_heads=num_kv_heads,
            head_dim=mc.head_dim, block_size=self.page_size, dtype=store,
            device="cpu" if self.device.type == "cpu" else "cuda",
            # Per-sequence state for every row of the req_to_token pool (the ids are its rows), unless the spec says.
            policy=with_max_seqs(os.environ.get("KVSPARSE_POLICY", "") if policy is None else policy,
                                 self.req_to_token_pool.req_to_token.shape[0]),
            num_threads=int(os.environ.get("KVSPARSE_NUM_THREADS", "0")) if num_threads is None else num_threads,
            # SGLang's CUDA graphs pad a decode batch to a captured size (rows past query_start_loc's end).
            padded_batches=True)
        self.released_rows = 0
        if not _hook_free_rows(self.req_to_token_pool, self._release_row):
            raise NotImplementedError("kvsparse/sglang: the req_to_token pool has no free_rows, so the end of a "
                                      "request cannot be seen and its policy state could not be released")
        # Checks that read metadata values on the host run only where that costs no device sync.
        self.host_checks = self.device.type == "cpu"
        self.forward_metadata = None
        self._calls = {}  # layer_id -> LayerCall
        self._graph = None  # persistent buffers, from init_cuda_graph_state

    def _release_row(self, row):
        if self.engine.release(row, missing_ok=True):
            self.released_rows += 1

    # -- metadata -----------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch):
        self.init_forward_metadata_out_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        dev, P = self.device, self.page_size
        pages = -(-self.req_to_token_pool.req_to_token.shape[1] // P)
        self._graph = dict(
            max_bs=int(max_bs),
            table=torch.zeros(max_bs, pages, dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            ids=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            qsl=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            out=[torch.empty(max_bs, self.num_q_heads * self.head_dim, dtype=self.engine.dtype, device=dev)
                 for _ in range(self.num_layers)])

    def init_forward_metadata_in_graph(self, forward_batch):
        pass  # everything is prepared outside the graph, into persistent buffers

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        fb = forward_batch
        mode = fb.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        decode = mode.is_decode()
        if not decode and not (mode.is_extend() or mode.is_mixed()):
            raise NotImplementedError(f"kvsparse/sglang: forward mode {mode} is not supported")
        P = self.page_size
        rows = fb.req_pool_indices
        bs = rows.shape[0]
        lens_host = getattr(fb, "seq_lens_cpu", None)
        max_seq = int(lens_host.max()) if lens_host is not None and bs else 0
        pages = -(-max_seq // P) if lens_host is not None else self.req_to_token_pool.req_to_token.shape[1]
        ids = rows if rows.dtype == torch.int64 else rows.to(torch.int64)
        g = self._graph
        if decode and g is not None and bs <= g["max_bs"]:
            # Persistent buffers (a captured graph reads these addresses): refreshed in place.
            table = gather_block_table(self.req_to_token_pool.req_to_token, rows, pages, P, out=g["table"])
            seq_lens = g["seq_lens"]
            seq_lens[:bs].copy_(fb.seq_lens)
            g["ids"][:bs].copy_(ids)
            ids, qsl = g["ids"], g["qsl"]
            num_tokens, max_q = bs, 1
        else:
            table = gather_block_table(self.req_to_token_pool.req_to_token, rows, pages, P)
            seq_lens = fb.seq_lens.to(torch.int32)
            if decode:
                qsl = torch.arange(bs + 1, dtype=torch.int32, device=rows.device)
                num_tokens, max_q = bs, 1
            else:
                ext_host = fb.extend_seq_lens_cpu
                qsl = torch.zeros(bs + 1, dtype=torch.int32, device=rows.device)
                torch.cumsum(fb.extend_seq_lens, 0, dtype=torch.int32, out=qsl[1:])
                num_tokens, max_q = int(sum(ext_host)), int(max(ext_host)) if bs else 0
        if self.host_checks:
            check_page_aligned(self.req_to_token_pool.req_to_token, rows.to(torch.int64), fb.seq_lens, P)
        self.forward_metadata = StepMeta(table, seq_lens, qsl, ids, num_seqs=bs, num_tokens=num_tokens,
                                         max_query_len=max_q, max_seq_len=0 if in_capture else max_seq)

    # -- forward ------------------------------------------------------------------------------------
    def _layer_call(self, layer):
        lid = layer.layer_id
        c = self._calls.get(lid)
        if c is None:
            at = getattr(layer, "attn_type", None)
            if layer.is_cross_attention or (at is not None and getattr(at, "name", str(at)) != "DECODER"):
                raise NotImplementedError("kvsparse/sglang: causal decoder self-attention only")
            if layer.qk_head_dim != layer.v_head_dim:
                raise NotImplementedError("kvsparse/sglang: qk_head_dim != v_head_dim is not supported")
            sw = getattr(layer, "sliding_window_size", -1)
            c = self._calls[lid] = LayerCall(
                self.engine, lid, scale=float(layer.scaling),
                # SGLang: key k is visible to query q when q - sw <= k <= q, i.e. sw + 1 keys.
                sliding_window=(int(sw) + 1) if sw is not None and sw > -1 else 0,
                softcap=float(layer.logit_cap or 0.0))
        kb = self.token_to_kv_pool.get_key_buffer(lid)
        if c.cache_src is not kb:
            P = self.page_size
            vb = self.token_to_kv_pool.get_value_buffer(lid)
            n = (kb.shape[0] // P) * P
            c.set_caches(kb, kb[:n].view(n // P, P, kb.shape[1], kb.shape[2]),
                         vb[:n].view(n // P, P, vb.shape[1], vb.shape[2]))
        return c

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache):
        c = self._layer_call(layer)
        m = self.forward_metadata
        stream = raw_stream(self.device)
        if save_kv_cache and k is not None and v is not None:
            c.write(k, v, forward_batch.out_cache_loc, stream)
        g = self._graph
        if g is not None and m.num_tokens <= g["max_bs"] and forward_batch.forward_mode.is_decode():
            o = g["out"][layer.layer_id][: q.shape[0]]  # the layer's persistent decode output
        else:
            o = q.new_empty(q.shape[0], self.num_q_heads * self.head_dim)
        c.attend(q, o, m, stream)
        return o

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
