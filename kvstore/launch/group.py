"""The supervision of a launch's role processes as one group: :class:`RoleGroup` (the local and ssh
launchers; the Ray driver and Spark's barrier tasks keep their own loops over the same
:class:`~kvstore.launch.roleprocess.RoleProcess`).

Fail fast: the first role that fails is what the launcher reports, and every role is then stopped
against one shared deadline.  The one exception is the restart policy (``--max-restarts K``): a
worker that fails while restarts are left is reaped, what it left in its process group killed, and
started again from its spec (:meth:`RoleProcess.restart`) with the next ``KVSTORE_INCARNATION``;
so is a server that has written a shard (``KVSTORE_SNAPSHOT_EVERY``: the caller's ``restartable``),
which starts from it (kvstore/server/restore.py).  A scheduler that fails still fails the launch.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable

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

    def supervise(self, workers: int, grace: float, restarts: int = 0,
                  restartable: Callable[[RoleProcess], bool] | None = None) -> RoleProcess | None:
        """Wait until ``workers`` workers have SUCCEEDED (return None) or any role has FAILED (return
        the first one to fail: fail fast, the caller then stops the rest), but a worker that fails
        while any of ``restarts`` are left is restarted (:meth:`restart`), and so is a server for which
        ``restartable`` says yes (it has a shard to start from).  After the last worker,
        the other roles get ``grace`` seconds, one deadline for all, to exit by themselves (a
        scheduler and servers do once every worker has left); each still running is logged."""
        left, used = workers, 0
        while left:
            role = self._exits.get()
            if role.state is RoleState.FAILED:
                kind = role.spec.role
                if used >= restarts or not (kind == "worker" or (kind == "server" and restartable is not None
                                                                  and restartable(role))):
                    if restarts and kind in ("worker", "server"):
                        log.error("%s failed: %s", role.name, f"all {restarts} restarts (--max-restarts) "
                                  "are used" if used >= restarts else "it has no shard to restart from "
                                  "(KVSTORE_SNAPSHOT_EVERY, KVSTORE_SNAPSHOT_DIR)")
                    return role
                used += 1
                if not self.restart(role, f"{used} of {restarts} restarts used"):
                    return role
                continue
            # the scheduler and servers exit 0 once every worker has left, maybe before they exit
            left -= role.spec.role == "worker"
        deadline = time.monotonic() + grace
        for role in self.roles:
            if role.wait(deadline) is None:
                log.warning("%s did not exit within %g s of the workers; stopping it", role.name, grace)
        return None

    def restart(self, role: RoleProcess, why: str) -> bool:
        """Start the FAILED ``role`` again with the next ``KVSTORE_INCARNATION``, once its process is
        reaped and what it left in its group killed; False when it cannot be started (it is then
        FAILED again).  ``why`` goes into the log line."""
        role.stop(0.0)  # exited already: reaped, its group's leftovers SIGKILLed, its output read
        incarnation = int(role.spec.env.get("KVSTORE_INCARNATION", "0")) + 1
        log.warning("%s exited with code %s; restarting it as incarnation %d (%s)", role.name,
                    role.exit_code, incarnation, why)
        role.restart()
        role.spec = dataclasses.replace(role.spec, env={**role.spec.env,
                                                        "KVSTORE_INCARNATION": str(incarnation)})
        try:
            role.start()
        except OSError as exc:
            log.error("cannot restart %s: %s", role.name, exc)
            return False
        return True

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
