"""Unit tests of kvstore.checkpoint: the zip + manifest.json + .npy file format and optimizer states."""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from kvstore.core import checkpoint as C
from kvstore.core import optimizer as opt
from kvstore.errors import (
    DTypeMismatchError,
    FormatError,
    KeyNotInitializedError,
    OptimizerError,
    ShapeMismatchError,
)

# float16 weights without multi_precision on purpose: their optimizer warning is expected
pytestmark = pytest.mark.filterwarnings("ignore:key .* updates a float16 weight in float16")

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]


def npy_bytes(array: np.ndarray, allow_pickle: bool = False) -> bytes:
    """The .npy serialisation of ``array``."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def craft(path, manifest, members: dict[str, bytes]) -> None:
    """Write a zip with ``manifest`` (a dict, or raw bytes) and the given raw members."""
    with zipfile.ZipFile(path, "w") as zf:
        if manifest is not None:
            zf.writestr("manifest.json", manifest if isinstance(manifest, bytes) else json.dumps(manifest))
        for name, data in members.items():
            zf.writestr(name, data)


def good_manifest(**extra) -> dict:
    """A valid manifest listing one array 'a' in member arrays/000000.npy."""
    return {"format": "kvstore", "version": 1, "arrays": {"a": "arrays/000000.npy"}, "kind": "arrays",
            **extra}


def leftovers(directory) -> list[str]:
    """Temporary files the writer left in ``directory``."""
    return [n for n in os.listdir(directory) if ".tmp-" in n]


# -- the container ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype(tmp_path, dtype):
    """Arrays of every supported dtype come back equal, with their dtype and shape."""
    arrays = {"x": (np.arange(12) - 5).astype(dtype).reshape(3, 4), "scalar": np.array(7, dtype),
              "empty": np.zeros((0, 3), dtype)}
    C.write(tmp_path / "f", {"kind": "test"}, arrays)
    manifest, back = C.read(tmp_path / "f")
    assert manifest == {"kind": "test"}
    assert set(back) == set(arrays)
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        np.testing.assert_array_equal(back[name], array)


def test_round_trip_non_contiguous_input(tmp_path):
    """Strided and Fortran-ordered arrays are stored by value."""
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    arrays = {"strided": base[::2, 1::3], "fortran": np.asfortranarray(base), "transposed": base.T}
    C.write(tmp_path / "f", {}, arrays)
    _, back = C.read(tmp_path / "f")
    for name, array in arrays.items():
        np.testing.assert_array_equal(back[name], array)


def test_file_layout_is_a_stored_zip_with_generated_member_names(tmp_path):
    """The file is an uncompressed zip: manifest.json plus arrays/NNNNNN.npy, never user strings."""
    C.write(tmp_path / "f", {"kind": "x"}, {"../evil": np.ones(2), "b/c": np.zeros(1)})
    with zipfile.ZipFile(tmp_path / "f") as zf:
        assert zf.namelist() == ["manifest.json", "arrays/000000.npy", "arrays/000001.npy"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
        manifest = json.loads(zf.read("manifest.json"))
    assert manifest == {"format": "kvstore", "version": C.FORMAT_VERSION, "kind": "x",
                        "arrays": {"../evil": "arrays/000000.npy", "b/c": "arrays/000001.npy"}}


def test_same_content_gives_the_same_bytes(tmp_path):
    """Writing the same content twice gives byte-identical files (fixed member timestamps)."""
    arrays = {"a": np.arange(5.0)}
    C.write(tmp_path / "1", {"kind": "k"}, arrays)
    C.write(tmp_path / "2", {"kind": "k"}, arrays)
    assert (tmp_path / "1").read_bytes() == (tmp_path / "2").read_bytes()


@pytest.mark.parametrize("key", ["format", "version", "arrays"])
def test_write_refuses_reserved_manifest_keys(tmp_path, key):
    """A manifest using format/version/arrays raises ValueError and writes nothing."""
    with pytest.raises(ValueError, match="reserved"):
        C.write(tmp_path / "f", {key: 1}, {})
    assert os.listdir(tmp_path) == []


def test_write_refuses_object_arrays_and_bad_names(tmp_path):
    """Object arrays (ValueError), non-str names and non-arrays (TypeError) are refused."""
    with pytest.raises(ValueError, match="pickle"):
        C.write(tmp_path / "f", {}, {"a": np.array([{}, 1], dtype=object)})
    with pytest.raises(TypeError):
        C.write(tmp_path / "f", {}, {1: np.ones(1)})
    with pytest.raises(TypeError):
        C.write(tmp_path / "f", {}, {"a": [1.0]})
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    """An array failing to serialize mid-write leaves the old file intact and no temporary file."""
    C.write(tmp_path / "f", {"kind": "old"}, {"a": np.ones(3)})
    before = (tmp_path / "f").read_bytes()
    calls = []
    real = np.lib.format.write_array

    def failing(fp, array, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            fp.write(b"partial")
            raise RuntimeError("disk on fire")
        return real(fp, array, **kwargs)

    monkeypatch.setattr(C.npy, "write_array", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        C.write(tmp_path / "f", {"kind": "new"}, {"a": np.zeros(3), "b": np.zeros(1000)})
    assert (tmp_path / "f").read_bytes() == before
    assert leftovers(tmp_path) == []


def test_failed_replace_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    """When os.replace fails the old file is unchanged and the temporary file is removed."""
    C.write(tmp_path / "f", {"kind": "old"}, {"a": np.ones(3)})

    def refuse(src, dst):
        assert os.path.basename(src).startswith(".f.tmp-") and os.path.dirname(src) == str(tmp_path)
        raise OSError("no rename today")

    monkeypatch.setattr(C.os, "replace", refuse)
    with pytest.raises(OSError, match="no rename"):
        C.write(tmp_path / "f", {"kind": "new"}, {"a": np.zeros(3)})
    monkeypatch.undo()
    assert C.read(tmp_path / "f")[0] == {"kind": "old"}
    assert leftovers(tmp_path) == []


def test_write_replaces_an_existing_file(tmp_path):
    """Writing over an existing file replaces it whole."""
    C.write(tmp_path / "f", {"kind": "old"}, {"a": np.ones(3), "b": np.ones(1)})
    C.write(tmp_path / "f", {"kind": "new"}, {"c": np.zeros(2)})
    manifest, arrays = C.read(tmp_path / "f")
    assert manifest == {"kind": "new"} and list(arrays) == ["c"]
    assert leftovers(tmp_path) == []


def test_missing_file_raises_file_not_found(tmp_path):
    """Reading a file that does not exist raises FileNotFoundError, not FormatError."""
    with pytest.raises(FileNotFoundError):
        C.read(tmp_path / "nope")


def test_garbage_bytes_are_a_format_error(tmp_path):
    """A file that is not a zip raises FormatError."""
    (tmp_path / "f").write_bytes(b"this is not a zip file at all" * 10)
    with pytest.raises(FormatError, match="not a zip"):
        C.read(tmp_path / "f")


def test_empty_file_is_a_format_error(tmp_path):
    """An empty file raises FormatError."""
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(FormatError):
        C.read(tmp_path / "f")


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.95])
def test_truncated_file_is_a_format_error(tmp_path, keep):
    """A file cut short anywhere raises FormatError."""
    C.write(tmp_path / "f", {"kind": "x"}, {"a": np.arange(1000.0), "b": np.arange(10)})
    data = (tmp_path / "f").read_bytes()
    (tmp_path / "f").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(FormatError):
        C.read(tmp_path / "f")


def test_flipped_byte_is_a_format_error(tmp_path):
    """A byte changed inside an array's data fails the zip's CRC check and raises FormatError."""
    C.write(tmp_path / "f", {"kind": "x"}, {"a": np.arange(1000.0)})
    data = bytearray((tmp_path / "f").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "f").write_bytes(bytes(data))
    with pytest.raises(FormatError, match="CRC"):
        C.read(tmp_path / "f")


def test_truncated_array_member_is_a_format_error(tmp_path):
    """A .npy member whose data is shorter than its header says raises FormatError."""
    craft(tmp_path / "f", good_manifest(), {"arrays/000000.npy": npy_bytes(np.arange(100.0))[:-8]})
    with pytest.raises(FormatError, match="truncated"):
        C.read(tmp_path / "f")


def test_array_member_with_garbage_header_is_a_format_error(tmp_path):
    """A member that is not a .npy file raises FormatError."""
    craft(tmp_path / "f", good_manifest(), {"arrays/000000.npy": b"not numpy"})
    with pytest.raises(FormatError):
        C.read(tmp_path / "f")


def test_pickled_object_array_is_refused(tmp_path):
    """A .npy member holding a pickled object array raises FormatError and is never unpickled."""
    evil = npy_bytes(np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    craft(tmp_path / "f", good_manifest(), {"arrays/000000.npy": evil})
    with pytest.raises(FormatError, match="pickle"):
        C.read(tmp_path / "f")


def test_zip_without_manifest_is_a_format_error(tmp_path):
    """A zip with no manifest.json raises FormatError."""
    craft(tmp_path / "f", None, {"arrays/000000.npy": npy_bytes(np.ones(2))})
    with pytest.raises(FormatError, match="no manifest"):
        C.read(tmp_path / "f")


@pytest.mark.parametrize("manifest", [b"{not json", b"\xff\xfe", b"[1, 2]", b'"kvstore"'])
def test_bad_manifest_json_is_a_format_error(tmp_path, manifest):
    """A manifest that is not JSON, not UTF-8 or not an object raises FormatError."""
    craft(tmp_path / "f", manifest, {})
    with pytest.raises(FormatError):
        C.read(tmp_path / "f")


@pytest.mark.parametrize("change", [{"format": "other"}, {"format": None}, {"version": 0}, {"version": "1"},
                                    {"version": True}, {"arrays": ["a"]}, {"arrays": {"a": 3}}])
def test_malformed_manifest_fields_are_a_format_error(tmp_path, change):
    """A wrong format tag, a bad version or a malformed arrays table raises FormatError."""
    craft(tmp_path / "f", {**good_manifest(), **change}, {"arrays/000000.npy": npy_bytes(np.ones(2))})
    with pytest.raises(FormatError):
        C.read(tmp_path / "f")


def test_newer_version_is_refused_with_upgrade_advice(tmp_path):
    """A file of a newer format version raises FormatError naming the version and saying to upgrade."""
    newer = C.FORMAT_VERSION + 1
    craft(tmp_path / "f", good_manifest(version=newer), {"arrays/000000.npy": npy_bytes(np.ones(2))})
    with pytest.raises(FormatError, match=f"version {newer}.*upgrade"):
        C.read(tmp_path / "f")


def test_missing_member_is_a_format_error(tmp_path):
    """A manifest naming a member the zip lacks raises FormatError."""
    craft(tmp_path / "f", good_manifest(), {})
    with pytest.raises(FormatError, match="missing"):
        C.read(tmp_path / "f")


# -- save_arrays / load_arrays ------------------------------------------------------------------------

def test_save_and_load_arrays_numpy_and_torch(tmp_path):
    """Named numpy arrays and torch tensors come back as equal numpy arrays."""
    torch = pytest.importorskip("torch")
    C.save_arrays(tmp_path / "f", {"np": np.arange(6, dtype=np.int32).reshape(2, 3),
                                   "torch": torch.arange(4, dtype=torch.float16)})
    back = C.load_arrays(tmp_path / "f")
    np.testing.assert_array_equal(back["np"], np.arange(6, dtype=np.int32).reshape(2, 3))
    assert back["torch"].dtype == np.float16
    np.testing.assert_array_equal(back["torch"], np.arange(4, dtype=np.float16))


def test_save_arrays_refuses_other_values(tmp_path):
    """Lists (TypeError) and unsupported dtypes (DTypeMismatchError) are refused; nothing is written."""
    with pytest.raises(TypeError):
        C.save_arrays(tmp_path / "f", {"a": [1, 2]})
    with pytest.raises(DTypeMismatchError):
        C.save_arrays(tmp_path / "f", {"a": np.ones(2, bool)})
    with pytest.raises(TypeError):
        C.save_arrays(tmp_path / "f", [np.ones(2)])
    assert os.listdir(tmp_path) == []


def test_load_arrays_refuses_other_kinds(tmp_path):
    """load_arrays on an optimizer-states file raises FormatError."""
    C.write_states(tmp_path / "f", C.StatesFile(None, 0, []))
    with pytest.raises(FormatError, match="optimizer_states"):
        C.load_arrays(tmp_path / "f")


# -- optimizer states files ---------------------------------------------------------------------------

def sample_states() -> C.StatesFile:
    """States with a big int key, a str key that looks like an int, and several dtypes."""
    return C.StatesFile({"name": "sgd", "params": {"momentum": 0.9}}, 7, [
        C.StateEntry(2**64 - 1, (2, 3), np.dtype(np.float32), 7,
                     {"mom": np.arange(6, dtype=np.float32).reshape(2, 3)}),
        C.StateEntry("3", (4,), np.dtype(np.float16), 2,
                     {"weight32": np.ones(4, np.float32), "mom": np.zeros(4, np.float32)}),
        C.StateEntry(3, (), np.dtype(np.float64), 1, {"mom": np.array(2.5)}),
        C.StateEntry("none", (5,), np.dtype(np.float64), 4, {}),
    ])


def test_states_round_trip_keeps_int_and_str_keys_apart(tmp_path):
    """write_states/read_states round-trip every field; 3, '3' and 2**64-1 stay distinct and typed."""
    states = sample_states()
    C.write_states(tmp_path / "s", states)
    back = C.read_states(tmp_path / "s")
    assert back.optimizer == states.optimizer and back.num_update == 7
    assert [e.key for e in back.entries] == [2**64 - 1, "3", 3, "none"]
    assert [type(e.key) for e in back.entries] == [int, str, int, str]
    for got, want in zip(back.entries, states.entries):
        assert (got.shape, got.dtype, got.count) == (want.shape, want.dtype, want.count)
        assert set(got.arrays) == set(want.arrays)
        for name, array in want.arrays.items():
            assert got.arrays[name].dtype == array.dtype and got.arrays[name].shape == want.shape
            np.testing.assert_array_equal(got.arrays[name], array)


def test_states_manifest_layout(tmp_path):
    """The manifest has kind, optimizer, num_update and one keys entry per key, as documented."""
    C.write_states(tmp_path / "s", sample_states())
    with zipfile.ZipFile(tmp_path / "s") as zf:
        manifest = json.loads(zf.read("manifest.json"))
    assert manifest["kind"] == "optimizer_states" and manifest["num_update"] == 7
    first = manifest["keys"][0]
    assert first["key"] == 2**64 - 1 and first["shape"] == [2, 3] and first["dtype"] == "float32"
    assert first["count"] == 7 and list(first["states"]) == ["mom"]
    assert manifest["keys"][1]["key"] == "3" and manifest["keys"][2]["key"] == 3


def test_write_states_refuses_inconsistent_entries(tmp_path):
    """An array of the wrong size, an unsupported dtype or a repeated key raises ValueError."""
    bad = [C.StateEntry(1, (2, 3), np.dtype(np.float32), 1, {"mom": np.zeros(5, np.float32)}),
           C.StateEntry(1, (2,), np.dtype(np.uint8), 1, {}),
           C.StateEntry(1, (2,), np.dtype(np.float32), -1, {})]
    for entry in bad:
        with pytest.raises(ValueError):
            C.write_states(tmp_path / "s", C.StatesFile(None, 1, [entry]))
    twice = C.StateEntry(1, (2,), np.dtype(np.float32), 1, {})
    with pytest.raises(ValueError, match="two"):
        C.write_states(tmp_path / "s", C.StatesFile(None, 1, [twice, twice]))
    assert os.listdir(tmp_path) == []


def states_file(path, entries, arrays=None, **top) -> None:
    """Craft an optimizer-states file with the given keys table and raw arrays."""
    arrays = arrays or {"0/mom": np.zeros(6, np.float32)}
    members = {name: f"arrays/{i:06d}.npy" for i, name in enumerate(arrays)}
    manifest = {"format": "kvstore", "version": 1, "arrays": members, "kind": "optimizer_states",
                "optimizer": None, "num_update": 1, "keys": entries, **top}
    craft(path, manifest, {members[n]: npy_bytes(a) for n, a in arrays.items()})


GOOD_ENTRY = {"key": 1, "shape": [2, 3], "dtype": "float32", "count": 1, "states": {"mom": "0/mom"}}


def test_crafted_states_file_reads(tmp_path):
    """The crafting helper makes a valid file (so the malformed cases below test one thing each)."""
    states_file(tmp_path / "s", [GOOD_ENTRY])
    (entry,) = C.read_states(tmp_path / "s").entries
    assert entry.key == 1 and entry.arrays["mom"].shape == (2, 3)


@pytest.mark.parametrize("change", [
    {"key": -1}, {"key": 1.5}, {"key": True}, {"key": None}, {"shape": [3, 3]}, {"shape": [-6]},
    {"shape": "2x3"}, {"dtype": "uint16"}, {"dtype": "object"}, {"count": -1}, {"count": 1.0},
    {"states": {"mom": "nope"}}, {"states": ["0/mom"]}, {"shape": None},
])
def test_malformed_state_entries_are_format_errors(tmp_path, change):
    """A bad key, shape, dtype, count, or a missing/mis-sized array raises FormatError."""
    states_file(tmp_path / "s", [{**GOOD_ENTRY, **change}])
    with pytest.raises(FormatError):
        C.read_states(tmp_path / "s")


@pytest.mark.parametrize("top", [{"kind": "arrays"}, {"num_update": -1}, {"num_update": None},
                                 {"optimizer": "sgd"}, {"keys": {"1": GOOD_ENTRY}}])
def test_malformed_states_header_is_a_format_error(tmp_path, top):
    """Another kind, a bad num_update, a non-object optimizer or a non-list keys raises FormatError."""
    states_file(tmp_path / "s", [GOOD_ENTRY], **top)
    with pytest.raises(FormatError):
        C.read_states(tmp_path / "s")


def test_entry_without_fields_and_repeated_keys_are_format_errors(tmp_path):
    """An entry lacking a field, or two entries for one key, raise FormatError."""
    states_file(tmp_path / "s", [{k: v for k, v in GOOD_ENTRY.items() if k != "count"}])
    with pytest.raises(FormatError):
        C.read_states(tmp_path / "s")
    states_file(tmp_path / "s", [GOOD_ENTRY, GOOD_ENTRY])
    with pytest.raises(FormatError, match="more than one"):
        C.read_states(tmp_path / "s")


def test_read_states_refuses_an_arrays_file(tmp_path):
    """read_states on a save_arrays file raises FormatError."""
    C.save_arrays(tmp_path / "f", {"a": np.ones(2)})
    with pytest.raises(FormatError):
        C.read_states(tmp_path / "f")


# -- optimizer_states / restore_optimizer with a real optimizer ---------------------------------------

def train(optimizer, weights: dict, steps: int, seed: int) -> None:
    """Apply ``steps`` deterministic pseudo-random updates to every weight."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        for key, weight in weights.items():
            optimizer.update(key, weight, rng.standard_normal(weight.shape).astype(weight.dtype))


