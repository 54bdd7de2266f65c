"""How kvstore is found: the scheduler under its installed name from a bare checkout, and the public
modules importable by the dotted names the docs use."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
from tests.helpers import REPO

# A child that drops setuptools' editable-install finder, so only the checkout on sys.path is seen,
# then asks where kvstore.scheduler comes from.
BARE_CHECKOUT = (
    "import sys; sys.meta_path = [f for f in sys.meta_path if 'ditable' not in repr(f)]; "
    "sys.path.insert(0, {repo!r}); import importlib.util, kvstore; "
    "print(importlib.util.find_spec('kvstore.scheduler').origin); print(kvstore.__file__)"
)


def test_a_bare_checkout_finds_the_scheduler_as_kvstore_scheduler(tmp_path):
    """Without any install, `python -m kvstore.scheduler` resolves to the repository's scheduler/ folder."""
    out = subprocess.run([sys.executable, "-c", BARE_CHECKOUT.format(repo=str(REPO))], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    origin, package = out.stdout.split()
    assert origin == str(REPO / "kvstore" / "scheduler" / "__init__.py")  # the link to scheduler/
    assert Path(origin).resolve() == REPO / "scheduler" / "__init__.py"
    assert package == str(REPO / "kvstore" / "__init__.py")


@pytest.mark.parametrize("name", ["kvstore.optimizer", "kvstore.lr_scheduler", "kvstore.checkpoint",
                                  "kvstore.snapshot", "kvstore.data", "kvstore.node"])
def test_public_modules_import_by_their_documented_names(name):
    """A public module imports by its documented name (``import kvstore.x``, ``from kvstore.x import *``)."""
    module = importlib.import_module(name)
    assert sys.modules[name] is module and getattr(kvstore, name.rpartition(".")[2]) is module
    namespace: dict = {}
    exec(f"from {name} import *", namespace)
    names = getattr(module, "__all__", [])
    assert set(names) <= set(namespace) and all(hasattr(module, n) for n in names)


def test_the_public_faces_are_the_core_objects():
    """kvstore.optimizer.register registers into the same registry create() reads."""
    import kvstore.optimizer as public

    import kvstore.core.optimizer as core

    assert public.create is core.create and public.OPTIMIZERS is core.OPTIMIZERS
    assert public.Optimizer is core.Optimizer
