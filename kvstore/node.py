"""``python -m kvstore.node CMD...``: one command line for every role.

The scheduler and servers are started by module name (``python -m scheduler``,
``python -m kvstore.server``) per ``DMLC_ROLE``; a worker runs ``CMD`` (a first
word ending in ``.py`` runs with this Python).  The process is replaced with
``exec``, so signals from a cluster manager reach the role directly.
"""

from __future__ import annotations

import os
import sys

from . import config as kvconfig
from .errors import ConfigError


def role_command(role: str | None, command: list[str]) -> list[str]:
    """Return the argv that runs ``role`` (``command`` is the worker's).  Raises ConfigError."""
    if role == "scheduler":
        return [sys.executable, "-m", "scheduler"]
    if role == "server":
        return [sys.executable, "-m", "kvstore.server"]
    if role == "worker":
        if not command:
            raise ConfigError("DMLC_ROLE=worker needs a command: python -m kvstore.node train.py ...")
        return python_if_script(command)
    raise ConfigError("DMLC_ROLE is not set; set it to scheduler, server or worker "
                      "(or start the job with launch.py)")


def python_if_script(command: list[str]) -> list[str]:
    """Prefix ``command`` with this Python when its first word is a ``.py`` file."""
    return [sys.executable, *command] if command[0].endswith(".py") else list(command)


def main(argv: list[str] | None = None) -> int:
    """Become this node's role; returns only on a configuration error."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        cmd = role_command(kvconfig.load().role, argv)
    except ConfigError as exc:
        print(f"kvstore.node: {exc}", file=sys.stderr)
        return 2
    os.execvp(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
