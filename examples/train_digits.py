"""Data-parallel training of a small MLP on scikit-learn's digits through the kvstore's Trainer.

Run a cluster of 4 workers and 2 servers on this machine::

    python launch.py -n 4 -s 2 examples/train_digits.py
    python launch.py -n 4 -s 2 examples/train_digits.py --kvstore dist_async
    python launch.py -n 4 -s 2 examples/train_digits.py --update-on-kvstore 0 --optimizer nag
    python launch.py -n 2 -s 1 examples/train_digits.py --kvstore dist_sync_device --devices cuda:0,cuda:1

or a single process with an in-process store::

    python examples/train_digits.py --kvstore local

Every worker trains on its own equal-size shard of the training set
(``kvstore.data.split``), so every worker runs the same number of steps, and
starts from rank 0's initial weights (the Trainer broadcasts them at its first
use; one key per parameter, ``trainer0/`` and the parameter's name).  Each step
a worker computes the gradients of its batch (the loss summed over the batch)
and calls ``trainer.step(global batch size)``:

* ``dist_sync`` with ``--update-on-kvstore 1`` (the default there): the
  workers push their gradients, the servers sum them over all workers, run the
  optimizer (``--optimizer``: sgd, nag, adam, adagrad or rmsprop) on the sum
  and every worker pulls the new weights back.
* ``dist_sync`` with ``--update-on-kvstore 0``: the workers pull back the sum of
  the gradients and each runs the same optimizer itself, so the replicas stay
  identical.
* ``dist_async``: the servers run the optimizer on each worker's push as it
  arrives (update on kvstore is forced), and a worker continues from the
  freshest weights it pulls back.
* ``local``: one process, the same Trainer.
* ``--devices D0,D1,...``: one model replica per device in each worker; each
  replica takes its slice of the batch (``kvstore.data.split_and_load``) and the
  Trainer sums the replicas' gradients too: on a GPU with a ``*_device`` store
  (``--kvstore dist_sync_device`` or ``device``), on the CPU otherwise.

The loop is a ``kvstore.Session`` (docs/trainer.md): it draws each epoch's shuffle
from (seed, epoch, rank) and starts where the job is.  Under ``launch.py
--max-restarts K`` a worker that dies is restarted and rejoins the running job
(docs/failures.md): it takes the current weights from the servers and goes on at
the ``kv.rejoined_at`` steps the job has done, so the job still ends after its
planned number of updates.  With ``--checkpoint URL`` rank 0 saves a checkpoint
there (every ``--checkpoint-every`` steps, and at the end), and the same command
run again after the whole job died resumes from the newest complete one::

    python launch.py -n 4 -s 2 --max-restarts 1 examples/train_digits.py
    python launch.py -n 4 -s 2 examples/train_digits.py --checkpoint ckpt/digits --checkpoint-every 50

Rank 0 prints the loss and test accuracy per epoch; the exit code is 1 when the
final test accuracy is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import kvstore
import kvstore.config
import kvstore.data
import kvstore.session

SEED = 0
OPTIMIZERS = ("sgd", "nag", "adam", "adagrad", "rmsprop")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvstore", default="dist_sync" if kvstore.config.in_cluster() else "local",
                        help="store type (default: dist_sync under launch.py, else local)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: 0.1 for sgd and nag, 0.01 for the others)")
    parser.add_argument("--momentum", type=float, default=0.9, help="momentum of sgd and nag")
    parser.add_argument("--update-on-kvstore", choices=("auto", "1", "0"), default="auto",
                        help="1: the servers run the optimizer; 0: every worker does (dist_sync and local "
                             "only); auto: the Trainer's default (1 in dist modes)")
    parser.add_argument("--devices", default="cpu",
                        help="comma-separated devices, one model replica on each (e.g. cuda:0,cuda:1)")
    parser.add_argument("--min-accuracy", type=float, default=0.90,
                        help="exit with code 1 when the final test accuracy is lower")
    parser.add_argument("--slow-rank", type=int, default=-1,
                        help="make this worker a straggler (with --slow-ms), to try KVSTORE_SYNC_QUORUM")
    parser.add_argument("--slow-ms", type=float, default=0.0, help="extra time per step of --slow-rank")
    parser.add_argument("--checkpoint", metavar="URL", default=None,
                        help="a folder or storage URL (s3://...) for kvstore.Session's checkpoints; a run "
                             "with one resumes from the newest complete checkpoint there (default: none)")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                        help="with --checkpoint: save every this many steps (default: at the end only)")
    return parser.parse_args()


def optimizer_params(args: argparse.Namespace) -> dict[str, float]:
    """The optimizer's hyper-parameters from the command line."""
    params = {"learning_rate": args.lr if args.lr is not None
              else 0.1 if args.optimizer in ("sgd", "nag") else 0.01}
    if args.optimizer in ("sgd", "nag"):
        params["momentum"] = args.momentum
    return params


def update_on_kvstore(args: argparse.Namespace, kv: kvstore.KVStore) -> bool | None:
    """The --update-on-kvstore choice; dist_async always updates on the servers."""
    if "async" in kv.type:
        if args.update_on_kvstore == "0" and kv.rank == 0:
            print("dist_async updates on the servers: ignoring --update-on-kvstore 0", flush=True)
        return True
    return None if args.update_on_kvstore == "auto" else args.update_on_kvstore == "1"


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits (8x8 images: 64 features scaled to [0, 1]) with a fixed 75/25 split."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.25, random_state=SEED, stratify=digits.target)
    return (torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train),
            torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    device = next(model.parameters()).device
    with torch.no_grad():
        return (model(x.to(device)).argmax(dim=1).cpu() == y).float().mean().item()


