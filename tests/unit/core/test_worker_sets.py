"""Unit tests of worker sets in the shard (kvstore.core.shard, kvstore.core.worker_sets): a set key's
rounds count its members only, non-members are refused, the init rendezvous, the shard image."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import agreement
from kvstore.core.groups import GroupedShardState
from kvstore.core.shard import ShardState
from kvstore.core.shard_image import capture, from_file, to_file
from kvstore.core.worker_sets import WorkerSet, worker_set
from kvstore.errors import CollectiveMismatchError, ConfigError, DeadlineExceededError, NotAMemberError


def ones(n: int = 3, v: float = 1.0) -> np.ndarray:
    return np.full(n, v, np.float32)


def set_shard(ordered: bool = True, present: list[int] | None = None) -> ShardState:
    """A 4-worker dist_sync shard with key 'w' of the set {0, 2} and key 'all' of every worker."""
    shard = ShardState(4, sync=True, ordered=ordered, present=present)
    shard.init("w", ones(v=0.0), members=[0, 2])
    shard.init("all", ones(v=0.0))
    return shard


@pytest.mark.parametrize("ordered", [True, False])
def test_a_set_round_closes_with_its_members_pushes_only(ordered: bool) -> None:
    """Round of a {0, 2} key of 4 workers closes once 0 and 2 pushed; 1 and 3 are never waited for."""
    shard = set_shard(ordered)
    assert shard.push("a", 2, "w", ones(v=2.0)) == []
    done = shard.push("b", 0, "w", ones(v=1.0))
    assert sorted(c.token for c in done) == ["a", "b"]
    np.testing.assert_array_equal(shard.value("w"), ones(v=3.0))
    assert shard.open_rounds() == 0
    assert shard.push("c", 0, "all", ones()) == []  # an all-worker key still waits for every worker


def test_a_non_members_push_and_pull_are_refused_leaving_the_key_untouched() -> None:
    """Worker 1's push or pull of a {0, 2} key raises NotAMemberError naming key, set and worker."""
    shard = set_shard()
    shard.push("a", 0, "w", ones(v=5.0))
    with pytest.raises(NotAMemberError, match=r"worker 1 is not in worker set \[0, 2\] of key 'w'"):
        shard.push("x", 1, "w", ones(v=9.0))
    with pytest.raises(NotAMemberError):
        shard.pull("y", 3, "w")
    with pytest.raises(NotAMemberError):  # one refused entry refuses the whole message
        shard.push_many(1, [("z", "all", ones(), 0), ("x", "w", ones(), 0)])
    assert shard.open_rounds() == 1 and shard.value("w").sum() == 0
    done = shard.push("b", 2, "w", ones(v=1.0))
    assert sorted(c.token for c in done) == ["a", "b"]
    np.testing.assert_array_equal(shard.value("w"), ones(v=6.0))


def test_a_non_members_refused_pushpull_aborts_no_round_of_the_set() -> None:
    """ShardState.abort for worker 1 (its pushpull of a {0, 2} key refused) leaves the set's round open."""
    shard = set_shard()
    shard.push("a", 0, "w", ones(v=5.0))
    assert shard.abort(1, ["w"], "a value of another shape") == []
    assert [c.token for c in shard.push("b", 2, "w", ones())] == ["a", "b"]
    np.testing.assert_array_equal(shard.value("w"), ones(v=6.0))


def test_an_absent_or_leaving_member_is_not_waited_for() -> None:
    """Elastic: member 2 absent at the start; member 0's push closes the round; a leave closes one too."""
    shard = set_shard(present=[0, 1, 3])
    done = shard.push("a", 0, "w", ones(v=4.0))
    assert [c.token for c in done] == ["a"]
    shard = set_shard()
    shard.push("a", 0, "w", ones(v=4.0))
    shard.leave(1)  # a non-member leaving changes nothing for the set's round
    assert shard.open_rounds() == 1
    done = shard.leave(2)
    assert [c.token for c in done] == ["a"]
    np.testing.assert_array_equal(shard.value("w"), ones(v=4.0))


def test_set_keys_are_never_grouped() -> None:
    """A key group never takes a set key: its members are checked per key."""
    shard = GroupedShardState(4, sync=True, ordered=False)
    shard.init("w", ones(v=0.0), members=[0, 2])
    shard.init("v", ones(v=0.0), members=[0, 2])
    assert shard.group_of(["w", "v"], [3, 3], np.zeros(6, np.float32), create=True) is None


def meet_digest(shape: tuple[int, ...] = (3,)) -> str:
    return agreement.digest([("w", shape, "float32")])


def test_the_init_rendezvous_answers_once_every_present_member_met_and_the_key_is_stored() -> None:
    """Members' meets wait for each other and for the value; then each is acked."""
    shard = ShardState(4, sync=True)
    assert shard.meet("m2", 2, "w", [0, 2], meet_digest()) == []  # before the value came
    shard.init("w", ones(), members=[0, 2])
    assert shard.met("w") == []  # member 0 has not met
    done = shard.meet("m0", 0, "w", [0, 2], meet_digest())
    assert sorted(c.token for c in done) == ["m0", "m2"] and all(c.error is None for c in done)
    with pytest.raises(NotAMemberError):
        shard.meet("m1", 1, "w", [0, 2], meet_digest())


