"""A training loop that checkpoints and resumes itself (TensorFlow's MonitoredTrainingSession, for a Trainer).

:class:`Session` runs the user's step function over the epochs' batches, saves the model's weights,
the optimizer's states, the step and the data position to a storage URL every N steps and/or T
seconds (rank 0 alone, in a split run the lowest rank of the epoch's view; atomically: a checkpoint is
complete once its ``session.json`` is written, last), and starts by itself from where the job is:

- a worker restarted under ``launch.py --max-restarts`` (``kv.rejoined_at`` is set) takes the
  servers' current weights and goes on at the job's step;
- otherwise, with a checkpoint URL, from the newest complete checkpoint there (the weights, the
  optimizer's states and the step, on every worker): a relaunch of the same command resumes;
- otherwise from step 0.

Each epoch's order is a pure function of ``(seed, epoch, rank)`` (:mod:`kvstore.core.progress`), so
any of these draws exactly the batches an unbroken run draws.  docs/failures.md, "One resume path".
With ``run(..., split=True)`` the whole dataset is split anew at each epoch's start over the workers
of the membership view agreed then (``kv.membership``), so workers may join and leave an elastic job
and every sample is still seen once per epoch (docs/elastic.md).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvstore import config as kvconfig
from kvstore.client.meter import log_scalar
from kvstore.client.store import DistKVStore
from kvstore.core import checkpoint, progress, storage
from kvstore.core.membership import EpochSplit, Membership
from kvstore.errors import ConfigError, FormatError
from kvstore.trainer import Trainer

__all__ = ["Batch", "EvaluateEvery", "Hook", "LogEvery", "Session", "StopAt"]

log = logging.getLogger("kvstore.session")

WEIGHTS, STATES, META = "weights.arrays", "trainer.states", "session.json"
FORMAT = "kvstore-session"


class Batch(NamedTuple):
    """One step's batch: ``step`` (0-based global step), its ``epoch`` and ``index`` in the epoch, and
    ``rows``, the indices of this worker's samples (an int64 numpy array: index tensors with it)."""

    step: int
    epoch: int
    index: int
    rows: np.ndarray


@dataclass(frozen=True)
class _Epoch:
    """A split epoch in progress (``run(..., split=True)``): its number, the job's step it began at, the
    workers it is split over, its steps, and the lowest rank of its view (which writes its checkpoints)."""

    epoch: int
    start: int
    workers: int
    steps: int
    writer: int


class Hook:
    """What a Session calls on every worker; subclass and override what you need (each does nothing)."""

    def begin(self, session: Session) -> None:
        """Once the weights are in place, before the first step: ``session.start_step`` is where this
        process starts, ``resumed_from`` the checkpoint it loaded (or None), ``rejoined`` whether it
        went on at the job's step after a restart."""

    def after_step(self, session: Session, loss: float | None) -> None:
        """After each step (``session.step`` steps done); ``loss`` is what the step function returned."""

    def after_epoch(self, session: Session, epoch: int) -> None:
        """After the last step of epoch ``epoch`` (0-based)."""


class LogEvery(Hook):
    """Every ``n`` steps: the mean loss of those steps to TensorBoard (``session/loss``, each worker
    its own run) and, on rank 0, one line on stdout (``step 40  loss 0.1234  (95.2 steps/s)``)."""

    def __init__(self, n: int) -> None:
        self.n, self._losses, self._began = int(n), [], time.perf_counter()

    def after_step(self, session: Session, loss: float | None) -> None:
        if loss is not None:
            self._losses.append(float(loss))
        if session.step % self.n:
            return
        mean = sum(self._losses) / len(self._losses) if self._losses else float("nan")
        if self._losses:
            log_scalar("session/loss", mean, session.step)
        if session.rank == 0:
            rate = len(self._losses) / max(time.perf_counter() - self._began, 1e-9)
            print(f"step {session.step}  loss {mean:.4f}  ({rate:.1f} steps/s)", flush=True)
        self._losses, self._began = [], time.perf_counter()


