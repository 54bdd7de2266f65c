"""ZeroMQ CURVE keys of a cluster (``KVSTORE_ENCRYPT=curve``), and the socket options that use them.

Every ROUTER (the scheduler, the servers) is a CURVE server holding the cluster's server key pair;
every DEALER is a CURVE client with a fresh random key pair that must know the server's public key.
The server key pair comes either from ``KVSTORE_SECRET`` (derived: a domain-separated SHA-256 of
the secret is the secret key, so only holders of the secret can compute the public key) or from
``KVSTORE_CURVE_KEYS=DIR``, in zmq's certificate format as written by
``zmq.auth.create_certificates(DIR, "server")``:

    DIR/server.key         public-key = "<40 z85 characters>"          (what every node needs)
    DIR/server.key_secret  public-key = "..." and secret-key = "..."   (the scheduler and servers)

CURVE encrypts and authenticates every byte on the wire; who may send what is still decided by
the MACs of ``kvstore.net.auth`` (docs/security.md, "Encryption (CURVE)").
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from kvstore.config import Config
from kvstore.errors import ConfigError

PUBLIC_FILE = "server.key"
SECRET_FILE = "server.key_secret"
ROUTER_ROLES = ("scheduler", "server")  # the roles that bind a ROUTER and need the secret key
_DOMAIN = b"kvstore-curve-server-v1\0"
_Z85_KEY = re.compile(rb"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
_LINE = re.compile(rb"^\s*(public-key|secret-key)\s*=\s*['\"]?([^'\"\s]*)['\"]?\s*$")


@dataclass(frozen=True)
class CurveKeys:
    """The cluster's CURVE server keys, z85-encoded (40 bytes each); ``server_secret`` only where needed."""

    server_public: bytes
    server_secret: bytes | None = None


def derive_keys(secret: str) -> CurveKeys:
    """The server key pair of a cluster secret: the same on every node, different for every secret."""
    if not secret:
        raise ConfigError("KVSTORE_ENCRYPT=curve needs KVSTORE_SECRET (the keys are derived from it) "
                          "or KVSTORE_CURVE_KEYS (a folder of key files)")
    secret_key = z85.encode(hashlib.sha256(_DOMAIN + secret.encode()).digest())
    return CurveKeys(zmq.curve_public(secret_key), secret_key)


def _read_keys(path: Path) -> dict[bytes, bytes]:
    """The ``public-key`` / ``secret-key`` entries of a zmq certificate file."""
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"KVSTORE_CURVE_KEYS: cannot read {path}: {exc.strerror or exc} (create the "
                          f"files with zmq.auth.create_certificates(DIR, 'server'))") from None
    found: dict[bytes, bytes] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match and not line.lstrip().startswith(b"#"):
            if not _Z85_KEY.fullmatch(match.group(2)):
                raise ConfigError(f"KVSTORE_CURVE_KEYS: {path}: the {match.group(1).decode()} is not "
                                  "40 z85 characters")
            found[match.group(1)] = match.group(2)
    return found


def load_keys(folder: str, with_secret: bool) -> CurveKeys:
    """The server keys from ``folder`` (:data:`PUBLIC_FILE`, or :data:`SECRET_FILE` ``with_secret``).

    Raises :class:`ConfigError` naming the file when it is missing or malformed.
    """
    path = Path(folder) / (SECRET_FILE if with_secret else PUBLIC_FILE)
    found = _read_keys(path)
    if b"public-key" not in found:
        raise ConfigError(f"KVSTORE_CURVE_KEYS: {path} holds no public-key")
    if not with_secret:
        return CurveKeys(found[b"public-key"])
    if b"secret-key" not in found:
        raise ConfigError(f"KVSTORE_CURVE_KEYS: {path} holds no secret-key")
    if zmq.curve_public(found[b"secret-key"]) != found[b"public-key"]:
        raise ConfigError(f"KVSTORE_CURVE_KEYS: {path}: the secret-key does not match the public-key")
    return CurveKeys(found[b"public-key"], found[b"secret-key"])


@functools.lru_cache(maxsize=16)
def _cached(encrypt: str | None, secret: str | None, folder: str | None,
            role: str | None) -> CurveKeys | None:
    if encrypt != "curve":
        return None
    if folder:
        return load_keys(folder, with_secret=role in ROUTER_ROLES)
    return derive_keys(secret or "")


def keys_for(cfg: Config) -> CurveKeys | None:
    """The CURVE keys ``cfg`` calls for (``KVSTORE_ENCRYPT``, ``KVSTORE_CURVE_KEYS``, ``KVSTORE_SECRET``),
    or None with encryption off.  Raises :class:`ConfigError` when they cannot be had."""
    get = functools.partial(getattr, cfg)
    return _cached(get("encrypt", None), get("secret", None), get("curve_keys", None), get("role", None))


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (a ROUTER, before it binds) a CURVE server with the cluster's key pair."""
    if keys.server_secret is None:
        raise ConfigError(f"a CURVE server needs the secret key ({SECRET_FILE} in KVSTORE_CURVE_KEYS)")
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def make_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (a DEALER, before it connects) a CURVE client of the cluster, with a fresh key pair."""
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
