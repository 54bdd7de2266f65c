"""The ssh launcher's parts: the host file, where each role runs, the ssh and rsync command lines,
what a remote role's environment carries, and the copy of the working directory to the hosts.

A remote role runs under a :mod:`kvstore.launch.tether` that ssh starts on its host: the role's argv
and environment travel on the tether's stdin, never on a command line.  :func:`start_remote` starts
one (the ssh placement of a :class:`~kvstore.launch.roleprocess.RoleProcess`); the processes are
supervised by :mod:`kvstore.launch.local`.
"""

from __future__ import annotations

import logging
import math
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from typing import NamedTuple, TypeVar

from kvstore import config as kvconfig
from kvstore.errors import ConfigError, SyncFailed
from kvstore.launch import envrules as roles
from kvstore.launch import tether
from kvstore.launch.interrupts import held_interrupts
from kvstore.launch.roleprocess import RoleSpec
from kvstore.net import address

log = logging.getLogger("kvstore.launcher")
H = TypeVar("H")

# sshd's default MaxStartups 10:30:100 drops new connections at random once 10 are not yet logged in:
# at most this many ssh clients to one host are started and not yet through (their tether said
# tether.STARTED, so the login is over); the next one starts when one of them is through or has exited.
SSH_STARTING_PER_HOST = 8
# How long past a remote tether's own grace the launcher waits before it kills the ssh client: the
# tether's grace runs from when the end of file reaches it, across the network.
SSH_STOP_MARGIN = 5.0
# Liveness of every ssh connection (and rsync's): a host that stops answering ends ssh with code 255
# after ServerAliveInterval * ServerAliveCountMax seconds (a minute) instead of TCP's hours.
SSH_ALIVE_INTERVAL, SSH_ALIVE_COUNT = 15, 4


def parse_hostfile(path: str) -> list[tuple[str, int | None]]:
    """Read an MXNet-style host file: one ``host`` or ``host:port`` (ssh port) per line; an IPv6
    address with a port is written ``[addr]:port`` (``[addr]`` and a bare ``addr`` work too).

    Blank lines and ``#`` comments are skipped.  Raises ConfigError for an
    unreadable or empty file or a bad entry or port.
    """
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"-H {path}: {exc.strerror}") from None
    hosts: list[tuple[str, int | None]] = []
    for number, line in enumerate(lines, 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            host, port = address.split_login(entry)
        except ValueError:
            port = ""  # reported below
        if port is None:
            hosts.append((host, None))
            continue
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"-H {path} line {number}: {entry!r} is not host, host:port or [addr]:port")
        hosts.append((host, int(port)))
    if not hosts:
        raise ConfigError(f"-H {path}: no hosts in it")
    return hosts


def placement(num_servers: int, num_workers: int, hosts: Sequence[H]) -> list[tuple[str, int, H]]:
    """Return ``(role, rank, host)`` for every server, then every worker: process i runs on
    ``hosts[i % len(hosts)]`` (dmlc's ssh launcher's order).  Raises ValueError without hosts."""
    if not hosts:
        raise ValueError("placement needs at least one host")
    roles = [("server", rank) for rank in range(num_servers)]
    roles += [("worker", rank) for rank in range(num_workers)]
    return [(role, rank, hosts[i % len(hosts)]) for i, (role, rank) in enumerate(roles)]


def bracketed(name: str) -> str:
    """``user@addr`` with an IPv6 ``addr`` as ``user@[addr]`` (so a ``:`` after it is not read as its own);
    any other name as it is."""
    user, at, node = name.rpartition("@")
    return f"{user}{at}[{node}]" if ":" in node else name


def host_label(host: tuple[str, int | None]) -> str:
    """``host`` or ``host:port`` as the hostfile wrote it, ``[addr]:port`` for IPv6 (for messages)."""
    name, port = host
    return name if port is None else f"{bracketed(name)}:{port}"


def node_name(host: str) -> str:
    """The machine part of an ssh destination: ``user@node`` -> ``node``."""
    return host.rpartition("@")[2]


def ssh_options(port: int | None, ssh_args: list[str], connect_timeout: float) -> list[str]:
    """``[-p PORT] SSH_ARGS`` and then the launcher's defaults: ``-o BatchMode=yes`` (never prompt),
    ``-o ConnectTimeout=`` ``connect_timeout`` rounded up (seconds to connect), ``-o ServerAliveInterval=15
    -o ServerAliveCountMax=4`` (a host that stops answering ends ssh after a minute).  ``ssh_args``
    come first, so the user's value of an option wins (ssh keeps the first value)."""
    return [*(["-p", str(port)] if port is not None else []), *ssh_args, "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={max(1, math.ceil(connect_timeout))}",
            "-o", f"ServerAliveInterval={SSH_ALIVE_INTERVAL}", "-o", f"ServerAliveCountMax={SSH_ALIVE_COUNT}"]


def ssh_command(host: tuple[str, int | None], ssh_args: list[str], remote: str,
                connect_timeout: float = kvconfig.DEFAULT_CONNECT_TIMEOUT) -> list[str]:
    """Return the ssh client's argv that runs the shell command ``remote`` on ``host``:
    ``ssh`` :func:`ssh_options` ``HOST REMOTE``."""
    name, port = host
    return ["ssh", *ssh_options(port, ssh_args, connect_timeout), name, remote]


