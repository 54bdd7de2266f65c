"""docs/kubernetes/kvstore-job.yaml: its objects agree with each other, and every pod it would start
derives its role with kvstore.launch.managers into exactly one scheduler, servers 0..S-1 and workers
0..W-1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore import config as kvconfig
from kvstore.launch import managers

MANIFEST = Path(__file__).resolve().parents[3] / "docs" / "kubernetes" / "kvstore-job.yaml"
COMMAND = ["python", "-m", "kvstore.node", "train.py"]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    """The manifest's documents."""
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def container(job: dict[str, Any]) -> dict[str, Any]:
    (only,) = job["spec"]["template"]["spec"]["containers"]
    return only


def plain_env(job: dict[str, Any]) -> dict[str, str]:
    """A Job's container env entries that have a literal value."""
    return {e["name"]: e["value"] for e in container(job)["env"] if "value" in e}


def pod_env(job: dict[str, Any], index: int, secrets: dict[str, dict[str, Any]],
            pod_ip: str) -> dict[str, str]:
    """The environment Kubernetes would give pod ``index`` of ``job``: literal values, valueFrom resolved
    (secretKeyRef from the manifest's Secrets, status.podIP faked) and JOB_COMPLETION_INDEX."""
    env = {"JOB_COMPLETION_INDEX": str(index)}
    for entry in container(job)["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        source = entry["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"]]["stringData"][ref["key"]]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[entry["name"]] = pod_ip
        else:
            raise AssertionError(f"unexpected valueFrom {source}")
    return env


def test_the_manifest_holds_a_secret_a_service_and_three_indexed_jobs(docs):
    """One Secret, one ClusterIP Service and the scheduler, servers and workers Jobs."""
    assert sorted(doc["kind"] for doc in docs) == ["Job", "Job", "Job", "Secret", "Service"]
    assert set(by_kind(docs, "Job")) == {"kvstore-scheduler", "kvstore-servers", "kvstore-workers"}
    (service,) = by_kind(docs, "Service").values()
    assert service["spec"]["type"] == "ClusterIP"
    for job in by_kind(docs, "Job").values():
        spec = job["spec"]
        assert job["apiVersion"] == "batch/v1"
        assert spec["completionMode"] == "Indexed" and spec["backoffLimit"] == 0
        assert spec["parallelism"] == spec["completions"]
        assert spec["template"]["spec"]["restartPolicy"] == "Never"
        assert container(job)["command"] == COMMAND and container(job)["image"]
        assert "DMLC_ROLE" not in plain_env(job)  # kvstore.node derives it


def test_cross_references(docs):
    """The Service selects the scheduler pod (only), ports agree, secret refs exist, counts and offsets
    match the plan (completions S and W, offsets 0, 1, 1 + S), and every pod has its pod IP as its host."""
    jobs, secrets = by_kind(docs, "Job"), by_kind(docs, "Secret")
    (service_name, service), = by_kind(docs, "Service").items()
    selector = service["spec"]["selector"]
    labels = {name: job["spec"]["template"]["metadata"]["labels"] for name, job in jobs.items()}
    selected = [name for name, pod in labels.items() if selector.items() <= pod.items()]
    assert selected == ["kvstore-scheduler"]
    (port,) = service["spec"]["ports"]
    scheduler_ports = [p["containerPort"] for p in container(jobs["kvstore-scheduler"]).get("ports", [])]
    assert port["targetPort"] in scheduler_ports
    envs = {name: plain_env(job) for name, job in jobs.items()}
    for env in envs.values():
        assert env["DMLC_PS_ROOT_URI"] == service_name
        assert env["DMLC_PS_ROOT_PORT"] == str(port["port"]) == str(port["targetPort"])
    counts = {(env["DMLC_NUM_SERVER"], env["DMLC_NUM_WORKER"]) for env in envs.values()}
    assert len(counts) == 1
    servers, workers = map(int, counts.pop())
    assert [jobs[n]["spec"]["completions"] for n in ("kvstore-scheduler", "kvstore-servers",
                                                     "kvstore-workers")] == [1, servers, workers]
    assert [envs[n]["KVSTORE_RANK_OFFSET"] for n in ("kvstore-scheduler", "kvstore-servers",
                                                     "kvstore-workers")] == ["0", "1", str(1 + servers)]
    for job in jobs.values():
        refs = {e["name"]: e["valueFrom"] for e in container(job)["env"] if "valueFrom" in e}
        secret_ref = refs["KVSTORE_SECRET"]["secretKeyRef"]
        assert secret_ref["key"] in secrets[secret_ref["name"]]["stringData"]
        assert refs["DMLC_NODE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_every_pod_derives_its_place_in_the_plan(docs):
    """managers.derive on every pod's environment: one scheduler, servers 0..S-1, workers 0..W-1, all on
    the Service's host and port, each advertising its pod IP, all with the same secret."""
    jobs, secrets = by_kind(docs, "Job"), by_kind(docs, "Secret")
    (service_name, service), = by_kind(docs, "Service").items()
    port = str(service["spec"]["ports"][0]["port"])
    roles, pods = [], 0
    for name in ("kvstore-scheduler", "kvstore-servers", "kvstore-workers"):
        for index in range(jobs[name]["spec"]["completions"]):
            pods += 1
            env = pod_env(jobs[name], index, secrets, pod_ip=f"10.1.0.{pods}")
            assert managers.detect(env).name == "kubernetes"
            derived = managers.derive(env)
            cfg = kvconfig.load({**env, **derived})
            assert (cfg.root_uri, str(cfg.root_port)) == (service_name, port)
            assert cfg.node_host == f"10.1.0.{pods}" and cfg.secret
            roles.append((cfg.role, cfg.server_id, cfg.worker_id))
    servers, workers = cfg.num_servers, cfg.num_workers
    assert roles == ([("scheduler", None, None)] + [("server", i, None) for i in range(servers)]
                     + [("worker", None, i) for i in range(workers)])
