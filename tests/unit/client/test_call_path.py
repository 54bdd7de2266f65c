"""A worker's push and pull cross few project modules, each once: traced over the fake transport.

The trace starts at the user's call (the ``public`` boundary in ``kvstore.errors`` around the store's
method) and stops at the transport: what the fake transport does inside is not the worker's path.
A module counts when code from its source file runs (a dataclass's generated ``__init__``, e.g. of a
``Message``, has no source file).  Along every call
stack, a project module appears in one run: no going back and forth (store -> base -> store).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvstore
from tests.unit.client.fake_transport import fake_store

MAX_MODULES = 8
TRANSPORT = "tests.unit.client.fake_transport"
SOURCE = str(Path(kvstore.__file__).parent)  # the project's source files


def trace(call: Callable[[], Any]) -> list[list[str]]:
    """The stack of project modules (kvstore.*) at each Python call ``call()`` makes from the user's
    call down to the transport, consecutive repeats merged."""
    stack: list[str] = []
    stacks: list[list[str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if not stack and not module.startswith("kvstore."):
                return  # the test's own frames, above the user's call: not counted
            ours = module.startswith("kvstore.") and frame.f_code.co_filename.startswith(SOURCE)
            stack.append("" if module.startswith("kvstore.") and not ours else module)  # generated code
            if ours and TRANSPORT not in stack:
                path = [m for m in stack if m.startswith("kvstore.")]
                stacks.append([m for i, m in enumerate(path) if i == 0 or path[i - 1] != m])
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return stacks


def check(stacks: list[list[str]]) -> set[str]:
    """Assert every stack visits each module in one run; return the modules crossed."""
    assert stacks, "nothing was traced"
    for path in stacks:
        assert len(path) == len(set(path)), f"back and forth: {' -> '.join(path)}"
    return {m for path in stacks for m in path}


@pytest.fixture
def kv():
    """A store over the fake transport with a small key 'w' and a key 'big' split over both servers."""
    store, _ = fake_store()
    store.init(["w", "big"], [np.zeros(4, np.float32), np.zeros(3000, np.float32)])
    yield store
    store.close()


CALLS = {
    "push of a small key": lambda kv: kv.push("w", np.ones(4, np.float32)),
    "pull of a small key": lambda kv: kv.pull("w"),
    "pull of a small key into an out": lambda kv: kv.pull("w", out=np.empty(4, np.float32)),
    "pushpull of a small key": lambda kv: kv.pushpull("w", np.ones(4, np.float32)),
    "push of a key on two servers": lambda kv: kv.push("big", np.ones(3000, np.float32)),
    "pull of a key on two servers": lambda kv: kv.pull("big"),
    "pushpull of a key on two servers": lambda kv: kv.pushpull("big", np.ones(3000, np.float32)),
}


@pytest.mark.parametrize("first", [True, False], ids=["first call", "later call"])
@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_crosses_at_most_eight_modules_each_once(kv, name: str, first: bool) -> None:
    """A dense numpy push, pull or pushpull (a small key; a key split over two servers), the first of its
    kind or a later one, crosses at most 8 project modules, none twice along any call stack."""
    call = CALLS[name]
    if not first:
        call(kv)
    modules = check(trace(lambda: call(kv)))
    assert len(modules) <= MAX_MODULES, sorted(modules)
    assert {"kvstore.errors", "kvstore.client.store"} <= modules  # from the boundary into the store


def test_the_trace_sees_going_back_and_forth() -> None:
    """The check refuses a stack that leaves a module and comes back to it."""
    with pytest.raises(AssertionError, match="back and forth"):
        check([["kvstore.client.store", "kvstore.base", "kvstore.client.store"]])
