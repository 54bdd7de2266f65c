"""Gradient compression, pure: MXNet's 2bit and 1bit rules, and fp16 / bf16 casts (docs/compression.md).

Each rule has a quantiser (``residual += grad``, then code each element and update its residual in
place) and a dequantiser, for numpy arrays and torch tensors (any device) alike, vectorised.  The
packed form is MXNet's: 2bit holds 16 values per float32 word, 4 per byte, the first value in the
byte's high bits (``11`` = +t, ``10`` = -t, else 0); 1bit holds 32 per word, 8 per byte, the first
value in the high bit (1 = +1, 0 = -1).  torch is never imported here (``sys.modules``).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import DTypeMismatchError

Array = Any  # np.ndarray or torch.Tensor
QUANTISED = ("2bit", "1bit")  # packed codes, a residual always
CASTS = ("fp16", "bf16")  # half-precision values, a residual with error_feedback
TYPES = QUANTISED + CASTS
FACTOR = {"2bit": 16, "1bit": 32}  # original elements per float32 word on the wire
KNOWN_PARAMS = ("type", "threshold", "error_feedback", "size_lower_bound")
MAX_THRESHOLD = float(np.finfo(np.float32).max)  # a threshold is a float32, as in MXNet


@dataclass(frozen=True)
class Spec:
    """A checked compression setting: its type, threshold (2bit, 1bit), error feedback (fp16, bf16),
    and the element count below which a key travels uncompressed (0: every key is compressed)."""

    type: str
    threshold: float = 0.5
    error_feedback: bool = False
    size_lower_bound: int = 0

    @property
    def residual(self) -> bool:
        """Whether this setting keeps a residual per value."""
        return self.type in QUANTISED or self.error_feedback

    def params(self) -> dict[str, Any]:
        """The setting as ``set_gradient_compression`` takes it (what ``get_gradient_compression`` gives)."""
        out: dict[str, Any] = {"type": self.type}
        if self.type in QUANTISED:
            out["threshold"] = self.threshold
        else:
            out["error_feedback"] = self.error_feedback
        if self.size_lower_bound:
            out["size_lower_bound"] = self.size_lower_bound
        return out

    def wire(self) -> list[Any]:
        """The body field naming this compression on a PUSH: ``[type, threshold]``."""
        return [self.type, float(np.float32(self.threshold))]


def parse(params: Any) -> Spec:
    """Check ``set_gradient_compression``'s argument (MXNet's checks); raise TypeError or ValueError."""
    if not isinstance(params, dict):
        raise TypeError(f"gradient compression takes a dict such as {{'type': '2bit', 'threshold': 0.5}}, "
                        f"not {type(params).__name__}")
    unknown = sorted(str(k) for k in params if k not in KNOWN_PARAMS)
    if unknown:
        raise ValueError(f"unknown gradient compression parameter(s) {unknown}; known: {list(KNOWN_PARAMS)}")
    kind = params.get("type")
    if kind not in TYPES:
        raise ValueError(f"unknown type for gradient compression: {kind!r}; use one of {list(TYPES)}")
    threshold = params.get("threshold", 0.5)
    if not finite_threshold(threshold):
        raise ValueError(f"gradient compression threshold must be a finite float32 number, not {threshold!r}")
    if kind == "2bit" and not threshold > 0:
        raise ValueError(f"threshold must be greater than 0 for two bit compression, not {threshold!r}")
    feedback = params.get("error_feedback", False)
    if not isinstance(feedback, bool) or (feedback and kind in QUANTISED):
        raise ValueError("'error_feedback' is a bool for fp16 and bf16 (2bit and 1bit always keep "
                         "a residual)")
    bound = params.get("size_lower_bound", 0)
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
        raise ValueError(f"'size_lower_bound' must be an int >= 0, not {bound!r}")
    return Spec(kind, float(threshold), feedback, bound)


def finite_threshold(threshold: Any) -> bool:
    """Whether ``threshold`` is a number (not a bool) that is finite as a float32."""
    return (isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
            and math.isfinite(threshold) and abs(threshold) <= MAX_THRESHOLD)


def check_dtype(key: Any, dtype: np.dtype) -> None:
    """Raise DTypeMismatchError unless ``dtype`` is float32 (MXNet compresses float32 only)."""
    if dtype != np.float32:
        raise DTypeMismatchError(f"key {key!r} holds {dtype}; gradient compression works on float32 "
                                 "values only (MXNet's rule): initialise it as float32 or leave it out")


def packed_size(kind: str, n: int) -> int:
    """Elements of the array that carries ``n`` values compressed with ``kind``."""
    return -(-n // FACTOR[kind]) if kind in FACTOR else n


def _torch() -> Any:
    return sys.modules["torch"]


def _is_numpy(a: Array) -> bool:
    return isinstance(a, np.ndarray)


# -- 2bit and 1bit ---------------------------------------------------------------------------------

def quantise(kind: str, grad: Array, residual: Array, threshold: float) -> Array:
    """Add flat float32 ``grad`` into ``residual`` (in place), code it, return the packed float32 words."""
    t = np.float32(threshold)
    residual += grad
    if _is_numpy(residual):
        return _quantise_numpy(kind, residual, t)
    torch, tf = _torch(), float(t)  # exactly t: a float32 value
    if kind == "2bit":
        pos, neg = residual >= tf, residual <= -tf
        residual.copy_(torch.where(pos, residual - tf, torch.where(neg, residual + tf, residual)))
        codes = (pos.to(torch.uint8) * 3) | (neg.to(torch.uint8) * 2)
        return _pack_torch(codes, 2, residual.shape[0], 16)
    up = residual > tf
    residual.copy_(torch.where(up, residual - 1.0, residual + 1.0))
    return _pack_torch(up.to(torch.uint8), 1, residual.shape[0], 32)


def _quantise_numpy(kind: str, residual: np.ndarray, t: np.float32) -> np.ndarray:
    """numpy's half of :func:`quantise`: ``residual`` already holds ``residual + grad``.

    One subtraction updates the residual: ``r - (-t)`` is exactly ``r + t``, ``r - 0`` is ``r``."""
    n = residual.shape[0]
    if kind == "2bit":
        pos, neg = residual >= t, residual <= -t
        step = pos.astype(np.float32)
        step -= neg
        step *= t
        residual -= step
        pairs = (_SPREAD[np.packbits(pos | neg)] << 1) | _SPREAD[np.packbits(pos)]  # hi, lo bits per value
        return _words(pairs.astype(">u2").view(np.uint8), n, 16)
    up = residual > t
    step = up.astype(np.float32)
    step *= 2
    step -= 1
    residual -= step
    return _words(np.packbits(up), n, 32)


def _words(packed: np.ndarray, n: int, per_word: int) -> np.ndarray:
    """Bytes padded with zeros to whole float32 words, viewed as float32."""
    out = np.zeros(-(-n // per_word) * 4, np.uint8)
    out[:packed.size] = packed
    return out.view(np.float32)


def _spread() -> np.ndarray:
    """Each byte's 8 bits moved to the even bit positions of a uint16 (bit j to bit 2j)."""
    byte = np.arange(256, dtype=np.uint16)
    out = np.zeros(256, np.uint16)
    for j in range(8):
        out |= ((byte >> j) & 1) << (2 * j)
    return out


