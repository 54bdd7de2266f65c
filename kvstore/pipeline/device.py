"""A stage's device: where its layers live, and how its boundary tensors leave and arrive.

The wire carries host arrays whatever the devices (a CPU stage and a CUDA stage can be neighbours).
On a CUDA stage, :class:`Mover` copies an output to pinned host memory on a side stream, after the
compute stream has produced it, and sends it once the copy is done; the copy overlaps the stage's next
compute, and what waits is sent before the stage blocks on a receive (so no peer waits for a message
held here).  An arriving array is staged in pinned memory and copied to the device on the side
stream; the compute stream waits for that copy, the CPU does not.  docs/pipeline.md, "GPUs".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvstore import config
from kvstore.errors import ConfigError, DeadlineExceededError

TICK = 0.0005  # seconds between polls of a copy's event while a deadline runs


def default_device(environ: Mapping[str, str] | None = None, cuda_devices: int | None = None) -> str:
    """The device a stage runs on when none is given: the CPU, unless CUDA is available and the
    launcher gave this worker GPUs (``LOCAL_RANK`` set): then its first visible GPU (``cuda:0``) when
    ``CUDA_VISIBLE_DEVICES`` narrows what it sees (``launch.py --gpus-per-worker``), else
    ``cuda:LOCAL_RANK`` (torchrun's workers see every GPU of the host).  ``environ``: the process's by
    default (read through :func:`kvstore.config.gpu_placement`)."""
    import torch

    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    local, visible = config.gpu_placement(environ)
    if count == 0 or not local.isdigit():
        return "cpu"
    if visible:
        return "cuda:0"
    return f"cuda:{int(local)}" if int(local) < count else "cpu"


def stage_device(device: Any, stage: int) -> Any:
    """This stage's ``torch.device`` from a Pipeline's ``device``: None (:func:`default_device`), one
    device, or a sequence with one per stage.  Raises ConfigError for a device torch does not know or
    CUDA absent."""
    import torch

    if isinstance(device, Sequence) and not isinstance(device, str):
        if stage >= len(device):
            raise ConfigError(f"device {list(device)} names no device for stage {stage}")
        device = device[stage]
    try:
        chosen = torch.device(default_device() if device is None else device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a torch device: {exc}") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"stage {stage} was given device {chosen} and CUDA is not available here")
    if chosen.type not in ("cpu", "cuda"):
        raise ConfigError(f"a pipeline stage runs on the CPU or a CUDA device, not {chosen}")
    return chosen


class Mover:
    """Moves one stage's boundary tensors between its ``device`` (a ``torch.device``) and the host;
    ``send(peer, op, body, arrays)`` is the link's.  Every wait for a copy has the link's ``timeout``."""

    def __init__(self, device: Any, send: Callable[[int, Any, dict, list[np.ndarray]], None],
                 timeout: float, me: str) -> None:
        import torch

        self.device, self.send_now, self.timeout, self.me = device, send, timeout, me
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending: list[tuple[Any, int, Any, dict, list[Any]]] = []  # event, peer, op, body, host copies

    def post(self, peer: int, op: Any, body: dict, tensors: list[Any]) -> None:
        """Send ``tensors`` (detached) to ``peer``: at once from the CPU; from a GPU once their copy to
        pinned host memory, started here on the side stream, is done (:meth:`flush`)."""
        import torch

        if not self.cuda or all(t.device.type == "cpu" for t in tensors):
            self.send_now(peer, op, body, [t.detach().contiguous().cpu().numpy() for t in tensors])
            return
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(current)  # the tensors are computed on the compute stream
            host = []
            for t in tensors:
                t = t.detach()
                if t.device.type != "cuda":  # a CPU element of a GPU stage's tuple
                    host.append(t.contiguous())
                    continue
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # its memory is not reused before the copy is done
                host.append(buf)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending.append((event, peer, op, body, host))
        self.flush(wait=False)

    def flush(self, wait: bool) -> None:
        """Send what is copied (in posting order); with ``wait``, everything, waiting for the copies.
        Raises DeadlineExceededError when a copy takes longer than the timeout."""
        while self.pending:
            event, peer, op, body, host = self.pending[0]
            if not event.query():
                if not wait:
                    return
                self._wait(event, body)
            self.pending.pop(0)
            self.send_now(peer, op, body, [h.numpy() for h in host])

    def _wait(self, event: Any, body: dict) -> None:
        deadline = time.monotonic() + self.timeout
        while not event.query():
            if time.monotonic() > deadline:
                raise DeadlineExceededError(f"{self.me} waited {self.timeout:g} s for the copy of "
                                            f"micro-batch {body.get('mb')}'s tensors to the host "
                                            "(KVSTORE_REQUEST_TIMEOUT)")
            time.sleep(TICK)

    def arrive(self, arrays: list[np.ndarray]) -> list[Any]:
        """Received host ``arrays`` as tensors on the device: on the CPU as they are (read-only frames);
        on a GPU staged in pinned memory and copied on the side stream, the compute stream waiting."""
        import warnings

        import torch

        with warnings.catch_warnings():  # a read-only frame: autograd never writes to its input
            warnings.simplefilter("ignore", UserWarning)
            host = [torch.from_numpy(a) for a in arrays]
        if not self.cuda:
            return host
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = []
            for h in host:
                pinned = torch.empty(h.shape, dtype=h.dtype, pin_memory=True)
                pinned.copy_(h)
                out.append(pinned.to(self.device, non_blocking=True))  # the caching host allocator
                # keeps the pinned block until this copy is done
            event = torch.cuda.Event()
            event.record(self.stream)
        current.wait_event(event)
        for t in out:
            t.record_stream(current)  # made on the side stream, used on the compute stream
        return out

    def place(self, value: Any) -> Any:
        """A tensor (or a tuple's tensors) of the caller's, on the device (x's slices, y's)."""
        import torch

        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=False) if value.device != self.device else value
        return type(value)(self.place(v) for v in value)
