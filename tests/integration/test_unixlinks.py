"""Same-host workers reach their servers over Unix-socket links (kvstore.net.unixlink, docs/shm.md):
values exact whatever their size, zmq kept where links are off, and a stranger on the socket harmless."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from kvstore.net.unixlink import UnixLink

from .conftest import Cluster, unique_key


def _rounds(kv, key: str, n: int, steps: int = 3) -> None:
    """``steps`` push-then-pull rounds of an ``n``-float key, each checked exactly (one worker)."""
    kv.init(key, np.zeros(n, np.float32))
    for step in range(steps):
        kv.push(key, np.arange(n, dtype=np.float32) + step)
        out = np.empty(n, np.float32)
        kv.pull(key, out=out)
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) + step)
        got = kv.pushpull(key, np.full(n, 2.0, np.float32), out=np.empty(n, np.float32))
        np.testing.assert_array_equal(got, np.full(n, 2.0, np.float32))


@pytest.mark.timeout(90)
def test_same_host_servers_are_linked_and_values_stay_exact(make_cluster) -> None:
    """By default each worker's requests to a same-host server go over a link, not zmq; small keys and
    16 MB values sent inline (a 1 MiB segment cannot hold them: records far bigger than a socket
    buffer, both ways) come back exact, from two workers summed over two servers."""
    cluster: Cluster = make_cluster("dist_sync", 2, 2, KVSTORE_SHM_BYTES=str(1 << 20))  # 16 MB: inline
    for kv in cluster.workers:
        assert all(type(kv._io.sockets[i]) is UnixLink for i in (0, 1))
    small, big = unique_key("link"), unique_key("link")
    n = 4 << 20

    def work(kv) -> tuple[np.ndarray, np.ndarray]:
        kv.init([small, big], [np.zeros(8, np.float32), np.zeros(n, np.float32)])
        kv.push([small, big], [np.full(8, kv.rank + 1.0, np.float32), np.full(n, kv.rank + 1.0, np.float32)])
        outs = [np.empty(8, np.float32), np.empty(n, np.float32)]
        kv.pull([small, big], out=outs)
        return outs[0], outs[1]
    for out_small, out_big in cluster.run(work):
        np.testing.assert_array_equal(out_small, np.full(8, 3.0, np.float32))
        assert out_big[0] == out_big[-1] == 3.0 and np.all(out_big == 3.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", [{"KVSTORE_UNIX_LINKS": "0"}, {"KVSTORE_SHM": "0"}])
def test_links_off_keeps_zmq(make_cluster, setting) -> None:
    """KVSTORE_UNIX_LINKS=0, or no shared memory (big values would cross a link inline, where zmq moves
    them faster): the worker stays on zmq, values exact."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, **setting)
    kv = cluster.workers[0]
    assert type(kv._io.sockets[0]) is not UnixLink
    _rounds(kv, unique_key("nolink"), 1024)


@pytest.mark.timeout(60)
def test_a_server_without_the_workers_segment_is_not_linked(make_cluster) -> None:
    """Shared memory off on the server alone: it offers a link but maps no segment, so the worker puts
    it back on zmq before its first request; values exact."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_SHM="0")
    (kv,) = cluster.connect(shm=True)
    assert kv._io.lanes is None and type(kv._io.sockets[0]) is not UnixLink
    _rounds(kv, unique_key("nolink"), 1024)


@pytest.mark.timeout(60)
def test_a_stranger_on_the_link_socket_changes_nothing(make_cluster) -> None:
    """A local process that connects to a server's link socket and sends junk, a huge length or a
    guessed token is closed or refused; the linked worker's rounds go on exact."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1)
    kv = cluster.workers[0]
    link = kv._io.sockets[0]
    assert type(link) is UnixLink
    key = unique_key("stranger")
    _rounds(kv, key, 16, steps=1)
    for junk in (b"\xff" * 64, struct.pack("<IH", 1 << 31, 1) + bytes(32),
                 struct.pack("<IHI", 6, 1, 0), bytes(100)):
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.connect("\0" + link.address)
        stranger.sendall(junk)
        stranger.settimeout(10)
        try:
            stranger.recv(1 << 16)  # closed by the server, or an unsigned refusal, never a hang
        finally:
            stranger.close()
        _rounds(kv, unique_key("stranger"), 16, steps=1)
