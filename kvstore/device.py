"""GPU aggregation for the ``device`` and ``dist_*_device`` modes, with torch.cuda.

A store in a device mode makes one :class:`DeviceComm` the first time it sees a
CUDA tensor (so without CUDA nothing here runs, and torch.cuda is never touched).
It does what MXNet's ``CommDevice`` does:

- **reduce**: the values pushed for one key are summed on one GPU, the key's
  *merge device*, chosen at the key's first reduce as the least-loaded device
  (fewest merge-buffer bytes placed so far) among the devices of the pushed
  tensors, by ONE reduction call (:func:`choose_reduction`): one contiguous
  tensor per GPU goes to ``torch.cuda.comm.reduce_add`` (one NCCL reduce, as
  ``torch.nn.DataParallel`` sums its gradients); anything else (replicas on one
  GPU, CPU tensors, numpy) is copied into the rows of one buffer on the merge
  device and summed over the rows by one ``sum`` (:func:`stacked_sum`).
- **to_host**: a sum that must leave the GPU (a dist push) is copied once into
  pinned CPU memory.
- **deliver**: a pulled value is copied to every CUDA ``out``: from the wire it
  is staged once in pinned memory, then one non-blocking copy per ``out`` is
  issued on a side stream of that ``out``'s device (torch runs a copy from
  another GPU on the source GPU's stream, ordered by its own events).  The side
  streams first wait for the work already queued on each device's current
  stream, and the host waits for the copies before returning, so the user's next
  kernel reads finished values.  (``torch.cuda.comm.broadcast`` is not used: it
  takes NCCL only when no ``out`` shares the source's GPU, and otherwise issues
  the same copies on the current streams, without the side streams.)
"""

from __future__ import annotations

import enum
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.core import precision, xp
from kvstore.core import values as V
from kvstore.core.partition import Key

Tensor = Any  # torch.Tensor; torch is imported by the user before anything here runs


def _torch() -> Any:
    return sys.modules["torch"]


def settle(values: list[Any]) -> None:
    """Wait for the work queued on the current stream of each CUDA device among ``values``."""
    devices = {v.device for v in values if xp.is_cuda(v)}
    for device in devices:
        _torch().cuda.current_stream(device).synchronize()


def as_tensor(value: Any) -> Tensor:
    """A tensor holding ``value`` (numpy arrays are shared where torch can, copied otherwise; a
    bfloat16 array, kvstore's or ml_dtypes', becomes a bfloat16 tensor)."""
    if xp.is_tensor(value):
        return value.detach()
    if not (value.flags.writeable and value.flags.c_contiguous):
        value = np.array(value, copy=True, order="C")
    if value.dtype.kind == "V" and precision.is_bf16(value.dtype):
        return precision.to_tensor(value)
    return _torch().from_numpy(value)


class Reduction(enum.Enum):
    """How :meth:`DeviceComm.reduce` sums one key's values (:func:`choose_reduction` picks it)."""

    COPY = "copy"  # one value: copied to the merge device
    REDUCE_ADD = "reduce_add"  # one contiguous CUDA tensor per GPU: torch.cuda.comm.reduce_add (NCCL)
    STACKED_SUM = "stacked_sum"  # anything else: copied into one buffer's rows, one sum over the rows


def choose_reduction(devices: Sequence[Any], contiguous: bool, nccl: bool) -> Reduction:
    """The reduction for values on ``devices`` (each value's ``torch.device``; None for numpy).

    ``contiguous``: every value is a contiguous tensor; ``nccl``: torch was built with NCCL.
    REDUCE_ADD exactly where ``torch.cuda.comm.reduce_add`` makes one NCCL reduce (every value a
    contiguous CUDA tensor, no two on one GPU; else it falls back to a loop of additions).  Pure:
    ``torch.device('cuda', i)`` objects exist without CUDA, so it is tested anywhere.
    """
    if len(devices) == 1:
        return Reduction.COPY
    cuda = [d.index for d in devices if d is not None and d.type == "cuda"]
    if nccl and contiguous and len(cuda) == len(devices) and len(set(cuda)) == len(cuda):
        return Reduction.REDUCE_ADD
    return Reduction.STACKED_SUM


def stacked_sum(values: Sequence[Any], shape: tuple[int, ...], dtype: Any, device: Any) -> Tensor:
    """The sum of ``values`` (numpy, or tensors on any device; checked) as a new tensor on ``device``.

    Each value is copied once into a row of one ``(len(values), *shape)`` buffer of torch dtype
    ``dtype`` on ``device`` (non-blocking only from a GPU: a pinned CPU value may change after the
    push), then ONE ``sum`` over the rows, in ``dtype``, makes the total: one kernel reads each value
    once, where a loop of additions launches one kernel per value and copies each remote value to a
    temporary first.  Integers sum exactly (wrapping, in ``dtype``), float32 and float64 in their
    dtype: torch's CUDA kernel keeps four accumulators per output, so up to four values are added in
    list order and more are paired otherwise (within rounding of the loop); float16 and bfloat16
    accumulate in float32 and round once, as the CPU path sums bfloat16.
    """
    rows = _torch().empty((len(values), *shape), dtype=dtype, device=device)
    for row, value in zip(rows, values):
        row.copy_(as_tensor(value), non_blocking=xp.is_cuda(value))
    return rows.sum(0, dtype=dtype)


