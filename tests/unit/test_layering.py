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

# Lowest first: eight tiers, the folders of docs/architecture.md's table.  A unit is a subpackage
# (every module in it) or a single top-level module.  A module imports units on its own tier or below,
# never above; the module graph has no cycle (test_no_import_cycles), which orders a tier's units.
LAYERS: list[tuple[str, ...]] = [
    ("kvstore.errors", "kvstore.config", "kvstore.logs", "kvstore.heap"),   # foundation
    ("kvstore.core",),                                                      # pure logic, no I/O
    ("kvstore.net", "kvstore.device", "kvstore.data", "kvstore.sparse",     # sockets; GPU sums; sharding;
     "kvstore.base"),                                                       # row-sparse args; the ABC
    ("kvstore.client", "kvstore.local", "kvstore.server", "kvstore.stores"),  # the stores, the server
    ("kvstore.trainer", "kvstore.trainer_sparse",                            # the torch layer
     "kvstore.overlap", "kvstore.torch_optim", "kvstore.sparse_reduce", "kvstore.pipeline",
     "kvstore.session"),
    ("kvstore.launch", "kvstore.ray", "kvstore.spark"),                     # starting clusters
    ("kvstore", "kvstore.node", "kvstore.status"),                          # the public surface, commands
    ("kvstore.scheduler",),                                                 # a program over kvstore
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


def test_at_most_eight_tiers():
    """The layer table has at most eight tiers (docs/architecture.md draws the same)."""
    assert len(LAYERS) <= 8


def test_imports_point_down_the_layers():
    """Every import of ours (lazy ones included) goes to a lower tier or stays on its own."""
    upward = []
    for module, path in MODULES.items():
        level, _ = layer_of(module)
        for target in our_imports(path):
            if layer_of(target)[0] > level:
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


# -- explicit owners ----------------------------------------------------------------------------------

CLASSES = {node.name: p for p in SOURCES for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.ClassDef)}
# Names that hold the project's own objects when they appear as a parameter or attribute: the owners
# (a store, the server, the scheduler...), their settings, and the parts handed to collaborators.  An
# alias (``X = Any``) is caught by these names and by every class name of ours.
HIDDEN_OWNER_NAMES = {"store", "kv", "kvstore", "server", "sched", "scheduler", "owner", "trainer", "pipe",
                      "pipeline", "cfg", "config", "settings", "state", "io", "mux", "link", "window",
                      "router", "channel", "meter", "peers", "shm", "service", "requests", "datapath",
                      "data_path", "restored", "writer", "compression", "heartbeat", "barriers", "lanes"}


def _is_any(annotation: ast.expr | None) -> bool:
    """``Any`` or ``object`` (bare, or as typing.Any), also as a string annotation."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.strip() in ("Any", "object", "typing.Any")
    if isinstance(annotation, ast.Name):
        return annotation.id in ("Any", "object")
    return isinstance(annotation, ast.Attribute) and annotation.attr == "Any"


def hidden_owners(source: str) -> list[str]:
    """Parameters, attributes and aliases in ``source`` that hold a project object behind ``Any``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in args.posonlyargs + args.args + args.kwonlyargs:
                if _is_any(arg.annotation) and arg.arg.lstrip("_") in HIDDEN_OWNER_NAMES:
                    found.append(f"{node.lineno}: parameter {arg.arg}")
        elif isinstance(node, ast.AnnAssign) and _is_any(node.annotation):
            target = node.target
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            if name.lstrip("_") in HIDDEN_OWNER_NAMES:
                found.append(f"{node.lineno}: attribute {name}")
        elif isinstance(node, ast.Assign) and _is_any(node.value):
            for target in node.targets:
                name = getattr(target, "id", "")
                if name in CLASSES or name.lower() in HIDDEN_OWNER_NAMES:
                    found.append(f"{node.lineno}: alias {name}")
    return found


def test_hidden_owner_finder_sees_each_form():
    """hidden_owners finds an Any parameter, attribute and alias that hold our objects, not an array."""
    source = ("Scheduler = Any\nclass A:\n    store: Any = None\n    def f(self, server: Any, value: Any,"
              " io: 'Any') -> None:\n        self.mux: object = None\n")
    assert sorted(line.split(": ", 1)[1] for line in hidden_owners(source)) == sorted(
        ["alias Scheduler", "attribute store", "parameter server", "parameter io", "attribute mux"])


def test_no_project_object_behind_any():
    """No parameter, attribute or alias annotated Any (or object) holds a kvstore or scheduler object:
    the Anys left are external values (arrays, tensors, msgpack bodies, user callables)."""
    offenders = [f"{p.relative_to(ROOT)}:{hit}" for p in SOURCES for hit in hidden_owners(p.read_text())]
    assert offenders == []