def test_members_that_disagree_all_get_a_collective_mismatch_and_nothing_is_stored() -> None:
    """Another shape at one member: every member's meet fails alike, the key is dropped."""
    shard = ShardState(4, sync=True)
    shard.init("w", ones(), members=[0, 2])
    shard.meet("m0", 0, "w", [0, 2], meet_digest())
    done = shard.meet("m2", 2, "w", [0, 2], meet_digest((4,)))
    assert len(done) == 2 and all(isinstance(c.error, CollectiveMismatchError) for c in done)
    assert "w" not in shard


def test_a_leaving_member_completes_the_rendezvous() -> None:
    """A member that left is not waited for at init."""
    shard = ShardState(4, sync=True)
    shard.init("w", ones(), members=[0, 2])
    shard.meet("m0", 0, "w", [0, 2], meet_digest())
    assert [c.token for c in shard.leave(2)] == ["m0"]


def test_a_rendezvous_past_its_deadline_fails_naming_the_missing_members() -> None:
    """Member 2 never meets: after the deadline member 0 gets DeadlineExceededError naming [2]; the
    key is dropped (nothing made), a rendezvous within its deadline is left open."""
    now = [0.0]
    shard = ShardState(4, sync=True, clock=lambda: now[0])
    shard.init("w", ones(), members=[0, 2])
    shard.meet("m0", 0, "w", [0, 2], meet_digest())
    now[0] = 5.0
    assert shard.expire_meets(10.0) == []
    now[0] = 11.0
    done = shard.expire_meets(10.0)
    assert [c.token for c in done] == ["m0"] and isinstance(done[0].error, DeadlineExceededError)
    assert "member(s) [2] did not call it" in str(done[0].error) and "w" not in shard


def test_a_set_under_a_quorum_or_staleness_is_refused() -> None:
    """Quorum and staleness count every worker: a set key's init is a ConfigError naming why."""
    with pytest.raises(ConfigError, match="KVSTORE_SYNC_QUORUM"):
        ShardState(4, sync=True, quorum=3).init("w", ones(), members=[0, 2])
    with pytest.raises(ConfigError, match="staleness"):
        ShardState(4, sync=False, staleness=2).init("w", ones(), members=[0, 2])
    with pytest.raises(ValueError):
        ShardState(4, sync=True).init("w", ones(), members=[0, 4])


def test_a_shard_image_keeps_each_keys_members() -> None:
    """capture -> to_file -> from_file -> restore keeps the set; a key without one stays without."""
    shard = set_shard()
    shard.push("a", 0, "w", ones())
    shard.push("b", 2, "w", ones())
    manifest, arrays = to_file(capture(shard, None, set(), rank=0, number=1))
    image = from_file(manifest, arrays, "shard")
    assert image.keys["w"].members == (0, 2) and image.keys["all"].members is None
    assert "workers" not in [e for e in manifest["keys"] if e["key"] == "all"][0]  # old readers' form
    restored = ShardState(4, sync=True)
    for key, held in image.keys.items():
        restored.restore(key, held.value, held.round, held.applied, held.members)
    assert restored.members_of("w") == (0, 2) and restored.members_of("all") is None
    with pytest.raises(NotAMemberError):
        restored.push("x", 3, "w", ones())
    assert [c.token for c in restored.push("c", 0, "w", ones()) + restored.push("d", 2, "w", ones())] \
        == ["c", "d"]


def test_worker_set_values() -> None:
    """A WorkerSet sorts and dedups its ranks; bad sets are refused."""
    assert WorkerSet((2, 0, 2)).ranks == (0, 2) and 2 in WorkerSet((2,))
    assert str(WorkerSet((1, 0))) == "{0, 1}"
    assert worker_set([3, 1], 4) == WorkerSet((1, 3)) and worker_set(None) is None
    with pytest.raises(ValueError):
        worker_set([], 4)
    with pytest.raises(ValueError):
        worker_set([4], 4)
    with pytest.raises(TypeError):
        worker_set(3, 4)


def test_a_local_store_takes_a_set_of_its_one_worker_and_refuses_others() -> None:
    """kv.init(..., workers=[0]) works on a local store; a set without rank 0 is out of range."""
    import kvstore

    kv = kvstore.create("local")
    kv.init("head", ones(v=0.0), workers=kvstore.WorkerSet((0,)))
    kv.push("head", ones())
    np.testing.assert_array_equal(kv.pull("head"), ones())
    with pytest.raises(ValueError, match="outside the job"):
        kv.init("x", ones(), workers=[1])
    with pytest.raises(ConfigError, match="dense keys only"):
        kv.init("t", shape=(4, 2), dtype="float32", init="zeros", workers=[0])
