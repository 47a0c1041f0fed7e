"""vLLM attention backend running prefill, chunked prefill and decode through kvsparse.

KV cache: vLLM (0.26 and 0.32) allocates each layer's cache as a logical [blocks, kv_heads, block_size,
2*head_size] view in a layout the backend accepts (how that is declared differs: vllm_compat.py); we accept
the head-major LBHNC/HND and the token-major LBNHC/NHD (flash's layout), on 0.32 preferring one by device
and token width (`preferred_layouts`), and pass K and V to kvsparse as
strided [blocks, block_size, kv_heads, head_size] views, with no copy (`kv_views`: on the CPU with head-major
blocks the two halves of each block's plane of one head, else the two halves of each row). One kvsparse
engine per process serves all layers.

Per step, `KvSparseMetadataBuilder.build` turns vLLM's metadata into one `step.StepMeta` (descriptors of
vLLM's own persistent int32 buffers, and of the sequence ids in the builder's persistent `IdBuffer`); per
layer, `KvSparseImpl` makes one C call for the cache write and one for attention through a `LayerCall`
built on the layer's first use, on vLLM's current stream. Nothing reads a device tensor on the host.

CUDA graphs: the builder declares `UNIFORM_SINGLE_TOKEN_DECODE` (FULL graphs of decode-only batches) for
dense engines on CUDA (and policies the library reports graph-capturable, `kvs_policy_query`), the case
scripts/gpu_shim_check.py captures and replays; `NEVER` otherwise (vLLM then
runs attention eagerly between piecewise graphs). The builder never waits for the device: it reads no
metadata tensor on the host, and the periodic stats line (which reads device counters) is off on CUDA unless
KVSPARSE_LOG_EVERY asks for it, and never in a capture build. Decode metadata built where graphs are on asks the engine
to plan for the block table's whole width (max_seq_len = 0), so a captured step stays valid as sequences
grow and its split-KV workspace is the largest a decode step of that batch size needs.
"""

import os
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from . import vllm_compat
from . import vllm_config as kcfg
from .vllm_config import BLOCK_SIZES, kernel_block_size  # noqa: F401 - part of the backend's declarations
from . import vllm_runner
from .engine import Engine, policy_info, with_max_seqs
from .step import IdBuffer, LayerCall, StepMeta, raw_stream
from .vllm_runner import TRACKER

log = init_logger("vllm.kvsparse")  # under vLLM's logger config, so INFO lines show


def log_every(device) -> int:
    """Builds between two `kvsparse stats:` lines: $KVSPARSE_LOG_EVERY, else 64 on the CPU and 0 (never) on
    CUDA, where reading the engine's counters synchronizes the device: opt in there, knowing that every
    N-th build waits for the GPU."""
    env = os.environ.get("KVSPARSE_LOG_EVERY")
    if env is not None:
        return int(env)
    return 0 if torch.device(device).type == "cuda" else 64

# What kvs_engine_create accepts (include/kvsparse.h), declared to vLLM so it can choose or refuse up front.
HEAD_SIZES = [64, 80, 96, 112, 128, 192, 256]


def engine_device(vllm_config):
    """The device of this process's engine: the CPU, or the CUDA device vLLM made current for this worker
    (under tensor parallelism each rank's own GPU, not cuda:0)."""
    if kcfg.device_type(vllm_config) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


_engine_lock = threading.Lock()
_ENGINE = None