def make_weights() -> dict:
    """Weights under an int key, a big int key and a str key (a float16 one for multi-precision)."""
    rng = np.random.default_rng(0)
    return {0: rng.standard_normal((3, 4)).astype(np.float32), 2**64 - 1: rng.standard_normal(5),
            "0": rng.standard_normal((2, 2)).astype(np.float16)}


OPTIMIZERS = [("sgd", {"momentum": 0.9, "wd": 1e-3, "multi_precision": True}),
              ("adam", {"learning_rate": 0.01, "wd": 1e-4}),
              ("rmsprop", {"centered": True})]


@pytest.mark.parametrize("name,params", OPTIMIZERS)
@pytest.mark.parametrize("dump", [True, False])
def test_save_restore_then_continue_is_bit_identical(tmp_path, name, params, dump):
    """Saving after a few updates and restoring into a fresh optimizer continues bit-identically."""
    original, weights = opt.create(name, **params), make_weights()
    train(original, weights, 3, seed=1)
    C.write_states(tmp_path / "s", C.optimizer_states(original, weights, dump))
    copies = {k: w.copy() for k, w in weights.items()}
    fresh = opt.create(name, **params)
    restored = C.restore_optimizer(C.read_states(tmp_path / "s"), None if dump else fresh, copies)
    assert (restored is not fresh) if dump else (restored is fresh)
    assert restored.spec() == original.spec() and restored.num_update == original.num_update
    assert restored.counts == original.counts
    train(original, weights, 4, seed=2)
    train(restored, copies, 4, seed=2)
    for key in weights:
        assert weights[key].tobytes() == copies[key].tobytes()


