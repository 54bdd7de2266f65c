"""Unit tests of kvstore.client.realign's pure part: the rounds an ALIGN names."""

from __future__ import annotations

import numpy as np

from kvstore.client.realign import lowest_rounds
from kvstore.net.protocol import Message, Op


def test_align_names_each_keys_oldest_held_push_and_else_its_next_round() -> None:
    """Dense keys from PUSH / PUSHPULL rounds, row-sparse tables from their SPARSE_PUSH chunks (a
    table's oldest held round), pulls ignored; a key with nothing held is at its next round."""
    ids = np.zeros(1, np.int64)
    held = [Message(Op.PUSH, {"keys": ["a", "b"], "rounds": [4, 7]}),
            Message(Op.SPARSE_PUSH, {"key": "t", "round": 6, "last": False}, [ids, ids]),
            Message(Op.SPARSE_PUSH, {"key": "t", "round": 5, "last": True}, [ids, ids]),
            Message(Op.SPARSE_PULL, {"key": "t", "after": 2}, [ids]),
            Message(Op.PUSHPULL, {"keys": ["a"], "rounds": [3]})]
    keys, rounds = lowest_rounds(held, {"a": 5, "b": 8, "t": 7, "u": 2})
    assert dict(zip(keys, rounds)) == {"a": 3, "b": 7, "t": 5, "u": 2}
