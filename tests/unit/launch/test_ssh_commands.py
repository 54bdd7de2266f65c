"""The ssh launcher's pure parts, kvstore.launch.ssh: the host file, placement, the ssh, rsync and remote
command lines, a remote role's environment (the ssh processes are tested in tests/integration)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.launch.ssh import (
    host_label,
    node_name,
    parse_hostfile,
    placement,
    remote_command,
    remote_environ,
    rsync_command,
    ssh_command,
    tether_grace,
)

# what ssh_options adds after the user's options, with the default KVSTORE_CONNECT_TIMEOUT of 60 s
DEFAULT_SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=60", "-o", "ServerAliveInterval=15",
                       "-o", "ServerAliveCountMax=4"]


def test_hostfile_hosts_ports_and_comments(tmp_path: Path) -> None:
    """One host or host:sshport a line; blank lines and # comments (whole or trailing) are skipped."""
    path = tmp_path / "hosts"
    path.write_text("# the cluster\n\nnode1\n  node2:2222   # a comment\nuser@node3:22\n::1\n"
                    "[::1]:22\n[fe80::1%eth0]\nalice@[2001:db8::7]:2200\n")
    assert parse_hostfile(str(path)) == [("node1", None), ("node2", 2222), ("user@node3", 22), ("::1", None),
                                         ("::1", 22), ("fe80::1%eth0", None), ("alice@2001:db8::7", 2200)]
    assert host_label(("::1", 22)) == "[::1]:22" and host_label(("alice@2001:db8::7", 2200)) == (
        "alice@[2001:db8::7]:2200") and host_label(("::1", None)) == "::1"


@pytest.mark.parametrize("text,message", [("node1:ssh\n", "line 1"), ("a\nnode:0\n", "line 2"),
                                          ("node:70000\n", "line 1"), ("", "no hosts"),
                                          ("# only\n\n", "no hosts"), ("[::1\n", "line 1"),
                                          ("[::1]22\n", "line 1"), ("[::1]:\n", "line 1"),
                                          ("[]:22\n", "line 1"), (":22\n", "line 1"),
                                          ("alice@:22\n", "line 1")])
def test_bad_hostfiles_are_config_errors(tmp_path: Path, text: str, message: str) -> None:
    """A bad port names its line; an empty file (or comments only) says there are no hosts."""
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        parse_hostfile(str(path))


def test_placement_is_servers_then_workers_round_robin() -> None:
    """Process i (servers first, then workers) runs on hosts[i % len(hosts)], as dmlc's ssh launcher."""
    hosts = [("a", None), ("b", 22)]
    assert placement(3, 2, hosts) == [("server", 0, ("a", None)), ("server", 1, ("b", 22)),
                                      ("server", 2, ("a", None)), ("worker", 0, ("b", 22)),
                                      ("worker", 1, ("a", None))]
    assert [host for _, _, host in placement(1, 4, ["only"])] == ["only"] * 5
    with pytest.raises(ValueError):
        placement(1, 1, [])


def test_ssh_command_and_remote_command_quote_everything() -> None:
    """ssh [-p PORT] ARGS -o BatchMode=yes -o ConnectTimeout=T -o ServerAlive... HOST 'cd DIR && exec
    env GRACE PY -m kvstore.launch.tether': the user's options come first (ssh keeps the first value), every
    remote word is shell-quoted, and nothing secret is on it (the environment travels on stdin)."""
    remote = remote_command("/srv/my job", "/opt/py $x/python", 5)
    assert remote == ("cd '/srv/my job' && exec env KVSTORE_SHUTDOWN_TIMEOUT=5 '/opt/py $x/python' "
                      "-m kvstore.launch.tether")
    assert shlex.split(remote)[-3:] == ["/opt/py $x/python", "-m", "kvstore.launch.tether"]
    argv = ssh_command(("node2", 2222), ["-i", "key"], remote)
    assert argv == ["ssh", "-p", "2222", "-i", "key", *DEFAULT_SSH_OPTIONS, "node2", remote]
    assert ssh_command(("node1", None), [], "cmd") == ["ssh", *DEFAULT_SSH_OPTIONS, "node1", "cmd"]
    assert "SECRET=" not in " ".join(argv) and "DMLC_" not in " ".join(argv)
    # ConnectTimeout is KVSTORE_CONNECT_TIMEOUT in whole seconds (rounded up); the user's value comes first
    argv = ssh_command(("::1", None), ["-o", "ConnectTimeout=5"], "cmd", connect_timeout=2.5)
    assert argv[1:3] == ["-o", "ConnectTimeout=5"] and "ConnectTimeout=3" in argv and argv[-2] == "::1"


def test_tether_grace_is_the_roles_shutdown_timeout_else_the_launchers() -> None:
    """The grace a remote tether applies: the KVSTORE_SHUTDOWN_TIMEOUT the launcher sends it (--env can
    raise it), else the one on the tether's command line; an invalid value (refused there) counts as that."""
    assert tether_grace({"KVSTORE_SHUTDOWN_TIMEOUT": "30"}, 5) == 30
    assert tether_grace({}, 5) == 5 and tether_grace({"KVSTORE_SHUTDOWN_TIMEOUT": "soon"}, 5) == 5


def test_remote_environ_forwards_only_kvstore_dmlc_and_omp() -> None:
    """A remote role gets the launcher's KVSTORE_*/DMLC_*/OMP_NUM_THREADS, the role's own variables
    (which win) and DMLC_NODE_HOST = the host's name; nothing else of the launcher's environment."""
    launcher_env = {"KVSTORE_LOG_LEVEL": "INFO", "DMLC_INTERFACE_X": "1", "HOME": "/root", "PATH": "/bin",
                    "KVSTORE_SECRET": "old", "LD_LIBRARY_PATH": "/x"}
    env = remote_environ({"KVSTORE_SECRET": "s", "DMLC_ROLE": "worker"}, "node2", launcher_env,
                         defaults={"OMP_NUM_THREADS": "1"})
    assert env == {"KVSTORE_LOG_LEVEL": "INFO", "DMLC_INTERFACE_X": "1", "KVSTORE_SECRET": "s",
                   "DMLC_ROLE": "worker", "OMP_NUM_THREADS": "1", "DMLC_NODE_HOST": "node2"}
    assert remote_environ({}, "n", {"OMP_NUM_THREADS": "4"}, defaults={"OMP_NUM_THREADS": "1"})[
        "OMP_NUM_THREADS"] == "4"
    # with DMLC_INTERFACE the role binds that interface's address, so no per-host name is imposed
    assert "DMLC_NODE_HOST" not in remote_environ({"DMLC_INTERFACE": "eth0"}, "n", {"DMLC_NODE_HOST": "x"})
    assert node_name("alice@node3") == "node3" and host_label(("n", 22)) == "n:22"


def test_rsync_command_copies_the_content_over_the_same_ssh() -> None:
    """rsync -az SRC/ HOST:DIR with -e carrying the port, the user's ssh options and the launcher's;
    an IPv6 address is bracketed in the destination."""
    argv = rsync_command(("node2", 2222), ["-i", "my key"], "/home/me/job", "/srv/job")
    assert argv[:3] == ["rsync", "-az", "-e"] and argv[4:] == ["/home/me/job/", "node2:/srv/job"]
    assert shlex.split(argv[3]) == ["ssh", "-p", "2222", "-i", "my key", *DEFAULT_SSH_OPTIONS]
    assert rsync_command(("alice@::1", 22), [], "/job", "/srv/job")[-1] == "alice@[::1]:/srv/job"
