"""A late registration with the right secret is told the truth: the cluster is already complete."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.client.store import DistKVStore
from kvstore.errors import AuthenticationError, ProtocolError

from .conftest import Cluster, unique_key


def test_a_late_worker_with_the_right_secret_hears_the_cluster_is_complete(make_cluster) -> None:
    """A node that registers after the map went out (a forked child calling create) gets ProtocolError
    'already complete', not an AuthenticationError blaming the secret; the cluster keeps working."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1)
    (kv,) = cluster.workers
    key = unique_key()
    kv.init(key, np.ones(3, np.float32))
    started = time.monotonic()
    with pytest.raises(ProtocolError, match="already complete") as caught:
        DistKVStore("dist_sync", cluster.cfg)
    assert not isinstance(caught.value, AuthenticationError)
    assert time.monotonic() - started < 10.0
    kv.push(key, np.full(3, 2.0, np.float32))
    np.testing.assert_array_equal(kv.pull(key), np.full(3, 2.0, np.float32))


def test_a_late_worker_may_ask_twice(make_cluster) -> None:
    """The refusal is given to each late registration, not once per scheduler."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1)
    for _ in range(2):
        with pytest.raises(ProtocolError, match="already complete"):
            DistKVStore("dist_sync", cluster.cfg)