def train(kv: kvstore.KVStore, args: argparse.Namespace) -> float:
    """Train on this worker's shard; return the final test accuracy of this worker's model."""
    rank, workers = kv.rank, kv.num_workers
    x_train, y_train, x_test, y_test = load_data()
    # contiguous equal shards (the remainder is dropped): every worker runs the same number of steps
    x_train = kvstore.data.split(x_train, workers, rank)
    y_train = kvstore.data.split(y_train, workers, rank)
    shard = len(x_train)

    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    devices = args.devices.split(",")
    models = [copy.deepcopy(model).to(d) for d in devices]  # one replica per device
    trainer = kvstore.Trainer([m.named_parameters() for m in models], args.optimizer,
                              optimizer_params(args), kvstore=kv,
                              update_on_kvstore=update_on_kvstore(args, kv))
    # The loss is SUMMED over the batch and the Trainer sums the gradients over the workers, so a
    # dist_sync step covers the global batch: step(len(batch) * workers) rescales the sum to the mean
    # gradient of the global batch (gluon's rule: rescale_grad = 1 / batch_size).  dist_async applies
    # each worker's push on arrival with the same scale, so one push from every worker moves the
    # weights about as far as one dist_sync step (1 / len(batch) would take steps `workers` times as
    # long, too long for this learning rate and momentum).
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    if rank == 0:
        print(f"{kv.type}: {workers} worker(s) x {len(devices)} device(s), {kv.num_servers} server(s), "
              f"{args.optimizer} "
              f"{optimizer_params(args)}, {shard} training samples per worker, {len(x_test)} test samples",
              flush=True)

    def step(batch: kvstore.session.Batch) -> float:
        """One step on this worker's batch: the replicas' summed losses."""
        total = 0.0
        xs = kvstore.data.split_and_load(x_train[batch.rows], devices, even_split=False)
        ys = kvstore.data.split_and_load(y_train[batch.rows], devices, even_split=False)
        for replica, x, y in zip(models, xs, ys):
            replica.zero_grad()
            loss = loss_fn(replica(x), y)
            loss.backward()
            total += loss.item()
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1000)  # a straggler's slower step (a demo, not a wait)
        trainer.step(len(batch.rows) * workers)
        return total

    class EpochReport(kvstore.session.Hook):
        """Each epoch's loss for TensorBoard (every worker) and, on rank 0, its line and test accuracy."""

        def __init__(self) -> None:
            self.started = time.perf_counter()

        def begin(self, session: kvstore.Session) -> None:
            if session.rejoined:
                print(f"rejoined the job at step {session.start_step}", flush=True)
            elif session.resumed_from is not None and rank == 0:
                print(f"resumed from {session.resumed_from} at step {session.start_step}", flush=True)
            self.started = time.perf_counter()

        def after_epoch(self, session: kvstore.Session, epoch: int) -> None:
            loss = session.epoch_loss / shard
            kvstore.log_scalar("loss", loss, epoch + 1)  # for launch.py --tensorboard (else kept, unused)
            if rank == 0:
                test_accuracy = accuracy(models[0], x_test, y_test)
                kvstore.log_scalar("test_accuracy", test_accuracy, epoch + 1)
                print(f"epoch {epoch + 1:3d}  loss {loss:.4f}  test accuracy {test_accuracy:.3f}  "
                      f"({time.perf_counter() - self.started:.2f} s)", flush=True)
            self.started = time.perf_counter()

    # The Session draws each epoch's shuffle from (seed, epoch, rank), skips the steps the job has done
    # (a restarted worker: kv.rejoined_at; a relaunch: the newest complete checkpoint under
    # --checkpoint, whose weights and optimizer states it loads) and writes checkpoints on rank 0.
    session = kvstore.Session(trainer, args.checkpoint, every_steps=args.checkpoint_every, seed=SEED,
                              hooks=[EpochReport()])
    # a last batch too small to give every replica a sample is dropped (the same on every worker)
    session.run(step, shard, args.batch_size, args.epochs, min_batch=len(devices))
    return accuracy(models[0], x_test, y_test)


def late_pushes(kv: kvstore.KVStore) -> dict[str, int]:
    """Every server's count of late pushes per worker, summed (kv.stats(cluster=True))."""
    total: dict[str, int] = {}
    for node in kv.stats(cluster=True)["nodes"]:
        for worker, count in node.get("late_pushes", {}).items():
            total[worker] = total.get(worker, 0) + count
    return total


def main() -> None:
    args = parse_args()
    with kvstore.create(args.kvstore) as kv:
        rank = kv.rank
        acc = train(kv, args)
        late = late_pushes(kv) if rank == 0 and args.slow_rank >= 0 else None
    if rank == 0:
        if late is not None:
            print(f"late pushes dropped per worker (KVSTORE_SYNC_QUORUM): {late}", flush=True)
        print(f"final test accuracy {acc:.3f}", flush=True)
        if acc < args.min_accuracy:
            raise SystemExit(f"final test accuracy {acc:.3f} is below --min-accuracy {args.min_accuracy}")


if __name__ == "__main__":
    main()
