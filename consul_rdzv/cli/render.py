"""What ``consul-rdzv`` shows of a run: the status document (``status --json``, each ``watch``
frame), its text, and what a watch compares."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from ..layout import Member, RunState
from ..service import SERVICE_PREFIX
from .read import Instance, RunView, min_max, run_state
from .text import fmt_duration, table, utc

#: Fields of a status document that change with every look, not with the run (and every field
#: named ``*_age``): a watch does not redraw for them.
_VOLATILE = ("time", "heartbeat_at", "age", "idle")


def _node_row(rank: int | None, node: str, member: Member | None, inst: Instance | None,
              fallback_host: str, state: str, now: float,
              fallback_address: str = "") -> dict[str, Any]:
    # The trainer-store host the node advertises (torchrun's --local-addr), as the round's
    # store shows it; else its service instance's Address (the same under torchrun); for a
    # node already gone from Consul, rank 0's store host (the sealed round records it).
    endpoint = (member.endpoint or {}) if member else {}
    address = (endpoint.get("host") or (inst.address if inst else "") or fallback_address
               or fallback_host or (member.host if member else ""))
    beat = inst.heartbeat_at if inst else None
    return {
        "rank": rank, "node": node, "address": address,
        "host": member.host if member else (fallback_host or None),
        "health": inst.status if inst else None,
        "consul_node": inst.consul_node if inst else None,
        "heartbeat_at": utc(beat),
        "heartbeat_age": None if beat is None else round(now - beat, 3),
        "heartbeat_source": inst.source if inst else None,
        # the check's TTL (heartbeat_timeout): a heartbeat older than this is a dead node's
        "ttl": (inst.meta.get("ttl") or None) if inst else None,
        "state": state,
        # why its Consul node holds it out of rounds (docs/health.md), or None
        "held_out": (member.health or None) if member else None,
    }


def status_doc(view: RunView) -> dict[str, Any]:
    """The JSON document of ``status`` (and of each ``watch`` frame); the text is made from it."""
    now = view.read_at
    state = view.state or RunState()
    current = state.round
    sealed = current if current and current.ranks else None
    store = sealed.store if sealed else None
    # rank 0 hosts the trainer store: the address it advertised, even once it is gone
    store_host = str(store.get("host") or "") if isinstance(store, dict) else ""
    rows: list[dict[str, Any]] = []
    for rank, node in enumerate(sealed.ranks if sealed else []):
        assert sealed is not None
        member, inst = state.members.get(node), view.instances.get(node)
        if member is None:
            st = "gone"
        elif member.modify_index > sealed.members_index:
            st = "rejoining"
        elif inst is not None and inst.status == "critical":
            st = "critical"
        else:
            st = "active"
        # the round records no hosts: the member key says, else the service's meta
        host = (inst.meta.get("host") or "") if inst else ""
        rows.append(_node_row(rank, node, member, inst, host, st, now,
                              store_host if rank == 0 else ""))
    in_round = set(sealed.ranks) if sealed else set()
    waiting = sorted((m for n, m in state.members.items() if n not in in_round),
                     key=lambda m: (m.create_index, m.node))
    for member in waiting:
        rows.append(_node_row(None, member.node, member, view.instances.get(member.node), "",
                              "held out" if member.health else "waiting", now))
    listed = in_round | set(state.members)
    for node in sorted(set(view.instances) - listed):
        inst = view.instances[node]
        st = "joining" if inst.status != "critical" else "gone"
        rows.append(_node_row(None, node, None, inst, "", st, now))
    lo, hi, minmax_from = min_max(state)
    passing = sum(1 for i in view.instances.values() if i.status == "passing")
    closed = dict(current.closed) if current and current.closed else None
    if closed:
        with contextlib.suppress(TypeError, ValueError):
            closed["closed_age"] = round(now - float(closed.get("at") or 0), 3)
    sources = {r["heartbeat_source"] for r in rows if r["heartbeat_source"]}
    doc: dict[str, Any] = {
        "time": utc(now),
        "run_id": view.run_id,
        "key_prefix": view.key_prefix,
        "consul": view.url,
        "exists": view.exists,
        "state": (run_state(view.state, view.invalid, passing=passing) if view.exists
                  else "missing"),
        "invalid": view.invalid,
        "services": view.services,
        "coordinator": state.leader.node if state.leader else None,
        "coordinator_since_age": (round(now - state.leader.since, 3)
                                  if state.leader and state.leader.since else None),
        "min_nodes": lo, "max_nodes": hi, "min_max_from": minmax_from,
        "round": sealed.round if sealed else None,
        "world_size": sealed.world_size if sealed else None,
        "sealed_age": (round(now - sealed.sealed_at, 3)
                       if sealed and sealed.sealed_at else None),
        "store": (f"{store.get('host')}:{store.get('port')}"
                  if isinstance(store, dict) else None),
        "store_node": sealed.ranks[0] if sealed else None,
        "closed": closed,
        "nodes": rows,
        "waiting": [m.node for m in waiting],
        "held_out": {n: m.health for n, m in sorted(state.members.items()) if m.health},
        "agent_node": view.agent_node,
        "heartbeat_sources": sorted(sources),
        "instances_hidden": bool(state.members) and not view.instances,
    }
    return doc


def stable(doc: dict[str, Any]) -> str:
    """``doc`` without the fields that change with time alone: what a watch compares."""
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()
                    if k not in _VOLATILE and not k.endswith("_age")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    return json.dumps(strip(doc), sort_keys=True)


def render_status(doc: dict[str, Any]) -> list[str]:
    """The text of ``status`` from its JSON document."""
    prefix = f"{doc['key_prefix']}/{doc['run_id']}"
    lines = [f"run {doc['run_id']} (keys {prefix}/, service "
             f"{', '.join(doc['services'])}) on {doc['consul']}"]

    def field_(name: str, value: str) -> None:
        lines.append(f"  {name + ':':<15}{value}")

    field_("state", doc["state"] + (f" ({doc['invalid']})" if doc["invalid"] else ""))
    if not doc["exists"]:
        lines.append(f"  nothing under {prefix}/ and no service instance yet")
        return lines
    closed = doc["closed"]
    if closed:
        ago = closed.get("closed_age")
        field_("closed", f"by {closed.get('by', '?')}"
               + (f" {fmt_duration(ago)} ago" if ago is not None else "")
               + f": {closed.get('reason', '')} (no further rounds; training nodes train on "
               "until their next rendezvous)")
    since = doc["coordinator_since_age"]
    field_("coordinator", (doc["coordinator"] or "-")
           + (f" (for {fmt_duration(since)})" if since is not None else ""))
    if doc["max_nodes"]:
        field_("min/max", f"{doc['min_nodes']}/{doc['max_nodes']} nodes "
               f"(from {doc['min_max_from']})")
    else:
        field_("min/max", "unknown (no round sealed and no node announced)")
    if doc["round"] is not None:
        sealed = doc["sealed_age"]
        field_("round", f"{doc['round']}, world size {doc['world_size']}"
               + (f", sealed {fmt_duration(sealed)} ago" if sealed is not None else ""))
        field_("trainer store", f"{doc['store'] or '-'} (rank 0: {doc['store_node']})")
    else:
        field_("round", "none sealed yet")
    rows = []
    for r in doc["nodes"]:
        if r["heartbeat_source"] is None:
            beat = "-"
        elif r["heartbeat_age"] is None:
            beat = f"unknown ({r['heartbeat_source']})"
        elif r["heartbeat_age"] < -1:
            beat = (f"{fmt_duration(-r['heartbeat_age'])} ahead ({r['heartbeat_source']}; "
                    "clock skew)")
        else:
            beat = f"{fmt_duration(r['heartbeat_age'])} ago ({r['heartbeat_source']})"
        rows.append(["-" if r["rank"] is None else str(r["rank"]), r["node"],
                     r["address"] or "-", r["health"] or "-", beat, r.get("ttl") or "-",
                     r["state"]])
    if rows:
        lines.append("")
        lines += table(["RANK", "NODE", "ADDRESS", "HEALTH", "HEARTBEAT", "TTL", "STATE"], rows,
                       "  ")
    lines.append("")
    field_("waiting", ", ".join(doc["waiting"]) or "none")
    for node, why in (doc.get("held_out") or {}).items():
        field_("held out", f"{node}: {why}")
    if doc["instances_hidden"]:
        lines.append(f"  health: no service instance of {', '.join(doc['services'])} is visible: "
                     "its agents may be down, or ACLs hide it (a token needs service_prefix "
                     f'"{SERVICE_PREFIX}" and node_prefix "" {{ policy = "read" }})')
    elif "catalog" in doc["heartbeat_sources"]:
        lines.append("  heartbeat: (agent) = read from the agent this CLI talks to"
                     + (f" (Consul node {doc['agent_node']})" if doc["agent_node"] else "")
                     + "; (catalog) = the catalog, which gets a check's output only every "
                       "check_update_interval (5 min by default): ask the node's own agent "
                       "(--address) for current ages")
    elif doc["heartbeat_sources"]:
        lines.append("  heartbeat: read from the agent this CLI talks to (current)")
    return lines


