"""launch.py --launcher mpi without running mpirun: the command line it builds, and how mpirun's tagged
output is read back (roles' lines, the first failed rank)."""

from __future__ import annotations

import io

import pytest

from kvstore.launch import mpirun
from kvstore.launch.options import LaunchConfig, parse_args

pytestmark = pytest.mark.timeout(30)


def contexts(argv: list[str]) -> list[list[str]]:
    """The app contexts of an mpirun command line (split at ``:``), the global options left off."""
    out: list[list[str]] = [[]]
    for word in argv[argv.index("-n"):]:
        if word == ":":
            out.append([])
        else:
            out[-1].append(word)
    return out


def test_one_app_context_per_role_in_the_plans_order() -> None:
    """1 + S + W contexts of kvstore.node: scheduler, servers, workers; shared names by -x NAME only, in
    every context (Open MPI gives a -x to its own context alone: a rank on another host got none of
    them when they stood once before the first); per-role variables and the workers' GPUs on their
    own contexts; no MASTER_ADDR anywhere."""
    cfg = LaunchConfig(2, 1, ["train.py", "--lr", "1"], "mpi", env_server={"S": "1"}, env_worker={"W": "2"},
                       gpus_per_worker=1)
    gpu = [{"CUDA_VISIBLE_DEVICES": str(r), "RANK": str(r)} for r in range(2)]
    argv = mpirun.mpirun_argv(cfg, "/usr/bin/mpirun", ["DMLC_NUM_SERVER", "KVSTORE_SECRET"], "/py", gpu)
    assert argv[:4] == ["/usr/bin/mpirun", "--oversubscribe", "--tag-output", "-n"]
    node = ["/py", "-m", "kvstore.node", "train.py", "--lr", "1"]
    shared = ["-x", "DMLC_NUM_SERVER", "-x", "KVSTORE_SECRET"]
    assert contexts(argv) == [
        ["-n", "1", *shared, "-x", "CUDA_VISIBLE_DEVICES=", *node],
        ["-n", "1", *shared, "-x", "S=1", "-x", "CUDA_VISIBLE_DEVICES=", *node],
        ["-n", "1", *shared, "-x", "W=2", "-x", "CUDA_VISIBLE_DEVICES=0", "-x", "RANK=0", *node],
        ["-n", "1", *shared, "-x", "W=2", "-x", "CUDA_VISIBLE_DEVICES=1", "-x", "RANK=1", *node]]
    assert not any("MASTER_" in word or "SECRET=" in word for word in argv)


def test_hosts_place_the_scheduler_first_then_round_robin() -> None:
    """-H a, b: the scheduler on a, then server 0 on a, worker 0 on b, worker 1 on a (i mod hosts)."""
    cfg = LaunchConfig(2, 1, ["t.py"], "mpi", hosts=[("u@a", None), ("b", None)])
    hosts = [ctx[ctx.index("-H") + 1] for ctx in contexts(mpirun.mpirun_argv(cfg, "mpirun", [], "py", None))]
    assert hosts == ["a", "a", "b", "a"]
    shared = mpirun.shared_env(cfg, "s3cret", {"KVSTORE_LOG_LEVEL": "INFO", "HOME": "/root"})
    assert shared["DMLC_PS_ROOT_URI"] == "a" and shared["KVSTORE_SECRET"] == "s3cret"
    assert shared["KVSTORE_LOG_LEVEL"] == "INFO" and "HOME" not in shared
    assert "DMLC_PS_ROOT_PORT" not in shared  # the mpi adapter's port from mpirun's job id


def test_the_mpi_launcher_flags(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """--launcher mpi takes -H of bare host names (optional); ssh ports and other ssh flags are refused."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a\nb\n")
    assert parse_args(["-n", "1", "--launcher", "mpi", "t.py"]).hosts == []
    assert parse_args(["-n", "1", "--launcher", "mpi", "-H", str(hostfile), "t.py"]).hosts == [
        ("a", None), ("b", None)]
    hostfile.write_text("a:2222\n")
    for extra, message in ((["-H", str(hostfile)], "without ssh ports"),
                           (["--ssh-args=-v"], "only apply to --launcher ssh")):
        with pytest.raises(SystemExit) as info:
            parse_args(["-n", "1", "--launcher", "mpi", *extra, "t.py"])
        assert info.value.code == 2 and message in capsys.readouterr().err


def output(names: list[str]) -> tuple[mpirun.TaggedOutput, io.BytesIO]:
    """A TaggedOutput writing to one buffer."""
    sink = io.BytesIO()
    tagged = mpirun.TaggedOutput(names)
    for out in (*tagged.roles, tagged.own):
        out._stream = sink
    return tagged, sink


def test_tagged_fragments_become_whole_prefixed_lines() -> None:
    """mpirun splits a rank's writes into tagged fragments; they are joined per rank into lines."""
    tagged, sink = output(["scheduler", "server 0", "worker 0"])
    tagged.write(b"[1,2]<stdout>:x[1,2]<stdout>: [1,2]<stdout>:1[1,2]<stdout>:\n")
    tagged.write(b"[1,1]<stdout>:half[1,0]<stdout>:hello\n")
    tagged.write(b"[1,1]<stdout>: done\n")
    tagged.write(b"plain line of mpirun\n")
    tagged.flush()
    assert sink.getvalue().decode().splitlines() == [
        "[worker 0] x 1", "[scheduler] hello", "[server 0] half done", "[mpirun] plain line of mpirun"]


def test_the_first_failed_rank_and_its_exception_make_the_summary() -> None:
    """mpirun's report names rank 3 (worker 1) and its code; its traceback's last line ends the summary."""
    tagged, _ = output(["scheduler", "server 0", "worker 0", "worker 1"])
    for line in (b"[1,3]<stderr>:Traceback (most recent call last):\n", b"[1,3]<stderr>:  File \"t.py\"\n",
                 b"[1,3]<stderr>:ValueError: boom\n",
                 b"  Process name: [[4453,1],3]\n", b"  Exit code:    7\n"):
        tagged.write(line)
    tagged.flush()
    assert (tagged.first_failed, tagged.failed_code) == (3, 7)
    assert tagged.summary(7) == "launch.py: worker 1 failed first (exit 7): ValueError: boom"


def test_a_rank_killed_by_a_signal_and_a_peer_reported_first() -> None:
    """A signal gives 128 + n; a scheduler reported first without a traceback yields to the worker
    that printed one (it noticed the worker's death and exited first)."""
    tagged, _ = output(["scheduler", "worker 0"])
    tagged.write(b"mpirun noticed that process rank 1 with PID 0 on node h exited on signal 9 (Killed).\n")
    assert (tagged.first_failed, tagged.failed_code) == (1, 137)
    assert tagged.summary(137) == "launch.py: worker 0 failed first (exit 137)"
    tagged, _ = output(["scheduler", "worker 0"])
    for line in (b"[1,1]<stderr>:Traceback (most recent call last):\n", b"[1,1]<stderr>:KeyError: 'w'\n",
                 b"  Process name: [[1,1],0]\n", b"  Exit code:    1\n"):
        tagged.write(line)
    assert tagged.summary(1) == "launch.py: worker 0 failed first (exit 1): KeyError: 'w'"
