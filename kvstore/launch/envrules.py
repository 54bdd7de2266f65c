"""What every launcher shares about the processes it starts: their environment rules and exit codes.

The local and ssh launcher (``kvstore.launch.local``), Ray (``kvstore.ray``) and
Spark (``kvstore.spark``) each build the environment of the roles they start
and report how they ended; these are the rules they have in common.
"""

from __future__ import annotations

from collections.abc import Mapping

# Variables a launcher sets for each role itself: a caller may not set them for every role.
SET_BY_LAUNCHER = frozenset({"DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_WORKER",
                             "DMLC_NUM_SERVER", "DMLC_NODE_HOST", "DMLC_WORKER_ID", "KVSTORE_SERVER_ID",
                             "KVSTORE_PORT_FILE"})
# ... and those plus KVSTORE_NODE_PORT (which a cluster manager sets for one server): a value in the
# caller's own environment is never copied to every role.  Given on purpose (--env, env=), a fixed
# server port is the caller's choice: one server per host, or servers that collide.
PER_ROLE = SET_BY_LAUNCHER | {"KVSTORE_NODE_PORT"}
FORWARDED_PREFIXES = ("KVSTORE_", "DMLC_")


def forwarded(environ: Mapping[str, str]) -> dict[str, str]:
    """The caller's variables that every role started elsewhere gets: its ``KVSTORE_*``, ``DMLC_*`` and
    ``OMP_NUM_THREADS``, but not those in :data:`PER_ROLE`.  Nothing else of ``environ`` travels."""
    return {name: value for name, value in environ.items()
            if (name.startswith(FORWARDED_PREFIXES) or name == "OMP_NUM_THREADS") and name not in PER_ROLE}


def inherited(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the variables in :data:`PER_ROLE`: what a child started on this machine
    inherits of its launcher's environment."""
    return {name: value for name, value in environ.items() if name not in PER_ROLE}


def with_node_host(env: Mapping[str, str], host: str) -> dict[str, str]:
    """``env`` with ``DMLC_NODE_HOST=host``, unless ``env`` names a ``DMLC_INTERFACE`` (blank counts as
    unset): the role then binds that interface's address, so any ``DMLC_NODE_HOST`` is dropped."""
    out = dict(env)
    if (out.get("DMLC_INTERFACE") or "").strip():
        out.pop("DMLC_NODE_HOST", None)
    else:
        out["DMLC_NODE_HOST"] = host
    return out


def exit_code(returncode: int) -> int:
    """A process's exit code as a shell reports it: 128 + the signal number when a signal ended it."""
    return 128 - returncode if returncode < 0 else returncode


def raise_interrupt(signum: int, frame: object) -> None:
    """A signal handler (for SIGTERM) that raises ``KeyboardInterrupt(signum)``, as SIGINT does, so one
    ``except KeyboardInterrupt`` stops everything and can tell the two apart."""
    raise KeyboardInterrupt(signum)
