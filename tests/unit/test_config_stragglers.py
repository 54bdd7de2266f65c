"""KVSTORE_SYNC_QUORUM and KVSTORE_STALENESS (issue 25): parsed, bounded, and refused with the
knob's name; ``create(quorum=...)`` checks its argument before joining anything."""

from __future__ import annotations

import pytest

from kvstore import config as kvconfig
from kvstore import create
from kvstore.errors import ConfigError


def test_unset_is_off():
    cfg = kvconfig.load({})
    assert cfg.sync_quorum is None and cfg.staleness is None


def test_values_are_read():
    cfg = kvconfig.load({"DMLC_NUM_WORKER": "4", "KVSTORE_SYNC_QUORUM": "3", "KVSTORE_STALENESS": "0"})
    assert cfg.sync_quorum == 3 and cfg.staleness == 0


@pytest.mark.parametrize("env, match", [
    ({"DMLC_NUM_WORKER": "3", "KVSTORE_SYNC_QUORUM": "4"}, r"KVSTORE_SYNC_QUORUM=4 must be in \[1, 3\]"),
    ({"KVSTORE_SYNC_QUORUM": "0"}, "KVSTORE_SYNC_QUORUM=0 must be >= 1"),
    ({"KVSTORE_STALENESS": "-1"}, "KVSTORE_STALENESS=-1 must be >= 0"),
    ({"KVSTORE_STALENESS": "two"}, "KVSTORE_STALENESS='two' is not an integer"),
])
def test_bad_values_name_the_knob(env, match):
    with pytest.raises(ConfigError, match=match):
        kvconfig.load(env)


@pytest.mark.parametrize("name, quorum, match", [
    ("dist_async", 2, "for dist_sync stores"), ("local", 1, "for dist_sync stores"),
    ("dist_sync", 0, "must be an int >= 1"), ("dist_sync", 1.5, "must be an int >= 1"),
])
def test_create_checks_quorum_first(name, quorum, match):
    with pytest.raises(ConfigError, match=match):
        create(name, quorum=quorum)
