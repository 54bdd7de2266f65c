"""A plain, element-by-element reference of MXNet's 2bit and 1bit rules (docs/compression.md), written
from the rules' text, to check kvstore.core.compression's vectorised code against."""

from __future__ import annotations

import numpy as np

F = np.float32
POS2 = (0xC0, 0x30, 0x0C, 0x03)  # 2bit: code 11 (+t) of value i % 4 of a byte
NEG2 = (0x80, 0x20, 0x08, 0x02)  # 2bit: code 10 (-t)
BIT1 = (0x80, 0x40, 0x20, 0x10, 0x08, 0x04, 0x02, 0x01)


def quantise_2bit(grad: np.ndarray, residual: np.ndarray, t: float) -> bytes:
    """r += g; r >= t: +t, r -= t; r <= -t: -t, r += t; else 0.  16 values per float32 word."""
    t = F(t)
    out = bytearray(-(-len(grad) // 16) * 4)
    for i in range(len(grad)):
        residual[i] = F(residual[i] + grad[i])
        if residual[i] >= t:
            out[i // 4] |= POS2[i % 4]
            residual[i] = F(residual[i] - t)
        elif residual[i] <= -t:
            out[i // 4] |= NEG2[i % 4]
            residual[i] = F(residual[i] + t)
    return bytes(out)


def dequantise_2bit(packed: bytes, n: int, t: float) -> list:
    values = []
    for i in range(n):
        code = (packed[i // 4] >> (6 - 2 * (i % 4))) & 3
        values.append(F(t) if code == 3 else -F(t) if code == 2 else F(0))
    return values


def quantise_1bit(grad: np.ndarray, residual: np.ndarray, t: float) -> bytes:
    """MXNet 1.9: r += g; r > t: 1, r -= 1; else 0, r += 1.  32 values per float32 word."""
    out = bytearray(-(-len(grad) // 32) * 4)
    for i in range(len(grad)):
        residual[i] = F(residual[i] + grad[i])
        if residual[i] > F(t):
            out[i // 8] |= BIT1[i % 8]
            residual[i] = F(residual[i] - F(1))
        else:
            residual[i] = F(residual[i] + F(1))
    return bytes(out)


def dequantise_1bit(packed: bytes, n: int, t: float) -> list:
    return [F(1) if packed[i // 8] & BIT1[i % 8] else F(-1) for i in range(n)]


QUANTISE = {"2bit": quantise_2bit, "1bit": quantise_1bit}
DEQUANTISE = {"2bit": dequantise_2bit, "1bit": dequantise_1bit}


def roundtrip(kind: str, grad: np.ndarray, residual: np.ndarray, t: float) -> np.ndarray:
    """What a server sums for ``grad``: quantised with ``residual`` (updated), then dequantised."""
    packed = QUANTISE[kind](grad, residual, t)
    return np.array(DEQUANTISE[kind](packed, len(grad), t), np.float32)
