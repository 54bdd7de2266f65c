"""Pure pipeline planning: layer balance, rank mapping, each stage's order of operations, and a
simulation of a step's timing under a schedule.

No I/O, no torch: every function here is a plain computation with unit tests
(tests/unit/test_pipeline_schedule.py).  docs/pipeline.md draws the schedules.

With K ranks per replica and v virtual stages per rank (``'interleaved'``; v = 1 otherwise), the model
is cut into K * v parts; part s runs on rank s % K as its local chunk s // K.  Activations flow from
part s to s + 1 (rank K - 1's chunk c feeds rank 0's chunk c + 1), gradients from s + 1 to s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "pipedream", "interleaved")
CHECKPOINTS = ("always", "except_last", "never")
Op = tuple[str, int]  # ("F" | "B", micro-batch index)
ChunkOp = tuple[str, int, int]  # ("F" | "B", micro-batch index, local chunk c: part c * K + stage)


def balance_by_weight(weights: Sequence[int], stages: int) -> list[int]:
    """Layers per stage: contiguous runs of ``weights`` (e.g. parameter counts) whose heaviest run is
    as light as possible, each stage holding at least one layer.  Raises :class:`ConfigError` when
    there are fewer layers than stages."""
    n = len(weights)
    if stages < 1 or n < stages:
        raise ConfigError(f"cannot cut {n} layers into {stages} stages (each stage needs a layer)")
    best: dict[tuple[int, int], tuple[int, list[int]]] = {}

    def solve(start: int, k: int) -> tuple[int, list[int]]:
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

    return solve(0, stages)[1]


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


def interleaved(stages: int, chunks: int, stage: int, virtual: int) -> list[ChunkOp]:
    """Interleaved 1F1B (Megatron-LM's schedule) at ``stage``, which holds ``virtual`` chunks.

    The micro-batches go in groups (:func:`_groups`: K each, M % K spread over them, one group when
    M <= K); forwards take each group through chunk 0, 1, ..., v - 1, backwards through v - 1, ..., 0.
    Stage i runs ``(v - 1) * g0 + K - i - 1`` warm-up forwards (g0 the first group's size), then one
    forward one backward, then the remaining backwards.  Any M >= 1 runs without deadlock; v = 1 is
    :func:`one_f_one_b`'s order.  Raises :class:`ConfigError` for a bad argument."""
    _check(stages, chunks, stage)
    _check_virtual("interleaved", virtual)
    groups = _groups(stages, chunks)
    forwards = [(m, c) for group in groups for c in range(virtual) for m in group]
    backwards = [(m, c) for group in groups for c in reversed(range(virtual)) for m in group]
    warmup = min((virtual - 1) * len(groups[0]) + stages - stage - 1, len(forwards))
    order: list[ChunkOp] = [("F", m, c) for m, c in forwards[:warmup]]
    for (fm, fc), (bm, bc) in zip(forwards[warmup:], backwards):
        order += [("F", fm, fc), ("B", bm, bc)]
    return order + [("B", m, c) for m, c in backwards[len(forwards) - warmup:]]


def ops(schedule: str, stages: int, chunks: int, stage: int, virtual: int = 1) -> list[ChunkOp]:
    """The ops of ``stage`` under ``schedule``, each with its local chunk: ``'gpipe'``, ``'1f1b'`` and
    ``'pipedream'`` hold one chunk (``virtual`` must be 1, c = 0), ``'interleaved'`` any ``virtual``
    >= 1 (1 is 1F1B's order).  Raises :class:`ConfigError` for an unknown name or a bad argument."""
    _check_virtual(schedule, virtual)
    if schedule == "interleaved":
        return interleaved(stages, chunks, stage, virtual)
    if schedule == "gpipe":
        return [(kind, mb, 0) for kind, mb in gpipe(stages, chunks, stage)]
    return [(kind, mb, 0) for kind, mb in one_f_one_b(stages, chunks, stage)]


def plan(schedule: str, stages: int, chunks: int, stage: int) -> list[Op]:
    """The ops of ``stage`` under ``schedule`` ('gpipe', '1f1b', 'pipedream': 1F1B's order, each
    backward followed by an update, or 'interleaved' with one chunk per rank: 1F1B's order too);
    raises :class:`ConfigError` for another name."""
    return [(kind, mb) for kind, mb, _ in ops(schedule, stages, chunks, stage)]


def held_bound(schedule: str, stages: int, chunks: int, stage: int, virtual: int = 1) -> int:
    """The most (micro-batch, chunk) activations ``stage`` holds at once (its forward done, its
    backward not yet) under ``schedule``: M for gpipe, ``min(K - i, M)`` for 1f1b and pipedream,
    ``min((v - 1) * g0 + K - i, M * v)`` for interleaved (g0: the first group's size, K when
    K divides M).  Raises :class:`ConfigError` for a bad argument."""
    _check(stages, chunks, stage)
    _check_virtual(schedule, virtual)
    if schedule == "gpipe":
        return chunks
    if schedule != "interleaved":
        return min(stages - stage, chunks)
    first = len(_groups(stages, chunks)[0])
    return min((virtual - 1) * first + stages - stage, chunks * virtual)


def bubble(schedule: str, stages: int, chunks: int, virtual: int = 1) -> float:
    """The fraction of a step's wall time each rank idles under ``schedule`` (the same at every
    rank, whatever a part's forward and backward cost): ``1 - M v / (v max(M, K) + min(M, K) - 1)``,
    i.e. ``(K - 1) / (M v + K - 1)`` when M >= K.  Raises :class:`ConfigError` for a bad argument."""
    _check(stages, chunks, 0)
    _check_virtual(schedule, virtual)
    span = virtual * max(chunks, stages) + min(chunks, stages) - 1  # in (forward + backward) times
    return (span - chunks * virtual) / span


@dataclass(frozen=True)
class Slot:
    """One op of a simulated rank: ``op`` ("F" | "B", micro-batch, local chunk) ran from ``start``
    to ``end``."""

    op: ChunkOp
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated step: each rank's ops in the order it ran them, with their times (from 0)."""

    ranks: tuple[tuple[Slot, ...], ...]

    @property
    def makespan(self) -> float:
        """The step's wall time: the end of the last op of any rank."""
        return max((slot.end for rank in self.ranks for slot in rank), default=0.0)

    def busy(self, rank: int) -> float:
        """The time ``rank`` spent running ops."""
        return sum(slot.end - slot.start for slot in self.ranks[rank])

    def idle(self, rank: int) -> float:
        """The fraction of the step's wall time ``rank`` idled (0 for an empty step)."""
        span = self.makespan
        return (span - self.busy(rank)) / span if span else 0.0


def simulate(schedule: str, stages: int, chunks: int, virtual: int = 1, forward: float = 1.0,
             backward: float = 2.0) -> Timeline:
    """Every rank of one replica running its :func:`ops` under ``schedule`` (see
    :func:`simulate_ops`).  Raises :class:`ConfigError` for a bad argument or a deadlock."""
    return simulate_ops([ops(schedule, stages, chunks, stage, virtual) for stage in range(stages)],
                        chunks, virtual, forward, backward)


def simulate_ops(rank_ops: Sequence[Sequence[ChunkOp]], chunks: int, virtual: int = 1,
                 forward: float = 1.0, backward: float = 2.0) -> Timeline:
    """A discrete-event run of ``rank_ops[i]``, rank i's ops in order, with ``len(rank_ops)`` ranks
    of ``virtual`` chunks: F of part s for micro-batch m waits for F of part s - 1 for m, B of part s
    for F of part s and B of part s + 1 (the last part's B for its F only); each op of a part takes
    ``forward`` or ``backward``; sends cost nothing and never block.  Raises :class:`ConfigError`
    when a rank's list is not every (F, B) of its parts once, or when the ranks deadlock (naming
    what each waits for)."""
    stages = len(rank_ops)
    if stages < 1 or chunks < 1 or virtual < 1 or not forward >= 0 or not backward >= 0:
        raise ConfigError(f"cannot simulate {stages} ranks x {virtual} chunks, {chunks} micro-batches, "
                          f"costs {forward} and {backward}")
    for stage, rank in enumerate(rank_ops):
        _check_complete(stage, rank, chunks, virtual)
    parts = stages * virtual
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, part) -> end
    slots: list[list[Slot]] = [[] for _ in range(stages)]
    free = [0.0] * stages
    remaining = sum(len(rank) for rank in rank_ops)
    while remaining:
        ran = 0
        for stage, rank in enumerate(rank_ops):
            while len(slots[stage]) < len(rank):
                kind, mb, chunk = op = rank[len(slots[stage])]
                needs = _needs(kind, mb, chunk * stages + stage, parts)
                if any(need not in done for need in needs):
                    break
                start = max([free[stage], *(done[need] for need in needs)])
                free[stage] = end = start + (forward if kind == "F" else backward)
                done[(kind, mb, chunk * stages + stage)] = end
                slots[stage].append(Slot(op, start, end))
                ran += 1
        if not ran:
            raise ConfigError("the schedule deadlocks: " + "; ".join(
                _waiting(stage, rank[len(slots[stage])], stages, parts, done)
                for stage, rank in enumerate(rank_ops) if len(slots[stage]) < len(rank)))
        remaining -= ran
    return Timeline(tuple(tuple(rank) for rank in slots))


def max_held(ops: Sequence[Op] | Sequence[ChunkOp]) -> int:
    """The most micro-batches (or (micro-batch, chunk) pairs) whose activations are held at once
    while running ``ops``."""
    held = peak = 0
    for op in ops:
        held += 1 if op[0] == "F" else -1
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


def _check_virtual(schedule: str, virtual: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if type(virtual) is not int or virtual < 1:
        raise ConfigError(f"virtual must be an int >= 1 (chunks per rank), not {virtual!r}")
    if virtual != 1 and schedule != "interleaved":
        raise ConfigError(f"schedule {schedule!r} runs one chunk per rank (virtual=1), not {virtual}: "
                          f"virtual stages need schedule 'interleaved'")


def _groups(stages: int, chunks: int) -> list[range]:
    """The micro-batches in floor(M / K) consecutive groups of near-equal sizes, each at least K,
    the larger first (Megatron's groups of K when K divides M); one group when M <= K.  A group
    smaller than K would idle rank 0 waiting for its next chunk's input; the first group is the
    largest because the warm-up is counted from it."""
    count = max(chunks // stages, 1)
    size, extra = divmod(chunks, count)
    groups, start = [], 0
    for index in range(count):
        end = start + size + (index < extra)
        groups.append(range(start, end))
        start = end
    return groups


def _needs(kind: str, mb: int, part: int, parts: int) -> list[tuple[str, int, int]]:
    """The ops (kind, micro-batch, part) that op (kind, mb) of ``part`` waits for."""
    if kind == "F":
        return [("F", mb, part - 1)] if part else []
    return [("F", mb, part)] + ([("B", mb, part + 1)] if part < parts - 1 else [])


def _waiting(stage: int, op: ChunkOp, stages: int, parts: int, done: Container[tuple[str, int, int]]) -> str:
    """What ``stage``, stuck at ``op``, waits for, in words."""
    kind, mb, chunk = op
    missing = [f"{k}{m} of part {p} (rank {p % stages} chunk {p // stages})"
               for k, m, p in _needs(kind, mb, chunk * stages + stage, parts) if (k, m, p) not in done]
    return f"rank {stage} at {kind}{mb} of chunk {chunk} waits for {' and '.join(missing)}"


def _check_complete(stage: int, order: Sequence[ChunkOp], chunks: int, virtual: int) -> None:
    want = [(kind, mb, chunk) for kind in "FB" for mb in range(chunks) for chunk in range(virtual)]
    count = Counter(tuple(op) for op in order)
    missing = [op for op in want if op not in count]
    extra = [op for op, times in count.items() if times > 1 or op not in set(want)]
    if missing or extra:
        raise ConfigError(f"rank {stage} must run every F and B of its {virtual} chunks for {chunks} "
                          f"micro-batches once: missing {missing}, extra or repeated {extra}")