def get_engine(vllm_config=None, num_q_heads=None, num_kv_heads=None, head_dim=None):
    """The process's engine, created on first use from the vLLM config (errors are kvsparse's)."""
    global _ENGINE
    with _engine_lock:
        if _ENGINE is None:
            if vllm_config is None:
                return None
            mc, pc = vllm_config.model_config, vllm_config.parallel_config
            kcfg.check_cache_dtype(vllm_config)
            _ENGINE = Engine(
                num_layers=mc.get_num_layers(pc),
                num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_size=kernel_block_size(vllm_config.cache_config.block_size),
                dtype=mc.dtype,
                device=engine_device(vllm_config),
                # Per-sequence state for as many sequences as vLLM schedules at once (unless the spec says).
                policy=with_max_seqs(kcfg.policy(vllm_config), vllm_config.scheduler_config.max_num_seqs),
                num_threads=int(os.environ.get("KVSPARSE_NUM_THREADS", "0")),
                cache_dtype=kcfg.cache_dtype(vllm_config),
                # vLLM 0.26's FULL CUDA graphs pad a decode batch to a captured size: query_start_loc ends at
                # the real tokens, the query holds the padded count (docs/vllm.md, "CUDA graphs").
                padded_batches=True,
            )
            TRACKER.release_fn = _ENGINE.release
            log.info("kvsparse engine: %d layers, %d/%d heads, head_dim %d, block %d, %s, policy %r",
                     mc.get_num_layers(pc), num_q_heads, num_kv_heads, head_dim,
                     _ENGINE.block_size, mc.dtype, _ENGINE.policy or "dense")
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


def worker_report(worker=None):
    """This worker's kvsparse state, for `LLM.collective_rpc(worker_report)` (the function runs in each
    worker, `worker` being vLLM's worker object): the engine's counters (`stats()`, which synchronizes a
    CUDA device: not for a hot loop), the request ids live in the tracker, the preemptions it saw and, per
    request, ids assigned / released by the engine / restarts. None where no kvsparse engine was made."""
    e = get_engine()
    if e is None:
        return None
    lifecycle = TRACKER.lifecycle()
    requests = {k: v for k, v in lifecycle.items() if k != "<dummy>"}
    rank = getattr(worker, "rank", None)
    return dict(rank=rank, policy=e.policy or "dense", device=str(e.device), stats=e.stats(),
                live_ids=len(TRACKER.live()), requests=len(requests),
                restarts=sum(v[2] for v in requests.values()),
                ids_assigned=sum(v[0] for v in requests.values()),
                ids_released_by_engine=sum(v[1] for v in requests.values()))


class KvSparseBackend(AttentionBackend):
    # The cache write happens in forward: one Python entry per layer instead of two.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return HEAD_SIZES

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return BLOCK_SIZES

    @classmethod
    def supported_kv_cache_layouts(cls):
        """vLLM 0.32: the layouts we read, most preferred first."""
        e = get_engine()  # made with the model's first attention layer, before vLLM resolves the cache layout
        if e is None:
            return preferred_layouts(current_platform.is_cpu())
        return preferred_layouts(e.device.type == "cpu", e.num_kv_heads * 2 * e.head_dim * e.cache_itemsize)

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        """vLLM 0.26: the logical shape of a layer's cache, [blocks, kv_heads, block_size, 2 * head_size]."""
        return vllm_compat.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False):
        """vLLM 0.26: the physical order of those axes for vLLM's layout ($VLLM_KV_CACHE_LAYOUT, default NHD:
        token-major, the layout the CUDA kernels were tuned on); kv_views reads either."""
        return vllm_compat.kv_cache_stride_order(vllm_compat.current_layout_name(), include_num_layers_dimension)

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
    max_seq_len: int  # as passed to the engine: 0 = plan for the block table's width
    query_start_loc: torch.Tensor  # [num_reqs+1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    seq_ids: torch.Tensor  # [num_reqs] int64, stable per request (vllm_runner.py), in the builder's IdBuffer
    step: StepMeta  # the above as descriptors, shared by every layer's call


def _int32(t, what):
    if t.dtype is not torch.int32:  # a conversion would be a new tensor per step, invisible to a captured graph
        raise NotImplementedError(f"kvsparse: vLLM passed {what} as {t.dtype}; int32 expected")
    return t


