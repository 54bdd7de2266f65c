"""The push window: at most ``KVSTORE_PUSH_WINDOW`` pushes of one key unacknowledged per worker.

A push (or pushpull) of a key whose window is full waits until the oldest push of that key is
acknowledged, under the request deadline.  A server acks a push once it has applied it (dist_sync:
when its round closes, so a worker can run at most ``window`` rounds ahead of the slowest one;
dist_async: on arrival), and refuses a push beyond the window instead of buffering it.  What a
worker has queued and what a server holds for it are then bounded by ``window`` x the key's size,
whatever the skew between workers (docs/architecture.md, "Flow control and memory").

A push that failed counts as acknowledged: its error is remembered for each of its keys and raised
by the key's next call (:meth:`PushWindow.take_failure`), or by ``barrier()``/``close()``.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any

from kvstore.client.mux import Request
from kvstore.core.partition import Key
from kvstore.errors import DeadlineExceededError, KVStoreError
from kvstore.net.protocol import Message

Wait = Callable[[Request, float], Message]  # Mux.wait: (request, timeout) -> reply, raising its error


class PushWindow:
    """The unacknowledged pushes of each key (each a list of the requests that carry a part of it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._pending: dict[Key, collections.deque[list[Request]]] = {}
        self._failures: dict[Key, BaseException] = {}  # refused pushes, raised by the key's next call
        self.waiting = 0              # threads waiting for room now
        self.blocked_seconds = 0.0    # time spent waiting for room, all threads together
        self._live = 0                # recorded requests not answered yet (0: every push is acked)
        # the futures whose failure their call raises (raised_by_call); weak: one never resolved goes
        # with its request, and no later future can be taken for it (an id() could be reused)
        self._raised: weakref.WeakSet[Any] = weakref.WeakSet()

    def _oldest_open(self, key: Key) -> list[Request] | None:
        """The oldest unacknowledged push of ``key`` when its window is full, else None (the caller
        holds the lock); acknowledged pushes are dropped on the way."""
        queue = self._pending.get(key)
        if queue is None:
            return None
        while queue and all(r.future.done() for r in queue[0]):
            queue.popleft()
        if not queue:
            del self._pending[key]
            return None
        return queue[0] if len(queue) >= self.size else None

    def _all_acked(self) -> bool:
        """True, forgetting every push, when no recorded request is unanswered (the caller holds the
        lock): then every key has room, without looking at each one."""
        if self._live:
            return False
        self._pending.clear()
        return True

    def has_room(self, keys: Iterable[Key]) -> bool:
        """Whether one more push of every key in ``keys`` fits in its window now."""
        with self._lock:
            return self._all_acked() or all(self._oldest_open(key) is None for key in keys)

    def wait_room(self, keys: Iterable[Key], deadline: float, wait: Wait) -> None:
        """Wait until one more push of each key fits, driving the sockets with ``wait``.

        Raises :class:`DeadlineExceededError` naming the key and ``KVSTORE_PUSH_WINDOW`` when the
        oldest push of a key is not acknowledged by ``deadline`` (``time.monotonic()``).
        """
        with self._lock:
            if self._all_acked():
                return
        for key in keys:
            while True:
                with self._lock:
                    oldest = self._oldest_open(key)
                    if oldest is None:
                        break
                    self.waiting += 1
                started = time.monotonic()
                try:
                    self._wait_for(key, oldest, deadline, wait)
                finally:
                    with self._lock:
                        self.waiting -= 1
                        self.blocked_seconds += time.monotonic() - started

    def _wait_for(self, key: Key, requests: list[Request], deadline: float, wait: Wait) -> None:
        """Wait until every one of ``requests`` (one push of ``key``) is answered or failed."""
        for request in requests:
            try:
                wait(request, max(0.0, deadline - time.monotonic()))
            except KVStoreError:  # first: a reply's error may be a TimeoutError too
                pass  # a refused push: the key's next call raises it (the store's failures)
            except FutureTimeout:
                raise DeadlineExceededError(
                    f"push of key {key!r}: {self.size} earlier pushes of it are still not acknowledged "
                    f"(KVSTORE_PUSH_WINDOW={self.size}) after the request deadline "
                    "(KVSTORE_REQUEST_TIMEOUT); in dist_sync a push is acknowledged once every worker "
                    "has pushed that key") from None

    def add(self, held: dict[Key, list[Request]], failures: bool = True) -> None:
        """Record one push of each key of ``held`` (key -> the requests carrying its parts); with
        ``failures``, a request that fails is remembered for each of its keys (:meth:`take_failure`).
        A pushpull's requests are recorded without: the call itself raises their errors."""
        keys_of: dict[int, tuple[Request, list[Key]]] = {}
        with self._lock:
            for key, requests in held.items():
                self._pending.setdefault(key, collections.deque()).append(requests)
                for request in requests:
                    keys_of.setdefault(id(request), (request, []))[1].append(key)
        self._watch([(request, keys if failures else None) for request, keys in keys_of.values()])

    def add_sends(self, send_keys: list[list[Key]], requests: list[Request], failures: bool = True) -> None:
        """:meth:`add` of a push whose ``requests[i]`` carries the whole values of ``send_keys[i]``
        (``kvstore.client.datapath``), each key in one request."""
        with self._lock:
            pending, deque = self._pending, collections.deque
            for keys, request in zip(send_keys, requests):
                record = [request]
                for key in keys:
                    queue = pending.get(key)
                    if queue is None:
                        pending[key] = deque((record,))
                    else:
                        queue.append(record)
        self._watch(list(zip(requests, send_keys if failures else [None] * len(requests))))

    def _watch(self, requests: list[tuple[Request, list[Key] | None]]) -> None:
        """Count ``requests`` as live until answered; a failure is remembered for the keys given."""
        with self._lock:
            self._live += len(requests)
        for request, keys in requests:
            request.future.add_done_callback(partial(self._done, keys))

    def raised_by_call(self, request: Request) -> None:
        """The failure of ``request``, a push recorded but not sent yet, is raised by the call that
        sends it (a held push a pull takes along: ``kvstore.client.datapath``): not remembered."""
        with self._lock:
            self._raised.add(request.future)

    def _done(self, keys: list[Key] | None, future: Any) -> None:
        """A push request finished (in whichever thread read its reply): remember its failure for
        ``keys`` (None: a pushpull's, or one :meth:`raised_by_call`: raised by the call itself)."""
        error = future.exception()
        with self._lock:
            self._live -= 1
            if self._raised and future in self._raised:
                self._raised.discard(future)
                keys = None
            if error is not None and keys is not None:
                for key in keys:
                    self._failures.setdefault(key, error)

    def take_failure(self, keys: Iterable[Key] | None = None) -> BaseException | None:
        """The failure of an earlier push of one of ``keys`` (None: any key), forgotten once taken."""
        if not self._failures:
            return None
        with self._lock:
            for key in list(self._failures) if keys is None else keys:
                error = self._failures.pop(key, None)
                if error is not None:
                    return error
        return None

    def outstanding(self) -> list[Request]:
        """Every push request not answered yet, oldest first per key (for barrier() and close())."""
        seen: dict[int, Request] = {}
        with self._lock:
            for queue in self._pending.values():
                for requests in queue:
                    for request in requests:
                        if not request.future.done():
                            seen.setdefault(id(request), request)
        return list(seen.values())
