"""The Trainer's overlap (issue 24) on real clusters: pushes from autograd hooks, in buckets, give the
same weights as the plain path, bit for bit, with 1 and 2 workers, with and without the store's
optimizer, with and without buckets; missing gradients and accumulation keep today's behaviour."""

from __future__ import annotations

import gc
import itertools
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from kvstore.base import layer_calls  # noqa: E402
from kvstore.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.timeout(120)
SGD = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}
_prefixes = itertools.count()
_seeding = threading.Lock()  # the workers are threads: torch's global generator is shared


def model() -> nn.Module:
    """A 64-16-10 MLP with the same weights every time (the first step's gradients use them)."""
    with _seeding:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))


def train(kv, prefix: str, uok: bool, overlap: bool, bucket_bytes: int = 0, steps: int = 4,
          accumulate: int = 1, unused: bool = False) -> list:
    """Train a fresh model ``steps`` steps on this worker's data; return its final weights."""
    net = model()
    params = list(net.named_parameters())
    if unused:  # a parameter the forward never uses: zeros pushed for it, with a warning
        params.append(("unused", nn.Parameter(torch.ones(3))))
    trainer = Trainer(params, "sgd", dict(SGD), kvstore=kv, update_on_kvstore=uok,
                      key_prefix=prefix, overlap=overlap, bucket_bytes=bucket_bytes)
    gen = torch.Generator().manual_seed(100 + kv.rank)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            net.zero_grad()
            for i in range(accumulate):
                x, y = torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen)
                if i < accumulate - 1:
                    with trainer.no_sync():
                        loss_fn(net(x), y).backward()
                else:
                    loss_fn(net(x), y).backward()
            trainer.step(8 * accumulate * kv.num_workers)
    if overlap:  # every step after the first pushed its buckets from the hooks (all but one, if unused)
        assert trainer._overlap.early == (steps - 1) * (len(trainer._overlap.buckets) - unused)
    trainer.close()
    return [p.detach().clone() for _, p in params]


def run(cluster, fn, *args, **kwargs) -> list:
    """``fn(kv, prefix, *args, **kwargs)`` on every worker, with a key prefix of its own (the same on all)."""
    prefix = f"ov{next(_prefixes)}"
    return cluster.run(lambda kv: fn(kv, prefix, *args, **kwargs))


def assert_same(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("workers", [1, 2])
def test_overlapped_steps_give_the_plain_paths_weights(make_cluster, workers: int) -> None:
    """Overlapped steps (buckets of one parameter, and of several) end with the plain path's weights."""
    cluster = make_cluster("dist_sync", workers, 1)
    for uok in (False, True):  # False first: the store holds no optimizer yet
        plain = run(cluster, train, uok, overlap=False)
        for bucket_bytes in (0, 700):  # 700: buckets [fc2.bias, fc2.weight, fc1.bias], [fc1.weight]
            overlapped = run(cluster, train, uok, overlap=True, bucket_bytes=bucket_bytes)
            for a, b in zip(plain, overlapped):
                assert_same(a, b)


def test_overlap_with_gradient_compression_gives_the_plain_paths_weights(make_cluster) -> None:
    """The hooks' pushpulls are compressed as the plain path's pushes are (2bit, residuals per key)."""
    cluster = make_cluster("dist_sync", 2, 1)
    cluster.run(lambda kv: kv.set_gradient_compression({"type": "2bit", "threshold": 0.05}))
    for uok in (False, True):
        plain = run(cluster, train, uok, overlap=False)
        overlapped = run(cluster, train, uok, overlap=True, bucket_bytes=700)
        for a, b in zip(plain, overlapped):
            assert_same(a, b)


def test_missing_gradient_and_accumulation_keep_todays_behaviour(make_cluster) -> None:
    """A parameter without a gradient gets zeros; accumulated backward passes (with and without
    no_sync) sum as on the plain path; both store modes."""
    cluster = make_cluster("dist_sync", 2, 1)
    for uok in (False, True):
        plain = run(cluster, train, uok, overlap=False, unused=True, accumulate=2)
        overlapped = run(cluster, train, uok, overlap=True, unused=True, accumulate=2, bucket_bytes=700)
        for a, b in zip(plain, overlapped):
            assert_same(a, b)
            assert not torch.equal(a[-1], torch.ones(3))  # wd and momentum moved the unused one


def test_accumulation_without_no_sync_takes_the_plain_path(make_cluster) -> None:
    """update_on_kvstore=False: backward twice without no_sync pushes again at step (today's sums)."""
    cluster = make_cluster("dist_sync", 2, 1)

    def twice(kv, prefix: str, overlap: bool) -> list:
        net = model()
        trainer = Trainer(net.named_parameters(), "sgd", dict(SGD), kvstore=kv, update_on_kvstore=False,
                          key_prefix=prefix, overlap=overlap)
        gen = torch.Generator().manual_seed(7 + kv.rank)
        for _ in range(3):
            net.zero_grad()
            for _ in range(2):
                net(torch.randn(4, 64, generator=gen)).sum().backward()
            trainer.step(8)
        return [p.detach().clone() for p in net.parameters()]

    plain = run(cluster, twice, False)
    overlapped = run(cluster, twice, True)
    for a, b in zip(plain, overlapped):
        assert_same(a, b)


def test_a_new_batch_size_after_overlapped_pushes_is_refused(make_cluster) -> None:
    """update_on_kvstore and overlap: a step whose batch size differs from the pushes' raises."""
    cluster = make_cluster("dist_sync", 1, 1)
    kv = cluster.workers[0]
    net = model()
    trainer = Trainer(net.named_parameters(), "sgd", dict(SGD), kvstore=kv, update_on_kvstore=True,
                      key_prefix=f"ov{next(_prefixes)}", overlap=True)
    for batch in (8, 8):
        net.zero_grad()
        net(torch.randn(batch, 64)).sum().backward()
        trainer.step(batch)
    net.zero_grad()
    net(torch.randn(4, 64)).sum().backward()
    with pytest.raises(ValueError, match="same batch size"):
        trainer.step(4)


def test_hooks_are_removed_by_close_and_by_garbage_collection() -> None:
    """close() removes every hook; a Trainer dropped without close leaves none behind either."""
    net = model()
    trainer = Trainer(net.named_parameters(), "sgd", dict(SGD), kvstore="local", overlap=True)
    assert trainer._overlap.hooks == 4
    assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in net.parameters())
    trainer.close()
    assert trainer._overlap.hooks == 0
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    trainer = Trainer(net.named_parameters(), "sgd", dict(SGD), kvstore="local", overlap=True)
    del trainer
    gc.collect()
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    net(torch.randn(2, 64)).sum().backward()  # no hook left to call


