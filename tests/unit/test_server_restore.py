"""Unit tests of kvstore.server.restore's pure parts: an ALIGN body's checks, a restart's shard choice."""

from __future__ import annotations

import pytest

from kvstore import config
from kvstore.errors import ConfigError, ProtocolError
from kvstore.server.restore import _align_body, read_image


def test_a_well_formed_align_is_read() -> None:
    """incarnation, origin, keys and one round per key."""
    body = {"incarnation": 1, "origin": 4, "keys": ["a", 3], "rounds": [2, 0]}
    assert _align_body(body) == (1, 4, ["a", 3], [2, 0])


@pytest.mark.parametrize("body", [
    {}, {"incarnation": -1, "origin": 0, "keys": [], "rounds": []},
    {"incarnation": 0, "origin": True, "keys": [], "rounds": []},
    {"incarnation": 0, "origin": 0, "keys": ["a"], "rounds": []},
    {"incarnation": 0, "origin": 0, "keys": ["a"], "rounds": [-1]},
    {"incarnation": 0, "origin": 0, "keys": ["a"], "rounds": [1.5]},
    {"incarnation": 0, "origin": 0, "keys": [[1]], "rounds": [1]},
    {"incarnation": 0, "origin": 0, "keys": "ab", "rounds": [1, 2]},
])
def test_a_malformed_align_is_a_protocol_error(body: dict) -> None:
    """Anything else is refused with ProtocolError (the server answers it and changes nothing)."""
    with pytest.raises(ProtocolError):
        _align_body(body)


def test_a_first_start_reads_no_shard_and_a_restart_needs_one(tmp_path) -> None:
    """Incarnation 0: None; a restart without a rank, a folder or a shard: ConfigError naming it."""
    base = {"DMLC_ROLE": "server", "KVSTORE_SNAPSHOT_DIR": str(tmp_path), "KVSTORE_SERVER_ID": "1"}
    assert read_image(config.load(base)) is None
    with pytest.raises(ConfigError, match="no shard"):
        read_image(config.load({**base, "KVSTORE_INCARNATION": "1"}))
    with pytest.raises(ConfigError, match="KVSTORE_SERVER_ID"):
        read_image(config.load({"DMLC_ROLE": "server", "KVSTORE_INCARNATION": "1"}))
