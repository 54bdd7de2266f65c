"""kvstore.net.curve: CURVE keys derived from the secret or read from key files, and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvstore import config as kvconfig
from kvstore.errors import ConfigError
from kvstore.net import transport
from kvstore.net.curve import PUBLIC_FILE, SECRET_FILE, CurveKeys, derive_keys, keys_for, load_keys


def test_derived_keys_are_deterministic_per_secret_and_differ_across_secrets():
    """The same secret gives the same valid key pair; another secret another pair."""
    first, again, other = derive_keys("s3cret"), derive_keys("s3cret"), derive_keys("other")
    assert first == again
    assert first.server_public != other.server_public and first.server_secret != other.server_secret
    assert len(first.server_public) == len(first.server_secret) == 40
    assert zmq.curve_public(first.server_secret) == first.server_public


def test_derived_keys_are_not_the_auth_key():
    """The CURVE secret key is domain-separated from the HMAC key of the same secret."""
    from kvstore.net.auth import derive_key

    assert zmq.utils.z85.decode(derive_keys("s3cret").server_secret) != derive_key("s3cret")


@pytest.fixture
def key_dir(tmp_path: Path) -> Path:
    zmq.auth.create_certificates(str(tmp_path), "server")
    return tmp_path


def test_key_files_written_by_zmq_load(key_dir: Path):
    """zmq.auth.create_certificates' files load: the public key alone, or the pair."""
    public, secret = zmq.auth.load_certificate(str(key_dir / SECRET_FILE))
    assert load_keys(str(key_dir), with_secret=False) == CurveKeys(public)
    assert load_keys(str(key_dir), with_secret=True) == CurveKeys(public, secret)


@pytest.mark.parametrize("name,with_secret", [(PUBLIC_FILE, False), (SECRET_FILE, True)])
def test_a_missing_key_file_is_named(key_dir: Path, name: str, with_secret: bool):
    (key_dir / name).unlink()
    with pytest.raises(ConfigError, match=rf"KVSTORE_CURVE_KEYS: cannot read .*{name}"):
        load_keys(str(key_dir), with_secret)


@pytest.mark.parametrize("text,problem", [
    ('public-key = "short"\n', "public-key is not 40 z85"),
    ("# nothing here\n", "holds no public-key"),
    ('curve\n    public-key = "' + "a" * 40 + '"\n', "holds no secret-key"),
    ('public-key = "' + "a" * 40 + '"\nsecret-key = "' + "b" * 40 + '"\n', "does not match"),
    ('public-key = "' + "a" * 39 + '~"\n', "public-key is not 40 z85"),
])
def test_malformed_key_files_are_named(tmp_path: Path, text: str, problem: str):
    (tmp_path / SECRET_FILE).write_text(text)
    with pytest.raises(ConfigError, match=rf"{SECRET_FILE}.*{problem}"):
        load_keys(str(tmp_path), with_secret=True)


def _cfg(**env: str) -> kvconfig.Config:
    return kvconfig.load(env)


def test_keys_for_follows_the_settings(key_dir: Path):
    """Off: None. Curve: derived from the secret, or from the folder (the pair for ROUTER roles)."""
    assert keys_for(_cfg(KVSTORE_SECRET="s")) is None
    assert keys_for(_cfg(KVSTORE_ENCRYPT="curve", KVSTORE_SECRET="s")) == derive_keys("s")
    folder = {"KVSTORE_ENCRYPT": "curve", "KVSTORE_SECRET": "s", "KVSTORE_CURVE_KEYS": str(key_dir)}
    assert keys_for(_cfg(**folder, DMLC_ROLE="worker")).server_secret is None
    for role in ("server", "scheduler"):
        assert keys_for(_cfg(**folder, DMLC_ROLE=role)) == load_keys(str(key_dir), with_secret=True)


def test_encryption_without_secret_or_keys_names_both_knobs():
    with pytest.raises(ConfigError, match="KVSTORE_SECRET.*KVSTORE_CURVE_KEYS"):
        keys_for(_cfg(KVSTORE_ENCRYPT="curve"))


def test_a_bad_encrypt_value_is_refused():
    with pytest.raises(ConfigError, match="KVSTORE_ENCRYPT='tls'"):
        _cfg(KVSTORE_ENCRYPT="tls")


def test_a_router_needs_the_secret_key():
    """A CURVE server without the secret key (a worker's keys) is a ConfigError naming the file."""
    with pytest.raises(ConfigError, match=SECRET_FILE):
        transport.bind_router("127.0.0.1", curve=CurveKeys(derive_keys("s").server_public))


def test_sockets_get_the_curve_options():
    """A ROUTER becomes a CURVE server; a DEALER a client of the server's public key."""
    keys = derive_keys("s")
    router, port = transport.bind_router("127.0.0.1", curve=keys)
    dealer = transport.connect_dealer(transport.address("127.0.0.1", port), curve=keys)
    try:
        assert router.getsockopt(zmq.CURVE_SERVER) == 1
        assert router.getsockopt(zmq.MECHANISM) == zmq.CURVE
        assert dealer.getsockopt(zmq.MECHANISM) == zmq.CURVE and dealer.getsockopt(zmq.CURVE_SERVER) == 0
        dealer.send(b"hello")
        assert router.poll(5000), "the CURVE handshake did not complete"
        assert router.recv_multipart()[1] == b"hello"
    finally:
        transport.close(dealer)
        transport.close(router)


def test_a_client_with_another_server_key_never_connects():
    """A DEALER holding another cluster's server key fails the handshake: nothing reaches the ROUTER."""
    router, port = transport.bind_router("127.0.0.1", curve=derive_keys("s"))
    dealer = transport.connect_dealer(transport.address("127.0.0.1", port), curve=derive_keys("other"))
    try:
        dealer.send(b"hello")
        assert not router.poll(300)
    finally:
        transport.close(dealer)
        transport.close(router)