def test_no_class_split_over_mixins():
    """A mixin of ours (a plain class without __init__) that only one class extends is a class cut into
    parts to fit a size: keep the class whole, or hand a collaborator a typed part."""
    subclasses: dict[str, list[str]] = {}
    for p in SOURCES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                for base in names & set(CLASSES):
                    subclasses.setdefault(base, []).append(node.name)
    # a mixin: a plain class (no bases) with no __init__ of its own, not usable alone
    mixins = {node.name for p in SOURCES for node in ast.walk(ast.parse(p.read_text()))
              if isinstance(node, ast.ClassDef) and not node.bases and not any(
                  isinstance(f, ast.FunctionDef) and f.name == "__init__" for f in node.body)}
    lone = {base: subs for base, subs in subclasses.items() if len(subs) == 1 and base in mixins}
    assert lone == {}


# -- one owner of the checkpoint-like files (issue 43) -----------------------------------------------

# The modules that own checkpoints, snapshots, optimizer-state files, server shards, worker residual
# files and --resume: each reaches those files only through kvstore.core.storage (so a storage URL
# works everywhere).  A narrow rule: these modules, these calls.  Not covered: the launcher's own port
# and log files (TensorBoard's output among them).
STORAGE_USERS = ("kvstore/core/checkpoint.py", "kvstore/core/snapshot.py", "kvstore/core/shard_image.py",
                 "kvstore/server/shards.py", "kvstore/server/restore.py", "kvstore/client/compress.py",
                 "kvstore/client/collective.py", "kvstore/client/sparse_states.py", "kvstore/local.py",
                 "kvstore/base.py", "kvstore/trainer.py", "kvstore/launch/options.py", "kvstore/spark.py",
                 "kvstore/net/timeline.py", "kvstore/session.py", "kvstore/launch/eventfile.py")
_FILE_CALLS = {
    "os": {"open", "fdopen", "replace", "rename", "renames", "unlink", "remove", "rmdir", "removedirs",
           "listdir", "scandir", "makedirs", "mkdir", "walk", "stat"},
    "os.path": {"exists", "lexists", "isfile", "isdir", "getsize"},
    "shutil": {"rmtree", "move", "copy", "copy2", "copyfile", "copytree"},
    "np": {"save", "savez", "savez_compressed", "load", "fromfile", "loadtxt", "savetxt", "memmap"},
    "io": {"open"},
}
_FILE_CALLS["numpy"] = _FILE_CALLS["np"]
_PATH_METHODS = {"write_bytes", "read_bytes", "write_text", "read_text", "tofile", "iterdir", "touch",
                 "unlink", "mkdir", "rmdir"}


def bare_file_access(source: str) -> list[str]:
    """Calls in ``source`` that reach a file without kvstore.core.storage: ``open``, ``os.open``,
    ``os.listdir``..., ``np.save``/``np.load``, ``shutil.*``, Path methods (``write_bytes``...), and
    such names imported with ``from``; a call on the ``storage`` module itself is its own."""
    found = []
    imported: set[str] = set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in _FILE_CALLS:
            imported.update(a.asname or a.name for a in node.names if a.name in _FILE_CALLS[node.module])
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and (func.id == "open" or func.id in imported):
            found.append(f"{node.lineno}: {func.id}()")
        elif isinstance(func, ast.Attribute):
            owner = ast.unparse(func.value)
            if func.attr in _FILE_CALLS.get(owner, ()) or (
                    func.attr in _PATH_METHODS and owner != "storage" and owner not in _FILE_CALLS):
                found.append(f"{node.lineno}: {owner}.{func.attr}()")
    return found


def test_bare_file_access_finder_sees_each_form():
    """bare_file_access finds open, os.open, os.path.exists, np.save, a Path's write_bytes and a
    from-imported listdir; storage.read_text and zipfile's zf.open are not bare."""
    source = ("from os import listdir\nopen('x')\nos.open('x', 0)\nos.path.exists('x')\nnp.save('x', a)\n"
              "Path('x').write_bytes(b'')\nlistdir('.')\nstorage.read_text('x')\nzf.open('m')\n")
    assert [hit.split(": ")[1] for hit in bare_file_access(source)] == [
        "open()", "os.open()", "os.path.exists()", "np.save()", "Path('x').write_bytes()", "listdir()"]


def test_checkpoint_like_files_only_through_the_storage_module():
    """The modules owning checkpoints, snapshots, state files, shards, residuals and --resume open,
    list, move and remove files only through kvstore.core.storage (which takes storage URLs)."""
    assert all((ROOT / name).is_file() for name in STORAGE_USERS)
    offenders = {name: hits for name in STORAGE_USERS
                 if (hits := bare_file_access((ROOT / name).read_text()))}
    assert offenders == {}
