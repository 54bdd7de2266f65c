"""Pure pipeline planning: layer balance, rank mapping, and each stage's order of operations.

No I/O, no torch: every function here is a plain computation with unit tests
(tests/unit/test_pipeline_schedule.py).  docs/pipeline.md draws the schedules.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "pipedream")
CHECKPOINTS = ("always", "except_last", "never")
Op = tuple[str, int]  # ("F" | "B", micro-batch index)


def balance_by_weight(weights: Sequence[float], stages: int, even: bool = False) -> list[int]:
    """Layers per stage: contiguous runs of ``weights`` (parameter counts, or measured costs as floats:
    ``kvstore.pipeline.profile``) whose heaviest run is as light as possible, each stage holding at
    least one layer; with ``even``, of those cuts the one whose lightest run is heaviest (else the
    first found).  Raises :class:`ConfigError` when there are fewer layers than stages."""
    n = len(weights)
    if stages < 1 or n < stages:
        raise ConfigError(f"cannot cut {n} layers into {stages} stages (each stage needs a layer)")
    best: dict[tuple[int, int], tuple[float, list[int]]] = {}

    def solve(start: int, k: int) -> tuple[float, list[int]]:
        """Cut layers[start:] into k stages: (heaviest stage, sizes)."""
        if (start, k) in best:
            return best[(start, k)]
        if k == 1:
            result = (sum(weights[start:]), [n - start])
        else:
            result = (-1, [])
            for end in range(start + 1, n - k + 2):
                rest, sizes = solve(end, k - 1)
                worst = max(sum(weights[start:end]), rest)
                if result[0] < 0 or worst < result[0]:
                    result = (worst, [end - start, *sizes])
        best[(start, k)] = result
        return result

    sizes = solve(0, stages)[1]
    return _evened(weights, sizes) if even else sizes


def _runs(weights: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """The total weight of each stage of the cut ``sizes``."""
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return [sum(weights[end - size:end]) for end, size in zip(ends, sizes)]


def _evened(weights: Sequence[float], cut: list[int]) -> list[int]:
    """The contiguous cut into as many runs as ``cut``, none heavier than its heaviest, whose lightest
    run is heaviest (``cut`` itself when none is)."""
    n, stages, cap = len(weights), len(cut), max(_runs(weights, cut))
    best: dict[tuple[int, int], tuple[float, list[int]] | None] = {}

    def solve(start: int, k: int) -> tuple[float, list[int]] | None:
        """Cut layers[start:] into k runs under the cap: (lightest run, sizes), or None."""
        if (start, k) not in best:
            result: tuple[float, list[int]] | None = None
            if k == 1:
                total = sum(weights[start:])
                result = (total, [n - start]) if total <= cap else None
            else:
                for end in range(start + 1, n - k + 2):
                    first, rest = sum(weights[start:end]), solve(end, k - 1)
                    if first > cap or rest is None:
                        continue
                    if result is None or min(first, rest[0]) > result[0]:
                        result = (min(first, rest[0]), [end - start, *rest[1]])
            best[(start, k)] = result
        return best[(start, k)]

    found = solve(0, stages)
    return cut if found is None else found[1]


def check_balance(balance: Sequence[int], layers: int, stages: int) -> list[int]:
    """``balance`` as a list, after checking it has ``stages`` positive entries summing to ``layers``;
    raises :class:`ConfigError` otherwise."""
    balance = list(balance)
    if len(balance) != stages or any(type(b) is not int or b < 1 for b in balance) or sum(balance) != layers:
        raise ConfigError(f"balance {balance} must give each of the {stages} stages at least one layer, "
                          f"{layers} layers in all")
    return balance


def stage_of(rank: int, stages: int) -> tuple[int, int]:
    """(stage, replica) of worker ``rank``: rank r runs stage r % K of replica r // K."""
    return rank % stages, rank // stages


def check_workers(num_workers: int, stages: int) -> int:
    """The number of replicas of each stage; raises :class:`ConfigError` unless ``num_workers`` is a
    positive multiple of ``stages``."""
    if stages < 1 or num_workers < stages or num_workers % stages:
        raise ConfigError(f"{num_workers} workers cannot run {stages} stages: the number of workers "
                          f"(DMLC_NUM_WORKER) must be a multiple of the number of stages")
    return num_workers // stages


def gpipe(stages: int, chunks: int, stage: int) -> list[Op]:
    """GPipe: every micro-batch's forward, then every backward (the same order at every stage)."""
    _check(stages, chunks, stage)
    return [("F", m) for m in range(chunks)] + [("B", m) for m in range(chunks)]


def one_f_one_b(stages: int, chunks: int, stage: int) -> list[Op]:
    """PipeDream-Flush: ``K - i - 1`` warm-up forwards at stage i, then one forward one backward,
    then the remaining backwards; at most ``K - i`` micro-batches' activations are held at once."""
    _check(stages, chunks, stage)
    warmup = min(stages - stage - 1, chunks)
    ops: list[Op] = [("F", m) for m in range(warmup)]
    backward = 0
    for m in range(warmup, chunks):
        ops += [("F", m), ("B", backward)]
        backward += 1
    return ops + [("B", m) for m in range(backward, chunks)]


def plan(schedule: str, stages: int, chunks: int, stage: int) -> list[Op]:
    """The ops of ``stage`` under ``schedule`` ('gpipe', '1f1b', or 'pipedream': 1F1B's order, each
    backward followed by an update); raises :class:`ConfigError` for another name."""
    if schedule == "gpipe":
        return gpipe(stages, chunks, stage)
    if schedule in ("1f1b", "pipedream"):
        return one_f_one_b(stages, chunks, stage)
    raise ConfigError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")


def max_held(ops: Sequence[Op]) -> int:
    """The most micro-batches whose activations are held at once while running ``ops``."""
    held = peak = 0
    for kind, _ in ops:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def checkpointed(mode: str, mb: int, chunks: int) -> bool:
    """Whether micro-batch ``mb``'s forward is re-materialised under ``checkpoint=mode``; raises
    :class:`ConfigError` for an unknown mode."""
    if mode not in CHECKPOINTS:
        raise ConfigError(f"checkpoint {mode!r} is not one of {', '.join(CHECKPOINTS)}")
    return mode == "always" or (mode == "except_last" and mb < chunks - 1)


def split_sizes(batch: int, chunks: int) -> list[int]:
    """Micro-batch sizes of a ``batch`` cut into at most ``chunks`` near-equal parts (torch.chunk's
    rule: ceil(batch / chunks) each, the last smaller; fewer parts when the batch is small)."""
    if batch < 1:
        raise ConfigError("a pipeline step needs a batch of at least one sample")
    size = -(-batch // chunks)
    return [min(size, batch - start) for start in range(0, batch, size)]


def _check(stages: int, chunks: int, stage: int) -> None:
    if stages < 1 or chunks < 1 or not 0 <= stage < stages:
        raise ConfigError(f"stage {stage} of {stages} with {chunks} micro-batches is not a pipeline")
