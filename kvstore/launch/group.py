"""The supervision of a launch's role processes as one group: :class:`RoleGroup` (the local and ssh
launchers; the Ray driver and Spark's barrier tasks keep their own loops over the same
:class:`~kvstore.launch.roleprocess.RoleProcess`).

Fail fast: the first role that fails is what the launcher reports, and every role is then stopped
against one shared deadline.  The one exception is the restart policy (``--max-restarts K``): a
worker that fails while restarts are left is reaped, what it left in its process group killed, and
started again from its spec (:meth:`RoleProcess.restart`) with the next ``KVSTORE_INCARNATION``;
so is a server that has written a shard (``KVSTORE_SNAPSHOT_EVERY``: the caller's ``restartable``),
which starts from it (kvstore/server/restore.py); and so, with a :class:`SchedulerRestart` (the local
launcher), is the scheduler, at its port, unless another role died with it or dies while the restarted
scheduler rebuilds the cluster (docs/failures.md): that is not survivable and fails the launch, named.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
from collections.abc import Callable

from kvstore.launch.elastic import left_slots, restart_env
from kvstore.launch.portfile import read_digest
from kvstore.launch.roleprocess import Killed, RoleProcess, RoleState

log = logging.getLogger("kvstore.launcher")


JOIN_POLL_S = 0.1  # how often an elastic job's control file is read (docs/elastic.md)
TOGETHER_S = 0.3  # seconds the launcher waits, once the scheduler died, for another role's death with it


@dataclasses.dataclass(frozen=True)
class SchedulerRestart:
    """How the local launcher restarts a lost scheduler: at ``port``, with the same ``port_file``,
    which a restarted scheduler writes again once it has rebuilt the cluster (until then the launcher
    takes any other death as not survivable).  ``window``: a role that died this many seconds before
    the scheduler died with it (KVSTORE_HEARTBEAT_TIMEOUT)."""

    port: int
    port_file: str
    window: float

    def rebuilding(self) -> bool:
        """Whether a restarted scheduler has not yet rebuilt the cluster (no port file yet)."""
        return not os.path.exists(self.port_file)


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
                  restartable: Callable[[RoleProcess], bool] | None = None,
                  scheduler: SchedulerRestart | None = None,
                  joins: Callable[[], int] | None = None) -> RoleProcess | None:
        """Wait until ``workers`` workers have SUCCEEDED (return None) or any role has FAILED (return
        the first one to fail: fail fast, the caller then stops the rest), but a worker that fails
        while any of ``restarts`` are left is restarted (:meth:`restart`), and so is a server for which
        ``restartable`` says yes (it has a shard to start from).  After the last worker,
        the other roles get ``grace`` seconds, one deadline for all, to exit by themselves (a
        scheduler and servers do once every worker has left); each still running is logged.  With
        ``scheduler``, a failed scheduler is restarted too (:meth:`_restart_scheduler`).  With
        ``joins`` (an elastic job), it is called every :data:`JOIN_POLL_S` and returns the workers it
        started, who are waited for too."""
        left, used = workers, 0
        died: dict[str, float] = {}  # role name -> when it last failed
        rebuilt = True  # no scheduler restart is rebuilding the cluster
        while left:
            if joins is not None:
                left += joins()
                try:
                    role = self._exits.get(timeout=JOIN_POLL_S)
                except queue.Empty:
                    continue
            else:
                role = self._exits.get()
            if role.state is RoleState.FAILED:
                kind = role.spec.role
                rebuilt = rebuilt or scheduler is None or not scheduler.rebuilding()
                if scheduler is not None and (kind == "scheduler" or not rebuilt):
                    if not self._restart_scheduler(role, scheduler, died, used, restarts):
                        return role
                    used, rebuilt = used + 1, False
                    continue
                died[role.name] = time.monotonic()
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

    def _restart_scheduler(self, role: RoleProcess, policy: SchedulerRestart, died: dict[str, float],
                           used: int, restarts: int) -> bool:
        """``role`` failed while the scheduler can be restarted: restart the scheduler (it is ``role``,
        killed by a signal) at its port and return True, or log why that is not survivable and return
        False: it exited by itself, no budget left, another role died with it (within
        ``policy.window`` before, or :data:`TOGETHER_S` after), or ``role`` died while a restarted
        scheduler rebuilds the cluster."""
        if role.spec.role != "scheduler":
            log.error("%s died while the restarted scheduler was rebuilding the cluster: not survivable "
                      "(docs/failures.md)", role.name)
            return False
        if (role.exit_code or 0) <= 128:  # it exited by itself: the job failed (it lost a node for good)
            return False
        if used >= restarts:
            log.error("scheduler failed: all %d restarts (--max-restarts) are used", restarts)
            return False
        if read_digest(policy.port_file) is None:  # written once the cluster map is out
            log.error("the scheduler died before the cluster was complete: nothing to rebuild from, not "
                      "restarted (docs/failures.md)")
            return False
        deadline, seen = time.monotonic() + TOGETHER_S, []
        while (wait := deadline - time.monotonic()) > 0:
            try:
                other = self._exits.get(timeout=wait)
            except queue.Empty:
                break
            seen.append(other)
            if other.state is RoleState.FAILED:
                died[other.name] = time.monotonic()
                break
        for other in seen:
            self._exits.put(other)  # seen again by the supervision loop
        now = time.monotonic()
        together = sorted(name for name, at in died.items() if now - at <= policy.window + TOGETHER_S)
        if together:
            log.error("the scheduler and %s died together: not survivable, the restarted scheduler could "
                      "not rebuild the cluster without them (docs/failures.md)", ", ".join(together))
            return False
        left = left_slots([(r.spec.rank, r.state) for r in self.roles if r.spec.role == "worker"])
        env = {"DMLC_PS_ROOT_PORT": str(policy.port), "KVSTORE_RESTARTS_USED": str(used + 1),
               "KVSTORE_RECOVER_LEFT": ",".join(map(str, left))}
        try:
            os.remove(policy.port_file)  # written again once the cluster is rebuilt
        except FileNotFoundError:
            pass
        return self.restart(role, f"{used + 1} of {restarts} restarts used; at the same port {policy.port}",
                            env)

    def restart(self, role: RoleProcess, why: str, env: dict[str, str] | None = None) -> bool:
        """Start the FAILED ``role`` again with the next ``KVSTORE_INCARNATION`` (and ``env``; a joined
        worker's without ``KVSTORE_JOIN``: :func:`restart_env`), once its process is reaped and what it
        left in its group killed; False when it cannot be started (it is then FAILED again).  ``why``
        goes into the log line."""
        role.stop(0.0)  # exited already: reaped, its group's leftovers SIGKILLed, its output read
        incarnation = int(role.spec.env.get("KVSTORE_INCARNATION", "0")) + 1
        log.warning("%s exited with code %s; restarting it as incarnation %d (%s)", role.name,
                    role.exit_code, incarnation, why)
        role.restart()
        role.spec = dataclasses.replace(role.spec, env=restart_env({**role.spec.env, **(env or {})},
                                                                   incarnation))
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
