"""Key groups: a batch of small keys that travels together, held and updated as one flat array.

Pure numpy, no I/O.  A worker sends the same list of small keys to a server in the same batch
every step (``kvstore.core.plan``); per-key Python then dominates a server's time (about 10 us a
key and round).  :class:`GroupedShardState` is a :class:`~kvstore.core.shard.ShardState` that, on
the first batch PUSH (or PUSHPULL) of a list of keys that are all at rest (no round open, no pull
waiting, the same counts), copies their values into one contiguous array, the *group*, and from
then on answers a batch of exactly those keys with one vectorised operation:

* a push adds the message's one flat array into the group's round accumulator (the first push of
  a round *is* the accumulator: no copy; the second makes a sum of its own);
* a round closes when every active worker has pushed the group (dist_sync), or at once
  (dist_async); the sum becomes the group's new value (a new array each round: copy-on-write,
  so a reply that views the old value is never written under);
* a pull of exactly those keys is answered with the group's whole value, zero-copy, once the
  worker's earlier pushes of the group are applied (read-your-writes).

The rules are those of ``ShardState`` for each key of the group: a group round is one round of
every key in it.  Any other access to a grouped key (a pull of another list, a chunk, a state,
a stall, a worker leaving, an aborted round) first *dissolves* the group: each key gets back its
own value (a view of the group's), counts, open rounds (with accumulators viewing the group's) and
waiting pulls, with each request token of the group split per key by ``split(token, index)``, so
everything continues exactly as if the keys had never been grouped.  Groups are used only where they
sum as the per-key rounds would: no ``quorum``, no staleness gate, and arrival order
(``ordered=False``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvstore.core.partition import Key, check_key
from kvstore.core.replies import _SILENT, Completion
from kvstore.core.rounds import ChunkRange, Round
from kvstore.core.shard import ShardState, _KeyState
from kvstore.errors import KVStoreError, ProtocolError

MIN_KEYS = 1  # a lone key gains too: no generic dispatch (docs/benchmarks.md)
_KEY_TYPES = {int, str}


class _GroupRound:
    """One open round of a group: the running sum of the flat arrays pushed, and who pushed."""

    __slots__ = ("acc", "owned", "tokens", "complete", "ranks", "opened", "last")

    def __init__(self, ranks: list[int], opened: float) -> None:
        self.acc: np.ndarray | None = None
        self.owned = False  # False: acc is a pushed array itself, never written to
        self.tokens: dict[int, list] = {}
        self.complete: set[int] = set()
        self.ranks, self.opened, self.last = ranks, opened, -1


class KeyGroup:
    """Keys held as one flat array; counts are relative to the keys' own at the group's creation."""

    __slots__ = ("keys", "sizes", "offsets", "dtype", "value", "base", "rounds", "next_round", "submitted",
                 "applied", "waiting", "start", "numbered")

    def __init__(self, keys: tuple, sizes: list[int], value: np.ndarray, start: _KeyState) -> None:
        self.keys, self.sizes, self.value, self.dtype = keys, sizes, value, value.dtype
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        self.offsets = offsets
        self.base = 0                              # rounds closed since creation
        self.rounds: deque[_GroupRound] = deque()  # open rounds, oldest first
        self.next_round: dict[int, int] = {}       # worker -> round (relative) its next push joins
        self.submitted: dict[int, int] = {}        # worker -> pushes since creation
        self.applied: dict[int, int] = {}          # worker -> pushes applied since creation
        self.waiting: list[tuple[Any, int, int]] = []  # pulls: token, worker, submitted target
        self.numbered: dict[int, list[int]] = {}   # async: worker -> its last applied push's rounds
        self.start = (start.base, dict(start.submitted), dict(start.applied), dict(start.next_round))

    def held_bytes(self) -> int:
        """Bytes of the open rounds' accumulators."""
        return sum(r.acc.nbytes for r in self.rounds if r.acc is not None)


