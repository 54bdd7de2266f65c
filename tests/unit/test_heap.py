"""``kvstore.heap.tune``: fixed glibc thresholds keep a freed array's pages for the next one.

Each case runs in a fresh interpreter (the thresholds are process-wide) and counts the page faults
(``ru_minflt``) of a step's pattern repeated 40 times: three 4 MiB arrays allocated and filled, then all
freed. Whether glibc's adaptive defaults hand the freed top back depends on where the interpreter's small
objects happen to land (a run here stopped trimming after four steps, CI's kept on), so both cases run
under ``MALLOC_TRIM_THRESHOLD_=0``, glibc's own knob for a heap that gives freed memory back at once
(it also fixes the mmap threshold at 128 KiB: untuned, each array is a mapping of its own, unmapped when
freed), what a server's step met when its freed top passed twice the largest block. Transparent huge
pages are off in the child, so a fault is a 4 KiB page whatever the machine's THP mode.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from kvstore import heap

pytestmark = pytest.mark.timeout(60)

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

SCRIPT = """
import ctypes, json, resource, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
import numpy as np
from kvstore import heap
said = heap.tune(sys.argv[1] == "1")
arrays = [np.ones(1 << 20, np.float32) for _ in range(3)]  # a first step maps the heap's pages
del arrays
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    arrays = [np.ones(1 << 20, np.float32) for _ in range(3)]  # 4 MiB each, written
    del arrays
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"said": said, "faults": faults}))
"""


def _faults(enabled: bool) -> dict:
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, "1" if enabled else "0"], capture_output=True,
                          text=True, timeout=50, check=True, env=env)
    return json.loads(done.stdout)


@glibc_only
def test_tuned_heap_reuses_a_freed_arrays_pages() -> None:
    """With tune, a step's freed 4 MiB arrays keep their pages for the next step, even where glibc was told to
    trim; without it, they fault anew."""
    tuned, plain = _faults(True), _faults(False)
    assert tuned["said"].startswith("mmap threshold 32 MiB")
    assert plain["said"].startswith("off")
    pages = 40 * 3 * (4 << 20) // 4096  # every array faulting every page in anew
    assert tuned["faults"] < pages // 50, tuned  # its pages stay mapped from one array to the next
    assert plain["faults"] > pages // 2, plain  # untuned, the freed top goes back and faults in again


def test_tune_answers_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call of tune decides for the process; later calls repeat its answer."""
    monkeypatch.setattr(heap, "_done", None)
    first = heap.tune(False)
    assert first == "off (KVSTORE_MALLOC_TUNE=0)"
    assert heap.tune(True) == first  # a process's thresholds are set once, by its first call


def test_tune_raises_nothing_where_the_libc_cannot_be_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CS_GNU_LIBC_VERSION (musl, macOS) and an unreadable interpreter path: tune leaves the heap alone."""

    def no_confstr(name: str) -> str:
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr(heap, "_done", None)
    monkeypatch.setattr(os, "confstr", no_confstr)
    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python3")
    assert "glibc" in heap.tune(True)


# A thread of its own (glibc gives it an arena of its own, as zmq's I/O thread has) allocates and fills
# a 12 MiB block (a received message); the main thread frees it, as a stage drops a refused message,
# within heap.trimming() or not.  Prints how much of the 12 MiB stays resident after malloc_trim(0).
ARENA_SCRIPT = """
import ctypes, json, sys, threading
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
from kvstore import heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
said = heap.tune(True)
blocks = []
def allocate():
    block = libc.malloc(12 << 20)
    ctypes.memset(block, 1, 12 << 20)
    blocks.append(block)
thread = threading.Thread(target=allocate)
thread.start()
thread.join()
base = rss()
if sys.argv[1] == "1":
    with heap.trimming():
        for block in blocks:
            libc.free(block)
else:
    for block in blocks:
        libc.free(block)
libc.malloc_trim(0)
print(json.dumps({"said": said, "kept": 12 - (base - rss())}))
"""


def _kept(trimming: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", ARENA_SCRIPT, "1" if trimming else "0"], capture_output=True,
                          text=True, timeout=50, check=True)
    return json.loads(done.stdout)


@glibc_only
def test_blocks_freed_while_trimming_leave_no_top_in_another_threads_arena() -> None:
    """malloc_trim returns every arena's free blocks but only the main arena's top: a 12 MiB block freed
    into a thread's arena stays resident (under the 16 MiB trim threshold), and goes back when freed
    within heap.trimming() (a refused message that zmq's I/O thread allocated)."""
    plain, trimmed = _kept(False), _kept(True)
    assert plain["said"].startswith("mmap threshold 32 MiB") and trimmed["said"] == plain["said"]
    assert plain["kept"] > 8, plain  # the control: the freed block stays resident
    assert trimmed["kept"] < 1, trimmed


def test_overlapping_trimmings_restore_the_threshold_when_the_last_one_leaves(monkeypatch) -> None:
    """Two users overlap (one enters, the other enters, the first leaves): the threshold stays 0 until
    the second leaves too, then is tune()'s again, once (a recording mallopt stands in for glibc's)."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(heap, "_mallopt_fn", lambda option, value: calls.append((option, value)) or 1)
    first, second = heap.trimming(), heap.trimming()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert calls == [(heap.M_TRIM_THRESHOLD, 0)]  # the second is still freeing with threshold 0
    second.__exit__(None, None, None)
    assert calls == [(heap.M_TRIM_THRESHOLD, 0), (heap.M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD)]
