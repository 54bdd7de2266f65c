"""kvstore.Session and its pure logic (kvstore.core.progress): data positions, which checkpoint is the
newest complete one, and checkpoint/resume with a local store giving the unbroken run's weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvstore.core import progress
from kvstore.errors import ConfigError

torch = pytest.importorskip("torch")

import kvstore  # noqa: E402
from kvstore.session import META, Hook  # noqa: E402

# -- pure logic --------------------------------------------------------------------------------------


def test_steps_per_epoch_counts_a_last_partial_batch_only_when_it_has_min_batch() -> None:
    """10 samples in batches of 4: 3 steps (the last of 2) with min_batch 1 or 2, 2 with min_batch 3."""
    assert progress.Schedule(10, 4, 1).steps_per_epoch == 3
    assert progress.Schedule(10, 4, 1, min_batch=2).steps_per_epoch == 3
    assert progress.Schedule(10, 4, 1, min_batch=3).steps_per_epoch == 2
    assert progress.Schedule(8, 4, 5).total_steps == 10


def test_a_step_maps_to_its_epoch_and_batch_index() -> None:
    """After s steps of a 3-step epoch the next batch is (s // 3, s % 3); the end is past the last epoch."""
    schedule = progress.Schedule(10, 4, 2)
    assert [(p.epoch, p.index) for p in map(schedule.position, range(7))] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    with pytest.raises(ValueError, match="outside"):
        schedule.position(7)


def test_rows_cut_the_epoch_order_into_batches_covering_every_sample_once() -> None:
    """An epoch's batches are consecutive slices of its order: every sample once, the last one short."""
    schedule = progress.Schedule(10, 4, 1)
    order = progress.epoch_order(0, 0, 0, 10)
    batches = [schedule.rows(order, i) for i in range(schedule.steps_per_epoch)]
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(np.concatenate(batches).tolist()) == list(range(10))


def test_schedule_refuses_bad_counts() -> None:
    """A count below 1, min_batch above batch_size, or no batch at all raise ValueError."""
    for args in ((0, 4, 1), (10, 0, 1), (10, 4, 0), (10, 4, 1, 5), (2, 4, 1, 3)):
        with pytest.raises(ValueError):
            progress.Schedule(*args)


def test_epoch_order_is_a_pure_function_of_seed_epoch_and_rank() -> None:
    """The same (seed, epoch, rank) draws the same permutation; another epoch, rank or seed another one."""
    base = progress.epoch_order(7, 3, 1, 50)
    assert np.array_equal(base, progress.epoch_order(7, 3, 1, 50))
    assert sorted(base.tolist()) == list(range(50))
    for other in ((7, 4, 1), (7, 3, 0), (8, 3, 1)):
        assert not np.array_equal(base, progress.epoch_order(*other, 50))


def test_checkpoint_names_sort_by_step_and_parse_back() -> None:
    """step-NNNNNNNN names parse back to their step; other names are no checkpoint."""
    assert progress.checkpoint_name(120) == "step-00000120"
    assert progress.step_of("step-00000120") == 120
    assert progress.step_of("step-123456789") == 123456789
    for name in ("step-12", ".step-00000001.tmp", "LATEST", "step-0000001x"):
        assert progress.step_of(name) is None


def test_newest_complete_skips_incomplete_newer_checkpoints_and_other_names() -> None:
    """The highest step whose check passes wins; a newer incomplete one (a crash mid-write) is skipped,
    names that are no checkpoint are never asked about, and none complete gives None."""
    names = ["step-00000010", "step-00000030", "notes.txt", "step-00000020", "step-00000040"]
    asked: list[str] = []

    def complete(name: str) -> bool:
        asked.append(name)
        return name in ("step-00000010", "step-00000030")

    assert progress.newest_complete(names, complete) == "step-00000030"
    assert asked == ["step-00000040", "step-00000030"]
    assert progress.newest_complete(names, lambda n: False) is None
    assert progress.newest_complete([], lambda n: True) is None


def test_stale_is_every_checkpoint_but_the_kept_ones() -> None:
    """Older complete checkpoints and incomplete leftovers are stale; other names are not."""
    names = ["step-00000010", "step-00000020", "step-00000030", "step-00000040", "other"]
    assert progress.stale(names, ["step-00000030", "step-00000020"]) == ["step-00000010", "step-00000040"]


def test_a_checkpoint_is_due_after_its_steps_or_its_seconds() -> None:
    """Due at every_steps steps or every_seconds seconds since the last one, never with no step since."""
    assert progress.due(5, 0.0, 5, None)
    assert not progress.due(4, 1e9, 5, None)
    assert progress.due(1, 60.0, None, 60.0)
    assert not progress.due(1, 59.0, None, 60.0)
    assert progress.due(1, 61.0, 100, 60.0)
    assert not progress.due(0, 1e9, 1, 1.0)
    assert not progress.due(10, 1e9, None, None)


# -- the Session with a local store -------------------------------------------------------------------

SAMPLES, BATCH, EPOCHS = 40, 8, 3  # 5 steps an epoch, 15 in all


def _job(tmp: Path | str | None, uok: bool | None, optimizer: tuple = ("sgd", {"learning_rate": 0.1,
                                                                              "momentum": 0.9}),
         samples: int = SAMPLES, **session_args):
    """A fresh model, Trainer (``optimizer``: name and parameters) and Session over a local store, on
    ``samples`` fixed samples, checkpointing to ``tmp`` (a path or URL; None: none); returns
    (model, session, step_fn)."""
    torch.manual_seed(0)
    x, y = torch.randn(samples, 6), torch.randint(0, 3, (samples,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    trainer = kvstore.Trainer(model.named_parameters(), *optimizer, kvstore="local", update_on_kvstore=uok,
                              key_prefix="net")
    session = kvstore.Session(trainer, None if tmp is None else str(tmp), **session_args)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")

    def step(batch) -> float:
        model.zero_grad()
        loss = loss_fn(model(x[batch.rows]), y[batch.rows])
        loss.backward()
        trainer.step(len(batch.rows))
        return loss.item()

    return model, session, step


def _weights(model) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("uok", [False, True], ids=["states-in-worker", "states-in-store"])
def test_a_stopped_session_resumes_to_the_unbroken_weights(tmp_path: Path, uok: bool) -> None:
    """Stopped at step 7 (mid-epoch) with a checkpoint every 3 steps, a new Session on the same URL
    resumes at step 7 and ends with exactly the weights of 15 unbroken steps (momentum included)."""
    model, session, step = _job(None, uok)
    assert session.run(step, SAMPLES, BATCH, EPOCHS) == 15
    unbroken = _weights(model)

    _, first, step = _job(tmp_path, uok, every_steps=3, stop_at=7)
    assert first.run(step, SAMPLES, BATCH, EPOCHS) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000007"]  # keep=2

    model, second, step = _job(tmp_path, uok, every_steps=3)
    assert second.latest() == str(tmp_path / "step-00000007")
    assert second.run(step, SAMPLES, BATCH, EPOCHS) == 15
    assert (second.start_step, second.resumed_from) == (7, str(tmp_path / "step-00000007"))
    for name, value in unbroken.items():
        np.testing.assert_array_equal(_weights(model)[name], value, err_msg=name)
    meta = json.loads((tmp_path / "step-00000015" / META).read_text())
    assert (meta["step"], meta["epoch"], meta["index"], meta["seed"]) == (15, 3, 0, 0)


def test_an_incomplete_newer_checkpoint_is_ignored_and_removed(tmp_path: Path) -> None:
    """A newer folder without session.json (a crash while writing) is not resumed from, and the next
    save removes it."""
    _, first, step = _job(tmp_path, False, every_steps=5, stop_at=5)
    first.run(step, SAMPLES, BATCH, EPOCHS)
    partial = tmp_path / "step-00000009"
    partial.mkdir()
    (partial / "weights.arrays").write_bytes(b"half a file")
    _, second, step = _job(tmp_path, False, every_steps=5, stop_at=10)
    assert second.latest() == str(tmp_path / "step-00000005")
    assert second.run(step, SAMPLES, BATCH, EPOCHS) == 10
    assert second.start_step == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005", "step-00000010"]


def test_a_checkpoint_of_another_schedule_is_refused(tmp_path: Path) -> None:
    """Resuming with another batch size (another data order) raises ConfigError naming both."""
    _, first, step = _job(tmp_path, False, stop_at=2)
    first.run(step, SAMPLES, BATCH, EPOCHS)
    _, second, step = _job(tmp_path, False)
    with pytest.raises(ConfigError, match="batch_size"):
        second.run(step, SAMPLES, BATCH // 2, EPOCHS)


def test_hooks_see_every_step_and_epoch_and_evaluate_reaches_the_user(tmp_path: Path) -> None:
    """A Hook gets begin once, then every step and each epoch's end once; eval_every calls evaluate
    every N steps;
    stop_at stops there; epoch_loss sums the step function's losses of the epoch."""
    events: list[tuple[str, int]] = []
    losses: list[float] = []

    class Record(Hook):
        def begin(self, session) -> None:
            events.append(("begin", session.start_step))

        def after_step(self, session, loss) -> None:
            events.append(("step", session.step))

        def after_epoch(self, session, epoch) -> None:
            events.append(("epoch", epoch))
            losses.append(session.epoch_loss)

    evaluated: list[int] = []
    _, session, step = _job(None, False, hooks=[Record()], eval_every=4,
                            evaluate=lambda s: evaluated.append(s.step) or 0.5, stop_at=11, log_every=2)
    assert session.run(step, SAMPLES, BATCH, EPOCHS) == 11
    assert events[0] == ("begin", 0)
    assert [e for e in events if e[0] == "epoch"] == [("epoch", 0), ("epoch", 1)]
    assert [e[1] for e in events if e[0] == "step"] == list(range(1, 12))
    assert evaluated == [4, 8]
    assert all(loss > 0 for loss in losses)


def test_session_refuses_bad_arguments() -> None:
    """A non-positive period, keep 0, or eval_every without evaluate raise ValueError."""
    trainer = kvstore.Trainer([torch.nn.Parameter(torch.zeros(2))], "sgd", kvstore="local")
    for kwargs in ({"every_steps": 0}, {"every_seconds": -1.0}, {"keep": 0}, {"eval_every": 3}):
        with pytest.raises(ValueError):
            kvstore.Session(trainer, **kwargs)


def test_a_restarted_workers_rounds_count_from_where_its_cluster_started(tmp_path: Path) -> None:
    """kv.rejoined_at counts the rounds of the worker's cluster, which started from the newest
    checkpoint: a checkpoint written by that cluster says where it started; one written by an earlier
    cluster is where this one started; with none, 0."""
    _, first, step = _job(tmp_path, True, every_steps=3, stop_at=7)
    first.trainer.kvstore.cluster_id = "run-1"  # a local store stands in for a cluster's store
    first.run(step, SAMPLES, BATCH, EPOCHS)
    _, second, step = _job(tmp_path, True, every_steps=3, stop_at=10)
    second.trainer.kvstore.cluster_id = "run-2"  # the relaunch: it resumes at 7 and saves 9 and 10
    assert second.run(step, SAMPLES, BATCH, EPOCHS) == 10 and second.start_step == 7
    meta = json.loads((tmp_path / "step-00000010" / META).read_text())
    assert (meta["cluster"], meta["cluster_start"]) == ("run-2", 7)
    _, rejoining, _ = _job(tmp_path, True)
    rejoining.trainer.kvstore.cluster_id = "run-2"  # a worker of the relaunched cluster, restarted
    assert rejoining._started_here() == 7
    rejoining.trainer.kvstore.cluster_id = "run-3"  # one of a cluster started from step 10
    assert rejoining._started_here() == 10
    _, fresh, _ = _job(tmp_path / "none", True)
    assert fresh._started_here() == 0


# -- split=True: the whole dataset split over the workers present at each epoch's start ---------------

def test_split_position_places_a_step_in_its_epoch_or_at_its_end() -> None:
    """A step within the tagged epoch is (epoch, step - start); its end is the next epoch's start; a
    step outside raises ValueError."""
    assert progress.split_position(13, 2, 10, 5) == (2, 3)
    assert progress.split_position(15, 2, 10, 5) == (3, 0)
    for bad in (9, 16):
        with pytest.raises(ValueError, match="not in epoch 2"):
            progress.split_position(bad, 2, 10, 5)


def test_split_order_is_one_shuffle_for_every_worker() -> None:
    """The split order is a permutation of the samples depending on (seed, epoch) only."""
    a = progress.split_order(3, 1, 50)
    assert sorted(a) == list(range(50)) and np.array_equal(a, progress.split_order(3, 1, 50))
    assert not np.array_equal(a, progress.split_order(3, 2, 50))


def test_a_split_session_sees_every_sample_once_per_epoch(tmp_path: Path) -> None:
    """With split=True, samples is the dataset: one worker's batches of each epoch cover every sample
    exactly once (a last short batch included), and run returns the epochs' steps."""
    seen: dict[int, list[int]] = {}
    model, session, step = _job(None, True, samples=42)

    def record(batch) -> float:
        seen.setdefault(batch.epoch, []).extend(int(r) for r in batch.rows)
        return step(batch)

    assert session.run(record, 42, BATCH, EPOCHS, split=True) == 6 * EPOCHS
    assert sorted(seen) == list(range(EPOCHS))
    assert all(sorted(rows) == list(range(42)) for rows in seen.values())
    assert seen[0] != seen[1]  # each epoch its own shuffle


def test_a_split_epoch_whose_parts_are_all_below_min_batch_raises_instead_of_passing_with_no_step() -> None:
    """3 samples in batches of 4 with min_batch 4: the epoch's one part makes no batch, so the run raises
    ConfigError at that epoch's start instead of counting epochs of no step."""
    _, session, step = _job(None, True, samples=3)
    with pytest.raises(ConfigError, match="none a batch of min_batch 4"):
        session.run(step, 3, 4, EPOCHS, 4, split=True)
    assert session.step == 0


def test_a_split_session_stops_at_the_epochs_end_and_resumes_mid_epoch_to_the_unbroken_weights(
        tmp_path: Path) -> None:
    """A stop asked mid-epoch takes effect at the epoch's end; a checkpoint taken mid-epoch resumes
    there (as many workers present as the epoch had) and ends with the unbroken run's weights."""
    model, session, step = _job(None, True)
    assert session.run(step, SAMPLES, BATCH, EPOCHS, split=True) == 15
    unbroken = _weights(model)
    _, stopped, step = _job(None, True, stop_at=7)
    assert stopped.run(step, SAMPLES, BATCH, EPOCHS, split=True) == 10  # epoch 1 ends at step 10

    _, first, step = _job(tmp_path, True, every_steps=3)

    class Crash(Hook):
        def after_step(self, session, loss) -> None:
            if session.step == 7:
                raise KeyboardInterrupt  # a worker killed after step 7 (saved at 6)

    first.hooks.append(Crash())
    with pytest.raises(KeyboardInterrupt):
        first.run(step, SAMPLES, BATCH, EPOCHS, split=True)
    meta = json.loads((tmp_path / "step-00000006" / META).read_text())
    assert (meta["epoch"], meta["index"], meta["epoch_start"], meta["epoch_workers"]) == (1, 1, 5, 1)
    model, second, step = _job(tmp_path, True)
    assert second.run(step, SAMPLES, BATCH, EPOCHS, split=True) == 15 and second.start_step == 6
    for name, value in unbroken.items():
        np.testing.assert_allclose(_weights(model)[name], value, rtol=1e-6, err_msg=name)
    _, plain, step = _job(tmp_path, True)
    with pytest.raises(ConfigError, match="split"):  # a split checkpoint is not a per-worker schedule's
        plain.run(step, SAMPLES, BATCH, EPOCHS)


def test_a_split_session_needs_updates_on_the_store() -> None:
    """split=True with update_on_kvstore=False raises ConfigError before any step."""
    _, session, step = _job(None, False)
    with pytest.raises(ConfigError, match="update_on_kvstore"):
        session.run(step, SAMPLES, BATCH, EPOCHS, split=True)


class _Comer:
    """A stand-in Trainer of a worker that joined or restarted (pure placement: ``_split_start``): its
    store's ``view`` is the map's last tagged view; nothing is sent."""

    update_on_kvstore = True

    def __init__(self, rank: int, view) -> None:
        self.kvstore = type("Store", (), {"rank": rank, "view": view, "num_workers": 4, "rejoined_at": 0})()


def test_a_worker_that_comes_in_places_itself_by_the_jobs_last_tagged_view() -> None:
    """Epoch 1 began at step 14 over ranks (0, 1): 25 samples each, 7 steps.  A worker coming in at
    step 17 goes on in it (a joiner owns no part of it, a restarted rank 1 its own); at 21 it is at
    epoch 2's start; past it, or with an untagged view after the first round, it cannot place itself."""
    from kvstore.core.membership import Membership

    view = Membership(5, (0, 1), 4, (1, 14))
    for rank in (2, 1):
        session = kvstore.Session(_Comer(rank, view))
        session.rejoined, session.step = True, 17
        assert session._split_start(50, 4, 1) == (1, 3, view)
        session.step = 21
        assert session._split_start(50, 4, 1) == (2, 0, None)
    session.step = 22
    with pytest.raises(ConfigError, match="cannot place this worker"):
        session._split_start(50, 4, 1)
    untagged = kvstore.Session(_Comer(2, Membership(0, (0, 1), 4)))
    untagged.rejoined, untagged.step = True, 0
    assert untagged._split_start(50, 4, 1) == (0, 0, None)
    untagged.step = 3
    with pytest.raises(ConfigError, match="names no epoch"):
        untagged._split_start(50, 4, 1)


def test_a_worker_coming_in_at_the_first_step_of_the_tagged_epoch_uses_that_epochs_view() -> None:
    """Epoch 1's view (tag (1, 14)) was already released when this worker came at step 14: it goes on in
    epoch 1 with that view (a joiner pushing zeros, a restarted rank 1 its own part) instead of opening
    a barrier nobody else joins."""
    from kvstore.core.membership import Membership

    view = Membership(5, (0, 1), 4, (1, 14))
    for rank in (2, 1):
        session = kvstore.Session(_Comer(rank, view))
        session.rejoined, session.step = True, 14
        assert session._split_start(50, 4, 1) == (1, 0, view)


def test_a_split_session_joined_before_the_first_view_awaits_it_then_trains_its_part(monkeypatch) -> None:
    """A worker that joined (KVSTORE_JOIN=1) while the job's last view names no epoch first awaits the
    first view (kv.await_view), before it touches the store; that view names it, so it trains its part of
    epoch 0 from step 0 (8 samples over ranks 0, 1, 2: parts of 3, 3 and 2 in batches of 2, two steps:
    its part is one batch, then zeros)."""
    from kvstore.client.store import DistKVStore
    from kvstore.core.membership import EpochSplit, Membership
    from kvstore.core.progress import split_order

    calls: list[str] = []

    class EarlyJoiner(DistKVStore):
        """A dist store of worker 2 joined before the first view (nothing is sent)."""

        rank, num_workers, rejoined_at, cluster_id = 2, 3, 0, "c"

        def __init__(self) -> None:  # no cluster: only what the Session reads
            self._view = Membership(0, (0, 1, 2), 3)

        @property
        def view(self) -> Membership:
            return self._view

        def await_view(self, timeout: float | None = None) -> Membership:
            calls.append("await_view")
            self._view = Membership(4, (0, 1, 2), 3, (0, 0))
            return self._view

    class Trainer:
        update_on_kvstore = True
        kvstore = EarlyJoiner()

        def init_kvstore(self) -> None:
            calls.append("init_kvstore")

        def step_without_data(self) -> None:
            calls.append("zero")

    monkeypatch.setenv("KVSTORE_JOIN", "1")
    rows: list[list[int]] = []
    early = kvstore.Session(Trainer())
    assert early.run(lambda b: rows.append(b.rows.tolist()), 8, 2, 1, split=True) == 2
    assert calls == ["await_view", "init_kvstore", "zero"] and early.rejoined
    lo, hi = EpochSplit(8, 3, 2, 1).bounds(2)
    assert rows == [split_order(0, 0, 8)[lo:hi].tolist()] and hi - lo == 2