@pytest.mark.parametrize("store", ["dist_sync", "local"])
def test_a_begun_pushpull_writes_its_outs_only_when_finished(make_cluster, store: str) -> None:
    """``_pushpull_begin`` (what the hooks send): the outs are written by ``finish()``, not before;
    ``finish(False)`` waits without writing; a repeated key is refused before anything is sent."""
    import numpy as np

    import kvstore

    kv = make_cluster("dist_sync", 1, 1).workers[0] if store == "dist_sync" else kvstore.create("local")
    key = f"begun{next(_prefixes)}"
    kv.init(key, np.zeros(4, np.float32))
    out = np.full(4, -1.0, np.float32)
    finish = kv._pushpull_begin([key], [np.ones(4, np.float32)], [out])
    assert (out == -1).all()
    finish()
    assert (out == 1).all()  # one worker, no optimizer: the stored value is the pushed sum
    other = np.full(4, -1.0, np.float32)
    kv._pushpull_begin([key], [np.full(4, 2, np.float32)], [other])(False)
    assert (other == -1).all()
    if store == "dist_sync":
        assert (kv.pull(key) == 2).all()  # the push was applied all the same
    with pytest.raises(ValueError, match="each key once"):
        kv._pushpull_begin([key, key], [np.ones(4, np.float32)] * 2, [out, out])


def test_a_gradient_replaced_before_step_still_gets_the_sum(make_cluster) -> None:
    """update_on_kvstore=False: a .grad replaced by a new tensor after backward still receives the
    summed gradient at step, so the workers keep the same weights (the hooks pushed the old one)."""
    cluster = make_cluster("dist_sync", 2, 1)

    def replaced(kv, prefix: str) -> list:
        net = model()
        trainer = Trainer(net.named_parameters(), "sgd", dict(SGD), kvstore=kv, update_on_kvstore=False,
                          key_prefix=prefix, overlap=True)
        gen = torch.Generator().manual_seed(11 + kv.rank)
        for _ in range(3):
            net.zero_grad()
            net(torch.randn(4, 64, generator=gen)).sum().backward()
            for p in net.parameters():
                p.grad = p.grad * 0.5  # a new tensor, as a user's scaling may make
            trainer.step(8)
        assert trainer._overlap.early > 0
        return [p.detach().clone() for p in net.parameters()]

    first, second = run(cluster, replaced)
    assert_same(first, second)


def test_every_pushpull_the_hooks_send_is_collected_even_when_step_refuses(make_cluster) -> None:
    """A step that raises (a new batch size) and a close() between backward and step still collect the
    hooks' pushpulls, so no failure of theirs can be lost (each ``finish`` is counted)."""
    cluster = make_cluster("dist_sync", 1, 1)
    kv = cluster.workers[0]
    begun: list[list] = []
    finished: list[list] = []
    calls = layer_calls(kv)  # what the Trainer's overlap calls
    original = calls.pushpull_begin

    def counted(keys, values, outs, priority=0):
        finish = original(keys, values, outs, priority)
        begun.append(keys)
        return lambda write=True: (finished.append(keys), finish(write))[1]

    calls.pushpull_begin = counted
    net = model()
    trainer = Trainer(net.named_parameters(), "sgd", dict(SGD), kvstore=kv, update_on_kvstore=True,
                      key_prefix=f"ov{next(_prefixes)}", overlap=True, bucket_bytes=0)
    for batch in (8, 8, 4):
        net.zero_grad()
        net(torch.randn(batch, 64)).sum().backward()
        if batch == 4:
            with pytest.raises(ValueError, match="same batch size"):
                trainer.step(batch)
        else:
            trainer.step(batch)
    assert len(begun) == 4 * 2 and len(finished) == len(begun)  # 4 buckets from the hooks in steps 2, 3
    net.zero_grad()
    net(torch.randn(4, 64)).sum().backward()
    trainer.close()  # no step after this backward: close collects its pushpulls
    assert len(begun) == 4 * 3 and len(finished) == len(begun)
