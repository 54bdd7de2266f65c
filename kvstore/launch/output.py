"""One role's output on the launcher's stdout: :class:`PrefixedOutput`.

Every line gets the role's prefix (``[worker 1] ``).  A Python traceback is held from its first line
(``Traceback (most recent call last):``) to its exception line (the first line after it that is
neither indented nor blank), or for at most :data:`TRACEBACK_WAIT` seconds, and then written in one
write: the tracebacks of roles that fail together come out one after the other, not line by line
into each other.  The last exception line is kept for the launcher's summary of a failed run.
"""

from __future__ import annotations

import sys
import threading
from typing import IO

TRACEBACK_START = b"Traceback (most recent call last):"
TRACEBACK_WAIT = 1.0  # seconds a traceback is held at most while its exception line is awaited
STDOUT_LOCK = threading.Lock()  # one writer at a time of prefixed lines to this process's stdout


def ends_traceback(line: bytes) -> bool:
    """Whether ``line``, inside a traceback, is its exception line (not indented, not blank)."""
    return bool(line.strip()) and not line[:1].isspace() and not line.startswith(TRACEBACK_START)


def summary_line(name: str, code: int | None, exception: str | None) -> str:
    """The last line of a failed launch: ``launch.py: worker 1 failed first (exit 1): ValueError: boom``
    (every launcher writes this one)."""
    text = f"launch.py: {name} failed first (exit {'unknown' if code is None else code})"
    return f"{text}: {exception}" if exception else text


class ExceptionLine:
    """Tracks the exception line of the last complete traceback in a role's lines (text, no output)."""

    def __init__(self) -> None:
        self.last: str | None = None
        self._open = False

    def feed(self, line: str) -> None:
        """Take the role's next output line (without its newline)."""
        if self._open:
            if ends_traceback(line.encode(errors="replace")):
                self.last, self._open = line.strip(), False
        elif line.startswith(TRACEBACK_START.decode()):
            self._open = True


class PrefixedOutput:
    """The lines of one role, each written to ``stream`` (default: this process's stdout) with
    ``prefix``; a traceback is held until it ends, then written at once (see the module docstring)."""

    def __init__(self, prefix: bytes, stream: IO[bytes] | None = None, wait: float = TRACEBACK_WAIT) -> None:
        self.prefix, self.wait = prefix, wait
        self._stream = stream
        self._held: list[bytes] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.last_exception: str | None = None  # the exception line of the last traceback seen

    def write(self, line: bytes) -> None:
        """Write ``line`` (newline kept) with the prefix, or hold it while a traceback is open."""
        with self._lock:
            if self._held:
                self._held.append(line)
                if ends_traceback(line):
                    self.last_exception = line.decode(errors="replace").strip()
                    self._flush()
                return
            if line.startswith(TRACEBACK_START):
                self._held.append(line)
                self._timer = threading.Timer(self.wait, self.flush)
                self._timer.daemon = True
                self._timer.start()
                return
            self._write([line])

    def flush(self) -> None:
        """Write what is held (a traceback whose end has not come: the output ended, or it was slow)."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        """Write the held lines in one write (with ``_lock`` held)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self._held = self._held, []
        if held:
            self._write(held)

    def _write(self, lines: list[bytes]) -> None:
        """Write ``lines``, each with the prefix, in one write under :data:`STDOUT_LOCK`."""
        data = b"".join(self.prefix + line for line in lines)
        with STDOUT_LOCK:
            stream = self._stream or sys.stdout.buffer
            stream.write(data)
            stream.flush()
