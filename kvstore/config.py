"""The only reader of the process environment.

MXNet's ``DMLC_*`` contract (set by ``launch.py`` or any other cluster manager)
plus this project's ``KVSTORE_*`` knobs become one frozen :class:`Config`.
Every function takes an ``environ`` mapping so tests can pass plain dicts;
``None`` means ``os.environ``.  Every variable is listed in ``docs/env.md``.
Nothing here probes the network: which address a node binds is :mod:`kvstore.net.address`'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError

ROLES = ("scheduler", "server", "worker")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_LOG_LEVEL = "WARNING"  # without KVSTORE_LOG_LEVEL: no lifecycle chatter, warnings and errors
DEFAULT_BIGARRAY_BOUND = 1_000_000
DEFAULT_CONNECT_TIMEOUT = 60.0
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_SHUTDOWN_TIMEOUT = 10.0
# Liveness: every node heartbeats once a second from a thread of its own; a node is declared lost
# after 10 s of silence -- long enough for a stop-the-world pause (GC, a page storm) or a scheduler
# busy with a burst of barriers, short enough that a dead peer is reported well inside a minute.
DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_TIMEOUT = 10.0
# The data path (docs/benchmarks.md has the measurements behind these): small values are packed into
# messages of up to 1 MiB; a pushed slice over 4 chunks travels in 2 MiB chunks, so a server sums one
# chunk while the next is on the wire and a server's unread messages stay within a few MiB per worker.
DEFAULT_BATCH_BYTES = 1 << 20
DEFAULT_CHUNK_BYTES = 2 << 20
WHOLE_CHUNKS = 4  # a slice of up to this many chunks travels whole (kvstore.core.plan)
# The largest frame a server's or the scheduler's ROUTER accepts (zmq MAXMSGSIZE; a bigger one
# disconnects its sender).  A worker's biggest legitimate frames are a slice of up to WHOLE_CHUNKS
# chunks (8 MiB by default), a batch (1 MiB) and a header (at most MAX_HEADER_BYTES, 1 MiB): 16 MiB
# leaves them twice that, and stops a stranger's declared multi-GiB frame at 16 MiB.
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
MIN_MESSAGE_BYTES = 1 << 20  # = kvstore.net.protocol.MAX_HEADER_BYTES: every header must fit
# A worker keeps at most this many pushes of one key unacknowledged (a further push waits for the
# oldest ack); a server refuses a push beyond it.  A server then holds O(workers x window x key
# size) whatever the skew between workers (docs/architecture.md, "Flow control and memory").
DEFAULT_PUSH_WINDOW = 2
DEFAULT_STALL_WARN = 60.0  # a sync round or barrier waiting this long is logged once, naming the late
# Same-host shared memory (kvstore.net.shm): each worker maps one segment of this size per server on its
# host, so at most workers x servers x 1 GiB of shared memory.  Pages are taken as they are first used and
# ranges are reused lowest first, so a segment holds the most bytes that were in flight at once: a push
# and the pull after it need twice the value, and 1 GiB carries a 256 MB value both ways (docs/shm.md).
DEFAULT_SHM_BYTES = 1 << 30


@dataclass(frozen=True)
class Config:
    """Everything a node needs to know about its cluster and its own limits."""

    role: str | None = None
    root_uri: str | None = None
    root_port: int | None = None
    num_servers: int | None = None
    num_workers: int | None = None
    node_host: str | None = None
    interface: str | None = None
    worker_id: int | None = None
    server_id: int | None = None
    secret: str | None = None
    bigarray_bound: int = DEFAULT_BIGARRAY_BOUND
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    auth_full: bool = False
    insecure: bool = False
    port_file: str | None = None
    node_port: int = 0
    resume: str | None = None
    log_level: str | None = None
    update_on_kvstore: bool = True
    batch_bytes: int = DEFAULT_BATCH_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    sum_order: str = "arrival"
    push_window: int = DEFAULT_PUSH_WINDOW
    hold_push: bool = False  # KVSTORE_HOLD_PUSH=1: dist_sync may hold a small push for its pull (one request)
    sync_quorum: int | None = None  # KVSTORE_SYNC_QUORUM: dist_sync rounds close at this many workers
    staleness: int | None = None    # KVSTORE_STALENESS: dist_async's bound on rounds ahead (None: off)
    encrypt: str | None = None       # KVSTORE_ENCRYPT: None (off) or "curve"
    curve_keys: str | None = None    # KVSTORE_CURVE_KEYS: a folder of key files, else derived from the secret
    stall_warn: float = DEFAULT_STALL_WARN  # KVSTORE_STALL_WARN: seconds before a stalled wait is logged
    stall_abort: float | None = None  # KVSTORE_STALL_ABORT: seconds before a stall raises (None: never)
    max_restarts: int = 0  # KVSTORE_MAX_RESTARTS: worker restarts the job absorbs (launch.py --max-restarts)
    incarnation: int = 0  # KVSTORE_INCARNATION: this worker's restarts so far (set by the launcher)
    test_die_at_round: tuple[int | None, int] | None = None  # KVSTORE_TEST_DIE_AT_ROUND: (rank, round)
    test_server_die_at: tuple[int | None, int] | None = None  # KVSTORE_TEST_SERVER_DIE_AT_ROUND
    test_arrivals: str | None = None  # KVSTORE_TEST_ARRIVALS: a file servers log each data request to
    scheduler_restarts: bool = False  # KVSTORE_SCHEDULER_RESTARTS: the launcher restarts a lost scheduler
    recover_left: tuple[int, ...] = ()  # KVSTORE_RECOVER_LEFT: a restarted scheduler's workers that exited 0
    restarts_used: int = 0  # KVSTORE_RESTARTS_USED: a restarted scheduler's restarts used so far
    elastic_workers: int | None = None  # KVSTORE_ELASTIC_WORKERS: workers present at the start (elastic)
    min_workers: int | None = None  # KVSTORE_MIN_WORKERS: a barrier with fewer present fails (elastic)
    join: bool = False  # KVSTORE_JOIN: this worker joins a running elastic job (set by the launcher)
    test_scheduler_die_at: tuple[str, int] | None = None  # KVSTORE_TEST_SCHEDULER_DIE_AT: (beats|barrier, N)
    test_server_stall: tuple[int, float] | None = None  # KVSTORE_TEST_SERVER_STALL: (Nth pull, seconds)
    snapshot_rounds: int = 0  # KVSTORE_SNAPSHOT_EVERY=N: a server writes its shard every N rounds (0: off)
    snapshot_seconds: float = 0.0  # KVSTORE_SNAPSHOT_EVERY=Ns: ... every N seconds instead (0: off)
    snapshot_dir: str | None = None  # KVSTORE_SNAPSHOT_DIR: where servers write their shards
    shm: bool = True  # KVSTORE_SHM: big arrays between a worker and a server on its host go by shared memory
    shm_bytes: int = DEFAULT_SHM_BYTES  # KVSTORE_SHM_BYTES: the size of each worker's segment per server
    unix_links: bool = True  # KVSTORE_UNIX_LINKS: a same-host worker talks to a server over a Unix socket
    histogram_every: int = 0  # KVSTORE_HISTOGRAM_EVERY=N: weight/gradient histograms every N steps (0: off)
    malloc_tune: bool = True  # KVSTORE_MALLOC_TUNE: fixed glibc heap thresholds in servers and workers

    def missing_cluster_vars(self) -> list[str]:
        """Return the names of the ``DMLC_*`` variables a distributed node needs but lacks."""
        needed = {"DMLC_PS_ROOT_URI": self.root_uri, "DMLC_PS_ROOT_PORT": self.root_port,
                  "DMLC_NUM_SERVER": self.num_servers, "DMLC_NUM_WORKER": self.num_workers}
        return [name for name, value in needed.items() if value is None]

    def require_cluster(self, what: str) -> None:
        """Raise :class:`ConfigError` naming every missing ``DMLC_*`` variable, if any."""
        missing = self.missing_cluster_vars()
        if missing:
            raise ConfigError(
                f"{what} needs the cluster environment, but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set. Start the job with the launcher, "
                "e.g. `python launch.py -n 2 -s 1 train.py`, or set the DMLC_* variables "
                "(see docs/env.md).")

    @property
    def root_address(self) -> str:
        """The scheduler's zmq address, ``tcp://host:port``."""
        host = self.root_uri or ""
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"tcp://{host}:{self.root_port}"


