"""Rank policies: who takes part in a round when more nodes wait than fit, and who gets which rank.

Pure functions over plain data, unit-tested without Consul. Selection is the same for every
policy except ``explicit``: survivors of the previous round first (by their old rank), then
newcomers in join order (their member key's CreateIndex). Ranks, by policy:

* ``stable`` (default): a survivor keeps its rank while it is below the new world size;
  everyone else fills the holes, survivors (by old rank) before newcomers (join order).
* ``natural``: natural sort of (host, node id): ``node9`` before ``node10``.
* ``topology``: natural sort of the chosen member meta values (e.g. ``zone``, ``rack``), then host,
  then node id, so neighbours in the network get neighbouring ranks.
* ``explicit``: every node asks for a rank; a round takes the nodes whose ranks form 0..W-1 with
  no gap (rank 3 waits, and does not disturb a running round, until someone asks for rank 2).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

POLICIES = ("stable", "natural", "topology", "explicit")


@dataclass(frozen=True)
class Candidate:
    node: str
    host: str = ""
    join_order: int = 0
    meta: Mapping[str, str] = field(default_factory=dict)
    rank: int | None = None  # explicit request


class NotReady(Exception):
    """The candidates cannot form a round yet (explicit ranks with holes)."""


def natural_key(text: str) -> tuple:
    """``"node10"`` sorts after ``"node9"``; digits compare as numbers."""
    parts = re.split(r"(\d+)", text)
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts if p != "")


def explicit_prefix(ranks: Sequence[int]) -> list[int]:
    """The ranks 0..k-1 present in ``ranks`` (sorted or not) before the first gap."""
    present = set(ranks)
    prefix: list[int] = []
    while len(prefix) in present:
        prefix.append(len(prefix))
    return prefix


def select(candidates: Sequence[Candidate], previous: Mapping[str, int], max_nodes: int,
           policy: str = "stable") -> list[Candidate]:
    """Pick at most ``max_nodes`` candidates: survivors first, then join order.

    ``explicit``: the first node (join order) asking for each rank, for the ranks 0..k-1 before
    the first rank nobody asked for; nodes beyond a gap are not selected.
    """
    if policy == "explicit":
        by_rank: dict[int, Candidate] = {}
        for c in sorted(candidates, key=lambda c: c.join_order):
            if c.rank is not None and 0 <= c.rank < max_nodes and c.rank not in by_rank:
                by_rank[c.rank] = c
        return [by_rank[r] for r in explicit_prefix(list(by_rank))]
    ordered = sorted(
        candidates,
        key=lambda c: (0, previous[c.node], 0) if c.node in previous else (1, 0, c.join_order),
    )
    return ordered[:max_nodes]


def assign(selected: Sequence[Candidate], previous: Mapping[str, int], policy: str = "stable",
           topology_keys: Sequence[str] = ()) -> list[str]:
    """Return node ids in rank order (index = rank). Raises NotReady for explicit holes."""
    if policy not in POLICIES:
        raise ValueError(f"unknown rank policy {policy!r}; choose one of {', '.join(POLICIES)}")
    world = len(selected)
    if policy == "explicit":
        asked = sorted(c.rank for c in selected if c.rank is not None)
        missing = sorted(set(range(world if not asked else max(asked) + 1)) - set(asked))
        if missing or len(asked) != world:
            raise NotReady(f"explicit ranks {missing} have no node yet")
        return [c.node for c in sorted(selected, key=lambda c: c.rank or 0)]
    if policy == "natural":
        return [c.node for c in sorted(selected, key=lambda c: (natural_key(c.host),
                                                                 natural_key(c.node)))]
    if policy == "topology":
        return [c.node for c in sorted(
            selected,
            key=lambda c: (tuple(natural_key(str(c.meta.get(k, ""))) for k in topology_keys),
                           natural_key(c.host), natural_key(c.node)),
        )]
    # stable
    ranks: list[str | None] = [None] * world
    rest: list[Candidate] = []
    for c in selected:
        old = previous.get(c.node)
        if old is not None and old < world and ranks[old] is None:
            ranks[old] = c.node
        else:
            rest.append(c)
    rest.sort(key=lambda c: (0, previous[c.node], 0) if c.node in previous
              else (1, 0, c.join_order))
    holes = iter(i for i, n in enumerate(ranks) if n is None)
    for c in rest:
        ranks[next(holes)] = c.node
    return [n for n in ranks if n is not None]
