"""Unit tests of kvstore.config: the environment contract, read from plain dicts."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore import config as kvconfig
from kvstore.errors import ConfigError

CLUSTER = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9091", "DMLC_NUM_SERVER": "2",
           "DMLC_NUM_WORKER": "3"}


def test_defaults_from_empty_environ():
    """An empty environment gives no cluster settings and the documented defaults."""
    cfg = kvconfig.load({})
    assert (cfg.role, cfg.root_uri, cfg.root_port, cfg.num_servers, cfg.num_workers) == (None,) * 5
    assert (cfg.node_host, cfg.interface, cfg.worker_id, cfg.server_id, cfg.secret) == (None,) * 5
    assert (cfg.port_file, cfg.log_level, cfg.node_port) == (None, None, 0)
    assert cfg.bigarray_bound == 1_000_000
    assert cfg.connect_timeout == 60.0
    assert cfg.request_timeout == 600.0
    assert cfg.shutdown_timeout == 10.0
    assert (cfg.batch_bytes, cfg.chunk_bytes, cfg.sum_order) == (1 << 20, 2 << 20, "arrival")
    assert cfg.max_message_bytes == 16 << 20


def test_load_reads_os_environ_when_none(monkeypatch):
    """load() without an argument reads the process environment."""
    monkeypatch.setenv("DMLC_NUM_WORKER", "5")
    monkeypatch.setenv("KVSTORE_BIGARRAY_BOUND", "77")
    cfg = kvconfig.load()
    assert cfg.num_workers == 5
    assert cfg.bigarray_bound == 77


def test_every_variable_is_parsed():
    """Each DMLC_* and KVSTORE_* variable lands in its Config field with the right type."""
    env = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "10.1.2.3", "DMLC_PS_ROOT_PORT": "9000",
           "DMLC_NUM_SERVER": "4", "DMLC_NUM_WORKER": "8", "DMLC_NODE_HOST": "10.1.2.9",
           "DMLC_INTERFACE": "eth1", "DMLC_WORKER_ID": "5", "KVSTORE_SERVER_ID": "2",
           "KVSTORE_SECRET": "s3cret", "KVSTORE_BIGARRAY_BOUND": "4096", "KVSTORE_CONNECT_TIMEOUT": "1.5",
           "KVSTORE_REQUEST_TIMEOUT": "30", "KVSTORE_SHUTDOWN_TIMEOUT": "0.25",
           "KVSTORE_PORT_FILE": "/tmp/port", "KVSTORE_LOG_LEVEL": "debug", "KVSTORE_BATCH_BYTES": "0",
           "KVSTORE_CHUNK_BYTES": "65536", "KVSTORE_SUM_ORDER": "Rank", "KVSTORE_NODE_PORT": "7070",
           "KVSTORE_MAX_MESSAGE_BYTES": "4194304"}
    assert kvconfig.load(env) == kvconfig.Config(
        role="worker", root_uri="10.1.2.3", root_port=9000, num_servers=4, num_workers=8,
        node_host="10.1.2.9", interface="eth1", worker_id=5, server_id=2, secret="s3cret",
        bigarray_bound=4096, connect_timeout=1.5, request_timeout=30.0, shutdown_timeout=0.25,
        port_file="/tmp/port", log_level="DEBUG", batch_bytes=0, chunk_bytes=65536, sum_order="rank",
        node_port=7070, max_message_bytes=4 << 20)


@pytest.mark.parametrize("role", ["scheduler", "server", "worker"])
def test_every_role_is_accepted(role):
    """DMLC_ROLE accepts scheduler, server and worker."""
    assert kvconfig.load({"DMLC_ROLE": role}).role == role


def test_surrounding_whitespace_is_ignored_and_blank_means_unset():
    """Values are stripped; a blank value counts as not set."""
    cfg = kvconfig.load({"DMLC_NUM_WORKER": " 3 ", "DMLC_PS_ROOT_URI": "  ", "KVSTORE_BIGARRAY_BOUND": ""})
    assert cfg.num_workers == 3
    assert cfg.root_uri is None
    assert cfg.bigarray_bound == 1_000_000


def test_config_is_frozen():
    """A Config cannot be changed after it is loaded."""
    cfg = kvconfig.load({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_workers = 3


def test_port_zero_is_allowed():
    """DMLC_PS_ROOT_PORT=0 is accepted (the scheduler then binds any free port)."""
    assert kvconfig.load({"DMLC_PS_ROOT_PORT": "0"}).root_port == 0


# -- bigarray bound ---------------------------------------------------------------------------------

def test_mxnet_bigarray_bound_is_the_fallback():
    """MXNET_KVSTORE_BIGARRAY_BOUND is read when KVSTORE_BIGARRAY_BOUND is absent."""
    assert kvconfig.load({"MXNET_KVSTORE_BIGARRAY_BOUND": "1234"}).bigarray_bound == 1234


def test_kvstore_bigarray_bound_wins_over_mxnet_name():
    """KVSTORE_BIGARRAY_BOUND wins when both names are set."""
    env = {"MXNET_KVSTORE_BIGARRAY_BOUND": "1234", "KVSTORE_BIGARRAY_BOUND": "99"}
    assert kvconfig.load(env).bigarray_bound == 99


@pytest.mark.parametrize("raw", ["lots", "0"])
def test_bad_mxnet_bigarray_bound_names_the_variable_that_was_set(raw):
    """An invalid MXNET_KVSTORE_BIGARRAY_BOUND raises ConfigError naming that variable."""
    with pytest.raises(ConfigError, match="MXNET_KVSTORE_BIGARRAY_BOUND"):
        kvconfig.load({"MXNET_KVSTORE_BIGARRAY_BOUND": raw})


# -- invalid values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,raw", [
    ("DMLC_ROLE", "boss"), ("DMLC_ROLE", "Worker"),
    ("DMLC_PS_ROOT_PORT", "http"), ("DMLC_PS_ROOT_PORT", "-1"), ("DMLC_PS_ROOT_PORT", "90.5"),
    ("DMLC_NUM_SERVER", "0"), ("DMLC_NUM_SERVER", "two"), ("DMLC_NUM_WORKER", "0"),
    ("DMLC_NUM_WORKER", "-3"), ("DMLC_WORKER_ID", "-1"), ("DMLC_WORKER_ID", "first"),
    ("KVSTORE_SERVER_ID", "-1"), ("KVSTORE_BIGARRAY_BOUND", "0"), ("KVSTORE_BIGARRAY_BOUND", "1e6"),
    ("KVSTORE_CONNECT_TIMEOUT", "soon"), ("KVSTORE_CONNECT_TIMEOUT", "0"),
    ("KVSTORE_REQUEST_TIMEOUT", "-5"), ("KVSTORE_REQUEST_TIMEOUT", "nan"),
    ("KVSTORE_SHUTDOWN_TIMEOUT", "0"), ("KVSTORE_SHUTDOWN_TIMEOUT", "10s"),
    ("KVSTORE_BATCH_BYTES", "-1"), ("KVSTORE_BATCH_BYTES", "1M"), ("KVSTORE_CHUNK_BYTES", "-4096"),
    ("KVSTORE_SUM_ORDER", "random"), ("KVSTORE_NODE_PORT", "65536"), ("KVSTORE_NODE_PORT", "any"),
    ("KVSTORE_MAX_MESSAGE_BYTES", "-1"), ("KVSTORE_MAX_MESSAGE_BYTES", "16M"),
    ("KVSTORE_MAX_MESSAGE_BYTES", "1048575"),
    ("KVSTORE_TEST_SERVER_STALL", "3"), ("KVSTORE_TEST_SERVER_STALL", "0:1"),
    ("KVSTORE_TEST_SERVER_STALL", "2:0"), ("KVSTORE_TEST_SERVER_STALL", "2:inf"),
])
def test_invalid_value_raises_config_error_naming_the_variable(name, raw):
    """A present but invalid value raises ConfigError whose message names the variable."""
    with pytest.raises(ConfigError) as info:
        kvconfig.load({name: raw})
    assert name in str(info.value)


def test_the_server_stall_hook_reads_n_and_seconds():
    """KVSTORE_TEST_SERVER_STALL=N:SECONDS is (N, seconds); unset, no hook."""
    assert kvconfig.load({"KVSTORE_TEST_SERVER_STALL": "400:2.5"}).test_server_stall == (400, 2.5)
    assert kvconfig.load({}).test_server_stall is None


def test_config_error_is_a_value_error():
    """A bad setting can be caught as the built-in ValueError too."""
    with pytest.raises(ValueError):
        kvconfig.load({"DMLC_NUM_WORKER": "x"})


@pytest.mark.parametrize("raw", ["65536", "70000"])
def test_port_above_65535_is_rejected(raw):
    """DMLC_PS_ROOT_PORT above 65535 is not a TCP port: ConfigError naming the variable."""
    with pytest.raises(ConfigError, match="DMLC_PS_ROOT_PORT"):
        kvconfig.load({"DMLC_PS_ROOT_PORT": raw})


# -- require_cluster --------------------------------------------------------------------------------

def test_require_cluster_passes_with_all_variables():
    """require_cluster does nothing when every cluster variable is set."""
    cfg = kvconfig.load(CLUSTER)
    assert cfg.missing_cluster_vars() == []
    cfg.require_cluster("a worker")


@pytest.mark.parametrize("missing", sorted(CLUSTER))
def test_require_cluster_names_the_missing_variable(missing):
    """With one variable missing, the error names it (only it) and says how to launch."""
    env = {k: v for k, v in CLUSTER.items() if k != missing}
    with pytest.raises(ConfigError) as info:
        kvconfig.load(env).require_cluster("kvstore.create('dist_sync')")
    message = str(info.value)
    assert missing in message
    assert all(other not in message for other in CLUSTER if other != missing)
    assert "launch.py" in message
    assert "kvstore.create('dist_sync')" in message


def test_require_cluster_names_every_missing_variable():
    """With nothing set, the error names all four DMLC_* variables."""
    with pytest.raises(ConfigError) as info:
        kvconfig.load({}).require_cluster("a server")
    for name in CLUSTER:
        assert name in str(info.value)
    assert "launch.py" in str(info.value)


# -- node_host --------------------------------------------------------------------------------------

# -- root_address, in_cluster, child_environ --------------------------------------------------------

@pytest.mark.parametrize("uri,port,expected", [
    ("127.0.0.1", "9091", "tcp://127.0.0.1:9091"),
    ("scheduler.example.com", "80", "tcp://scheduler.example.com:80"),
    ("::1", "9091", "tcp://[::1]:9091"),
    ("fe80::1:2", "1234", "tcp://[fe80::1:2]:1234"),
    ("[::1]", "9091", "tcp://[::1]:9091"),
])
def test_root_address(uri, port, expected):
    """root_address is tcp://host:port, with IPv6 hosts in brackets (added once)."""
    cfg = kvconfig.load({"DMLC_PS_ROOT_URI": uri, "DMLC_PS_ROOT_PORT": port})
    assert cfg.root_address == expected