def test_optimizer_states_entries(tmp_path):
    """optimizer_states has one entry per key with state, with the weight's shape and dtype."""
    sgd, weights = opt.create("sgd", momentum=0.5), make_weights()
    weights["unused"] = np.zeros(2, np.float32)
    train(sgd, {0: weights[0], "0": weights["0"]}, 2, seed=3)
    states = C.optimizer_states(sgd, weights, dump_optimizer=False)
    assert states.optimizer is None and states.num_update == 2
    assert [(e.key, e.shape, e.dtype, e.count) for e in states.entries] == [
        (0, (3, 4), np.float32, 2), ("0", (2, 2), np.float16, 2)]
    assert C.optimizer_states(sgd, weights, dump_optimizer=True).optimizer == sgd.spec()


def test_optimizer_states_needs_every_weight():
    """A key with state but no weight raises KeyNotInitializedError."""
    sgd, weights = opt.create("sgd", momentum=0.5), make_weights()
    train(sgd, weights, 1, seed=0)
    del weights[0]
    with pytest.raises(KeyNotInitializedError):
        C.optimizer_states(sgd, weights, dump_optimizer=False)


def test_restore_without_spec_replaces_state_and_drops_absent_keys():
    """Restoring into an optimizer replaces its states; keys missing from the file lose theirs."""
    weights = make_weights()
    saved = opt.create("adam")
    train(saved, {0: weights[0]}, 2, seed=4)
    states = C.optimizer_states(saved, weights, dump_optimizer=False)
    target = opt.create("adam")
    train(target, weights, 5, seed=5)
    assert C.restore_optimizer(states, target, weights) is target
    assert set(target.states) == {0} and target.counts == {0: 2} and target.num_update == 2
    np.testing.assert_array_equal(target.states[0]["mean"], saved.states[0]["mean"])


