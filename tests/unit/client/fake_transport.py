"""A fake transport for unit tests of :class:`DistKVStore`: no processes, no sockets.

:class:`FakeMux` stands where the worker's :class:`~kvstore.client.mux.Mux` stands and answers every
request at once from an in-memory cluster: a scheduler that answers barriers and leaves, and servers
that keep each key's slice as the servers of one ``dist_sync`` worker do (a push is applied at once,
a pull returns the slice).  A test can make an op go unanswered (``silent``) or answered with an error
reply (``refuse``), and reads what was sent (``sent``).  A parked push (``submit(park=True)``) is kept
unsent, as the Mux keeps it, until a pull takes it (``take_parked``) or any other call sends it first;
whether it is refused is decided when it is parked (the op's ``refuse`` then), as when it was pushed.
:func:`fake_store` builds a store over it
through the documented seam (``kvstore.client.store.Joined``).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from kvstore import config as kvconfig
from kvstore.client.mux import SCHEDULER, Mux, Parked, Request
from kvstore.client.store import DistKVStore, Joined
from kvstore.errors import StoreClosedError, error_code, error_from_code
from kvstore.net.protocol import Message, Op

SERVERS = ["tcp://10.0.0.1:9001", "tcp://10.0.0.2:9002"]  # never connected


class FakeMux(Mux):
    """A Mux whose requests are answered by an in-memory cluster of ``servers`` servers."""

    def __init__(self, servers: int) -> None:  # no sockets, so no Mux.__init__
        self.rank, self.lanes, self.names, self.channel = 0, None, {}, None
        self.pace_bytes = 1 << 62  # answered at once: nothing is paced
        self.slices: list[dict[Any, np.ndarray]] = [{} for _ in range(servers)]  # each server's slices
        self.sent: list[tuple[int, Message]] = []
        self.silent: set[Op] = set()  # ops left unanswered
        self.refuse: dict[Op, BaseException] = {}  # ops answered with this error (as a server's ERROR)
        self.failure: BaseException | None = None
        self._closed = False
        self._open: list[Request] = []  # unanswered
        self._parked: Parked | None = None
        self._parked_refusal: BaseException | None = None  # refuse[PUSH] when the push was parked

    def submit(self, target: int, msg: Message, what: str, after_failure: bool = False,
               reply_bytes: int = 0, chunk: tuple[int, int] | None = None, bypass: bool = False,
               priority: int = 0, keys: Any = None, defer: bool = False, park: bool = False) -> Request:
        """Record ``msg`` and answer it at once (unless its op is ``silent``), as Mux.submit resolves;
        nothing waits, so ``priority`` and ``defer`` change nothing.  ``park``: kept unsent (the
        module docstring); a parked push is sent before ``msg``."""
        if self._closed:
            raise StoreClosedError(f"{what}: the store is closed")
        self._unpark()
        request = Request(what, target=target, msg=msg)
        if park and self.failure is None:
            self._parked = Parked(request, target, 0, priority, keys)
            self._parked_refusal = self.refuse.get(msg.op)
            return request
        return self._answer_request(request, after_failure)

    def take_parked(self, target: int, keys: Any) -> Parked | None:
        """The parked push if it is of ``keys`` to ``target``, else None (it is sent first)."""
        if self._parked is not None and self._parked.target == target and self._parked.keys == keys:
            parked, self._parked = self._parked, None
            return parked
        self._unpark()
        return None

    def send_parked(self, parked: Parked, priority: int = 0) -> Request:
        """Send a push :meth:`take_parked` returned (its message changed by the caller)."""
        refusal, self._parked_refusal = self._parked_refusal, None
        return self._answer_request(parked.request, refusal=refusal)

    def send_parked_as(self, target: int, keys: Any, op: Op, priority: int = 0,
                       before: Any = None) -> Request | None:
        """:meth:`take_parked`, then send it as ``op`` (``before(request)`` first), as the Mux does."""
        parked = self.take_parked(target, keys)
        if parked is None:
            return None
        if before is not None:
            before(parked.request)
        parked.request.msg.op = op
        return self.send_parked(parked, priority)

    def _unpark(self) -> None:
        parked, self._parked = self._parked, None
        if parked is not None:
            refusal, self._parked_refusal = self._parked_refusal, None
            self._answer_request(parked.request, refusal=refusal)

    def _answer_request(self, request: Request, after_failure: bool = False,
                        refusal: BaseException | None = None) -> Request:
        """Record ``request``'s message and answer it (see :meth:`submit`); ``refusal``: refused with
        it whatever ``refuse`` says now (a parked push's)."""
        target, msg, what = request.target, request.msg, request.what
        if self.failure is not None and not after_failure:
            request.future.set_exception(self.failure)
            return request
        self.sent.append((target, msg))
        if refusal is None and msg.op in self.silent:
            self._open.append(request)
        elif refusal is not None or msg.op in self.refuse:
            error = refusal if refusal is not None else self.refuse[msg.op]  # as the Mux turns an ERROR
            request.future.set_exception(error_from_code(error_code(error), f"{what} failed: {error}"))
        else:
            request.future.set_result(self._answer(target, msg))
        return request

    def wait(self, request: Request, timeout: float) -> Any:
        """The reply to ``request`` (a parked push is sent first); ``concurrent.futures.TimeoutError``
        after ``timeout`` s."""
        self._unpark()
        try:
            return request.future.result(timeout)
        except FutureTimeout:
            raise FutureTimeout() from None

    def fail(self, error: BaseException) -> None:
        """Fail every unanswered request, and every later one, with ``error`` (a lost peer)."""
        if self._closed or self.failure is not None:
            return
        self.failure = error
        if self._parked is not None:
            self._open.append(self._parked.request)
            self._parked = None
        for request in self._open:
            if not request.future.done():
                request.future.set_exception(error)
        self._open.clear()

    def stop(self, timeout: float) -> None:
        """Closed: every later submit raises StoreClosedError."""
        self._closed = True

    def ops(self, target: int | None = None) -> list[Op]:
        """The ops sent (to ``target`` only, when given), in order."""
        return [msg.op for t, msg in self.sent if target is None or t == target]

    # -- the in-memory cluster ------------------------------------------------------------------
    def _answer(self, target: int, msg: Message) -> Message:
        if target == SCHEDULER:
            return Message(Op.OK, {"failures": [], "left": []} if msg.op is Op.BARRIER else {})
        if msg.op in (Op.INIT, Op.PUSH, Op.PUSHPULL, Op.PULL):
            return self._data(self.slices[target], msg)
        return Message(Op.OK, {})

    @staticmethod
    def _data(slices: dict[Any, np.ndarray], msg: Message) -> Message:
        body = msg.body
        lo = body.get("lo")
        offset, outs = 0, []
        for key, size in zip(body["keys"], body["sizes"]):
            if msg.op is not Op.PULL:
                part = msg.arrays[0][offset:offset + size]
                if lo is None:
                    slices[key] = part.copy()
                else:  # a chunk of a big slice
                    if msg.op is Op.INIT and lo == 0:
                        slices[key] = np.zeros(body["total"], part.dtype)
                    slices[key][lo:lo + size] = part
            offset += size
            if msg.op is Op.PULL or msg.op is Op.PUSHPULL:
                outs.append(slices[key] if lo is None else slices[key][lo:lo + size])
        return Message(Op.OK, {}, [np.concatenate(outs)] if outs else [])


def fake_config(**changes: Any) -> kvconfig.Config:
    """A worker's settings for a two-server cluster (never reached), with ``changes``."""
    cfg = kvconfig.load({"DMLC_PS_ROOT_URI": "10.0.0.9", "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_WORKER": "1",
                         "DMLC_NUM_SERVER": str(len(SERVERS)), "DMLC_ROLE": "worker"})
    return dataclasses.replace(cfg, **{"bigarray_bound": 1000, **changes})


def fake_store(name: str = "dist_sync", **changes: Any) -> tuple[DistKVStore, FakeMux]:
    """A dist store over a :class:`FakeMux`, joined as the only worker of a two-server cluster."""
    mux = FakeMux(len(SERVERS))
    body = {"rank": 0, "num_workers": 1, "seed": 7, "session": b"fake", "push_window": 2, "chunk_bytes": 0,
            "servers": [["10.0.0.1", 9001], ["10.0.0.2", 9002]]}
    return DistKVStore(name, fake_config(**changes), joined=Joined(body, SERVERS, mux, heartbeat=False)), mux
