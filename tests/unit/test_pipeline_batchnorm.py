"""DeferredBatchNorm (kvstore.pipeline.batchnorm): conversion; one running-statistics update per commit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import ConfigError  # noqa: E402
from kvstore.pipeline import batchnorm  # noqa: E402

pytestmark = pytest.mark.timeout(20)


def test_convert_replaces_nested_batch_norms_keeping_dtype_and_values() -> None:
    """Every batch norm, nested ones included, becomes a DeferredBatchNorm with the same dtype and state."""
    inner = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(3), inner).double()
    model[0].running_mean.fill_(0.5)
    converted = batchnorm.convert(model)
    found = batchnorm.deferred_in(converted)
    assert len(found) == 2 and converted[0] in found and converted[1][1] in found
    assert converted[0].weight.dtype == torch.float64 and float(converted[0].running_mean[0]) == 0.5
    with pytest.raises(ConfigError, match="track_running_stats"):
        batchnorm.convert(torch.nn.BatchNorm1d(3, track_running_stats=False))


def test_convert_replaces_every_kind_of_batch_norm() -> None:
    """Any batch norm with running statistics is replaced, a class built on torch's batch norm base
    itself (apex's SyncBatchNorm is one) included, as before DeferredBatchNorm became a BatchNorm1d."""
    from torch.nn.modules.batchnorm import _BatchNorm

    class OwnBatchNorm(_BatchNorm):
        def _check_input_dim(self, x) -> None:
            pass

    model = torch.nn.Sequential(torch.nn.BatchNorm2d(3), OwnBatchNorm(3), torch.nn.SyncBatchNorm(3))
    converted = batchnorm.convert(model)
    assert len(batchnorm.deferred_in(converted)) == 3


def test_commit_updates_once_from_every_counted_micro_batch() -> None:
    """Two micro-batches (one forwarded twice, as a recomputation) then commit: plain batch norm's
    update over their concatenation; a dropped commit changes nothing."""
    torch.manual_seed(0)
    x = torch.randn(10, 3, dtype=torch.float64)
    plain = torch.nn.BatchNorm1d(3).double()
    plain(x)
    norm = batchnorm.convert(torch.nn.BatchNorm1d(3).double())
    for mb, part in ((0, x[:6]), (1, x[6:]), (1, x[6:])):
        norm.begin(mb)
        out = norm(part)
        torch.testing.assert_close(out, torch.nn.functional.batch_norm(part, None, None, training=True))
    norm.commit()
    torch.testing.assert_close(norm.running_mean, plain.running_mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(norm.running_var, plain.running_var, rtol=1e-12, atol=0)
    assert int(norm.num_batches_tracked) == 1
    norm.begin(0)
    norm(x)
    norm.commit(apply=False)
    torch.testing.assert_close(norm.running_mean, plain.running_mean, rtol=1e-12, atol=0)