def test_restore_with_spec_leaves_the_given_optimizer_alone():
    """With a dumped spec the result is a new optimizer of that spec; the one given is untouched."""
    weights = make_weights()
    saved = opt.create("sgd", momentum=0.9, learning_rate=0.5)
    train(saved, weights, 2, seed=6)
    states = C.optimizer_states(saved, weights, dump_optimizer=True)
    mine = opt.create("adam")
    train(mine, weights, 1, seed=7)
    before = (mine.spec(), {k: {n: a.copy() for n, a in s.items()} for k, s in mine.states.items()})
    restored = C.restore_optimizer(states, mine, weights)
    assert restored is not mine and restored.spec() == saved.spec()
    assert mine.spec() == before[0] and set(mine.states) == set(before[1])


def snapshot(optimizer) -> tuple:
    """Everything restore_optimizer may change, copied."""
    return ({k: {n: a.copy() for n, a in s.items()} for k, s in optimizer.states.items()},
            dict(optimizer.counts), optimizer.num_update)


def assert_same(optimizer, snap) -> None:
    """``optimizer`` still holds exactly ``snap``."""
    states, counts, num_update = snap
    assert optimizer.counts == counts and optimizer.num_update == num_update
    assert set(optimizer.states) == set(states)
    for key, arrays in states.items():
        assert set(optimizer.states[key]) == set(arrays)
        for name, array in arrays.items():
            assert optimizer.states[key][name].tobytes() == array.tobytes()


