"""The held push (issue 39): which pushes may be held, and what a held push becomes, over the fake
transport (no processes, no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import config as kvconfig
from kvstore.client.datapath import HOLD_BYTES, holdable
from kvstore.client.mux import Request
from kvstore.client.window import PushWindow
from kvstore.core.plan import Send, Span
from kvstore.errors import ShapeMismatchError
from kvstore.net.protocol import Op
from tests.unit.client.fake_transport import fake_store


def _send(server: int, *parts: tuple[str, int], lo: int | None = None) -> Send:
    return Send(server, [Span(key, 0, size) for key, size in parts], lo=lo)


def test_one_message_of_the_same_keys_both_ways_may_be_held() -> None:
    """A push and a pull that are one message each, of the same whole keys to one server, hold."""
    assert holdable([_send(0, ("a", 1))], [_send(0, ("a", 1))], 4)
    assert holdable([_send(1, ("a", 2), ("b", 3))], [_send(1, ("a", 2), ("b", 3))], 20)


@pytest.mark.parametrize("push, pull, nbytes", [
    ([_send(0, ("a", 1))], [_send(1, ("a", 1))], 4),  # another server
    ([_send(0, ("a", 1)), _send(1, ("b", 1))], [_send(0, ("a", 1)), _send(1, ("b", 1))], 8),  # two messages
    ([_send(0, ("a", 1), ("b", 1))], [_send(0, ("b", 1), ("a", 1))], 8),  # other order: another reply
    ([_send(0, ("a", 4), lo=0)], [_send(0, ("a", 4))], 16),  # a chunk
    ([_send(0, ("a", HOLD_BYTES // 4))], [_send(0, ("a", HOLD_BYTES // 4))], HOLD_BYTES),  # too big
])
def test_anything_else_is_sent_at_once(push, pull, nbytes) -> None:
    """Two messages, another server or order of keys, a chunk, or HOLD_BYTES of values: never held."""
    assert not holdable(push, pull, nbytes)


def test_a_failure_its_call_raises_is_not_remembered_for_the_keys() -> None:
    """The window forgets the failure of a push a pull took along (the pull raises it), not another's."""
    window = PushWindow(2)
    taken, alone = Request("push of a"), Request("push of b")
    window.add_sends([["a"], ["b"]], [taken, alone])
    window.raised_by_call(taken)
    taken.future.set_exception(ShapeMismatchError("refused"))
    alone.future.set_exception(ShapeMismatchError("refused"))
    assert window.take_failure(["a"]) is None
    assert isinstance(window.take_failure(["b"]), ShapeMismatchError)


def test_a_push_then_a_pull_of_the_same_key_send_one_pushpull() -> None:
    """dist_sync: a fast push is held; the pull of its key takes it along as one PUSHPULL carrying the
    push's round, and reads the pushed value."""
    kv, mux = fake_store(hold_push=True)
    kv.init("w", np.zeros(4, np.float32))
    out = np.empty(4, np.float32)
    for step in range(2):
        kv.push("w", np.full(4, step + 1, np.float32))
        assert mux.ops(0) + mux.ops(1) == [Op.INIT] + [Op.PUSHPULL] * step  # held: not sent
        kv.pull("w", out=out)
        assert out.tolist() == [step + 1] * 4
    sent = [msg.body for _, msg in mux.sent if msg.op is Op.PUSHPULL]
    assert [body["rounds"] for body in sent] == [[0], [1]]
    kv.close()


