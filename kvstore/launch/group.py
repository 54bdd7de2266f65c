"""The supervision of a launch's role processes as one group: :class:`RoleGroup` (the local and ssh
launchers; the Ray driver and Spark's barrier tasks keep their own loops over the same
:class:`~kvstore.launch.roleprocess.RoleProcess`).

Fail fast: the first role that fails is what the launcher reports, and every role is then stopped
against one shared deadline.  A restart policy (``--max-restarts``, a later issue) belongs here: a
failed role can go back to STARTING (:meth:`RoleProcess.restart`).
"""

from __future__ import annotations

import logging
import queue
import time

from kvstore.launch.roleprocess import Killed, RoleProcess, RoleState

log = logging.getLogger("kvstore.launcher")


class RoleGroup:
    """The role processes of one launch, in the order they were started."""

    def __init__(self) -> None:
        self.roles: list[RoleProcess] = []
        self._exits: queue.SimpleQueue[RoleProcess] = queue.SimpleQueue()

    def add(self, role: RoleProcess) -> RoleProcess:
        """Supervise ``role`` (started, or being started) from now on; return it."""
        self.roles.append(role)
        role.on_exit(self._exits.put)
        return role

    def failed(self) -> RoleProcess | None:
        """The first role (in start order) that has FAILED, if any."""
        return next((role for role in self.roles if role.state is RoleState.FAILED), None)

    def supervise(self, workers: int, grace: float) -> RoleProcess | None:
        """Wait until ``workers`` workers have SUCCEEDED (return None) or any role has FAILED (return
        the first one to fail: fail fast, the caller then stops the rest).  After the last worker,
        the other roles get ``grace`` seconds, one deadline for all, to exit by themselves (a
        scheduler and servers do once every worker has left); each still running is logged."""
        left = workers
        while left:
            role = self._exits.get()
            if role.state is RoleState.FAILED:
                return role
            # the scheduler and servers exit 0 once every worker has left, maybe before they exit
            left -= role.spec.role == "worker"
        deadline = time.monotonic() + grace
        for role in self.roles:
            if role.wait(deadline) is None:
                log.warning("%s did not exit within %g s of the workers; stopping it", role.name, grace)
        return None

    def stop(self) -> list[tuple[RoleProcess, Killed, float]]:
        """Stop every role: ask each to stop, then give each its ``stop_wait`` from that one moment,
        SIGKILL what is left, reap, and wait for the rest of their output.  Returns ``(role, what was
        killed, the seconds it was given)`` for each role that had to be killed."""
        for role in self.roles:
            role.request_stop()
        start = time.monotonic()
        killed = []
        try:
            for role in self.roles:
                what = role.finish_stop(start + role.stop_wait, join_timeout=0.0)
                if what is not None:
                    killed.append((role, what, role.stop_wait))
        finally:
            for role in self.roles:
                role.join(5.0)
        return killed