@pytest.mark.parametrize("spoil,error", [
    (lambda w: w.pop(0), KeyNotInitializedError),
    (lambda w: w.__setitem__(0, np.zeros((4, 3), np.float32)), ShapeMismatchError),
    (lambda w: w.__setitem__(0, np.zeros((3, 4), np.float64)), DTypeMismatchError),
])
def test_restore_errors_leave_the_optimizer_untouched(spoil, error):
    """A key missing from the weights, or of another shape or dtype, raises and changes nothing."""
    weights = make_weights()
    saved = opt.create("sgd", momentum=0.9)
    train(saved, weights, 2, seed=8)
    states = C.optimizer_states(saved, weights, dump_optimizer=False)
    states.entries.sort(key=lambda e: e.key != 0, reverse=True)  # the spoiled key 0 comes last
    target = opt.create("sgd", momentum=0.9)
    train(target, weights, 3, seed=9)
    snap = snapshot(target)
    spoil(weights)
    with pytest.raises(error):
        C.restore_optimizer(states, target, weights)
    assert_same(target, snap)


def test_restore_state_that_does_not_fit_the_optimizer_changes_nothing():
    """Adam states into an SGD optimizer raise OptimizerError and leave it unchanged."""
    weights = make_weights()
    saved = opt.create("adam")
    train(saved, weights, 2, seed=10)
    states = C.optimizer_states(saved, weights, dump_optimizer=False)
    target = opt.create("sgd", momentum=0.9)
    train(target, weights, 1, seed=11)
    snap = snapshot(target)
    with pytest.raises(OptimizerError):
        C.restore_optimizer(states, target, weights)
    assert_same(target, snap)


