"""Worker script for the elastic data test: a split Session (Session.run(split=True)) in a dist_sync job.

argv: OUT_PREFIX SAMPLES MODE
MODE ``grow``: 2 workers start; in epoch 1, at its batch 2, worker 0 asks the launcher for two more
(two lines 'join' in $KVSTORE_ELASTIC_CONTROL) and waits, polling with a deadline, until both have
joined (each writes OUT_PREFIX-joined-RANK once its store is made), so both come in mid-epoch and push
zeros until that epoch ends.  Worker 3 stops after 2 epochs it had a share of; the others after 2
epochs whose view is {0, 1, 2}.  MODE ``shrink``: worker 1 stops after epoch 0 and worker 0 goes on,
into a job below --min-workers.

Every step each worker with a batch sets the gradient of its one 300-element parameter to 2**rank and
steps (sgd, lr 1, on the servers), so a step lowers the weights by the sum of 2**r over the workers
with data in it; a worker without a batch pushes zeros.  Each process writes to OUT_PREFIX.RANK.PID
``start STEP VALUE``, then per step ``STEP data EPOCH ROWS VALUE UNIFORM`` (ROWS: its sample ids,
comma-separated) or ``STEP zero VALUE UNIFORM``, and ``end STEP``.
"""

import os
import sys
import time

import torch

import kvstore

out, samples, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
BATCH, EPOCHS, JOIN_AT = 4, 40, (1, 2)  # JOIN_AT: (epoch, index) where worker 0 asks for the joins
kv = kvstore.create("dist_sync")
rank = kv.rank
if kv.rejoined_at is not None:  # a joiner: worker 0 may go on now (it waits in its step for this)
    open(f"{out}-joined-{rank}", "w").close()
weight = torch.nn.Parameter(torch.zeros(300))
trainer = kvstore.Trainer([("w", weight)], "sgd", {"learning_rate": 1.0}, kvstore=kv, update_on_kvstore=True,
                          overlap=False)
record = open(f"{out}.{rank}.{os.getpid()}", "w")
batch_of_step: dict[int, kvstore.session.Batch] = {}


def value() -> str:
    """The weights' first element and whether every element is equal."""
    w = weight.detach()
    return f"{float(w[0])!r} {int(bool(torch.all(w == w[0])))}"


def wait_for_joiners() -> None:
    """Ask for two joins, then wait (at most 90 s) until both joiners have made their stores."""
    with open(os.environ["KVSTORE_ELASTIC_CONTROL"], "a") as control:
        control.write("join\njoin\n")
    deadline = time.monotonic() + 90
    while not all(os.path.exists(f"{out}-joined-{r}") for r in (2, 3)):
        if time.monotonic() > deadline:
            raise TimeoutError("the two joiners did not come within 90 s")
        time.sleep(0.05)


def step(batch: kvstore.session.Batch) -> float:
    """One step on this worker's batch: a gradient of 2**rank on every element."""
    if mode == "grow" and rank == 0 and (batch.epoch, batch.index) == JOIN_AT:
        wait_for_joiners()
    batch_of_step[batch.step] = batch
    weight.grad = torch.full((300,), 2.0 ** rank)
    trainer.step(1)
    return 1.0


class Record(kvstore.session.Hook):
    """Writes each step's record, and stops as the MODE says."""

    def __init__(self) -> None:
        self.shares = self.settled = 0  # epochs this worker had a share of; epochs of view {0, 1, 2}

    def begin(self, session: kvstore.Session) -> None:
        record.write(f"start {session.start_step} {value()}\n")

    def after_step(self, session: kvstore.Session, loss: float | None) -> None:
        done = session.step - 1
        batch = batch_of_step.pop(done, None)
        if batch is None:
            record.write(f"{done} zero {value()}\n")
        else:
            rows = ",".join(str(int(r)) for r in batch.rows)
            record.write(f"{done} data {batch.epoch} {rows} {value()}\n")

    def after_epoch(self, session: kvstore.Session, epoch: int) -> None:
        view = kv.view  # the epoch's: agreed at its start (a joiner mid-epoch: the one it came into)
        self.shares += rank in view
        self.settled += view.ranks == (0, 1, 2)
        if mode == "shrink":
            if rank == 1:
                session.stop()
        elif (rank == 3 and self.shares >= 2) or self.settled >= 2:
            session.stop()


hook = Record()
session = kvstore.Session(trainer, hooks=[hook])
done = session.run(step, samples, BATCH, EPOCHS, split=True)
if mode == "grow" and not (hook.settled >= 2 or (rank == 3 and hook.shares >= 2)):
    raise RuntimeError(f"worker {rank} ran {EPOCHS} epochs: the membership never settled")
record.write(f"end {done}\n")
record.close()
kv.close()
