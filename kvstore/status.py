"""``python -m kvstore.status [ADDRESS]`` (or ``kvstore-status``): a running cluster at a glance.

Asks the scheduler at ``ADDRESS`` (``host:port``; default ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``)
for its STATUS, sealed with ``KVSTORE_SECRET`` as any node's message is (no session: the tool does
not register), and shows it: ``--json`` prints the reply once, else a live view redrawn every
``--interval`` seconds until Ctrl-C.  Exits 1 with one line naming the address when the scheduler
does not answer within ``--timeout`` seconds or refuses the secret (docs/observability.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any

from kvstore import config as kvconfig
from kvstore.core.status_view import render
from kvstore.errors import (
    AuthenticationError,
    DeadlineExceededError,
    KVStoreError,
    ProtocolError,
    error_from_code,
)
from kvstore.net import address as kvaddress
from kvstore.net import protocol, transport
from kvstore.net.auth import Channel, channel_for, new_label
from kvstore.net.protocol import Message, Op

__all__ = ["StatusClient", "main"]
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


class StatusClient:
    """One connection to a scheduler that asks it for STATUS (its own DEALER and channel)."""

    def __init__(self, cfg: kvconfig.Config, where: str) -> None:
        self.where, self.cfg = where, cfg
        self.channel: Channel = channel_for(cfg, new_label("status"))
        self.sock = transport.connect_dealer(where, curve=transport.curve_keys(cfg))
        self._seq = itertools.count(1)

    def status(self, timeout: float) -> dict[str, Any]:
        """The scheduler's STATUS reply body; raises DeadlineExceededError past ``timeout`` seconds,
        AuthenticationError when it refuses this secret (or its reply does not verify)."""
        seq = next(self._seq)
        transport.send(self.sock, self.channel.seal(Message(Op.STATUS, {}, seq=seq), "scheduler"))
        deadline = time.monotonic() + timeout
        while True:
            try:
                frames = transport.recv_within(self.sock, max(0.0, deadline - time.monotonic()), "reply")
            except DeadlineExceededError:
                raise DeadlineExceededError(f"no STATUS reply from the scheduler at {self.where} within "
                                            f"{timeout:g} s (--timeout)") from None
            reply = self._open(frames)
            if reply.seq != seq:
                continue  # the late answer to an earlier request
            if reply.op is Op.ERROR:
                raise error_from_code(str(reply.body.get("code", "")), str(reply.body.get("message", "")))
            return reply.body

    def _open(self, frames: list[Any]) -> Message:
        try:
            return self.channel.open(frames)
        except (AuthenticationError, ProtocolError):
            refusal = _unsigned_text(frames)
            if refusal is not None:
                raise AuthenticationError(f"the scheduler at {self.where} refused this request: "
                                          f"{refusal} (is KVSTORE_SECRET the cluster's?)") from None
            raise AuthenticationError(f"the reply of the scheduler at {self.where} failed to "
                                      "authenticate (is KVSTORE_SECRET the cluster's?)") from None

    def close(self) -> None:
        """Close the connection."""
        transport.close(self.sock)


def _unsigned_text(frames: list[Any]) -> str | None:
    """The message of an unsigned ERROR reply (a refusal), else None."""
    if len(frames) < 2 or memoryview(frames[0]).nbytes:
        return None
    try:
        reply = protocol.decode(frames[1:])
    except ProtocolError:
        return None
    return str(reply.body.get("message", ""))[:300] if reply.op is Op.ERROR else None


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kvstore.status``."""
    p = argparse.ArgumentParser(prog="python -m kvstore.status",
                                description="Show a running kvstore cluster: nodes, heartbeats, rates, "
                                "the straggler. Uses KVSTORE_SECRET (and KVSTORE_ENCRYPT) like any node.")
    p.add_argument("address", nargs="?", help="the scheduler's host:port (default: "
                   "DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT)")
    p.add_argument("--json", action="store_true", help="print the STATUS reply once as JSON and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for the scheduler's answer before exiting 1 (default 10)")
    return p


def _target(args: argparse.Namespace, cfg: kvconfig.Config) -> tuple[str, str]:
    """(host:port as given, zmq address); raises ValueError when there is none or it is malformed."""
    given = args.address or (f"{cfg.root_uri}:{cfg.root_port}" if cfg.root_uri and cfg.root_port else None)
    if given is None:
        raise ValueError("no scheduler address: give host:port, or set DMLC_PS_ROOT_URI and "
                         "DMLC_PS_ROOT_PORT")
    try:
        host, port = kvaddress.parse_host_port(given)
    except ValueError:
        raise ValueError(f"{given!r} is not host:port (a port in 1..65535)") from None
    return given, transport.address(host, port)


def _live(client: StatusClient, given: str, interval: float, timeout: float) -> None:
    previous: tuple[float, dict[str, Any]] | None = None
    while True:
        body = client.status(timeout)
        now = time.monotonic()
        seconds = now - previous[0] if previous else 0.0
        sys.stdout.write(CLEAR + render(body, previous[1] if previous else None, seconds, given) + "\n")
        sys.stdout.flush()
        previous = (now, body)
        time.sleep(interval)  # the refresh period of the view, not a wait for a condition


def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit code (0, 1 when the scheduler does not answer or refuses,
    2 for a bad command line)."""
    args = parser().parse_args(argv)
    try:
        cfg = kvconfig.load()
        given, where = _target(args, cfg)
        client = StatusClient(cfg, where)
    except (ValueError, KVStoreError) as exc:
        print(f"kvstore.status: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            print(json.dumps(client.status(args.timeout), indent=1, sort_keys=True, default=str))
        else:
            _live(client, given, max(0.1, args.interval), args.timeout)
    except KeyboardInterrupt:
        return 0
    except KVStoreError as exc:
        print(f"kvstore.status: no status from the scheduler at {given}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