@pytest.mark.parametrize("env,expected", [({}, False), ({"DMLC_ROLE": "worker"}, True),
                                          ({"DMLC_ROLE": " "}, False), ({"DMLC_NUM_WORKER": "2"}, False)])
def test_in_cluster_follows_dmlc_role(env, expected):
    """in_cluster is True exactly when DMLC_ROLE is set to something."""
    assert kvconfig.in_cluster(env) is expected


def test_child_environ_overlays_extra_on_a_copy():
    """child_environ returns base + extra (extra wins) and leaves the base mapping untouched."""
    base = {"PATH": "/bin", "DMLC_ROLE": "worker"}
    env = kvconfig.child_environ({"DMLC_ROLE": "server", "KVSTORE_SERVER_ID": "1"}, base)
    assert env == {"PATH": "/bin", "DMLC_ROLE": "server", "KVSTORE_SERVER_ID": "1"}
    assert base == {"PATH": "/bin", "DMLC_ROLE": "worker"}
    assert env is not base


def test_child_environ_defaults_to_os_environ(monkeypatch):
    """Without a base, child_environ copies the process environment."""
    monkeypatch.setenv("KVSTORE_UNIT_TEST_MARK", "yes")
    env = kvconfig.child_environ({"EXTRA": "1"})
    assert env["KVSTORE_UNIT_TEST_MARK"] == "yes"
    assert env["EXTRA"] == "1"


