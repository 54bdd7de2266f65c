"""Pure pipeline planning (kvstore.pipeline.schedule): balance, rank mapping, schedules, checkpointing."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.pipeline import schedule as S

pytestmark = pytest.mark.timeout(10)


def test_gpipe_runs_every_forward_then_every_backward() -> None:
    """gpipe: all forwards of the mini-batch, then all backwards, at every stage."""
    for stage in range(3):
        assert S.gpipe(3, 4, stage) == [("F", m) for m in range(4)] + [("B", m) for m in range(4)]


def test_1f1b_warms_up_then_alternates() -> None:
    """1f1b at stage 0 of 4 with 6 micro-batches: 3 warm-up forwards, alternation, cool-down backwards."""
    assert S.one_f_one_b(4, 6, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4),
                                      ("B", 1), ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert S.one_f_one_b(4, 6, 3) == [op for m in range(6) for op in (("F", m), ("B", m))]


@pytest.mark.parametrize("stages,chunks", [(1, 1), (2, 1), (2, 5), (4, 2), (4, 8), (5, 3)])
def test_1f1b_holds_at_most_k_minus_i_and_runs_each_op_once(stages: int, chunks: int) -> None:
    """1f1b: every F and B once, each B after its F, at most min(K - i, M) activations held at stage i."""
    for stage in range(stages):
        ops = S.one_f_one_b(stages, chunks, stage)
        assert sorted(ops) == sorted([("F", m) for m in range(chunks)] + [("B", m) for m in range(chunks)])
        assert all(ops.index(("F", m)) < ops.index(("B", m)) for m in range(chunks))
        assert S.max_held(ops) <= min(stages - stage, chunks)
        assert S.max_held(S.gpipe(stages, chunks, stage)) == chunks


def test_plan_refuses_an_unknown_schedule() -> None:
    """An unknown schedule name is a ConfigError naming the known ones."""
    with pytest.raises(ConfigError, match="gpipe, 1f1b"):
        S.plan("zero-bubble", 2, 2, 0)


def test_balance_by_weight_minimises_the_heaviest_stage() -> None:
    """Contiguous cuts, each stage at least one layer, the heaviest stage as light as possible."""
    assert S.balance_by_weight([10, 1, 1, 10], 2) == [2, 2]
    assert S.balance_by_weight([1, 1, 1, 9], 2) == [3, 1]
    assert S.balance_by_weight([0, 0, 0], 3) == [1, 1, 1]
    with pytest.raises(ConfigError, match="3 layers into 4 stages"):
        S.balance_by_weight([1, 1, 1], 4)


def test_check_balance_and_workers() -> None:
    """A balance must cover every layer with K positive entries; W must be a multiple of K."""
    assert S.check_balance([1, 2], 3, 2) == [1, 2]
    for bad in ([3], [0, 3], [1, 1]):
        with pytest.raises(ConfigError):
            S.check_balance(bad, 3, 2)
    assert S.check_workers(4, 2) == 2
    with pytest.raises(ConfigError, match="multiple"):
        S.check_workers(3, 2)


def test_rank_mapping() -> None:
    """Rank r runs stage r % K of replica r // K."""
    assert [S.stage_of(r, 2) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_checkpoint_modes_and_split_sizes() -> None:
    """except_last spares the last micro-batch; sizes follow torch.chunk's rule."""
    assert [S.checkpointed("except_last", m, 3) for m in range(3)] == [True, True, False]
    assert [S.checkpointed("always", m, 2) for m in range(2)] == [True, True]
    assert not S.checkpointed("never", 0, 2)
    with pytest.raises(ConfigError):
        S.checkpointed("sometimes", 0, 1)
    assert S.split_sizes(10, 4) == [3, 3, 3, 1]
    assert S.split_sizes(3, 4) == [1, 1, 1]


def test_pipedream_runs_1f1b_order() -> None:
    """pipedream: 1F1B's order at every stage (its updates and stashing live in the stage, not the plan)."""
    for stage in range(4):
        assert S.plan("pipedream", 4, 8, stage) == S.one_f_one_b(4, 8, stage)
        assert S.max_held(S.plan("pipedream", 4, 8, stage)) == 4 - stage


# --- interleaved 1F1B, ops with chunks, the activation bound, the simulator and the bubble ---

# (schedule, K, v) checked with every M in 1..12: K in 1..5, v in 1..4 where the schedule allows it
CASES = [(schedule, stages, virtual) for schedule in S.SCHEDULES for stages in range(1, 6)
         for virtual in (range(1, 5) if schedule == "interleaved" else [1])]


def test_interleaved_order_for_two_ranks_two_chunks() -> None:
    """K=2, v=2, M=4: warm-up of (v-1)K + K-i-1 forwards, group by group, backwards through chunk 1 then 0."""
    a, b = 0, 1
    assert S.interleaved(2, 4, 0, 2) == [
        ("F", 0, a), ("F", 1, a), ("F", 0, b), ("F", 1, b), ("B", 0, b), ("F", 2, a), ("B", 1, b),
        ("F", 3, a), ("B", 0, a), ("F", 2, b), ("B", 1, a), ("F", 3, b), ("B", 2, b), ("B", 3, b),
        ("B", 2, a), ("B", 3, a)]
    assert S.interleaved(2, 4, 1, 2) == [
        ("F", 0, a), ("F", 1, a), ("F", 0, b), ("B", 0, b), ("F", 1, b), ("B", 1, b), ("F", 2, a),
        ("B", 0, a), ("F", 3, a), ("B", 1, a), ("F", 2, b), ("B", 2, b), ("F", 3, b), ("B", 3, b),
        ("B", 2, a), ("B", 3, a)]


def test_interleaved_spreads_the_left_over_micro_batches_over_the_first_groups() -> None:
    """K=2, M=5: groups {0, 1, 2} and {3, 4} (none smaller than K); M=3 < 2K: one group of 3."""
    forwards = [(mb, c) for kind, mb, c in S.interleaved(2, 5, 1, 2) if kind == "F"]
    assert forwards == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    backwards = [(mb, c) for kind, mb, c in S.interleaved(2, 3, 0, 2) if kind == "B"]
    assert backwards == [(0, 1), (1, 1), (2, 1), (0, 0), (1, 0), (2, 0)]


@pytest.mark.parametrize("stages", range(1, 6))
def test_interleaved_with_one_chunk_is_1f1b(stages: int) -> None:
    """v=1: interleaved's order is one_f_one_b's at every stage and M, chunk 0 throughout."""
    for chunks in range(1, 13):
        for stage in range(stages):
            want = S.one_f_one_b(stages, chunks, stage)
            assert S.interleaved(stages, chunks, stage, 1) == [(kind, mb, 0) for kind, mb in want]
            assert S.plan("interleaved", stages, chunks, stage) == want


def test_ops_of_the_one_chunk_schedules_are_their_plans_with_chunk_0() -> None:
    """gpipe, 1f1b and pipedream: ops() is plan() with c = 0; plan() is unchanged."""
    for schedule in ("gpipe", "1f1b", "pipedream"):
        for stage in range(3):
            assert S.ops(schedule, 3, 5, stage) == [(k, mb, 0) for k, mb in S.plan(schedule, 3, 5, stage)]
    assert S.plan("gpipe", 3, 2, 1) == S.gpipe(3, 2, 1)
    assert S.plan("1f1b", 3, 5, 0) == S.one_f_one_b(3, 5, 0)


def test_bad_virtual_stages_and_names_are_config_errors() -> None:
    """virtual > 1 needs 'interleaved'; virtual must be an int >= 1; unknown names are refused everywhere."""
    with pytest.raises(ConfigError, match="virtual stages need schedule 'interleaved'"):
        S.ops("1f1b", 2, 4, 0, virtual=2)
    with pytest.raises(ConfigError, match="virtual must be an int >= 1"):
        S.interleaved(2, 4, 0, 0)
    with pytest.raises(ConfigError, match="virtual must be an int >= 1"):
        S.ops("interleaved", 2, 4, 0, virtual=2.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a pipeline"):
        S.interleaved(2, 0, 0, 2)
    for call in (lambda: S.ops("zb", 2, 2, 0), lambda: S.held_bound("zb", 2, 2, 0),
                 lambda: S.bubble("zb", 2, 2), lambda: S.simulate("zb", 2, 2)):
        with pytest.raises(ConfigError, match="gpipe, 1f1b, pipedream, interleaved"):
            call()
    with pytest.raises(ConfigError, match="virtual stages need"):
        S.bubble("gpipe", 2, 4, virtual=2)


@pytest.mark.parametrize("schedule,stages,virtual", CASES)
def test_every_op_once_each_b_after_its_f_and_the_activation_bound(schedule: str, stages: int,
                                                                   virtual: int) -> None:
    """Each rank runs every (F, B) of each of its chunks once, B after F, holding held_bound() at its peak."""
    for chunks in range(1, 13):
        for stage in range(stages):
            ops = S.ops(schedule, stages, chunks, stage, virtual)
            want = [(k, mb, c) for k in "FB" for mb in range(chunks) for c in range(virtual)]
            assert sorted(ops) == sorted(want)
            assert all(ops.index(("F", mb, c)) < ops.index(("B", mb, c))
                       for mb in range(chunks) for c in range(virtual))
            assert S.max_held(ops) == S.held_bound(schedule, stages, chunks, stage, virtual)


def test_activation_bounds_in_numbers() -> None:
    """gpipe holds M; 1f1b K-i; interleaved (v-1)K + K-i when K divides M, else by its first group."""
    assert [S.held_bound("gpipe", 4, 8, i) for i in range(4)] == [8] * 4
    assert [S.held_bound("1f1b", 4, 8, i) for i in range(4)] == [4, 3, 2, 1]
    assert [S.held_bound("interleaved", 4, 8, i, 2) for i in range(4)] == [8, 7, 6, 5]
    assert [S.held_bound("interleaved", 4, 9, i, 3) for i in range(4)] == [14, 13, 12, 11]  # groups 5, 4
    assert S.held_bound("interleaved", 4, 1, 0, 3) == 3  # every chunk of the one micro-batch


@pytest.mark.parametrize("schedule,stages,virtual", CASES)
def test_simulation_runs_every_part_once_without_deadlock(schedule: str, stages: int, virtual: int) -> None:
    """simulate: no deadlock; every (F, B) of every part once; each op after what it waits for; no overlap."""
    for chunks in range(1, 13):
        timeline = S.simulate(schedule, stages, chunks, virtual)
        end: dict[tuple[str, int, int], float] = {}
        for stage, slots in enumerate(timeline.ranks):
            assert [slot.op for slot in slots] == S.ops(schedule, stages, chunks, stage, virtual)
            for slot, after in zip(slots, slots[1:]):
                assert slot.end <= after.start
            for slot in slots:
                kind, mb, chunk = slot.op
                assert slot.end - slot.start == (1.0 if kind == "F" else 2.0)
                end[(kind, mb, chunk * stages + stage)] = slot.end
        parts = stages * virtual
        assert sorted(end) == sorted((k, mb, p) for k in "FB" for mb in range(chunks) for p in range(parts))
        starts = {(s.op[0], s.op[1], s.op[2] * stages + r): s.start
                  for r, slots in enumerate(timeline.ranks) for s in slots}
        for (kind, mb, part), start in starts.items():
            if kind == "F" and part:
                assert start >= end[("F", mb, part - 1)]
            if kind == "B":
                assert start >= end[("F", mb, part)]
                assert part == parts - 1 or start >= end[("B", mb, part + 1)]


def test_simulation_names_a_deadlock_and_a_missing_op() -> None:
    """A rank waiting for a backward while its neighbour waits for its next forward is a deadlock, named."""
    rank0 = [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]
    rank1 = [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]
    deadlock = (r"deadlocks: rank 0 at B0 of chunk 0 waits for B0 of part 1 \(rank 1 chunk 0\); "
                r"rank 1 at F1 of chunk 0 waits for F1 of part 0 ")
    with pytest.raises(ConfigError, match=deadlock):
        S.simulate_ops([rank0, rank1], chunks=2)
    with pytest.raises(ConfigError, match=r"rank 1 .* missing \[\('B', 1, 0\)\], "
                                          r"extra or repeated \[\('F', 1, 0\)"):
        S.simulate_ops([rank0, [("F", 0, 0), ("F", 1, 0), ("F", 1, 0), ("B", 0, 0)]], chunks=2)


@pytest.mark.parametrize("costs", [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
@pytest.mark.parametrize("schedule", S.SCHEDULES)
def test_bubble_formula_is_the_simulated_idle_fraction(costs: tuple[float, float], schedule: str) -> None:
    """bubble() is the fraction of the simulated step's wall time every rank idles, whatever F and B cost."""
    forward, backward = costs
    for stages, virtual in [(k, v) for name, k, v in CASES if name == schedule]:
        for chunks in range(1, 13):
            timeline = S.simulate(schedule, stages, chunks, virtual, forward, backward)
            want = S.bubble(schedule, stages, chunks, virtual)
            assert timeline.makespan == pytest.approx(chunks * virtual * (forward + backward) / (1 - want))
            for stage in range(stages):
                assert timeline.idle(stage) == pytest.approx(want, abs=1e-12)


def test_bubble_in_numbers_shrinks_by_v() -> None:
    """(K-1)/(M+K-1) for gpipe and 1f1b; interleaved: Megatron's bubble/ideal ratio (K-1)/(vM)."""
    assert S.bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert S.bubble("1f1b", 4, 8) == S.bubble("gpipe", 4, 8)
    assert S.bubble("1f1b", 4, 2) == pytest.approx(3 / 5)
    for virtual in (1, 2, 4):
        fraction = S.bubble("interleaved", 4, 8, virtual)
        assert fraction == pytest.approx(3 / (8 * virtual + 3))
        assert fraction / (1 - fraction) == pytest.approx(3 / (virtual * 8))  # bubble time / ideal time
    assert S.bubble("interleaved", 4, 2, 2) == pytest.approx(1 - 4 / (8 + 1))  # M < K: v K + M - 1 slots
    assert S.bubble("gpipe", 1, 3) == 0.0