def test_any_other_call_sends_the_held_push_first_as_it_is() -> None:
    """A second push, a pull of another key, a generic pull, a barrier: each sends the held PUSH first."""
    kv, mux = fake_store(hold_push=True)
    kv.init(["a", "b"], [np.zeros(2, np.float32), np.zeros(2, np.float32)])
    out = np.empty(2, np.float32)
    data = lambda: [(msg.op, msg.body["keys"]) for _, msg in mux.sent if msg.op is not Op.INIT  # noqa: E731
                    and msg.body.get("keys")]
    kv.push("a", np.ones(2, np.float32))
    kv.push("a", np.ones(2, np.float32))
    assert data() == [(Op.PUSH, ["a"])]
    kv.pull("b", out=out)
    assert data()[1:] == [(Op.PUSH, ["a"]), (Op.PULL, ["b"])]
    kv.push("a", np.full(2, 3, np.float32))
    assert kv.pull("a").tolist() == [3, 3]  # the generic pull (no out) takes nothing along
    assert data()[3:] == [(Op.PUSH, ["a"]), (Op.PULL, ["a"])]
    kv.push("b", np.ones(2, np.float32))
    kv.barrier()
    assert data()[-1] == (Op.PUSH, ["b"])
    kv.close()


def test_dist_async_sends_every_push_at_once() -> None:
    """dist_async never holds: a push is sent by its call, and its pull is a PULL."""
    kv, mux = fake_store("dist_async", hold_push=True)
    kv.init("w", np.zeros(2, np.float32))
    kv.push("w", np.ones(2, np.float32))
    assert mux.ops(0) + mux.ops(1) == [Op.INIT, Op.PUSH]
    kv.pull("w", out=np.empty(2, np.float32))
    assert Op.PUSHPULL not in mux.ops()
    kv.close()


def test_a_refused_held_push_is_raised_by_the_pull_that_took_it_once() -> None:
    """A held push refused by its server fails the pull that took it along; the next pull reads."""
    kv, mux = fake_store(hold_push=True)
    kv.init("w", np.zeros(2, np.float32))
    mux.refuse[Op.PUSH] = ShapeMismatchError("key 'w' holds 2 elements")
    kv.push("w", np.ones(2, np.float32))
    del mux.refuse[Op.PUSH]
    out = np.empty(2, np.float32)
    with pytest.raises(ShapeMismatchError, match="push of key 'w'"):
        kv.pull("w", out=out)
    kv.pull("w", out=out)
    assert out.tolist() == [0, 0]
    kv.close()


def test_kvstore_hold_push_0_the_default_sends_every_push_at_once() -> None:
    """KVSTORE_HOLD_PUSH=0, the default (read by the config; 1 turns holding on): a dist_sync push is
    sent by its call, its pull a PULL."""
    env = {"DMLC_PS_ROOT_URI": "10.0.0.9", "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_WORKER": "1",
           "DMLC_NUM_SERVER": "2", "DMLC_ROLE": "worker"}
    assert not kvconfig.load(env).hold_push and kvconfig.load({**env, "KVSTORE_HOLD_PUSH": "1"}).hold_push
    kv, mux = fake_store(hold_push=False)
    kv.init("w", np.zeros(2, np.float32))
    kv.push("w", np.ones(2, np.float32))
    assert mux.ops(0) + mux.ops(1) == [Op.INIT, Op.PUSH]
    kv.pull("w", out=np.empty(2, np.float32))
    assert Op.PUSHPULL not in mux.ops()
    kv.close()


def test_a_finished_futures_raised_mark_never_silences_another_pushs_failure() -> None:
    """raised_by_call on a request whose future had finished (fail() resolving a held push while a pull
    took it) leaves no mark a later push's future could be taken for (review: keyed by id(), 190 of
    200 later failures were silenced)."""
    window = PushWindow(2)
    silenced = 0
    for _ in range(200):
        taken = Request("push of a")
        window.add_sends([["a"]], [taken])
        taken.future.set_exception(ShapeMismatchError("node lost"))
        window.take_failure(["a"])
        window.raised_by_call(taken)
        window.has_room(["a"])
        del taken
        later = Request("push of b")
        window.add_sends([["b"]], [later])
        later.future.set_exception(ShapeMismatchError("refused"))
        if window.take_failure(["b"]) is None:
            silenced += 1
    assert silenced == 0
