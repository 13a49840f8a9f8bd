"""Round planning: the coordinator's and the training watch's decisions, as pure functions.

No Consul and no threads here: everything takes a view of the run (members, the current round)
and returns a decision, so it is unit-tested on hand-built states (tests/test_ranks.py).

* :func:`plan_round`: the coordinator seals now, waits for the last call, or waits for nodes;
* :func:`count_waiting`: ``num_nodes_waiting()`` of a participant of a round, from what its
  training watch sees of the member keys;
* :func:`round_broken`: whether a round can no longer run (a participant is gone, or asked for a
  new round);
* :func:`round_bytes` / :func:`largest_world`: the size of a sealed round against Consul's
  transaction limit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from .client import MAX_TXN_BYTES
from .layout import RunState
from .ranks import Candidate, NotReady, assign, explicit_prefix, select
from .service import INCARNATION_TAG
from .settings import RendezvousSettings

# Consul refuses a transaction body above MAX_TXN_BYTES (512 KiB, ``txn_max_req_len``); the
# sealed round is one value inside one transaction, base64-encoded (4/3 of its bytes).
#: The transaction's bytes besides the round's ranks and hosts (keys, session id, the other
#: round fields, JSON framing): generous, measured at ~700 with a 200-character key prefix.
ROUND_OVERHEAD = 2048


@dataclass
class Plan:
    """The coordinator's decision for one view of the run."""

    seal: list[str] | None = None  # node ids in rank order
    quorum_since: float | None = None
    reason: str = ""
    detail: str = ""  # what a waiting node's progress line adds to the node count


@dataclass(frozen=True)
class MemberView:
    """What the training watch knows of one member key."""

    modify_index: int
    rank: int | None = None  # explicit rank request
    healthy: bool = True  # False: its Consul node holds it out (Member.health)


def active_participants(state: RunState) -> list[str]:
    """Participants of the current round still in it: alive and not asking for a new round.

    A participant asks for a new round by rewriting its member key, which moves the key's
    ModifyIndex past the member snapshot the round was sealed from.
    """
    current = state.round
    if current is None or not current.ranks:
        return []
    return [n for n in current.ranks
            if n in state.members and state.members[n].modify_index <= current.members_index]


def plan_round(state: RunState, settings: RendezvousSettings, now: float,
               quorum_since: float | None) -> Plan:
    """Decide whether the coordinator seals now, waits for the last call, or waits for nodes."""
    active = active_participants(state)
    current = state.round if state.round and state.round.ranks else None
    if active and current is not None:
        reason = (f"{len(active)} node(s) of round {current.round} have not come back yet "
                  f"({', '.join(sorted(active)[:8])})")
        return Plan(reason=reason, detail=reason)
    previous = {n: r for r, n in enumerate(current.ranks)} if current else {}
    # A member whose Consul node is unhealthy (a critical node check, maintenance) is never
    # admitted, nor counted toward min_nodes (docs/health.md).
    candidates = [Candidate(m.node, m.host, m.create_index, m.meta, m.rank)
                  for m in state.members.values() if not m.health]
    held = held_out(state)
    selected = select(candidates, previous, settings.max_nodes, settings.rank_policy)
    if len(selected) < settings.min_nodes:
        reason = f"{len(selected)} of min_nodes {settings.min_nodes} nodes present"
        detail = explicit_gap(candidates) if settings.rank_policy == "explicit" else ""
        if held:
            detail = "; ".join(p for p in (detail, held) if p)
        return Plan(reason=f"{reason} ({detail})" if detail else reason, detail=detail)
    try:
        order = assign(selected, previous, settings.rank_policy, settings.topology_keys)
    except NotReady as exc:
        return Plan(reason=str(exc))
    full = len(selected) >= settings.max_nodes
    nobody_new = current is not None and all(c.node in previous for c in selected)
    if full or nobody_new:
        return Plan(seal=order, quorum_since=quorum_since or now)
    since = now if quorum_since is None else quorum_since
    if now >= since + settings.last_call_timeout:
        return Plan(seal=order, quorum_since=since)
    reason = f"last call: {len(selected)} nodes present, up to {settings.max_nodes}"
    return Plan(quorum_since=since, reason=reason, detail=reason)


