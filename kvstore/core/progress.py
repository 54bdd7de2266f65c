"""A training session's progress and its checkpoints, as pure logic (``kvstore.Session`` does the I/O).

- :class:`Schedule`: how many steps an epoch has, and where step ``s`` is (its epoch and the index of
  its batch in the epoch's order): the data position is a pure function of the step, so a session
  resumed at a step, or a worker rejoining at one, draws exactly the batches an unbroken run draws.
- :func:`epoch_order`: each epoch's shuffle, a pure function of ``(seed, epoch, rank)``: the
  checkpoint's seed and step are the whole random state the data order needs; :func:`split_order`,
  one shuffle of the whole dataset per epoch, which a Session with ``split=True`` cuts over the workers
  present at the epoch's start, and :func:`split_position`, where a step is in such an epoch.
- checkpoint names (``step-00000120``), which checkpoint is the newest complete one, which are
  stale, and when the next one is due.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["Position", "Schedule", "checkpoint_name", "due", "epoch_order", "newest_complete", "split_order",
           "split_position", "stale", "step_of"]

_NAME = re.compile(r"^step-(\d{8,})$")


@dataclass(frozen=True)
class Position:
    """Where a session is: ``step`` steps done; the next is batch ``index`` of epoch ``epoch`` (0-based)."""

    step: int
    epoch: int
    index: int


@dataclass(frozen=True)
class Schedule:
    """``epochs`` passes over ``samples`` samples in batches of ``batch_size``; a last batch shorter
    than ``min_batch`` is dropped (``min_batch=batch_size``: full batches only).  Raises ValueError for
    a count below 1, a ``min_batch`` outside ``[1, batch_size]``, or an epoch with no batch."""

    samples: int
    batch_size: int
    epochs: int
    min_batch: int = 1

    def __post_init__(self) -> None:
        for name in ("samples", "batch_size", "epochs", "min_batch"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.min_batch > self.batch_size:
            raise ValueError(f"min_batch {self.min_batch} is larger than batch_size {self.batch_size}")
        if self.steps_per_epoch == 0:
            raise ValueError(f"{self.samples} samples make no batch of at least {self.min_batch}")

    @property
    def steps_per_epoch(self) -> int:
        """The batches of one epoch: the full ones, and the last partial one if it has ``min_batch``."""
        full, rest = divmod(self.samples, self.batch_size)
        return full + (1 if rest >= self.min_batch else 0)

    @property
    def total_steps(self) -> int:
        """Every step of every epoch."""
        return self.steps_per_epoch * self.epochs

    def position(self, step: int) -> Position:
        """Where the session is after ``step`` steps (``step == total_steps``: past the last epoch).
        Raises ValueError for a step outside ``[0, total_steps]``."""
        if not 0 <= step <= self.total_steps:
            raise ValueError(f"step {step} is outside this schedule's 0..{self.total_steps}")
        epoch, index = divmod(step, self.steps_per_epoch)
        return Position(step, epoch, index)

    def rows(self, order: np.ndarray, index: int) -> np.ndarray:
        """The sample indices of batch ``index`` of an epoch whose order is ``order``."""
        return order[index * self.batch_size:(index + 1) * self.batch_size]

    def settings(self) -> dict[str, int]:
        """What a checkpoint records of the schedule (a resumed run must have the same)."""
        return {"samples": self.samples, "batch_size": self.batch_size, "min_batch": self.min_batch}


def epoch_order(seed: int, epoch: int, rank: int, samples: int) -> np.ndarray:
    """The shuffle of epoch ``epoch`` (0-based) on worker ``rank``: a permutation of ``samples``,
    a pure function of its arguments (numpy's PCG64 seeded with ``[seed, epoch, rank]``)."""
    return np.random.default_rng([seed, epoch, rank]).permutation(samples)


def split_order(seed: int, epoch: int, samples: int) -> np.ndarray:
    """The shuffle of epoch ``epoch`` of a dataset split over the workers each epoch (``Session.run(...,
    split=True)``): one permutation of ``samples`` for every worker, a pure function of its arguments
    (numpy's PCG64 seeded with ``[seed, epoch]``)."""
    return np.random.default_rng([seed, epoch]).permutation(samples)


def split_position(step: int, epoch: int, start: int, steps: int) -> tuple[int, int]:
    """Where the job's step ``step`` is, given that epoch ``epoch`` began at step ``start`` with
    ``steps`` steps: ``(epoch, step - start)`` within it, or ``(epoch + 1, 0)`` at its end.  Raises
    ValueError for a step before ``start`` or past that epoch's end (the view is not the step's)."""
    if not start <= step <= start + steps:
        raise ValueError(f"step {step} is not in epoch {epoch} (steps {start} to {start + steps - 1}) "
                         "nor at its end")
    return (epoch, step - start) if step < start + steps else (epoch + 1, 0)


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint taken after ``step`` steps (sorts by step)."""
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step of checkpoint folder ``name``, or None when it is not one."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def newest_complete(names: Iterable[str], complete: Callable[[str], bool]) -> str | None:
    """The checkpoint among ``names`` with the highest step that ``complete(name)`` accepts (asked
    newest first, stopping at the first yes), or None.  Names that are no checkpoint are ignored."""
    for name in sorted((n for n in names if step_of(n) is not None), key=step_of, reverse=True):
        if complete(name):
            return name
    return None


def stale(names: Iterable[str], kept: Iterable[str]) -> list[str]:
    """The checkpoints among ``names`` to remove: every one but those in ``kept`` (the newest complete
    ones).  Incomplete ones are leftovers of a crash while writing: only one process writes."""
    keep = set(kept)
    return sorted(n for n in names if step_of(n) is not None and n not in keep)


def due(steps_since: int, seconds_since: float, every_steps: int | None, every_seconds: float | None) -> bool:
    """Whether a checkpoint is due ``steps_since`` steps and ``seconds_since`` seconds after the last
    one (or the session's start), saving every ``every_steps`` steps and/or ``every_seconds`` seconds."""
    if steps_since <= 0:
        return False
    return bool((every_steps and steps_since >= every_steps)
                or (every_seconds and seconds_since >= every_seconds))
