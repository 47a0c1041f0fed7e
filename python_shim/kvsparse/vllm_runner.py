"""Which vLLM request each metadata row belongs to, under vLLM's model runners (V1, and V2 of 0.26 and 0.32).

vLLM's attention metadata names no request, so the builder asks the model runner, which it finds once (the
runner that is building it is on the call stack of the builder's constructor). Its class gets one wrapper,
around `execute_model`, installed only then: plain vLLM, with kvsparse installed but not the backend,
runs no kvsparse code at all per step.

- Each real step enters `execute_model(scheduler_output)`. Before the runner updates its batch, requests in
  `finished_req_ids` lose their id and state; `preempted_req_ids` and (V1) `resumed_req_ids` too, counted
  as restarts (their KV is recomputed, so their policy state must start over).
- Builds inside a real step read the rows' request ids (`vllm_compat.row_request_keys`): 0.32's V2 runner
  (`vllm/v1/worker/gpu/`) puts each row's request slot into `CommonAttentionMetadata.req_idx` and keeps
  `req_states.index_to_req_id`; 0.26's V2 runner returns the step's rows (`InputBatch.req_ids`) from
  `prepare_inputs`, which is wrapped too there; the V1 runner (`gpu_model_runner.py`, also vLLM's CPU
  runner) keeps `input_batch.req_ids` in row order. Rows past the runner's live requests are CUDA-graph
  padding.
- Builds outside a real step (profiling, warm-up, graph capture, V2's `dummy_run=True`) get ephemeral ids.
"""
import functools
import sys
import threading

from . import vllm_compat
from .seq_ids import EPHEMERAL_BASE, SeqIds  # noqa: F401 - EPHEMERAL_BASE re-exported

_HOOK_MARK = "_kvsparse_hooked"


class RequestIds(SeqIds):
    """SeqIds fed from vLLM's model runner (one per process: `TRACKER`)."""

    def __init__(self):
        super().__init__()
        self._step = threading.local()
        self.runner = None

    # -- called by the execute_model wrapper ---------------------------------------------------------------
    def begin_step(self, runner, scheduler_output):
        """Entering execute_model; scheduler_output None for dummy runs."""
        stack = getattr(self._step, "stack", None)
        if stack is None:
            stack = self._step.stack = []
        stack.append((runner, scheduler_output is not None))
        self._step.req_ids = None
        if scheduler_output is None:
            return
        self.runner = runner
        so = scheduler_output
        self.forget(set(getattr(so, "finished_req_ids", None) or ()))
        restarted = set(getattr(so, "preempted_req_ids", None) or ())
        cached = getattr(so, "scheduled_cached_reqs", None)
        restarted |= set(getattr(cached, "resumed_req_ids", None) or ())
        self.forget(restarted, restarted=True)

    def end_step(self):
        self._step.stack.pop()

    # -- called by the metadata builder --------------------------------------------------------------------
    def batch_ids(self, common):
        """Sequence ids of the rows of one CommonAttentionMetadata (host work only)."""
        n = common.num_reqs
        stack = getattr(self._step, "stack", None)
        if not stack or not stack[-1][1]:
            return self.ids([None] * n)
        runner = stack[-1][0]
        return self.ids(vllm_compat.row_request_keys(runner, common, n, getattr(self._step, "req_ids", None)))

    def record_rows(self, req_ids):
        """The rows' requests of the current step, from the runner's prepare_inputs (0.26's V2 runner)."""
        self._step.req_ids = None if req_ids is None else list(req_ids)


TRACKER = RequestIds()


def find_runner(max_depth=40):
    """The vLLM model runner on the caller's stack (the builder is constructed inside the runner's
    initialize_kv_cache), or None."""
    f = sys._getframe(1)
    for _ in range(max_depth):
        if f is None:
            return None
        obj = f.f_locals.get("self")
        if obj is not None and callable(getattr(type(obj), "execute_model", None)) and (
                hasattr(obj, "input_batch") or hasattr(obj, "req_states")):
            return obj
        f = f.f_back
    return None


def wrap_method(cls, name, make, mark=_HOOK_MARK):
    """Replaces `cls.name` by `make(original)` once (a second call finds the mark on the wrapper and does
    nothing). Returns whether it wrapped."""
    orig = getattr(cls, name)
    if getattr(orig, mark, False):
        return False
    wrapper = functools.wraps(orig)(make(orig))
    setattr(wrapper, mark, True)
    setattr(cls, name, wrapper)
    return True


def _execute_model(orig):
    def execute_model(self, scheduler_output, *args, **kwargs):
        # V2: execute_model(scheduler_output, intermediate_tensors=None, dummy_run=False, ...).
        dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
        TRACKER.begin_step(self, None if dummy else scheduler_output)
        try:
            return orig(self, scheduler_output, *args, **kwargs)
        finally:
            TRACKER.end_step()

    return execute_model


def _prepare_inputs(orig):
    """0.26's V2 runner: the InputBatch that prepare_inputs returns names the step's rows in order."""

    def prepare_inputs(self, *args, **kwargs):
        batch = orig(self, *args, **kwargs)
        TRACKER.record_rows(getattr(batch, "req_ids", None))
        return batch

    return prepare_inputs


def install(runner):
    """Wraps `execute_model` of the runner's class (idempotent), and on 0.26's V2 runner `prepare_inputs`."""
    cls = type(runner)
    if wrap_method(cls, "execute_model", _execute_model) and vllm_compat.records_prepare_inputs(cls):
        wrap_method(cls, "prepare_inputs", _prepare_inputs)


def hooked(runner_cls) -> bool:
    return bool(getattr(getattr(runner_cls, "execute_model", None), _HOOK_MARK, False))
