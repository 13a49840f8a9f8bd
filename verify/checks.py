"""The campaign's invariant checks, on records alone (nodes' reports, values seen in Consul).

Pure functions: ``tests/test_campaign.py`` catches each violation kind on hand-built records, and
``python -m verify.run --check-events`` runs them on a recorded ``events.jsonl``.
"""

from __future__ import annotations

import bisect
import contextlib
import json
from collections import defaultdict
from pathlib import Path


def seal_of(values: dict) -> dict:
    """The sealed content of a round, from a node's report or a ``P/round/current`` value."""
    ranks = values.get("participants", values.get("ranks")) or []
    return {"round": values.get("round"), "ranks": list(ranks), "store": values.get("store"),
            "members_index": values.get("members_index"),
            "coordinator": values.get("coordinator"), "seal_id": values.get("seal_id")}


def _key(seal: dict) -> str:
    return json.dumps(seal, sort_keys=True)


def check_invariants(reports: list[dict], consul_values: list[dict],
                     endpoints: dict[int, dict], node_of: dict[int, str], *,
                     min_nodes: int, max_nodes: int) -> list[dict]:
    """Every violation of the round invariants in a campaign's records (empty: none).

    ``reports``: the ``round`` events of the node processes, in the order each process printed
    them, each with its process ``serial``; ``consul_values``: every value of
    ``P/round/current`` the watcher saw, in order (``{"recv", "modify_index", "value"}``);
    ``endpoints``: the trainer-store endpoint each process advertised; ``node_of``: each
    process's node id. A violation is ``{"kind", "round", "detail", "evidence"}``.
    """
    violations: list[dict] = []

    def violation(kind: str, round_no, detail: str, **evidence) -> None:
        violations.append({"kind": kind, "round": round_no, "detail": detail,
                           "evidence": evidence})

    endpoints_of: dict[str, list[dict]] = defaultdict(list)
    for serial, endpoint in endpoints.items():
        endpoints_of[node_of[serial]].append(endpoint)

    # The content of each round number, from every source.
    contents: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    checked: set[str] = set()

    def check_seal(seal: dict, source: str) -> None:
        contents[seal["round"]][_key(seal)].append(source)
        if _key(seal) in checked:
            return
        checked.add(_key(seal))
        ranks, number = seal["ranks"], seal["round"]
        if not ranks or len(set(ranks)) != len(ranks):
            violation("ranks", number, f"round {number} ranks are not unique node ids: {ranks}",
                      seal=seal, source=source)
        if not min_nodes <= len(ranks) <= max_nodes:
            violation("world_size", number, f"round {number} has W={len(ranks)} outside "
                      f"[{min_nodes}, {max_nodes}]", seal=seal, source=source)
        if ranks and seal["store"] not in endpoints_of.get(ranks[0], []):
            violation("store_endpoint", number, f"round {number} store {seal['store']} is no "
                      f"endpoint rank 0 ({ranks[0]}) ever advertised", seal=seal, source=source,
                      advertised=endpoints_of.get(ranks[0], []))

    for value in consul_values:
        v = value.get("value") or {}
        if v.get("closed"):
            violation("run_closed", v.get("round"), f"the run was closed: {v['closed']}",
                      value=value)
        if v.get("ranks"):
            check_seal(seal_of(v), f"consul@{value.get('modify_index')}")

    last_round: dict[int, int] = {}
    in_round: dict[tuple[int, str], set[int]] = defaultdict(set)
    for report in reports:
        serial, node, number = report["serial"], report["node_id"], report["round"]
        seal = seal_of(report)
        check_seal(seal, f"{node}/p{serial}")
        ranks, rank = seal["ranks"], report.get("rank")
        if node not in ranks:
            violation("not_a_participant", number, f"{node}/p{serial} got round {number} "
                      f"that does not list it: {ranks}", report=report)
        elif report.get("world_size") != len(ranks) or rank != ranks.index(node):
            violation("ranks", number, f"{node}/p{serial} got rank {rank} of "
                      f"{report.get('world_size')} in round {number}; participants {ranks}",
                      report=report)
        if ranks and ranks[0] == node and seal["store"] != endpoints.get(serial):
            violation("store_endpoint", number, f"{node}/p{serial} is rank 0 of round {number} "
                      f"but the store is {seal['store']}, not its endpoint "
                      f"{endpoints.get(serial)}", report=report)
        previous = last_round.get(serial)
        if previous is not None and number <= previous:
            violation("round_not_increasing", number, f"{node}/p{serial} returned round "
                      f"{number} after round {previous}", report=report)
        last_round[serial] = number
        in_round[(number, node)].add(serial)

    for (number, node), serials in sorted(in_round.items()):
        if len(serials) > 1:
            violation("node_twice_in_round", number, f"processes {sorted(serials)} of node id "
                      f"{node} were all in round {number}", serials=sorted(serials))

    for number, seen in sorted(contents.items()):
        if len(seen) > 1:
            seal_ids = {json.loads(k)["seal_id"] for k in seen}
            kind = "sealed_twice" if len(seal_ids) > 1 else "disagreement"
            violation(kind, number, f"round {number} has {len(seen)} different contents "
                      f"({len(seal_ids)} seal ids)",
                      contents={k: sorted(set(v))[:12] for k, v in seen.items()})

    highest = 0
    for value in consul_values:
        number = (value.get("value") or {}).get("round") or 0
        if (value.get("value") or {}).get("ranks"):
            if number < highest:
                violation("round_went_back", number, f"P/round/current went from round "
                          f"{highest} back to {number}", value=value)
            highest = max(highest, number)
    return violations


