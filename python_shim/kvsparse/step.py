"""The per-step work both engine backends share (vLLM's and SGLang's); it imports neither, so it runs, and
is checked (scripts/gpu_shim_check.py), where neither is installed.

One step of a serving engine is: the batch's metadata (block table, sequence lengths, query offsets,
sequence ids) on the engine's device, then per layer one `kvs_cache_write` and one `kvs_attention_forward`.
Here the Python work is cut to what changes:
- `StepMeta`: the step's metadata as descriptors, built once per step and shared by every layer's calls.
- `LayerCall`: one layer's argument structs and descriptors, built once; a call re-points the query, output,
  key and value descriptors (data pointer, row count) and the step's metadata, then calls C. The caches'
  descriptors are rebuilt only when the layer's cache tensor changes.
- `IdBuffer`: sequence ids in one persistent tensor on the engine's device, copied from pinned host memory
  on the current stream only when they change, so a CUDA graph captured over it reads the current ids at
  every replay.
Everything goes to the caller's current CUDA stream; nothing here reads a device tensor on the host.
"""
import torch

from ._ffi import ffi, lib
from .dlpack import Desc
from .engine import KvsError
from .streams import raw_stream  # noqa: F401  (re-exported: the backends import it from here)



def _word(struct_type: str, field: str) -> int:
    off = ffi.offsetof(struct_type, field)
    assert off % 8 == 0
    return off // 8


_FWD_STREAM = _word("kvs_forward_args", "stream")
_CW_STREAM = _word("kvs_cache_write_args", "stream")


class StepMeta:
    """One step's batch description for every layer: descriptors of the block table `[seqs, blocks]` int32,
    `seq_lens [seqs]` int32, `query_start_loc [seqs+1]` int32 and `seq_ids [seqs]` int64 (or None), plus
    the query row count and the host-known maxima (0 = unknown: the CUDA engine then plans for the block
    table's whole width, which is what a captured graph needs to stay valid for longer sequences).
    With `num_seqs`, the tensors may hold more rows (persistent buffers): their first rows are described."""

    __slots__ = ("block_table", "seq_lens", "query_start_loc", "seq_ids", "num_tokens", "max_query_len",
                 "max_seq_len", "_descs")

    def __init__(self, block_table, seq_lens, query_start_loc, seq_ids=None, *, num_tokens, num_seqs=None,
                 max_query_len=0, max_seq_len=0, reuse=None):
        # The Desc objects own the DLTensors' shape arrays and keep the tensors alive while this step is used.
        # `reuse`: a StepMeta no longer in use whose descriptors are re-pointed (persistent buffers: cheap).
        n = num_seqs
        d = self._descs = reuse._descs if reuse is not None else (Desc(), Desc(), Desc(), Desc())
        self.block_table = d[0].set(block_table, n)
        self.seq_lens = d[1].set(seq_lens, n)
        self.query_start_loc = d[2].set(query_start_loc, None if n is None else n + 1)
        self.seq_ids = ffi.NULL if seq_ids is None else d[3].set(seq_ids, n)
        self.num_tokens = int(num_tokens)
        self.max_query_len = int(max_query_len)
        self.max_seq_len = int(max_seq_len)


