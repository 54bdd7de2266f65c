"""Worker script: 2bit/1bit pushes under the launcher, checked against the plain reference.

argv: KIND THRESHOLD.  Every worker draws every worker's gradients from one seed (two values per
push, as from two devices), keeps every worker's reference residuals, pushes its own, and checks
that each pull is, bit for bit, the sum over workers of the reference's dequantised values.  The
big key is split over the servers (the launcher test sets KVSTORE_BIGARRAY_BOUND=1000).
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: tests.compression_ref

import kvstore  # noqa: E402
from tests import compression_ref as ref  # noqa: E402

kind, threshold = sys.argv[1], float(sys.argv[2])
kv = kvstore.create("dist_sync")
W = kv.num_workers
kv.set_gradient_compression({"type": kind, "threshold": threshold})
sizes = {"big": 3000, "small": 37}
kv.init(list(sizes), [np.zeros(n, np.float32) for n in sizes.values()])
rng = np.random.default_rng(11)
residual = {(w, k): np.zeros(n, np.float32) for w in range(W) for k, n in sizes.items()}
for step in range(3):
    grads = {(w, k): (rng.standard_normal((2, n)) * 0.7).astype(np.float32)
             for w in range(W) for k, n in sizes.items()}
    kv.push(list(sizes), [list(grads[kv.rank, k]) for k in sizes])
    for key, got in zip(sizes, kv.pull(list(sizes))):
        want = sum(ref.roundtrip(kind, grads[w, key][0] + grads[w, key][1], residual[w, key], threshold)
                   for w in range(W))
        assert got.tobytes() == want.astype(np.float32).tobytes(), (step, key, got[:4], want[:4])
kv.barrier()
print(f"RESULT ok rank={kv.rank} kind={kind} servers={kv.num_servers}", flush=True)
