"""Logging that says which role and rank wrote each line."""

from __future__ import annotations

import logging
import sys


class _RoleFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.tag = "kvstore"

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.tag
        return True


_filter = _RoleFilter()


def setup(role: str, rank: int | None = None, level: str = "INFO") -> None:
    """Send this process's ``kvstore``/``scheduler`` logs to stderr, tagged with role and rank."""
    set_identity(role, rank)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(role)s %(levelname)s %(message)s"))
    handler.addFilter(_filter)
    for name in ("kvstore", "scheduler"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False


def set_identity(role: str, rank: int | None) -> None:
    """Change the role/rank tag of later log lines (a rank is known only after rendezvous)."""
    _filter.tag = role if rank is None else f"{role} {rank}"
