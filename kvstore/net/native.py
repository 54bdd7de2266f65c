"""Which implementation of the small-message path this process runs (issue 39).

``kvstore.net._hot`` is a C extension built from this package's own source at ``pip install`` time
(setup.py); it does the framing, MAC and encoding of the compact layout (``kvstore.net.compact``) and
the header MAC of every message (``kvstore.net.auth``), byte for byte as the pure-Python code does.
It is optional: where it was not built (no compiler at install time) the pure-Python path runs, and
each node says so in one log line when it starts (:func:`announce`, at INFO: a machine without a
compiler is a supported one, and the line must not disturb a command's output);
``KVSTORE_PURE_PYTHON=1`` asks for the pure-Python path deliberately (no line).
Round semantics never depend on which one runs.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

from kvstore import config

log = logging.getLogger("kvstore.net")
_missing: list[str] = []  # why the compiled module could not be imported (at most one entry)
ABI = 1  # the compiled module's HOT_ABI this source calls (_hot.c): another is a stale build, not used


@functools.cache
def module() -> ModuleType | None:
    """The compiled ``kvstore.net._hot`` (not yet configured: ``kvstore.net.compact`` does that), or None
    where the pure-Python path runs.  Raises ConfigError for a bad ``KVSTORE_PURE_PYTHON``."""
    if config.pure_python():
        return None
    try:
        from kvstore.net import _hot  # type: ignore[attr-defined]  # built by setup.py, when it could be
    except ImportError as exc:
        _missing.append(str(exc))
        return None
    if getattr(_hot, "ABI", None) != ABI:  # built from an older source: its calls may not match ours
        _missing.append(f"the built module is stale (ABI {getattr(_hot, 'ABI', None)}, this source {ABI}): "
                        "rebuild it (pip install -e . or python setup.py build_ext --inplace)")
        return None
    return _hot


@functools.cache
def announce() -> None:
    """Log, once per process, that the pure-Python path runs because the compiled one was not built
    (a node calls this as it starts); nothing when it was built or ``KVSTORE_PURE_PYTHON=1``."""
    if module() is None and _missing:
        log.info("kvstore.net._hot is not built (%s): the pure-Python message path runs; reinstall "
                 "with a C compiler for the compiled one", _missing[0])
