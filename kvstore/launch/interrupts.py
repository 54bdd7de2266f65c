"""Holding SIGINT and SIGTERM while the launcher starts a process and records it, so an interrupt
never leaves a started process that nobody stops."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for a ``with`` block, then deliver those that came (once each) to the
    handlers there were: e.g. a Ctrl-C then raises KeyboardInterrupt after the block, not inside it.

    Done by swapping the Python handlers (which always run in the main thread), not by a signal
    mask (which would not stop another thread from taking the signal).  Outside the main thread,
    where handlers cannot be set, nothing is held.  Raises what a restored handler raises.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous: dict[int, object] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):  # one at a time: a signal between them still restores
            previous[sig] = signal.signal(sig, lambda signum, _frame: held.append(signum))
        yield
    finally:
        interrupted = _restore_handlers(previous)
        if interrupted is not None:
            raise interrupted
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


def _restore_handlers(previous: dict[int, object]) -> BaseException | None:
    """Put back every handler of ``previous``; return the exception a restored handler raised for a
    signal that came meanwhile (the others are put back first), or None."""
    left = dict(previous)
    raised: BaseException | None = None
    while left:
        try:
            while left:
                sig, handler = next(iter(left.items()))
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
                del left[sig]
        except BaseException as exc:  # noqa: BLE001 -- e.g. KeyboardInterrupt from a restored handler
            raised = raised or exc
    return raised
