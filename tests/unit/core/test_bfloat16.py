"""bfloat16 values in one process: torch tensors as bits, fp32 sums and updates, files, numpy."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore.core import checkpoint, precision
from kvstore.core import optimizer as kvopt
from kvstore.core.dtypes import BF16
from kvstore.errors import DTypeMismatchError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(30)


def _bf16(seed: int, n: int = 64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_narrow_rounds_as_torch_does() -> None:
    x = torch.randn(10000, generator=torch.Generator().manual_seed(0)) * 1e3
    x[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    got = precision.narrow(x.numpy()).view(np.uint16)
    want = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got[1:], want[1:])  # NaN bits differ by torch kernel: NaN stays NaN
    assert np.isnan(precision.widen(got[:1].view(BF16)))[0]


def test_local_sum_is_torch_rounding_of_fp32_sum() -> None:
    kv = kvstore.create("local")
    kv.init("w", torch.zeros(64, dtype=torch.bfloat16))
    a, b = _bf16(1), _bf16(2)
    kv.push("w", [a, b])
    got = kv.pull("w")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (a.float() + b.float()).to(torch.bfloat16))


def test_local_sgd_updates_an_fp32_master_copy() -> None:
    kv = kvstore.create("local")
    kv.set_optimizer(kvopt.create("sgd", learning_rate=0.01))
    w0 = _bf16(3)
    kv.init(0, w0)
    master = w0.float()
    for step in range(5):
        g = _bf16(10 + step)
        kv.push(0, g)
        master -= 0.01 * g.float()
    assert torch.equal(kv.pull(0), master.to(torch.bfloat16))


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    values = {"w": precision.narrow(np.linspace(-3, 3, 7, dtype=np.float32))}
    checkpoint.save_arrays(tmp_path / "f", values)
    back = checkpoint.load_arrays(tmp_path / "f")["w"]
    assert back.dtype == BF16 and np.array_equal(back.view(np.uint16), values["w"].view(np.uint16))


def test_numpy_users_get_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    kv = kvstore.create("local")
    kv.init("n", np.ones(3, ml_dtypes.bfloat16))
    kv.push("n", [np.full(3, 1.5, ml_dtypes.bfloat16), np.full(3, 0.25, ml_dtypes.bfloat16)])
    got = kv.pull("n")
    assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got.astype(np.float32), [1.75] * 3)
    out = np.zeros(3, ml_dtypes.bfloat16)
    kv.pull("n", out=out)
    assert np.array_equal(out.astype(np.float32), [1.75] * 3)


def test_without_ml_dtypes_the_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now raises ImportError
    with pytest.raises(DTypeMismatchError, match="ml_dtypes"):
        precision.for_user(precision.narrow(np.ones(2, np.float32)))
    kv = kvstore.create("local")  # torch users need no ml_dtypes
    kv.init("t", _bf16(5))
    assert kv.pull("t").dtype == torch.bfloat16


def test_local_states_file_records_bfloat16_and_reloads(tmp_path: Path) -> None:
    """A local store's adam states of a bfloat16 key are saved as a bfloat16 entry and restored."""
    kv = kvstore.create("local")
    kv.set_optimizer(kvopt.create("adam", learning_rate=0.01))
    kv.init("w", _bf16(1))
    kv.push("w", _bf16(2))
    kv.save_optimizer_states(str(tmp_path / "s"))
    (entry,) = checkpoint.read_states(tmp_path / "s").entries
    assert entry.dtype == BF16 and {a.dtype for a in entry.arrays.values()} == {np.dtype(np.float32)}
    kv.push("w", _bf16(3))
    kv.load_optimizer_states(str(tmp_path / "s"))  # the moments go back to the saved ones
    kv.save_optimizer_states(str(tmp_path / "again"))
    (back,) = checkpoint.read_states(tmp_path / "again").entries
    assert back.dtype == BF16 and back.count == entry.count
    for name, array in entry.arrays.items():
        np.testing.assert_array_equal(back.arrays[name], array)
    kv.push("w", _bf16(4))  # and updates go on from them


def test_local_states_refuse_a_float32_key(tmp_path: Path) -> None:
    """A bfloat16 entry does not load into a float32 key of the same shape: the dtype is named."""
    kv = kvstore.create("local")
    kv.set_optimizer(kvopt.create("sgd", learning_rate=0.1, momentum=0.9))
    kv.init("w", _bf16(1))
    kv.push("w", _bf16(2))
    kv.save_optimizer_states(str(tmp_path / "s"))
    other = kvstore.create("local")
    other.set_optimizer(kvopt.create("sgd", learning_rate=0.1, momentum=0.9))
    other.init("w", np.zeros(64, np.float32))
    with pytest.raises(DTypeMismatchError, match="bfloat16"):
        other.load_optimizer_states(str(tmp_path / "s"))


def test_trainer_updates_bf16_parameters_through_fp32_masters(tmp_path: Path) -> None:
    """update_on_kvstore=False: bfloat16 weights step through a float32 copy, and the Trainer's
    states (file and state dict) hold them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    master = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    trainer = kvstore.Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.001},
                              kvstore=kvstore.create("local"), update_on_kvstore=False)
    x = torch.randn(5, 4).to(torch.bfloat16)
    for _ in range(3):
        model.zero_grad()
        model(x).sum().backward()
        for n, p in model.named_parameters():
            master[n] -= 0.001 * p.grad.float()
        trainer.step(1)
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), master[n].to(torch.bfloat16)), n
    trainer.save_states(str(tmp_path / "t"))
    entries = checkpoint.read_states(tmp_path / "t").entries
    assert {e.dtype for e in entries} == {BF16} and all("weight32" in e.arrays for e in entries)
    trainer.load_states(str(tmp_path / "t"))
    state = trainer.state_dict()
    assert {e["dtype"] for e in state["states"].values()} == {"bfloat16"}
    trainer.load_state_dict(state)
