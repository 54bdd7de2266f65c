"""kvstore.launch.output.PrefixedOutput: prefixed lines, and a traceback held and written in one piece."""

from __future__ import annotations

import io

from kvstore.launch.output import PrefixedOutput, ends_traceback
from tests.helpers import poll_for

TRACEBACK = [b"Traceback (most recent call last):\n", b'  File "x.py", line 1, in <module>\n',
             b"    f()\n", b"\n", b"ValueError: boom\n"]


def test_lines_get_the_prefix_at_once() -> None:
    """An ordinary line is written with the role's prefix as it comes."""
    stream = io.BytesIO()
    out = PrefixedOutput(b"[worker 1] ", stream)
    out.write(b"epoch 1\n")
    assert stream.getvalue() == b"[worker 1] epoch 1\n"
    assert out.last_exception is None


def test_a_traceback_is_held_until_its_exception_line() -> None:
    """Another role's lines written meanwhile come before the traceback, which comes out whole."""
    stream = io.BytesIO()
    one, two = PrefixedOutput(b"[worker 0] ", stream), PrefixedOutput(b"[worker 1] ", stream)
    for line in TRACEBACK[:-1]:
        one.write(line)
        two.write(b"still here\n")
    assert stream.getvalue() == b"[worker 1] still here\n" * 4
    one.write(TRACEBACK[-1])
    one.write(b"after\n")
    expected = b"".join(b"[worker 0] " + line for line in [*TRACEBACK, b"after\n"])
    assert stream.getvalue() == b"[worker 1] still here\n" * 4 + expected
    assert one.last_exception == "ValueError: boom"


def test_an_unfinished_traceback_is_written_after_the_wait_or_at_flush() -> None:
    """A traceback whose exception line never comes is written after ``wait`` seconds, or by flush()."""
    stream = io.BytesIO()
    out = PrefixedOutput(b"[s] ", stream, wait=0.05)
    out.write(TRACEBACK[0])
    poll_for(lambda: stream.getvalue() == b"[s] " + TRACEBACK[0], 5, "the held traceback to be written")
    flushed = io.BytesIO()
    out = PrefixedOutput(b"[s] ", flushed, wait=60)
    out.write(TRACEBACK[0])
    out.write(TRACEBACK[1])
    assert flushed.getvalue() == b""
    out.flush()
    assert flushed.getvalue() == b"[s] " + TRACEBACK[0] + b"[s] " + TRACEBACK[1]
    assert out.last_exception is None


def test_what_ends_a_traceback() -> None:
    """Only a line neither indented nor blank (nor another traceback's start) ends a traceback."""
    assert ends_traceback(b"ValueError: boom\n") and ends_traceback(b"KeyboardInterrupt")
    assert not any(ends_traceback(line) for line in TRACEBACK[:-1])
    assert not ends_traceback(b"\t  x\n")
