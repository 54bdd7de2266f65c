"""TensorBoard next to a cluster (``launch.py --tensorboard DIR``, ``kvstore.spark.run(tensorboard=...)``).

Two parts, both on the launcher's (or driver's) host, so no role needs a shared disk:

- :class:`ScalarWriter`, a thread that asks the scheduler for STATUS once a second (with the
  cluster's secret, as ``kvstore.status`` does) and writes every node's counters
  (:func:`kvstore.core.scalars.node_scalars`), the Trainer's rates and the user's
  ``kvstore.log_scalar`` values as TensorBoard scalars, and the workers' weight and gradient
  histograms (``KVSTORE_HISTOGRAM_EVERY``) as histograms: one run directory per job
  (``DIR/job-...``), one subdirectory per role and rank (``scheduler``, ``server-0``, ``worker-1``).
- :class:`TensorBoardServer`: the real ``python -m tensorboard.main --logdir DIR`` on a free port (or
  ``TENSORBOARD_PORT``); it prints ``TensorBoard at http://host:port/`` once it listens, and is
  stopped after the job unless kept.

Both need the ``[tensorboard]`` extra (:func:`require`).  ``DIR`` may be a storage URL
(``s3://bucket/runs``, :mod:`kvstore.core.storage`): an object store cannot append, so each event
file there is written in parts (:class:`kvstore.launch.eventfile.EventFile`).  docs/observability.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvstore import config as kvconfig
from kvstore.core import scalars as kvscalars
from kvstore.core import storage
from kvstore.errors import ConfigError, KVStoreError
from kvstore.launch.eventfile import EventFile
from kvstore.launch.roleprocess import RoleProcess, RoleSpec
from kvstore.net.status_client import StatusClient

log = logging.getLogger("kvstore.launcher")
MISSING = ("TensorBoard is not installed: --tensorboard (and kvstore.spark.run's tensorboard=) need the "
           "[tensorboard] extra: pip install 'kvstore-ps[tensorboard]' (or pip install tensorboard)")
PORT_VARIABLE = "TENSORBOARD_PORT"
URL = re.compile(r"(https?://\S+?)/?\s")
ROLES = ("scheduler", "server", "worker")  # whose snapshots are written
STARTUP_TIMEOUT = 60.0  # seconds TensorBoard has to say where it listens


def require(logdir: str | None = None) -> None:
    """Check TensorBoard's writer can be imported, and for an ``s3://`` ``logdir`` the boto3 its server
    reads S3 with.  Raises ConfigError with what to install."""
    try:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"{MISSING} ({exc})") from None
    if logdir is not None and str(logdir).lower().startswith("s3://"):
        try:
            import boto3  # noqa: F401
        except ImportError:
            raise ConfigError("TensorBoard reads s3:// through boto3: pip install boto3") from None


def new_run_dir(logdir: str) -> str:
    """Create and return a fresh run directory of one job under ``logdir`` (a path or a storage URL):
    ``job-YYYYmmdd-HHMMSS-xxxx``.  Raises OSError, ConfigError for a URL kvstore cannot open."""
    name = f"job-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    if storage.is_local(logdir):
        path = os.path.join(os.path.abspath(storage.local_path(logdir) or logdir), name)
        os.makedirs(path, exist_ok=False)
        return path
    path = storage.join(logdir, name)
    storage.makedirs(path)
    return path


class ScalarWriter(threading.Thread):
    """Polls the scheduler at ``where`` (zmq address) every ``interval`` seconds and writes the
    scalars of every node under ``run_dir`` until :meth:`stop`."""

    def __init__(self, run_dir: str, settings: kvconfig.Config, where: str, interval: float = 1.0) -> None:
        super().__init__(name="kvstore-tensorboard-writer", daemon=True)
        self.run_dir, self.settings, self.where, self.interval = run_dir, settings, where, interval
        self._stop_event = threading.Event()
        self._writers: dict[str, EventFile] = {}
        self._failing = False  # the last write failed (warned once; quiet until one works again)
        self._seen: dict[str, int] = {}  # run -> last user-scalar sequence number written
        self._trainer: dict[str, tuple[float, dict[str, Any]]] = {}  # run -> (time, trainer field)
        self._histograms: dict[tuple[str, str], int] = {}  # (run, tag) -> last histogram seq written
        self._t0 = time.time()
        self.polls = 0  # STATUS replies written

    def stop(self, timeout: float = 10.0) -> None:
        """Write one last poll, close the event files and end the thread (within ``timeout``)."""
        self._stop_event.set()
        self.join(timeout)

    def run(self) -> None:
        # At once, then every interval: the scheduler hears from the start that a poller follows the
        # job, so it waits at its end (bounded) for one more STATUS, sent after every role's final
        # counters, however short the job or late a poll (its linger; docs/observability.md).
        client = StatusClient(self.settings, self.where)
        try:
            client = self._poll(client, max(2.0, 3 * self.interval))
            while not self._stop_event.wait(self.interval):
                client = self._poll(client, max(2.0, 3 * self.interval))
            self._poll(client, 0.5)  # the last one, when the scheduler is still there
        finally:
            client.close()
            for writer in self._writers.values():
                writer.close()

    def _poll(self, client: StatusClient, timeout: float) -> StatusClient:
        """Write one STATUS; return the client for the next poll: a fresh one after a reply from
        before the cluster map (the scheduler answers from then on over a channel of its own, whose
        first reply would not open on this one: asking twice could miss the scheduler's last one)."""
        try:
            body = client.status(timeout, follow=True)  # the scheduler holds at exit for our next one
        except KVStoreError as exc:  # the scheduler is starting or gone: the next poll may work
            log.debug("no STATUS for TensorBoard: %s", exc)
            return client
        self.record(body)
        cluster = body.get("cluster")
        if isinstance(cluster, dict) and cluster.get("complete") is False:
            client.close()
            return StatusClient(self.settings, self.where)
        return client

    def _writer(self, run: str) -> EventFile:
        writer = self._writers.get(run)
        if writer is None:
            writer = self._writers[run] = EventFile(storage.join(self.run_dir, run))
        return writer

    def record(self, body: dict[str, Any]) -> bool:
        """:meth:`write` ``body``; True when it was written.  A failure (a full disk) is logged once,
        then nothing until a write works again, which is logged in one line.  Raises nothing."""
        try:
            self.write(body)
        except OSError as exc:
            if not self._failing:
                self._failing = True
                log.warning("cannot write TensorBoard's event files under %s: %s; the scalars are dropped "
                            "(no more warnings) until they can be written again", self.run_dir, exc)
            else:
                log.debug("still cannot write TensorBoard's event files: %s", exc)
            return False
        if self._failing:
            self._failing = False
            log.info("TensorBoard's event files under %s are written again", self.run_dir)
        return True

    def write(self, body: dict[str, Any]) -> None:
        """Write the scalars of one STATUS reply ``body``; flush the event files.  Raises nothing but
        OSError."""
        snapshots = [s for s in body.get("nodes", []) if isinstance(s, dict) and not s.get("truncated")]
        if isinstance(body.get("scheduler"), dict):
            snapshots.append(body["scheduler"])
        for snap in snapshots:
            role, rank = snap.get("role"), snap.get("rank")
            if role not in ROLES or not isinstance(rank, int):
                continue
            self._write_node(kvscalars.run_name(role, rank), snap)
        failed: OSError | None = None
        for writer in self._writers.values():
            try:
                writer.flush()
            except OSError as exc:  # the other runs may still be written
                failed = failed or exc
        if failed is not None:
            raise failed
        self.polls += 1

    def _write_node(self, run: str, snap: dict[str, Any]) -> None:
        wall = snap.get("time") if isinstance(snap.get("time"), float) else time.time()
        step = max(0, round(wall - self._t0))
        values = kvscalars.node_scalars(snap)
        trainer = snap.get("trainer")
        if isinstance(trainer, dict):
            previous = self._trainer.get(run)
            if previous is not None:
                values.update(kvscalars.trainer_rates(previous[1], trainer, wall - previous[0]))
            self._trainer[run] = (wall, trainer)
        writer = self._writer(run)
        for tag, value in values.items():
            writer.add(_event(tag, value, step, wall))
        user, self._seen[run] = kvscalars.new_scalars(snap, self._seen.get(run, 0))
        for name, value, user_step, user_wall in user:
            writer.add(_event(name, value, user_step, user_wall))
        histograms = snap.get("histograms")
        if isinstance(histograms, dict):
            for tag, entry in histograms.items():
                event = histogram_event(tag, entry)
                if event is None or entry[0] == self._histograms.get((run, tag)):
                    continue
                self._histograms[(run, tag)] = entry[0]
                writer.add(event)


def _event(tag: str, value: float, step: int, wall: float) -> Any:
    from tensorboard.compat.proto import event_pb2, summary_pb2  # the extra
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
    return event_pb2.Event(wall_time=wall, step=step, summary=summary)


def histogram_event(tag: Any, entry: Any) -> Any:
    """The TensorBoard event of one carried histogram ``entry`` (``[seq, step, wall, min, max, count,
    sum, sum_of_squares, counts]``, :class:`kvstore.client.meter.HistogramLog`): a HistogramProto whose
    buckets are ``counts`` over equal widths from min to max.  None for a malformed one; raises nothing."""
    from tensorboard.compat.proto import event_pb2, summary_pb2  # the extra
    if not (isinstance(tag, str) and isinstance(entry, list) and len(entry) == 9
            and all(isinstance(v, int) and not isinstance(v, bool) for v in (entry[0], entry[1], entry[5]))
            and all(_real(v) for v in entry[2:8]) and isinstance(entry[8], list)
            and entry[8] and all(isinstance(c, int) and not isinstance(c, bool) for c in entry[8])):
        return None
    _, step, wall, low, high, count, total, squares, counts = entry
    width = (high - low) / len(counts)
    limits = [low + width * (i + 1) for i in range(len(counts) - 1)] + [float(high)]
    if high == low:  # one value: a bucket at it
        limits, counts = [float(high)], [count]
    histo = summary_pb2.HistogramProto(min=low, max=high, num=count, sum=total, sum_squares=squares,
                                       bucket_limit=limits, bucket=counts)
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, histo=histo)])
    return event_pb2.Event(wall_time=float(wall), step=max(0, step), summary=summary)


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def port_from(environ: Mapping[str, str]) -> int:
    """``TENSORBOARD_PORT`` of ``environ``, or 0 (a free port).  Raises ConfigError for a bad value."""
    return kvconfig.env_int(environ, PORT_VARIABLE, minimum=0, maximum=65535, default=0) or 0


