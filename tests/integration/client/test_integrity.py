"""KVSTORE_AUTH=full through real processes: a push whose array bytes are damaged in flight is refused by
the server with a sealed IntegrityError, which the worker's next call on the key raises at once (not
after KVSTORE_REQUEST_TIMEOUT); the server's value is unchanged and the cluster goes on."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

import kvstore
from kvstore.client.store import DistKVStore, connect
from kvstore.errors import AuthenticationError, IntegrityError
from tests.helpers import poll_for

from ..conftest import Cluster

REQUEST_TIMEOUT = 60.0


class FlipOneArrayByte:
    """A tamper hook, given to the store's Mux when it is made (``kvstore.client.mux``): once ``armed``,
    the next message with an array frame goes out with its first array byte flipped (in a copy: the
    frame is a view of the caller's array); ``used`` says it happened."""

    def __init__(self) -> None:
        self.armed = self.used = False

    def __call__(self, frames: list) -> list:
        if not self.armed or self.used or len(frames) < 3:
            return frames
        self.used = True
        damaged = bytearray(bytes(frames[2]))
        damaged[0] ^= 0x01
        return [*frames[:2], bytes(damaged), *frames[3:]]


@pytest.mark.timeout(60)
def test_a_damaged_push_fails_the_next_call_at_once_and_changes_nothing(make_cluster) -> None:
    """Damaged push of 'w' -> the next pull of 'w' raises IntegrityError naming the push, well before
    the request timeout; a fresh pull returns the previous value; a genuine push then applies."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_AUTH="full",
                                    KVSTORE_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT))
    flip = FlipOneArrayByte()  # installed when the store is made, armed below
    kv = DistKVStore("dist_sync", cluster.cfg, joined=connect(cluster.cfg, "dist_sync", tamper=flip))
    cluster.workers = [kv]
    assert kv._io.channel.full and kv._cfg.request_timeout == REQUEST_TIMEOUT
    before = np.arange(8, dtype=np.float32)
    kv.init("w", before)
    flip.armed = True
    started = time.monotonic()
    kv.push("w", np.full(8, 100.0, np.float32))
    with pytest.raises(IntegrityError) as caught:
        kv.pull("w")
    elapsed = time.monotonic() - started
    assert flip.used and elapsed < 10.0, f"the error took {elapsed:.1f} s"
    assert isinstance(caught.value, kvstore.AuthenticationError)
    assert isinstance(caught.value, kvstore.KVStoreError)
    assert "push of key 'w'" in str(caught.value) and "nothing was applied" in str(caught.value)
    np.testing.assert_array_equal(kv.pull("w"), before)  # the server's value is untouched
    kv.push("w", np.full(8, 3.0, np.float32))  # the cluster goes on: an undamaged push applies
    np.testing.assert_array_equal(kv.pull("w"), np.full(8, 3.0, np.float32))
    server_log = next(log for name, _, log in cluster.procs.procs if name == "server 0")
    poll_for(lambda: "damaged-payload=1" in server_log.read_text(), 10, "the server to log the refusal")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cluster_mode", ["full", "header"])
def test_a_worker_in_the_other_auth_mode_is_refused_clearly(make_cluster, cluster_mode: str) -> None:
    """A worker whose KVSTORE_AUTH differs from the cluster's gets an AuthenticationError naming both
    modes at registration, at once; a worker in the cluster's mode then joins."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_AUTH=cluster_mode)
    other = dataclasses.replace(cluster.cfg, auth_full=cluster_mode == "header", connect_timeout=10.0)
    started = time.monotonic()
    with pytest.raises(AuthenticationError, match=f"reached a node with KVSTORE_AUTH={cluster_mode}"):
        DistKVStore("dist_sync", other)
    assert time.monotonic() - started < 10.0
    (kv,) = cluster.connect()
    kv.init("w", np.ones(2))
    np.testing.assert_array_equal(kv.pull("w"), np.ones(2))
