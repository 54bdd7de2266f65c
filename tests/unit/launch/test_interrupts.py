"""kvstore.launch.interrupts: SIGINT and SIGTERM held while a child starts."""

from __future__ import annotations

import os
import signal

import pytest

from kvstore.launch.interrupts import held_interrupts


def test_interrupts_are_held_while_a_child_starts() -> None:
    """SIGINT inside held_interrupts() (as around Popen and the bookkeeping of a child) raises
    KeyboardInterrupt only after the block; the handlers are back as they were."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    finished = False
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100_000):  # the handler runs between these bytecodes, and only records it
                pass
            finished = True
    assert finished
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
