"""Worker script for a join asked before a plain dist_sync job (no Session) stored its weights.

argv: OUT STEPS
Worker 0 asks for one join right after its store is made, and both first workers wait (polling, with a
deadline) until the joiner's store is made (OUT-joined), so the joiner is admitted before their first
init.  The first workers init the key, set the optimizer (sgd, lr 1) and then agree a tagged view
(``kv.membership((0,))``): the sign that the weights are stored.  The joiner (``kv.rejoined_at`` set,
``kv.view`` untagged) awaits that view (``kv.await_view()``) before its init and set_optimizer, which it
skips as any joiner.  Then every worker pushes ``2**rank`` STEPS times; each writes to OUT.RANK the
value of the key's first element it pulled before the first step and after each step.
"""

import os
import sys
import time

import numpy as np

import kvstore

out, steps = sys.argv[1], int(sys.argv[2])
kv = kvstore.create("dist_sync")
rank = kv.rank
if kv.rejoined_at is None:
    if rank == 0:
        with open(os.environ["KVSTORE_ELASTIC_CONTROL"], "a") as control:
            control.write("join\n")
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{out}-joined"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no joiner after 60 s ({out}-joined)")
        time.sleep(0.05)  # polling interval of a deadline-bounded wait
else:
    open(f"{out}-joined", "w").close()
    if not kv.view.tag:
        kv.await_view()  # the others' init and set_optimizer, followed, then their tagged view
kv.init("w", np.zeros(10))
kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))
if kv.rejoined_at is None:
    kv.membership((0,))  # the weights are stored: a worker that joined early comes in here
w = np.empty(10)
kv.pull("w", out=w)
values = [float(w[0])]
for _ in range(steps):
    kv.push("w", np.full(10, 2.0 ** rank))
    kv.pull("w", out=w)
    values.append(float(w[0]))
with open(f"{out}.{rank}", "w") as record:
    record.write(" ".join(repr(v) for v in values) + f"\n{kv.rejoined_at} {int(kv.joined_at_start)}\n")
kv.close()