def test_child_environ_layers_defaults_parent_extra():
    """A child's env is defaults, overridden by the parent's env, overridden by explicit extras."""
    env = kvconfig.child_environ({"B": "extra"}, environ={"A": "parent", "B": "parent"},
                               defaults={"A": "default", "C": "default"})
    assert env == {"A": "parent", "B": "extra", "C": "default"}


@pytest.mark.parametrize("level", ["debug", "WARNING"])
def test_log_level_is_upper_cased(level):
    """KVSTORE_LOG_LEVEL accepts logging's level names in any case."""
    assert kvconfig.load({"KVSTORE_LOG_LEVEL": level}).log_level == level.upper()


def test_unknown_log_level_is_a_config_error():
    """An unknown KVSTORE_LOG_LEVEL is refused with the list of valid names."""
    with pytest.raises(ConfigError, match="KVSTORE_LOG_LEVEL='LOUD'.*DEBUG"):
        kvconfig.load({"KVSTORE_LOG_LEVEL": "loud"})


def test_heartbeat_settings_default_and_parse():
    """The heartbeat interval and timeout default to 1 s and 10 s and are read in seconds."""
    cfg = kvconfig.load({})
    assert (cfg.heartbeat_interval, cfg.heartbeat_timeout) == (1.0, 10.0)
    cfg = kvconfig.load({"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3"})
    assert (cfg.heartbeat_interval, cfg.heartbeat_timeout) == (0.2, 3.0)


