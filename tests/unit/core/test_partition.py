"""Unit tests of kvstore.core.partition: key checks, home servers, slices and placement."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from kvstore.core.partition import Piece, check_key, home_server, key_bytes, placement, slice_bounds
from kvstore.errors import KeyTypeError

SEED = 123456789


def expected_bounds(size: int, num_servers: int) -> list[tuple[int, int]]:
    """Slice edges computed exactly: edge i is size*i/S rounded half up (MXNet's round())."""
    edges = [math.floor(Fraction(size * i, num_servers) + Fraction(1, 2)) for i in range(num_servers + 1)]
    return list(zip(edges[:-1], edges[1:]))


# -- check_key / key_bytes ----------------------------------------------------------------------------

@pytest.mark.parametrize("key", [0, 1, 2**32, 2**32 + 2, 2**63, 2**64 - 1], ids=str)
def test_check_key_accepts_ints_in_range(key):
    """Ints in [0, 2**64) are accepted and returned unchanged as plain ints."""
    got = check_key(key)
    assert got == key
    assert type(got) is int


@pytest.mark.parametrize("key", [np.int64(5), np.uint64(2**64 - 1), np.int32(7), np.uint8(0)], ids=repr)
def test_check_key_accepts_numpy_ints_as_plain_ints(key):
    """Numpy integer scalars are accepted and converted to plain ints of the same value."""
    got = check_key(key)
    assert got == int(key)
    assert type(got) is int


@pytest.mark.parametrize("key", ["", "3", "weight", "ünïcødé"])
def test_check_key_accepts_strs(key):
    """Any str (even empty or non-ASCII) is a valid key, returned unchanged."""
    assert check_key(key) == key


@pytest.mark.parametrize("key", [True, False, np.bool_(True), -1, np.int64(-1), 2**64, 2**70, 1.0, 3.5,
                                 np.float32(1), None, b"3", bytearray(b"3"), (1,), [1], object()],
                         ids=lambda key: "object()" if type(key) is object else repr(key))  # one id per run
def test_check_key_rejects_everything_else(key):
    """bool, negative, >= 2**64, floats, None, bytes and containers raise KeyTypeError."""
    with pytest.raises(KeyTypeError):
        check_key(key)


def test_key_type_error_is_a_type_error():
    """A bad key can be caught as the built-in TypeError too."""
    with pytest.raises(TypeError):
        check_key(None)


def test_int_and_str_keys_have_different_bytes():
    """Key 3 and key "3" never collide: their tagged bytes differ."""
    assert key_bytes(3) != key_bytes("3")
    assert key_bytes(0) != key_bytes("")


def test_key_bytes_are_distinct_over_the_whole_int_range():
    """Ints that collide in 32 bits (2 and 2**32+2) or sit at the edges have distinct bytes."""
    keys = [0, 2, 2**32 + 2, 2**63, 2**64 - 1]
    assert len({key_bytes(k) for k in keys}) == len(keys)


# -- home_server ------------------------------------------------------------------------------------

def test_home_server_is_deterministic():
    """The same (key, num_servers, seed) always maps to the same server."""
    keys = list(range(50)) + [f"k{i}" for i in range(50)]
    first = [home_server(k, 7, SEED) for k in keys]
    assert [home_server(k, 7, SEED) for k in keys] == first


@pytest.mark.parametrize("num_servers", [1, 2, 3, 8, 13])
def test_home_server_is_in_range(num_servers):
    """Every key lands on a server in [0, num_servers)."""
    keys = list(range(200)) + [str(i) for i in range(200)] + [2**64 - 1]
    assert all(0 <= home_server(k, num_servers, SEED) < num_servers for k in keys)


def test_home_server_with_one_server_is_zero():
    """With a single server every key lives on server 0."""
    assert {home_server(k, 1, s) for k in range(100) for s in (0, 1, SEED)} == {0}


def test_home_server_depends_on_the_seed():
    """Another seed gives another placement for a good share of keys."""
    keys = range(1000)
    a = [home_server(k, 4, 1) for k in keys]
    b = [home_server(k, 4, 2) for k in keys]
    moved = sum(x != y for x, y in zip(a, b))
    assert 500 < moved < 1000  # ~75% expected for independent hashes over 4 servers


def test_home_server_is_independent_of_call_order():
    """Placement of a key does not depend on which keys were placed before it (unlike MXNet's str keys)."""
    keys = [f"layer{i}.weight" for i in range(100)] + list(range(100))
    forward = {k: home_server(k, 5, SEED) for k in keys}
    backward = {k: home_server(k, 5, SEED) for k in reversed(keys)}
    assert forward == backward


def test_int_and_str_key_are_placed_independently():
    """Over many keys, k and str(k) do not systematically share a server."""
    same = sum(home_server(k, 4, SEED) == home_server(str(k), 4, SEED) for k in range(1000))
    assert same < 400  # ~250 expected; identical placement would give 1000


@pytest.mark.parametrize("keys", [range(10_000), [f"param{i}" for i in range(10_000)]], ids=["int", "str"])
def test_home_server_spreads_keys_evenly(keys):
    """10,000 keys over 4 servers give each server between 15% and 35% of them."""
    counts = Counter(home_server(k, 4, SEED) for k in keys)
    assert set(counts) == {0, 1, 2, 3}
    assert all(1500 <= c <= 3500 for c in counts.values()), counts


def test_sequential_keys_do_not_follow_a_modulo_pattern():
    """Consecutive int keys are hashed, not placed round-robin (k % S) as a naive scheme would."""
    homes = [home_server(k, 4, SEED) for k in range(100)]
    assert homes != [k % 4 for k in range(100)]


# -- slice_bounds -----------------------------------------------------------------------------------

@pytest.mark.parametrize("size,num_servers,expected", [
    (5, 2, [(0, 3), (3, 5)]),                      # 2.5 rounds up to 3
    (10, 4, [(0, 3), (3, 5), (5, 8), (8, 10)]),    # 2.5 -> 3, 5, 7.5 -> 8
    (7, 3, [(0, 2), (2, 5), (5, 7)]),              # 2.33 -> 2, 4.67 -> 5
    (2, 4, [(0, 1), (1, 1), (1, 2), (2, 2)]),      # 0.5 -> 1, 1, 1.5 -> 2
    (9, 1, [(0, 9)]),
    (0, 3, [(0, 0), (0, 0), (0, 0)]),
    (1_000_000, 3, [(0, 333_333), (333_333, 666_667), (666_667, 1_000_000)]),
])
def test_slice_bounds_match_hand_computed_mxnet_rounding(size, num_servers, expected):
    """Slice edges are round(size/S*i) with halves rounded up, as MXNet computes them."""
    assert slice_bounds(size, num_servers) == expected


def test_slice_bounds_invariants_over_many_sizes():
    """For many (size, S): S contiguous slices cover [0, size), sizes differ by <= 1, edges round half up."""
    for num_servers in range(1, 17):
        for size in list(range(0, 300)) + [1_000_000, 1_000_003, 2**31 + 7]:
            bounds = slice_bounds(size, num_servers)
            assert len(bounds) == num_servers
            assert bounds[0][0] == 0 and bounds[-1][1] == size
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            lengths = [stop - start for start, stop in bounds]
            assert min(lengths) >= 0 and max(lengths) - min(lengths) <= 1, (size, num_servers)
            assert bounds == expected_bounds(size, num_servers), (size, num_servers)


# -- placement --------------------------------------------------------------------------------------

def test_placement_below_bound_is_one_piece_on_the_home_server():
    """A value with fewer elements than the bound is one whole piece on home_server(key)."""
    for key in [0, 7, "w", 2**64 - 1]:
        pieces = placement(key, 99, 4, SEED, bound=100)
        assert pieces == [Piece(home_server(key, 4, SEED), 0, 99)]


def test_placement_at_bound_is_split_over_every_server():
    """A value with exactly `bound` elements is cut into one piece per server, piece i on server i."""
    assert placement("w", 100, 4, SEED, bound=100) == [Piece(0, 0, 25), Piece(1, 25, 50),
                                                       Piece(2, 50, 75), Piece(3, 75, 100)]


def test_placement_above_bound_uses_the_slice_bounds():
    """A big value's pieces are the MXNet slices, whatever the key."""
    for key in [1, "x"]:
        pieces = placement(key, 10, 4, SEED, bound=5)
        assert [(p.server, p.start, p.stop) for p in pieces] == [(0, 0, 3), (1, 3, 5), (2, 5, 8), (3, 8, 10)]


def test_placement_split_pieces_reassemble_the_value():
    """The split pieces of a big value concatenate back to the whole flattened value."""
    value = np.arange(1001, dtype=np.float32)
    pieces = placement(3, value.size, 7, SEED, bound=1000)
    assert sorted(p.server for p in pieces) == list(range(7))
    np.testing.assert_array_equal(np.concatenate([value[p.start:p.stop] for p in pieces]), value)


def test_placement_with_one_server_never_splits():
    """With a single server even a huge value is one piece on server 0."""
    assert placement(5, 10**9, 1, SEED, bound=10) == [Piece(0, 0, 10**9)]


def test_placement_leaves_out_empty_slices():
    """When a split value has fewer elements than servers, empty slices are left out."""
    pieces = placement("tiny", 2, 4, SEED, bound=1)
    assert pieces == [Piece(0, 0, 1), Piece(2, 1, 2)]  # slices (0,1) (1,1) (1,2) (2,2)


def test_placement_of_empty_value_below_bound_is_one_empty_piece():
    """A 0-element value (below any bound) is one empty piece on its home server."""
    assert placement(9, 0, 3, SEED, bound=1) == [Piece(home_server(9, 3, SEED), 0, 0)]


def test_placement_is_the_same_on_every_worker():
    """Placements computed in another order (as on another worker) are identical."""
    keys = list(range(50)) + [f"k{i}" for i in range(50)]
    sizes = [10, 10_000, 2_000_000]
    first = [placement(k, n, 3, SEED, 1_000_000) for k in keys for n in sizes]
    again = {(k, n): placement(k, n, 3, SEED, 1_000_000) for k in reversed(keys) for n in sizes}
    assert first == [again[(k, n)] for k in keys for n in sizes]


def test_check_key_refuses_a_lone_surrogate_as_a_key_type_error():
    """A str key with no UTF-8 encoding ('\\ud800') is a KeyTypeError, not a UnicodeEncodeError."""
    with pytest.raises(KeyTypeError, match="surrogate"):
        check_key("w\ud800")
    assert check_key("wé") == "wé"
