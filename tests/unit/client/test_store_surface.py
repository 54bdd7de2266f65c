"""The stores' public surfaces do not grow, and the worker's data-path object stays narrow.

The lists were taken before issue 36's restructuring (the data path, the fake-transport seam): no member
may become public only to satisfy the private-member rule (ruff ``SLF``)."""

from __future__ import annotations

from kvstore.client.datapath import DataPath
from kvstore.client.store import DistKVStore
from kvstore.local import LocalKVStore

COMMON = {"barrier", "broadcast", "close", "get_gradient_compression", "get_optimizer", "init",
          "is_capable", "load_optimizer_states", "num_servers", "num_workers", "pull", "push", "pushpull",
          "rank", "register", "row_sparse_pull", "save_checkpoint", "save_optimizer_states",
          "set_gradient_compression", "set_optimizer", "set_optimizer_params", "type",
          # issue 45 item 3: the workers' agreed membership is API (docs/elastic.md), on every store
          "membership", "num_present", "view"}
# scheduler_request became stage_access: the pipeline's one hook, which now also gives the stage's
# settings and session-sealed channel (the store kept one public name for it, not two); cluster_id
# (issue 43: kvstore.Session tells its cluster's checkpoints from an earlier cluster's) is API, not a seam
# await_view and joined_at_start (issue 45: a worker that joined before the job's first tagged membership
# view follows the others' barriers until one agrees it, then meets the first step's collectives with
# them, docs/elastic.md) are API, as membership and rejoined_at are
DIST = COMMON | {"await_view", "check_alive", "cluster_id", "joined_at_start", "rejoined_at", "stage_access",
                 "stats"}
DATA_PATH = {"mux", "window", "cluster", "plan", "pieces", "submit", "wait", "receive", "after_round", "send",
             "send_planned", "hold"}


def public(cls: type) -> set[str]:
    """The names ``dir(cls)`` lists without a leading underscore."""
    return {name for name in dir(cls) if not name.startswith("_")}


def test_the_dist_store_has_no_more_public_members_than_before() -> None:
    """DistKVStore's public attributes are exactly the pinned list (taken before the data-path split)."""
    assert public(DistKVStore) == DIST


def test_the_local_store_has_no_more_public_members_than_before() -> None:
    """LocalKVStore's public attributes are exactly the pinned list (taken before the data-path split),
    and stats (issue 46: a local store's dynamic tables report their counters, as the servers' do)."""
    assert public(LocalKVStore) == COMMON | {"stats"}


def test_the_data_path_is_narrow() -> None:
    """DataPath's public members (methods, and the attributes it declares) are the pinned dozen."""
    members = public(DataPath) | set(DataPath.__annotations__)
    assert {m for m in members if not m.startswith("_")} == DATA_PATH
    assert len(DATA_PATH) <= 12
