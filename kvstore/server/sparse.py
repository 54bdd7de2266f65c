"""A server's handlers for row-sparse keys (SPARSE_INIT, SPARSE_SET, SPARSE_PUSH, SPARSE_PULL) over its
:class:`kvstore.core.sparse_shard.RowTables`, and the optimizer's sparse update (docs/sparse.md).

Every field is checked before anything changes; a bad request gets an error reply.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.core import compression as C
from kvstore.core import rowsparse as R
from kvstore.core.dynamic import (
    DynamicRows,
    apply_dynamic,
    fit_state,
    full_bytes,
    load_state,
    state_of,
    table_label,
)
from kvstore.core.partition import Key, check_key
from kvstore.core.replies import Completion
from kvstore.core.sparse_shard import RowTables
from kvstore.core.sparse_update import apply_rows
from kvstore.core.staleness import StalenessGate
from kvstore.errors import (
    ConfigError,
    DTypeMismatchError,
    NodeLostError,
    OptimizerError,
    ProtocolError,
    UnsupportedError,
)
from kvstore.net.protocol import Message, Op
from kvstore.net.router import Handler
from kvstore.server.requests import Requests

log = logging.getLogger("kvstore.server")


def _physical_memory() -> int:
    """This machine's memory in bytes (a table range beyond it is refused, not attempted)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _int(body: dict, name: str, low: int = 0) -> int:
    value = body.get(name)
    if type(value) is not int or not low <= value < 2**63:  # a count past int64 could not be sent back
        raise ProtocolError(f"field {name!r} must be an int in [{low}, 2**63), not {value!r} "
                            f"({type(value).__name__})")
    return value


