"""A server's peak memory: all its resident pages, and its own (without same-host workers' segments).

The pages of a worker's shared-memory segment (``kvstore.net.shm``) that a server has read or written
count in the server's RSS, as ``RssShmem``, though they are the worker's segment and exist once.  The
kernel keeps one peak (``VmHWM``) for all pages, so the server's own peak (``RssAnon`` + ``RssFile``)
is bounded from above in intervals: at each :meth:`PeakMemory.checkpoint` the peak of the interval
that ends (``VmHWM``) minus the shared pages mapped when it began is an upper bound of the own peak
in it (those pages only grow while a segment stays mapped), and writing ``5`` to
``/proc/self/clear_refs`` starts the next interval's ``VmHWM`` afresh.  The server checkpoints before
and after it first touches a segment's pages (in steps of at most :data:`kvstore.net.shm.GROW_STEP`)
and around each unmapping, so the bound exceeds the true own peak by at most one step while a
segment grows, and by nothing once it stops growing.  docs/shm.md says why this is the honest figure.

Where ``clear_refs`` cannot be written (not Linux, a kernel before 4.0) the own peak is the whole
peak, as without shared memory.
"""

from __future__ import annotations

import resource
import sys

KIB = 1024


def _status() -> dict[str, int]:
    """``VmHWM``, ``VmRSS`` and ``RssShmem`` of this process in bytes ({} where /proc is missing)."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                name, _, rest = line.partition(":")
                if name in ("VmHWM", "VmRSS", "RssShmem"):
                    fields[name] = int(rest.split()[0]) * KIB
    except (OSError, ValueError, IndexError):
        return {}
    return fields


def _ru_maxrss() -> int:
    """This process's peak resident set size in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * KIB


class PeakMemory:
    """The peak of all of this process's resident pages and an upper bound of the peak of its own."""

    def __init__(self) -> None:
        self.total = 0
        self.own = 0
        self._resettable = True
        self._shared = _status().get("RssShmem", 0)  # shared pages mapped when the interval began

    def checkpoint(self) -> None:
        """End the current interval (fold its peak into :attr:`total` and :attr:`own`) and begin the
        next.  Raises nothing."""
        self._fold()
        if not self._resettable:
            return
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
                clear.write("5")  # VmHWM := VmRSS
        except OSError:
            self._resettable = False  # every later interval runs from here: still an upper bound
            return
        self._shared = _status().get("RssShmem", 0)

    def _fold(self) -> None:
        peak = _status().get("VmHWM") or _ru_maxrss()
        self.total = max(self.total, peak)
        self.own = max(self.own, peak - self._shared)

    def report(self) -> tuple[int, int]:
        """(peak resident bytes in all, upper bound of the peak of the process's own), up to now."""
        self._fold()
        return self.total, self.own
