"""A sealed message whose array description numpy cannot build (dims ``[0, 2**63]``, or 65 dims) once
killed the node that decoded it.  Sent to a live server and to the scheduler, each must now be
refused with an ERROR (if answered at all) while the node keeps serving: a worker's push and pull
return the right values afterwards, and nobody is declared lost."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.net.protocol import Op

from .conftest import Cluster, insider, unique_key
from .test_fuzz import Target, sealed_raw

FATAL_METAS = {"dims-0-2**63": (["float32", [0, 2**63]], b""),
               "65-dims": (["float32", [1] * 65], b"\x00" * 4)}
SERVER_OPS = (Op.PUSH, Op.INIT, Op.STATE_SET)
SCHEDULER_OPS = (Op.HEARTBEAT, Op.BARRIER)


@pytest.mark.parametrize("case", sorted(FATAL_METAS))
def test_unbuildable_array_descriptions_leave_server_and_scheduler_serving(make_cluster, case) -> None:
    """The server and the scheduler refuse the sealed message and go on; no node is lost."""
    meta, frame = FATAL_METAS[case]
    cluster: Cluster = make_cluster("dist_sync", 2, 1)
    key, value = unique_key(), np.arange(5, dtype=np.float32)
    cluster.run(lambda kv: kv.init(key, value))
    sealer = insider(cluster.workers[0], "attacker")
    server, scheduler = Target.server(cluster, sealer), Target.scheduler(cluster, sealer)
    try:
        for target, ops in ((server, SERVER_OPS), (scheduler, SCHEDULER_OPS)):
            for op in ops:
                header = {"op": int(op), "seq": 7, "sender": 0, "body": {"keys": [key], "sizes": [5]},
                          "arrays": [meta], "auth": target.auth()}
                target.refuses(sealed_raw(sealer, header, [frame]))
    finally:
        server.close()
        scheduler.close()
    cluster.run(lambda kv: kv.push(key, value * (kv.rank + 1)))
    for out in cluster.run(lambda kv: kv.pull(key)):
        np.testing.assert_array_equal(out, value * 3)
    cluster.run(lambda kv: kv.barrier())  # both workers still count
    assert all(proc.poll() is None for _, proc, _ in cluster.procs.procs), cluster.procs.output()
    _, log = next((p, lg) for name, p, lg in cluster.procs.procs if name == "scheduler")
    assert "is lost" not in log.read_text() and "left" not in log.read_text()
