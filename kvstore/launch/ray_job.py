"""A kvstore cluster running on Ray, from the driver's side: :class:`RayJob` places one bundle per
role, creates each role's actor (:class:`kvstore.launch.ray_actor.RoleActor`), starts the scheduler,
then the servers and workers, supervises them and tears everything down.

One supervision loop long-polls every actor for new output lines and its exit code, prints the
lines with the launcher's prefixes (``[scheduler]``, ``[server 0]``, ``[worker 1]``), and stops
everything when any role fails or its actor dies.  Importing this module imports ray.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvstore import config as kvconfig
from kvstore.errors import DeadlineExceededError, RoleFailed
from kvstore.launch import envrules as roles
from kvstore.launch import ray_cluster
from kvstore.launch.elastic import CONTROL_VARIABLE, JoinControl, control_path, elastic_slots
from kvstore.launch.output import ExceptionLine
from kvstore.launch.ray_actor import Call, RoleActor
from kvstore.launch.ray_plan import (
    DEFAULT_PLACEMENT_TIMEOUT,
    DEFAULT_SCHEDULER_CPUS,
    DEFAULT_SERVER_CPUS,
    DEFAULT_WORKER_CPUS,
    RoleSpec,
    role_environ,
    role_specs,
)

log = logging.getLogger("kvstore.launcher")

_POLL = 0.5  # seconds a drain() waits in the actor for news before answering "nothing yet"
# Variables of a function worker's environment that are also set when its actor's process starts (through
# the actor's runtime_env, which Ray writes to its logs): never secret, and read once by a library when it
# is imported, which may be while Ray unpickles the function's arguments (numpy for an array), before the
# function runs.  The rest, the secret included, are set only while the function runs.
_PROCESS_START_VARS = ("OMP_NUM_THREADS",)

_Remote = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)(RoleActor)


@dataclass
class _Handle:
    """One role of the job on the driver: its plan, its actor, its node, and what became of it."""

    spec: RoleSpec
    actor: Any
    node_ip: str
    exit_code: int | None = None
    dead: bool = False
    created: bool = False  # its actor answered once: a role it may hold is worth releasing
    incarnation: int = 0  # --max-restarts: times its role was started again


class RayJob:
    """A kvstore cluster running on Ray: made by :func:`start`, supervised by :meth:`wait`.

    ``actor(role, rank)`` is the Ray actor of a role (``ray.kill`` it to see the
    job fail).  Use it as a context manager, or call :meth:`stop`, so it is
    always torn down.

    An elastic job (``max_workers`` B, docs/elastic.md) places a bundle for each of its B worker slots
    and starts ``num_workers`` of them; :meth:`add_worker`, or a line ``join`` appended to the control
    file (``control_file``, every role's ``KVSTORE_ELASTIC_CONTROL``), starts one more worker actor in
    the lowest slot no live worker holds, with ``KVSTORE_JOIN=1`` and the slot's next incarnation.
    """

    def __init__(self, target: Sequence[str] | Callable[..., Any], num_workers: int, num_servers: int, *,
                 args: tuple = (), kwargs: Mapping[str, Any] | None = None, address: str | None = None,
                 env: Mapping[str, str] | None = None, settings: kvconfig.Config | None = None,
                 scheduler_cpus: float = DEFAULT_SCHEDULER_CPUS, server_cpus: float = DEFAULT_SERVER_CPUS,
                 worker_cpus: float = DEFAULT_WORKER_CPUS, worker_gpus: float = 0.0,
                 placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT, cwd: str | None = None,
                 stdout: TextIO | None = None, max_restarts: int = 0, min_workers: int | None = None,
                 max_workers: int | None = None) -> None:
        self.function = target if callable(target) else None
        self.command = None if callable(target) else (shlex.split(target) if isinstance(target, str)
                                                       else list(target))
        if self.command is not None and not self.command:
            raise ValueError("the worker command is empty")
        self.args, self.kwargs = tuple(args), dict(kwargs or {})
        self.slots = elastic_slots(num_workers, min_workers, max_workers)
        self.roles = role_specs(self.slots, num_servers, scheduler_cpus=scheduler_cpus,
                                server_cpus=server_cpus, worker_cpus=worker_cpus, worker_gpus=worker_gpus)
        self.num_workers, self.num_servers = num_workers, num_servers
        self.extra = dict(env or {})
        if max_workers is not None:  # B slots, num_workers present at the start (docs/elastic.md)
            self.extra["KVSTORE_ELASTIC_WORKERS"] = str(num_workers)
        if min_workers is not None:  # a barrier with fewer present fails (docs/elastic.md)
            self.extra["KVSTORE_MIN_WORKERS"] = str(min_workers)
        self.elastic = max_workers is not None
        self.control: JoinControl | None = None  # the elastic control file, made by start()
        self._incarnations: dict[int, int] = {}  # elastic: slot -> the highest incarnation it had
        self._workers_left: set[int] = set()  # the slots whose worker has not exited yet
        self._node_ips: list[str] = []  # each bundle's node, once placed
        caller = kvconfig.child_environ({})  # a copy of this process's environment
        self.settings = settings or kvconfig.load({**caller, **self.extra})
        self.forwarded = roles.forwarded(caller)
        self.secret = self.settings.secret or secrets.token_hex(32)
        self.address, self.placement_timeout = address, placement_timeout
        self.cwd = cwd or os.getcwd()
        self._out = stdout
        self.exceptions: dict[str, ExceptionLine] = {}  # role name -> its last traceback's exception
        self._handles: list[_Handle] = []
        self._pg: Any = None
        self._started_ray = False
        self._stopped = False
        self._results: dict[int, Any] = {}
        self._timeout: float | None = None
        self._pending: dict[Any, _Handle] = {}  # an outstanding drain() per running role
        # --max-restarts: a command worker that fails is started again in its actor (docs/failures.md)
        self.restarts_left = max_restarts if self.function is None else 0
        if self.restarts_left:
            self.extra["KVSTORE_MAX_RESTARTS"] = str(max_restarts)  # the scheduler's budget
        self._root: tuple[str, int] = ("", 0)  # the scheduler's address, once it is up

    # start -----------------------------------------------------------------------------------------
    def start(self) -> RayJob:
        """Connect to Ray, place the job, create every role's actor, start the scheduler, then the
        servers and workers.

        Raises PlacementError when the roles cannot be placed within the placement timeout,
        RoleFailed when the scheduler fails to start or an actor dies, DeadlineExceededError when an
        actor is not created within the placement timeout, or does not start its role, or the
        scheduler reports no port, within ``KVSTORE_CONNECT_TIMEOUT``.  On any error everything
        started is torn down.
        """
        try:
            self.connect()
            if self.elastic:
                self._open_control()
            node_ips = self._node_ips = self._place()
            root_uri = node_ips[0]
            for index, spec in enumerate(self.roles):
                if spec.role != "worker" or spec.rank < self.num_workers:  # the other slots wait for joins
                    self._spawn_role(index, root_uri)
            self._created()
            scheduler = self._handles[0]
            env = self._env(scheduler.spec, root_uri, 0, scheduler.node_ip)
            self._started([(scheduler, scheduler.actor.start_command.remote(
                ["-m", "kvstore.scheduler"], env, self.cwd, self.settings.shutdown_timeout, python=True,
                port_file=True))])
            port = self._wait_port(scheduler)
            self._root = (root_uri, port)
            log.info("scheduler on %s:%d; starting %d servers and %d workers", root_uri, port,
                     self.num_servers, self.num_workers)
            self._started([(handle, self._start_role(handle, self._env(handle.spec, root_uri, port,
                                                                       handle.node_ip)))
                           for handle in self._handles[1:]])
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn_role(self, index: int, root_uri: str) -> _Handle:
        """Create the actor of role ``index`` in its bundle (a function worker's with its call)."""
        spec, node_ip = self.roles[index], self._node_ips[index]
        if spec.role == "worker" and self.function is not None:
            # the secret goes as start_function's argument, never in the runtime_env: Ray logs that
            env = self._env(spec, root_uri, 0, node_ip)
            start_vars = {name: env[name] for name in _PROCESS_START_VARS if name in env}
            return self._spawn(index, node_ip, start_vars, call=(self.function, self.args, self.kwargs))
        return self._spawn(index, node_ip)

    def _start_role(self, handle: _Handle, env: dict[str, str]) -> Any:
        """Ask the (created) actor of a server or worker to start its role with ``env``; return the call."""
        if handle.spec.role == "worker" and self.function is not None:
            return handle.actor.start_function.remote(env)
        if handle.spec.role == "worker":
            return handle.actor.start_command.remote(self.command, env, self.cwd,
                                                     self.settings.shutdown_timeout)
        return handle.actor.start_command.remote(["-m", "kvstore.server"], env, self.cwd,
                                                 self.settings.shutdown_timeout, python=True)

    # elastic membership ----------------------------------------------------------------------------
    def _open_control(self) -> None:
        """Create the elastic job's control file in a private directory of the driver's machine, give its
        path to every role (``KVSTORE_ELASTIC_CONTROL``) and log it."""
        folder = tempfile.mkdtemp(prefix="kvstore-ray-elastic-")
        self.control = JoinControl(control_path(folder), self.slots)
        self.extra[CONTROL_VARIABLE] = self.control.path
        log.info("elastic job of %d worker slots: append a line 'join' to %s to add a worker", self.slots,
                 self.control.path)

    @property
    def control_file(self) -> str | None:
        """The elastic job's control file (its roles' ``KVSTORE_ELASTIC_CONTROL``; None before :meth:`start`
        or for a job that is not elastic)."""
        return None if self.control is None else self.control.path

    @property
    def held_slots(self) -> set[int]:
        """The worker slots a live worker holds now, as this driver last saw them (one that exited, with
        any code, holds none)."""
        return {h.spec.rank for h in list(self._handles)
                if h.spec.role == "worker" and h.spec.rank is not None and not h.dead and h.exit_code is None}

    def add_worker(self) -> None:
        """Ask for one more worker, as a line ``join`` appended to the control file does: the supervision
        loop (:meth:`wait`) starts it, or logs and refuses the join when every slot is held.  Raises
        ValueError for a job without ``max_workers`` or not started, OSError when the file cannot be
        written."""
        if self.control is None:
            raise ValueError("add_worker needs an elastic job (max_workers) that has started")
        with open(self.control.path, "a") as control:
            control.write("join\n")

    def _join_workers(self) -> None:
        """Start a worker actor for each join asked since the last look, each in the lowest slot no live
        worker holds (a left slot's old actor is killed first), with ``KVSTORE_JOIN=1`` and the slot's next
        incarnation; log and refuse a join with every slot held.  Raises RoleFailed or
        DeadlineExceededError as the start does."""
        assert self.control is not None
        for _ in range(self.control.asked()):
            workers = [h for h in self._handles if h.spec.role == "worker"]
            found = self.control.join(self.held_slots, self._incarnations, "max_workers")
            if found is None:
                continue
            slot, incarnation = found
            self._incarnations[slot] = incarnation
            for old in workers:  # a worker that left: its actor holds the slot's bundle
                if old.spec.rank == slot and not old.dead:
                    old.dead = True
                    ray.kill(old.actor)
            handle = self._spawn_role(1 + self.num_servers + slot, self._root[0])
            timeout = self.placement_timeout
            self._wait_calls([(handle, handle.actor.__ray_ready__.remote())], timeout,
                             f"was not created within {timeout:g} s (the placement timeout)", created=True)
            env = self._env(handle.spec, *self._root, handle.node_ip)
            env.update({"KVSTORE_JOIN": "1", "KVSTORE_INCARNATION": str(incarnation)})
            handle.incarnation = incarnation  # its restart (--max-restarts) is the slot's next, no join
            self._started([(handle, self._start_role(handle, env))])
            self._pending[handle.actor.drain.remote(_POLL)] = handle
            self._workers_left.add(slot)

    def _created(self) -> None:
        """Wait for every role's actor to be created (its process started, its runtime_env set up, a
        function worker's function and arguments unpickled), all within one placement timeout, before
        any role starts: the roles' own KVSTORE_CONNECT_TIMEOUT (the scheduler's for the rendezvous
        among them) then counts from actors that are all there.

        Raises RoleFailed for an actor that died (e.g. could not be created), DeadlineExceededError
        naming the first role whose actor is not created in time and the placement timeout."""
        timeout = self.placement_timeout
        self._wait_calls([(handle, handle.actor.__ray_ready__.remote()) for handle in self._handles], timeout,
                         f"was not created within {timeout:g} s (the placement timeout): its process did not "
                         "start, or is stuck in its runtime_env or unpickling its function and arguments",
                         created=True)

    def _started(self, starts: list[tuple[_Handle, Any]]) -> None:
        """Wait for the (created) actors' start calls, all within one ``KVSTORE_CONNECT_TIMEOUT``.

        Raises RoleFailed for an actor that died or whose start call raised, DeadlineExceededError
        naming the first role whose actor has not started it in time and KVSTORE_CONNECT_TIMEOUT."""
        timeout = self.settings.connect_timeout
        self._wait_calls(starts, timeout, f"did not start its role within {timeout:g} s of being created "
                         "(KVSTORE_CONNECT_TIMEOUT): its start call is stuck")

    def _wait_calls(self, calls: list[tuple[_Handle, Any]], timeout: float, late: str,
                    created: bool = False) -> None:
        """Wait for every actor call of ``calls``, all within one ``timeout``; see _created, _started.
        With ``created``, each actor that answered is marked created."""
        deadline = time.monotonic() + timeout
        for handle, ref in calls:
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                handle.created = handle.created or created
            except ray.exceptions.GetTimeoutError:
                raise DeadlineExceededError(f"{handle.spec.name}'s Ray actor {late}") from None
            except ray.exceptions.RayActorError as exc:
                handle.dead = True
                raise self._died(handle, exc) from None
            except ray.exceptions.RayTaskError as exc:
                raise RoleFailed(f"{handle.spec.name} could not be started: {exc}", handle.spec.role,
                                 handle.spec.rank, None) from None

    def connect(self) -> None:
        """Connect to Ray (see :func:`kvstore.launch.ray_cluster.connect`), before :meth:`start` (which
        connects too) where the caller must act once Ray is up; the job's own Ray instance is shut
        down by :meth:`stop`.  Raises what ``ray.init`` raises."""
        self._started_ray = ray_cluster.connect(self.address) or self._started_ray

    def _place(self) -> list[str]:
        """Create the placement group and wait for it; return each bundle's node IP.  Raises
        PlacementError (the group is removed by :meth:`stop`)."""
        self._pg = placement_group([spec.bundle() for spec in self.roles], strategy="SPREAD")
        return ray_cluster.bundle_nodes(self._pg, self.roles, self.placement_timeout)

    def _env(self, spec: RoleSpec, root_uri: str, port: int, node_ip: str) -> dict[str, str]:
        """The environment of the role ``spec`` on ``node_ip`` (see :func:`role_environ`)."""
        return role_environ(spec, num_workers=self.slots, num_servers=self.num_servers,
                            secret=self.secret, root_uri=root_uri, root_port=port, node_ip=node_ip,
                            forwarded=self.forwarded, extra=self.extra)

    def _spawn(self, index: int, node_ip: str, env_vars: Mapping[str, str] | None = None,
               call: Call | None = None) -> _Handle:
        """Create the actor of role ``index`` in its bundle; ``env_vars`` (never a secret: Ray writes a
        runtime_env to its logs) are set in the actor's process when it starts; ``call`` is a function
        worker's (function, args, kwargs)."""
        spec = self.roles[index]
        options: dict[str, Any] = {
            "num_cpus": spec.cpus, "num_gpus": spec.gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=index)}
        if env_vars:
            options["runtime_env"] = {"env_vars": dict(env_vars)}
        handle = _Handle(spec, _Remote.options(**options).remote(spec.name, call), node_ip)
        self._handles.append(handle)
        return handle

    def _wait_port(self, scheduler: _Handle) -> int:
        """The port the scheduler's actor read from its port file.  Raises RoleFailed when the scheduler
        exits first or its actor dies, DeadlineExceededError after ``KVSTORE_CONNECT_TIMEOUT``."""
        timeout = self.settings.connect_timeout
        try:
            port, code = ray.get(scheduler.actor.wait_port.remote(timeout), timeout=timeout + 30)
        except ray.exceptions.RayActorError as exc:
            scheduler.dead = True
            raise self._died(scheduler, exc) from None
        except ray.exceptions.GetTimeoutError:
            port, code = None, None
        if port is not None:
            return port
        if code is not None:
            scheduler.exit_code = code
            grace = self.settings.shutdown_timeout
            note = ""
            try:
                self._print(scheduler, ray.get(scheduler.actor.drain.remote(0), timeout=grace)[0])
            except ray.exceptions.GetTimeoutError:
                note = f" (its last output did not arrive within {grace:g} s, KVSTORE_SHUTDOWN_TIMEOUT)"
            except ray.exceptions.RayError as exc:
                note = f" (its last output is lost: {_death_reason(exc)})"
            raise RoleFailed(f"scheduler exited with code {code} before reporting its port{note}",
                             "scheduler", None, code)
        raise DeadlineExceededError(f"the scheduler did not report its port within {timeout:g} s "
                                    "(KVSTORE_CONNECT_TIMEOUT)")

    # supervise -------------------------------------------------------------------------------------
    def actor(self, role: str, rank: int | None = None) -> Any:
        """The Ray actor handle of ``role`` ``rank`` (e.g. ``job.actor('worker', 1)``)."""
        for handle in reversed(self._handles):  # a slot's latest worker
            if handle.spec.role == role and handle.spec.rank == rank:
                return handle.actor
        raise KeyError(f"no {role} {rank} in this job" if rank is not None else f"no {role} in this job")

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Supervise the job to its end and tear it down; return the workers' results by rank (the
        function's return values, or every command worker's exit code, 0).

        Raises RoleFailed when a role fails or its actor dies, DeadlineExceededError past
        ``timeout`` seconds; every role is stopped either way.
        """
        try:
            return self.supervise(timeout)
        finally:
            self.stop()

    def supervise(self, timeout: float | None = None) -> list[Any]:
        """:meth:`wait` without the teardown (call :meth:`stop` after it)."""
        self._timeout = timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        self._pending = {h.actor.drain.remote(_POLL): h for h in self._handles
                         if not h.dead and h.exit_code is None}
        workers_left = self._workers_left
        workers_left.update(h.spec.rank for h in self._handles if h.spec.role == "worker" and not h.dead
                            and h.exit_code is None)
        while workers_left:
            if self.control is not None:
                self._join_workers()
            self._poll(deadline, workers_left)
        # The scheduler and servers exit 0 by themselves once every worker has left; as with the
        # local launcher, how they exit after the last worker is not checked.
        grace_end = time.monotonic() + self.settings.shutdown_timeout
        while self._pending and time.monotonic() < grace_end:
            self._poll(grace_end, workers_left, final=True)
        for handle in self._pending.values():
            log.warning("%s did not exit within %g s of the workers; stopping it", handle.spec.name,
                        self.settings.shutdown_timeout)
        if self.elastic:  # by slot, the last worker's; None for a slot never held
            return [self._results.get(slot) for slot in range(self.slots)]
        return [self._results[rank] for rank in range(self.num_workers)]

    def _poll(self, deadline: float | None, workers_left: set[int], final: bool = False) -> None:
        """Wait up to a second for one actor's drain(); print its lines and act on its exit."""
        tick = 0.1 if self.control is not None else 1.0  # an elastic job reads its control file each 0.1 s
        wait_for = tick if deadline is None else max(0.0, min(tick, deadline - time.monotonic()))
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=wait_for)
        if not ready:
            if deadline is not None and time.monotonic() >= deadline and not final:
                raise DeadlineExceededError(f"the job did not finish within {self._timeout:g} s "
                                            "(the timeout of wait/run)")
            return
        ref = ready[0]
        handle = self._pending.pop(ref)
        try:
            lines, code = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            handle.dead = True
            if final:
                log.warning("%s", self._died(handle, exc))
                return
            raise self._died(handle, exc) from None
        self._print(handle, lines)
        if code is None:
            self._pending[handle.actor.drain.remote(_POLL)] = handle
            return
        handle.exit_code = code
        if final:
            return
        if code != 0:
            if handle.spec.role == "worker" and self.restarts_left > 0:
                self._restart(handle, code)
                return
            raise self._failed(handle, code)
        if handle.spec.role == "worker":
            self._results[handle.spec.rank] = self._result_of(handle)
            workers_left.discard(handle.spec.rank)

    def _restart(self, handle: _Handle, code: int) -> None:
        """Start the failed command worker ``handle`` again in its actor, with the next
        ``KVSTORE_INCARNATION`` (one of the restarts left; a joined worker's restart has no
        ``KVSTORE_JOIN``: it rejoins its slot).  Raises RoleFailed when its actor died or
        the start raised, DeadlineExceededError past ``KVSTORE_CONNECT_TIMEOUT``."""
        self.restarts_left -= 1
        handle.incarnation += 1
        if handle.spec.rank is not None:  # a join in its slot later takes one above this restart's
            self._incarnations[handle.spec.rank] = max(handle.incarnation,
                                                       self._incarnations.get(handle.spec.rank, 0))
        log.warning("%s exited with code %d; restarting it in its actor as incarnation %d (%d restarts "
                    "left)", handle.spec.name, code, handle.incarnation, self.restarts_left)
        env = self._env(handle.spec, *self._root, handle.node_ip)
        env["KVSTORE_INCARNATION"] = str(handle.incarnation)
        handle.exit_code = None
        timeout = self.settings.connect_timeout
        self._wait_calls([(handle, handle.actor.start_command.remote(
            self.command, env, self.cwd, self.settings.shutdown_timeout))], timeout,
            f"did not restart its role within {timeout:g} s (KVSTORE_CONNECT_TIMEOUT)")
        self._pending[handle.actor.drain.remote(_POLL)] = handle

    def _result_of(self, handle: _Handle) -> Any:
        """A finished worker's result: 0 for a command, else its function's return value.

        Raises DeadlineExceededError when the value does not arrive within ``KVSTORE_REQUEST_TIMEOUT``,
        RoleFailed when the actor died or the value could not be sent back."""
        if self.function is None:
            return 0
        timeout = self.settings.request_timeout
        try:
            return ray.get(handle.actor.result.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise DeadlineExceededError(f"{handle.spec.name}'s return value did not arrive within "
                                        f"{timeout:g} s (KVSTORE_REQUEST_TIMEOUT)") from None
        except ray.exceptions.RayActorError as exc:
            handle.dead = True
            raise self._died(handle, exc) from None
        except ray.exceptions.RayError as exc:
            raise RoleFailed(f"{handle.spec.name}'s return value could not be sent back: {exc}",
                             handle.spec.role, handle.spec.rank, None) from None

    def _failed(self, handle: _Handle, code: int) -> RoleFailed:
        """The RoleFailed of a role that exited with ``code`` (a function worker's with its traceback)."""
        spec = handle.spec
        message = f"{spec.name} exited with code {code}"
        if spec.role == "worker" and self.function is not None:
            try:
                error = ray.get(handle.actor.error.remote(), timeout=10)
            except ray.exceptions.RayError:
                error = None
            if error:
                message = f"{spec.name}'s function raised (exit code {code}):\n{error.rstrip()}"
        return RoleFailed(message, spec.role, spec.rank, code)

    def _died(self, handle: _Handle, exc: BaseException) -> RoleFailed:
        """The RoleFailed of a role whose actor died (``exc``, Ray's error, says why)."""
        spec = handle.spec
        reason = _death_reason(exc)
        return RoleFailed(f"{spec.name} died (its Ray actor on {handle.node_ip} is gone: {reason})",
                          spec.role, spec.rank, None)

    def _print(self, handle: _Handle, lines: list[str]) -> None:
        """Write ``lines`` to the job's output, each prefixed with the role's name."""
        if not lines:
            return
        tracker = self.exceptions.setdefault(handle.spec.name, ExceptionLine())
        for line in lines:
            tracker.feed(line)
        out = self._out or sys.stdout
        prefix = f"[{handle.spec.name}] "
        out.write("".join(f"{prefix}{line}\n" for line in lines))
        out.flush()

    # teardown --------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Tear the job down (idempotent): release every tether, give the roles
        ``KVSTORE_SHUTDOWN_TIMEOUT`` to exit (one shared deadline; each tether then SIGKILLs its
        role), print what they wrote last, kill every actor, remove the placement group, and shut
        down the Ray instance this job started."""
        if self._stopped:
            return
        self._stopped = True
        alive = [h for h in self._handles if not h.dead and h.created]  # the others hold no role
        try:
            if alive:
                self._release(alive)
        finally:
            for handle in self._handles:
                try:
                    ray.kill(handle.actor)
                except Exception:  # noqa: BLE001 -- already gone
                    pass
            if self._pg is not None:
                try:
                    remove_placement_group(self._pg)
                except Exception:  # noqa: BLE001
                    pass
                self._pg = None
            if self._started_ray:
                ray.shutdown()
                self._started_ray = False
            if self.control is not None:
                shutil.rmtree(os.path.dirname(self.control.path), ignore_errors=True)

    def _release(self, alive: list[_Handle]) -> None:
        """Release the tethers of ``alive``, give the roles ``KVSTORE_SHUTDOWN_TIMEOUT`` to exit, print
        their last output, and log those still running (their actors' kill stops them)."""
        grace = self.settings.shutdown_timeout
        ray.wait([h.actor.release.remote() for h in alive], num_returns=len(alive), timeout=5)
        waits = {h.actor.wait.remote(grace + 1): h for h in alive}
        ready = set(ray.wait(list(waits), num_returns=len(waits), timeout=grace + 5)[0])
        # what the supervision loop had asked for, then whatever is left
        self._print_drains(self._pending, _POLL + 5)
        self._pending = {}
        self._print_drains({h.actor.drain.remote(0): h for h in alive}, 5)
        still = []
        for ref, handle in waits.items():
            if handle.spec.role == "worker" and self.function is not None:
                continue  # a function worker is not waited for: killing its actor stops it
            try:
                code = ray.get(ref) if ref in ready else None
            except ray.exceptions.RayError:
                continue
            if code is None:
                still.append(handle.spec.name)
        if still:
            log.error("still running %g s after the stop, killed with their actors: %s", grace,
                      ", ".join(still))

    def _print_drains(self, drains: Mapping[Any, _Handle], timeout: float) -> None:
        """Print the lines of the drain() calls ``drains`` that answer within ``timeout``."""
        if not drains:
            return
        done, _ = ray.wait(list(drains), num_returns=len(drains), timeout=timeout)
        for ref in done:
            try:
                self._print(drains[ref], ray.get(ref)[0])
            except ray.exceptions.RayError:
                pass

    def __enter__(self) -> RayJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

def _death_reason(exc: BaseException) -> str:
    """The sentence of a RayActorError that says why the actor died (Ray's text varies by version)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("The actor is dead because"):
            return line[len("The actor is dead because"):].strip()
    return lines[0] if lines else type(exc).__name__
