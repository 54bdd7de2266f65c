"""The dist store's collective calls on the servers' optimizer, its state and snapshots.

:class:`CollectiveCalls` serves :class:`kvstore.client.store.DistKVStore`'s
``set_optimizer``, ``set_optimizer_params``, ``get_optimizer``, optimizer-state save
and load, ``save_checkpoint`` and the ``KVSTORE_RESUME`` restore.  It sees its store
only through a :class:`StoreLink`: the few callables (and values) the store hands it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.client import sparse_states
from kvstore.client.mux import Request
from kvstore.client.sparse import DEFAULT_CHUNK_BYTES, DistRows, SetCall
from kvstore.core import checkpoint, snapshot
from kvstore.core import optimizer as kvoptimizer
from kvstore.core.dtypes import BF16
from kvstore.core.partition import Key, Piece
from kvstore.core.plan import plan
from kvstore.core.values import Meta
from kvstore.errors import DeadlineExceededError, KVStoreError, OptimizerError
from kvstore.net.protocol import Message, Op


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars as Python numbers and maps as [key, value] pairs, for the wire."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return [[_plain(k), _plain(v)] for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class StoreLink:
    """What the collective calls use of their store, and nothing more."""

    run_collective: Callable[[str, Callable[[], Any]], None]  # action on the leader; its failure on all
    barrier: Callable[[], None]  # the store's barrier(): this worker's pushes applied, every worker met
    submit: Callable[[int, Message, str], Request]  # queue one message to a server (index, msg, what)
    request_all: Callable[[list[Request]], list[Message]]  # wait for replies, under the request timeout
    pieces: Callable[[Key], list[Piece]]  # where an initialised key's value lives
    metas: Callable[[], dict[Key, Meta]]  # a copy of the initialised keys' metas
    pull: Callable[[list[Key]], list[Any]]  # the current values of initialised keys
    servers: Sequence[str]  # the servers' addresses, by index
    resume: str | None  # the KVSTORE_RESUME snapshot directory, if any
    chunk_bytes: int = 0  # the cluster's chunk size (from the map): big state slices go in chunks
    save_residuals: Callable[[str], None] | None = None  # this worker's compression residuals, per rank
    rows: DistRows | None = None  # the store's row-sparse keys: their states (client/sparse_states.py)
    sparse_metas: Callable[[], dict] = dict  # a copy of the row-sparse keys' metas


class CollectiveCalls:
    """set_optimizer, states, snapshots and resume for a dist store (see the module docstring)."""

    def __init__(self, link: StoreLink) -> None:
        self._link = link
        self._restored: tuple | None = None  # (values, states) of the KVSTORE_RESUME snapshot, rank 0
        self._states_resumed = False

    # -- resume ----------------------------------------------------------------------------------
    def _snapshot(self) -> tuple:
        """The (values, states) of the ``KVSTORE_RESUME`` snapshot, read once (by rank 0)."""
        if self._restored is None:  # tables (and values past a chunk) left in the files: read as sent
            self._restored = snapshot.read(self._link.resume, self._link.chunk_bytes or DEFAULT_CHUNK_BYTES)
        return self._restored

    def resumed(self, items: list[tuple[Key, np.ndarray]]) -> list[tuple[Key, np.ndarray]]:
        """``items`` where, under ``KVSTORE_RESUME``, each key the snapshot holds has the snapshot's
        value.  Raises FormatError for a damaged snapshot, a shape or dtype error for a misfit."""
        if self._link.resume is None:
            return items
        values, _ = self._snapshot()
        resumed = []
        for key, array in items:
            if key in values:
                snapshot.check_fits(values, key, array.shape, array.dtype)
                array = values[key]
                if isinstance(array, checkpoint.Stored):  # a dense key: sent whole, so read whole
                    array = array.read()
            resumed.append((key, array))
        return resumed

    def resumed_table(self, key: Key, shape: tuple[int, ...], dtype: np.dtype) -> snapshot.Read | None:
        """Under ``KVSTORE_RESUME``, the snapshot's value of row-sparse ``key`` (None when it has none; a
        dynamic table's is a RowSparse of its rows, or a HeldRows left in the file; a big fixed
        table's a Stored array: both read a chunk at a time as they are sent); raises like
        :meth:`resumed`."""
        if self._link.resume is None:
            return None
        values, _ = self._snapshot()
        if key not in values:
            return None
        snapshot.check_fits(values, key, shape, dtype)
        return values[key]

    def initialised(self, keys: list[Key]) -> None:
        """Under ``KVSTORE_RESUME``, give keys initialised after the optimizer was restored their
        snapshot state too (collective, like the init that calls it); raises what that raises."""
        if self._link.resume is None or not self._states_resumed:
            return
        self._link.run_collective("restoring the snapshot's optimizer state of new keys",
                                  lambda: self._resume_states(set(keys), install=False))

    def _resume_states(self, keys: set | None = None, install: bool = True) -> None:
        """Send the snapshot's state of ``keys`` (default: every initialised key) to the servers;
        with ``install``, first set the optimizer in effect again with the snapshot's update count."""
        _, states = self._snapshot()
        if states is None:
            return
        metas = {**self._link.metas(), **self._link.sparse_metas()}
        known = set(metas) if keys is None else set(keys) & set(metas)
        kept = checkpoint.StatesFile(None, states.num_update, [e for e in states.entries if e.key in known])
        self._scatter_states_file(kept, f"the snapshot in {self._link.resume}", install)

    # -- plumbing --------------------------------------------------------------------------------
    def _meet(self) -> KVStoreError | None:
        """barrier(), but an earlier push's failure is returned, so the caller still meets the others."""
        try:
            self._link.barrier()
        except DeadlineExceededError:
            raise
        except KVStoreError as exc:
            return exc
        return None

    def _to_servers(self, op: Op, body: dict[str, Any], what: str) -> list[Message]:
        """Send one control message to every server; return their replies in server order."""
        link = self._link
        return link.request_all([link.submit(i, Message(op, dict(body)), f"{what} to server {i}")
                                 for i in range(len(link.servers))])

    def _optimizer_info(self) -> list[Message]:
        return self._to_servers(Op.OPTIMIZER_INFO, {}, "optimizer query")

    # -- optimizer -------------------------------------------------------------------------------
    def set_optimizer(self, optimizer: kvoptimizer.Optimizer) -> None:
        """Install ``optimizer`` on every server (collective), then any snapshot state to resume from.

        Raises the failure of an earlier push (after the others were met) or of the install."""
        spec = optimizer.spec()
        earlier = self._meet()  # pushes made before are applied without the optimizer
        self._link.run_collective("set_optimizer", lambda: self._to_servers(
            Op.OPTIMIZER_SET, {"spec": spec}, "set_optimizer"))
        if self._link.resume is not None and not self._states_resumed:
            # the first optimizer continues from the snapshot's state (retried if this fails)
            self._link.run_collective("restoring the snapshot's optimizer state", self._resume_states)
            self._states_resumed = True
        _raise(earlier)

    def set_optimizer_params(self, params: dict[str, Any]) -> None:
        """Send new hyper-parameters to every server; raises OptimizerError as the servers do."""
        params = {name: _plain(value) for name, value in params.items()}
        self._to_servers(Op.OPTIMIZER_PARAMS, {"params": params}, "set_optimizer_params")

    def get_optimizer(self) -> kvoptimizer.Optimizer | None:
        """A copy of the servers' optimizer (spec, and the highest update count of any server), or None."""
        info = [m.body for m in self._optimizer_info()]
        if info[0]["spec"] is None:
            return None
        optimizer = kvoptimizer.from_spec(info[0]["spec"])
        optimizer.num_update = max(i["num_update"] for i in info)  # a server may hold no updated key
        return optimizer

    # -- states and snapshots --------------------------------------------------------------------
    def save_states(self, fname: str, dump_optimizer: bool, collective: bool = True) -> None:
        """Gather every key's optimizer state and write it to ``fname`` on the leader (collective), or,
        without ``collective``, on this worker alone with no barrier (the states the servers hold now).

        Raises OptimizerError when no optimizer is set, OSError from the file system."""
        if not collective:
            checkpoint.write_states(fname, self._gather_states(dump_optimizer))
            return
        earlier = self._meet()  # every worker's pushes are applied before the states are read
        self._link.run_collective("save_optimizer_states", lambda: checkpoint.write_states(
            fname, self._gather_states(dump_optimizer)))
        _raise(earlier)

    def _gather_states(self, dump_optimizer: bool) -> checkpoint.StatesFile:
        info = [m.body for m in self._optimizer_info()]
        if info[0]["spec"] is None:
            raise OptimizerError("save_optimizer_states: no optimizer is set (call set_optimizer)")
        metas = self._link.metas()
        keys = list(metas)
        requests = [[self._state_get(k, p) for p in self._link.pieces(k)] for k in keys]
        replies = iter(self._link.request_all([r for group in requests for r in group]))
        entries = []
        for key, group in zip(keys, requests):
            entry = self._state_entry(key, metas[key], [next(replies) for _ in group])
            if entry is not None:
                entries.append(entry)
        if self._link.rows is not None:
            entries.extend(sparse_states.gather(self._link.rows, self._link.sparse_metas()))
        return checkpoint.StatesFile(info[0]["spec"] if dump_optimizer else None,
                                     max(i["num_update"] for i in info), entries)

    def _state_get(self, key: Key, piece: Piece) -> Request:
        what = f"state_get of key {key!r} to server {piece.server} ({self._link.servers[piece.server]})"
        return self._link.submit(piece.server, Message(Op.STATE_GET, {"key": key}, []), what)

    @staticmethod
    def _state_entry(key: Key, meta: Meta, parts: list[Message]) -> checkpoint.StateEntry | None:
        names = {tuple(m.body["names"]) for m in parts}
        if len(names) != 1:
            raise OptimizerError(f"the servers disagree on the optimizer state of key {key!r}: {names}")
        (state_names,) = names
        if not state_names:
            return None  # never updated: nothing to save
        arrays = {name: np.concatenate([m.arrays[i] for m in parts]).reshape(meta.shape)
                  for i, name in enumerate(state_names)}
        return checkpoint.StateEntry(key, meta.shape, meta.dtype, max(m.body["count"] for m in parts),
                                     arrays)

    def save_checkpoint(self, directory: str) -> None:
        """Write every key's value and optimizer state as a new snapshot generation (collective).

        Raises OSError from the file system, or the failure of an earlier push."""
        earlier = self._meet()  # every worker's pushes are applied: no round is open

        def write() -> None:
            has_optimizer = self._optimizer_info()[0].body["spec"] is not None
            states = self._gather_states(True) if has_optimizer else None
            keys = list(self._link.metas())
            values = dict(zip(keys, self._link.pull(keys)))
            if self._link.rows is not None:  # row-sparse tables, whole (client/sparse_states.py)
                values.update(sparse_states.tables(self._link.rows, self._link.sparse_metas()))
            snapshot.write(directory, values, states)

        self._link.run_collective("save_checkpoint", write)
        if self._link.save_residuals is not None:  # each worker its own, into the generation just written
            self._link.save_residuals(directory)
        _raise(earlier)

    def load_states(self, fname: str) -> None:
        """Read the states in ``fname`` on the leader and install them on every server (collective).

        Raises FormatError, OptimizerError or a key error when the file does not fit."""
        earlier = self._meet()
        sparse = self._link.sparse_metas()

        def load() -> None:  # a row-sparse table's state is left in the file, read as it is sent
            self._scatter_states_file(checkpoint.read_states(fname, lambda key, _: key in sparse), fname)
        self._link.run_collective("load_optimizer_states", load)
        _raise(earlier)

    def _scatter_states_file(self, states: checkpoint.StatesFile, source: str, install: bool = True) -> None:
        """Check ``states`` against the keys, then install them on every server (any server count).

        With ``install`` the optimizer is set again first (dropping every state) with the file's
        update count; without, the states are added to those the servers hold."""
        spec = states.optimizer or self._optimizer_info()[0].body["spec"]
        if spec is None:
            raise OptimizerError(f"load_optimizer_states: {source} holds no optimizer and none is set "
                                 "(call set_optimizer first, or save with dump_optimizer=True)")
        sparse = self._link.sparse_metas()  # row-sparse keys' states go their own way
        rows_entries = [e for e in states.entries if e.key in sparse]
        states = checkpoint.StatesFile(states.optimizer, states.num_update,
                                       [e for e in states.entries if e.key not in sparse])
        sparse_states.check(rows_entries, sparse, kvoptimizer.from_spec(spec))
        for entry in states.entries:  # a dense key's state left in the file (a big one): sent whole
            entry.arrays = {n: a.read() if isinstance(a, checkpoint.Stored) else a
                            for n, a in entry.arrays.items()}
        metas = self._link.metas()  # servers hold a bfloat16 key as a float32 master copy
        shapes = {k: np.zeros(m.shape, np.float32 if m.dtype == BF16 else m.dtype) for k, m in metas.items()}
        declared = {k: m.dtype for k, m in metas.items()}
        checkpoint.restore_optimizer(states, kvoptimizer.from_spec(spec), shapes, declared)  # checks it all
        if install:
            self._to_servers(Op.OPTIMIZER_SET, {"spec": spec, "num_update": states.num_update},
                             "load_optimizer_states")
        call = None if self._link.rows is None else SetCall(self._link.rows)  # settled once in a shard
        requests = []
        for entry in states.entries:
            requests.extend(self._send_state(entry, call))
        self._link.request_all(requests)
        if rows_entries:
            sparse_states.scatter(self._link.rows, rows_entries, sparse, call)
        if call is not None:
            call.settle()

    def _send_state(self, entry: checkpoint.StateEntry, call: SetCall | None = None) -> list[Request]:
        """Queue STATE_SET messages of one key's state: per server its slice of every state array,
        in chunks (``lo``) cut as a push of that slice would be when it is big, so every frame fits
        the cluster's ``KVSTORE_MAX_MESSAGE_BYTES`` (each stamped as a set of ``call``); return their
        requests."""
        names = list(entry.arrays)
        flats = [np.ascontiguousarray(entry.arrays[n]).reshape(-1) for n in names]
        pieces = self._link.pieces(entry.key)
        if flats:  # cut by the widest dtype, so no state's chunk is bigger than a push's
            widest = max((f.dtype for f in flats), key=lambda d: d.itemsize)
            sends = plan([(entry.key, widest, pieces)], 0, self._link.chunk_bytes)
            cuts = [(s.server, s.parts[0].start, s.parts[0].stop, s.lo) for s in sends]
        else:
            cuts = [(p.server, p.start, p.stop, None) for p in pieces]
        requests = []
        for server, start, stop, lo in cuts:
            body = {"key": entry.key, "count": entry.count, "names": names}
            if call is not None:
                body = call.stamp(server, entry.key, body)
            if lo is not None:
                body["lo"] = lo
            what = f"optimizer state of key {entry.key!r} to server {server}"
            arrays = [f[start:stop] for f in flats]
            requests.append(self._link.submit(server, Message(Op.STATE_SET, body, arrays), what))
        return requests
