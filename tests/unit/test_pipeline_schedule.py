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
