"""Test hosts on real network stacks: Linux network namespaces on one machine (docs/hosts.md).

``Hosts(n)`` makes n "hosts", each a network namespace with its own address on a private network, a pid
namespace of its own (so ``/proc`` shows only its processes: a server on one host cannot open a
worker's shared memory on another by pid, as on real machines) and lo up.  The hosts are joined by a
bridge that lives in a namespace of its own: nothing is added to the machine's own interfaces, routes
or addresses, so every instance may use the same subnet, and instances in parallel (pytest-xdist) do
not meet.  Every namespace name starts with :data:`PREFIX`, the creating process's pid and a random
tag, so a run killed before its teardown is swept by the next one (:func:`sweep`).

- ``host.popen(argv, env)`` / ``host.run(argv, env)``: a process inside the host (``nsenter`` into its
  network, pid and mount namespaces); ``host.address`` is its IPv4 address, ``host.name`` its netns.
- ``hosts.link(a, b).rate(mbit)``: shape both directions between two hosts with ``tc htb`` (a class
  per destination on each host's ``eth0``; other traffic is not shaped).
- ``hosts.cut(host)`` / ``hosts.heal(host)``: take the host's port on the bridge down / up (a cable
  pulled at the switch: the host keeps its address, its packets go nowhere).
- ``hosts.partition(a, b)`` / ``hosts.rejoin(a, b)``: cut only the path between two hosts (a
  blackhole route to each other on both; each still reaches the rest).
- ``hosts.relay(at, to_host, to_port, delay)``: a TCP relay listening on ``at`` that forwards to
  ``to_host:to_port`` adding ``delay`` seconds each way (this kernel has no ``netem``; see
  :func:`relay_main`).  It adds latency, not loss: a TCP relay cannot drop segments, and there is
  no ``gact`` or ``netem`` here to drop packets.
- ``hosts.sshd()``: an sshd on port 22 of every host (a namespace's port space is its own) with keys
  made for this instance; ``hosts.ssh_args`` logs in to them.

Teardown (``__exit__``, also after a failed test) kills each host's pid namespace (its init's death
takes every process in it along: sshd, every ssh session, every role), deletes every namespace (their
veths and the bridge go with them) and removes the work directory.  The host inits also die with the
thread that made them (``PR_SET_PDEATHSIG``), so make ``Hosts`` in a thread that outlives it.

Needs root, ``ip``, ``tc``, ``nsenter`` and ``unshare`` (util-linux); :func:`unavailable` says why not.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "kvh"
SUBNET = "10.45.0"  # host i is SUBNET.(i+1)/24; private to each instance's namespaces
SSHD = "/usr/sbin/sshd"
_TOOLS = ("ip", "tc", "nsenter", "unshare")
_PR_SET_PDEATHSIG = 1
# The init of a host's pid namespace: it reaps every orphan (as pid 1 must) until it is killed.
_INIT = ("import os, time\n"
         "while True:\n"
         "    try:\n"
         "        os.wait()\n"
         "    except ChildProcessError:\n"
         "        time.sleep(0.5)\n")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _tc(netns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "tc", *args], capture_output=True, text=True, timeout=30,
                   check=True)


def unavailable() -> str | None:
    """Why namespaced hosts cannot be made here (not root, a tool missing, ``ip netns add`` refused),
    or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces): run as root, as CI does"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    probe = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pids_in_netns(name: str) -> list[int]:
    """Pids of the processes whose network namespace is ``name`` (by the namespace's inode)."""
    try:
        inode = os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.stat(entry / "ns" / "net").st_ino == inode:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _remove_netns(name: str) -> None:
    for pid in _pids_in_netns(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", name, check=False)


def sweep() -> list[str]:
    """Remove the namespaces (and kill their processes) that a run no longer alive left behind: those
    named ``PREFIX<pid>x...`` whose pid is gone.  Returns their names."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    stale = []
    for line in listed:
        name = line.split(" ", 1)[0]
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].partition("x")[0]
        if pid.isdigit() and not _alive(int(pid)):
            stale.append(name)
    for name in stale:
        _remove_netns(name)
    return stale


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Host:
    """One namespaced host: its netns ``name``, ``address``, and processes run inside it."""

    def __init__(self, index: int, name: str, address: str, port: str, workdir: Path) -> None:
        self.index, self.name, self.address = index, name, address
        self.port = port  # its interface on the bridge, in the switch namespace
        self.workdir = workdir
        self.init: subprocess.Popen | None = None  # `unshare`, whose child is the pid namespace's init
        self.init_pid = 0  # that child, as the root pid namespace numbers it

    def __repr__(self) -> str:
        return f"Host({self.index}, {self.address})"

    def _start(self) -> None:
        """Start the host's pid namespace (its init) inside its network namespace."""
        self.init = subprocess.Popen(
            ["ip", "netns", "exec", self.name, "unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
             sys.executable, "-c", _INIT], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 30
        while not self.init_pid:
            children = Path(f"/proc/{self.init.pid}/task/{self.init.pid}/children")
            try:
                found = children.read_text().split()
            except OSError:
                found = []
            if found:
                self.init_pid = int(found[0])
            elif self.init.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {self.index}: its pid namespace did not start "
                                   f"(unshare exited {self.init.poll()})")
            else:
                time.sleep(0.01)  # polling interval of a deadline-bounded wait

    def argv(self, argv: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """``argv`` wrapped to run inside this host (its network, pid and mount namespaces), in ``cwd``."""
        return ["nsenter", "-t", str(self.init_pid), "-n", "-p", "-m", f"--wd={cwd or os.getcwd()}", "--",
                *argv]

    def popen(self, argv: list[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside this host with ``env`` added to this environment (Popen's other
        arguments as given; ``cwd`` is honoured inside).  Its own session unless told otherwise."""
        kwargs.setdefault("start_new_session", True)
        cwd = kwargs.pop("cwd", None)
        return subprocess.Popen(self.argv(argv, cwd), env={**os.environ, **(env or {})}, **kwargs)

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 60,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to its end (``timeout`` seconds at most; raises
        ``subprocess.TimeoutExpired`` past it); output captured as text unless ``stdout`` or ``stderr``
        is given."""
        if "stdout" not in kwargs and "stderr" not in kwargs:
            kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        cwd = kwargs.pop("cwd", None)
        return subprocess.run(self.argv(argv, cwd), env={**os.environ, **(env or {})}, timeout=timeout,
                              **kwargs)

    def _stop(self) -> None:
        for pid in (self.init_pid, self.init.pid if self.init else 0):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)  # pid 1 of the namespace: every process in it dies too
                except ProcessLookupError:
                    pass
        if self.init is not None:
            self.init.wait(30)


@dataclass
class Link:
    """The path between two hosts, both directions."""

    hosts: Hosts
    a: Host
    b: Host

    def rate(self, mbit: float) -> Link:
        """Shape this path to ``mbit`` Mbit/s each way (``tc htb``, a class per destination)."""
        for src, dst in ((self.a, self.b), (self.b, self.a)):
            self.hosts._shape(src, dst, mbit)
        return self


@dataclass(frozen=True)
class Relay:
    """A running delay relay: connect to ``address:port`` (on ``at``) to reach its target."""

    at: Host
    address: str
    port: int
    proc: subprocess.Popen


class Hosts:
    """``n`` namespaced hosts on one private network (see the module's docstring); a context manager."""

    def __init__(self, n: int) -> None:
        if n < 1 or n > 250:
            raise ValueError(f"1 to 250 hosts, not {n}")
        self.n = n
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.ssh_args = ""
        self._made: list[str] = []
        self._shaped: dict[str, set[str]] = {}
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Hosts:
        try:
            sweep()
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def _netns(self, name: str) -> str:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _make(self) -> None:
        self._netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n):
            name = self._netns(f"{self.tag}-h{i}")
            port = f"h{i}"
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            host = Host(i, name, f"{SUBNET}.{i + 1}", port, self.workdir)
            self.hosts.append(host)
            host._start()

    def link(self, a: Host, b: Host) -> Link:
        """The path between hosts ``a`` and ``b``: ``.rate(mbit)`` shapes it."""
        return Link(self, a, b)

    def _shape(self, src: Host, dst: Host, mbit: float) -> None:
        with self._lock:
            peers = self._shaped.setdefault(src.name, set())
            if not peers:  # unclassified traffic (default 0: no such class) goes unshaped
                _tc(src.name, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "0")
            verb = "change" if dst.address in peers else "add"
            classid = f"1:{dst.index + 10:x}"
            _tc(src.name, "class", verb, "dev", "eth0", "parent", "1:", "classid", classid, "htb",
                "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit")
            if verb == "add":
                _tc(src.name, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1",
                    "u32", "match", "ip", "dst", f"{dst.address}/32", "flowid", classid)
                peers.add(dst.address)

    def cut(self, host: Host) -> None:
        """Cut ``host`` off the network: its port on the bridge goes down (its own ``eth0`` stays
        configured; what it sends goes nowhere)."""
        _ip("-n", self.switch, "link", "set", host.port, "down")

    def heal(self, host: Host) -> None:
        """Undo :meth:`cut`: the host's port on the bridge comes back up."""
        _ip("-n", self.switch, "link", "set", host.port, "up")

    def partition(self, a: Host, b: Host) -> None:
        """Cut the path between ``a`` and ``b`` only (a blackhole route to each other on both): each
        still reaches every other host."""
        _ip("-n", a.name, "route", "add", "blackhole", f"{b.address}/32")
        _ip("-n", b.name, "route", "add", "blackhole", f"{a.address}/32")

    def rejoin(self, a: Host, b: Host) -> None:
        """Undo :meth:`partition` of ``a`` and ``b``."""
        _ip("-n", a.name, "route", "del", "blackhole", f"{b.address}/32", check=False)
        _ip("-n", b.name, "route", "del", "blackhole", f"{a.address}/32", check=False)

    def relay(self, at: Host, to: Host, to_port: int, delay: float, listen: str | None = None,
              port: int = 0) -> Relay:
        """Start a TCP relay on ``at`` (on ``listen``, default its address, and ``port``, default a free
        one) forwarding to ``to.address:to_port`` with ``delay`` seconds added to each direction.
        Raises RuntimeError if it does not start."""
        argv = [sys.executable, "-m", "tests.hosts", "relay", listen or at.address, to.address, str(to_port),
                str(delay), str(port)]
        proc = at.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        cwd=Path(__file__).resolve().parent.parent)
        self._procs.append(proc)
        line = proc.stdout.readline()  # it prints its port, or dies (EOF) with its error
        if not line.startswith("PORT "):
            raise RuntimeError(f"the relay on {at} did not start: {line}{proc.stdout.read()}")
        return Relay(at, listen or at.address, int(line.split()[1]), proc)

    def sshd(self) -> str:
        """Start an sshd on port 22 of every host, accepting a key made for these hosts; return the
        ``--ssh-args`` (also ``self.ssh_args``) that log in to them.  Raises RuntimeError when one
        does not listen within 30 s."""
        keys = self.workdir / "ssh"
        keys.mkdir()
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / key)],
                           check=True, timeout=30, capture_output=True)
        shutil.copy(keys / "client_key.pub", keys / "authorized_keys")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
        started = []
        for host in self.hosts:
            config = keys / f"sshd_config-{host.index}"
            config.write_text("\n".join([
                "Port 22", f"ListenAddress {host.address}", f"HostKey {keys / 'host_key'}",
                f"AuthorizedKeysFile {keys / 'authorized_keys'}",
                f"PidFile {keys / f'sshd-{host.index}.pid'}", "StrictModes no", "UsePAM no",
                "PermitRootLogin prohibit-password", "PubkeyAuthentication yes", "PasswordAuthentication no",
                "KbdInteractiveAuthentication no", "LogLevel INFO", ""]))
            log = keys / f"sshd-{host.index}.log"
            with open(log, "wb") as fh:
                proc = host.popen([SSHD, "-D", "-e", "-f", str(config)], stdout=fh, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
            self._procs.append(proc)
            started.append((host, proc, log))
        deadline = time.monotonic() + 30
        for host, proc, log in started:
            while "Server listening" not in log.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {host} did not start:\n{log.read_text(errors='replace')}")
                time.sleep(0.02)  # polling interval of a deadline-bounded wait
        self.ssh_args = shlex.join(["-F", "/dev/null", "-i", str(keys / "client_key"),
                                    "-o", "IdentitiesOnly=yes", "-o", "UserKnownHostsFile=/dev/null",
                                    "-o", "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR"])
        return self.ssh_args

    def close(self) -> None:
        """Kill every process in the hosts, delete every namespace and the work directory (idempotent)."""
        for host in self.hosts:
            host._stop()
        for proc in self._procs:
            try:
                proc.wait(10)  # nsenter exits once its child (in the dead pid namespace) is gone
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        for name in reversed(self._made):
            _remove_netns(name)
        self._made.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)


