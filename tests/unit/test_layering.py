"""Architecture rules, checked by reading the source of kvstore/ and scheduler/ (no imports run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvstore", "scheduler")
SOURCES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
PICKLERS = {"pickle", "cPickle", "_pickle", "pickletools", "dill", "cloudpickle", "shelve", "joblib"}


def module_name(path: Path) -> str:
    """Dotted module name of a source file under ROOT (package __init__ -> package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool = False, top_level_only: bool = False) -> set[str]:
    """Absolute names a module imports: 'a.b' for `import a.b`, 'p' and 'p.x' for `from p import x`.

    Relative imports are resolved against ``module``.  With ``top_level_only`` imports inside
    functions and classes are skipped (imports under module-level if/try still count).
    """
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    nodes = _top_level_nodes(tree) if top_level_only else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


def _top_level_nodes(tree: ast.AST):
    """Nodes of ``tree`` outside any function or class body."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def file_imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Imports of the source file at ``path``."""
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py", top_level_only)


def roots(names: set[str]) -> set[str]:
    """Top-level package of each imported name."""
    return {n.split(".")[0] for n in names}


def users_of(package: str, top_level_only: bool = False) -> set[str]:
    """Source files (relative to ROOT, as posix paths) that import ``package``."""
    return {p.relative_to(ROOT).as_posix() for p in SOURCES
            if package in roots(file_imports(p, top_level_only))}


# -- the helpers themselves (so a broken helper cannot make the rules pass vacuously) ----------------

def test_helper_sees_every_import_form():
    """imports_of finds plain, from, relative, nested-function and module-level-try imports."""
    source = ("import zmq.asyncio\nfrom msgpack import packb\nfrom . import protocol\n"
              "from .transport import send\nfrom .. import scheduler\n"
              "try:\n    import torch\nexcept ImportError:\n    pass\n"
              "def f():\n    import pickle\n")
    found = imports_of(source, "kvstore.sub.mod")
    assert {"zmq.asyncio", "msgpack", "kvstore.sub.protocol", "kvstore.sub.transport.send",
            "kvstore.scheduler", "torch", "pickle"} <= found
    top = imports_of(source, "kvstore.sub.mod", top_level_only=True)
    assert "torch" in top and "pickle" not in top


def test_the_source_tree_is_found():
    """The rule tests scan the real modules (transport, protocol, config, scheduler.state...)."""
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {"kvstore/transport.py", "kvstore/protocol.py", "kvstore/config.py", "kvstore/state.py",
            "scheduler/state.py"} <= names
    assert "zmq" in roots(file_imports(ROOT / "kvstore/transport.py"))
    assert "msgpack" in roots(file_imports(ROOT / "kvstore/protocol.py"))


# -- the rules --------------------------------------------------------------------------------------

def test_zmq_only_in_transport():
    """zmq is imported only by kvstore/transport.py."""
    assert users_of("zmq") == {"kvstore/transport.py"}


def test_msgpack_only_in_protocol():
    """msgpack is imported only by kvstore/protocol.py."""
    assert users_of("msgpack") == {"kvstore/protocol.py"}


@pytest.mark.parametrize("needle", ["os.environ", "environ[", "getenv", "putenv"])
def test_environment_read_only_in_config(needle):
    """The process environment is touched (by text search) only in kvstore/config.py."""
    offenders = {p.relative_to(ROOT).as_posix() for p in SOURCES if needle in p.read_text()}
    assert offenders <= {"kvstore/config.py"}


def test_environ_not_imported_by_name_outside_config():
    """No module other than config does `from os import environ/getenv`."""
    offenders = {p.relative_to(ROOT).as_posix() for p in SOURCES
                 if {"os.environ", "os.getenv", "os.environb"} & file_imports(p)}
    assert offenders <= {"kvstore/config.py"}


def test_protocol_and_transport_never_import_each_other():
    """protocol does not import transport and transport does not import protocol."""
    assert not any(n.startswith("kvstore.transport") for n in file_imports(ROOT / "kvstore/protocol.py"))
    assert not any(n.startswith("kvstore.protocol") for n in file_imports(ROOT / "kvstore/transport.py"))


def test_kvstore_never_imports_scheduler():
    """No module of kvstore imports the scheduler package."""
    offenders = {p.relative_to(ROOT).as_posix() for p in SOURCES
                 if p.is_relative_to(ROOT / "kvstore") and "scheduler" in roots(file_imports(p))}
    assert offenders == set()


def test_no_pickle_anywhere():
    """Neither kvstore nor scheduler imports pickle or a pickle-like serializer."""
    offenders = {p.relative_to(ROOT).as_posix(): roots(file_imports(p)) & PICKLERS for p in SOURCES}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_unpickling_numpy_loads():
    """No source enables numpy's pickle support (allow_pickle=True)."""
    assert [p.name for p in SOURCES if "allow_pickle=True" in p.read_text()] == []


def test_torch_never_imported_at_module_level_in_kvstore():
    """torch is imported only inside functions in kvstore/, never when a module loads."""
    offenders = {user for user in users_of("torch", top_level_only=True) if user.startswith("kvstore/")}
    assert offenders == set()
