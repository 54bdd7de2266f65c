"""GPU aggregation for the ``device`` and ``dist_*_device`` modes, with torch.cuda.

A store in a device mode makes one :class:`DeviceComm` the first time it sees a
CUDA tensor (so without CUDA nothing here runs, and torch.cuda is never touched).
It does what MXNet's ``CommDevice`` does:

- **reduce**: the values pushed for one key are summed on one GPU, the key's
  *merge device*, chosen at the key's first reduce as the least-loaded device
  (fewest merge-buffer bytes placed so far) among the devices of the pushed
  tensors; values elsewhere (other GPUs, CPU tensors, numpy) are copied there.
- **to_host**: a sum that must leave the GPU (a dist push) is copied once into
  pinned CPU memory.
- **deliver**: a pulled value is copied to every CUDA ``out``: from the wire it
  is staged once in pinned memory, then one non-blocking copy per ``out`` is
  issued on a side stream of that ``out``'s device (torch runs a copy from
  another GPU on the source GPU's stream, ordered by its own events).  The side
  streams first wait for the work already queued on each device's current
  stream, and the host waits for the copies before returning, so the user's next
  kernel reads finished values.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

from kvstore.core import values as V
from kvstore.core import xp
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
    """A tensor holding ``value`` (numpy arrays are shared where torch can, copied otherwise)."""
    if xp.is_tensor(value):
        return value.detach()
    if not (value.flags.writeable and value.flags.c_contiguous):
        value = np.array(value, copy=True, order="C")
    return _torch().from_numpy(value)


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
        self._streams: dict[Any, Any] = {}  # device -> the side stream for copies to it
        self._lock = threading.Lock()

    # -- reduce -----------------------------------------------------------------------------------
    def reduce(self, key: Key, meta: V.Meta, values: list[Any]) -> Tensor:
        """The sum of ``values`` (checked against ``meta``) as a new tensor on the key's merge device.

        Summed in list order, in the key's dtype, like the CPU path.  Raises the shape
        and dtype errors of :func:`kvstore.core.values.check`.
        """
        for value in values:
            V.check(key, meta, value, "pushed value")
        devices = [v.device for v in values if xp.is_cuda(v)]
        nbytes = meta.size * meta.dtype.itemsize
        device = self.placement.device(key, nbytes, devices)
        total = as_tensor(values[0]).to(device, memory_format=_torch().contiguous_format, copy=True)
        for value in values[1:]:  # non-blocking only from a GPU: a pinned CPU value may change after push
            total += as_tensor(value).to(device, non_blocking=xp.is_cuda(value))
        return total

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
            staged = torch.empty(source.shape, dtype=xp.torch_dtype(source.dtype), pin_memory=True)
            staged.numpy()[...] = source
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