# -- the delay relay ------------------------------------------------------------------------------------


def _pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
    """Copy ``src`` to ``dst``, each chunk sent ``delay`` seconds after it arrived (pipelined: the delay
    adds latency, not a limit on the rate); half-close ``dst`` at ``src``'s end."""
    import queue

    chunks: queue.Queue = queue.Queue()

    def send() -> None:
        while True:
            due, data = chunks.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the added latency itself
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    while True:
        try:
            data = src.recv(1 << 16)
        except OSError:
            data = b""
        chunks.put((time.monotonic() + delay, data))
        if not data:
            break
    sender.join()


def relay_main(listen: str, target: str, target_port: int, delay: float, port: int = 0) -> None:
    """Accept on ``listen:port`` (0: a free port; printed as ``PORT n``); relay each connection to
    ``target:target_port`` through two :func:`_pump` threads.  Runs until killed."""
    server = socket.create_server((listen, port))
    print(f"PORT {server.getsockname()[1]}", flush=True)
    while True:
        client, _ = server.accept()
        try:
            upstream = socket.create_connection((target, target_port), timeout=10)
        except OSError:
            client.close()
            continue
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_pump, args=(client, upstream, delay), daemon=True).start()
        threading.Thread(target=_pump, args=(upstream, client, delay), daemon=True).start()


if __name__ == "__main__":
    if len(sys.argv) in (6, 7) and sys.argv[1] == "relay":
        relay_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]),
                   int(sys.argv[6]) if len(sys.argv) == 7 else 0)
    else:
        sys.exit("usage: python -m tests.hosts relay LISTEN_ADDRESS TARGET TARGET_PORT DELAY_S [PORT]")