def env_text(env: Mapping[str, str], name: str, fallback: str | None = None) -> str | None:
    """The stripped value of ``name`` in ``env`` (else of ``fallback``); None when unset or blank."""
    value = env.get(name)
    if value is None and fallback is not None:
        value = env.get(fallback)
    value = value.strip() if value is not None else None
    return value or None


def env_int(env: Mapping[str, str], name: str, *, minimum: int, maximum: int | None = None,
            fallback: str | None = None, default: int | None = None) -> int | None:
    """The integer value of ``name`` in ``env`` (else of ``fallback``), or ``default`` when unset or blank.

    Raises :class:`ConfigError` naming the variable that was set when its value is not an
    integer or lies outside ``[minimum, maximum]``.
    """
    if env_text(env, name) is None and fallback is not None and env_text(env, fallback) is not None:
        name = fallback  # errors must name the variable the user actually set
    raw = env_text(env, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{name}={value} must be {bounds}")
    return value


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env_text(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ConfigError(f"{name}={value} must be a positive number of seconds")
    return value


def load(environ: Mapping[str, str] | None = None) -> Config:
    """Read a :class:`Config` from ``environ`` (default ``os.environ``).

    Raises :class:`ConfigError` for a value that is present but invalid; absent
    cluster variables are left ``None`` (see :meth:`Config.require_cluster`).
    """
    env = os.environ if environ is None else environ
    level = (env_text(env, "KVSTORE_LOG_LEVEL") or "").upper() or None
    if level is not None and level not in LOG_LEVELS:
        raise ConfigError(f"KVSTORE_LOG_LEVEL={level!r} is not one of {', '.join(LOG_LEVELS)}")
    role = env_text(env, "DMLC_ROLE")
    if role is not None and role not in ROLES:
        raise ConfigError(f"DMLC_ROLE={role!r} is not one of {', '.join(ROLES)}")
    interval = _seconds(env, "KVSTORE_HEARTBEAT_INTERVAL", DEFAULT_HEARTBEAT_INTERVAL)
    timeout = _seconds(env, "KVSTORE_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT)
    if timeout < 2 * interval:
        raise ConfigError(f"KVSTORE_HEARTBEAT_TIMEOUT={timeout:g} must be at least twice "
                          f"KVSTORE_HEARTBEAT_INTERVAL={interval:g}, or one late beat declares a node lost")
    return Config(
        role=role,
        root_uri=env_text(env, "DMLC_PS_ROOT_URI"),
        root_port=env_int(env, "DMLC_PS_ROOT_PORT", minimum=0, maximum=65535),
        num_servers=env_int(env, "DMLC_NUM_SERVER", minimum=1),
        num_workers=env_int(env, "DMLC_NUM_WORKER", minimum=1),
        node_host=env_text(env, "DMLC_NODE_HOST"),
        interface=env_text(env, "DMLC_INTERFACE"),
        worker_id=env_int(env, "DMLC_WORKER_ID", minimum=0),
        server_id=env_int(env, "KVSTORE_SERVER_ID", minimum=0),
        secret=env_text(env, "KVSTORE_SECRET"),
        bigarray_bound=env_int(env, "KVSTORE_BIGARRAY_BOUND", minimum=1,
                            fallback="MXNET_KVSTORE_BIGARRAY_BOUND",
                            default=DEFAULT_BIGARRAY_BOUND),
        connect_timeout=_seconds(env, "KVSTORE_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT),
        request_timeout=_seconds(env, "KVSTORE_REQUEST_TIMEOUT", DEFAULT_REQUEST_TIMEOUT),
        shutdown_timeout=_seconds(env, "KVSTORE_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT),
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        auth_full=_auth_mode(env) == "full",
        insecure=bool(env_int(env, "KVSTORE_INSECURE", minimum=0, maximum=1, default=0)),
        port_file=env_text(env, "KVSTORE_PORT_FILE"),
        node_port=env_int(env, "KVSTORE_NODE_PORT", minimum=0, maximum=65535, default=0),
        resume=env_text(env, "KVSTORE_RESUME"),
        log_level=level,
        update_on_kvstore=bool(env_int(env, "KVSTORE_UPDATE_ON_KVSTORE", minimum=0, maximum=1,
                                    fallback="MXNET_UPDATE_ON_KVSTORE", default=1)),
        **_data_path(env),
        **_watch_and_wire(env),
        **_restarts(env),
        **_shards(env),
    )


def _shm(env: Mapping[str, str]) -> dict[str, Any]:
    """Same-host shared memory: on or off, and each segment's size (at least 1 MiB); Unix-socket links."""
    return {"shm": bool(env_int(env, "KVSTORE_SHM", minimum=0, maximum=1, default=1)),
            "shm_bytes": env_int(env, "KVSTORE_SHM_BYTES", minimum=1 << 20, maximum=1 << 40,
                                 default=DEFAULT_SHM_BYTES),
            "unix_links": bool(env_int(env, "KVSTORE_UNIX_LINKS", minimum=0, maximum=1, default=1)),
            "malloc_tune": bool(env_int(env, "KVSTORE_MALLOC_TUNE", minimum=0, maximum=1, default=1))}


def _restarts(env: Mapping[str, str]) -> dict[str, Any]:
    """Worker restarts (docs/failures.md): the job's budget, this process's incarnation, the test hooks
    (and ``KVSTORE_TEST_ARRIVALS``, the servers' arrival log of tests of ``priority``)."""
    return {"max_restarts": env_int(env, "KVSTORE_MAX_RESTARTS", minimum=0, default=0),
            "incarnation": env_int(env, "KVSTORE_INCARNATION", minimum=0, default=0),
            "test_die_at_round": _die_at(env, "KVSTORE_TEST_DIE_AT_ROUND"),
            "test_server_die_at": _die_at(env, "KVSTORE_TEST_SERVER_DIE_AT_ROUND"),
            "scheduler_restarts": bool(env_int(env, "KVSTORE_SCHEDULER_RESTARTS", minimum=0, maximum=1,
                                               default=0)),
            "recover_left": _ranks(env, "KVSTORE_RECOVER_LEFT"),
            "restarts_used": env_int(env, "KVSTORE_RESTARTS_USED", minimum=0, default=0),
            "elastic_workers": env_int(env, "KVSTORE_ELASTIC_WORKERS", minimum=1, default=None),
            "min_workers": env_int(env, "KVSTORE_MIN_WORKERS", minimum=1, default=None),
            "join": bool(env_int(env, "KVSTORE_JOIN", minimum=0, maximum=1, default=0)),
            "test_scheduler_die_at": _scheduler_die_at(env),
            "test_server_stall": _stall(env, "KVSTORE_TEST_SERVER_STALL"),
            "test_arrivals": env_text(env, "KVSTORE_TEST_ARRIVALS")}


def _ranks(env: Mapping[str, str], name: str) -> tuple[int, ...]:
    """A comma-separated list of ranks >= 0 (empty when unset); ConfigError for anything else."""
    raw = env_text(env, name)
    if not raw:
        return ()
    try:
        ranks = tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a comma-separated list of ranks") from None
    if any(rank < 0 for rank in ranks):
        raise ConfigError(f"{name}={raw!r}: ranks must be >= 0")
    return ranks


def _scheduler_die_at(env: Mapping[str, str]) -> tuple[str, int] | None:
    """The test hook ``KVSTORE_TEST_SCHEDULER_DIE_AT``: ``beats:N`` (after N heartbeats) or
    ``barrier:N`` (once the N-th barrier has its first worker) as ``(kind, N)``."""
    raw = env_text(env, "KVSTORE_TEST_SCHEDULER_DIE_AT")
    if raw is None:
        return None
    kind, _, number = raw.partition(":")
    if kind not in ("beats", "barrier") or not number.isdigit() or int(number) < 1:
        raise ConfigError(f"KVSTORE_TEST_SCHEDULER_DIE_AT={raw!r} is not beats:N or barrier:N (N >= 1)")
    return kind, int(number)


def _shards(env: Mapping[str, str]) -> dict[str, Any]:
    """Server shards (docs/failures.md): ``KVSTORE_SNAPSHOT_EVERY`` (``N`` rounds or ``Ns`` seconds)
    and ``KVSTORE_SNAPSHOT_DIR``.  Raises ConfigError for a malformed period or one without a folder."""
    raw, folder = env_text(env, "KVSTORE_SNAPSHOT_EVERY"), env_text(env, "KVSTORE_SNAPSHOT_DIR")
    if raw is None:
        return {"snapshot_dir": folder}
    try:
        number = float(raw[:-1]) if raw.endswith("s") else int(raw)
    except ValueError:
        number = 0
    if not number > 0:
        raise ConfigError(f"KVSTORE_SNAPSHOT_EVERY={raw!r} is not N (rounds, >= 1) or Ns (seconds, > 0)")
    if folder is None:
        raise ConfigError("KVSTORE_SNAPSHOT_EVERY is set but KVSTORE_SNAPSHOT_DIR is not: "
                          "servers need a folder for their shards")
    if raw.endswith("s"):
        return {"snapshot_seconds": float(number), "snapshot_dir": folder}
    return {"snapshot_rounds": int(number), "snapshot_dir": folder}


def _die_at(env: Mapping[str, str], name: str) -> tuple[int | None, int] | None:
    """A test hook's ``N`` (any worker or server) or ``RANK:N`` as ``(rank or None, N)``."""
    raw = env_text(env, name)
    if raw is None:
        return None
    rank, _, number = raw.rpartition(":")
    try:
        parsed = (int(rank) if rank else None, int(number))
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not N or RANK:N") from None
    if parsed[1] < 1 or (parsed[0] is not None and parsed[0] < 0):
        raise ConfigError(f"{name}={raw!r}: N must be >= 1 and RANK >= 0")
    return parsed


def _stall(env: Mapping[str, str], name: str) -> tuple[int, float] | None:
    """A test hook's ``N:SECONDS`` as ``(N, seconds)`` (N >= 1, seconds > 0)."""
    raw = env_text(env, name)
    if raw is None:
        return None
    number, _, seconds = raw.partition(":")
    try:
        parsed = (int(number), float(seconds))
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not N:SECONDS") from None
    if parsed[0] < 1 or not 0 < parsed[1] < float("inf"):
        raise ConfigError(f"{name}={raw!r}: N must be >= 1 and SECONDS > 0")
    return parsed


def _watch_and_wire(env: Mapping[str, str]) -> dict[str, Any]:
    """Encryption, the stall inspector's knobs and the Trainer's histograms."""
    return {"encrypt": _encrypt(env), "curve_keys": env_text(env, "KVSTORE_CURVE_KEYS"),
            "stall_warn": _seconds(env, "KVSTORE_STALL_WARN", DEFAULT_STALL_WARN),
            "stall_abort": _seconds(env, "KVSTORE_STALL_ABORT", 0.0) or None,
            "histogram_every": env_int(env, "KVSTORE_HISTOGRAM_EVERY", minimum=0, default=0) or 0}


def _data_path(env: Mapping[str, str]) -> dict[str, Any]:
    """The data path's knobs: message sizes, the sum order, the push window, the sync quorum (in
    ``[1, DMLC_NUM_WORKER]``), the staleness bound, the held push and same-host shared memory."""
    return {"batch_bytes": env_int(env, "KVSTORE_BATCH_BYTES", minimum=0, default=DEFAULT_BATCH_BYTES),
            "chunk_bytes": env_int(env, "KVSTORE_CHUNK_BYTES", minimum=0, default=DEFAULT_CHUNK_BYTES),
            "max_message_bytes": _max_message_bytes(env), "sum_order": _sum_order(env),
            "push_window": env_int(env, "KVSTORE_PUSH_WINDOW", minimum=1, maximum=1024,
                                   default=DEFAULT_PUSH_WINDOW),
            "sync_quorum": env_int(env, "KVSTORE_SYNC_QUORUM", minimum=1,  # at most DMLC_NUM_WORKER
                                   maximum=env_int(env, "DMLC_NUM_WORKER", minimum=1)),
            "staleness": env_int(env, "KVSTORE_STALENESS", minimum=0),
            "hold_push": bool(env_int(env, "KVSTORE_HOLD_PUSH", minimum=0, maximum=1, default=0)),
            **_shm(env)}


def _max_message_bytes(env: Mapping[str, str]) -> int:
    value = env_int(env, "KVSTORE_MAX_MESSAGE_BYTES", minimum=0, default=DEFAULT_MAX_MESSAGE_BYTES)
    if 0 < value < MIN_MESSAGE_BYTES:
        raise ConfigError(f"KVSTORE_MAX_MESSAGE_BYTES={value} must be 0 (no limit) or at least "
                          f"{MIN_MESSAGE_BYTES} (a message header may take up to {MIN_MESSAGE_BYTES} bytes)")
    return value


def check_message_limits(max_message_bytes: int, chunk_bytes: int, batch_bytes: int | None = None,
                         source: str = "") -> None:
    """Raise :class:`ConfigError` naming the variables when a worker's legitimate message could be
    bigger than ``max_message_bytes`` (0: no limit): chunking off, 4 chunks over the limit, or
    batches over it.  ``batch_bytes`` None skips the batch check; ``source`` says where the first
    two values come from (e.g. " (the scheduler's)")."""
    if not max_message_bytes:
        return
    limit = f"KVSTORE_MAX_MESSAGE_BYTES={max_message_bytes}{source}"
    fix = f"set KVSTORE_CHUNK_BYTES to at most {max_message_bytes // WHOLE_CHUNKS}, or raise {limit}"
    if chunk_bytes <= 0:
        raise ConfigError(f"KVSTORE_CHUNK_BYTES=0{source} sends every value slice whole, however big, "
                          f"so a big one would exceed {limit}: {fix} (0 lifts the limit)")
    if WHOLE_CHUNKS * chunk_bytes > max_message_bytes:
        raise ConfigError(f"a value slice of up to {WHOLE_CHUNKS} chunks travels whole, and {WHOLE_CHUNKS} "
                          f"x KVSTORE_CHUNK_BYTES={chunk_bytes}{source} exceeds {limit}: {fix}")
    if batch_bytes is not None and batch_bytes > max_message_bytes:
        raise ConfigError(f"KVSTORE_BATCH_BYTES={batch_bytes} exceeds {limit}: set KVSTORE_BATCH_BYTES "
                          f"to at most {max_message_bytes}, or raise the limit")


def check_node_limit(own: int, cluster: int) -> None:
    """Raise :class:`ConfigError` when a node whose own ``KVSTORE_MAX_MESSAGE_BYTES`` is ``own`` would
    refuse frames the workers may send under the cluster's limit ``cluster`` (the scheduler's, from
    the map; 0 is no limit): ``own`` is smaller."""
    if own and not 0 < cluster <= own:
        theirs = cluster or "0 (no limit)"
        raise ConfigError(f"this node's KVSTORE_MAX_MESSAGE_BYTES={own} is smaller than the scheduler's "
                          f"{theirs}, under which workers cut their messages: set the same value everywhere")


def _sum_order(env: Mapping[str, str]) -> str:
    order = (env_text(env, "KVSTORE_SUM_ORDER") or "arrival").lower()
    if order not in ("rank", "arrival"):
        raise ConfigError(f"KVSTORE_SUM_ORDER={order!r} is not 'arrival' (the default: each push is added "
                          "as it arrives, so a server holds one sum per key whatever the skew) or 'rank' "
                          "(dist_sync sums in worker-rank order, bit-identical on every run, holding "
                          "pushes that arrive early)")
    return order


def _auth_mode(env: Mapping[str, str]) -> str:
    mode = (env_text(env, "KVSTORE_AUTH") or "header").lower()
    if mode not in ("header", "full"):
        raise ConfigError(f"KVSTORE_AUTH={mode!r} is not 'header' (the default: MACs over headers and "
                          "frame lengths) or 'full' (also a Poly1305 tag over the array bytes; needs the "
                          "'cryptography' package)")
    return mode


def _encrypt(env: Mapping[str, str]) -> str | None:
    mode = (env_text(env, "KVSTORE_ENCRYPT") or "off").lower()
    if mode not in ("off", "curve"):
        raise ConfigError(f"KVSTORE_ENCRYPT={mode!r} is not 'off' (the default) or 'curve' (ZeroMQ CURVE "
                          "encryption on every socket of the cluster)")
    return None if mode == "off" else mode


def pure_python(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVSTORE_PURE_PYTHON=1`` asks for the pure-Python small-message path even where the
    compiled one (``kvstore.net._hot``) is built.  Raises ConfigError for a value other than 0 or 1."""
    env = os.environ if environ is None else environ
    return bool(env_int(env, "KVSTORE_PURE_PYTHON", minimum=0, maximum=1, default=0))


def gpu_placement(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """``(LOCAL_RANK, CUDA_VISIBLE_DEVICES)`` as the launcher (``--gpus-per-worker``) or torchrun set
    them for this worker ("" when unset): where a pipeline stage's default device comes from."""
    env = os.environ if environ is None else environ
    return env.get("LOCAL_RANK", "").strip(), env.get("CUDA_VISIBLE_DEVICES", "").strip()


def in_cluster(environ: Mapping[str, str] | None = None) -> bool:
    """True when the environment names a distributed role (as the launcher sets it)."""
    env = os.environ if environ is None else environ
    return bool(env_text(env, "DMLC_ROLE"))


def child_environ(extra: Mapping[str, str], environ: Mapping[str, str] | None = None,
                  defaults: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return the environment of a child process: ``defaults``, overridden by ``environ``
    (default ``os.environ``), overridden by ``extra``."""
    env = dict(defaults or {})
    env.update(os.environ if environ is None else environ)
    env.update(extra)
    return env


@contextlib.contextmanager
def process_environ(overrides: Mapping[str, str]) -> Iterator[None]:
    """Set ``overrides`` in this process's environment for a ``with`` block, then restore what was there.

    For a role run inside a process kvstore does not own (a Spark task's reused
    Python worker): ``kvstore.create`` inside the block reads ``overrides``, and
    nothing of them is left for the process's next task.
    """
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
