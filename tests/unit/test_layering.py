"""Architecture rules, checked by reading the source of kvstore/ and scheduler/ (no imports run).

The folder tree is the architecture: each package sits on a layer and imports only from layers below
it, or from its own package.  docs/architecture.md draws the same table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvstore", "scheduler")
SOURCES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
PICKLERS = {"pickle", "cPickle", "_pickle", "pickletools", "dill", "cloudpickle", "shelve", "joblib"}


def module_name(path: Path) -> str:
    """Installed dotted name of a source file under ROOT (package __init__ -> package).

    The repository's scheduler/ folder is installed as ``kvstore.scheduler`` (setup.py's package_dir).
    """
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "scheduler":
        parts.insert(0, "kvstore")
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
    """The rule tests scan the real modules (transport, protocol, config, the shard, the scheduler...)."""
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {"kvstore/net/transport.py", "kvstore/net/protocol.py", "kvstore/config.py",
            "kvstore/core/shard.py", "scheduler/state.py"} <= names
    assert module_name(ROOT / "scheduler/state.py") == "kvstore.scheduler.state"
    assert "zmq" in roots(file_imports(ROOT / "kvstore/net/transport.py"))
    assert "msgpack" in roots(file_imports(ROOT / "kvstore/net/protocol.py"))


def test_cycle_finder_finds_a_cycle():
    """find_cycle reports a -> b -> a and nothing for a tree."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) in (["a", "b", "a"], ["b", "a", "b"])
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_layer_of_classifies_by_longest_prefix():
    """kvstore.core.shard is in core, kvstore.config is its own unit, the scheduler sits on top."""
    assert layer_of("kvstore.core.shard") == (LAYER_INDEX["kvstore.core"], "kvstore.core")
    assert layer_of("kvstore.config") == (LAYER_INDEX["kvstore.config"], "kvstore.config")
    assert layer_of("kvstore.scheduler.scheduler")[0] == len(LAYERS) - 1


# -- the layers -------------------------------------------------------------------------------------

# Lowest first.  A unit is a subpackage (every module in it) or a single top-level module.  A module
# may import a unit on a lower layer, or its own unit; never one beside it or above it.
LAYERS: list[tuple[str, ...]] = [
    ("kvstore.errors",),
    ("kvstore.config", "kvstore.logs", "kvstore.heap"),
    ("kvstore.core",),                                            # pure logic, no I/O
    ("kvstore.net", "kvstore.device", "kvstore.data",              # sockets; GPU sums; sharding
     "kvstore.optimizer", "kvstore.lr_scheduler", "kvstore.checkpoint",  # public faces of core
     "kvstore.sparse"),                                            # row-sparse argument rules
    ("kvstore.base",),                                            # the KVStore ABC
    ("kvstore.client", "kvstore.local", "kvstore.server"),        # the stores; the server process
    ("kvstore.stores",),                                          # create(): the registry of stores
    ("kvstore.trainer_states", "kvstore.overlap", "kvstore.pipeline"),  # the Trainer's helpers, pipelines
    ("kvstore.trainer", "kvstore.torch_optim"),                   # the torch-facing wrappers
    ("kvstore.trainer_sparse",),                                  # a Trainer plus row-sparse embeddings
    ("kvstore.launch",),                                          # starting clusters
    ("kvstore", "kvstore.ray", "kvstore.spark", "kvstore.node",   # the public surface, entry points
     "kvstore.status"),
    ("kvstore.scheduler",),                                       # a program over kvstore, started by name
]
LAYER_INDEX = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, unit) of a dotted module name of ours, by its longest listed prefix."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        unit = ".".join(parts[:n])
        if unit in LAYER_INDEX:
            return LAYER_INDEX[unit], unit
    raise KeyError(module)


MODULES = {module_name(p): p for p in SOURCES}


