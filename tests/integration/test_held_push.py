"""A held push through real processes (issue 39): in dist_sync a small key's push followed by a pull of
the same key travels as one PUSHPULL; anything else sends the push first, as it is.

The servers log each data request as it arrives (``KVSTORE_TEST_ARRIVALS``, a test hook installed only
when set), so a test counts the requests a call sequence took.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore.errors import DTypeMismatchError
from tests.helpers import poll_for

from .conftest import unique_key


def _requests(log: Path, sender: int = 0) -> list[tuple[str, list[str]]]:
    """(op, keys) of each data request ``sender`` made, in arrival order (INITs left out)."""
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [(line["op"], line["keys"]) for line in lines if line["op"] != "INIT" and line["sender"] == sender]


@pytest.fixture
def one(make_cluster, tmp_path: Path):
    """A 1-worker 1-server dist_sync cluster logging arrivals: (its worker, the log).  The test's
    thread keeps the GIL from a push to the pull after it however loaded the machine is (a long
    switch interval): else the Mux's releaser thread may take the GIL meanwhile and send the push
    alone, which is right but not what these tests look at."""
    log = tmp_path / "arrivals.jsonl"
    cluster = make_cluster("dist_sync", 1, 1, KVSTORE_TEST_ARRIVALS=str(log), KVSTORE_HOLD_PUSH="1")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    yield cluster.workers[0], log
    sys.setswitchinterval(interval)


def test_a_push_then_a_pull_of_the_same_key_is_one_request(one) -> None:
    """A 1-element key's and a 1,024-float key's push then pull (into an out) reach the server as one
    PUSHPULL each, every round, and the pull reads the pushed value."""
    kv, log = one
    for size in (1, 1024):
        key = unique_key()
        kv.init(key, np.zeros(size, np.float32))
        out = np.empty(size, np.float32)
        for step in range(3):
            kv.push(key, np.full(size, step + 1, np.float32))
            kv.pull(key, out=out)
            assert np.all(out == step + 1)
        assert [op for op, keys in _requests(log) if keys == [key]] == ["PUSHPULL"] * 3


def test_by_default_a_push_is_sent_by_its_call(make_cluster, tmp_path: Path) -> None:
    """Without KVSTORE_HOLD_PUSH=1 (the default) a push then a pull of one small key are a PUSH and
    a PULL: holding is opt-in (a caller running Python after a push would delay it by the GIL's
    switch interval, docs/benchmarks.md)."""
    log = tmp_path / "arrivals.jsonl"
    kv = make_cluster("dist_sync", 1, 1, KVSTORE_TEST_ARRIVALS=str(log)).workers[0]
    key = unique_key()
    kv.init(key, np.zeros(4, np.float32))
    out = np.empty(4, np.float32)
    kv.push(key, np.ones(4, np.float32))
    kv.pull(key, out=out)
    assert np.all(out == 1)
    assert [op for op, keys in _requests(log) if keys == [key]] == ["PUSH", "PULL"]


def test_a_list_of_small_keys_in_one_message_is_held_too(one) -> None:
    """A list of small keys batched in one message: its push then pull is one PUSHPULL."""
    kv, log = one
    keys = [unique_key(), unique_key()]
    kv.init(keys, [np.zeros(3, np.float32), np.zeros(2, np.float32)])
    outs = [np.empty(3, np.float32), np.empty(2, np.float32)]
    kv.push(keys, [np.full(3, 4, np.float32), np.full(2, 5, np.float32)])
    kv.pull(keys, out=outs)
    assert outs[0].tolist() == [4] * 3 and outs[1].tolist() == [5] * 2
    assert [op for op, sent in _requests(log) if sent == keys] == ["PUSHPULL"]


def test_a_lone_push_reaches_the_server_with_no_further_call(one) -> None:
    """A push no call follows is sent anyway (the Mux's releaser thread): the server logs it as a
    PUSH while the worker calls nothing, and a later pull reads it."""
    kv, log = one
    key = unique_key()
    kv.init(key, np.zeros(1, np.float32))
    kv.push(key, np.full(1, 7, np.float32))
    poll_for(lambda: ("PUSH", [key]) in _requests(log), 10, "the lone push to reach the server")
    assert kv.pull(key).tolist() == [7.0]


def test_a_pull_of_another_key_a_barrier_and_close_each_send_the_held_push_first(one) -> None:
    """A held push goes out as it is, before the call that follows: a pull of another key, a barrier,
    a second push of the key, close; every value is right."""
    kv, log = one
    a, b = unique_key(), unique_key()
    kv.init([a, b], [np.zeros(2, np.float32), np.zeros(2, np.float32)])
    out = np.empty(2, np.float32)
    kv.push(a, np.full(2, 1, np.float32))
    kv.pull(b, out=out)  # another key
    assert out.tolist() == [0, 0]
    assert _requests(log)[-2:] == [("PUSH", [a]), ("PULL", [b])]
    kv.push(a, np.full(2, 2, np.float32))
    kv.barrier()
    assert _requests(log)[-1] == ("PUSH", [a])
    kv.push(a, np.full(2, 3, np.float32))
    kv.push(a, np.full(2, 4, np.float32))  # the first goes out as the second is held
    kv.pull(a, out=out)
    assert out.tolist() == [4, 4]
    assert _requests(log)[-2:] == [("PUSH", [a]), ("PUSHPULL", [a])]
    kv.push(b, np.full(2, 5, np.float32))
    kv.close()
    assert _requests(log)[-1] == ("PUSH", [b])


def test_dist_async_never_holds_a_push(make_cluster, tmp_path: Path) -> None:
    """In dist_async a push then a pull of the same key are a PUSH then a PULL, the push sent at once."""
    log = tmp_path / "arrivals.jsonl"
    kv = make_cluster("dist_async", 1, 1, KVSTORE_TEST_ARRIVALS=str(log), KVSTORE_HOLD_PUSH="1").workers[0]
    key = unique_key()
    kv.init(key, np.zeros(1, np.float32))
    out = np.empty(1, np.float32)
    kv.push(key, np.full(1, 3, np.float32))
    kv.pull(key, out=out)
    assert out.tolist() == [3.0]
    assert [op for op, keys in _requests(log) if keys == [key]] == ["PUSH", "PULL"]


def test_a_held_push_that_fails_raises_at_the_next_call_on_its_key(one) -> None:
    """A push the server refuses (an int key under an optimizer): taken along by its pull, the pull
    raises it; sent alone (a pull of another key followed), the key's next call raises it, once."""
    kv, log = one
    bad, other = unique_key(), unique_key()
    kv.init([bad, other], [np.zeros(1, np.int32), np.zeros(1, np.float32)])
    kv.set_optimizer(kvstore.optimizer.create("sgd"))  # updates floating-point keys only
    ints, out, fout = np.ones(1, np.int32), np.empty(1, np.int32), np.empty(1, np.float32)
    kv.push(bad, ints)
    with pytest.raises(DTypeMismatchError, match="floating-point"):
        kv.pull(bad, out=out)
    assert _requests(log) == [("PUSHPULL", [bad])]  # taken along
    kv.pull(bad, out=out)  # raised once: this pull reads the value
    assert out.tolist() == [0]
    kv.push(bad, ints)
    kv.pull(other, out=fout)  # sends the held push alone; its refusal is the key's
    assert _requests(log)[-2:] == [("PUSH", [bad]), ("PULL", [other])]
    with pytest.raises(DTypeMismatchError, match="floating-point"):
        kv.pull(bad, out=out)
    kv.pull(bad, out=out)
    assert out.tolist() == [0]


@pytest.mark.timeout(120)
def test_a_pull_from_another_thread_after_a_push_returned_sees_that_push(make_cluster) -> None:
    """Thread A pushes k then pulls it (taking the held push along); thread B, once A's push returned,
    pulls k and must read that push, every step, with a 1 us switch interval (review: B's PULL once
    overtook A's PUSHPULL while the push was out of its slot, 284 of 3,000 stale)."""
    kv = make_cluster("dist_sync", 1, 1, KVSTORE_HOLD_PUSH="1").workers[0]
    key = unique_key()
    kv.init(key, np.zeros(1, np.float32))
    pushed, read = threading.Event(), threading.Event()
    stale: list[tuple[int, float]] = []
    steps, out = 1500, np.empty(1, np.float32)

    def other_thread() -> None:
        for step in range(1, steps + 1):
            if not pushed.wait(30):
                return
            pushed.clear()
            got = float(kv.pull(key)[0])
            if got != step:
                stale.append((step, got))
            read.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=other_thread, daemon=True)
    try:
        thread.start()
        for step in range(1, steps + 1):
            kv.push(key, np.full(1, step, np.float32))
            pushed.set()
            kv.pull(key, out=out)
            assert read.wait(30), f"the other thread's pull of step {step} did not return"
            read.clear()
    finally:
        sys.setswitchinterval(interval)
        thread.join(30)
    assert stale == [], f"{len(stale)} of {steps} pulls missed the push before them, e.g. {stale[:5]}"
