"""Unit tests of kvstore.launch.managers.tfconfig: TensorFlow's TF_CONFIG cluster spec."""

from __future__ import annotations

import pytest

from kvstore import config as kvconfig
from kvstore.errors import ConfigError
from kvstore.launch import managers, node
from kvstore.launch.managers.tfconfig import tf_config
from tests.unit.launch.managers.helpers import tf_env


def test_tf_config_with_chief():
    """ps tasks are servers binding their own address; the chief is worker 0, worker i is i + 1; the
    scheduler runs at the chief's address, hosted by the chief's node."""
    cluster = {"chief": ["c0:2222"], "worker": ["w0:2223", "w1:2224"], "ps": ["p0:3000", "p1:3001"]}
    tasks = [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0), ("ps", 1)]
    found = {task: managers.explain(tf_env(cluster, *task)) for task in tasks}
    for derivation in found.values():
        assert derivation.env["DMLC_PS_ROOT_URI"] == "c0" and derivation.env["DMLC_PS_ROOT_PORT"] == "2222"
        assert (derivation.env["DMLC_NUM_SERVER"], derivation.env["DMLC_NUM_WORKER"]) == ("2", "3")
    assert [found[t].env["DMLC_WORKER_ID"] for t in tasks[:3]] == ["0", "1", "2"]
    assert all(found[t].role == "worker" for t in tasks[:3])
    assert found[("ps", 1)].env == {"DMLC_PS_ROOT_URI": "c0", "DMLC_PS_ROOT_PORT": "2222",
                                    "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "3", "DMLC_ROLE": "server",
                                    "KVSTORE_SERVER_ID": "1", "DMLC_NODE_HOST": "p1",
                                    "KVSTORE_NODE_PORT": "3001"}
    assert [t for t, d in found.items() if d.runs_scheduler] == [("chief", 0)]
    assert found[("chief", 0)].summary() == ("tf_config task chief:0 -> worker 0 and the scheduler, "
                                             "scheduler c0:2222")


def test_tf_config_without_chief():
    """Without a chief worker i is worker i, and worker 0 hosts the scheduler at its address."""
    cluster = {"worker": ["w0:5000", "w1:5001"], "ps": ["[::1]:6000"]}
    results = [managers.explain(tf_env(cluster, "worker", i)) for i in range(2)]
    assert [r.env["DMLC_WORKER_ID"] for r in results] == ["0", "1"]
    assert [r.runs_scheduler for r in results] == [True, False]
    assert {(r.env["DMLC_PS_ROOT_URI"], r.env["DMLC_PS_ROOT_PORT"]) for r in results} == {("w0", "5000")}
    ps = tf_config(tf_env(cluster, "ps", 0))
    assert (ps["DMLC_NODE_HOST"], ps["KVSTORE_NODE_PORT"]) == ("::1", "6000")


def test_tf_config_with_a_scheduler_job():
    """A 'scheduler' job runs the scheduler at its one address; then no task hosts it beside a worker."""
    cluster = {"scheduler": ["s:7000"], "chief": ["c:1"], "worker": ["w:2"], "ps": ["p:3"]}
    sched = managers.explain(tf_env(cluster, "scheduler", 0))
    assert sched.role == "scheduler" and not sched.runs_scheduler
    assert (sched.env["DMLC_PS_ROOT_URI"], sched.env["DMLC_PS_ROOT_PORT"]) == ("s", "7000")
    chief = managers.explain(tf_env(cluster, "chief", 0))
    assert chief.env["DMLC_WORKER_ID"] == "0" and not chief.runs_scheduler
    assert chief.env["DMLC_PS_ROOT_URI"] == "s"


