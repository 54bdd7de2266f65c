"""PushWindow (pure logic, fake requests): waits for the oldest push of a full key, raises a
DeadlineExceededError naming the key and the knob, and treats a failed push as answered."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import pytest

from kvstore.client.window import PushWindow
from kvstore.errors import DeadlineExceededError, ProtocolError


@dataclass
class FakeRequest:
    future: Future = field(default_factory=Future)


def test_room_until_the_window_is_full():
    window = PushWindow(2)
    assert window.has_room(["w"])
    window.add({"w": [FakeRequest()]})
    assert window.has_room(["w"])
    window.add({"w": [FakeRequest()]})
    assert not window.has_room(["w"]) and window.has_room(["v"])


def test_answered_pushes_leave_the_window():
    window = PushWindow(1)
    first = FakeRequest()
    window.add({"w": [first]})
    first.future.set_result("ack")
    assert window.has_room(["w"])


def test_wait_room_drives_the_oldest_push_to_its_ack():
    window = PushWindow(1)
    oldest = FakeRequest()
    window.add({"w": [oldest]})
    waited = []

    def wait(request, timeout):
        waited.append(request)
        request.future.set_result("ack")  # what the wire does once the server acks
        return "ack"

    window.wait_room(["w"], time.monotonic() + 5, wait)
    assert waited == [oldest] and window.has_room(["w"]) and window.waiting == 0


def test_a_failed_push_counts_as_answered():
    window = PushWindow(1)
    oldest = FakeRequest()
    window.add({"w": [oldest]})

    def wait(request, timeout):
        request.future.set_exception(ProtocolError("refused"))
        raise ProtocolError("refused")

    window.wait_room(["w"], time.monotonic() + 5, wait)  # raised later, by the key's next call
    assert window.has_room(["w"])


def test_the_deadline_names_the_key_and_the_knob():
    window = PushWindow(1)
    window.add({"w": [FakeRequest()]})

    def wait(request, timeout):
        raise FutureTimeout()

    with pytest.raises(DeadlineExceededError, match=r"key 'w'.*KVSTORE_PUSH_WINDOW=1"):
        window.wait_room(["w"], time.monotonic(), wait)
    assert window.waiting == 0 and window.blocked_seconds >= 0