def remote_command(directory: str, python: str, grace: float) -> str:
    """The shell command ssh runs on a host: a tether in ``directory`` under ``python``.

    Only the tether's own stop grace (``KVSTORE_SHUTDOWN_TIMEOUT``, not a secret) is on this line;
    the role's argv and environment travel on the tether's stdin.  Every word is shell-quoted.
    """
    return (f"cd {shlex.quote(directory)} && exec env KVSTORE_SHUTDOWN_TIMEOUT={grace:g} "
            f"{shlex.quote(python)} -m kvstore.launch.tether")


def remote_environ(extra: Mapping[str, str], node: str, environ: Mapping[str, str] | None = None,
                   defaults: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return what a remote role's environment gets on top of its host's own (the ssh login's).

    ``defaults`` < :func:`kvstore.launch.envrules.forwarded` of ``environ`` (default: the launcher's; its
    ``KVSTORE_*``, ``DMLC_*`` and ``OMP_NUM_THREADS`` but the per-role ones) < ``extra``; then
    ``DMLC_NODE_HOST=node``, unless ``DMLC_INTERFACE`` is set (the role then binds that interface's
    address).  Nothing else of ``environ`` is sent.
    """
    source = kvconfig.child_environ({}) if environ is None else environ  # {} -> the launcher's own
    env = kvconfig.child_environ(extra, environ=roles.forwarded(source), defaults=defaults)
    return roles.with_node_host(env, node)


def rsync_command(host: tuple[str, int | None], ssh_args: list[str], source: str, dest: str,
                  connect_timeout: float = kvconfig.DEFAULT_CONNECT_TIMEOUT) -> list[str]:
    """Return ``rsync -az`` of ``source``'s content into ``dest`` on ``host`` over the same ssh (with the
    same :func:`ssh_options`); an IPv6 address is bracketed in the destination, as rsync wants."""
    name, port = host
    shell = shlex.join(["ssh", *ssh_options(port, ssh_args, connect_timeout)])
    return ["rsync", "-az", "-e", shell, source.rstrip("/") + "/", f"{bracketed(name)}:{dest}"]


def tether_grace(env: Mapping[str, str], default: float) -> float:
    """The grace a remote tether gives its role between SIGTERM and SIGKILL, given ``env``, the
    environment the launcher sends it: its ``KVSTORE_SHUTDOWN_TIMEOUT``, else ``default`` (the value
    :func:`remote_command` puts on the tether's command line).  An invalid value makes the tether
    refuse the request at once, so ``default`` is returned for it."""
    try:
        return kvconfig.load({"KVSTORE_SHUTDOWN_TIMEOUT": env.get("KVSTORE_SHUTDOWN_TIMEOUT")
                              or f"{default:g}"}).shutdown_timeout
    except ConfigError:
        return default


class RemoteRole(NamedTuple):
    """How a role is started on a host under a tether: its environment (sent on the tether's stdin),
    the grace its tether gives it between SIGTERM and SIGKILL, and the ssh argv that starts the tether."""

    env: dict[str, str]
    grace: float
    via: list[str]


def remote_role(host: tuple[str, int | None], extra: Mapping[str, str], defaults: Mapping[str, str] | None,
                *, directory: str, python: str, ssh_args: list[str], settings: kvconfig.Config) -> RemoteRole:
    """The :class:`RemoteRole` of a role with the variables ``extra`` (over ``defaults``) on ``host``,
    run in ``directory`` with ``python`` there, with the launcher's ``settings``.  Raises nothing."""
    env = remote_environ(extra, node_name(host[0]), defaults=defaults)
    grace = tether_grace(env, settings.shutdown_timeout)
    remote = remote_command(directory, python, settings.shutdown_timeout)
    return RemoteRole(env, grace, ssh_command(host, ssh_args, remote, settings.connect_timeout))


def start_remote(spec: RoleSpec, via: list[str]) -> subprocess.Popen:
    """Start ``spec`` on its host: ``via`` (the ssh argv of :func:`remote_role`) runs a tether there that
    announces itself, and gets the role's argv and environment on its stdin.  The ssh client runs in a
    session and process group of its own, its stdout and stderr in one pipe.  Raises OSError."""
    return tether.spawn(spec.argv, spec.env, via=via, announce=True, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, start_new_session=True)


def sync_dir(hosts: list[tuple[str, int | None]], ssh_args: list[str], source: str, dest: str,
             connect_timeout: float = kvconfig.DEFAULT_CONNECT_TIMEOUT) -> None:
    """rsync ``source`` into ``dest`` on every distinct host, in parallel.

    There is no overall deadline (a copy takes as long as its size needs); a stalled one is ended by
    the ssh options (:func:`ssh_options`: ``connect_timeout`` to connect, a minute of silence from
    the host), and an interrupt ends the wait.  Raises SyncFailed (with rsync's output and code) when
    any fails; rsync processes still running then (or on an interrupt) are killed and reaped.
    """
    procs: list[tuple[tuple[str, int | None], subprocess.Popen]] = []
    try:
        for host in dict.fromkeys(hosts):
            log.info("rsync %s/ to %s on %s", source.rstrip("/"), dest, host_label(host))
            try:
                with held_interrupts():  # an interrupt comes after the append, so the kill below sees it
                    procs.append((host, subprocess.Popen(
                        rsync_command(host, ssh_args, source, dest, connect_timeout),
                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        start_new_session=True)))
            except OSError as exc:
                raise SyncFailed(f"cannot start rsync for --sync-dst-dir: {exc}", 127) from None
        for host, proc in procs:
            out = proc.communicate()[0].decode(errors="replace").strip()
            if proc.returncode:
                code = roles.exit_code(proc.returncode)
                raise SyncFailed(f"--sync-dst-dir: rsync to {dest} on {host_label(host)} exited with code "
                                 f"{code}: {out or '(no output)'}", code)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

