"""Stable 64-bit sequence ids for vLLM requests, and their release.

vLLM's attention metadata names no requests, but the model runner's persistent
batch (`runner.input_batch.req_ids`) lists the request id of every metadata row,
in row order, after the runner's reorderings. We hook `GPUModelRunner._update_states`
(the CPU runner inherits it), which runs once per step before metadata is built:
it tells us which requests finished or were preempted/resumed, and which runner
the following `build()` belongs to. A request keeps its id while it lives; a
resumed request (its KV recomputed after preemption) gets its old state released
and a fresh id. Ids are released only if the engine saw them (registered by a
forward call), so every created sequence is released exactly once.
"""
import collections
import itertools
import logging
import threading

log = logging.getLogger("vllm.kvsparse")

# Ids for rows the runner has no request for (profiling / warm-up dummy batches).
_EPHEMERAL_BASE = 1 << 62


class SeqIdTracker:
    def __init__(self):
        self._lock = threading.Lock()
        self._next = itertools.count(1)
        self._ids = {}  # req_id -> seq id
        self._registered = set()  # seq ids the engine holds state for
        self._ephemeral = set()
        self._req_of = {}  # seq id -> req id ("<dummy>" for ephemeral ids), for the lifecycle counters
        # Lifecycle counters per request id: engine state registered / released (tests assert 1 and 1).
        self.created = collections.Counter()
        self.released = collections.Counter()
        self.restarts = collections.Counter()  # preempted (or resumed) while holding an id
        self.runner = None
        self.release_fn = None  # set by the backend: seq_id -> None

    def on_step(self, scheduler_output, runner):
        """Called before the runner updates its batch for a step."""
        self.runner = runner
        finished = set(getattr(scheduler_output, "finished_req_ids", ()) or ())
        restarted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        restarted |= set(getattr(cached, "resumed_req_ids", None) or ())
        with self._lock:
            for req_id in finished | restarted:
                sid = self._ids.pop(req_id, None)
                if sid is not None:
                    if req_id in restarted:
                        self.restarts[req_id] += 1
                    self._release_locked(sid)
            self._release_ephemeral_locked()

    def _release_locked(self, sid):
        if sid in self._registered:
            self._registered.discard(sid)
            self.released[self._req_of.get(sid, "?")] += 1
            if self.release_fn is not None:
                self.release_fn(sid)
        self._req_of.pop(sid, None)

    def _release_ephemeral_locked(self):
        for sid in list(self._ephemeral):
            self._release_locked(sid)
        self._ephemeral.clear()

    def ids_for_batch(self, num_reqs):
        """Seq ids of the first num_reqs rows of the current batch."""
        req_ids = []
        if self.runner is not None:
            req_ids = list(self.runner.input_batch.req_ids[:num_reqs])
        with self._lock:
            if len(req_ids) != num_reqs or any(r is None for r in req_ids):
                self._release_ephemeral_locked()
                ids = [_EPHEMERAL_BASE + i for i in range(num_reqs)]
                self._ephemeral.update(ids)
                self._req_of.update((i, "<dummy>") for i in ids)
                return ids
            out = []
            for r in req_ids:
                sid = self._ids.get(r)
                if sid is None:
                    sid = self._ids[r] = next(self._next)
                    self._req_of[sid] = r
                out.append(sid)
            return out

    def mark_registered(self, ids):
        """The engine now holds state for these ids (a forward call with them succeeded)."""
        with self._lock:
            for sid in ids:
                if sid not in self._registered:
                    self._registered.add(sid)
                    self.created[self._req_of.get(sid, "?")] += 1

    def live(self):
        with self._lock:
            return dict(self._ids)

    def lifecycle(self):
        """{req_id: [times state was created, times released, preemptions]} (dummy batches: "<dummy>")."""
        with self._lock:
            keys = set(self.created) | set(self.released)
            return {k: [self.created[k], self.released[k], self.restarts[k]] for k in keys}


TRACKER = SeqIdTracker()


def install_runner_hook():
    """Wraps GPUModelRunner._update_states once per process (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig = GPUModelRunner._update_states
    if getattr(orig, "_kvsparse_hooked", False):
        return

    def _update_states(self, scheduler_output):
        TRACKER.on_step(scheduler_output, self)
        return orig(self, scheduler_output)

    _update_states._kvsparse_hooked = True
    GPUModelRunner._update_states = _update_states
