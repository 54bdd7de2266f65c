"""What one counter update costs: ``Counters.add``, ``Counters.add_label`` and ``Histogram.observe``
(kvstore/core/stats.py), with the lock the roles pass (``threading.Lock()``) and without one.

    python benchmarks/stats_cost.py [--n 200000] [--repeat 5]

Each figure is the best of ``--repeat`` passes of ``--n`` calls (this machine is shared), in
nanoseconds per call, with the cost of an empty call of the same shape measured alongside.
"""

from __future__ import annotations

import argparse
import threading
import timeit

from kvstore.core.stats import Counters, Histogram


def best_ns(stmt: str, env: dict, n: int, repeat: int) -> float:
    """The best of ``repeat`` timings of ``n`` runs of ``stmt``, in ns per run."""
    return min(timeit.repeat(stmt, globals=env, number=n, repeat=repeat)) / n * 1e9


def main() -> None:
    """Print one line per operation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    def nothing(*_: object) -> None:
        return None

    env = {"locked": Counters(threading.Lock()), "bare": Counters(), "hist": Histogram(threading.Lock()),
           "nothing": nothing}
    for label, stmt in [("empty call", "nothing('push', 1)"),
                        ("Counters.add (lock)", "locked.add('bytes_in', 4096)"),
                        ("Counters.add (no lock)", "bare.add('bytes_in', 4096)"),
                        ("Counters.add_label (lock)", "locked.add_label('ops', 'push')"),
                        ("Histogram.observe (lock)", "hist.observe(0.0012)")]:
        print(f"{label:<28} {best_ns(stmt, env, args.n, args.repeat):7.0f} ns")


if __name__ == "__main__":
    main()
