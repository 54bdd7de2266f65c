"""``python -m kvstore.status [ADDRESS]`` (or ``kvstore-status``): a running cluster at a glance.

Asks the scheduler at ``ADDRESS`` (``host:port``; default ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``)
for its STATUS, sealed with ``KVSTORE_SECRET`` as any node's message is (no session: the tool does
not register), and shows it: ``--json`` prints the reply once, else a live view redrawn every
``--interval`` seconds until Ctrl-C.  Exits 1 with one line naming the address when the scheduler
does not answer within ``--timeout`` seconds or refuses the secret (docs/observability.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvstore import config as kvconfig
from kvstore.core.status_view import render
from kvstore.errors import KVStoreError
from kvstore.net import address as kvaddress
from kvstore.net import transport
from kvstore.net.status_client import StatusClient

__all__ = ["StatusClient", "main"]
CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


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