def test_restore_needs_an_optimizer_or_a_spec():
    """No spec in the file and no optimizer given raises OptimizerError."""
    with pytest.raises(OptimizerError, match="no optimizer"):
        C.restore_optimizer(C.StatesFile(None, 0, []), None, {})


def test_restore_with_a_bad_spec_raises_optimizer_error():
    """A spec naming an unknown optimizer raises OptimizerError; the given optimizer is unchanged."""
    target = opt.create("sgd")
    with pytest.raises(OptimizerError):
        C.restore_optimizer(C.StatesFile({"name": "nope", "params": {}}, 0, []), target, {})
    assert target.states == {} and target.num_update == 0


def test_a_dynamic_tables_state_entry_keeps_its_row_ids(tmp_path) -> None:
    """An entry with ids (a dynamic table's rows) round-trips them as int64 next to its state rows;
    entries without ids read back with none; ids of another length or dtype are refused both ways."""
    ids = np.array([-3, 7, 2**40], np.int64)
    mom = np.arange(6, dtype=np.float32).reshape(3, 2)
    states = C.StatesFile(None, 4, [C.StateEntry("d", (3, 2), np.float32, 4, {"mom": mom}, ids),
                                    C.StateEntry(1, (2,), np.float32, 4, {"mom": np.ones(2, np.float32)})])
    C.write_states(tmp_path / "s", states)
    back = C.read_states(tmp_path / "s")
    np.testing.assert_array_equal(back.entries[0].ids, ids)
    np.testing.assert_array_equal(back.entries[0].arrays["mom"], mom)
    assert back.entries[1].ids is None
    with pytest.raises(ValueError, match="row ids"):
        C.write_states(tmp_path / "bad", C.StatesFile(None, 4, [C.StateEntry("d", (3, 2), np.float32, 4,
                                                                              {"mom": mom}, ids[:2])]))
    manifest, arrays = C.read(tmp_path / "s")
    manifest["keys"][0]["ids"] = manifest["keys"][1]["states"]["mom"]  # 2 float32, not 3 int64
    C.write(tmp_path / "damaged", manifest, arrays)
    with pytest.raises(FormatError, match="ids"):
        C.read_states(tmp_path / "damaged")


