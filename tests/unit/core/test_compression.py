"""kvstore.core.compression against the plain reference (tests/compression_ref.py), numpy and torch,
element for element and bit for bit; the parameter checks; the fp16 / bf16 casts."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import compression as C
from kvstore.errors import DTypeMismatchError
from tests import compression_ref as ref

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(30)


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    grad = rng.standard_normal(n).astype(np.float32)
    grad[:3] = [0.5, -0.5, 0.0][: min(3, n)]  # exactly at the threshold
    return grad, (rng.standard_normal(n) * 0.3).astype(np.float32)


@pytest.mark.parametrize("kind,threshold", [("2bit", 0.5), ("2bit", 1.25), ("1bit", 0.0), ("1bit", 0.3)])
@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 31, 32, 33, 100, 1000])
def test_quantise_matches_the_reference_bit_for_bit(kind: str, threshold: float, n: int) -> None:
    """Packed words, updated residuals and dequantised values equal the reference's, three steps in a row,
    for numpy arrays and torch tensors alike."""
    grad, residual = _data(n, n)
    want_r, np_r, t_r = residual.copy(), residual.copy(), torch.from_numpy(residual.copy())
    for step in range(3):
        g = grad * (step + 1)
        want = ref.QUANTISE[kind](g, want_r, threshold)
        got = C.quantise(kind, g, np_r, threshold)
        got_t = C.quantise(kind, torch.from_numpy(g), t_r, threshold)
        assert got.dtype == np.float32 and got.size == C.packed_size(kind, n)
        assert got.tobytes() == want == got_t.numpy().tobytes()
        assert np_r.tobytes() == want_r.tobytes() == t_r.numpy().tobytes()
        plain = np.array(ref.DEQUANTISE[kind](want, n, threshold), np.float32)
        assert C.dequantise(kind, got, n, threshold).tobytes() == plain.tobytes()
        assert C.dequantise(kind, got_t, n, threshold).numpy().tobytes() == plain.tobytes()


def test_2bit_layout_is_mxnets() -> None:
    """The first value sits in the high bits of the first byte; 16 values per float32 word."""
    grad = np.array([1.0, -1.0, 0.0, 1.0] + [0.0] * 12 + [-1.0], np.float32)
    packed = C.quantise("2bit", grad, np.zeros(17, np.float32), 0.5)
    assert packed.size == 2
    assert list(packed.view(np.uint8)) == [0b11100011, 0, 0, 0, 0b10000000, 0, 0, 0]


def test_1bit_layout_is_mxnets() -> None:
    grad = np.array([1.0, -1.0, 1.0] + [-1.0] * 30, np.float32)
    packed = C.quantise("1bit", grad, np.zeros(33, np.float32), 0.0)
    assert list(packed.view(np.uint8)) == [0b10100000, 0, 0, 0, 0, 0, 0, 0]
    assert C.dequantise("1bit", packed, 33, 0.0).tolist() == grad.tolist()


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_half_casts_with_error_feedback(kind: str) -> None:
    """fp16 and bf16 round to nearest (torch's rounding, numpy too); error feedback keeps what was lost."""
    grad, _ = _data(1000, 3)
    grad[:4] = [np.nan, np.inf, -np.inf, 1e-40]
    half = C.to_half(kind, grad, None)
    torch_half = torch.from_numpy(grad).to(torch.float16 if kind == "fp16" else torch.bfloat16)
    np.testing.assert_array_equal(C.from_half(kind, half), torch_half.float().numpy())  # NaN as NaN
    residual = np.zeros(1000, np.float32)
    g = grad[4:].copy()
    r = residual[4:]
    sent = C.from_half(kind, C.to_half(kind, g, r))
    np.testing.assert_array_equal(sent + r, g)  # exact here: what was lost is kept


def test_parse_checks_like_mxnet() -> None:
    assert C.parse({"type": "2bit"}).threshold == 0.5
    assert C.parse({"type": "1bit", "threshold": 0}).params() == {"type": "1bit", "threshold": 0.0}
    assert C.parse({"type": "fp16", "error_feedback": True}).residual
    for bad, error in [("2bit", TypeError), ({"type": "3bit"}, ValueError),
                       ({"type": "2bit", "threshold": 0}, ValueError),
                       ({"type": "2bit", "threshold": -1}, ValueError),
                       ({"type": "2bit", "threshold": float("nan")}, ValueError),
                       ({"type": "1bit", "threshold": 1e39}, ValueError),
                       ({"type": "1bit", "threshold": True}, ValueError),
                       ({"type": "2bit", "thresold": 1}, ValueError),
                       ({"type": "2bit", "error_feedback": True}, ValueError),
                       ({"type": "fp16", "size_lower_bound": -1}, ValueError)]:
        with pytest.raises(error):
            C.parse(bad)
    with pytest.raises(DTypeMismatchError, match="float32 values only"):
        C.check_dtype("w", np.dtype(np.float64))
