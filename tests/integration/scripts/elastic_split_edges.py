"""Worker script for the split Session's edge cases (tests/integration/test_elastic_split.py).

argv: OUT MODE SAMPLES BATCH MIN_BATCH EPOCHS [CKPT]
MODE ``join_at_start``: at epoch 1's first batch (its membership view released, before anyone pushed
in it) worker 0 asks for one join and both first workers wait, polling with a deadline, until the
joiner's store is made; then they step.  MODE ``join_at_begin``: worker 0 asks for one join before
anyone's first step (before the job's first view and its first init) and both wait for the joiner.
MODE ``join_after_init``: the same once the first workers have stored the weights and set the optimizer
(``trainer.init_kvstore()``), still before the first view.  MODE ``join_at_end``: after its run and
``kv.close()``, worker 0 waits (deadline-bounded) until the scheduler's port is closed (the job has
ended), asks for one join, and keeps running until the test, which reads the launcher's output, has
seen the launcher refuse it (it creates OUT-refused; at most 60 s).  MODE ``leave_barrier``: worker 1
stops after epoch 0 and meets one more ``kv.barrier()`` before it closes its store.  MODE
``rank0_leaves``: worker 0 stops after epoch 0.  MODE ``plain``: nothing else.  With CKPT, a
checkpoint every step (rank 0 of each epoch's view writes it).

Each step a worker with a batch pushes ``2**rank`` (sgd, lr 1, on the servers).  Each worker writes
OUT.RANK: per step ``STEP data EPOCH ROWS`` (ROWS: its sample ids, comma-separated) or ``STEP zero``,
and ``end STEP``; and OUT.w.RANK: per step ``STEP W`` (the weights' first element after it, as
pulled); a joiner creates OUT-joined once its store is made.
"""

import os
import socket
import sys
import time

import torch

import kvstore

out, mode, samples, batch, min_batch, epochs = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
ckpt = sys.argv[7] if len(sys.argv) > 7 else None
kv = kvstore.create("dist_sync")
rank = kv.rank
if kv.rejoined_at is not None:
    open(f"{out}-joined", "w").close()
weight = torch.nn.Parameter(torch.zeros(4))
trainer = kvstore.Trainer([("w", weight)], "sgd", {"learning_rate": 1.0}, kvstore=kv, update_on_kvstore=True,
                          overlap=False)
record = open(f"{out}.{rank}", "w")
weights = open(f"{out}.w.{rank}", "w")
seen: dict[int, kvstore.session.Batch] = {}


def ask_for_a_join_and_wait() -> None:
    """Worker 0 appends a line 'join' to the launcher's control file; every first worker then waits
    (at most 60 s) until the joiner has made its store."""
    if rank == 0:
        with open(os.environ["KVSTORE_ELASTIC_CONTROL"], "a") as control:
            control.write("join\n")
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{out}-joined"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no joiner after 60 s ({out}-joined)")
        time.sleep(0.05)  # polling interval of a deadline-bounded wait


def wait_for_the_scheduler_to_exit() -> None:
    """Poll (at most 30 s) until nothing listens on the scheduler's port any more."""
    where = (os.environ["DMLC_PS_ROOT_URI"], int(os.environ["DMLC_PS_ROOT_PORT"]))
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(where, timeout=1).close()
        except OSError:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the scheduler at {where} still listens 30 s after every worker left")
        time.sleep(0.05)  # polling interval of a deadline-bounded wait


if mode == "join_after_init" and kv.rejoined_at is None:
    trainer.init_kvstore()  # the weights stored, the optimizer set: two collectives, no view yet
if mode in ("join_at_begin", "join_after_init") and kv.rejoined_at is None:
    ask_for_a_join_and_wait()


def step(b: kvstore.session.Batch) -> float:
    if mode == "join_at_start" and (b.epoch, b.index) == (1, 0) and kv.rejoined_at is None:
        ask_for_a_join_and_wait()
    seen[b.step] = b
    weight.grad = torch.full((4,), 2.0 ** rank)
    trainer.step(1)
    return 1.0


class Record(kvstore.session.Hook):
    """Writes each step's batch (or ``zero``) to this worker's record; stops where the mode says."""

    def after_step(self, session: kvstore.Session, loss: float | None) -> None:
        b = seen.pop(session.step - 1, None)
        if b is None:
            record.write(f"{session.step - 1} zero\n")
        else:
            record.write(f"{session.step - 1} data {b.epoch} {','.join(str(int(r)) for r in b.rows)}\n")
        record.flush()
        weights.write(f"{session.step - 1} {float(weight.detach()[0])!r}\n")
        weights.flush()

    def after_epoch(self, session: kvstore.Session, epoch: int) -> None:
        if (mode == "leave_barrier" and rank == 1) or (mode == "rank0_leaves" and rank == 0):
            session.stop()  # leave for good at this epoch's end


session = kvstore.Session(trainer, ckpt, every_steps=1 if ckpt else None, keep=100, hooks=[Record()])
done = session.run(step, samples, batch, epochs, min_batch, split=True)
if mode == "leave_barrier" and rank == 1:
    kv.barrier()  # any collective between run's return and close (save_states, an eval barrier, ...)
record.write(f"end {done}\n")
record.close()
weights.close()
kv.close()
if mode == "join_at_end" and rank == 0:
    wait_for_the_scheduler_to_exit()
    with open(os.environ["KVSTORE_ELASTIC_CONTROL"], "a") as control:
        control.write("join\n")
    deadline = time.monotonic() + 60  # still running while the launcher reads the line: it must refuse it
    while not os.path.exists(f"{out}-refused"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the launcher did not refuse the join within 60 s ({out}-refused)")
        time.sleep(0.05)  # polling interval of a deadline-bounded wait