def test_a_chunked_array_is_written_as_it_comes_and_must_fill_its_shape(tmp_path) -> None:
    """A Chunked array's chunks become one .npy member read back as the whole array; chunks that
    hold fewer or more elements than its shape raise ValueError and leave no file."""
    whole = np.arange(24, dtype=np.float32).reshape(6, 4)

    def chunks(parts):
        return lambda: iter(parts)

    streamed = C.Chunked((6, 4), np.dtype(np.float32), chunks([whole[:4], whole[4:]]))
    C.write(tmp_path / "ok", {}, {"t": streamed})
    np.testing.assert_array_equal(C.read(tmp_path / "ok")[1]["t"], whole)
    for parts in ([whole[:4]], [whole, whole[:1]]):
        with pytest.raises(ValueError, match="elements"):
            C.write(tmp_path / "bad", {}, {"t": C.Chunked((6, 4), np.dtype(np.float32), chunks(parts))})
        assert not (tmp_path / "bad").exists()


def test_a_streamed_array_is_left_in_the_file_and_read_a_run_at_a_time(tmp_path) -> None:
    """read(streamed=...) leaves the arrays it names in the file (Stored: shape, dtype, size); their runs
    read back the elements in order, whole or in parts, and runs past the end raise FormatError."""
    whole = np.arange(40, dtype=np.float64).reshape(10, 4)
    C.write(tmp_path / "f", {"kind": "arrays"}, {"t": whole, "small": np.ones(3, np.float32)})
    asked = []

    def streamed(manifest, name, nbytes):
        asked.append((manifest["kind"], name, nbytes))
        return name == "t"

    _, arrays = C.read(tmp_path / "f", streamed)
    assert ("arrays", "t", 320) in asked and isinstance(arrays["small"], np.ndarray)
    stored = arrays["t"]
    assert isinstance(stored, C.Stored) and stored.shape == (10, 4) and stored.size == 40
    parts = list(stored.runs([12, 4, 24]))
    np.testing.assert_array_equal(np.concatenate(parts), whole.reshape(-1))
    np.testing.assert_array_equal(stored.read(), whole)
    assert [p.size for p in C.runs(whole, [8, 32])] == [8, 32]
    with pytest.raises(FormatError, match="40 elements"):
        list(stored.runs([30, 11]))


