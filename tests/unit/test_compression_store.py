"""Gradient compression in the in-process stores: 'device' quantises each value of a push with its own
residual and sums the dequantised values (MXNet's CommDevice), element for element as the reference;
'local' raises as MXNet does; the setting is refused after the first push and for non-float32 keys."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore
from kvstore.errors import ConfigError, DTypeMismatchError, UnsupportedError
from tests import compression_ref as ref

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("kind,threshold", [("2bit", 0.5), ("1bit", 0.0)])
def test_device_matches_the_reference_with_two_values_per_push(kind: str, threshold: float) -> None:
    kv = kvstore.create("device")
    kv.set_gradient_compression({"type": kind, "threshold": threshold})
    n, rng = 50, np.random.default_rng(1)
    kv.init("w", np.zeros(n, np.float32))
    residuals = [np.zeros(n, np.float32), np.zeros(n, np.float32)]
    for step in range(4):
        a, b = (rng.standard_normal((2, n)) * 0.6).astype(np.float32)
        kv.push("w", [a, torch.from_numpy(b.copy())])
        want = (ref.roundtrip(kind, a, residuals[0], threshold)
                + ref.roundtrip(kind, b, residuals[1], threshold))
        assert kv.pull("w").tobytes() == want.tobytes(), f"step {step}"
    assert kv.get_gradient_compression() == {"type": kind, "threshold": threshold}


def test_device_fp16_pushes_in_half_precision() -> None:
    kv = kvstore.create("device")
    kv.set_gradient_compression({"type": "fp16"})
    kv.init(1, np.zeros(3, np.float32))
    kv.push(1, np.array([1 / 3, 70000.0, 1e-8], np.float32))
    np.testing.assert_array_equal(kv.pull(1), np.array([1 / 3, np.inf, 1e-8], np.float16).astype(np.float32))


def test_local_raises_as_mxnet_does() -> None:
    kv = kvstore.create("local")
    with pytest.raises(UnsupportedError, match="not supported for a local store"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    assert kv.get_gradient_compression() is None


def test_refused_after_the_first_push_and_for_other_dtypes() -> None:
    kv = kvstore.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 1.0})
    kv.set_gradient_compression({"type": "1bit"})  # may be changed until the first push
    kv.init(["f64", "f32"], [np.zeros(2), np.zeros(2, np.float32)])
    with pytest.raises(DTypeMismatchError, match="float32 values only"):
        kv.push("f64", np.ones(2))
    kv.push("f32", np.ones(2, np.float32))
    with pytest.raises(ConfigError, match="before the first push"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    assert kv.get_gradient_compression() == {"type": "1bit", "threshold": 0.5}
    with pytest.raises(ValueError, match="greater than 0"):
        kvstore.create("device").set_gradient_compression({"type": "2bit", "threshold": 0})


def test_trainer_takes_gluons_compression_params() -> None:
    """Trainer(..., compression_params=...) sets the store's compression before its first push."""
    w = torch.nn.Parameter(torch.zeros(4))
    kv = kvstore.create("device")
    trainer = kvstore.Trainer([w], "sgd", {"learning_rate": 1.0}, kvstore=kv,
                              compression_params={"type": "2bit", "threshold": 0.5})
    w.grad = torch.tensor([0.7, -0.7, 0.2, 0.0])
    trainer.step(1)
    assert kv.get_gradient_compression() == {"type": "2bit", "threshold": 0.5}
    np.testing.assert_allclose(w.detach().numpy(), [-0.5, 0.5, 0.0, 0.0])


def test_keys_below_size_lower_bound_travel_uncompressed() -> None:
    kv = kvstore.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5, "size_lower_bound": 10})
    kv.init(["small", "big"], [np.zeros(9, np.float32), np.zeros(10, np.float32)])
    kv.push(["small", "big"], [np.full(9, 0.3, np.float32), np.full(10, 0.3, np.float32)])
    np.testing.assert_array_equal(kv.pull("small"), np.full(9, 0.3, np.float32))
    np.testing.assert_array_equal(kv.pull("big"), np.zeros(10, np.float32))
    assert kv.get_gradient_compression()["size_lower_bound"] == 10
