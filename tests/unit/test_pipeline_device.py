"""A pipeline stage's device (kvstore.pipeline.device): the default from the launcher's variables, the
per-stage choice, and the CPU path of the Mover (sent at once, as host arrays)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import ConfigError  # noqa: E402
from kvstore.pipeline.device import Mover, default_device, stage_device  # noqa: E402


@pytest.mark.parametrize("environ,count,expected", [
    ({}, 2, "cpu"),  # not started with GPUs
    ({"LOCAL_RANK": "1"}, 0, "cpu"),  # no CUDA
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, 2, "cuda:0"),  # launch.py --gpus-per-worker
    ({"LOCAL_RANK": "1"}, 4, "cuda:1"),  # torchrun: every GPU visible
    ({"LOCAL_RANK": "5"}, 4, "cpu"),  # more workers than GPUs
])
def test_the_default_device_follows_the_launcher(environ, count, expected) -> None:
    """CPU unless the launcher gave the worker GPUs: then its first visible one, or cuda:LOCAL_RANK."""
    assert default_device(environ, count) == expected


def test_a_device_per_stage_and_bad_devices() -> None:
    """A sequence gives each stage its device; a stage it misses, an unknown device, or CUDA where there
    is none is a ConfigError."""
    assert stage_device(["cpu", "cpu"], 1) == torch.device("cpu")
    with pytest.raises(ConfigError, match="no device for stage 2"):
        stage_device(["cpu", "cpu"], 2)
    with pytest.raises(ConfigError, match="not a torch device"):
        stage_device("gpu-please", 0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            stage_device("cuda:0", 0)


def test_a_cpu_mover_sends_at_once_and_receives_as_is() -> None:
    """On the CPU, post sends host arrays of the tensors at once (nothing pending) and arrive returns
    tensors of the arrays."""
    sent = []
    mover = Mover(torch.device("cpu"), lambda *args: sent.append(args), 1.0, "stage 0")
    t = torch.arange(6.0, requires_grad=True).reshape(2, 3)
    mover.post(1, "op", {"mb": 0}, [t * 2])
    assert not mover.pending and len(sent) == 1
    (peer, op, body, arrays), = sent
    np.testing.assert_array_equal(arrays[0], (t * 2).detach().numpy())
    got = mover.arrive([np.ones((2, 2))])
    assert isinstance(got[0], torch.Tensor) and got[0].sum() == 4