class SparseServer:
    """The row-sparse part of one server: its tables and the four handlers."""

    def __init__(self, requests: Requests) -> None:
        self.requests = requests  # its replies, and the server's optimizer
        self.tables = RowTables()
        self.tables.updater = self._update
        self.tables.dynamic_updater = self._update_dynamic
        self.max_bytes = 0
        self.settle: Callable[[bytes, int, int, tuple[int, int]], None] = self._settled_now
        # ^ (identity, seq, sets, (worker, call)): a settle request, answered once its sets are in a shard

    def configure(self, num_workers: int, sync: bool, window: int, max_bytes: int = 0,
                  staleness: int | None = None, quorum: int | None = None, ordered: bool = False) -> None:
        """Set the cluster's worker count and mode (from the map), the largest reply of rows
        (``KVSTORE_MAX_MESSAGE_BYTES``, 0: no limit), dist_async's ``staleness`` bound, dist_sync's
        ``quorum`` (None: none) and whether a round's rows are summed in rank order
        (``KVSTORE_SUM_ORDER=rank``)."""
        self.tables = RowTables(num_workers, sync, window or (1 << 30), ordered=ordered)  # 0: no limit
        if not sync and staleness is not None:
            self.tables.gate = StalenessGate(staleness, window)
        if sync and quorum is not None and quorum < num_workers:
            self.tables.quorum = quorum
        self.max_bytes = max_bytes
        self.tables.updater = self._update
        self.tables.dynamic_updater = self._update_dynamic

    def handlers(self) -> dict[Op, Handler]:
        """The ops this part serves."""
        return {Op.SPARSE_INIT: self._on_init, Op.SPARSE_SET: self._on_set,
                Op.SPARSE_PUSH: self._on_push, Op.SPARSE_PULL: self._on_pull}

    def __contains__(self, key: object) -> bool:
        return key in self.tables

    def nbytes(self) -> int:
        """Bytes of the row ranges held and of their optimizer state."""
        opt = self.requests.optimizer
        states = {} if opt is None else opt.states
        held = (a.nbytes for k in self.tables.tables for a in states.get(k, {}).values())
        return self.tables.nbytes() + sum(held)

    def dynamic_stats(self) -> dict[str, dict]:
        """Each dynamic table's counters here (:meth:`DynamicRows.stats`), by :func:`table_label`."""
        return {table_label(k): t.dynamic.stats() for k, t in self.tables.tables.items()
                if t.dynamic is not None}

    def _update(self, key: Key, weight: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        apply_rows(self.requests.optimizer, key, weight, ids, rows)

    def _update_dynamic(self, key: Key, table: DynamicRows, ids: np.ndarray, rows: np.ndarray) -> None:
        apply_dynamic(self.requests.optimizer, key, table, ids, rows)

    def _sender(self, msg: Message) -> int:
        if not (type(msg.sender) is int and 0 <= msg.sender < self.tables.num_workers):
            raise ProtocolError(f"{msg.op.name} carries no valid worker rank (got {msg.sender!r})")
        return msg.sender

    def _rows(self, msg: Message, with_rows: bool) -> tuple[Key, np.ndarray, np.ndarray | None]:
        key = check_key(msg.body.get("key"))
        self._sender(msg)
        if len(msg.arrays) != (2 if with_rows else 1):
            wanted = "ids and rows" if with_rows else "ids"
            raise ProtocolError(f"{msg.op.name} of key {key!r} needs {wanted}")
        return key, msg.arrays[0], msg.arrays[1] if with_rows else None

    def _reply_all(self, done: list[Completion]) -> None:
        for c in done:
            identity, seq = c.token
            arrays = [] if c.value is None else [c.value]
            self.requests.reply(identity, Message(Op.OK, seq=seq, arrays=arrays))

    def _on_init(self, identity: bytes, msg: Message) -> None:
        key = check_key(msg.body.get("key"))
        self._sender(msg)
        if msg.body.get("dynamic") is not None:
            self._init_dynamic(identity, msg, key)
            return
        shape, dtype = R.wire_meta(key, msg.body.get("shape"), msg.body.get("dtype"))
        lo, hi = _int(msg.body, "lo"), _int(msg.body, "hi")
        if not lo < hi <= shape[0]:
            raise ProtocolError(f"SPARSE_INIT of key {key!r}: rows [{lo}, {hi}) are not in [0, {shape[0]})")
        try:
            spec = R.parse_init(key, msg.body.get("init"))
        except (ValueError, TypeError) as exc:
            raise ProtocolError(str(exc)) from None
        need = (hi - lo) * math.prod(shape[1:]) * dtype.itemsize  # exact: no int64 wrap-around
        held = self.nbytes()  # what this server's tables and their state already take
        if need + held > _physical_memory():
            raise ConfigError(f"row_sparse key {key!r}: rows [{lo}, {hi}) take {need} bytes, more than this "
                              f"server's memory ({_physical_memory()} bytes) less the {held} bytes of its "
                              "row_sparse tables; start more servers")
        if self.requests.optimizer is not None and dtype.kind != "f":
            raise DTypeMismatchError(f"key {key!r}: the optimizer updates floating-point keys only")
        self.tables.init(key, shape, dtype, lo, hi, spec)
        log.debug("row_sparse key %r: rows [%d, %d) of %s", key, lo, hi, shape)
        self.requests.reply(identity, Message(Op.OK, seq=msg.seq))

    def _init_dynamic(self, identity: bytes, msg: Message, key: Key) -> None:
        """A dynamic table's SPARSE_INIT: ``shape`` is a row's shape, ``dynamic`` its DynamicSpec."""
        row = msg.body.get("shape")
        if not isinstance(row, list):
            raise ProtocolError(f"SPARSE_INIT of dynamic key {key!r} needs a row's shape (a list of ints)")
        shape, dtype = R.wire_meta(key, [1, *row], msg.body.get("dtype"))
        try:
            spec = R.parse_init(key, msg.body.get("init"))
            dynamic = R.parse_spec(key, msg.body.get("dynamic"))
        except (ValueError, TypeError) as exc:
            raise ProtocolError(str(exc)) from None
        if self.requests.optimizer is not None and dtype.kind != "f":
            raise DTypeMismatchError(f"key {key!r}: the optimizer updates floating-point keys only")
        width = math.prod(shape[1:])
        opt = self.requests.optimizer  # its state per row, as it stands now (one set later: not counted)
        one = np.zeros((1, width), dtype)
        state = 0 if opt is None else sum(a.nbytes for a in opt.create_state(key, one).values())
        need = full_bytes(dynamic, width, dtype, state)  # 0: no capacity, no bound to check here
        held = self.nbytes()
        if need + held > _physical_memory():
            raise ConfigError(f"dynamic key {key!r}: {dynamic.capacity} rows (with their id map, counters "
                              f"and optimizer state) take {need} bytes, more "
                              f"than this server's memory ({_physical_memory()} bytes) less the {held} "
                              "bytes of its row_sparse tables; lower its capacity or start more servers")
        self.tables.init_dynamic(key, (R.DYNAMIC_ROWS, *shape[1:]), DynamicRows(width, dtype, spec, dynamic))
        log.debug("dynamic row_sparse key %r: rows of %s, %s", key, shape[1:], dynamic)
        self.requests.reply(identity, Message(Op.OK, seq=msg.seq))

    def _settled_now(self, identity: bytes, seq: int, sets: int, call: tuple[int, int]) -> None:
        """Answer a settle request at once (a server without shards)."""
        self.tables.calls.pop(call, None)
        self.requests.reply(identity, Message(Op.OK, seq=seq))

    def _on_set(self, identity: bytes, msg: Message) -> None:
        if "settle" in msg.body:
            self._on_settle(identity, msg)
            return
        key, ids, rows = self._rows(msg, True)
        name = msg.body.get("state")
        call = None
        if "call" in msg.body:  # one of the sets of an init or load, settled at its end
            call = (msg.sender, _int(msg.body, "call"), _int(msg.body, "part"))
        if name is None and self.tables.table(key).dynamic is not None:
            self._set_dynamic_rows(key, ids, rows)
            self.tables.note_set(call)
        elif name is None:
            self.tables.set_rows(key, ids, rows, call)
        else:
            if not isinstance(name, str):
                raise ProtocolError(f"SPARSE_SET of key {key!r}: 'state' must be a state's name, "
                                    f"not {name!r}")
            self._set_state(key, name, _int(msg.body, "count"), ids, rows)
            self.tables.note_set(call)
        self.requests.reply(identity, Message(Op.OK, seq=msg.seq))

    def _on_settle(self, identity: bytes, msg: Message) -> None:
        """The end of an init's or load's sets (``settle``: its call, ``parts``: how many sets it sent
        here): answered once a shard holding them is written (``settle``), so a restart cannot bring
        back what they overwrote after they were acknowledged.  NodeLostError when this server did
        not take them all: a restart (from a shard without them) came in between."""
        sender = self._sender(msg)
        call, parts = _int(msg.body, "settle"), _int(msg.body, "parts")
        if not self.tables.settles(sender, call, parts):
            self.tables.calls.pop((sender, call), None)
            raise NodeLostError(f"row messages of an init or load of row_sparse keys set on this server "
                                f"were lost in its restart before a shard held them ({parts} sent); the "
                                "keys hold the rows or states of before: load them again", role="server")
        self.settle(identity, msg.seq, self.tables.sets, (sender, call))

    def _set_dynamic_rows(self, key: Key, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store rows of distinct ``ids`` in dynamic ``key`` (a resumed snapshot): made (their state
        fresh) or overwritten; rows there is no room for are dropped, and logged."""
        table, _ = self.tables.local_ids(key, ids)
        dynamic = table.dynamic
        assert dynamic is not None
        if rows.dtype != dynamic.dtype or rows.shape != (ids.size, dynamic.width):
            raise ProtocolError(f"SPARSE_SET of dynamic key {key!r}: rows must be {dynamic.dtype}"
                                f"({ids.size}, {dynamic.width}), got {rows.dtype}{rows.shape}")
        slots, fresh = dynamic.put(ids)
        if self.requests.optimizer is not None:
            fit_state(self.requests.optimizer, key, dynamic.weight, fresh)
        keep = slots >= 0
        dynamic.weight[slots[keep]] = rows[keep]
        if not keep.all():
            log.warning("dynamic key %r: no room for %d of the rows set", key, int((~keep).sum()))

    def _set_state(self, key: Key, name: str, count: int, ids: np.ndarray, rows: np.ndarray) -> None:
        """Overwrite rows ``ids`` of state array ``name`` of ``key`` (a load_optimizer_states), making
        the key's state first if it has none; OptimizerError for a name the optimizer does not keep."""
        opt = self.requests.optimizer
        if opt is None:
            raise OptimizerError(f"setting the optimizer state of key {key!r}: no optimizer is set")
        table, local = self.tables.local_ids(key, ids)
        if table.dynamic is not None:
            lost = load_state(opt, key, table.dynamic, ids, {name: rows}, count, whole=False)
            if lost:
                log.warning("dynamic key %r: no room for %d rows of loaded optimizer state", key, lost)
            return
        state = opt.states.get(key)
        if state is None or any(a.shape != table.weight.shape for a in state.values()):
            state = opt.create_state(key, table.weight)
        if name not in state:
            raise OptimizerError(f"key {key!r}: {opt.name} keeps no state {name!r} (it keeps "
                                 f"{sorted(state)})")
        if rows.shape != (ids.size, table.width) or rows.dtype != state[name].dtype:
            raise OptimizerError(f"key {key!r}: state {name!r} rows must be {state[name].dtype}"
                                 f"({ids.size}, {table.width}), got {rows.dtype}{rows.shape}")
        state[name][local] = rows
        opt.states[key] = state
        opt.counts[key] = count
        opt.num_update = max(opt.num_update, count)

    def _on_push(self, identity: bytes, msg: Message) -> None:
        key, ids, rows = self._rows(msg, True)
        rnd, last = _int(msg.body, "round"), msg.body.get("last")
        if type(last) is not bool:
            raise ProtocolError(f"SPARSE_PUSH of key {key!r} needs 'last' (a bool)")
        if msg.body.get("quantised") is not None:  # 2bit / 1bit: the rows' packed words, float32 again
            rows = self._dequantise(key, msg.body["quantised"], ids, rows)
        half = msg.body.get("half")
        if half is not None:  # fp16 / bf16 compression: float32 rows again (the table's check follows)
            if half not in C.CASTS or rows.dtype != np.float16:  # bf16: its bits, in a 2-byte dtype
                raise ProtocolError(f"SPARSE_PUSH of key {key!r}: 'half' {half!r} with {rows.dtype} rows")
            rows = C.from_half(half, np.ascontiguousarray(rows).reshape(-1)).reshape(rows.shape)
        self._reply_all(self.tables.push(msg.sender, key, rnd, last, ids, rows, (identity, msg.seq)))

    def _dequantise(self, key: Key, field: Any, ids: np.ndarray, packed: np.ndarray) -> np.ndarray:
        """The float32 rows ``(ids.size, width)`` that 2bit / 1bit ``packed`` words stand for (the
        worker kept the residual).  ProtocolError for a bad ``[type, threshold]``, a table that is
        not float32, or words that are not one flat float32 array of the packed length."""
        if not (isinstance(field, list) and len(field) == 2 and field[0] in C.QUANTISED
                and C.finite_threshold(field[1]) and (field[0] != "2bit" or field[1] > 0)):
            raise ProtocolError(f"SPARSE_PUSH of key {key!r}: 'quantised' must be [type, threshold] with a "
                                f"type of {list(C.QUANTISED)} (2bit: threshold > 0); got {repr(field)[:80]}")
        table = self.tables.table(key)
        if table.dtype != np.float32 or ids.ndim != 1:
            raise ProtocolError(f"SPARSE_PUSH of key {key!r}: quantised rows need a float32 table and flat "
                                f"ids (it holds {table.dtype})")
        n = ids.size * table.width
        want = C.packed_size(field[0], n)
        if packed.dtype != np.float32 or packed.ndim != 1 or packed.size != want:
            raise ProtocolError(f"SPARSE_PUSH of key {key!r}: {field[0]} rows of {ids.size} ids need one "
                                f"flat float32 array of {want} words; got {packed.dtype}{packed.shape}")
        return C.dequantise(field[0], packed, n, float(field[1])).reshape(ids.size, table.width)

    def _on_pull(self, identity: bytes, msg: Message) -> None:
        key, ids, _ = self._rows(msg, False)
        after = _int(msg.body, "after")
        table = self.tables.table(key)
        admit = msg.body.get("admit", False)
        if type(admit) is not bool:
            raise ProtocolError(f"SPARSE_PULL of key {key!r}: 'admit' must be a bool, not {admit!r}")
        if self.max_bytes and ids.size * table.width * table.dtype.itemsize * 3 > self.max_bytes:  # adam
            raise ProtocolError(f"SPARSE_PULL of {ids.size} rows of key {key!r}: the reply could exceed "
                                f"KVSTORE_MAX_MESSAGE_BYTES={self.max_bytes}; ask in smaller messages")
        if msg.body.get("held") is not None:  # a dynamic table's rows held, by slots (a save)
            self.requests.reply(identity, self._held_rows(key, msg))
            return
        if msg.body.get("state") is True:  # the optimizer's state rows (save_optimizer_states)
            self.requests.reply(identity, self._state_rows(key, ids, msg.seq))
            return
        self._reply_all(self.tables.pull(msg.sender, key, after, ids, (identity, msg.seq), admit))

    def _held_rows(self, key: Key, msg: Message) -> Message:
        """The reply to a walk of dynamic ``key``'s pool: the rows held in slots ``[held, held +
        limit)`` as ``{next, count, names}`` (``next``: the next call's start, -1 when done) and arrays
        ``[ids, rows, *states]`` (with ``state``: the optimizer's rows of each state array, ``names``
        naming them; none when the key was never updated); ``rows``: how many it holds in all.
        Counts no use."""
        table = self.tables.table(key)
        if table.dynamic is None:
            raise ProtocolError(f"SPARSE_PULL of key {key!r}: 'held' walks dynamic tables only")
        start, limit = _int(msg.body, "held"), _int(msg.body, "limit", 1)
        row = table.width * max(table.dtype.itemsize, 4)
        if self.max_bytes:  # ids, rows, and adam's (or mixed precision's) three state arrays
            limit = max(1, min(limit, self.max_bytes // (5 * row + 8)))
        slots, after = table.dynamic.live_slots(start, limit)
        arrays = [table.dynamic.ids[slots], table.dynamic.weight[slots]]
        opt = self.requests.optimizer
        states = None
        if msg.body.get("state") is True and opt is not None:
            states = state_of(opt, key, table.dynamic, slots)
        names = [] if states is None else list(states)
        body = {"next": after, "count": 0 if opt is None else opt.counts.get(key, 0), "names": names,
                "rows": len(table.dynamic)}
        return Message(Op.OK, body, arrays + [states[n] for n in names], seq=msg.seq)

    def _state_rows(self, key: Key, ids: np.ndarray, seq: int) -> Message:
        """The reply to a state pull: ``{count, names}`` and the rows ``ids`` of each state array
        (no names when the key was never updated).  A key stepped with no row of this range yet (lazy
        updates) answers the fresh state its first update would make, as the other ranges' servers
        answer their state."""
        table, local = self.tables.local_ids(key, ids)
        if table.dynamic is not None:
            raise UnsupportedError(f"dynamic key {key!r}: its optimizer state is not saved yet")
        opt = self.requests.optimizer
        state = None if opt is None else opt.states.get(key)
        if state is not None:
            rows = {name: a[local] for name, a in state.items()}
        else:
            rows = opt.create_state(key, table.weight[local]) if opt is not None and key in opt.counts else {}
        body = {"count": 0 if opt is None else opt.counts.get(key, 0), "names": list(rows)}
        return Message(Op.OK, body, list(rows.values()), seq=seq)

    def leave(self, sender: int) -> None:
        """A worker left: answer what no longer waits for it."""
        self._reply_all(self.tables.leave(sender))

    # -- a worker's restart (kvstore.core.rejoin.RowRounds): the tables' side, their answers sent --

    def mark_away(self, worker: int) -> None:
        """``worker`` is lost, to be restarted: the tables' rounds close without it, scaled."""
        self._reply_all(self.tables.mark_away(worker))

    def first_round(self, worker: int) -> int:
        """The first round no table has opened here (dist_async: ``worker``'s most pushes of one)."""
        return self.tables.first_round(worker)

    def readmit(self, worker: int) -> int:
        """A restarted ``worker`` counts again from :meth:`first_round`, which is returned."""
        return self.tables.readmit(worker)

    def rejoin_at(self, worker: int, at: int) -> None:
        """``worker`` counts from round ``at`` of every table; answer the rounds that close."""
        self._reply_all(self.tables.rejoin_at(worker, at))
