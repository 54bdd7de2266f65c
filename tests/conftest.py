"""Suite-wide test set-up: the ``cuda`` marker skips cleanly where torch has no CUDA."""

from __future__ import annotations

import pytest


def _cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA (torch is not installed)"
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    return None


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``cuda`` marker."""
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped where torch has none")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked ``cuda`` when torch has no CUDA device, before any fixture runs."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    reason = _cuda_reason() if marked else None
    if reason:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))