@pytest.mark.parametrize("env", [{"KVSTORE_HEARTBEAT_INTERVAL": "2", "KVSTORE_HEARTBEAT_TIMEOUT": "3"},
                                 {"KVSTORE_HEARTBEAT_TIMEOUT": "1.5"},
                                 {"KVSTORE_HEARTBEAT_INTERVAL": "0"}, {"KVSTORE_HEARTBEAT_TIMEOUT": "x"}])
def test_heartbeat_settings_that_cannot_work_are_refused(env):
    """A timeout under twice the interval, a non-positive or non-numeric value is a ConfigError."""
    with pytest.raises(ConfigError, match="KVSTORE_HEARTBEAT"):
        kvconfig.load(env)


def test_auth_mode_and_insecure_flag():
    """KVSTORE_AUTH is 'header' (default) or 'full'; KVSTORE_INSECURE is 0 or 1."""
    assert not kvconfig.load({}).auth_full and not kvconfig.load({}).insecure
    assert kvconfig.load({"KVSTORE_AUTH": "FULL", "KVSTORE_INSECURE": "1"}).auth_full
    assert kvconfig.load({"KVSTORE_INSECURE": "1"}).insecure
    with pytest.raises(ConfigError, match="KVSTORE_AUTH"):
        kvconfig.load({"KVSTORE_AUTH": "none"})
    with pytest.raises(ConfigError, match="KVSTORE_INSECURE"):
        kvconfig.load({"KVSTORE_INSECURE": "yes"})


def test_process_environ_sets_then_restores(monkeypatch):
    """process_environ sets variables for its block, then restores changed ones and removes new ones."""
    monkeypatch.setenv("KVSTORE_TEST_KEPT", "before")
    monkeypatch.delenv("KVSTORE_TEST_NEW", raising=False)
    with kvconfig.process_environ({"KVSTORE_TEST_KEPT": "during", "KVSTORE_TEST_NEW": "x"}):
        assert kvconfig.child_environ({})["KVSTORE_TEST_KEPT"] == "during"
        assert kvconfig.child_environ({})["KVSTORE_TEST_NEW"] == "x"
    after = kvconfig.child_environ({})
    assert after["KVSTORE_TEST_KEPT"] == "before" and "KVSTORE_TEST_NEW" not in after


def test_process_environ_restores_after_an_exception(monkeypatch):
    """The environment is restored when the block raises."""
    monkeypatch.delenv("DMLC_NUM_WORKER", raising=False)
    with pytest.raises(RuntimeError), kvconfig.process_environ({"DMLC_NUM_WORKER": "7"}):
        assert kvconfig.load().num_workers == 7
        raise RuntimeError("boom")
    assert kvconfig.load().num_workers is None


# -- KVSTORE_MAX_MESSAGE_BYTES and the settings it bounds ---------------------------------------------