def test_a_states_file_leaves_the_streamed_keys_state_in_the_file(tmp_path) -> None:
    """read_states(streamed=...) leaves the entries it names (by key and bytes) in the file, a dynamic
    table's ids too, in the file's order; the other entries read whole (ids sorted) as before."""
    ids = np.array([9, -3, 7], np.int64)
    mom = np.arange(6, dtype=np.float32).reshape(3, 2)
    states = C.StatesFile(None, 4, [C.StateEntry("d", (3, 2), np.float32, 4, {"mom": mom}, ids),
                                    C.StateEntry(1, (2,), np.float32, 4, {"mom": np.ones(2, np.float32)})])
    C.write_states(tmp_path / "s", states)
    asked = []
    back = C.read_states(tmp_path / "s", lambda key, nbytes: asked.append((key, nbytes)) or key == "d")
    assert sorted(asked, key=str) == [("d", 24), (1, 8)]
    dynamic, dense = back.entries
    assert isinstance(dynamic.ids, C.Stored) and isinstance(dynamic.arrays["mom"], C.Stored)
    np.testing.assert_array_equal(dynamic.ids.read(), ids)  # the file's order
    np.testing.assert_array_equal(dynamic.arrays["mom"].read(), mom)
    assert isinstance(dense.arrays["mom"], np.ndarray)
    eager = C.read_states(tmp_path / "s").entries[0]
    np.testing.assert_array_equal(eager.ids, np.sort(ids))


def test_a_streamed_load_checks_the_whole_array_before_its_first_run(tmp_path: Path) -> None:
    """A Stored array read a run at a time raises on a damaged member before it yields any run (as the
    whole read does): a damaged file never leaves a table half-loaded on the servers."""
    path = str(tmp_path / "values.kvs")
    array = np.arange(4096, dtype=np.float32)
    C.write(path, {"kind": "x"}, {"a": array, "b": array})
    _, intact = C.read(path, lambda document, name, nbytes: True)
    assert np.array_equal(np.concatenate(list(intact["a"].runs([1024] * 4))), array)
    data = bytearray(Path(path).read_bytes())
    at = data.find(array[4000:4004].tobytes())  # a byte near the end of member a's data
    data[at] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    with pytest.raises(FormatError):
        C.read(path)  # read whole: refused before anything is used
    _, arrays = C.read(path, lambda document, name, nbytes: True)
    got = []
    with pytest.raises(FormatError):
        for run in arrays["a"].runs([1024] * 4):
            got.append(run)  # each run is sent to the servers as it comes
    assert not got, f"{len(got)} runs (of 4) were handed out before the damage was found"
    with pytest.raises(FormatError):
        C.check_stored(arrays["b"], arrays["a"])  # a load's every member, before it sends any
