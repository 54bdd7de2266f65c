"""A worker's side of the scheduler's barrier, and the collective calls built on it.

A collective call (``init``, ``set_optimizer``, ``save_checkpoint``, ...) is an action run by one
worker, the leader, between two barriers: the first says who is still in the cluster, the second
carries the leader's failure to every worker (docs/api.md, "Blocking rules").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvstore.client.mux import SCHEDULER, Mux
from kvstore.config import Config
from kvstore.core import agreement
from kvstore.core.membership import Membership, view_of
from kvstore.errors import (
    CollectiveMismatchError,
    DeadlineExceededError,
    TooFewWorkersError,
    error_code,
    error_from_code,
    from_cluster,
)
from kvstore.net.protocol import Message, Op

log = logging.getLogger("kvstore.dist")


class Barriers:
    """Joins barriers for one worker (``rank`` of ``num_workers``) over ``io``; ``wait`` is the store's
    deadline-bounded wait for replies; ``pushes`` counts this worker's pushes so far."""

    def __init__(self, io: Mux, cfg: Config, mode: str, rank: int, num_workers: int,
                 wait: Callable[[list, float, str], list], pushes: Callable[[], int] = lambda: 0,
                 passed: int = 0, absent: list[int] | None = None, view: Membership | None = None,
                 tagged: dict | None = None) -> None:
        self._io, self._cfg, self._mode, self._rank, self._num_workers = io, cfg, mode, rank, num_workers
        self.passed = passed  # barriers released so far (a restarted scheduler repeats only an open one)
        # the membership the last barrier passed agreed (before any: the map's, docs/elastic.md)
        self.view = view if view is not None else view_of({"absent": absent or []}, num_workers, passed)
        self._wait, self._pushes = wait, pushes
        # the last tagged view as the scheduler keeps it ({"view", "left", "tag"}): a restarted scheduler
        # learns it back from the workers' re-registrations (scheduler/recovery.py)
        self.tagged = tagged
        self._lock = threading.Lock()
        # workers known to have left, and us; an elastic job's slots absent at the start (not warned of)
        self._left: set[int] = {rank, *(absent or ())}
        # the slots the scheduler last said have left (or are absent): an elastic job's join takes one
        # out again, so this, not the warned-of union above, is what a re-registration reports
        self._told: set[int] = set(absent or ())
        self._unwarned: dict[int, int] = {}  # left, not warned about yet -> this worker's pushes then

    def collective(self, what: str, action: Callable[[], Any], digest: str | None = None) -> None:
        """Run ``action()`` on the leader, then a barrier that tells every worker whether it worked.

        A first barrier tells who is still in the cluster: the leader is the lowest rank that
        has not left (rank 0 unless it finished early).  The leader re-raises its own error;
        every other worker raises the same type naming the leader, so no worker carries on as
        if the operation had worked.  With a ``digest`` of this worker's arguments
        (``kvstore.core.agreement``), the first barrier carries it: when the workers' digests differ
        every worker raises CollectiveMismatchError and the action is not run.
        """
        reply = self.join(digest=digest)
        self._check_agreement(what, reply)
        left = set(reply.get("left", []))
        here = [rank for rank in range(self._num_workers) if rank not in left]
        error: Exception | None = None
        if self._rank == (here[0] if here else self._rank):
            try:
                action()
            except Exception as exc:  # still join the barrier, so no worker is left waiting
                error = exc
        self._report(what, error)

    def exchange(self, what: str, digest: str) -> None:
        """Meet every worker at a barrier carrying this worker's ``digest`` of its arguments to the
        collective ``what``; raise CollectiveMismatchError (on every worker alike) when they differ."""
        self._check_agreement(what, self.join(digest=digest))

    @staticmethod
    def _check_agreement(what: str, reply: dict) -> None:
        """Raise the disagreement of the digests a barrier's ``reply`` carries (``[ranks, text]`` per
        distinct text), if any."""
        digests = {int(rank): text for ranks, text in reply.get("digests", []) for rank in ranks}
        error = agreement.disagreement(what, digests)
        if error is not None:
            raise error

    def agree(self, what: str, check: Callable[[], None]) -> None:
        """Run ``check()`` on every worker, then a barrier: each worker raises its own failure, or the
        first other worker's, so all of them go on only if every check passed."""
        error: Exception | None = None
        try:
            check()
        except Exception as exc:  # still join the barrier, so no worker is left waiting
            error = exc
        self._report(what, error)

    def _report(self, what: str, error: Exception | None) -> None:
        """Join the barrier that carries this worker's ``error`` (None: it worked) to every worker;
        raise it, or the first other worker's failure (as its type, naming that worker)."""
        failure = None if error is None else {"code": error_code(error), "message": str(error)}
        failures = self.join(failure).get("failures", [])
        if error is not None:
            raise error
        if failures:
            rank, info = failures[0]
            message = f"{what} failed on worker {rank}: {info['message']}"
            raise from_cluster(error_from_code(info["code"], message))

    def join(self, failure: dict[str, str] | None = None, digest: str | None = None,
             tag: tuple[int, ...] | None = None, follow: bool = False) -> dict:
        """Join the scheduler's barrier (with a ``failure``, ``digest`` or membership ``tag`` to hand
        every worker; or, ``follow``, as no call of its own: paired with whatever the others call);
        return its reply's body (``failures``, ``left``, ``view``, ``digests``) and keep the membership
        it agreed as :attr:`view`.  A barrier the scheduler released with TooFewWorkersError or
        CollectiveMismatchError counts as passed (so does every worker's)."""
        body: dict[str, Any] = {} if failure is None else {"failure": failure}
        if digest is not None:
            body["digest"] = digest
        if tag is not None:
            body["tag"] = list(tag)
        if follow:
            body["follow"] = True
        body["after"] = self.passed
        request = self._io.submit(SCHEDULER, Message(Op.BARRIER, body), "barrier among all workers")
        try:
            try:
                body = self._wait([request], self._cfg.request_timeout, "KVSTORE_REQUEST_TIMEOUT")[0].body
            except (TooFewWorkersError, CollectiveMismatchError):
                self._passed()  # released, with the error (too few workers, or a membership view paired
                raise  # with other calls): the scheduler counted it
            self._passed()
            with self._lock:
                self.view = view_of(body, self._num_workers, self.passed)
                if body.get("tag") is not None and type(body.get("view")) is int:
                    self.tagged = {"view": body["view"], "left": list(body.get("left", [])),
                                   "tag": list(body["tag"])}
            self.warn_left(body.get("left", []))
            return body
        except DeadlineExceededError:
            # Withdraw from the barrier so a retry is not paired with a stale entry.  The
            # scheduler answers in order: if the barrier completed meanwhile, it has passed.
            cancel = self._io.submit(SCHEDULER, Message(Op.BARRIER, {"cancel": True}),
                                     "withdrawal from the barrier")
            reply = self._wait([cancel], self._cfg.shutdown_timeout, "KVSTORE_SHUTDOWN_TIMEOUT")[0]
            if not reply.body.get("released"):
                raise
            self._passed()
            return {}  # it completed, but its reply (and any failure in it) was given up on

    def _passed(self) -> None:
        """Count one more barrier passed (every worker passes the same ones, in order)."""
        with self._lock:
            self.passed += 1

    @property
    def left(self) -> list[int]:
        """The other workers the scheduler last said have left (an elastic job's absent slots too; a
        slot joined since is no longer among them)."""
        with self._lock:
            return sorted(self._told - {self._rank})

    def warn_left(self, left: list[int]) -> None:
        """Note the workers a barrier or heartbeat reply says have left (called with each).  dist_sync:
        one warning per worker once this worker has pushed since it learned of the leave (its later
        sums exclude that worker's pushes, docs/failures.md), so workers leaving together at the end of
        a job warn nobody; other modes: one info line at once."""
        with self._lock:  # several threads may pass barriers
            new, self._left = sorted(set(left) - self._left), self._left | set(left)
            self._told = set(left)
            if self._mode != "dist_sync":
                due = new
            else:
                pushes = self._pushes()
                self._unwarned.update(dict.fromkeys(new, pushes))
                due = sorted(rank for rank, at in self._unwarned.items() if pushes > at)
                for rank in due:
                    del self._unwarned[rank]
        for rank in due:
            if self._mode == "dist_sync":
                log.warning("worker %d has left: dist_sync sums from now on exclude its pushes", rank)
            else:
                log.info("worker %d has left: barriers no longer wait for it", rank)