def check_missed_rounds(consul_values: list[dict],
                        member_history: dict[str, list[tuple[float, int | None, str | None]]],
                        serial_of: dict[str, int], reports: list[dict],
                        unavailable: dict[int, list[tuple[float, float]]], *,
                        until: float, margin: float = 20.0) -> list[dict]:
    """Liveness: a node process that did not return a sealed round meant for it.

    A round is meant for a process when it lists its node and its ``members_index`` covers the
    process's current member write (the acceptance rule of docs/protocol.md). Flagged when the
    process reported neither that round nor a later one within ``margin`` seconds of the round
    becoming readable (the watcher saw it), although for that whole window it ran, was not
    frozen, its client agent was up (``unavailable``: intervals per process serial when it was
    not), and its member key stayed unchanged (a node whose session was lost announces again and
    waits for another round). ``consul_values``: the watcher's values of ``P/round/current``;
    ``member_history``: each member key's (wall time seen, ModifyIndex or None when deleted,
    incarnation); ``serial_of``: incarnation id -> process serial; ``reports``: the round events
    (``serial``, ``round``, ``recv``); ``until``: the end of the records.
    """
    reported: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for r in reports:
        reported[r["serial"]].append((r["recv"], r["round"]))
    violations = []
    for value in consul_values:
        v = value.get("value") or {}
        ranks = v.get("ranks") or []
        opened, closes = value["recv"], value["recv"] + margin
        if closes > until:
            continue
        for node in ranks:
            history = member_history.get(node, [])
            at = bisect.bisect_right([h[0] for h in history], opened) - 1
            if at < 0:
                continue
            _, write, incarnation = history[at]
            serial = serial_of.get(str(incarnation))
            if write is None or serial is None or (v.get("members_index") or 0) < write:
                continue
            if at + 1 < len(history) and history[at + 1][0] < closes:
                continue  # the key changed: the node announced again
            if any(a < closes and b > opened for a, b in unavailable.get(serial, [])):
                continue
            if any(t <= closes and number >= v.get("round", 0)
                   for t, number in reported[serial]):
                continue
            violations.append({
                "kind": "own_round_missed", "round": v.get("round"),
                "detail": f"{node}/p{serial} did not return round {v.get('round')} (sealed "
                          f"{v.get('sealed_at', 0):.3f} by {v.get('coordinator')}, readable "
                          f"from {opened:.3f}, members_index {v.get('members_index')}) within "
                          f"{margin:g}s, although the round covers its member write {write} "
                          "and it ran, unfrozen, its agent up, its key unchanged",
                "evidence": {"seal": v, "serial": serial, "write": write,
                             "reports_after": [x for x in reported[serial] if x[0] >= opened][:3]}})
    return violations


def check_events_file(path: Path, *, min_nodes: int, max_nodes: int) -> int:
    """Check the round invariants (:func:`check_invariants`) of a recorded events.jsonl; print
    the violations; 1 if any."""
    reports, values, endpoints, node_of = [], [], {}, {}
    with open(path) as events:
        for line in events:
            event = json.loads(line)
            kind = event.get("event")
            if kind == "round":
                reports.append(event)
            elif kind == "consul":
                values.append(event)
            elif kind == "start":
                endpoints[event["serial"]] = event["endpoint"]
                node_of[event["serial"]] = event["node_id"]
    reports.sort(key=lambda r: (r["serial"], r["recv"]))
    violations = check_invariants(reports, values, endpoints, node_of, min_nodes=min_nodes,
                                  max_nodes=max_nodes)
    rounds = {r["seal_id"] for r in reports} | {
        v["value"].get("seal_id") for v in values if (v.get("value") or {}).get("ranks")}
    print(f"{path}: {len(rounds)} sealed rounds, {len(reports)} reports, {len(values)} values "
          f"of P/round/current, {len(violations)} violation(s)")
    for violation in violations:
        print(f"- {violation['kind']} (round {violation['round']}): {violation['detail']}")
    return 1 if violations else 0


def loadavg() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"
