"""Worker script for the worker-set restart test: 4 workers, key 's' of the set {0, 2} and key 't' of
the set {1, 3}, STEPS steps of pushpull of its set's key, then of key 'all' of every worker (so the
sets' rounds stay in step, as a Trainer's keys do: a restarted worker rejoins every key at one step).

argv: STEPS OUT_PREFIX [STEP_MS]
STEP_MS (default 0): each step's own work, in milliseconds (a sleep standing for computation), so that
a restarted worker finds the others still training.
Each member pushes the same value at a step (a pure function of the step), so a round that closes
without a lost member (scaled as a quorum of the rest) equals the full round.  A restarted worker
(``launch.py --max-restarts``) starts at ``kv.rejoined_at``.  Every worker writes the last value it
pulled at the end to OUT_PREFIX.RANK; a read that is not exact fails the script.
"""

import sys
import time

import numpy as np

import kvstore

steps, out = int(sys.argv[1]), sys.argv[2]
step_s = (float(sys.argv[3]) if len(sys.argv) > 3 else 0.0) / 1000
kv = kvstore.create("dist_sync")
mine, members = ("s", [0, 2]) if kv.rank in (0, 2) else ("t", [1, 3])
kv.init(mine, np.zeros(300, np.float32), workers=members)  # sliced over both servers (bound 100)
kv.init("all", np.zeros(4, np.float32))
first = kv.rejoined_at or 0
print(f"rank {kv.rank} from step {first}", flush=True)
value = np.zeros(300, np.float32)
for step in range(first, steps):
    time.sleep(step_s)  # the step's computation
    grad = np.full(300, float(step + 1), np.float32)
    kv.pushpull(mine, grad, out=value)
    expected = 2.0 * (step + 1)
    if not np.array_equal(value, np.full(300, expected, np.float32)):
        raise SystemExit(f"rank {kv.rank} step {step}: read {value[:3]}, expected {expected}")
    paced = kv.pushpull("all", np.ones(4, np.float32))
    if not np.allclose(paced, 4.0):
        raise SystemExit(f"rank {kv.rank} step {step}: read {paced} of key 'all', expected 4")
kvstore.checkpoint.save_arrays(f"{out}.{kv.rank}", {"value": kv.pull(mine)})
print(f"rank {kv.rank} done steps {first}..{steps}", flush=True)
kv.close()