class LayerCall:
    """Cache writes and attention of one layer through one engine, with descriptors built once.

    The descriptors of what changes per call (query, output, key, value, slot mapping) are shared by all of
    an engine's LayerCalls, so a step's slot mapping is described once for all layers: an engine's layer
    calls must come from one thread at a time (as vLLM and SGLang make them)."""

    def __init__(self, engine, layer, *, scale, sliding_window=0, softcap=0.0):
        self._h = engine._h
        self.layer = layer
        self._q_tail = (engine.num_q_heads, engine.head_dim)
        self._kv_tail = (engine.num_kv_heads, engine.head_dim)
        shared = getattr(engine, "_call_descs", None)
        if shared is None:
            shared = engine._call_descs = (Desc(), Desc(), Desc(), Desc(), Desc())
        self._q, self._o, self._k, self._v, self._slots = shared
        self._kc, self._vc = Desc(), Desc()
        self.cache_src = None  # what the caller built the cache views from (compared by identity)

        fa = self._fa = ffi.new("kvs_forward_args *")
        fa.struct_size = ffi.sizeof("kvs_forward_args")
        fa.layer = layer
        fa.scale, fa.sliding_window, fa.softcap = float(scale), int(sliding_window), float(softcap)
        fa.lse, fa.call_stats = ffi.NULL, ffi.NULL
        wa = self._wa = ffi.new("kvs_cache_write_args *")
        wa.struct_size = ffi.sizeof("kvs_cache_write_args")
        wa.layer = layer
        # The descriptors stay where they are (their contents change), so the structs point at them once.
        fa.query, fa.out = self._q.ptr, self._o.ptr
        wa.key, wa.value, wa.slot_mapping = self._k.ptr, self._v.ptr, self._slots.ptr
        # Streams are written as 64-bit words: ffi.cast to void* per call costs more than the rest.
        self._fa_words = ffi.cast("uint64_t *", fa)
        self._wa_words = ffi.cast("uint64_t *", wa)

    def set_caches(self, src, key_cache, value_cache):
        """The layer's `[blocks, block_size, kv_heads, head_dim]` caches (strided views), made from `src`."""
        self._fa.key_cache = self._wa.key_cache = self._kc.set(key_cache)
        self._fa.value_cache = self._wa.value_cache = self._vc.set(value_cache)
        self.cache_src = src

    def write(self, key, value, slot_mapping, stream=0, rows=None):
        """New K/V rows (`[rows, kv_heads, head_dim]` or `[rows, kv_heads*head_dim]`) into the caches at
        `slot_mapping[:rows]` (default: all of it; int64 or int32, negative = skip)."""
        slots = self._slots
        slots.set(slot_mapping, rows)
        self._k.set(key, slots.rows, self._kv_tail)
        self._v.set(value, slots.rows, self._kv_tail)
        self._wa_words[_CW_STREAM] = stream
        st = lib.kvs_cache_write(self._h, self._wa)
        if st:
            raise KvsError(st, "cache_write")

    def attend(self, query, out, meta, stream=0):
        """Attention of the step's `meta.num_tokens` query rows (`[rows, heads, dim]` or
        `[rows, heads*dim]`, a prefix of `query`/`out` when they hold padding rows) into `out`."""
        fa = self._fa
        n = meta.num_tokens
        self._q.set(query, n, self._q_tail)
        self._o.set(out, n, self._q_tail)
        fa.block_table = meta.block_table
        fa.seq_lens = meta.seq_lens
        fa.query_start_loc = meta.query_start_loc
        fa.seq_ids = meta.seq_ids
        fa.max_query_len = meta.max_query_len
        fa.max_seq_len = meta.max_seq_len
        self._fa_words[_FWD_STREAM] = stream
        st = lib.kvs_attention_forward(self._h, fa)
        if st:
            raise KvsError(st, "attention_forward")


class IdBuffer:
    """The step's sequence ids in one persistent int64 tensor on `device` (`capacity` rows).

    `put(ids)` returns `tensor[:len(ids)]` holding them. On CUDA the ids go through a ring of pinned host
    rows and a non-blocking copy on the current stream; a ring row is rewritten only after the copy that last
    read it has run (its event; in steady serving that copy ran steps ago, so the wait is free). Unchanged ids
    (a steady decode batch) cost no copy at all."""

    RING = 4

    def __init__(self, device, capacity):
        self.device = torch.device(device)
        self.capacity = int(capacity)
        self.tensor = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._host = torch.zeros(self.RING, self.capacity, dtype=torch.int64, pin_memory=True)
            self._events = [None] * self.RING
            self._slot = 0
        self._last = None

    def put(self, ids):
        n = len(ids)
        if n > self.capacity:
            raise ValueError(f"kvsparse: {n} sequences in one step, more than the {self.capacity} the id buffer "
                             "holds (its address must not change under CUDA graphs)")
        if ids != self._last:
            src = torch.tensor(ids, dtype=torch.int64)
            if self._cuda:
                i = self._slot
                self._slot = (i + 1) % self.RING
                ev = self._events[i]
                if ev is not None and not ev.query():  # only when the GPU is RING steps behind
                    ev.synchronize()
                host = self._host[i, :n]
                host.copy_(src)
                self.tensor[:n].copy_(host, non_blocking=True)
                ev = self._events[i] = torch.cuda.Event()
                ev.record()
            else:
                self.tensor[:n].copy_(src)
            self._last = list(ids)
        return self.tensor[:n]
