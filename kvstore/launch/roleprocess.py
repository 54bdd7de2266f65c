"""One started role, for every launcher: :class:`RoleProcess`.

The local and ssh launchers (:mod:`kvstore.launch.local`), a Ray actor (:mod:`kvstore.launch.ray_actor`),
a Spark task (:mod:`kvstore.launch.spark_tasks`), the tether (:mod:`kvstore.launch.tether`) and the
``TF_CONFIG`` chief's node (:mod:`kvstore.launch.node`) all hold the processes they start as a
:class:`RoleProcess`: its :class:`RoleSpec`, its :class:`RoleState`, the pump that copies its output
with the role/rank prefix, the port it published (:mod:`kvstore.launch.portfile`), :meth:`~RoleProcess.wait`
and :meth:`~RoleProcess.stop`.  What differs per backend is only how the process is placed and
started, the ``start`` function given to it (fork here, ssh there, a tether in an actor or a task).

States and their transitions (:data:`TRANSITIONS`)::

    STARTING --(started; an ssh tether's STARTED line)--> RUNNING
    STARTING, RUNNING --(exit 0)--> SUCCEEDED   --(exit != 0, or a signal)--> FAILED
    STARTING, RUNNING --(exit after request_stop)--> STOPPED
    FAILED --(restart)--> STARTING              (the restart policy's way back; none yet)

A process that leads its own process group (started with ``start_new_session``) is reaped only
after its group has been dealt with: its exit is seen with ``waitid(WNOWAIT)``, so its pid, the
group's id, cannot be reused meanwhile and a signal to the group never reaches a stranger.
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from kvstore.launch import envrules, portfile
from kvstore.launch.output import PrefixedOutput

GROUP_POLL = 0.02  # seconds between two looks at a process group that is being stopped
JOIN_TIMEOUT = 5.0  # seconds a stop waits for the output pump to reach the end of the output


class RoleState(enum.Enum):
    """Where a role is in its life."""

    STARTING = "starting"  # being started (an ssh role: until its tether said STARTED)
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # exited 0 by itself
    FAILED = "failed"  # exited non-zero or by a signal by itself, or could not be started
    STOPPED = "stopped"  # exited after it was asked to stop


TRANSITIONS: dict[RoleState, frozenset[RoleState]] = {
    RoleState.STARTING: frozenset({RoleState.RUNNING, RoleState.SUCCEEDED, RoleState.FAILED,
                                   RoleState.STOPPED}),
    RoleState.RUNNING: frozenset({RoleState.SUCCEEDED, RoleState.FAILED, RoleState.STOPPED}),
    RoleState.FAILED: frozenset({RoleState.STARTING}),  # a restart
    RoleState.SUCCEEDED: frozenset(),
    RoleState.STOPPED: frozenset(),
}


class Killed(enum.Enum):
    """What a stop had to SIGKILL."""

    PROCESS = "process"  # the process itself (for a tethered role: the tether or its ssh client)
    GROUP = "group"  # only what the process, exited by then, left in its process group


@dataclass(frozen=True)
class RoleSpec:
    """What a role is: ``role`` (scheduler, server, worker), ``rank`` (None for the scheduler), the
    ``argv`` and ``env`` its start function runs, and the ssh ``host`` it runs on (None: this machine,
    or its Ray actor's or Spark task's)."""

    role: str
    rank: int | None
    argv: list[str]
    env: dict[str, str]
    host: tuple[str, int | None] | None = None

    @property
    def name(self) -> str:
        """``scheduler``, ``server 0``, ``worker 1``: how messages and prefixes name the role."""
        return self.role if self.rank is None else f"{self.role} {self.rank}"


Start = Callable[[RoleSpec], subprocess.Popen]  # how a backend places and starts a role's process


def start_here(spec: RoleSpec) -> subprocess.Popen:
    """Start ``spec`` on this machine in a session and process group of its own, stdin from
    ``/dev/null``, stdout and stderr into one pipe.  Raises OSError when it cannot be started."""
    return subprocess.Popen(spec.argv, env=spec.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def start_pump(stream: IO[bytes], emit: Callable[[bytes], None],
               on_end: Callable[[], None] | None = None) -> threading.Thread:
    """Start the daemon thread that hands every line of ``stream`` (bytes, newline kept) to ``emit``
    until its end, closes it, then calls ``on_end``.  Returns the thread; raises RuntimeError if it
    cannot start."""

    def pump() -> None:
        """Copy the lines, then close the stream and tell ``on_end``."""
        try:
            for line in iter(stream.readline, b""):
                emit(line)
        finally:
            stream.close()
            if on_end is not None:
                on_end()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def read_port(path: str, timeout: float, exited: Callable[[float], bool],
              interval: float = portfile.POLL_INTERVAL) -> int | None:
    """The port a scheduler wrote to its port file ``path``, once it is there; None when
    ``exited(seconds)`` (a wait of up to ``seconds`` for the scheduler's end) says it has ended first,
    or after ``timeout`` seconds.  The one reader of a published port in kvstore/launch:
    :meth:`RoleProcess.read_port` passes its own exit, the Ray actor the exit it recorded, the torchrun
    helper of ``kvstore.node`` the end of its scheduler's pipe.  Raises what ``exited`` raises."""
    return portfile.wait(path, timeout, exited, interval)


def release(proc: subprocess.Popen) -> None:
    """Close ``proc``'s stdin (a tether's: it then stops its role); a pipe already closed is ignored."""
    try:
        proc.stdin.close()
    except (BrokenPipeError, OSError, AttributeError):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group that is gone or not ours is ignored."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a process this one may signal."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class RoleProcess:
    """One started role (see the module docstring): its spec, state, output, port, wait and stop.

    ``start`` places and starts the process (default :func:`start_here`).  Each line of its output
    (when ``start`` pipes it) goes to ``output``, default: this process's stdout with the prefix
    ``[name] `` (:attr:`printed`, which keeps a traceback together); ``on_output_end`` is called at
    the output's end.  With ``tethered`` the process is
    a :mod:`~kvstore.launch.tether` (or the ssh client of one): a stop closes its stdin and the
    tether stops the role and what it left.  With ``announce``, the role stays STARTING until a line
    of its output ends with those bytes (they are not copied).  ``stop_wait`` is the seconds
    :meth:`stop` gives it by default (a :class:`~kvstore.launch.group.RoleGroup` gives each role its
    own from one shared moment).
    """

    def __init__(self, spec: RoleSpec, start: Start = start_here, *,
                 output: Callable[[bytes], None] | None = None,
                 on_output_end: Callable[[], None] | None = None, tethered: bool = False,
                 announce: bytes | None = None, stop_wait: float = 0.0) -> None:
        self.spec, self.output, self.tethered = spec, output, tethered
        self.announce, self.stop_wait = announce, stop_wait
        self._start, self._on_output_end = start, on_output_end
        self.printed = PrefixedOutput(f"[{spec.name}] ".encode())
        self._lock = threading.Lock()
        self._state = RoleState.STARTING
        self._callbacks: list[Callable[[RoleProcess], Any]] = []
        self._reset()

    def _reset(self) -> None:
        """Forget the last process (a new start follows)."""
        self.proc: subprocess.Popen | None = None
        self.own_group = False  # the process leads its own process group
        self._code: int | None = None
        self._done = False  # its exit is recorded (under _lock)
        self._stopping = False
        self._reaped = False
        self._announced = False
        self._started = threading.Event()  # set once past STARTING
        self._exited = threading.Event()
        self._pump: threading.Thread | None = None

    # -- what it is ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The role's name (``worker 1``)."""
        return self.spec.name

    @property
    def state(self) -> RoleState:
        """Its :class:`RoleState` now."""
        return self._state

    @property
    def exit_code(self) -> int | None:
        """The shell-style exit code (128 + n for signal n), or None while it runs (or never ran)."""
        return self._code

    def _move(self, to: RoleState) -> None:
        """Go to state ``to`` (with ``_lock`` held).  Raises RuntimeError for a transition not in
        :data:`TRANSITIONS`."""
        if to not in TRANSITIONS[self._state]:
            raise RuntimeError(f"{self.name}: no transition from {self._state.value} to {to.value}")
        self._state = to

    # -- start --------------------------------------------------------------------------------------
    def start(self) -> RoleProcess:
        """Start the process, its output pump and the watch of its exit; return self.

        Raises OSError when the process cannot be started (the role is then FAILED), RuntimeError
        when the role is not STARTING or its process was started already.
        """
        with self._lock:
            if self._state is not RoleState.STARTING or self.proc is not None:
                raise RuntimeError(f"{self.name} cannot be started: it is {self._state.value}")
        try:
            proc = self._start(self.spec)
        except BaseException:
            with self._lock:
                self._move(RoleState.FAILED)
            self._started.set()
            self._exited.set()  # nothing to wait for
            raise
        self.proc = proc
        try:
            self.own_group = os.getpgid(proc.pid) == proc.pid
        except ProcessLookupError:  # reaped by someone else already: nothing to keep
            self.own_group = False
        if self.announce is None:
            with self._lock:
                self._move(RoleState.RUNNING)
            self._started.set()
        if proc.stdout is not None:
            self._pump = start_pump(proc.stdout, self._line, self._output_ended)
        # the exit is watched apart from the output: a grandchild may hold the pipe open for long
        threading.Thread(target=self._watch, args=(proc,), daemon=True).start()
        return self

    def _line(self, line: bytes) -> None:
        """One line of output: the announcement (not copied) moves the role to RUNNING; the rest goes
        to ``output``, or to stdout with the prefix."""
        if self.announce is not None and not self._announced and line.endswith(self.announce):
            self._announced = True  # the tether's line, maybe after a partial line of the login's
            with self._lock:
                if self._state is RoleState.STARTING:
                    self._move(RoleState.RUNNING)
            self._started.set()
            line = line[: -len(self.announce)]
            if not line:
                return
            line += b"\n"
        if self.output is not None:
            self.output(line)
            return
        self.printed.write(line)

    def _output_ended(self) -> None:
        """At the output's end: write a traceback still held, then tell ``on_output_end``."""
        self.printed.flush()
        if self._on_output_end is not None:
            self._on_output_end()

    def _watch(self, proc: subprocess.Popen) -> None:
        """Wait for ``proc``'s exit, leaving it unreaped when it leads its group (see the module
        docstring); record the code and the state, then call the exit callbacks."""
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            code = info.si_status if info.si_code == os.CLD_EXITED else 128 + info.si_status
        except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): Popen's own answer
            code = envrules.exit_code(proc.wait())
        if not self.own_group:
            proc.wait()  # no group id to keep: reaped at once
        with self._lock:
            self._code, self._done = code, True
            self._move(RoleState.STOPPED if self._stopping else
                       RoleState.SUCCEEDED if code == 0 else RoleState.FAILED)
            callbacks = list(self._callbacks)
        self._exited.set()
        self._started.set()
        for callback in callbacks:
            callback(self)

    def on_exit(self, callback: Callable[[RoleProcess], Any]) -> None:
        """Call ``callback(self)`` at each exit of the process (from the thread that saw it), at once
        if it has exited already."""
        with self._lock:
            self._callbacks.append(callback)
            if not self._done:
                return
        callback(self)

    def wait_started(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` until the role is past STARTING; say whether it is."""
        return self._started.wait(timeout)

    def restart(self) -> None:
        """Move a FAILED role back to STARTING, so :meth:`start` runs its spec again (the way back of a
        restart policy).  Raises RuntimeError unless it failed and its process was reaped (stopped)."""
        with self._lock:
            if self.proc is not None and not self._reaped:
                raise RuntimeError(f"{self.name}: stop its process before a restart")
            self._move(RoleState.STARTING)
            self._reset()

    # -- port and wait ------------------------------------------------------------------------------
    def read_port(self, path: str, timeout: float, interval: float = portfile.POLL_INTERVAL) -> int | None:
        """The port this role (a scheduler) wrote to its port file ``path``, once it is there; None when
        it exits first or ``timeout`` seconds pass (its :attr:`exit_code` tells which)."""
        return read_port(path, timeout, self._exited.wait, interval)

    def wait(self, deadline: float | None = None) -> int | None:
        """Wait until the process has exited or the ``time.monotonic()`` ``deadline`` (None: no
        limit) has passed; return its exit code, None while it runs.  It is not reaped."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._exited.wait(timeout)
        return self._code

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the output pump to reach the end of the output."""
        if self._pump is not None:
            self._pump.join(timeout)

    # -- stop ---------------------------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process's group when it leads one (what it left there too, even after
        it exited), else to the process; nothing once it is reaped."""
        proc = self.proc
        if proc is None or self._reaped:
            return
        if self.own_group:
            _signal_group(proc.pid, sig)
        elif self._code is None:
            try:
                proc.send_signal(sig)
            except (ProcessLookupError, PermissionError):
                pass  # gone

    def request_stop(self) -> None:
        """Ask the role to stop: end of file on a tether's stdin, else SIGTERM to its process group.
        An exit from now on is STOPPED (one before stays what it was)."""
        with self._lock:
            self._stopping = True
        if self.proc is None:
            return
        if self.tethered:
            release(self.proc)
        else:
            self.signal(signal.SIGTERM)

    def _owns_leftovers(self) -> bool:
        """Whether what the process leaves in its group is this stop's to end (a tether ends its own)."""
        return self.own_group and not self.tethered

    def finish_stop(self, deadline: float, join_timeout: float = JOIN_TIMEOUT) -> Killed | None:
        """After :meth:`request_stop`: wait until the ``time.monotonic()`` ``deadline`` for the process
        to exit (and for a group started here, everything in it); SIGKILL what is left (it is sent
        whatever happens meanwhile); reap it; wait ``join_timeout`` for the output's end.  Returns
        what had to be killed, or None."""
        proc = self.proc
        if proc is None:
            return None
        killed: Killed | None = None
        try:
            if self._exited.wait(max(0.0, deadline - time.monotonic())):
                # reaped now, not before: while a member of its group lives, its pid stays the group's
                # id (Linux hands out no pid in use as a group id), so what follows reaches this group
                self.reap()
                while self._owns_leftovers() and group_alive(proc.pid) and time.monotonic() < deadline:
                    time.sleep(GROUP_POLL)  # polling interval of a wait bounded by ``deadline``
        finally:
            if not self._exited.is_set():
                killed = Killed.PROCESS
                self.signal(signal.SIGKILL)
            else:
                self.reap()
                if self._owns_leftovers() and group_alive(proc.pid):
                    killed = Killed.GROUP
                    _signal_group(proc.pid, signal.SIGKILL)
            self.reap()
        self.join(join_timeout)
        return killed

    def stop(self, wait: float | None = None, join_timeout: float = JOIN_TIMEOUT) -> Killed | None:
        """Stop the role: :meth:`request_stop`, then :meth:`finish_stop` ``wait`` seconds (default
        ``stop_wait``) from now.  Returns what had to be killed (see :class:`Killed`), or None."""
        self.request_stop()
        return self.finish_stop(time.monotonic() + (self.stop_wait if wait is None else wait), join_timeout)

    def reap(self) -> None:
        """Wait for the exit, then collect the process.  Its pid stays its group's id while anything
        of the group lives, and may be reused after that: :meth:`signal` no longer signals it."""
        if self.proc is None or self._reaped:
            return
        self._exited.wait()
        self.proc.wait()
        self._reaped = True