def held_out(state: RunState) -> str:
    """The members held out by their Consul node's health, with why (for progress lines)."""
    held = sorted((m.node, m.health) for m in state.members.values() if m.health)
    if not held:
        return ""
    return "held out: " + "; ".join(f"{node}: {why}" for node, why in held[:8]) + (
        "; ..." if len(held) > 8 else "")


def explicit_gap(candidates: list[Candidate]) -> str:
    """Why explicit ranks cannot all be placed: the lowest rank nobody asked for."""
    asked = sorted({c.rank for c in candidates if c.rank is not None})
    placed = len(explicit_prefix(asked))
    beyond = [r for r in asked if r > placed]
    if not beyond:
        return f"ranks 0..{placed - 1} asked for" if placed else "no rank asked for yet"
    return (f"rank {placed} has no node, so rank(s) {', '.join(map(str, beyond[:8]))} "
            "cannot be placed yet: explicit ranks form a round only as 0..W-1 without gaps")


def round_broken(members: Mapping[str, MemberView], participants: list[str],
                 members_index: int) -> list[str]:
    """Participants no longer in the round: gone, or asking for a new one. Empty if intact."""
    return [n for n in participants
            if n not in members or members[n].modify_index > members_index]


def count_waiting(members: Mapping[str, MemberView], participants: list[str],
                  members_index: int, settings: RendezvousSettings, *,
                  max_nodes: int | None = None) -> int:
    """``num_nodes_waiting`` of a participant, from one view of the member keys.

    Participants that are gone or ask for a new round always count (survivors must re-rendezvous
    now rather than hang in a collective). Other waiting nodes count only while the round has
    room for them, as in torch's c10d backend, and with explicit ranks only when their rank can
    be placed (no gap below it), so a node that cannot join a new round never restarts the job.
    ``max_nodes`` is the round's (what its coordinator sealed it with; default the settings'):
    nodes started with different ``--nnodes`` ranges agree on the room a round has.
    """
    broken = round_broken(members, participants, members_index)
    active = [n for n in participants if n not in broken]
    # A newcomer held out by its node's health cannot join: it restarts nobody.
    newcomers = [n for n in members if n not in participants and members[n].healthy]
    if settings.rank_policy == "explicit":
        taken = {participants.index(n) for n in active}  # explicit: rank == asked rank
        asked = taken | {members[n].rank for n in newcomers if members[n].rank is not None}
        placeable = len(explicit_prefix(sorted(r for r in asked if r is not None)))
        newcomers = [n for n in newcomers
                     if (rank := members[n].rank) is not None and rank < placeable
                     and rank not in taken]
    room = len(active) < (max_nodes or settings.max_nodes)
    return len(broken) + (len(newcomers) if room else 0)


#: Per node, besides its id: its quotes and comma, and its incarnation tag with its own.
PER_NODE_FIXED = 3 + INCARNATION_TAG + 3


def round_bytes(world: int, node_id_len: int, prefix_len: int = 200) -> int:
    """Upper estimate of the seal transaction's size for ``world`` nodes."""
    per_node = node_id_len + PER_NODE_FIXED
    raw = world * per_node + ROUND_OVERHEAD // 2
    return math.ceil(raw * 4 / 3) + ROUND_OVERHEAD // 2 + 2 * prefix_len


def largest_world(node_id_len: int, prefix_len: int = 200) -> int:
    """The largest world whose sealed round fits Consul's transaction limit."""
    budget = (MAX_TXN_BYTES - ROUND_OVERHEAD // 2 - 2 * prefix_len) * 3 / 4 - ROUND_OVERHEAD // 2
    return max(0, int(budget // (node_id_len + PER_NODE_FIXED)))


def json_len(text: str) -> int:
    """Length of ``text`` as a JSON string without its quotes (escapes count)."""
    return len(json.dumps(text)) - 2
