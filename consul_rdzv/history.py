"""A job's round history: what each sealed round was, how the round before it ended, and the
job's totals (pure functions; the coordinator writes them in its seal transaction).

A round's ending is only known when the next round is sealed: the coordinator then sees which
participants of the previous round are gone (their member keys: dead, left or drained), which
came back as a new process (replaced), which asked for a new round first (re-announced: its
workers failed or its agent restarted), and which nodes are new. Each member write carries its
wall-clock time (``Member.at``), so the round ended at the first re-announcement of one of its
participants, and the job did not train from then until the next seal (``lost``). What is not
seen from Consul is not counted: the check TTL before a dead node's key goes, and the workers'
start after the seal.

Keys: ``H/<job>/rounds/<round>`` (one record per sealed round, the last
:data:`~consul_rdzv.layout.HISTORY_ROUNDS` kept) and ``H/<job>/totals`` (every round counted),
docs/protocol.md "Round history". The same endings, the last few, ride in the round value
(``recent``) for the restart-storm stop (:func:`storm`).
"""

from __future__ import annotations

from collections import Counter

from .layout import HISTORY_NAMES, HISTORY_ROUNDS, Keys, Round, RunState, history_value
from .service import incarnation_tag

#: Endings kept in the round value for the storm check (at most).
RECENT_MAX = 50

CAUSES = ("drained", "gone", "replaced", "joined", "restart")
#: The endings a restart storm is made of: failures. A node joining (the job grows, nodes
#: arriving one by one at its start) or an operator's drain is no failure.
STORM_CAUSES = ("gone", "replaced", "restart")


def _names(nodes: list[str]) -> list[str]:
    return nodes[:HISTORY_NAMES]


def ending(previous: Round, state: RunState, order: list[str], now: float) -> dict:
    """How ``previous`` ended, seen from the member snapshot the next round is sealed from."""
    members = state.members
    gone, replaced, asked = [], [], []
    for i, node in enumerate(previous.ranks):
        member = members.get(node)
        if member is None:
            gone.append(node)
        elif previous.incarnations and \
                incarnation_tag(member.incarnation) != previous.incarnations[i]:
            replaced.append(node)
        elif member.modify_index > previous.members_index:
            asked.append(node)
    drained = [n for n in gone if n in state.drains]
    joined = [n for n in order if n not in previous.ranks]
    back = sorted(asked + replaced, key=lambda n: members[n].modify_index)
    stamps = [members[n].at for n in back if members[n].at > 0]
    ended_at = min(stamps) if stamps else now
    cause = next(c for c, hit in (("drained", drained), ("gone", gone), ("replaced", replaced),
                                  ("joined", joined), ("restart", True)) if hit)
    return {
        "round": previous.round, "sealed_at": previous.sealed_at, "ended_at": ended_at,
        "trained": round(max(0.0, ended_at - previous.sealed_at), 3) if previous.sealed_at
        else 0.0,
        "lost": round(max(0.0, now - ended_at), 3), "cause": cause,
        "gone": _names(gone), "drained": _names(drained), "replaced": _names(replaced),
        "joined": _names(joined), "first": back[0] if back else None,
        "counts": {"gone": len(gone), "drained": len(drained), "replaced": len(replaced),
                   "joined": len(joined), "asked": len(asked)},
    }


def involved(end: dict) -> list[str]:
    """The nodes an ending blames: gone, replaced or joined; else the first to ask for a new
    round (a restart: its workers failed, or its agent restarted)."""
    nodes = [*end.get("gone", []), *end.get("replaced", []), *end.get("joined", [])]
    if not nodes and end.get("first"):
        nodes.append(end["first"])
    return nodes


def record(sealed: Round, after: dict | None) -> dict:
    """The history record of a round as sealed, with how the round before it ended."""
    return {"round": sealed.round, "sealed_at": sealed.sealed_at, "world": sealed.world_size,
            "coordinator": sealed.coordinator, "first_join": sealed.first_join,
            "quorum_at": sealed.quorum_at, "after": after}


def totals(previous: dict, sealed: Round, after: dict | None) -> dict:
    """The job's totals once ``sealed`` is sealed (``previous``: the totals before)."""
    out: dict = {"rounds": int(previous.get("rounds", 0)) + 1,
           "restarts": int(previous.get("restarts", 0)),
           "lost": float(previous.get("lost", 0.0)), "trained": float(previous.get("trained", 0.0)),
           "causes": dict(previous.get("causes") or {}),
           "since": previous.get("since") or sealed.sealed_at,
           "round": sealed.round, "last_sealed_at": sealed.sealed_at}
    if after is not None:
        out["restarts"] += 1
        out["lost"] = round(out["lost"] + after["lost"], 3)
        out["trained"] = round(out["trained"] + after["trained"], 3)
        out["causes"][after["cause"]] = int(out["causes"].get(after["cause"], 0)) + 1
    return out


def recent(previous: list, after: dict | None, keep: int) -> list:
    """The last ``keep`` failure endings (:data:`STORM_CAUSES`, for the storm check), the
    newest last."""
    if after is None or keep <= 0 or after["cause"] not in STORM_CAUSES:
        return list(previous[-keep:]) if keep > 0 else []
    short = {"round": after["round"], "ended_at": after["ended_at"],
             "trained": after["trained"], "cause": after["cause"],
             "nodes": involved(after)[:8]}
    return [*previous, short][-min(keep, RECENT_MAX):]


def seal_ops(keys: Keys, sealed: Round, after: dict | None, txn_kv) -> list[dict]:
    """The history writes that ride in the seal transaction: the round's record, the totals,
    and the deletion of the record that falls out of the kept window."""
    job = sealed.job
    ops = [txn_kv("set", keys.history_round(job, sealed.round),
                  value=history_value(record(sealed, after))),
           txn_kv("set", keys.history_totals(job), value=history_value(sealed.totals))]
    if sealed.round > HISTORY_ROUNDS:
        ops.append(txn_kv("delete", keys.history_round(job, sealed.round - HISTORY_ROUNDS)))
    return ops


def storm(endings: list, *, rounds: int, window: float, min_round: float,
          now: float) -> str | None:
    """The restart-storm pattern, or None: the last ``rounds`` rounds all ended within
    ``window`` seconds of ``now``, each after less than ``min_round`` seconds of training."""
    if rounds <= 0 or len(endings) < rounds:
        return None
    last = endings[-rounds:]
    if any(e["trained"] >= min_round or e["ended_at"] < now - window for e in last):
        return None
    nodes = Counter(n for e in last for n in e.get("nodes", []))
    causes = Counter(e["cause"] for e in last)
    named = ", ".join(f"{n} ({c}x)" for n, c in nodes.most_common(8)) or "none named"
    counted = ", ".join(f"{k} {v}x" for k, v in causes.items())
    return (f"restart storm: the last {rounds} failures (in rounds {last[0]['round']}-"
            f"{last[-1]['round']}) each ended a round after less than {min_round:g}s of "
            f"training, all within {window:g}s ({counted}); "
            f"nodes involved: {named}")
