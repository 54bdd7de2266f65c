"""How kvstore is found: the scheduler under its installed name from a bare checkout, and the public
modules importable by the dotted names the docs use."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
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
    import kvstore.core.optimizer as core
    import kvstore.optimizer as public

    assert public.create is core.create and public.OPTIMIZERS is core.OPTIMIZERS
    assert public.Optimizer is core.Optimizer


# PEP 517's hooks, called in a child whose working directory is the copy: what `python -m build` runs.
# setuptools logs to stdout too: the names built are the last line.
BUILD = ("import sys; from setuptools import build_meta as b; out = sys.argv[1]; "
         "names = b.build_sdist(out), b.build_wheel(out); print(*names)")


def test_the_sdist_and_wheel_hold_the_package_license_and_py_typed_only(tmp_path):
    """A build of the checkout holds kvstore (py.typed too, and its compiled hot path in the wheel), its
    scheduler, LICENSE and metadata, no more."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    src = tmp_path / "src"
    for name in filter(None, files):  # the files a clean clone has (scratch the tests leave is git-ignored)
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / name).is_symlink():  # kvstore/scheduler -> ../scheduler stays a link, as in a clone
            os.symlink(os.readlink(REPO / name), src / name)
        elif (REPO / name).is_file():
            shutil.copyfile(REPO / name, src / name)
    out = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path / "dist")], cwd=src,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    sdist_name, wheel_name = out.stdout.splitlines()[-1].split()
    with tarfile.open(tmp_path / "dist" / sdist_name) as sdist:
        top = sdist_name.removesuffix(".tar.gz")
        in_sdist = {m.name.removeprefix(top + "/") for m in sdist.getmembers() if m.isfile()}
    with zipfile.ZipFile(tmp_path / "dist" / wheel_name) as wheel:
        in_wheel = set(wheel.namelist())
    tracked = {f for f in files if f.startswith(("kvstore/", "scheduler/")) and f != "kvstore/scheduler"}
    # the package as installed: scheduler/ through its link kvstore/scheduler, as real files
    installed = {"kvstore/" + f if f.startswith("scheduler/") else f for f in tracked}
    egg_info = {f for f in in_sdist if f.startswith("kvstore_ps.egg-info/")}
    assert in_sdist - egg_info == installed | {"LICENSE", "README.md", "PKG-INFO", "pyproject.toml",
                                               "setup.py", "setup.cfg"}
    dist_info = {f for f in in_wheel if ".dist-info/" in f}
    # the compiled hot path (kvstore/net/_hot.c, built where a C compiler is) in place of its C source
    built = {f for f in in_wheel if f.startswith("kvstore/net/_hot.") and f.endswith((".so", ".pyd"))}
    assert len(built) == (1 if shutil.which("cc") or shutil.which("gcc") else 0)
    assert in_wheel - dist_info - built == installed - {"kvstore/net/_hot.c"}
    assert "kvstore/py.typed" in in_wheel
    assert any(f.endswith(".dist-info/licenses/LICENSE") for f in dist_info)
    assert (REPO / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
