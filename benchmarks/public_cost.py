"""What the ``@public`` wrapper (kvstore/base.py: cluster errors re-raised without internal frames)
adds to each public store call, against the same method unwrapped.

    python benchmarks/public_cost.py [--n 1000000]

Prints the best of 5 timings of ``--n`` calls of a method that returns its argument, plain and
wrapped, in nanoseconds per call, and the difference: the wrapper's cost per public call.
"""

from __future__ import annotations

import argparse
import timeit
from typing import Any

from kvstore.errors import public


class _Calls:
    def plain(self, value: Any) -> Any:
        return value

    @public
    def wrapped(self, value: Any) -> Any:
        return value


def main() -> None:
    """Print one line per variant and the difference."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    args = parser.parse_args()
    calls = _Calls()
    ns = {name: min(timeit.repeat(f"calls.{name}(1)", globals={"calls": calls}, number=args.n,
                                  repeat=5)) / args.n * 1e9 for name in ("plain", "wrapped")}
    for name, value in ns.items():
        print(f"{name:<8} {value:6.0f} ns per call")
    print(f"@public adds {ns['wrapped'] - ns['plain']:.0f} ns per public call")


if __name__ == "__main__":
    main()