@pytest.mark.parametrize("raw,match", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    ('["a"]', "TF_CONFIG has no 'cluster'"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}}', "TF_CONFIG has no 'task'"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}, "task": {"type": "trainer", "index": 0}}',
     "TF_CONFIG: task type 'trainer' is not one of chief, master, worker, ps"),
    ('{"cluster": {"ps": ["p:1"], "chief": ["c:1"], "master": ["m:1"]}, "task": {"type": "ps", "index": 0}}',
     "both a 'chief' and a 'master' job"),
    ('{"cluster": {"ps": ["p:1"], "master": ["m:1"]}, "task": {"type": "master", "index": 1}}',
     "TF_CONFIG: task master:1 is out of range: cluster.master has 1 address"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}, "task": {"type": "worker", "index": 1}}',
     "TF_CONFIG: task worker:1 is out of range"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}, "task": {"type": "worker", "index": -1}}',
     "TF_CONFIG: task.index = -1"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}, "task": {"type": "evaluator", "index": 0}}',
     "TF_CONFIG: an 'evaluator' task is not part of the cluster"),
    ('{"cluster": {"worker": ["w:2"]}, "task": {"type": "worker", "index": 0}}', "TF_CONFIG: .* no 'ps'"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w"]}, "task": {"type": "worker", "index": 0}}',
     "TF_CONFIG: cluster.worker\\[0\\] = 'w' is not 'host:port'"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}, "task": {"type": "scheduler", "index": 0}}',
     "or 'scheduler', with a scheduler job"),
    ('{"cluster": {"ps": ["p:1"], "scheduler": ["a:1", "b:2"], "worker": ["w:2"]}, '
     '"task": {"type": "worker", "index": 0}}', "cluster.scheduler has 2 addresses"),
])
def test_tf_config_errors_name_tf_config(raw, match):
    """Invalid JSON, unknown task types, evaluators and out-of-range indexes are ConfigErrors."""
    with pytest.raises(ConfigError, match=match):
        managers.derive({"TF_CONFIG": raw})


def test_tf_config_master_is_the_chief():
    """TensorFlow 1's 'master' job and task type are the chief's other name: worker 0, hosting the
    scheduler at its address."""
    cluster = {"master": ["m0:2222"], "worker": ["w0:2223"], "ps": ["p0:3000"]}
    master = managers.explain(tf_env(cluster, "master", 0))
    assert (master.role, master.env["DMLC_WORKER_ID"], master.runs_scheduler) == ("worker", "0", True)
    assert master.summary() == "tf_config task master:0 -> worker 0 and the scheduler, scheduler m0:2222"
    worker = tf_config(tf_env(cluster, "worker", 0))
    assert (worker["DMLC_WORKER_ID"], worker["DMLC_PS_ROOT_URI"]) == ("1", "m0")
    assert worker["DMLC_NUM_WORKER"] == "2"
    # a 'chief' task type in a TF1-style cluster, and the reverse, mean the same task
    assert tf_config(tf_env(cluster, "chief", 0))["DMLC_WORKER_ID"] == "0"
    assert tf_config(tf_env({"chief": ["c:1"], "ps": ["p:2"]}, "master", 0))["DMLC_NODE_HOST"] == "c"


def test_tf_config_interface_wins_over_the_derived_node_host():
    """With DMLC_INTERFACE set, no task gets a derived DMLC_NODE_HOST (it would win over the interface);
    a DMLC_NODE_HOST of the user's is left as the user set it."""
    cluster = {"chief": ["c0:2222"], "worker": ["w0:2223"], "ps": ["p0:3000"]}
    for kind in ("ps", "chief", "worker"):
        plain = tf_config(tf_env(cluster, kind, 0))
        assert plain["DMLC_NODE_HOST"] == f"{kind[0]}0"
        derived = tf_config(tf_env(cluster, kind, 0, DMLC_INTERFACE="eth0"))
        assert "DMLC_NODE_HOST" not in derived
        cfg = kvconfig.load({**tf_env(cluster, kind, 0, DMLC_INTERFACE="eth0"), **derived})
        assert (cfg.interface, cfg.node_host) == ("eth0", None)
        assert node.node_host_env({**tf_env(cluster, kind, 0, DMLC_INTERFACE="eth0"), **derived}) == {}
    ps = tf_config(tf_env(cluster, "ps", 0, DMLC_INTERFACE=" "))  # blank: unset
    assert ps["DMLC_NODE_HOST"] == "p0" and ps["KVSTORE_NODE_PORT"] == "3000"


def test_tf_config_counts_must_agree_with_dmlc_variables():
    """DMLC_NUM_SERVER / DMLC_NUM_WORKER that contradict TF_CONFIG are refused; agreeing ones are fine."""
    cluster = {"chief": ["c:1"], "worker": ["w:2"], "ps": ["p:3"]}
    with pytest.raises(ConfigError, match="DMLC_NUM_SERVER=2 but TF_CONFIG lists 1 ps task"):
        tf_config(tf_env(cluster, "ps", 0, DMLC_NUM_SERVER="2"))
    assert tf_config(tf_env(cluster, "worker", 0, DMLC_NUM_WORKER="2"))["DMLC_WORKER_ID"] == "1"