# On the CPU a token-major cache reads faster once one token's K and V rows over all KV heads are this wide.
WIDE_TOKEN_BYTES = 2048


def preferred_layouts(cpu: bool, token_bytes: int = 0):
    """The cache layouts we read, most preferred first (either is read correctly on both devices).

    CPU, measured on the same data in both layouts (docs/perf.md, issue 16, "2026-11-26"): head-major blocks
    (LBHNC, vLLM's own CPU layout) for narrow tokens -- the SmolLM2 shape (3 KV heads x 64, 768-1536 bytes
    per token) ran at 0.77-0.94x of the token-major time with bf16 and 0.88-1.02x with f32 on two threads
    (1.02-1.08x with f32 on one); token-major (LBNHC) for wide ones -- the Llama-8B shape (8 x 128, 4-8 KiB
    per token) ran up to 1.2x (f32) and 1.3-1.7x (bf16) slower over head-major blocks. CUDA: token-major, the layout the GPU kernels were tuned and measured on.
    `VLLM_KV_CACHE_LAYOUT=HND|NHD` overrides the choice. (vLLM 0.32's declaration; 0.26 takes vLLM's own
    layout choice, see get_kv_cache_stride_order.)"""
    return vllm_compat.layout_list(head_major_first=cpu and token_bytes < WIDE_TOKEN_BYTES)


def kv_views(kv_cache: torch.Tensor, head_size: int):
    """K and V of one layer's cache as [blocks, block_size, kv_heads, head_size] views, no copy.

    vLLM 0.32 gives a backend each layer's cache as a logical [blocks, kv_heads, block_size, 2 * head_size]
    tensor and leaves the meaning of the last axis to it (its own CPU backend stores its own format inside a
    block). On the CPU with head-major blocks (LBHNC: each block's plane of one KV head, block_size x
    2 * head_size, is one contiguous run) K takes the plane's first half and V its second, each row-major
    [block_size, head_size]: a head's K rows of a block are then one run and its V rows another, as in
    vLLM's own CPU cache. Measured on the 2-vCPU AVX-512 VM (SmolLM2 shape, docs/perf.md): f32 4-10% faster on
    two threads than K and V as the two halves of every row; bf16 no consistent difference. Elsewhere (token-major blocks, CUDA) K and V are the two
    halves of each token's row. kvsparse alone writes and reads the cache, so the choice only has to be the
    same on every call, which it is (a function of the tensor's device, shape and strides)."""
    b, h, n, c = kv_cache.shape
    if kv_cache.device.type == "cpu" and c == 2 * head_size and kv_cache.stride(3) == 1 and kv_cache.stride(2) == c:
        planes = kv_cache.view(b, h, 2, n, head_size)
        return planes[:, :, 0].transpose(1, 2), planes[:, :, 1].transpose(1, 2)
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


def graph_capturable(spec: str) -> bool:
    """Whether a CUDA engine's decode steps under the policy spec may be captured in a CUDA graph, as the
    library decides it (`kvs_policy_query`; dense: always). Which stages qualify, and the GPU checks behind
    them, are the library's (docs/abi.md, `kvs_policy_info.graph_capturable`). A malformed spec raises."""
    return policy_info(spec)["graph_capturable"]


def graphs_supported(vllm_config) -> bool:
    return kcfg.device_type(vllm_config) == "cuda" and graph_capturable(kcfg.policy(vllm_config))


