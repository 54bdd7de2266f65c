"""Many keys through one cluster: 10,000 keys in one call each of init, push and pull."""

from __future__ import annotations

import numpy as np

from .conftest import Cluster


def test_ten_thousand_keys(make_cluster) -> None:
    """10,000 str and int keys spread over 2 servers all sum correctly for 2 workers."""
    cluster: Cluster = make_cluster("dist_sync", num_workers=2, num_servers=2)
    keys = [f"many/{i}" for i in range(5_000)] + list(range(5_000))
    base = np.arange(len(keys), dtype=np.float32)

    def work(kv):
        kv.init(keys, [np.zeros(2, np.float32)] * len(keys))
        kv.push(keys, [np.full(2, v, np.float32) for v in base])
        return np.array([o[0] for o in kv.pull(keys)])

    for got in cluster.run(work):
        np.testing.assert_array_equal(got, base * 2)
    servers = {p.server for k in keys[:200] for p in cluster.workers[0]._path.pieces(k)}
    assert servers == {0, 1}
