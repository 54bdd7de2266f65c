"""ShardState: the values one server holds, and the rules that change them.

Pure numpy, no I/O: the server loop decodes a request, calls one method here
and sends whatever :class:`Completion` objects come back.  Requests are
identified by an opaque ``token`` the caller chooses.

Rules (docs/architecture.md, SEMANTICS.md):

* ``dist_sync``: a key's round closes when one push from **every** worker still
  in the cluster has arrived; a second push from the same worker waits for the
  next round.  A worker that has left (:meth:`ShardState.leave`) no longer
  counts, so the others' last rounds close without it (uneven ends).  The
  round's sum is then applied (assigned, or handed to the updater), and the
  replies to its pushes are sent only then.
* ``dist_async``: each push is applied on arrival (assigned, or updated).
* A pull is answered once every push its worker sent earlier for that key has
  been applied (read-your-writes); a pushpull is a push plus such a pull.
* A bad request raises before anything changes.

Arrays handed out by :meth:`ShardState.pull` are never written to afterwards:
every update stores a new array, so a reply may be sent without copying.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import DTypeMismatchError, DuplicateInitError, KeyNotInitializedError, ShapeMismatchError
from .partition import Key

Updater = Callable[[Key, np.ndarray, np.ndarray], np.ndarray]


@dataclass
class Completion:
    """A request that is now answered: ``value`` is the slice to send back, or None for a bare ack."""

    token: Any
    value: np.ndarray | None = None


@dataclass
class _KeyState:
    value: np.ndarray
    submitted: dict[int, int] = field(default_factory=dict)   # worker -> pushes received
    applied: dict[int, int] = field(default_factory=dict)     # worker -> pushes applied
    round_values: dict[int, np.ndarray] = field(default_factory=dict)  # worker -> pushed value
    round_tokens: dict[int, Any] = field(default_factory=dict)  # worker -> push token
    backlog: list[tuple[Any, int, np.ndarray]] = field(default_factory=list)
    waiting_pulls: list[tuple[Any, int, int]] = field(default_factory=list)  # token, worker, target


class ShardState:
    """The keys (or key slices) held by one server."""

    def __init__(self, num_workers: int, sync: bool, updater: Updater | None = None) -> None:
        self.num_workers = num_workers
        self.active = set(range(num_workers))  # workers that have not left
        self.sync = sync
        self.updater = updater
        self._keys: dict[Key, _KeyState] = {}

    def __contains__(self, key: Key) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def nbytes(self) -> int:
        """Bytes of the values held (not counting rounds in progress)."""
        return sum(state.value.nbytes for state in self._keys.values())

    def value(self, key: Key) -> np.ndarray:
        """Return the stored value of ``key``; raise :class:`KeyNotInitializedError` if absent."""
        return self._get(key).value

    def init(self, key: Key, value: np.ndarray) -> None:
        """Store the first value of ``key``; raise :class:`DuplicateInitError` if it exists."""
        if key in self._keys:
            raise DuplicateInitError(f"key {key!r} is already initialised on this server")
        self._keys[key] = _KeyState(value=np.array(value, copy=True))

    def push(self, token: Any, worker: int, key: Key, value: np.ndarray) -> list[Completion]:
        """Contribute ``value`` from ``worker``; return the requests this answers (maybe none yet)."""
        state = self._checked(key, value)
        self._check_active(worker)
        return self._accept(state, key, token, worker, value)

    def pull(self, token: Any, worker: int, key: Key) -> list[Completion]:
        """Ask for ``key``'s value; answered now, or once ``worker``'s earlier pushes are applied."""
        state = self._get(key)
        self._check_worker(worker)
        return self._add_pull(state, token, worker)

    def leave(self, worker: int) -> list[Completion]:
        """``worker`` left: rounds stop waiting for it; return the requests that closing them answers.

        Its pushes already in a round (or waiting for one) still count, but are not acknowledged
        (nobody waits for them), and its waiting pulls are dropped.  Leaving twice changes nothing.
        """
        self._check_worker(worker)
        if worker not in self.active:
            return []
        self.active.discard(worker)
        done: list[Completion] = []
        for key, state in self._keys.items():
            if worker in state.round_tokens:
                state.round_tokens[worker] = _SILENT
            state.backlog = [(_SILENT if w == worker else t, w, v) for t, w, v in state.backlog]
            state.waiting_pulls = [p for p in state.waiting_pulls if p[1] != worker]
            done += self._close_rounds(state, key)
        return done

    def pushpull(self, token: Any, worker: int, key: Key, value: np.ndarray) -> list[Completion]:
        """Push ``value`` and answer ``token`` with the value once that push is applied."""
        state = self._checked(key, value)
        self._check_active(worker)
        done = self._accept(state, key, _SILENT, worker, value)
        return done + self._add_pull(state, token, worker)

    # -- internals ---------------------------------------------------------------------------

    def _get(self, key: Key) -> _KeyState:
        try:
            return self._keys[key]
        except KeyError:
            raise KeyNotInitializedError(f"key {key!r} has not been initialised (call init first)") from None

    def _check_worker(self, worker: int) -> None:
        if not (isinstance(worker, int) and 0 <= worker < self.num_workers):
            raise ValueError(f"worker rank {worker!r} is not in [0, {self.num_workers})")

    def _check_active(self, worker: int) -> None:
        self._check_worker(worker)
        if worker not in self.active:
            raise ValueError(f"worker {worker} has left the cluster; it cannot push")

    def _checked(self, key: Key, value: np.ndarray) -> _KeyState:
        state = self._get(key)
        if value.shape != state.value.shape:
            raise ShapeMismatchError(f"key {key!r}: pushed shape {value.shape} differs from the "
                                     f"stored shape {state.value.shape}")
        if value.dtype != state.value.dtype:
            raise DTypeMismatchError(f"key {key!r}: pushed dtype {value.dtype} differs from the "
                                     f"stored dtype {state.value.dtype}")
        return state

    def _accept(self, state: _KeyState, key: Key, token: Any, worker: int,
                value: np.ndarray) -> list[Completion]:
        state.submitted[worker] = state.submitted.get(worker, 0) + 1
        if not self.sync:
            self._apply(state, key, value, {worker: token})
            return _acks([token]) + self._release_pulls(state)
        if worker in state.round_tokens:
            state.backlog.append((token, worker, value))
            return []
        self._add_to_round(state, token, worker, value)
        return self._close_rounds(state, key)

    def _add_to_round(self, state: _KeyState, token: Any, worker: int, value: np.ndarray) -> None:
        state.round_values[worker] = value  # may view a received frame: never written to
        state.round_tokens[worker] = token

    @staticmethod
    def _round_total(values: dict[int, np.ndarray]) -> np.ndarray:
        ordered = [values[w] for w in sorted(values)]
        if len(ordered) == 1:
            return ordered[0]
        total = ordered[0] + ordered[1]  # the round's own buffer from here on
        for value in ordered[2:]:
            total += value
        return total

    def _close_rounds(self, state: _KeyState, key: Key) -> list[Completion]:
        done: list[Completion] = []
        while state.round_tokens and self.active <= state.round_tokens.keys():
            tokens, total = state.round_tokens, self._round_total(state.round_values)
            state.round_tokens, state.round_values = {}, {}
            self._apply(state, key, total, tokens)
            done.extend(_acks(tokens.values()))
            backlog, state.backlog = state.backlog, []
            for token, worker, value in backlog:
                if worker in state.round_tokens:
                    state.backlog.append((token, worker, value))
                else:
                    self._add_to_round(state, token, worker, value)
        return done + self._release_pulls(state)

    def _apply(self, state: _KeyState, key: Key, total: np.ndarray, tokens: dict[int, Any]) -> None:
        if self.updater is None:
            state.value = total
        else:
            state.value = self.updater(key, total, state.value)
        for worker in tokens:
            state.applied[worker] = state.applied.get(worker, 0) + 1

    def _add_pull(self, state: _KeyState, token: Any, worker: int) -> list[Completion]:
        state.waiting_pulls.append((token, worker, state.submitted.get(worker, 0)))
        return self._release_pulls(state)

    def _release_pulls(self, state: _KeyState) -> list[Completion]:
        ready, waiting = [], []
        for entry in state.waiting_pulls:
            _, worker, target = entry
            (ready if state.applied.get(worker, 0) >= target else waiting).append(entry)
        state.waiting_pulls = waiting
        return [Completion(token, state.value) for token, _, _ in ready]


_SILENT = object()  # marks the push half of a pushpull, whose ack is folded into the pull's reply


def _acks(tokens: Any) -> list[Completion]:
    return [Completion(t) for t in tokens if t is not _SILENT]
