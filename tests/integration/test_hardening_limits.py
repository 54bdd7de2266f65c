"""KVSTORE_MAX_MESSAGE_BYTES through real scheduler and server processes.

Under the smallest limit (1 MiB, a header's maximum) with 256 KiB chunks, every message a worker
sends must fit: an INIT of a slice bigger than the limit goes in chunks, pushes too, an adam
state of such a slice is saved, and loaded back in STATE_SET chunks.  Settings that would let a
legitimate message exceed the limit are refused at start, naming the variables.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvstore import config as kvconfig
from kvstore.client.store import DistKVStore
from kvstore.core import checkpoint
from kvstore.core import optimizer as kvopt
from kvstore.errors import ConfigError
from tests.helpers import Processes, poll_for, python

from .conftest import SECRET, Cluster

LIMIT = kvconfig.MIN_MESSAGE_BYTES  # 1 MiB: the smallest limit there is
CHUNK = LIMIT // kvconfig.WHOLE_CHUNKS  # 256 KiB: a slice of 4 chunks is exactly the limit
SMALL = {"KVSTORE_MAX_MESSAGE_BYTES": LIMIT, "KVSTORE_CHUNK_BYTES": CHUNK, "KVSTORE_REQUEST_TIMEOUT": 20}
# 2 servers: 'big' is 4 MiB (2 MiB a server, 8 chunks each), 'odd' 2.4 MB of float64 (1.2 MB a
# server, 5 chunks, the last one short), 'small' travels in a batch.
SHAPES = {"big": ((1024, 1024), np.float32), "odd": ((300_001,), np.float64), "small": ((10,), np.float32)}
ADAM = {"learning_rate": 0.01, "wd": 0.001}


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {k: rng.standard_normal(shape).astype(dtype) for k, (shape, dtype) in SHAPES.items()}


def _grad(step: int, rank: int, key: str) -> np.ndarray:
    shape, dtype = SHAPES[key]
    return np.random.default_rng(100 * step + rank).standard_normal(shape).astype(dtype)


def _total(step: int, key: str) -> np.ndarray:
    return _grad(step, 0, key) + _grad(step, 1, key)  # two workers: the sum is the same in any order


def _steps(kv: DistKVStore, steps: range) -> dict[str, np.ndarray]:
    keys = list(SHAPES)
    for step in steps:
        kv.push(keys, [_grad(step, kv.rank, k) for k in keys])
    return dict(zip(keys, kv.pull(keys)))


def _reference(opt: kvopt.Optimizer, weights: dict[str, np.ndarray], steps: range) -> None:
    """Apply the summed grads of ``steps`` to ``weights`` in place, as one process would."""
    for step in steps:
        for key, weight in weights.items():
            opt.update(key, weight, _total(step, key))


def _assert_same_states(got: checkpoint.StatesFile, want: checkpoint.StatesFile) -> None:
    assert sorted(e.key for e in got.entries) == sorted(e.key for e in want.entries) == sorted(SHAPES)
    wanted = {e.key: e for e in want.entries}
    for entry in got.entries:
        assert entry.count == wanted[entry.key].count
        assert sorted(entry.arrays) == sorted(wanted[entry.key].arrays)
        for name, array in entry.arrays.items():
            np.testing.assert_array_equal(array, wanted[entry.key].arrays[name], err_msg=name)


def test_init_push_adam_and_optimizer_states_fit_a_small_limit(make_cluster, tmp_path: Path) -> None:
    """With a 1 MiB limit and 256 KiB chunks, 2 workers x 2 servers: init of keys whose slices exceed
    the limit, push / pull, adam, save_optimizer_states and load_optimizer_states all work, and every
    value and state is bit-identical to one process doing the same."""
    cluster: Cluster = make_cluster("dist_sync", 2, 2, bound=1000, **SMALL)
    first, second = tmp_path / "after2.states", tmp_path / "reloaded.states"
    keys = list(SHAPES)

    def work(kv: DistKVStore) -> tuple:
        kv.init(keys, [_weights()[k] for k in keys])
        initial = dict(zip(keys, kv.pull(keys)))
        kv.set_optimizer(kvopt.create("adam", **ADAM))
        after2 = _steps(kv, range(2))
        kv.save_optimizer_states(str(first))
        after3 = _steps(kv, range(2, 3))
        kv.load_optimizer_states(str(first))  # back to the state after step 2 (the weights stay)
        kv.save_optimizer_states(str(second))
        after4 = _steps(kv, range(3, 4))  # from the reloaded state
        return initial, after2, after3, after4, kv._path.plan(keys)[0]

    results = cluster.run(work)
    weights, opt = _weights(), kvopt.create("adam", **ADAM)
    _reference(opt, weights, range(2))
    expected2 = {k: w.copy() for k, w in weights.items()}
    _reference(opt, weights, range(2, 3))
    expected3 = {k: w.copy() for k, w in weights.items()}
    saved = checkpoint.read_states(str(first))
    reloaded = checkpoint.restore_optimizer(saved, kvopt.create("adam", **ADAM), weights)
    _reference(reloaded, weights, range(3, 4))
    for initial, after2, after3, after4, sends in results:
        for key in keys:
            np.testing.assert_array_equal(initial[key], _weights()[key], err_msg=key)
            np.testing.assert_array_equal(after2[key], expected2[key], err_msg=key)
            np.testing.assert_array_equal(after3[key], expected3[key], err_msg=key)
            np.testing.assert_array_equal(after4[key], weights[key], err_msg=key)
        assert {s.parts[0].key for s in sends if s.lo is not None} == {"big", "odd"}  # pushed in chunks
    truth = checkpoint.read_states(str(first))
    _check_against(truth, expected2)
    _assert_same_states(checkpoint.read_states(str(second)), truth)


def _check_against(states: checkpoint.StatesFile, weights_after2: dict[str, np.ndarray]) -> None:
    """The saved states are one process's adam states after the first two steps."""
    weights, opt = _weights(), kvopt.create("adam", **ADAM)
    _reference(opt, weights, range(2))
    for key in SHAPES:
        np.testing.assert_array_equal(weights[key], weights_after2[key])
    want = checkpoint.StatesFile(None, opt.num_update, [
        checkpoint.StateEntry(k, SHAPES[k][0], np.dtype(SHAPES[k][1]), *opt.get_state(k)) for k in SHAPES])
    _assert_same_states(states, want)


