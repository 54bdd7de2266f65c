"""kvstore/launch has one implementation of what a launcher does with a role's process: the output pump,
reading the published port, watching the exit, signalling and stopping a process group.  They live in
kvstore/launch/roleprocess.py; every other module of kvstore/launch (the local and ssh launchers,
the Ray actor, the Spark tasks, the tether, kvstore.node) goes through it.  Checked by reading the
source (no imports run), so a second copy of any of them fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[3] / "kvstore" / "launch"
OWNER = LAUNCH / "roleprocess.py"
OTHERS = sorted(p for p in LAUNCH.rglob("*.py") if p != OWNER)

# what only roleprocess.py may do, as the attribute or function names that do it
PUMP = {"readline", "readlines"}  # reading a child's output line by line: a pump
PORT = {("portfile", "read"), ("portfile", "wait")}  # polling the port file
STOP = {"killpg", "waitid", "stop_group", "group_alive", "_signal_group", "terminate", "send_signal"}


def _names_used(tree: ast.AST) -> set[str]:
    """Every attribute name and every called bare name in ``tree``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            found.add(node.func.id)
        elif isinstance(node, ast.ImportFrom):
            found.update(alias.name for alias in node.names)
    return found


def _portfile_reads(tree: ast.AST) -> set[tuple[str, str]]:
    """``portfile.read`` / ``portfile.wait`` used in ``tree``, or imported by name from portfile."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            found.add((node.value.id, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("portfile"):
            found.update(("portfile", alias.name) for alias in node.names)
    return found & PORT


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text())


def test_the_scan_sees_the_launch_modules_and_what_the_owner_does() -> None:
    """The scan covers the launchers, and finds the pump, the port read and the stop in roleprocess.py
    (so a rename there cannot make the rules below pass vacuously)."""
    names = {p.relative_to(LAUNCH).as_posix() for p in OTHERS}
    assert {"local.py", "ssh.py", "group.py", "tether.py", "ray_actor.py", "ray_job.py", "spark_tasks.py",
            "node.py", "portfile.py"} <= names
    owner = _tree(OWNER)
    assert {"readline", "killpg", "waitid"} <= _names_used(owner)
    assert _portfile_reads(owner) == {("portfile", "wait")}


@pytest.mark.parametrize("path", OTHERS, ids=lambda p: p.relative_to(LAUNCH).as_posix())
def test_no_other_module_pumps_output_or_stops_a_group(path: Path) -> None:
    """No module but roleprocess.py reads a child's output line by line, or calls killpg, waitid, a
    group-stopping helper, Popen.terminate or Popen.send_signal."""
    assert _names_used(_tree(path)) & (PUMP | STOP) == set()


@pytest.mark.parametrize("path", [p for p in OTHERS if p.name != "portfile.py"],
                         ids=lambda p: p.relative_to(LAUNCH).as_posix())
def test_no_other_module_polls_the_port_file(path: Path) -> None:
    """No module but roleprocess.py (and portfile.py, which defines them) calls portfile.read or
    portfile.wait: every launcher reads a published port through roleprocess.read_port."""
    assert _portfile_reads(_tree(path)) == set()


@pytest.mark.parametrize("module", ["local.py", "group.py", "ray_actor.py", "spark_tasks.py", "tether.py",
                                    "node.py"])
def test_every_launcher_holds_its_processes_as_role_processes(module: str) -> None:
    """The local and ssh launchers (through the group), the Ray actor, the Spark tasks, the tether and
    the TF_CONFIG chief's node all use RoleProcess, and no module keeps a process class of its own
    (the former local.Child, spark_tasks._Role)."""
    tree = _tree(LAUNCH / module)
    assert "RoleProcess" in {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    classes = {node.name for p in OTHERS for node in ast.walk(_tree(p)) if isinstance(node, ast.ClassDef)}
    assert not classes & {"Child", "_Role"}
