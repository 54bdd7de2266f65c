"""The suite's same-host shared-memory figures (issue 24 target 3) and its servers' memory lines.

Shared memory is on by default, so the suite's 1w1s figures are shared memory's; this reruns the 1w1s
model and 256 MB tests with ``KVSTORE_SHM=0`` (every byte over TCP) and prints both against the raw
pyzmq baseline and a 64 MB memcpy measured in the same run.  A server logs two peaks at shutdown
(``kvstore.server.peakmem``): all its resident pages, and its own (without the pages of same-host
workers' segments it maps); the bounded-memory figure is the own one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

SERVER_LINE = re.compile(r"server (\d+) INFO .*?([\d.]+) MB held, peak RSS ([\d.]+) MB(?:, own ([\d.]+) MB)?")


def servers(stdout: str) -> list[dict[str, Any]]:
    """Each server's shutdown line in a launch's output: rank, MB held, peak RSS and own peak in MB."""
    found = [{"rank": int(m.group(1)), "held_mb": float(m.group(2)), "peak_rss_mb": float(m.group(3)),
              "own_peak_mb": float(m.group(4) or m.group(3))} for m in SERVER_LINE.finditer(stdout)]
    return sorted(found, key=lambda m: m["rank"])


def memory_line(s: dict[str, Any]) -> str:
    """``server R holds H MB, own peak O MB (O/H x), peak RSS P MB (P/H x)``."""
    held = max(s["held_mb"], 1e-9)
    own = s.get("own_peak_mb", s["peak_rss_mb"])
    return (f"server {s['rank']} holds {s['held_mb']:.0f} MB, own peak {own:.0f} MB ({own / held:.2f}x), "
            f"peak RSS with shared pages {s['peak_rss_mb']:.0f} MB ({s['peak_rss_mb'] / held:.2f}x)")


def run(launch: Callable[..., dict[str, Any]], mean: Callable[..., float], tests: list[str],
        quick: bool) -> dict[str, Any]:
    """The 1w1s model and 256 MB tests of ``tests`` with ``KVSTORE_SHM=0``: their GB/s and servers."""
    out: dict[str, Any] = {}
    if "throughput" in tests:
        off = launch(1, 1, ["throughput"], quick, {"KVSTORE_SHM": "0"})
        out["throughput_gbps"] = mean(off["results"]["throughput"], "gbps")
    if "bigkey" in tests:
        big = launch(1, 1, ["bigkey"], quick, {"KVSTORE_SHM": "0"})
        out["bigkey_gbps"] = mean(big["results"]["bigkey"], "gbps")
        out["bigkey_servers"] = big["servers"]
    return out


def report(one: dict[str, Any], off: dict[str, Any], base: dict[str, Any]) -> None:
    """Print the 1w1s figures with shared memory (``one``: the suite's 1w1s config) and without."""
    raw, memcpy = base["model"]["gbps"], base["memcpy_gbps"]
    if "throughput_gbps" in off:
        on, tcp = one["throughput_gbps"], off["throughput_gbps"]
        used = "shared memory" if one.get("throughput_shm_bytes", 0) > 0 else "NO shared memory (TCP)"
        print(f"1w1s 64 MB model, default ({used}): {on:.3f} GB/s = {on / raw:.2f}x raw TCP, "
              f"{on / memcpy:.2f}x a 64 MB memcpy ({memcpy:.2f} GB/s); KVSTORE_SHM=0: {tcp:.3f} GB/s "
              f"({tcp / raw:.2f}x raw TCP); shared memory / TCP {on / tcp:.2f}")
    if "bigkey_gbps" in off:
        on, tcp, big = one["bigkey_gbps"], off["bigkey_gbps"], base["big"]["gbps"]
        print(f"1w1s 256 MB key, default: {on:.3f} GB/s ({on / big:.2f}x raw TCP); KVSTORE_SHM=0: "
              f"{tcp:.3f} GB/s ({tcp / big:.2f}x raw TCP); shared memory / TCP {on / tcp:.2f}")
        for s in off["bigkey_servers"]:
            print(f"1w1s 256 MB test, KVSTORE_SHM=0: {memory_line(s)}")
