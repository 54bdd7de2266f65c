"""The C reader of a refused message's frames uses pyzmq's own libzmq, never another copy."""

from __future__ import annotations

import ctypes
import io
import shutil
import sys

import pytest
import zmq

from kvstore.net import transport


def _pyzmq_library_path() -> str:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        found = {line.split()[-1] for line in maps if "libzmq" in line and "/" in line}
    if len(found) != 1:
        pytest.skip("pyzmq's libzmq is not one library of its own in this process")
    return found.pop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_discarder_calls_pyzmqs_libzmq_even_when_the_map_names_another(monkeypatch, tmp_path) -> None:
    """A libzmq pyzmq does not call (the only one mapped, pyzmq's linked in statically) is never used."""
    other = tmp_path / "libzmq.so.5"
    shutil.copy(_pyzmq_library_path(), other)  # another copy of the library: its own code and state
    fake_maps = f"7f0000000000-7f0000001000 r-xp 00000000 fe:00 1 {other}\n"
    monkeypatch.setattr(transport, "open", lambda *a, **k: io.StringIO(fake_maps), raising=False)
    found = transport._discarder()
    if found is None:
        return  # not using the C reader at all is safe
    backend = ctypes.CDLL(sys.modules[zmq.backend.Socket.__module__].__file__)
    address = ctypes.cast(backend.zmq_msg_recv, ctypes.c_void_p).value
    assert ctypes.cast(found._recv, ctypes.c_void_p).value == address


def test_the_discarder_reads_the_rest_of_a_message_on_a_pyzmq_socket() -> None:
    """The rest of a 5-frame message is read and counted by the C reader; the next message is intact."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://discard-test")
        b.connect("inproc://discard-test")
        a.send_multipart([b"1", b"2", b"3", b"4", b"5"])
        a.send_multipart([b"next"])
        first = b.recv(copy=False)
        assert transport._discard_rest(b, first) == 4
        assert b.recv_multipart() == [b"next"]
    finally:
        a.close(0)
        b.close(0)