def our_imports(path: Path) -> set[str]:
    """The modules of ours that ``path`` imports, lazy imports included: ``from pkg import name`` counts
    ``pkg.name`` when that is a module, else ``pkg``; a name that is no module counts as its module."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name not in MODULES and "." in name:
                name = name.rpartition(".")[0]
            if name in MODULES and name.split(".")[0] == "kvstore":
                found.add(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a path whose first and last nodes are the same, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_module_is_on_a_layer():
    """Each module of kvstore/ and scheduler/ belongs to a listed unit (a new package must be placed)."""
    unplaced = []
    for module in MODULES:
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert unplaced == []


def test_imports_point_down_the_layers():
    """Every import of ours (lazy ones included) goes to a lower layer or stays in its own unit."""
    upward = []
    for module, path in MODULES.items():
        level, unit = layer_of(module)
        for target in our_imports(path):
            t_level, t_unit = layer_of(target)
            if t_unit != unit and t_level >= level:
                upward.append(f"{module} -> {target}")
    assert sorted(upward) == []


def test_no_import_cycles():
    """The graph of our module imports (lazy ones included; a package's __init__ aside) has no cycle."""
    graph = {m: {t for t in our_imports(p) if t != m and MODULES[t].name != "__init__.py"}
             for m, p in MODULES.items()}
    assert find_cycle(graph) is None


def test_core_does_no_io():
    """kvstore.core imports no sockets, threads, processes or signals, and nothing above it."""
    io = {"zmq", "msgpack", "socket", "subprocess", "multiprocessing", "threading", "selectors", "signal",
          "asyncio", "http", "urllib"}
    offenders = {p.relative_to(ROOT).as_posix(): roots(file_imports(p)) & io
                 for p in SOURCES if p.is_relative_to(ROOT / "kvstore" / "core")}
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("limit_kind", ["module", "function"])
def test_size_limits(limit_kind):
    """No module of kvstore/ or scheduler/ over 800 lines (issue 36: a smell, not a cap that cuts a
    class), no function over 50."""
    over = []
    for p in SOURCES:
        source = p.read_text()
        if limit_kind == "module" and source.count("\n") > 800:
            over.append(f"{p.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)) if limit_kind == "function" else ():
            is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_function and node.end_lineno - node.lineno >= 50:
                over.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert over == []


# -- the single-owner rules -------------------------------------------------------------------------

def test_zmq_only_in_transport():
    """zmq is imported only by kvstore/net/transport.py (and kvstore/net/curve.py, its CURVE keys)."""
    assert users_of("zmq") == {"kvstore/net/transport.py", "kvstore/net/curve.py"}


def test_msgpack_only_in_protocol():
    """msgpack is imported only by kvstore/net/protocol.py."""
    assert users_of("msgpack") == {"kvstore/net/protocol.py"}


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


def test_addresses_only_in_net_address():
    """Address parsing and probing (ipaddress, getaddrinfo, interface ioctls) live in net/address.py."""
    needles = ("ipaddress", "getaddrinfo", "gethostbyname", "SIOCGIFADDR", "def is_loopback",
               "def _is_loopback")
    offenders = {p.relative_to(ROOT).as_posix() for p in SOURCES
                 if any(n in p.read_text() for n in needles)}
    assert offenders <= {"kvstore/net/address.py"}


def test_protocol_and_transport_never_import_each_other():
    """protocol does not import transport and transport does not import protocol."""
    assert "kvstore.net.transport" not in our_imports(ROOT / "kvstore/net/protocol.py")
    assert "kvstore.net.protocol" not in our_imports(ROOT / "kvstore/net/transport.py")


def test_kvstore_never_imports_the_scheduler():
    """No module of kvstore/ imports the scheduler (it is started by module name only)."""
    offenders = {p.relative_to(ROOT).as_posix() for p in SOURCES
                 if p.is_relative_to(ROOT / "kvstore")
                 and any(n == "scheduler" or n.startswith(("scheduler.", "kvstore.scheduler"))
                         for n in file_imports(p))}
    assert offenders == set()


def test_errors_live_in_errors():
    """Every exception class of kvstore/ and scheduler/ is defined in kvstore/errors.py."""
    elsewhere = []
    for p in SOURCES:
        if p == ROOT / "kvstore" / "errors.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception", "Failed"))
                    for b in node.bases):
                elsewhere.append(f"{p.relative_to(ROOT)}: {node.name}")
    assert elsewhere == []


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