class TensorBoardServer:
    """The TensorBoard process over ``logdir`` (a :class:`RoleProcess` in a process group of its own,
    its output in ``logdir/tensorboard-<launcher pid>.log``)."""

    def __init__(self, logdir: str, port: int = 0, bind_all: bool = False) -> None:
        local = storage.local_path(logdir)
        self.logdir = os.path.abspath(local) if local is not None else logdir
        self.port, self.bind_all = port, bind_all
        self.role: RoleProcess | None = None
        self.url: str | None = None
        # its output beside the events, or in the temporary folder when they are on a store
        self.log_path = os.path.join(self.logdir if local is not None else tempfile.gettempdir(),
                                     f"tensorboard-{os.getpid()}.log")
        self._announcer: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """TensorBoard's process id while it runs, else None."""
        proc = self.role.proc if self.role is not None else None
        return proc.pid if proc is not None and proc.poll() is None else None

    def _popen(self, spec: RoleSpec) -> subprocess.Popen:
        with open(self.log_path, "wb") as out:
            return subprocess.Popen(spec.argv, env=spec.env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=out, start_new_session=True)

    def start(self) -> None:
        """Start TensorBoard, and a thread that prints ``TensorBoard at URL`` once it listens.
        Raises OSError when it cannot be started."""
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        where = ["--bind_all"] if self.bind_all else ["--host", "127.0.0.1"]
        argv = [sys.executable, "-m", "tensorboard.main", "--logdir", self.logdir, "--port", str(self.port),
                *where, "--reload_interval", "1", "--load_fast", "false"]  # one process, no data server
        self.role = RoleProcess(RoleSpec("tensorboard", None, argv, kvconfig.child_environ({})),
                                self._popen, stop_wait=10.0)
        self.role.start()
        self._announcer = threading.Thread(target=self._announce, name="kvstore-tensorboard-url",
                                           daemon=True)
        self._announcer.start()

    def _announce(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline and self.role is not None:
            found = self._url()
            if found is not None:
                self.url = found
                print(f"TensorBoard at {found} (logdir {self.logdir}, pid {self.pid})",
                      file=sys.stderr, flush=True)
                return
            if self.role.exit_code is not None:
                break
            time.sleep(0.2)  # polling interval of a deadline-bounded wait
        log.warning("TensorBoard did not start (see %s)", self.log_path)

    def _url(self) -> str | None:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as src:
                match = URL.search(src.read())
        except OSError:
            return None
        return match.group(1) if match else None

    def wait_url(self, timeout: float) -> str | None:
        """The URL once TensorBoard listens (None after ``timeout`` seconds or if it exited)."""
        if self._announcer is not None:
            self._announcer.join(timeout)
        return self.url

    def stop(self) -> None:
        """Stop TensorBoard (SIGTERM to its group, SIGKILL after 10 s) and reap it; never raises."""
        if self.role is not None:
            self.role.stop()
        if self._announcer is not None:
            self._announcer.join(1.0)


class JobBoard:
    """``--tensorboard``'s parts for one job: the server over ``logdir`` (started first), the writer of
    the job's run (attached once the scheduler's port is known), and their end."""

    def __init__(self, logdir: str, keep: bool, environ: Mapping[str, str], bind_all: bool = False) -> None:
        require(logdir)
        self.keep = keep
        self.server = TensorBoardServer(logdir, port_from(environ), bind_all)
        self.run_dir = new_run_dir(logdir)
        self.writer: ScalarWriter | None = None

    def start(self) -> None:
        """Start TensorBoard.  Raises OSError when it cannot be started."""
        self.server.start()

    def attach(self, settings: kvconfig.Config, where: str) -> None:
        """Start writing the scalars of the cluster whose scheduler is at ``where`` (zmq address),
        asked with ``settings``' secret."""
        self.writer = ScalarWriter(self.run_dir, settings, where)
        self.writer.start()

    def finish_writer(self) -> None:
        """Stop the writer after one last poll (the job is over); never raises."""
        if self.writer is not None:
            self.writer.stop()

    def finish(self) -> None:
        """Stop the writer and, unless kept, TensorBoard; never raises."""
        self.finish_writer()
        if not self.keep:
            self.server.stop()
            return
        pid = self.server.pid
        if pid is not None:
            print(f"TensorBoard keeps running at {self.server.url or '(starting)'} (pid {pid}; "
                  f"stop it with: kill {pid})", file=sys.stderr, flush=True)


class AddressInbox:
    """Where a job's scheduler task reports its ``host:port`` to the driver (Spark: the scheduler runs
    on an executor): a TCP listener on every interface of this host, a free port, one JSON line
    ``{"host", "port"}`` per connection, handed to ``on_address`` (the first one only)."""

    def __init__(self, on_address: Callable[[str, int], None]) -> None:
        self.on_address = on_address
        self.listener = socket.create_server(("", 0))
        self.port = self.listener.getsockname()[1]
        self._done = False
        self._thread = threading.Thread(target=self._serve, name="kvstore-scheduler-inbox", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._done:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5.0)
                try:
                    report = json.loads(_receive_line(conn))
                    host, port = str(report["host"]), int(report["port"])
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("ignored a bad scheduler address report: %s", exc)
                    continue
            self._done = True
            self.on_address(host, port)

    def close(self) -> None:
        """Stop listening."""
        self._done = True
        self.listener.close()
        self._thread.join(2.0)


def _receive_line(conn: socket.socket, limit: int = 4096) -> bytes:
    """The bytes ``conn`` sends up to a newline, its end, or ``limit``.  Raises OSError."""
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = conn.recv(limit)
        if not chunk:
            break
        data += chunk
    return data


def report_address(inbox: tuple[str, int], host: str, port: int, timeout: float = 5.0) -> None:
    """Tell the driver's :class:`AddressInbox` at ``inbox`` (host, port) that the scheduler listens on
    ``host:port``.  Raises OSError when the driver cannot be reached."""
    with socket.create_connection(inbox, timeout=timeout) as conn:
        conn.sendall(json.dumps({"host": host, "port": port}).encode() + b"\n")