def _at_rest(state: _KeyState, first: _KeyState, size: int, dtype: np.dtype) -> bool:
    """Whether a key's state can join a group whose first key's state is ``first``."""
    value = state.value
    return (not state.rounds and not state.waiting_pulls and not state.assembling and not state.offset
            and not state.debts  # an aborted round's debts are checked per key (ShardState.abort)
            and state.members is None  # a worker set's rounds and members are checked per key
            and value.ndim == 1 and value.size == size and value.dtype == dtype
            and state.base == first.base and state.submitted == state.applied == first.submitted
            and state.next_round == first.next_round)


class GroupedShardState(ShardState):
    """A :class:`ShardState` with key groups (see the module docstring).

    ``split(token, i)`` makes the token of a group request's ``i``-th key, for a group dissolved
    while that request waits (default: ``(token, i)``).
    """

    def __init__(self, *args: Any, split: Callable[[Any, int], Any] = lambda t, i: (t, i),
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.split = split
        self.grouping = self.quorum is None and self.gate is None and not self.ordered
        self._groups: dict[tuple, KeyGroup] = {}
        self._grouped: dict[Key, KeyGroup] = {}

    # -- the group path ---------------------------------------------------------------------------
    def group_of(self, keys: Any, sizes: Any, array: np.ndarray | None, create: bool) -> KeyGroup | None:
        """The group of exactly ``keys`` (with these ``sizes``, and ``array``'s dtype and length when
        given), made now when ``create`` and the keys are at rest; None when the per-key path must
        serve the request (including any malformed one: it raises the per-key errors)."""
        if not self.grouping or type(keys) is not list or len(keys) < MIN_KEYS or type(sizes) is not list:
            return None
        if self.away or self.joins:  # a restarted worker's rounds (core/rejoin.py) are per key
            return None
        if not set(map(type, keys)) <= _KEY_TYPES:  # 1 == True == 1.0: only ints and strs may match
            return None
        found = self._groups.get(tuple(keys))
        if found is None and create and array is not None:
            found = self._create(keys, sizes, array)
        if found is None or sizes != found.sizes:
            return None
        if array is not None and not (type(array) is np.ndarray and array.ndim == 1
                                      and array.size == found.offsets[-1] and array.dtype == found.dtype):
            return None
        return found

    def _create(self, keys: list, sizes: list, array: np.ndarray) -> KeyGroup | None:
        """A new group of ``keys`` if each is a valid, distinct, stored key at rest, else None."""
        if len(sizes) != len(keys) or len(set(keys)) != len(keys):
            return None
        try:
            states = [self._keys[check_key(k)] for k in keys]
        except (KeyError, KVStoreError):
            return None
        first = states[0]
        for key, state, n in zip(keys, states, sizes):
            if type(n) is not int or not _at_rest(state, first, n, array.dtype):
                return None
            other = self._grouped.get(key)
            if other is not None:
                self._dissolve(other)  # an overlapping list: the keys are at rest, so this is cheap
        group = KeyGroup(tuple(keys), list(sizes), np.concatenate([s.value for s in states]), first)
        offsets = group.offsets
        for i, (key, state) in enumerate(zip(keys, states)):
            state.value = group.value[offsets[i]:offsets[i + 1]]  # the old arrays are freed
            self._grouped[key] = group
        self._groups[group.keys] = group
        return group

    def push_group(self, group: KeyGroup, worker: int, token: Any, array: np.ndarray,
                   pull: bool = False, rounds: list[int] | None = None) -> list[Completion]:
        """Push ``array`` (every key of ``group``, flat) from ``worker``, as ``push_many`` of each key
        (``pushpull`` with ``pull``: ``token`` is then answered with the group's new value); in
        dist_async ``rounds`` (each key's push number) is kept for the keys' numbering (a shard's).
        Raises, changing nothing, ``ValueError`` for a worker that is not active and
        :class:`ProtocolError` beyond the push window."""
        self._check_active(worker)
        if self.window and group.submitted.get(worker, 0) - group.applied.get(worker, 0) >= self.window:
            raise ProtocolError(f"key {group.keys[0]!r} and {len(group.keys) - 1} more: worker {worker} "
                                f"pushed beyond its window of {self.window} unacknowledged pushes "
                                "(KVSTORE_PUSH_WINDOW); refused, not buffered")
        group.submitted[worker] = group.submitted.get(worker, 0) + 1
        push_token = _SILENT if pull else token
        if not self.sync:
            self._apply_group(group, array, (worker,))
            if rounds is not None:
                group.numbered[worker] = rounds  # a reference: no per-key work here
            done = [] if pull else [Completion(token)]
        else:
            done = self._contribute(group, worker, push_token, array)
        if pull:
            done += self.pull_group(group, worker, token)
        return done

    def _contribute(self, group: KeyGroup, worker: int, token: Any, array: np.ndarray) -> list[Completion]:
        number = max(group.next_round.get(worker, group.base), group.base)
        i = number - group.base
        if i == len(group.rounds):
            group.rounds.append(_GroupRound(self._ranks, self.clock()))
        rnd = group.rounds[i]
        if rnd.acc is None:
            rnd.acc = array  # no copy; never written to
        elif not rnd.owned:
            rnd.acc, rnd.owned = rnd.acc + array, True
        else:
            rnd.acc += array
        rnd.tokens[worker] = [token]
        rnd.complete.add(worker)
        rnd.last = worker
        group.next_round[worker] = number + 1
        return self._close_group_rounds(group) if i == 0 else []

    def _close_group_rounds(self, group: KeyGroup) -> list[Completion]:
        """Close the group's oldest rounds while every active worker has pushed them; return the acks
        and the pulls this releases."""
        done: list[Completion] = []
        rounds, active = group.rounds, self.active
        if not (rounds and len(rounds[0].complete) >= len(active) and active <= rounds[0].complete):
            return done
        while rounds and len(rounds[0].complete) >= len(active) and active <= rounds[0].complete:
            rnd = rounds.popleft()
            group.base += 1
            self._apply_group(group, rnd.acc, rnd.complete)
            if self.on_close is not None:
                self.on_close(group.keys[0], self.clock() - rnd.opened, rnd.last, len(group.keys))
            done += [Completion(t) for tokens in rnd.tokens.values() for t in tokens if t is not _SILENT]
        return done + self._release_group_pulls(group) if group.waiting else done

    def _apply_group(self, group: KeyGroup, total: np.ndarray, workers: Iterable[int]) -> None:
        if self.updater is not None and len(group.keys) == 1:
            total = self.updater(group.keys[0], total, group.value)
        elif self.updater is not None:  # the optimizer updates each key (its state is per key)
            old, new, offsets = group.value, np.empty_like(group.value), group.offsets
            for i, key in enumerate(group.keys):
                a, b = offsets[i], offsets[i + 1]
                new[a:b] = self.updater(key, total[a:b], old[a:b])
            total = new
        group.value = total
        for worker in workers:
            group.applied[worker] = group.applied.get(worker, 0) + 1

    def pull_group(self, group: KeyGroup, worker: int, token: Any) -> list[Completion]:
        """Answer ``token`` with the group's whole value once ``worker``'s pushes of it are applied.
        Raises ``ValueError`` if ``worker`` is not a rank."""
        self._check_worker(worker)
        target = group.submitted.get(worker, 0)
        if group.applied.get(worker, 0) >= target:
            return [Completion(token, group.value)]
        group.waiting.append((token, worker, target))
        return []

    def _release_group_pulls(self, group: KeyGroup) -> list[Completion]:
        ready, waiting, applied = [], [], group.applied
        for entry in group.waiting:
            (ready if applied.get(entry[1], 0) >= entry[2] else waiting).append(entry)
        group.waiting = waiting
        return [Completion(token, group.value) for token, _, _ in ready]

    # -- back to per-key state ----------------------------------------------------------------------
    def _dissolve(self, group: KeyGroup) -> None:
        """Give every key of ``group`` its own state back (see the module docstring)."""
        base0, sub0, app0, next0 = group.start
        offsets, split = group.offsets, self.split
        for i, key in enumerate(group.keys):
            a, b = offsets[i], offsets[i + 1]
            state = self._keys[key]
            state.value = group.value[a:b]
            state.base = base0 + group.base
            state.submitted = _added(sub0, group.submitted)
            state.applied = _added(app0, group.applied)
            state.next_round = {**next0, **{w: base0 + r for w, r in group.next_round.items()}}
            for w, numbers in group.numbered.items():  # dist_async: as ShardState._number records it
                state.numbered[w] = max(state.numbered.get(w, 0), numbers[i] + 1)
            for g in group.rounds:
                state.rounds.append(_split_round(g, a, b, i, split))
            state.waiting_pulls.extend((split(t, i), w, sub0.get(w, 0) + target, 0, b - a)
                                       for t, w, target in group.waiting)
            del self._grouped[key]
        del self._groups[group.keys]

    def settle(self) -> None:
        """Dissolve every group: each key's own state is then current."""
        for group in list(self._groups.values()):
            self._dissolve(group)

    def progress(self) -> int:
        """As :meth:`ShardState.progress`, reading each key group's own counts (none is dissolved)."""
        groups = self._groups.values()
        if self.sync:
            grouped = max((g.start[0] + g.base for g in groups), default=0)
        else:
            grouped = max((max(_added(g.start[2], g.applied).values(), default=0) for g in groups), default=0)
        return max(grouped, super().progress())

    # -- ShardState's per-key entry points, made group-aware ------------------------------------------
    def _get(self, key: Key) -> _KeyState:
        group = self._grouped.get(key)
        if group is not None:
            self._dissolve(group)
        return super()._get(key)

    def held_bytes(self) -> int:
        """As :meth:`ShardState.held_bytes`, group rounds included."""
        return super().held_bytes() + sum(g.held_bytes() for g in self._groups.values())

    def open_rounds(self) -> int:
        """As :meth:`ShardState.open_rounds`: a group's round counts once per key."""
        return super().open_rounds() + sum(len(g.rounds) * len(g.keys) for g in self._groups.values())

    def stalled(self, older_than: float) -> list[tuple[Key, float, list[int]]]:
        """As :meth:`ShardState.stalled`; a group with such a round is dissolved first (a stall is rare)."""
        now = self.clock()
        for group in [g for g in self._groups.values() if g.rounds and now - g.rounds[0].opened > older_than]:
            self._dissolve(group)
        return super().stalled(older_than)

    def leave(self, worker: int) -> list[Completion]:
        """As :meth:`ShardState.leave` (every group is dissolved first)."""
        self.settle()
        return super().leave(worker)


def _added(start: dict[int, int], since: dict[int, int]) -> dict[int, int]:
    """Per-worker counts ``start`` plus ``since``."""
    return {w: start.get(w, 0) + since.get(w, 0) for w in {*start, *since}}


def _split_round(group_round: _GroupRound, a: int, b: int, i: int, split: Callable[[Any, int], Any]) -> Round:
    """The per-key round of elements ``[a, b)`` (the ``i``-th key) of an open group round."""
    rnd = Round(list(group_round.ranks), group_round.opened)
    if group_round.acc is not None:
        rnd.acc, rnd.owned = group_round.acc[a:b], group_round.owned
        part = rnd.parts[0] = ChunkRange(b - a)
        part.last = group_round.last
    rnd.tokens = {w: [t if t is _SILENT else split(t, i) for t in tokens]
                  for w, tokens in group_round.tokens.items()}
    rnd.covered = {w: b - a for w in group_round.complete}
    rnd.complete = set(group_round.complete)
    rnd.last = group_round.last
    return rnd