class MergePlacement:
    """Which GPU holds each key's merge buffer: the least-loaded of the pushing devices, fixed per key.

    Pure bookkeeping (thread-safe); it never touches CUDA, so it is unit-tested anywhere.
    """

    def __init__(self) -> None:
        self._merge: dict[Key, Any] = {}  # key -> torch.device of its merge buffer
        self._load: dict[Any, int] = {}  # device -> bytes of merge buffers placed on it
        self._lock = threading.Lock()

    def device(self, key: Key, nbytes: int, devices: list[Any]) -> Any:
        """The key's merge device: at its first call the device of ``devices`` with the fewest bytes
        placed so far (the lowest index on a tie), charged ``nbytes``; the same device afterwards."""
        with self._lock:
            device = self._merge.get(key)
            if device is None:
                candidates = sorted(set(devices), key=lambda d: d.index or 0)
                device = min(candidates, key=lambda d: self._load.get(d, 0))
                self._merge[key] = device
                self._load[device] = self._load.get(device, 0) + nbytes
            return device

    def loads(self) -> dict[str, int]:
        """Bytes of merge buffers placed on each device, by device name."""
        with self._lock:
            return {str(d): n for d, n in self._load.items()}


class DeviceComm:
    """GPU reduction and pinned-memory staging for one store."""

    def __init__(self) -> None:
        torch = _torch()
        if not torch.cuda.is_available():  # a CUDA tensor exists, so this is a broken set-up
            raise RuntimeError("a CUDA tensor was given but torch.cuda is not available")
        self.placement = MergePlacement()
        self._nccl: bool | None = None  # whether torch has NCCL; asked at the first multi-GPU reduce
        self._streams: dict[Any, Any] = {}  # device -> the side stream for copies to it
        self._lock = threading.Lock()

    # -- reduce -----------------------------------------------------------------------------------
    def reduce(self, key: Key, meta: V.Meta, values: list[Any]) -> Tensor:
        """The sum of ``values`` (checked against ``meta``) as a new tensor on the key's merge device,
        by one reduction call (:func:`choose_reduction`), in the key's dtype.

        Raises the shape and dtype errors of :func:`kvstore.core.values.check`.
        """
        for value in values:
            V.check(key, meta, value, "pushed value")
        devices = [v.device for v in values if xp.is_cuda(v)]
        nbytes = meta.size * meta.dtype.itemsize
        device = self.placement.device(key, nbytes, devices)
        torch = _torch()
        places = [v.device if xp.is_tensor(v) else None for v in values]
        contiguous = all(xp.is_tensor(v) and v.is_contiguous() for v in values)
        how = choose_reduction(places, contiguous, len(set(devices)) > 1 and self._has_nccl())
        if how is Reduction.COPY:
            return as_tensor(values[0]).to(device, memory_format=torch.contiguous_format, copy=True)
        if how is Reduction.REDUCE_ADD:
            from torch.cuda import comm  # not loaded by ``import torch``

            return comm.reduce_add([v.detach() for v in values], destination=device.index)
        return stacked_sum(values, meta.shape, xp.torch_dtype(meta.dtype), device)

    def _has_nccl(self) -> bool:
        """Whether torch was built with NCCL, asked once (``nccl.is_available`` of no tensors, which
        warns on a build without it; the stacked sum serves there)."""
        if self._nccl is None:
            from torch.cuda import nccl

            self._nccl = bool(nccl.is_available([]))
        return self._nccl

    # -- host staging -----------------------------------------------------------------------------
    def to_host(self, tensor: Tensor) -> np.ndarray:
        """``tensor`` (on a GPU) copied once into pinned CPU memory; returns a numpy view of it."""
        torch = _torch()
        pinned = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)
        pinned.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        return pinned.numpy()

    def _stream(self, device: Any) -> Any:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = _torch().cuda.Stream(device=device)
            return stream

    def deliver(self, source: Any, outs: list[Any]) -> None:
        """Copy ``source`` (numpy, or a tensor on any device) into every ``out``, CUDA ones on streams.

        Returns once every copy has finished.
        """
        torch = _torch()
        cuda = [o for o in outs if xp.is_cuda(o)]
        host = [o for o in outs if not xp.is_cuda(o)]
        if host:
            array = source if isinstance(source, np.ndarray) else xp.to_numpy(source)
            for out in host:
                V.write(out, array)
        if not cuda:
            return
        if isinstance(source, np.ndarray):  # from the wire: stage once in pinned memory
            staged = torch.empty(source.shape, dtype=xp.torch_dtype(xp.dtype_of(source)), pin_memory=True)
            xp.numpy_view(staged)[...] = xp.numpy_view(source)  # bfloat16 through its bits
            source = staged
        by_device: dict[Any, list[Any]] = {}
        for out in cuda:
            by_device.setdefault(out.device, []).append(out)
        waits = set(by_device) | ({source.device} if source.device.type == "cuda" else set())
        used = []
        with torch.no_grad():  # an out may be a parameter that requires grad
            for device, group in by_device.items():
                stream = self._stream(device)
                for other in waits:  # what is queued on out's and source's devices comes first
                    stream.wait_stream(torch.cuda.current_stream(other))
                with torch.cuda.stream(stream):
                    for out in group:
                        out.copy_(source.reshape(out.shape), non_blocking=True)
                used.append(stream)
        for stream in used:
            stream.synchronize()
