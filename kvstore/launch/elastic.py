"""Elastic membership under the local and Ray launchers (``launch.py --min-workers A --max-workers B -n N``,
docs/elastic.md): the job has B worker slots, N of them started; a worker is added while it runs by a
line ``join`` appended to the control file, whose path every role gets as ``KVSTORE_ELASTIC_CONTROL``.

Pure bookkeeping here, shared by both: :class:`JoinControl` (the lines asked since the last look, and
which slot a new worker takes, the lowest no live worker holds, with which incarnation, one above any
the slot had), :func:`job_ending` (a join asked as the job ends is refused) and :func:`elastic_slots`
(the counts' checks).  Under ``--max-restarts`` a joined worker that dies is restarted as any worker
is: the next incarnation of its slot, without ``KVSTORE_JOIN`` (:func:`restart_env`), so it rejoins as
a restart; one that exits 0 has left for good.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from kvstore.launch.roleprocess import RoleState

log = logging.getLogger("kvstore.launcher")
CONTROL_VARIABLE = "KVSTORE_ELASTIC_CONTROL"
JOIN_VARIABLE = "KVSTORE_JOIN"  # set on a joining worker only: its restart is no join (a rejoin of its slot)


class JoinControl:
    """The control file of an elastic job (``path``, created empty) and its ``slots`` worker slots."""

    def __init__(self, path: str, slots: int) -> None:
        self.path, self.slots = path, slots
        self._offset = 0
        with open(path, "w"):
            pass

    def asked(self) -> int:
        """The joins asked since the last call: complete lines ``join`` appended to the file (any
        other complete line is logged and ignored).  Raises nothing; an unreadable file asks none."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError as exc:
            log.error("cannot read the elastic control file %s: %s", self.path, exc)
            return 0
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        count = 0
        for line in data[:end].decode("utf-8", "replace").splitlines():
            if line.strip() == "join":
                count += 1
            elif line.strip():
                log.warning("elastic control file %s: ignored %r (only 'join' lines are understood)",
                            self.path, line[:80])
        return count

    def slot(self, held: set[int], incarnations: dict[int, int]) -> tuple[int, int] | None:
        """The slot a new worker takes, and its incarnation: the lowest not ``held`` by a live worker,
        one above the highest incarnation it had (``incarnations``: slot -> highest; 1 for a slot never
        held).  None when all ``slots`` are held."""
        free = [s for s in range(self.slots) if s not in held]
        if not free:
            return None
        return free[0], incarnations.get(free[0], 0) + 1

    def join(self, held: set[int], incarnations: dict[int, int], flag: str,
             ending: str | None = None) -> tuple[int, int] | None:
        """:meth:`slot` for an asked join, logged: the worker to start, or None (refused, logged as the
        launcher's ``flag`` names the slots: ``--max-workers``, ``max_workers``; or, with ``ending``,
        the reason the job is ending, :func:`job_ending`: a worker started now would find no job)."""
        if ending is not None:
            log.warning("a worker's join was asked as the job ends (%s): refused, the job is not failed "
                        "for it", ending)
            return None
        found = self.slot(held, incarnations)
        if found is None:
            log.error("a worker's join was asked, but all %d worker slots (%s) are held: refused",
                      self.slots, flag)
        else:
            log.info("starting worker %d (incarnation %d) to join the running job", *found)
        return found


def job_ending(live_workers: int, scheduler_gone: bool) -> str | None:
    """Why an elastic job is ending, so that a join asked now is refused (docs/elastic.md), or None:
    its scheduler is gone (exited, or its port closed: it does once every worker has left), or no
    worker is running (``live_workers``: those started and not exited)."""
    if scheduler_gone:
        return "the scheduler is gone, as it goes once every worker has left"
    if live_workers == 0:
        return "every worker has exited"
    return None


DEATH_UNSEEN = 5.0  # seconds a closed scheduler port, its process still running, holds a join


def death_unseen(restarts: bool, scheduler_running: bool, live_workers: int, closed_for: float) -> bool:
    """Whether a scheduler port found closed (for ``closed_for`` seconds) is more likely a SIGKILLed
    scheduler the launcher has yet to see exit (and will restart: ``restarts``) than a job's end: its
    process still counts as running and workers run.  A join asked then is held, not refused, for up
    to DEATH_UNSEEN seconds (a scheduler closes its port at the job's end just before it exits)."""
    return restarts and scheduler_running and live_workers > 0 and closed_for < DEATH_UNSEEN


def elastic_slots(num_workers: int, min_workers: int | None, max_workers: int | None) -> int:
    """The job's worker slots: ``max_workers``, or ``num_workers`` for a job that is not elastic.  Raises
    ValueError unless ``1 <= min_workers <= num_workers <= max_workers`` (each defaulting to
    ``num_workers``).  Restarts (``--max-restarts``) combine with an elastic job (docs/elastic.md)."""
    if min_workers is None and max_workers is None:
        return num_workers
    low = num_workers if min_workers is None else min_workers
    high = num_workers if max_workers is None else max_workers
    if not 1 <= low <= num_workers <= high:
        raise ValueError(f"min_workers {low} <= num_workers {num_workers} <= max_workers {high} must hold "
                         "(and at least 1)")
    return high


def restart_env(env: dict[str, str], incarnation: int) -> dict[str, str]:
    """The environment of a role's restart as ``incarnation``: ``env`` with that
    ``KVSTORE_INCARNATION`` and without ``KVSTORE_JOIN`` (a joined worker's restart rejoins its slot,
    it does not join an absent one)."""
    return {**{k: v for k, v in env.items() if k != JOIN_VARIABLE}, "KVSTORE_INCARNATION": str(incarnation)}


def left_slots(workers: Iterable[tuple[int | None, RoleState]]) -> list[int]:
    """The worker slots that have left for good, from ``(rank, state)`` of every worker process a
    launch started: those where one exited 0 (SUCCEEDED) and none is live (STARTING, RUNNING, or
    FAILED and being restarted), so a slot a later join took is not one of them.  Ascending."""
    done = {rank for rank, state in workers if rank is not None and state is RoleState.SUCCEEDED}
    live = {rank for rank, state in workers
            if state in (RoleState.STARTING, RoleState.RUNNING, RoleState.FAILED)}
    return sorted(done - live)


def control_path(workdir: str) -> str:
    """Where a launch in ``workdir`` keeps its control file."""
    return os.path.join(workdir, "elastic.control")
