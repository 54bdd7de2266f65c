"""The dist store's collective calls on the servers' optimizer, its state and snapshots.

A mixin of :class:`kvstore.dist.DistKVStore` (kept apart so each module stays
readable): ``set_optimizer``, ``set_optimizer_params``, ``get_optimizer``,
optimizer-state save and load, ``save_checkpoint`` and the ``KVSTORE_RESUME``
restore.  It uses the store's plumbing (``_collective``, ``_to_servers``,
``_pieces``, ``_send``, ``_request_all``, ``_pull``, ``barrier``, ``_io``,
``_meta``, ``_lock``, ``_cfg``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.core import checkpoint, snapshot
from kvstore.core import optimizer as kvoptimizer
from kvstore.core.partition import Key
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


class StateCalls:
    """set_optimizer, states, snapshots and resume for a dist store (see the module docstring)."""

    def _snapshot(self) -> tuple:
        """The (values, states) of the ``KVSTORE_RESUME`` snapshot, read once (by rank 0)."""
        if self._restored is None:
            self._restored = snapshot.read(self._cfg.resume)
        return self._restored

    def _resumed(self, items: list[tuple[Key, np.ndarray]]) -> list[tuple[Key, np.ndarray]]:
        """Under ``KVSTORE_RESUME`` each key the snapshot holds starts from the snapshot's value."""
        if self._cfg.resume is None:
            return items
        values, _ = self._snapshot()
        resumed = []
        for key, array in items:
            if key in values:
                snapshot.check_fits(values, key, array.shape, array.dtype)
                array = values[key]
            resumed.append((key, array))
        return resumed

    # -- optimizer -------------------------------------------------------------------------------
    def _set_optimizer(self, optimizer: kvoptimizer.Optimizer) -> None:
        spec = optimizer.spec()
        earlier = self._meet()  # pushes made before are applied without the optimizer
        self._collective("set_optimizer", lambda: self._to_servers(
            Op.OPTIMIZER_SET, {"spec": spec}, "set_optimizer"))
        if self._cfg.resume is not None and not self._states_resumed:
            # the first optimizer continues from the snapshot's state (retried if this fails)
            self._collective("restoring the snapshot's optimizer state", self._resume_states)
            self._states_resumed = True
        _raise(earlier)

    def _initialised(self, keys: list[Key]) -> None:
        """Under ``KVSTORE_RESUME``, keys initialised after the optimizer was restored get their
        snapshot state too (collective, like the init that calls it)."""
        if self._cfg.resume is None or not self._states_resumed:
            return
        self._collective("restoring the snapshot's optimizer state of new keys",
                         lambda: self._resume_states(set(keys), install=False))

    def _resume_states(self, keys: set | None = None, install: bool = True) -> None:
        """Send the snapshot's state of ``keys`` (default: every initialised key) to the servers;
        with ``install``, first set the optimizer in effect again with the snapshot's update count."""
        _, states = self._snapshot()
        if states is None:
            return
        with self._lock:
            known = set(self._meta) if keys is None else set(keys) & set(self._meta)
        kept = checkpoint.StatesFile(None, states.num_update, [e for e in states.entries if e.key in known])
        self._scatter_states_file(kept, f"the snapshot in {self._cfg.resume}", install)

    def _meet(self) -> KVStoreError | None:
        """barrier(), but an earlier push's failure is returned, so the caller still meets the others."""
        try:
            self.barrier()
        except DeadlineExceededError:
            raise
        except KVStoreError as exc:
            return exc
        return None

    def _set_optimizer_params(self, params: dict[str, Any]) -> None:
        params = {name: _plain(value) for name, value in params.items()}
        self._to_servers(Op.OPTIMIZER_PARAMS, {"params": params}, "set_optimizer_params")

    def _optimizer_info(self) -> list[Message]:
        return self._to_servers(Op.OPTIMIZER_INFO, {}, "optimizer query")

    def get_optimizer(self) -> kvoptimizer.Optimizer | None:
        """A copy of the servers' optimizer (spec, and the highest update count of any server), or None."""
        self._check_open()
        info = [m.body for m in self._optimizer_info()]
        if info[0]["spec"] is None:
            return None
        optimizer = kvoptimizer.from_spec(info[0]["spec"])
        optimizer.num_update = max(i["num_update"] for i in info)  # a server may hold no updated key
        return optimizer

    def _save_states(self, fname: str, dump_optimizer: bool) -> None:
        earlier = self._meet()  # every worker's pushes are applied before the states are read
        self._collective("save_optimizer_states", lambda: checkpoint.write_states(
            fname, self._gather_states(dump_optimizer)))
        _raise(earlier)

    def _gather_states(self, dump_optimizer: bool) -> checkpoint.StatesFile:
        info = [m.body for m in self._optimizer_info()]
        if info[0]["spec"] is None:
            raise OptimizerError("save_optimizer_states: no optimizer is set (call set_optimizer)")
        with self._lock:
            keys = list(self._meta)
        requests = [[self._send(Op.STATE_GET, k, p, None) for p in self._pieces(k)] for k in keys]
        replies = iter(self._request_all([r for group in requests for r in group]))
        entries = []
        for key, group in zip(keys, requests):
            entry = self._state_entry(key, [next(replies) for _ in group])
            if entry is not None:
                entries.append(entry)
        return checkpoint.StatesFile(info[0]["spec"] if dump_optimizer else None,
                                     max(i["num_update"] for i in info), entries)

    def _state_entry(self, key: Key, parts: list[Message]) -> checkpoint.StateEntry | None:
        meta = self._meta[key]
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

    def _save_checkpoint(self, directory: str) -> None:
        earlier = self._meet()  # every worker's pushes are applied: no round is open

        def write() -> None:
            has_optimizer = self._optimizer_info()[0].body["spec"] is not None
            states = self._gather_states(True) if has_optimizer else None
            with self._lock:
                keys = list(self._meta)
            snapshot.write(directory, dict(zip(keys, self._pull(keys, 0))), states)

        self._collective("save_checkpoint", write)
        _raise(earlier)

    def _load_states(self, fname: str) -> None:
        earlier = self._meet()
        self._collective("load_optimizer_states", lambda: self._scatter_states(fname))
        _raise(earlier)

    def _scatter_states(self, fname: str) -> None:
        self._scatter_states_file(checkpoint.read_states(fname), fname)

    def _scatter_states_file(self, states: checkpoint.StatesFile, source: str, install: bool = True) -> None:
        """Check ``states`` against the keys, then install them on every server (any server count).

        With ``install`` the optimizer is set again first (dropping every state) with the file's
        update count; without, the states are added to those the servers hold."""
        spec = states.optimizer or self._optimizer_info()[0].body["spec"]
        if spec is None:
            raise OptimizerError(f"load_optimizer_states: {source} holds no optimizer and none is set "
                                 "(call set_optimizer first, or save with dump_optimizer=True)")
        with self._lock:
            shapes = {k: np.zeros(m.shape, m.dtype) for k, m in self._meta.items()}
        checkpoint.restore_optimizer(states, kvoptimizer.from_spec(spec), shapes)  # checks it all
        if install:
            self._to_servers(Op.OPTIMIZER_SET, {"spec": spec, "num_update": states.num_update},
                             "load_optimizer_states")
        requests = []
        for entry in states.entries:
            names = list(entry.arrays)
            flats = [entry.arrays[n].reshape(-1) for n in names]
            for piece in self._pieces(entry.key):
                arrays = [f[piece.start:piece.stop] for f in flats]
                what = f"optimizer state of key {entry.key!r} to server {piece.server}"
                body = {"key": entry.key, "count": entry.count, "names": names}
                requests.append(self._io.submit(piece.server, Message(Op.STATE_SET, body, arrays), what))
        self._request_all(requests)
