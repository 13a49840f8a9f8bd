"""The fault schedule of a campaign: which fault, when, on what, drawn from a seed alone.

``random.Random(seed)`` draws the whole schedule before it is used: the time of each fault
(seconds after the first round), its kind, duration and target choice (a number in [0, 1) that
picks among the candidates found at run time). The same seed gives the same schedule.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

#: Fault kinds and their weights in the schedule (see the module docstring).
KINDS: dict[str, float] = {
    "worker_kill_training": 2.0,
    "worker_kill_joining": 2.0,
    "worker_freeze_short": 1.0,
    "worker_freeze_long": 1.0,
    "coordinator_kill": 2.0,
    "worker_replace": 1.0,
    "leader_server_kill": 3.0,
    "leader_kill_at_seal": 2.0,
    "server_restart": 1.5,
    "client_agent_kill": 1.5,
}
SERVER_KINDS = frozenset({"leader_server_kill", "leader_kill_at_seal", "server_restart"})
NODE_KILL_KINDS = frozenset({"worker_kill_training", "worker_kill_joining", "coordinator_kill"})
#: No server fault is planned before the previous one's server has been back this long (it
#: catches up, a leader settles): server faults never overlap, so the quorum holds.
SERVER_SETTLE = 10.0
#: Likewise for client agents: one agent down at a time.
AGENT_SETTLE = 3.0

def _duration_range(kind: str, heartbeat: float) -> tuple[float, float]:
    """Seconds: the freeze, the down time of an agent, or the delay before a killed node's
    replacement starts."""
    if kind == "worker_freeze_short":
        return 0.2 * heartbeat, 0.7 * heartbeat
    if kind == "worker_freeze_long":
        return 1.5 * heartbeat, 3.0 * heartbeat
    if kind == "worker_replace":
        return 0.5 * heartbeat, 2.5 * heartbeat
    if kind in ("leader_server_kill", "leader_kill_at_seal"):
        return 1.0, 6.0
    if kind == "server_restart":
        return 0.5, 4.0
    if kind == "client_agent_kill":
        return 1.0, 6.0
    return 0.2, 3.0  # a killed node's replacement


@dataclass(frozen=True)
class FaultSpec:
    """One planned fault, drawn from the seed alone.

    ``at``: seconds after the campaign's first round. ``pick`` chooses the target among the
    candidates found at run time (sorted by slot, or the servers / client agents in order);
    ``duration`` see :func:`_duration_range`; ``same_id`` and ``agent_pick``: a killed node's
    replacement keeps its node id or gets a new one, and talks to the client agent
    ``agent_pick`` chooses.
    """

    index: int
    at: float
    kind: str
    pick: float
    duration: float
    same_id: bool
    agent_pick: float


def fault_schedule(seed: int, *, gap: tuple[float, float] = (2.0, 7.0),
                   heartbeat: float = 2.0,
                   kinds: dict[str, float] | None = None) -> Iterator[FaultSpec]:
    """The endless fault schedule of ``seed``: the same seed, the same sequence.

    Each fault draws the same five numbers whatever its kind, so the sequence depends on nothing
    but the seed and the arguments. Server faults are spaced so that they never overlap (see
    :data:`SERVER_SETTLE`), client agent kills likewise.
    """
    weights = dict(kinds if kinds is not None else KINDS)
    if not weights or any(k not in KINDS for k in weights):
        raise ValueError(f"unknown fault kinds: {sorted(set(weights) - set(KINDS))}")
    rng = random.Random(seed)
    at = 0.0
    server_free = agent_free = 0.0
    index = 0
    while True:
        at += rng.uniform(*gap)
        u_kind, pick, u_duration, same, agent_pick = (rng.random() for _ in range(5))
        allowed = {k: w for k, w in weights.items()
                   if not (k in SERVER_KINDS and at < server_free)
                   and not (k == "client_agent_kill" and at < agent_free)}
        if not allowed:
            continue
        kind = _weighted(allowed, u_kind)
        lo, hi = _duration_range(kind, heartbeat)
        duration = lo + u_duration * (hi - lo)
        if kind in SERVER_KINDS:
            server_free = at + duration + SERVER_SETTLE
        elif kind == "client_agent_kill":
            agent_free = at + duration + AGENT_SETTLE
        yield FaultSpec(index=index, at=round(at, 3), kind=kind, pick=round(pick, 6),
                        duration=round(duration, 3), same_id=same < 0.5,
                        agent_pick=round(agent_pick, 6))
        index += 1


def _weighted(weights: dict[str, float], u: float) -> str:
    total = sum(weights.values())
    acc = 0.0
    for kind, weight in weights.items():
        acc += weight / total
        if u < acc:
            return kind
    return next(reversed(weights))


def schedule_digest(specs: Iterable[FaultSpec]) -> str:
    """SHA-256 (first 16 hex digits) of a schedule prefix: equal seeds give equal digests."""
    text = json.dumps([asdict(s) for s in specs], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pick(candidates: list, u: float):
    return candidates[min(int(u * len(candidates)), len(candidates) - 1)]
