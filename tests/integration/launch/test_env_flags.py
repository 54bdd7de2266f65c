"""MXNet's per-role launcher flags on a real local cluster: --env-worker reaches only the workers,
--env-server only the servers, and a bare --env NAME passes the launcher's value to every role.

Each role's environment is read from /proc/PID/environ while the cluster runs (the workers wait for
the test to release them), so a server's environment is observed without it logging anything.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import finish, launch, poll_for, tagged_pids

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc/PID/environ")

# A worker: print what it got, then wait (polling, with a deadline) for the test to release it.
WORKER = """\
import os, sys, time
print('got', os.environ.get('KV_ENVTEST_WORKER'), os.environ.get('KV_ENVTEST_SERVER'), flush=True)
deadline = time.monotonic() + 40
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)  # the polling interval of a deadline-bounded wait
sys.exit(0 if os.path.exists(sys.argv[1]) else 3)
"""


def _environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with ({} once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.timeout(60)
def test_env_server_and_env_worker_reach_only_their_roles(tmp_path: Path) -> None:
    """1 server and 2 workers: every role has the forwarded --env NAME, only the servers their
    --env-server variable, only the workers their --env-worker one (and the worker prints it)."""
    tag = f"envflags-{uuid.uuid4().hex}"
    release = tmp_path / "release"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # the workers never join, so the scheduler and server wait for them until the launcher stops them
    # KVSTORE_SHUTDOWN_TIMEOUT after the last worker (default 10 s): 1 s is enough for that
    env = {**os.environ, "KV_ENVTEST_ALL": tag, "KVSTORE_SHUTDOWN_TIMEOUT": "1"}
    flags = ["--env", "KV_ENVTEST_ALL", "--env-server", f"KV_ENVTEST_SERVER={tag}",
             "--env-worker", f"KV_ENVTEST_WORKER=w-{tag}"]
    proc = launch(["-n", "2", "-s", "1", *flags, sys.executable, str(script), str(release)], env)
    try:
        def roles() -> dict[str, list[dict[str, str]]] | None:
            found: dict[str, list[dict[str, str]]] = {}
            for pid in tagged_pids(f"KV_ENVTEST_ALL={tag}"):
                environ = _environ(pid)
                if "DMLC_ROLE" in environ:  # the launcher itself has no DMLC_ROLE
                    found.setdefault(environ["DMLC_ROLE"], []).append(environ)
            counts = {role: len(found.get(role, [])) for role in ("scheduler", "server", "worker")}
            return found if counts == {"scheduler": 1, "server": 1, "worker": 2} else None

        found = poll_for(roles, 40, "the scheduler, 1 server and 2 workers to be running")
    finally:
        release.touch()
        code, out = finish(proc, 45)
    assert code == 0, out
    assert [e.get("KV_ENVTEST_SERVER") for e in found["server"]] == [tag]
    assert [e.get("KV_ENVTEST_WORKER") for e in found["server"]] == [None]
    assert [e.get("KV_ENVTEST_WORKER") for e in found["worker"]] == [f"w-{tag}"] * 2
    assert [e.get("KV_ENVTEST_SERVER") for e in found["worker"]] == [None] * 2
    assert {"KV_ENVTEST_SERVER", "KV_ENVTEST_WORKER"}.isdisjoint(found["scheduler"][0])
    assert out.count(f"got w-{tag} None") == 2, out
