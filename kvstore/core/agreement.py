"""Whether every worker called a collective with the same arguments: digests and their comparison.

Pure logic, no I/O.  Before a collective acts (an init, a broadcast), each worker makes a
:func:`digest` of its arguments (the root rank, and each key's name, shape and dtype, in order)
and the workers exchange them at a barrier they meet anyway (``kvstore.client.barriers``);
:func:`disagreement` then gives every worker the same :class:`CollectiveMismatchError`, naming the
ranks that differ and what differs, or None when they all agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from kvstore.errors import CollectiveMismatchError

SHOWN = 4  # differences named per worker; the rest are counted


def digest(entries: Iterable[tuple[Any, Iterable[int], str]], root: int | None = None) -> str:
    """The digest of a collective's arguments: ``(key, shape, dtype)`` of each entry, in order, and
    the ``root`` rank (None: the collective has none), as compact JSON text."""
    body = {"keys": [[_plain_key(k), [int(n) for n in shape], str(dtype)] for k, shape, dtype in entries]}
    if root is not None:
        body["root"] = int(root)
    return json.dumps(body, separators=(",", ":"))


def _plain_key(key: Any) -> Any:
    return key if isinstance(key, (int, str)) else str(key)


def disagreement(what: str, digests: Mapping[int, str]) -> CollectiveMismatchError | None:
    """None when every worker's digest (rank -> :func:`digest` text) is the same; else the error every
    worker raises: each group of workers that agree, against the lowest rank of the largest group."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(digests):
        groups.setdefault(digests[rank], []).append(rank)
    if len(groups) <= 1:
        return None
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
    ref_text, ref_ranks = ordered[0]
    ref, ref_rank = json.loads(ref_text), ref_ranks[0]
    lines, differ = [], []
    for text, ranks in ordered[1:]:
        differ.extend(ranks)
        who = _ranks(ranks)
        lines.append(f"{who} differ{'s' if len(ranks) == 1 else ''} from {_ranks(ref_ranks)}: "
                     + "; ".join(_differences(json.loads(text), ref, ref_rank)))
    return CollectiveMismatchError(f"{what}: the workers' arguments differ (every worker must pass the "
                                   f"same keys, in the same order, with the same shapes, dtypes and "
                                   f"root rank): " + " | ".join(lines), sorted(differ))


def _ranks(ranks: list[int]) -> str:
    return f"worker {ranks[0]}" if len(ranks) == 1 else f"workers {ranks}"


def _differences(mine: dict[str, Any], ref: dict[str, Any], ref_rank: int) -> list[str]:
    """What ``mine`` has that ``ref`` (the digest of worker ``ref_rank``) has not, in words."""
    out = []
    if mine.get("root") != ref.get("root"):
        out.append(f"root_rank {mine.get('root')} (worker {ref_rank}: {ref.get('root')})")
    keys = {json.dumps(e[0]): e for e in mine["keys"]}
    ref_keys = {json.dumps(e[0]): e for e in ref["keys"]}
    extra = [e[0] for k, e in keys.items() if k not in ref_keys]
    missing = [e[0] for k, e in ref_keys.items() if k not in keys]
    if extra:
        out.append(f"{len(extra)} key(s) worker {ref_rank} lacks: {extra[:SHOWN]}")
    if missing:
        out.append(f"{len(missing)} key(s) of worker {ref_rank} missing: {missing[:SHOWN]}")
    changed = [f"key {e[0]!r} {tuple(e[1])} {e[2]} (worker {ref_rank}: {tuple(r[1])} {r[2]})"
               for k, e in keys.items() if (r := ref_keys.get(k)) is not None and e[1:] != r[1:]]
    if changed:
        out.append(", ".join(changed[:SHOWN]) + (f" and {len(changed) - SHOWN} more" if len(changed) > SHOWN
                                                  else ""))
    common = [k for k in keys if k in ref_keys]
    if not extra and not missing and common != [k for k in ref_keys if k in keys]:
        out.append(f"the same keys in another order (first: {[keys[k][0] for k in common[:SHOWN]]}, "
                   f"worker {ref_rank}: {[ref_keys[k][0] for k in list(ref_keys)[:SHOWN]]})")
    if not out:
        out.append("a duplicate key")  # same key set, shapes and order: only duplicates can differ
    return out
