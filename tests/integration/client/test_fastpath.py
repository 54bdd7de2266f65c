"""Known lists of small keys take the worker's fast path (kvstore/client/fastpath.py) and the
servers' key groups (kvstore/core/groups.py): results, errors and fallbacks as the generic path."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import KeyTypeError, ShapeMismatchError

from ..conftest import Cluster

pytestmark = pytest.mark.timeout(120)


def test_repeated_lists_sum_and_pull_as_the_generic_path(make_cluster) -> None:
    """Two workers push, pull and pushpull one list of 300 small keys (two dtypes, 2-D values, two
    servers) for several rounds through the fast path; every round's values are the sums, and a
    pull of a sub-list (which dissolves the servers' groups) still reads them."""
    cluster: Cluster = make_cluster("dist_sync", num_workers=2, num_servers=2)
    keys = [f"fp/{i}" for i in range(150)] + list(range(150))
    shapes = [(2, 3) if i % 2 else (5,) for i in range(len(keys))]
    dtypes = [np.float32 if i % 3 else np.float64 for i in range(len(keys))]

    def work(kv):
        kv.init(keys, [np.zeros(s, d) for s, d in zip(shapes, dtypes)])
        outs = [np.empty(s, d) for s, d in zip(shapes, dtypes)]
        for step in range(1, 5):
            kv.push(keys, [np.full(s, step + kv.rank, d) for s, d in zip(shapes, dtypes)])
            kv.pull(keys, out=outs)
            assert all(np.all(o == 2 * step + 1) for o in outs)
            kv.pushpull(keys, [np.full(s, step, d) for s, d in zip(shapes, dtypes)], out=outs)
            assert all(np.all(o == 2 * step) for o in outs)
        assert kv._fast._lists[tuple(keys)] is not None  # the fast path was taken
        sub = kv.pull(keys[::7])
        return all(np.all(v == 8) for v in sub)

    assert cluster.run(work) == [True, True]


def test_a_bad_call_of_a_known_list_raises_as_the_generic_path(make_cluster) -> None:
    """After a list is known, a value of the wrong shape and a bool key are refused as before (the
    fast path steps aside), and nothing is sent for them."""
    cluster: Cluster = make_cluster("dist_sync", num_workers=1, num_servers=1)
    kv = cluster.workers[0]
    keys = [1, 2, 3]
    kv.init(keys, [np.zeros(4, np.float32)] * 3)
    kv.push(keys, [np.ones(4, np.float32)] * 3)
    with pytest.raises(ShapeMismatchError):
        kv.push(keys, [np.ones(4, np.float32), np.ones(5, np.float32), np.ones(4, np.float32)])
    with pytest.raises(KeyTypeError):
        kv.push([True, 2, 3], [np.ones(4, np.float32)] * 3)
    outs = [np.empty(4, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
    assert all(np.all(o == 1) for o in outs)


def test_one_key_takes_the_fast_path_and_its_errors_stay(make_cluster) -> None:
    """A lone small key goes through its one-key plan with the generic results and errors."""
    cluster: Cluster = make_cluster("dist_sync", num_workers=1, num_servers=1)
    kv = cluster.workers[0]
    kv.init("one", np.zeros(3, np.float32))
    out = np.empty(3, np.float32)
    for step in range(1, 4):
        kv.push("one", np.full(3, step, np.float32))
        kv.pull("one", out=out)
        assert np.all(out == step)
        value = np.full(3, 10 * step, np.float32)
        assert kv.pushpull("one", value) is value and np.all(value == 10 * step)
    assert kv._fast._lists[("one",)] is not None  # the one-key plan was used
    with pytest.raises(ShapeMismatchError):
        kv.push("one", np.ones(4, np.float32))
    assert np.all(kv.pull("one") == 30)
