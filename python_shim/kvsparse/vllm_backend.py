"""vLLM attention backend running prefill, chunked prefill and decode through kvsparse.

KV cache: vLLM 0.32 allocates each layer's cache as a logical [blocks, kv_heads,
block_size, 2*head_size] view in a layout the backend accepts; we accept the
token-major LBNHC (flash's layout) and LBHNC, and pass K and V to kvsparse as the
two strided halves of `kv_cache.transpose(1, 2)` ([blocks, block_size, kv_heads,
head_size] each), with no copy. One kvsparse engine per process serves all layers.
"""

import os
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from .engine import Engine, KvsError, KvsUnsupported
from .seq_ids import TRACKER

from vllm.logger import init_logger

log = init_logger("vllm.kvsparse")  # under vLLM's logger config, so INFO lines show
LOG_EVERY = int(os.environ.get("KVSPARSE_LOG_EVERY", "64"))

_engine_lock = threading.Lock()
_ENGINE = None


def policy_from_config(vllm_config) -> str:
    """additional_config {"kvsparse": {"policy": ...}} first, then $KVSPARSE_POLICY, else dense."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    spec = (extra.get("kvsparse") or {}).get("policy") if isinstance(extra, dict) else None
    if spec is None:
        spec = os.environ.get("KVSPARSE_POLICY", "")
    return spec


def get_engine(vllm_config=None, num_q_heads=None, num_kv_heads=None, head_dim=None):
    """The process's engine, created on first use from the vLLM config (errors are kvsparse's)."""
    global _ENGINE
    with _engine_lock:
        if _ENGINE is None:
            if vllm_config is None:
                return None
            mc, pc = vllm_config.model_config, vllm_config.parallel_config
            cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
            if str(cache_dtype) not in ("auto", "None"):
                # The C config has no quantized-cache dtype; refuse it here, at engine start.
                raise KvsUnsupported(f"kv_cache_dtype {cache_dtype!r} is not supported (kvsparse keeps K/V in "
                                     f"the model dtype: float32, float16 or bfloat16; use kv_cache_dtype='auto')")
            _ENGINE = Engine(
                num_layers=mc.get_num_layers(pc),
                num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_size=vllm_config.cache_config.block_size,
                dtype=mc.dtype,
                device="cpu" if vllm_config.device_config.device.type == "cpu" else "cuda",
                policy=policy_from_config(vllm_config),
                num_threads=int(os.environ.get("KVSPARSE_NUM_THREADS", "0")),
            )
            TRACKER.release_fn = _ENGINE.release
            log.info("kvsparse engine: %d layers, %d/%d heads, head_dim %d, block %d, %s, policy %r",
                     mc.get_num_layers(pc), num_q_heads, num_kv_heads, head_dim,
                     vllm_config.cache_config.block_size, mc.dtype, _ENGINE.policy or "dense")
        return _ENGINE


def log_stats(engine):
    s = engine.stats()
    log.info("kvsparse stats: policy %r calls %d prefill_tokens %d decode_rows %d policy_rows %d "
             "blocks visited/eligible %d/%d skipped_termination %d kv_bytes_read %d sequences live %d created %d "
             "released %d",
             engine.policy or "dense", s["calls"], s["prefill_tokens"], s["decode_rows"], s["policy_rows"],
             s["blocks_visited"], s["blocks_eligible"], s["blocks_skipped_termination"], s["kv_bytes_read"],
             s["live_sequences"], s["sequences_created"], s["sequences_released"])
    return s


class KvSparseBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @staticmethod
    def get_impl_cls():
        return KvSparseImpl

    @staticmethod
    def get_builder_cls():
        return KvSparseMetadataBuilder


@dataclass
class KvSparseMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs+1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    seq_ids: torch.Tensor  # [num_reqs] int64, stable per request (seq_ids.py)
    registered: bool = False


class KvSparseMetadataBuilder(AttentionMetadataBuilder[KvSparseMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._builds = 0

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvSparseMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise NotImplementedError("kvsparse serves causal decoder attention only")
        n = m.num_reqs
        ids = TRACKER.ids_for_batch(n)
        self._builds += 1
        eng = get_engine()
        if eng is not None and LOG_EVERY > 0 and self._builds % LOG_EVERY == 0:
            log_stats(eng)
        return KvSparseMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc[: n + 1].to(torch.int32),
            seq_lens=m.seq_lens[:n].to(torch.int32),
            block_table=m.block_table_tensor[:n].to(torch.int32),
            slot_mapping=m.slot_mapping,
            seq_ids=torch.tensor(ids, dtype=torch.int64),
        )


def _layer_index(layer) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer.layer_name)


class KvSparseImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None):
        if alibi_slopes is not None or sinks is not None:
            raise NotImplementedError("kvsparse: ALiBi and attention sinks are not supported")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"kvsparse: attention type {attn_type} is not supported")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.sliding_window = int(sliding_window or 0)
        self.softcap = float(logits_soft_cap or 0.0)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.engine = get_engine(get_current_vllm_config(), num_heads, num_kv_heads, head_size)
        if (num_heads, num_kv_heads, head_size) != (self._cfg_heads()):
            raise NotImplementedError("kvsparse: all layers must share one head geometry")
        self._layer = {}

    def _cfg_heads(self):
        e = self.engine
        return e.num_q_heads, e.num_kv_heads, e.head_dim

    def _idx(self, layer):
        i = self._layer.get(id(layer))
        if i is None:
            i = self._layer[id(layer)] = _layer_index(layer)
        return i

    def _split(self, kv_cache):
        kc, vc = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        return kc, vc

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if kv_cache.numel() == 0:
            return
        n = slot_mapping.shape[0]
        kc, vc = self._split(kv_cache)
        self.engine.cache_write(self._idx(layer), key[:n], value[:n], kc, vc, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvsparse: fused output quantization is not supported")
        if attn_metadata is None:  # warm-up
            return output
        n = attn_metadata.num_actual_tokens
        out = output[:n].view(n, self.num_heads, self.head_size)
        kc, vc = self._split(kv_cache)
        self.engine.forward(
            self._idx(layer), query[:n], kc, vc, attn_metadata.block_table, attn_metadata.seq_lens,
            attn_metadata.query_start_loc, out, seq_ids=attn_metadata.seq_ids, scale=self.scale,
            sliding_window=self.sliding_window, softcap=self.softcap,
            max_query_len=attn_metadata.max_query_len, max_seq_len=attn_metadata.max_seq_len)
        if not attn_metadata.registered:
            attn_metadata.registered = True
            TRACKER.mark_registered(attn_metadata.seq_ids.tolist())
        return output