class EvaluateEvery(Hook):
    """Every ``n`` steps, ``evaluate(session)`` on every worker; a number it returns (or each value of
    a mapping it returns) goes to TensorBoard under its name (``eval`` for a bare number); rank 0 prints
    it."""

    def __init__(self, n: int, evaluate: Callable[[Session], float | Mapping[str, float] | None]) -> None:
        self.n, self.evaluate = int(n), evaluate

    def after_step(self, session: Session, loss: float | None) -> None:
        if session.step % self.n:
            return
        result = self.evaluate(session)
        values = {} if result is None else {"eval": result} if not isinstance(result, Mapping) else result
        for name, value in values.items():
            log_scalar(name, float(value), session.step)
        if values and session.rank == 0:
            shown = "  ".join(f"{k} {float(v):.4f}" for k, v in values.items())
            print(f"step {session.step}  {shown}", flush=True)


class StopAt(Hook):
    """Stop the session once ``step`` steps are done (a checkpoint, if any, is saved there)."""

    def __init__(self, step: int) -> None:
        self.at = int(step)

    def after_step(self, session: Session, loss: float | None) -> None:
        if session.step >= self.at:
            session.stop()


class Session:
    """Run a Trainer's training loop with checkpoints, resume and hooks (see the module docstring).

    ``checkpoint``: a storage URL (a folder; ``s3://``... through :mod:`kvstore.core.storage`) or None
    (no checkpoints; rejoin still works).  Checkpoints are taken every ``every_steps`` steps and/or
    ``every_seconds`` seconds (both None: only at the end) and at the end or a stop; the newest
    ``keep`` complete ones are kept.  ``seed`` seeds the epochs' orders.  ``log_every``,
    ``eval_every`` with ``evaluate``, and ``stop_at`` add the built-in hooks; ``hooks`` adds yours.
    Raises ValueError for a bad count.
    """

    def __init__(self, trainer: Trainer, checkpoint: str | None = None, *, every_steps: int | None = None,
                 every_seconds: float | None = None, keep: int = 2, seed: int = 0,
                 log_every: int | None = None,
                 eval_every: int | None = None, evaluate: Callable[[Session], Any] | None = None,
                 stop_at: int | None = None, hooks: Iterable[Hook] = ()) -> None:
        for name, value in (("every_steps", every_steps), ("every_seconds", every_seconds),
                            ("log_every", log_every), ("eval_every", eval_every)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep!r}")
        if (eval_every is None) != (evaluate is None):
            raise ValueError("eval_every and evaluate go together")
        self.trainer, self.url = trainer, None if checkpoint is None else str(checkpoint)
        self.every_steps, self.every_seconds, self.keep, self.seed = every_steps, every_seconds, keep, seed
        self.hooks: list[Hook] = list(hooks)
        if log_every is not None:
            self.hooks.append(LogEvery(log_every))
        if eval_every is not None and evaluate is not None:
            self.hooks.append(EvaluateEvery(eval_every, evaluate))
        if stop_at is not None:
            self.hooks.append(StopAt(stop_at))
        self.step = 0  # steps done (the job's, not this process's)
        self.start_step = 0  # where this process started
        self.resumed_from: str | None = None  # the checkpoint this process started from
        self.rejoined = False  # whether it went on at the job's step after a restart (kv.rejoined_at)
        self.epoch_loss = 0.0  # the sum of the step function's losses in this epoch, in this process
        self._stopped = False
        self._schedule: progress.Schedule | None = None
        self._settings_now: dict[str, Any] = {}  # what a checkpoint of this run records of its schedule
        self._epoch: _Epoch | None = None  # split=True: the epoch in progress
        self._saved_step, self._saved_time = 0, time.monotonic()
        self._cluster_start = 0  # the job's step at which this cluster started (in each checkpoint)

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self.trainer.kvstore.rank

    def stop(self) -> None:
        """Stop after the current step (its hooks still run; the checkpoint is saved); with
        ``run(..., split=True)``, after the current epoch's last step, so this worker's share of it is
        done (docs/elastic.md)."""
        self._stopped = True

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, step_fn: Callable[[Batch], float | None], samples: int, batch_size: int, epochs: int,
            min_batch: int = 1, *, split: bool = False) -> int:
        """Call ``step_fn(batch)`` for every step of ``epochs`` epochs over this worker's ``samples``
        samples in batches of ``batch_size`` (a last one shorter than ``min_batch`` dropped), from
        where the job is (see the class), running the hooks and saving checkpoints; return the steps
        done.  With ``split=True``, ``samples`` is the whole dataset's size instead, split anew at
        each epoch's start over the workers present then (:meth:`_run_split`, docs/elastic.md).
        Raises ConfigError for a checkpoint of another schedule, seed or worker count, or with
        ``launch.py --resume``; FormatError for a damaged checkpoint; what ``step_fn`` raises."""
        if split:
            return self._run_split(step_fn, samples, batch_size, epochs, min_batch)
        schedule = progress.Schedule(samples, batch_size, epochs, min_batch)
        self._schedule = schedule
        self._settings_now = {**schedule.settings(), "seed": self.seed,
                              "num_workers": self.trainer.kvstore.num_workers}
        self.step = self.start_step = self._begin(schedule.total_steps)
        self._saved_step, self._saved_time = self.step, time.monotonic()
        for hook in self.hooks:
            hook.begin(self)
        order: np.ndarray | None = None
        while self.step < schedule.total_steps and not self._stopped:
            at = schedule.position(self.step)
            if order is None or at.index == 0:
                order = progress.epoch_order(self.seed, at.epoch, self.rank, samples)
                self.epoch_loss = 0.0
            loss = step_fn(Batch(self.step, at.epoch, at.index, schedule.rows(order, at.index)))
            if loss is not None:
                self.epoch_loss += float(loss)
            self.step += 1
            for hook in self.hooks:
                hook.after_step(self, loss)
            if at.index == schedule.steps_per_epoch - 1:
                for hook in self.hooks:
                    hook.after_epoch(self, at.epoch)
            self._save_if_due()
        if self.step != self._saved_step:
            self.save()
        return self.step

    def _save_if_due(self) -> None:
        """Save a checkpoint when ``every_steps`` / ``every_seconds`` says one is due."""
        if progress.due(self.step - self._saved_step, time.monotonic() - self._saved_time,
                        self.every_steps, self.every_seconds):
            self.save()

    def _run_split(self, step_fn: Callable[[Batch], float | None], samples: int, batch_size: int,
                   epochs: int, min_batch: int) -> int:
        """``run(..., split=True)``: each epoch starts with ``kv.membership((epoch, step))``, and the
        epoch's shuffle of all ``samples`` (:func:`progress.split_order`) is cut over the workers of
        that view in rank order (:class:`EpochSplit`), so every sample is in one worker's batches per
        epoch whoever joins or leaves.  A worker without a batch in a step (a part one batch short, or
        one that joined mid-epoch and so owns none of it) pushes zeros (``Trainer.step_without_data``);
        :meth:`stop` takes effect at the epoch's end.  A worker that joined (``KVSTORE_JOIN``) before
        the job's first epoch view waits for it first (:meth:`_await_first_view`).  Raises ConfigError
        without update_on_kvstore, for an epoch whose view's parts are all smaller than ``min_batch``,
        for a checkpoint of another schedule, or a mid-epoch one resumed with another worker count;
        DeadlineExceededError when a joiner's wait for the first view runs out."""
        if int(epochs) < 1:
            raise ValueError(f"epochs must be at least 1, got {epochs!r}")
        EpochSplit(samples, 1, batch_size, min_batch)  # the counts' checks
        if not self.trainer.update_on_kvstore:
            raise ConfigError("Session.run(split=True) needs update_on_kvstore=True: a worker without a "
                              "batch in a step pushes zeros and takes the servers' weights (docs/elastic.md)")
        kv = self.trainer.kvstore
        self._await_first_view()
        # no worker count: each epoch's split follows its view (a mid-epoch resume checks the epoch's)
        self._settings_now = {"samples": samples, "batch_size": batch_size, "min_batch": min_batch,
                              "seed": self.seed, "split": True}
        self.step = self.start_step = self._begin(None)
        epoch, index, view = self._split_start(samples, batch_size, min_batch)
        self._saved_step, self._saved_time = self.step, time.monotonic()
        for hook in self.hooks:
            hook.begin(self)
        while epoch < epochs:
            if view is None:  # the epoch's start: agree its view (a comer may hold it already)
                view = kv.membership((epoch, self.step))
            plan = EpochSplit(samples, view.size, batch_size, min_batch)
            if plan.steps == 0:  # every worker of the view raises it here: no round is left waiting
                raise ConfigError(f"epoch {epoch} split over {view.size} workers gives parts of at most "
                                  f"{plan.bounds(0)[1]} samples, none a batch of min_batch {min_batch}: "
                                  "lower min_batch (or run with fewer workers)")
            self._epoch = _Epoch(epoch, self.step - index, view.size, plan.steps, view.ranks[0])
            order = progress.split_order(self.seed, epoch, samples)
            part = view.index(self.rank) if self.rank in view else None  # None: joined mid-epoch
            self.epoch_loss = 0.0
            for at in range(index, plan.steps):
                lo, hi = (0, 0) if part is None else plan.rows(part, at)
                loss = None
                if hi > lo:
                    loss = step_fn(Batch(self.step, epoch, at, order[lo:hi]))
                else:
                    self.trainer.step_without_data()
                if loss is not None:
                    self.epoch_loss += float(loss)
                self.step += 1
                for hook in self.hooks:
                    hook.after_step(self, loss)
                self._save_if_due()
            for hook in self.hooks:
                hook.after_epoch(self, epoch)
            epoch, index, view = epoch + 1, 0, None
            if self._stopped:
                break
        if self.step != self._saved_step:
            self.save()
        return self.step

    def _await_first_view(self) -> None:
        """A worker that joined (``KVSTORE_JOIN``) before the job agreed any tagged membership view:
        it counts in the others' barriers from its registration, so it follows them (their init,
        set_optimizer...; ``kv.await_view``) until they agree the first epoch's view, which names it
        too; then the weights and the optimizer are on the servers and it goes on as any joiner, with
        its part of that epoch.  Raises what ``await_view`` raises (DeadlineExceededError after
        KVSTORE_CONNECT_TIMEOUT)."""
        kv = self.trainer.kvstore
        if not (isinstance(kv, DistKVStore) and kv.rejoined_at is not None and not kv.view.tag
                and kvconfig.load().join):
            return
        log.info("session: worker %d joined before the job's first epoch view; waiting for it", kv.rank)
        view = kv.await_view()
        log.info("session: worker %d comes into view %d %s of ranks %s", kv.rank, view.number, view.tag,
                 list(view.ranks))

    def _split_start(self, samples: int, batch_size: int,
                     min_batch: int) -> tuple[int, int, Membership | None]:
        """Where a split run starts at ``self.step``: ``(epoch, index, view)``, view None when the loop
        must agree the epoch's view.  A worker that joined or restarted reads the job's last view (its
        tag: the epoch and the step it began at) and goes on in that epoch with it, even at its first
        step (the others agreed it already); a resumed checkpoint's mid-epoch position agrees a view of
        as many workers as that epoch had.  Raises ConfigError when neither places it."""
        kv = self.trainer.kvstore
        if self.rejoined:
            view = kv.view
            if len(view.tag) != 2:
                if self.step == 0:  # a restart before the first epoch view (a join awaited it): it joins it
                    return 0, 0, None
                raise ConfigError(f"this worker came into the job at step {self.step}, but the job's last "
                                  "membership view names no epoch: a split Session joins only a job whose "
                                  "workers run a split Session")
            first, start = view.tag
            steps = EpochSplit(samples, view.size, batch_size, min_batch).steps
            try:
                epoch, index = progress.split_position(self.step, first, start, steps)
            except ValueError as exc:
                raise ConfigError(f"cannot place this worker in the job's epochs: {exc}") from None
            return epoch, index, (view if epoch == first else None)  # its own epoch's view: agreed already
        if self.resumed_from is None:
            return 0, 0, None
        meta = self._meta(self.resumed_from)
        epoch, index = int(meta["epoch"]), int(meta["index"])
        if index == 0:
            return epoch, 0, None
        view = kv.membership((epoch, int(meta["epoch_start"])))
        if view.size != meta["epoch_workers"]:
            raise ConfigError(f"{self.resumed_from} is in the middle of epoch {epoch}, split over "
                              f"{meta['epoch_workers']} workers, but {view.size} are present: resume with "
                              "as many, or from a checkpoint at an epoch's end")
        return epoch, index, view

    def _begin(self, total: int | None) -> int:
        """The step to start at (at most ``total``, the schedule's steps, when known), with the weights
        and states in place (see the class).  Raises ConfigError for a restarted worker whose Trainer
        updates locally (the servers hold gradient sums, not the job's weights)."""
        kv = self.trainer.kvstore
        rejoined = getattr(kv, "rejoined_at", None)
        if rejoined is not None:  # a restarted worker: the servers hold the job's weights and states
            if not self.trainer.update_on_kvstore:
                raise ConfigError("a worker restarted under --max-restarts takes the job's weights from the "
                                  "servers, which with update_on_kvstore=False hold gradient sums, not "
                                  "weights: relaunch the job instead (it resumes from the session's "
                                  "checkpoint), or update on the servers")
            self.trainer.init_kvstore()
            base = self._cluster_start = self._started_here()  # this cluster's rounds count from there
            self.rejoined = True
            log.info("session: rejoined at step %d (the job's)", base + int(rejoined))
            return base + int(rejoined) if total is None else min(base + int(rejoined), total)
        found = self.latest()
        if found is None:
            self.trainer.init_kvstore()
            return 0
        if kvconfig.load().resume is not None:
            raise ConfigError(f"launch.py --resume (KVSTORE_RESUME) and the session's checkpoint {found} "
                              "both hold the weights: use one (remove the checkpoint folder, or --resume)")
        meta = self._meta(found)
        mine = {**self._settings_now, "split": bool(self._settings_now.get("split"))}
        theirs = {**{k: meta.get(k) for k in mine}, "split": bool(meta.get("split"))}
        if theirs != mine:
            raise ConfigError(f"cannot resume from {found}: it was saved with {theirs}, this run has {mine} "
                              "(the data order depends on them)")
        self._load_weights(storage.join(found, WEIGHTS))  # before the first use, which stores rank 0's
        self.trainer.load_states(storage.join(found, STATES))
        self.resumed_from = found
        log.info("session: resumed from %s at step %d", found, meta["step"])
        self._cluster_start = int(meta["step"]) if total is None else min(int(meta["step"]), total)
        return self._cluster_start

    def _started_here(self) -> int:
        """For a restarted worker: the job's step at which its cluster started (its rounds, and so
        ``kv.rejoined_at``, count from there).  A cluster starts from the newest complete checkpoint:
        when that one was written by this cluster, its ``cluster_start`` says where that was; when by
        an earlier one, this cluster started from it; with none (or no URL), at 0."""
        found = self.latest()
        if found is None:
            return 0
        meta = self._meta(found)
        if meta.get("cluster") == getattr(self.trainer.kvstore, "cluster_id", None):
            return int(meta["cluster_start"])
        return int(meta["step"])

    # -- checkpoints -----------------------------------------------------------------------------
    def latest(self) -> str | None:
        """The URL of the newest complete checkpoint under the session's URL, or None (none there, or
        no URL).  Raises OSError from the store."""
        if self.url is None:
            return None
        try:
            names = storage.listdir(self.url)
        except FileNotFoundError:
            return None
        name = progress.newest_complete(names, lambda n: self._complete(storage.join(self.url, n)))
        return None if name is None else storage.join(self.url, name)

    def _complete(self, location: str) -> bool:
        """Whether the checkpoint at ``location`` has a readable ``session.json`` naming its step."""
        try:
            meta = self._meta(location)
        except (OSError, FormatError):
            return False
        return meta.get("step") == progress.step_of(location.rstrip("/").rpartition("/")[2])

    @staticmethod
    def _meta(location: str) -> dict[str, Any]:
        """The ``session.json`` of the checkpoint at ``location``; FormatError when it is not one."""
        where = storage.join(location, META)
        try:
            meta = json.loads(storage.read_text(where))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{where}: not a session checkpoint ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise FormatError(f"{where}: not a session checkpoint")
        return meta

    def save(self) -> str | None:
        """Rank 0 writes a checkpoint of the current step (weights, optimizer states, then
        ``session.json``) and removes all but the newest ``keep``; return its URL (None on other ranks
        or without a URL).  In a split run the writer is the lowest rank of the epoch's view, so
        checkpoints go on after worker 0 left (every worker's view of an epoch is the same, and an
        epoch's saves end before the next epoch's view is agreed).  Not collective.  A failed write is
        logged and the previous one stays."""
        self._saved_step, self._saved_time = self.step, time.monotonic()
        if self.url is None or (self._schedule is None and self._epoch is None):
            return None
        if self.rank != (0 if self._epoch is None else self._epoch.writer):
            return None
        folder = storage.join(self.url, progress.checkpoint_name(self.step))
        if self._epoch is not None:  # split=True: the epoch's start and workers place a mid-epoch resume
            e = self._epoch
            epoch, index = progress.split_position(self.step, e.epoch, e.start, e.steps)
            where = {"epoch": epoch, "index": index, "epoch_start": e.start, "epoch_workers": e.workers,
                     "order": "numpy default_rng([seed, epoch]).permutation(samples), split over the "
                              "epoch's workers in rank order"}
        else:
            at = self._schedule.position(self.step)
            where = {"epoch": at.epoch, "index": at.index,
                     "order": "numpy default_rng([seed, epoch, rank]).permutation(samples)"}
        meta = {"format": FORMAT, "version": 1, "step": self.step, **where,
                "cluster": getattr(self.trainer.kvstore, "cluster_id", None),
                "cluster_start": self._cluster_start, **self._settings_now, "time": time.time()}
        try:
            storage.makedirs(folder)
            checkpoint.save_arrays(storage.join(folder, WEIGHTS),
                                   {n: p.detach().cpu() for n, p in self.trainer.named_parameters()})
            self.trainer.save_states(storage.join(folder, STATES), collective=False)
            text = (json.dumps(meta, indent=1) + "\n").encode()
            storage.atomic_write(storage.join(folder, META), lambda f: f.write(text))  # complete from here
        except OSError as exc:
            log.warning("session: could not write the checkpoint of step %d to %s (%s); the previous one "
                        "stays in effect", self.step, folder, exc)
            return None
        self._prune()
        log.info("session: saved step %d to %s", self.step, folder)
        return folder

    def _prune(self) -> None:
        """Remove every checkpoint but the newest ``keep`` complete ones (best effort)."""
        try:
            names = storage.listdir(self.url)
        except OSError:
            return
        complete = [n for n in sorted(names, key=lambda n: progress.step_of(n) or -1, reverse=True)
                    if progress.step_of(n) is not None and self._complete(storage.join(self.url, n))]
        for name in progress.stale(names, complete[:self.keep]):
            storage.remove_tree(storage.join(self.url, name))

    def _load_weights(self, location: str) -> None:
        """Copy the arrays saved at ``location`` into the Trainer's parameters (every replica's first
        use copies them on); FormatError when names, shapes or dtypes differ from the model's."""
        import torch

        arrays = checkpoint.load_arrays(location)
        params = dict(self.trainer.named_parameters())
        if sorted(arrays) != sorted(params):
            raise FormatError(f"{location} holds {sorted(arrays)}, the Trainer has {sorted(params)}")
        with torch.no_grad():
            for name, param in params.items():
                value = torch.from_numpy(np.ascontiguousarray(arrays[name]))
                if tuple(value.shape) != tuple(param.shape):
                    raise FormatError(f"{location}: {name} has shape {tuple(value.shape)}, the model's "
                                      f"{tuple(param.shape)}")
                param.copy_(value.to(param.dtype))
