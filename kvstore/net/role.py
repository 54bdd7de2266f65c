"""The wrapper of a role process's main (the scheduler's, a server's): load the config, set up
logging, and map errors to exit codes.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from kvstore import config as kvconfig
from kvstore import logs
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.role")


def run_role(role: str, body: Callable[[kvconfig.Config], int],
             rank: Callable[[kvconfig.Config], int | None] = lambda cfg: None) -> int:
    """Run a role process's ``body(cfg)``: load the config, set up logging, map errors to exit codes.

    Returns 2 for an invalid setting, 1 when ``body`` raises a :class:`KVStoreError`,
    else ``body``'s own code.
    """
    try:
        cfg = kvconfig.load()
    except KVStoreError as exc:
        print(f"{role}: {exc}", file=sys.stderr)
        return 2
    logs.setup(role, rank(cfg), level=cfg.log_level or kvconfig.DEFAULT_LOG_LEVEL)
    try:
        return body(cfg)
    except KVStoreError as exc:
        log.error("%s", exc)
        return 1