def _scheduler(env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a scheduler with ``env`` until it exits (it must refuse to start at once)."""
    full = {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "0",
            "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "KVSTORE_SECRET": SECRET,
            "KVSTORE_CONNECT_TIMEOUT": "10", **env}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "DMLC_"))}
    return subprocess.run([python(), "-m", "kvstore.scheduler"], env={**base, **full}, capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("env,names", [
    ({"KVSTORE_CHUNK_BYTES": "0"}, ["KVSTORE_CHUNK_BYTES=0", "KVSTORE_MAX_MESSAGE_BYTES=16777216"]),
    ({"KVSTORE_CHUNK_BYTES": "0", "KVSTORE_MAX_MESSAGE_BYTES": str(LIMIT)},
     ["KVSTORE_CHUNK_BYTES=0", f"KVSTORE_MAX_MESSAGE_BYTES={LIMIT}"]),
    ({"KVSTORE_CHUNK_BYTES": str(CHUNK + 1), "KVSTORE_MAX_MESSAGE_BYTES": str(LIMIT)},
     [f"KVSTORE_CHUNK_BYTES={CHUNK + 1}", f"KVSTORE_MAX_MESSAGE_BYTES={LIMIT}", f"at most {CHUNK}"]),
    ({"KVSTORE_BATCH_BYTES": str(LIMIT + 1), "KVSTORE_MAX_MESSAGE_BYTES": str(LIMIT),
      "KVSTORE_CHUNK_BYTES": str(CHUNK)}, [f"KVSTORE_BATCH_BYTES={LIMIT + 1}"]),
], ids=["chunking-off", "chunking-off-small-limit", "chunks-too-big", "batches-too-big"])
def test_settings_that_would_exceed_the_limit_are_refused_at_start(env: dict, names: list[str]) -> None:
    """The scheduler refuses to start (exit 1, before it binds) with a ConfigError naming the variables
    when a legitimate message could exceed the limit."""
    done = _scheduler(env)
    assert done.returncode == 1, done.stderr
    for name in names:
        assert name in done.stderr, done.stderr
    assert "listening on port" not in done.stderr


def test_a_worker_whose_batches_exceed_the_clusters_limit_is_refused(make_cluster) -> None:
    """A worker's own KVSTORE_BATCH_BYTES is checked against the limit in the scheduler's map:
    kvstore.create raises ConfigError naming both, after telling the scheduler, which then declares
    the worker lost (so no other worker waits for it) and stops the cluster."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False, **SMALL)
    cfg = dataclasses.replace(cluster.cfg, batch_bytes=2 * LIMIT)
    with pytest.raises(ConfigError, match=rf"KVSTORE_BATCH_BYTES={2 * LIMIT} exceeds "
                                          rf"KVSTORE_MAX_MESSAGE_BYTES={LIMIT} \(the scheduler's\)"):
        DistKVStore("dist_sync", cfg)
    scheduler = cluster.procs.procs[0][1]
    poll_for(lambda: scheduler.poll() is not None, 20, "the scheduler's exit")
    assert scheduler.returncode == 1
    assert "worker 0 on" in cluster.procs.output() and "its settings were refused" in cluster.procs.output()


def test_a_server_with_a_smaller_limit_than_the_scheduler_refuses_to_serve(tmp_path: Path) -> None:
    """A server whose own limit is below the map's would cut off workers' legitimate messages: it exits
    with a ConfigError naming both limits as soon as the map arrives."""
    procs = Processes(tmp_path)
    env = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
           "KVSTORE_SECRET": SECRET, "KVSTORE_CONNECT_TIMEOUT": "20", "KVSTORE_SHUTDOWN_TIMEOUT": "2",
           "KVSTORE_MAX_MESSAGE_BYTES": str(2 * LIMIT), "KVSTORE_CHUNK_BYTES": str(CHUNK)}
    port_file = tmp_path / "scheduler.port"
    worker = None
    try:
        procs.start("scheduler", [python(), "-m", "kvstore.scheduler"],
                    {**env, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_PORT": "0",
                     "KVSTORE_PORT_FILE": str(port_file)})
        poll_for(port_file.exists, 30, "the scheduler's port file")
        env["DMLC_PS_ROOT_PORT"] = port_file.read_text().strip()
        server = procs.start("server", [python(), "-m", "kvstore.server"],
                             {**env, "DMLC_ROLE": "server", "KVSTORE_MAX_MESSAGE_BYTES": str(LIMIT)})
        # the worker only completes the registration; without shared memory it does not wait out the
        # connect timeout for the dead server's reply to a segment offer
        worker = DistKVStore("dist_sync", kvconfig.load({**env, "DMLC_ROLE": "worker", "KVSTORE_SHM": "0"}))
        poll_for(lambda: server.poll() is not None, 20, "the server's exit")
        assert server.returncode == 1
        log = procs.output()
        assert f"KVSTORE_MAX_MESSAGE_BYTES={LIMIT} is smaller than the scheduler's {2 * LIMIT}" in log, log
    finally:
        if worker is not None:
            worker._close("the test is over")  # no server to drain: report and go
        procs.stop(timeout=10)
