"""Stable 64-bit sequence ids for a serving engine's requests, and their release.

A policy keeps state per sequence id from one decode step to the next, so a request must keep its id while
it lives and lose it (`kvs_sequence_release`) when it finishes or its KV is recomputed (preemption). The
serving engine names its requests by a key (vLLM: the request id string); `ids(keys)` maps each row's key
to its id, allocating on first sight, and `forget(keys)` releases. Rows with no request (profiling, warm-up,
CUDA-graph padding: key None) get ephemeral ids, released at the next step.

Release asks the engine with missing_ok: an id the engine never saw (a dense CUDA engine registers none; a
captured graph's replays run no Python) is not an error. This module knows no serving engine; the vLLM side
that finds request keys per step is `vllm_runner.py`.
"""
import collections
import itertools
import threading

# Ids for rows the serving engine has no request for (profiling / warm-up / padding rows).
EPHEMERAL_BASE = 1 << 62


class SeqIds:
    def __init__(self, release_fn=None):
        self._lock = threading.Lock()
        self._next = itertools.count(1)
        self._ids = {}  # key -> seq id
        self._key_of = {}  # seq id -> key ("<dummy>" for ephemeral ids), for the lifecycle counters
        self._ephemeral = []
        # Per key: ids handed out, ids the engine held and released, restarts (preemptions) while holding one.
        self.assigned = collections.Counter()
        self.released = collections.Counter()
        self.restarts = collections.Counter()
        self.release_fn = release_fn  # (seq_id, missing_ok=True) -> bool (engine held it); Engine.release

    def ids(self, keys):
        """Sequence ids for one step's rows (key None: an ephemeral id). Releases the last step's ephemeral ids."""
        with self._lock:
            self._release_ephemeral_locked()
            out = []
            for i, k in enumerate(keys):
                if k is None:
                    sid = EPHEMERAL_BASE + i
                    self._ephemeral.append(sid)
                    self._key_of[sid] = "<dummy>"
                    self.assigned["<dummy>"] += 1
                else:
                    sid = self._ids.get(k)
                    if sid is None:
                        sid = self._ids[k] = next(self._next)
                        self._key_of[sid] = k
                        self.assigned[k] += 1
                out.append(sid)
            return out

    def forget(self, keys, restarted=False):
        """The requests `keys` finished (or, with restarted, lost their KV): release their state."""
        with self._lock:
            for k in keys:
                sid = self._ids.pop(k, None)
                if sid is not None:
                    if restarted:
                        self.restarts[k] += 1
                    self._release_locked(sid)

    def _release_locked(self, sid):
        key = self._key_of.pop(sid, "?")
        if self.release_fn is not None and self.release_fn(sid, missing_ok=True):
            self.released[key] += 1

    def _release_ephemeral_locked(self):
        for sid in self._ephemeral:
            self._release_locked(sid)
        self._ephemeral.clear()

    def live(self):
        with self._lock:
            return dict(self._ids)

    def lifecycle(self):
        """{key: [ids assigned, released by the engine, restarts]} (rows without a request: "<dummy>")."""
        with self._lock:
            keys = set(self.assigned) | set(self.released)
            return {k: [self.assigned[k], self.released[k], self.restarts[k]] for k in keys}
