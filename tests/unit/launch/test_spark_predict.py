"""kvstore.launch.spark_predict's tasks, no Spark: the checkpoint generation they load."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import snapshot
from kvstore.errors import TaskFailed
from kvstore.launch import spark_predict


def _spec(generation: str) -> spark_predict.PredictSpec:
    return spark_predict.PredictSpec(lambda weights: weights, None, generation, (0,), 2)


def test_a_task_loads_the_generation_predict_chose_not_a_newer_one(tmp_path) -> None:
    """The weights come from the generation predict() resolved, even once a newer one is written."""
    folder = str(tmp_path / "ckpt")
    snapshot.write(folder, {"w": np.full(3, 1.0)}, None)
    chosen = snapshot.newest(folder)
    snapshot.write(folder, {"w": np.full(3, 2.0)}, None)
    np.testing.assert_array_equal(spark_predict.load_weights(_spec(chosen))["w"], np.full(3, 1.0))


def test_a_removed_generation_is_a_task_failure_naming_it(tmp_path) -> None:
    """Once later saves removed the chosen generation, the task fails naming it (no other is read)."""
    folder = str(tmp_path / "ckpt")
    snapshot.write(folder, {"w": np.zeros(2)}, None)
    chosen = snapshot.newest(folder)
    snapshot.write(folder, {"w": np.ones(2)}, None)
    snapshot.write(folder, {"w": np.ones(2)}, None)
    with pytest.raises(TaskFailed, match="snapshot-000001"):
        spark_predict.load_weights(_spec(chosen))
