"""AdamW (kvstore.optimizer.create('adamw')) against torch.optim.AdamW on the same gradients."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import optimizer as kvopt

torch = pytest.importorskip("torch")


def _torch_run(w0: np.ndarray, grads: list[np.ndarray], **kw) -> np.ndarray:
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = torch.optim.AdamW([p], **kw)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    return p.detach().numpy()


@pytest.mark.parametrize("side", ["numpy", "torch"])
@pytest.mark.parametrize("hyper", [{}, {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1},
                                   {"lr": 0.05, "weight_decay": 0.0}])
def test_adamw_matches_torch_to_1e6(side: str, hyper: dict) -> None:
    """20 steps of float32 AdamW agree with torch.optim.AdamW (weights within 1e-6)."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((5, 7)).astype(np.float32)
    grads = [rng.standard_normal((5, 7)).astype(np.float32) for _ in range(20)]
    params = {"learning_rate": hyper.get("lr", 1e-3), "beta1": hyper.get("betas", (0.9, 0.999))[0],
              "beta2": hyper.get("betas", (0.9, 0.999))[1], "epsilon": hyper.get("eps", 1e-8)}
    if "weight_decay" in hyper:
        params["wd"] = hyper["weight_decay"]
    opt = kvopt.create("adamw", **params)
    w = w0.copy() if side == "numpy" else torch.tensor(w0)
    for g in grads:
        opt.update("w", w, g if side == "numpy" else torch.tensor(g))
    mine = w if side == "numpy" else w.numpy()
    np.testing.assert_allclose(mine, _torch_run(w0, grads, **hyper), rtol=0, atol=1e-6)


def test_adamw_defaults_are_torchs() -> None:
    """lr 0.001, betas (0.9, 0.999), eps 1e-8, weight decay 0.01; the spec round-trips."""
    opt = kvopt.create("adamw")
    assert (opt.learning_rate, opt.beta1, opt.beta2, opt.epsilon, opt.wd) == (0.001, 0.9, 0.999, 1e-8, 0.01)
    again = kvopt.from_spec(opt.spec())
    assert isinstance(again, kvopt.AdamW) and again.spec() == opt.spec()


def test_adamw_rescales_and_clips_the_gradient_first() -> None:
    """rescale_grad and clip_gradient apply to the gradient before torch's formula (decay untouched)."""
    w0 = np.array([1.0, -2.0, 3.0], np.float32)
    grads = [np.array([4.0, -0.1, 0.0], np.float32)] * 3
    opt = kvopt.create("adamw", learning_rate=0.1, rescale_grad=0.5, clip_gradient=1.0)
    w = w0.copy()
    for g in grads:
        opt.update(0, w, g)
    expected = _torch_run(w0, [np.clip(0.5 * g, -1, 1) for g in grads], lr=0.1)
    np.testing.assert_allclose(w, expected, rtol=0, atol=1e-6)
