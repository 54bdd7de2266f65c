"""What the tasks of ``kvstore.spark.predict`` do on the executors, no Spark imported: load the weights
(a broadcast state dict, or the generation of a ``kv.save_checkpoint`` folder that ``predict`` chose
on the driver: the same one in every task), build the
model once per task with ``model_fn(weights)``, and append its prediction to every row, a batch of
rows at a time, in the rows' order."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.core import snapshot
from kvstore.errors import TaskFailed


@dataclass(frozen=True)
class PredictSpec:
    """Everything a predict task needs; Spark pickles it into the job's task closure."""

    model_fn: Callable[[dict], Callable[[np.ndarray], Any]]
    weights: Any  # a pyspark Broadcast of the state dict, or None (then `checkpoint`)
    checkpoint: str | None  # the path of one snapshot generation (snapshot.newest on the driver)
    positions: tuple[int, ...]  # the input columns' places in a row
    batch_size: int


def load_weights(spec: PredictSpec) -> dict:
    """The state dict ``model_fn`` gets: the broadcast one, else the checkpoint generation's values by
    key.  Raises TaskFailed when the generation cannot be read (e.g. later saves removed it)."""
    if spec.weights is not None:
        return spec.weights.value
    try:
        values, _ = snapshot.read_generation(str(spec.checkpoint))
    except (OSError, ValueError) as exc:
        raise TaskFailed(f"predict cannot read the checkpoint generation {spec.checkpoint} (later "
                         f"kv.save_checkpoint calls remove all but the newest two): {exc}") from None
    return values


def inputs(rows: list[Any], positions: tuple[int, ...]) -> np.ndarray:
    """The model's input for ``rows``: one row per row, the input columns side by side (an array
    column gives its elements); float32 unless the columns are float64."""
    parts = []
    for position in positions:
        column = np.asarray([row[position] for row in rows])
        parts.append(column.reshape(len(rows), -1))
    batch = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return batch if batch.dtype == np.float64 else batch.astype(np.float32)


def predict_partition(spec: PredictSpec, rows: Iterable[Any]) -> Iterator[tuple]:
    """Each row of ``rows`` with its prediction appended, in order, ``spec.batch_size`` rows per call
    of the model.  Raises TaskFailed when the model returns a wrong number of predictions."""
    model = spec.model_fn(load_weights(spec))
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= spec.batch_size:
            yield from _predicted(model, chunk, spec.positions)
            chunk = []
    if chunk:
        yield from _predicted(model, chunk, spec.positions)


def _predicted(model: Callable[[np.ndarray], Any], chunk: list[Any],
               positions: tuple[int, ...]) -> Iterator[tuple]:
    out = np.asarray(model(inputs(chunk, positions)))
    if out.ndim == 0 or len(out) != len(chunk):
        raise TaskFailed(f"model_fn's model returned {out.shape[:1] or 'a scalar'} predictions for a batch "
                         f"of {len(chunk)} rows (one per row, along the first axis)")
    for row, value in zip(chunk, out):
        yield (*row, value.tolist())
