"""Unit tests of kvstore.core.shard_image: a server's shard image, its file form and its checks."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.optimizer import create
from kvstore.core.shard import ShardState
from kvstore.core.shard_image import capture, from_file, to_file
from kvstore.errors import FormatError


def trained(rounds: int, open_round: bool = True) -> tuple[ShardState, object]:
    """A two-worker dist_sync shard with an SGD-with-momentum optimizer and ``rounds`` closed rounds of
    key 'w' (and of int key 7), plus an open round of 'w' when ``open_round``."""
    opt = create("sgd", learning_rate=0.5, momentum=0.9)
    shard = ShardState(2, sync=True, ordered=True, window=2)

    def update(key, total, stored):
        weight = stored.copy()
        opt.update(key, weight, total)
        return weight
    shard.updater = update
    shard.init("w", np.zeros(3, np.float32))
    shard.init(7, np.ones(2, np.float32))
    for r in range(rounds):
        for worker in (0, 1):
            shard.push(("w", r, worker), worker, "w", np.full(3, 1.0, np.float32))
            shard.push((7, r, worker), worker, 7, np.full(2, 1.0, np.float32))
    if open_round:
        shard.push("open", 0, "w", np.full(3, 100.0, np.float32))
    return shard, opt


def test_an_image_holds_each_keys_closed_rounds_and_not_the_open_one() -> None:
    """The image's value and round agree: an open round's push is not in it; momentum is copied."""
    shard, opt = trained(3)
    image = capture(shard, opt, set(), rank=1, number=4)
    assert image.keys["w"].round == 3 and image.keys[7].round == 3 and image.step() == 3 == shard.progress()
    expected = shard.value("w").copy()
    np.testing.assert_array_equal(image.keys["w"].value, expected)
    before = image.keys["w"].states["mom"].copy()
    shard.push("close", 1, "w", np.full(3, 1.0, np.float32))  # closes round 3: state changes in place
    np.testing.assert_array_equal(image.keys["w"].states["mom"], before)
    np.testing.assert_array_equal(image.keys["w"].value, expected)
    assert image.keys["w"].count == 3 and image.num_update == opt.num_update - 1


def test_an_image_survives_its_file_form() -> None:
    """to_file then from_file gives back keys (int and str kept apart), rounds, applied counts, state."""
    shard, opt = trained(2, open_round=False)
    image = capture(shard, opt, {7}, rank=0, number=1)
    manifest, arrays = to_file(image)
    back = from_file(manifest, arrays, "x")
    assert set(back.keys) == {"w", 7} and back.optimizer == opt.spec() and back.mode == "dist_sync"
    assert back.keys[7].bf16 and not back.keys["w"].bf16 and back.keys["w"].applied == {0: 2, 1: 2}
    for key in ("w", 7):
        np.testing.assert_array_equal(back.keys[key].value, image.keys[key].value)
        np.testing.assert_array_equal(back.keys[key].states["mom"], image.keys[key].states["mom"])


@pytest.mark.parametrize("damage", ["kind", "round", "state", "applied"])
def test_a_malformed_shard_is_refused_by_name(damage: str) -> None:
    """A wrong kind, a negative round, a state of the wrong size or bad applied pairs: FormatError."""
    shard, opt = trained(1, open_round=False)
    manifest, arrays = to_file(capture(shard, opt, set(), 0, 1))
    entry = manifest["keys"][0]
    if damage == "kind":
        manifest["kind"] = "arrays"
    elif damage == "round":
        entry["round"] = -1
    elif damage == "state":
        arrays[entry["states"]["mom"]] = np.zeros(1)
    else:
        entry["applied"] = [[0]]
    with pytest.raises(FormatError, match="where"):
        from_file(manifest, arrays, "where")


def test_an_async_image_counts_each_workers_applied_pushes() -> None:
    """dist_async: round stays 0, applied counts what each worker's pushes did, step is the most."""
    shard = ShardState(2, sync=False)
    shard.init("w", np.zeros(2))
    for n in range(3):
        shard.push(n, 0, "w", np.ones(2))
    shard.push("b", 1, "w", np.ones(2))
    image = capture(shard, None, set(), 0, 1)
    assert image.keys["w"].applied == {0: 3, 1: 1} and image.step() == 3 and image.optimizer is None


def test_a_capture_copies_into_an_earlier_images_buffers() -> None:
    """With ``spare``, the state copies land in the earlier image's arrays and hold the new state."""
    shard, opt = trained(2, open_round=False)
    first = capture(shard, opt, set(), 0, 1)
    buffer = first.keys["w"].states["mom"]
    for worker in (0, 1):
        shard.push(worker, worker, "w", np.full(3, 1.0, np.float32))
    second = capture(shard, opt, set(), 0, 2, spare=first.keys)
    assert second.keys["w"].states["mom"] is buffer and second.keys["w"].round == 3
    np.testing.assert_array_equal(buffer, opt.get_state("w")[1]["mom"])