_SPREAD = _spread()


def _pack_torch(codes: Any, width: int, n: int, per_word: int) -> Any:
    """torch: ``width``-bit codes into float32 words, the first code of each byte in its high bits."""
    torch = _torch()
    padded = torch.zeros(-(-n // per_word) * per_word, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    per_byte = 8 // width
    lanes = padded.view(-1, per_byte)
    shifts = torch.arange(8 - width, -1, -width, device=codes.device, dtype=torch.uint8)
    packed = (lanes << shifts).sum(dim=1, dtype=torch.uint8)  # disjoint bits: sum == or
    return packed.view(torch.float32)


@functools.lru_cache(maxsize=64)  # thresholds come from peers too: bounded
def _table(kind: str, threshold: float) -> np.ndarray:
    """Each byte value's decoded values (4 for 2bit, 8 for 1bit), float32."""
    t = np.float32(threshold)
    byte = np.arange(256, dtype=np.uint8)
    if kind == "2bit":
        codes = np.stack([(byte >> s) & 3 for s in (6, 4, 2, 0)], axis=1)
        return np.where(codes == 3, t, np.where(codes == 2, -t, np.float32(0))).astype(np.float32)
    bits = np.unpackbits(byte[:, None], axis=1)
    return np.where(bits == 1, np.float32(1), np.float32(-1)).astype(np.float32)


def dequantise(kind: str, packed: Array, n: int, threshold: float) -> Array:
    """The ``n`` float32 values that ``packed`` (flat float32 words) stands for."""
    table = _table(kind, float(np.float32(threshold)))
    if _is_numpy(packed):  # one gather of whole rows (16 or 32 bytes), far faster than table[bytes]
        rows = table.view(f"V{table.shape[1] * 4}").reshape(-1)
        return np.take(rows, np.ascontiguousarray(packed).view(np.uint8)).view(np.float32)[:n]
    torch = _torch()
    lookup = torch.from_numpy(table).to(packed.device)
    return lookup[packed.contiguous().view(torch.uint8).long()].reshape(-1)[:n]


# -- fp16 and bf16 ---------------------------------------------------------------------------------

def to_half(kind: str, grad: Array, residual: Array | None) -> Array:
    """``grad`` (plus ``residual``, which keeps what the cast lost) as fp16, or bf16 bits as uint16."""
    value = grad
    if residual is not None:
        residual += grad
        value = residual
    if _is_numpy(value):
        with np.errstate(over="ignore"):  # beyond fp16's range: inf, as torch gives
            half = value.astype(np.float16) if kind == "fp16" else _bf16_bits(value)
    else:
        torch = _torch()
        half = value.to(torch.float16) if kind == "fp16" else value.to(torch.bfloat16).view(torch.uint16)
    if residual is not None:
        residual -= from_half(kind, half)
    return half


def _bf16_bits(value: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bits, rounding to nearest even (as torch does); NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(value, np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    out[np.isnan(value)] = 0x7FC0
    return out


def from_half(kind: str, half: Array) -> Array:
    """fp16 values, or bf16 bits (uint16), as float32."""
    if _is_numpy(half):
        if kind == "fp16":
            return half.astype(np.float32)
        bits = np.ascontiguousarray(half).view(np.uint16).astype(np.uint32)
        return (bits << np.uint32(16)).view(np.float32)
    torch = _torch()
    if kind == "fp16":
        return half.to(torch.float32)
    return half.view(torch.bfloat16).to(torch.float32)


def compress(spec: Spec, grad: Array, residual: Array | None) -> Array:
    """The wire array for flat float32 ``grad`` under ``spec``; ``residual`` (same shape) is updated."""
    if spec.type in QUANTISED:
        return quantise(spec.type, grad, residual, spec.threshold)
    return to_half(spec.type, grad, residual if spec.error_feedback else None)


def decompress(kind: str, array: Array, n: int, threshold: float) -> Array:
    """The ``n`` float32 values a wire array of ``kind`` stands for."""
    if kind in QUANTISED:
        return dequantise(kind, array, n, threshold)
    return from_half(kind, array)