def test_max_message_bytes_is_zero_for_no_limit_or_at_least_a_header():
    """0 lifts the limit; the smallest limit is the protocol's largest header."""
    from kvstore.net.protocol import MAX_HEADER_BYTES

    assert kvconfig.MIN_MESSAGE_BYTES == MAX_HEADER_BYTES
    assert kvconfig.load({"KVSTORE_MAX_MESSAGE_BYTES": "0"}).max_message_bytes == 0
    smallest = kvconfig.load({"KVSTORE_MAX_MESSAGE_BYTES": str(MAX_HEADER_BYTES)})
    assert smallest.max_message_bytes == MAX_HEADER_BYTES
    with pytest.raises(ConfigError, match=f"=65536 must be 0 .* at least {MAX_HEADER_BYTES}"):
        kvconfig.load({"KVSTORE_MAX_MESSAGE_BYTES": "65536"})


def test_default_settings_fit_the_default_limit_with_room():
    """The defaults pass the check: 4 chunks (8 MiB), a batch (1 MiB) and a header (1 MiB) fit 16 MiB."""
    cfg = kvconfig.load({})
    kvconfig.check_message_limits(cfg.max_message_bytes, cfg.chunk_bytes, cfg.batch_bytes)
    assert kvconfig.WHOLE_CHUNKS * cfg.chunk_bytes <= cfg.max_message_bytes // 2
    assert max(cfg.batch_bytes, kvconfig.MIN_MESSAGE_BYTES) <= cfg.max_message_bytes // 2


@pytest.mark.parametrize("limit,chunk,batch", [
    (1 << 20, 256 << 10, 1 << 20),   # exactly at the limit: 4 chunks and a batch of 1 MiB
    (0, 0, 64 << 20),                # no limit: chunking off and huge batches are fine
    (0, 1 << 30, 0),
    (16 << 20, 1, 0),                # tiny chunks, batching off
])
def test_consistent_limits_pass(limit, chunk, batch):
    """Settings under which every planned frame fits the limit are accepted."""
    kvconfig.check_message_limits(limit, chunk, batch)


@pytest.mark.parametrize("limit,chunk,batch,names", [
    (16 << 20, 0, 1 << 20, ["KVSTORE_CHUNK_BYTES=0", "KVSTORE_MAX_MESSAGE_BYTES=16777216"]),
    (16 << 20, (4 << 20) + 1, 1 << 20, ["KVSTORE_CHUNK_BYTES=4194305", "KVSTORE_MAX_MESSAGE_BYTES=16777216",
                                         "at most 4194304"]),
    (1 << 20, 256 << 10, (1 << 20) + 1, ["KVSTORE_BATCH_BYTES=1048577", "KVSTORE_MAX_MESSAGE_BYTES=1048576"]),
])
def test_settings_that_would_exceed_the_limit_are_refused_naming_the_variables(limit, chunk, batch, names):
    """Chunking off, 4 chunks over the limit, or batches over it: ConfigError naming every variable
    involved and the value that would fit."""
    with pytest.raises(ConfigError) as info:
        kvconfig.check_message_limits(limit, chunk, batch)
    for name in names:
        assert name in str(info.value)


def test_the_batch_check_can_be_skipped_and_the_source_is_named():
    """batch_bytes None checks the chunk size only; ``source`` tells where the values came from."""
    kvconfig.check_message_limits(1 << 20, 256 << 10, None)
    with pytest.raises(ConfigError, match=r"KVSTORE_CHUNK_BYTES=0 \(the scheduler's\)"):
        kvconfig.check_message_limits(1 << 20, 0, None, source=" (the scheduler's)")


@pytest.mark.parametrize("own,cluster,ok", [
    (0, 0, True), (0, 16 << 20, True), (16 << 20, 16 << 20, True), (32 << 20, 16 << 20, True),
    (16 << 20, 32 << 20, False), (16 << 20, 0, False),
])
def test_a_node_with_a_smaller_limit_than_the_scheduler_is_refused(own, cluster, ok):
    """A server's own limit must admit whatever the scheduler's limit lets workers send."""
    if ok:
        kvconfig.check_node_limit(own, cluster)
        return
    with pytest.raises(ConfigError, match=f"KVSTORE_MAX_MESSAGE_BYTES={own} is smaller than the scheduler's"):
        kvconfig.check_node_limit(own, cluster)
