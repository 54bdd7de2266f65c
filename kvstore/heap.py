"""Keep the C heap's pages from one training step to the next (``KVSTORE_MALLOC_TUNE``, on by default).

glibc's malloc gives memory back to the kernel once the free space at the top of its heap passes a
*trim threshold*, and maps each block over an *mmap threshold* on its own; both adapt to about twice
the largest block freed so far.  A server or worker allocates the same few arrays of 1-32 MB every
step (a received gradient, a new weight, an optimizer's scratch, a pulled value, autograd's
gradients) and frees them again, so with those defaults every step faults their pages in anew: about
400 page faults a step on the server of a 670k-parameter MLP (a quarter of its time), measured with
``/proc/<pid>/stat`` (docs/benchmarks.md).  :func:`tune` fixes the thresholds instead: blocks under
:data:`MMAP_THRESHOLD` come from the heap, and up to :data:`TRIM_THRESHOLD` bytes of free heap stay
mapped for the next step.  Larger values (a 64 MB or 256 MB key) are still mapped on their own and
returned when freed.  The free space kept at the top of the heap is bounded by the trim threshold;
free blocks inside the heap are reused but never returned, with glibc's defaults as with these.

That kept top is one per *arena*: zmq's I/O thread allocates the messages it receives from an arena
of its own, and glibc's ``malloc_trim`` returns the free blocks of every arena but the top of the
main one only.  After a stranger's flood of big messages, up to the trim threshold stayed resident
in each I/O thread's arena (16 or 31 MiB in a pipeline stage).  :func:`trimming` frees such blocks
with the threshold at zero, so their arena's top goes back at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import platform
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger("kvstore.heap")

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's own upper bound for its adaptive threshold on 64-bit systems
TRIM_THRESHOLD = 16 << 20

_done: str | None = None
_mallopt_fn: Callable[[int, int], int] | None = None  # set once tune() has fixed the thresholds
_trim_lock = threading.Lock()
_trimmers = 0  # threads inside trimming() now


def tune(enabled: bool = True) -> str:
    """Fix glibc's trim and mmap thresholds for this process (once; later calls repeat the answer).

    Returns what was done, or why nothing was: turned off, not glibc, or ``mallopt`` refused.
    Raises nothing.
    """
    global _done
    if _done is not None:
        return _done
    if not enabled:
        _done = "off (KVSTORE_MALLOC_TUNE=0)"
    elif not _glibc():
        _done = "not glibc: the allocator is left as it is"
    else:
        _done = _mallopt()
    log.debug("malloc thresholds: %s", _done)
    return _done


def _glibc() -> bool:
    """Whether this process runs on glibc; False when that cannot be told (``platform.libc_ver``
    reads ``sys.executable`` where ``CS_GNU_LIBC_VERSION`` is missing, and that file may be gone)."""
    try:
        return platform.libc_ver()[0] == "glibc"
    except OSError:
        return False


def _mallopt() -> str:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "no mallopt in this process"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "mallopt refused the thresholds"
    global _mallopt_fn
    _mallopt_fn = mallopt
    return f"mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"


@contextlib.contextmanager
def trimming() -> Iterator[None]:
    """While inside, a block freed into any arena gives that arena's free top back to the OS at once
    (trim threshold 0); on leaving, the threshold is :func:`tune`'s again.  For dropping a refused
    message's big buffers, which zmq's I/O thread allocated.  Does nothing where :func:`tune` did not
    fix the thresholds (glibc's adaptive ones are left alone).  Threads may overlap: the threshold
    comes back when the last of them leaves.  Raises nothing."""
    global _trimmers
    mallopt = _mallopt_fn
    if mallopt is None:
        yield
        return
    with _trim_lock:
        _trimmers += 1
        if _trimmers == 1:
            mallopt(M_TRIM_THRESHOLD, 0)
    try:
        yield
    finally:
        with _trim_lock:
            _trimmers -= 1
            if _trimmers == 0:
                mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