class KvSparseMetadataBuilder(AttentionMetadataBuilder[KvSparseMetadata]):
    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if graphs_supported(vllm_config):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.engine = get_engine()
        if self.engine is None:
            raise RuntimeError("kvsparse: metadata builder created before any kvsparse attention layer")
        if kv_cache_spec.block_size != self.engine.block_size:
            raise NotImplementedError(f"kvsparse: vLLM chose kernel blocks of {kv_cache_spec.block_size} tokens for "
                                      f"an engine made for {self.engine.block_size}")
        runner = vllm_runner.find_runner()
        if runner is not None:
            vllm_runner.install(runner)
        elif self.engine.policy:
            raise NotImplementedError(f"kvsparse: cannot find vLLM's model runner, so request ids are unknown and "
                                      f"policy {self.engine.policy!r} cannot keep state per request")
        sc = vllm_config.scheduler_config
        self.ids = IdBuffer(self.engine.device, sc.max_num_seqs + sc.max_num_batched_tokens)
        mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
        self.graphs = graphs_supported(vllm_config) and mode is not None and getattr(mode, "name", "NONE") != "NONE"
        self._builds = 0
        self._log_every = log_every(self.engine.device)
        self._steps, self._turn = [None, None], 0

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvSparseMetadata:
        return self._build(common_attn_metadata, capture=False)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> KvSparseMetadata:
        return self._build(common_attn_metadata, capture=True)

    def _build(self, m, capture):
        if m.causal is not True:
            raise NotImplementedError("kvsparse serves causal decoder attention only")
        n = m.num_reqs
        ids = self.ids.put(TRACKER.batch_ids(m))
        self._builds += 1
        if not capture and self._log_every > 0 and self._builds % self._log_every == 0:
            log_stats(self.engine)
        max_seq_len = 0 if capture or (self.graphs and m.max_query_len == 1) else m.max_seq_len
        qsl = _int32(m.query_start_loc, "query_start_loc")
        seq_lens = _int32(m.seq_lens, "seq_lens")
        table = _int32(m.block_table_tensor, "block_table")
        # Two StepMetas in turn: vLLM uses a step's metadata until the next build, never after the one after.
        self._turn ^= 1
        step = self._steps[self._turn] = StepMeta(
            table, seq_lens, qsl, ids, num_seqs=n, num_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
            max_seq_len=max_seq_len, reuse=self._steps[self._turn])
        return KvSparseMetadata(
            num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len, max_seq_len=max_seq_len,
            query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=m.slot_mapping,
            seq_ids=ids, step=step)


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
        e = self.engine
        if (num_heads, num_kv_heads, head_size) != (e.num_q_heads, e.num_kv_heads, e.head_dim):
            raise NotImplementedError("kvsparse: all layers must share one head geometry")
        self.device = e.device
        self._cuda = e.device.type == "cuda"
        self._call = None  # LayerCall of this impl's layer, made on first use

    def _bind(self, layer, kv_cache):
        """The layer's LayerCall with its caches set from `kv_cache` (None while the cache is empty)."""
        if kv_cache.numel() == 0:
            return None
        c = self._call
        if c is None:
            if self.engine.cache_dtype != "auto":
                # vLLM's per-layer FP8 scales (per tensor; 1.0 unless the checkpoint or calibration set them).
                self.engine.set_kv_scales(_layer_index(layer), getattr(layer, "_k_scale_float", 1.0),
                                          getattr(layer, "_v_scale_float", 1.0))
            c = self._call = LayerCall(self.engine, _layer_index(layer), scale=self.scale,
                                       sliding_window=self.sliding_window, softcap=self.softcap)
        kc, vc = kv_views(kv_cache, self.head_size)
        c.set_caches(kv_cache, kc, vc)
        return c

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        """The step's new K/V into the cache (unless this layer shares another layer's cache), then attention:
        one Python entry per layer (forward_includes_kv_cache_update)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvsparse: fused output quantization is not supported")
        if attn_metadata is None:  # warm-up
            return output
        c = self._call
        if c is None or c.cache_src is not kv_cache:
            c = self._bind(layer, kv_cache)
            if c is None:
                return output
        stream = raw_stream(self.device) if self._cuda else 0
        if key is not None and value is not None and self.kv_sharing_target_layer_name is None:
            c.write(key, value, attn_metadata.slot_mapping, stream)
        c.attend(query, output, attn_metadata.step, stream)
        return output
