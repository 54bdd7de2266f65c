"""Worker script for the dist_async elastic test: workers join a running asynchronous job.

argv: OUT_PREFIX MODE
Key 'w' (300 elements, sliced over the servers) starts at 0 and the servers apply sgd with lr 1, so
after any pushes it is minus their sum, whatever their order.  Each step a worker pushes the whole
key filled with the integer ``(rank + 1) * (1 + step % 4)`` and pulls it (read-your-writes: its push
is applied then), and records ``push VALUE TIME`` after the pull.  MODE:

- ``grow`` (``-n 2 --max-workers 3``): worker 0 asks for a join after its step 20; the joiner (slot 2)
  does 40 steps and leaves; worker 1 leaves 10 steps after the joiner's fifth; worker 0 trains on
  until both have left.
- ``rejoin`` (``-n 2 --max-workers 2``): worker 1 leaves after 30 steps; worker 0 then asks for a
  join (again every 40 steps until the joiner is up: the launcher refuses one asked before the
  leaver's process has ended), which a new incarnation of slot 1 takes; it does 40 steps and
  leaves; worker 0 trains on until it has left.

Worker 0 records ``join TIME`` just before each ask.  Every worker records ``start REJOINED_AT VALUE
TIME`` (VALUE: the largest element of its first pull, the least updated: the two servers' slices are
read at different times, with other workers' pushes in between), and ``end``; worker 0 last records
``final VALUE SAME`` (pulled once every other worker has left; SAME: 1 if every element is VALUE) and
``lead N`` (the servers' largest ``max_lead``, from snapshots taken over a second after that, so
after their last refresh of it).  Records go to OUT_PREFIX.RANK.INCARNATION; a worker that leaves
then creates OUT_PREFIX.left.RANK.INCARNATION.
"""

import os
import sys
import time

import numpy as np

import kvstore

out, mode = sys.argv[1], sys.argv[2]
MAX_STEPS = 3000
kv = kvstore.create("dist_async")
rank, incarnation = kv.rank, int(os.environ.get("KVSTORE_INCARNATION", "0"))
kv.init("w", np.zeros(300))  # a joiner: the shape only, the servers hold the value
kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))  # a joiner keeps the servers'
w = np.empty(300)
kv.pull("w", out=w)  # a joiner: the servers' latest value
record = open(f"{out}.{rank}.{incarnation}", "w")
record.write(f"start {kv.rejoined_at} {float(w.max())!r} {time.time()!r}\n")
record.flush()


def marker(name: str) -> str:
    """The path of a marker file."""
    return f"{out}.{name}"


def ask_join() -> None:
    """Ask the launcher for one more worker, recording when."""
    record.write(f"join {time.time()!r}\n")
    record.flush()
    with open(os.environ["KVSTORE_ELASTIC_CONTROL"], "a") as control:
        control.write("join\n")


def done(step: int, state: dict) -> bool:
    """Whether this worker stops after ``step`` steps (asking for the join on the way)."""
    if rank == 0:
        if "asked" not in state and (step == 20 if mode == "grow" else os.path.exists(marker("left.1.0"))):
            ask_join()
            state["asked"] = step
        elif mode == "rejoin" and step - state.get("asked", step) >= 40 and not os.path.exists(f"{out}.1.1"):
            # the launcher refuses a join while the leaver's process is still running (its slot held):
            # ask again until the new incarnation is up (a join asked while it runs is refused too)
            ask_join()
            state["asked"] = step
        others = ["left.1.0", "left.2.1"] if mode == "grow" else ["left.1.0", "left.1.1"]
        return all(os.path.exists(marker(m)) for m in others)
    if incarnation > 0 or rank == 2:  # the joiner
        if step == 5:
            open(marker(f"pushing.{rank}.{incarnation}"), "w").close()
        return step >= 40
    if mode == "rejoin":
        return step >= 30
    if "since" not in state and os.path.exists(marker("pushing.2.1")):
        state["since"] = step
    return "since" in state and step >= state["since"] + 10


step, state = 0, {}
while not done(step, state):
    if step >= MAX_STEPS:
        raise RuntimeError(f"worker {rank} reached {MAX_STEPS} steps: the others never came or left")
    time.sleep(0.005)  # the step's compute
    value = float((rank + 1) * (1 + step % 4))
    kv.push("w", np.full(300, value))
    kv.pull("w", out=w)
    record.write(f"push {value!r} {time.time()!r}\n")
    step += 1
record.write("end\n")
record.flush()
if rank == 0:  # the others have left: the servers' final value, and how far ahead any push ran
    kv.pull("w", out=w)
    record.write(f"final {float(w[0])!r} {int(np.all(w == w[0]))}\n")
    ended, deadline = time.time(), time.monotonic() + 20
    while True:  # a server's max_lead is refreshed once a second: wait for snapshots taken after that
        servers = [n for n in kv.stats(cluster=True)["nodes"] if n["role"] == "server"]
        if all(n.get("time", 0) > ended + 1.5 for n in servers):
            break
        if time.monotonic() > deadline:  # recorded as -1: the test fails
            servers = []
            break
        time.sleep(0.1)  # the polling interval of a deadline-bounded wait
    record.write(f"lead {max((n.get('max_lead', -1) for n in servers), default=-1)}\n")
record.close()
kv.close()
open(marker(f"left.{rank}.{incarnation}"), "w").close()
