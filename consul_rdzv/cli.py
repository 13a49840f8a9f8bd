"""``consul-rdzv``: see and operate consul-rdzv runs in Consul, run a dev agent, run the demo.

    consul-rdzv list                        every run under the key prefix
    consul-rdzv status RUN                  one run: coordinator, round, each node's health
    consul-rdzv watch RUN                   status again on every change (blocking queries)
    consul-rdzv close RUN [--reason TEXT]   no further rounds (training nodes train on)
    consul-rdzv drain RUN NODE              take a node out now: the job re-forms without it
    consul-rdzv gc [--yes]                  delete ended and abandoned runs (dry run by default)
    consul-rdzv agent [--bind ADDR --port N] a Consul dev agent until Ctrl-C
    consul-rdzv demo [--keep]               a real 3-node torchrun job on this machine

Global options (``--address``, ``--key-prefix``, ``--token-file``, ...) go before or after the
command. Consul is configured as the library configures it (``ConsulConfig.resolve``): options
first, then the ``CONSUL_*`` variables, then the defaults. Errors are one line on stderr
(``consul-rdzv <command>: <message>``), exit code 1 (2 for usage errors). docs/cli.md is the
reference.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__, runs
from .client import BlockingIndex, ConsulClient, KVEntry, Step
from .config import ConsulConfig
from .errors import (
    ConsulError,
    ConsulTxnConflict,
    ConsulUnavailableError,
    RendezvousError,
)
from .layout import Keys, Member, RunState
from .planning import active_participants
from .runs import Closing, Verdict
from .service import (
    DEFAULT_KEY_PREFIX,
    NODE_ID_RULE,
    RDZV_TAG,
    SERVICE_PREFIX,
    Incarnation,
    heartbeat_time,
    is_heartbeat_check,
    node_id_of,
    run_of,
    service_name,
    tagged,
    utc_iso,
    valid_node_id,
)
from .settings import RendezvousSettings

PROG = "consul-rdzv"
#: How long one blocking query of ``watch`` waits before it asks again.
WATCH_WAIT = 60.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_STATUS_ORDER = {"passing": 0, "warning": 1, "critical": 2}
#: Fields of a status document that change with every look, not with the run (and every field
#: named ``*_age``): a watch does not redraw for them.
_VOLATILE = ("time", "heartbeat_at", "age", "idle")


class CliError(Exception):
    """A failure the CLI reports as one line on stderr, exit code 1."""


class UsageError(CliError):
    """A bad argument value that argparse cannot see: exit code 2."""


# --------------------------------------------------------------------------------- formatting


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())


def fmt_duration(seconds: float) -> str:
    """A short human duration: ``0.4s``, ``42s``, ``3m05s``, ``2h10m``, ``3d4h``."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{int(seconds)}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours}h"


def parse_duration(text: str) -> float:
    """``90``, ``30s``, ``10m``, ``2h``, ``1d`` as seconds (argparse type)."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: give seconds, or a number with s, m, h or d (e.g. 10m)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"]


def table(headers: list[str], rows: list[list[str]], indent: str = "") -> list[str]:
    """Left-aligned columns separated by two spaces (kubectl's look)."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    lines = []
    for row in [headers, *rows]:
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def utc(ts: float | None) -> str | None:
    """An ISO time (UTC) for JSON output, as a heartbeat's (service.utc_iso)."""
    return utc_iso(ts) if ts else None


# --------------------------------------------------------------------------------- reading Consul


@dataclass
class Instance:
    """One node's service instance of a run, with the health of its checks."""

    node_id: str
    service_id: str
    service: str
    address: str
    port: int
    consul_node: str
    status: str  # worst of the instance's checks and its Consul node's: passing/warning/critical
    output: str  # the heartbeat check's output ("... · heartbeat <ISO time>")
    source: str  # where the heartbeat output comes from: "agent" or "catalog"
    incarnation: str
    meta: dict = field(default_factory=dict)

    @property
    def heartbeat_at(self) -> float | None:
        return heartbeat_time(self.output)


@dataclass
class RunView:
    """Everything ``status`` shows of one run, read at one moment."""

    run_id: str
    key_prefix: str
    url: str
    services: list[str]
    keys: list[KVEntry]
    state: RunState | None
    invalid: str | None  # why the run's keys are not consul-rdzv state
    instances: dict[str, Instance]
    agent_node: str | None  # the Consul node of the agent the CLI talks to, if it holds checks
    read_at: float

    @property
    def prefix(self) -> str:
        return f"{self.key_prefix}/{self.run_id}"

    @property
    def exists(self) -> bool:
        return bool(self.keys) or bool(self.instances)


def _worst(statuses: Iterable[str]) -> str:
    worst = "passing"
    for status in statuses:
        if _STATUS_ORDER.get(status, 2) > _STATUS_ORDER[worst]:
            worst = status if status in _STATUS_ORDER else "critical"
    return worst


class Reader:
    """The CLI's reads of Consul: KV trees, service health, the agent's own checks."""

    def __init__(self, client: ConsulClient, key_prefix: str,
                 service_name: str | None = None) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.service_name = service_name

    @property
    def url(self) -> str:
        return self.client.config.url

    def probe(self, prefix: str) -> None:
        """Read ``prefix/`` itself: a token without key read there gets a 403 naming the rule.

        A recursive KV read is filtered by ACLs instead (and an anonymous request is not even
        told it was), so a missing permission would look like an empty prefix.
        """
        self.client.kv_get(prefix + "/")

    def tree(self, prefix: str, *, index: int | None = None,
             wait: float | None = None) -> tuple[int, list[KVEntry]]:
        """Every key under ``prefix/`` and the index to block on next."""
        res, headers = self.client.read_with_headers(f"/v1/kv/{prefix}/", params={"recurse": ""},
                                                     index=index, wait=wait)
        if headers.get("x-consul-results-filtered-by-acls", "").lower() == "true":
            raise CliError(
                f"Consul's ACLs hide some keys under {prefix}/ from this token: give it "
                f'key_prefix "{self.key_prefix}/" {{ policy = "read" }} (write for close, drain '
                "and gc).")
        return res.index, [KVEntry.from_json(item) for item in res.data or []]

    def services_of(self, run_id: str) -> list[str]:
        """The service names of a run: ``--service-name``, else every consul-rdzv service
        tagged ``run-<run_id>``, and the default ``torchelastic-<run_id>`` (service.py)."""
        if self.service_name:
            return [self.service_name]
        names = [service_name(run_id)]
        with contextlib.suppress(ConsulError):
            services = self.client.read_with_headers("/v1/catalog/services")[0].data or {}
            names += sorted(name for name, tags in services.items()
                            if tagged(tags, run_id)
                            and name not in names)
        return names

    def agent_checks(self) -> dict[str, dict]:
        """The checks of the agent the CLI talks to (their output is current; the catalog gets
        an output-only change only every check_update_interval). Empty if hidden or failing."""
        try:
            return self.client.agent_checks() or {}
        except ConsulError:
            return {}

    def instances(self, run_id: str, services: list[str],
                  agent_checks: dict[str, dict] | None = None) -> dict[str, Instance]:
        """node id -> the run's service instance of that node (the newest incarnation wins)."""
        agent_checks = self.agent_checks() if agent_checks is None else agent_checks
        found: dict[str, Instance] = {}
        for name in services:
            entries = self.client.read_with_headers(f"/v1/health/service/{name}")[0].data or []
            for entry in entries:
                inst = _instance(entry, run_id, agent_checks)
                if inst is None:
                    continue
                known = found.get(inst.node_id)
                if known is None or _started(inst) > _started(known):
                    found[inst.node_id] = inst
        return found

    def run_view(self, run_id: str, *, services: list[str] | None = None) -> RunView:
        """Read one run: its keys (parsed) and its service instances with their health."""
        prefix = f"{self.key_prefix}/{run_id}"
        _, entries = self.tree(prefix)
        state, invalid = None, None
        try:
            state = RunState.parse(Keys(prefix), entries)
        except RendezvousError as exc:
            invalid = one_line(exc)
        services = services or self.services_of(run_id)
        checks = self.agent_checks()
        instances = self.instances(run_id, services, checks)
        agent_node = next((c.get("Node") for c in checks.values() if c.get("Node")), None)
        return RunView(run_id, self.key_prefix, self.url, services, entries, state, invalid,
                       instances, agent_node, time.time())

    def runs(self) -> dict[str, list[KVEntry]]:
        """run id -> its keys, for every run under the key prefix."""
        _, entries = self.tree(self.key_prefix)
        runs: dict[str, list[KVEntry]] = {}
        start = len(self.key_prefix) + 1
        for entry in entries:
            rest = entry.key[start:]
            run_id = rest.split("/", 1)[0]
            if run_id:
                runs.setdefault(run_id, []).append(entry)
        return runs

    def passing_runs(self) -> dict[str, int]:
        """run id -> how many passing consul-rdzv service instances carry its tag."""
        try:
            res, _ = self.client.read_with_headers(
                "/v1/health/state/any", params={"filter": f'"{RDZV_TAG}" in ServiceTags'})
        except ConsulError:
            return {}
        worst: dict[tuple[str, str], str] = {}  # (Consul node, service id) -> worst status
        runs: dict[tuple[str, str], str] = {}
        for check in res.data or []:
            sid = check.get("ServiceID") or ""
            tags = check.get("ServiceTags") or []
            run = run_of(tags)
            if not sid or run is None:
                continue
            key = (check.get("Node") or "", sid)
            worst[key] = _worst([worst.get(key, "passing"), check.get("Status", "critical")])
            runs[key] = run
        counts: dict[str, int] = {}
        for key, status in worst.items():
            if status == "passing":
                counts[runs[key]] = counts.get(runs[key], 0) + 1
        return counts


def _started(inst: Instance) -> float:
    """When the incarnation that registered ``inst`` started (0 if its meta does not say)."""
    return Incarnation.of(inst.meta).started


def _instance(entry: dict, run_id: str, agent_checks: dict[str, dict]) -> Instance | None:
    """The run's instance in one ``/v1/health/service`` entry (None if another run's), with the
    heartbeat output and status from the agent's own checks when it holds them."""
    service = entry.get("Service") or {}
    meta = service.get("Meta") or {}
    if meta.get("run_id") not in (None, run_id):
        return None  # another run sharing a service name
    sid = service.get("ID", "")
    node_id = node_id_of(service, run_id)
    consul_node = (entry.get("Node") or {}).get("Node", "")
    checks = entry.get("Checks") or []
    statuses, output, source = [], "", "catalog"
    for check in checks:
        status, out = check.get("Status", "critical"), check.get("Output", "")
        local = agent_checks.get(check.get("CheckID", ""))
        if local is not None and local.get("Node") == consul_node:
            status, out = local.get("Status", status), local.get("Output", out)
            if check.get("ServiceID") == sid:
                source = "agent"
        statuses.append(status)
        if is_heartbeat_check(check, sid):
            output = out
    return Instance(node_id=node_id, service_id=sid, service=service.get("Service", ""),
                    address=service.get("Address") or "", port=int(service.get("Port") or 0),
                    consul_node=consul_node, status=_worst(statuses), output=output,
                    source=source, incarnation=Incarnation.of(meta).id, meta=meta)


# --------------------------------------------------------------------------------- run summaries


def run_state(state: RunState | None, invalid: str | None, *, passing: int = 0) -> str:
    """One word for a run: training, re-forming, waiting, closed, abandoned, invalid, starting.

    * ``training``: a sealed round whose participants are all still in it;
    * ``re-forming``: a sealed round that a participant left or asked to leave, nodes present;
    * ``waiting``: nodes present, no round sealed yet (or none of the last round is left);
    * ``closed``: closed with ``consul-rdzv close`` or at the job's end (nodes may still train);
    * ``abandoned``: no live node (no member key) and no passing service instance;
    * ``starting``: no member key yet, but passing service instances (nodes registering);
    * ``invalid``: keys under the run that are not consul-rdzv state.
    """
    if invalid:
        return "invalid"
    state = state or RunState()
    current = state.round
    if current and current.closed:
        return "closed"
    if not state.members:
        return "starting" if passing else "abandoned"
    if current and current.ranks:
        active = active_participants(state)
        if len(active) == len(current.ranks):
            return "training"
        if active or any(n in state.members for n in current.ranks):
            return "re-forming"
    return "waiting"


def _times(state: RunState | None) -> tuple[float | None, float | None]:
    """(earliest, latest) wall-clock time recorded in a run's values, or None if none is."""
    if state is None:
        return None, None
    stamps = [m.started for m in state.members.values()]
    if state.leader:
        stamps.append(state.leader.since)
    if state.round:
        stamps += [state.round.first_join, state.round.sealed_at]
        if state.round.closed:
            with contextlib.suppress(TypeError, ValueError):
                stamps.append(float(state.round.closed.get("at") or 0))
    stamps = [s for s in stamps if s and s > 0]
    return (min(stamps), max(stamps)) if stamps else (None, None)


def _min_max(state: RunState) -> tuple[int | None, int | None, str]:
    current = state.round
    if current and current.ranks and current.max_nodes:
        return current.min_nodes, current.max_nodes, f"round {current.round}'s coordinator"
    pairs = {(m.min_nodes, m.max_nodes) for m in state.members.values() if m.max_nodes}
    if len(pairs) == 1:
        lo, hi = pairs.pop()
        return lo, hi, "the nodes' settings"
    if pairs:
        lo = min(p[0] for p in pairs)
        hi = max(p[1] for p in pairs)
        return lo, hi, "the nodes' settings, which disagree"
    return None, None, "unknown"


def run_summary(run_id: str, entries: list[KVEntry], key_prefix: str, now: float,
                passing: int = 0) -> dict[str, Any]:
    """One row of ``list`` (and the facts ``gc`` decides on)."""
    state, invalid = None, None
    try:
        state = RunState.parse(Keys(f"{key_prefix}/{run_id}"), entries)
    except RendezvousError as exc:
        invalid = one_line(exc)
    first, last = _times(state)
    current = state.round if state else None
    sealed = current if current and current.ranks else None
    lo, hi, _ = _min_max(state) if state else (None, None, "")
    return {
        "run_id": run_id,
        "state": run_state(state, invalid, passing=passing),
        "round": sealed.round if sealed else None,
        "world_size": sealed.world_size if sealed else None,
        "nodes": len(state.members) if state else 0,
        "min_nodes": lo, "max_nodes": hi,
        "coordinator": state.leader.node if state and state.leader else None,
        "closed": current.closed if current else None,
        "passing_instances": passing,
        "keys": len(entries),
        "started_at": utc(first), "last_activity_at": utc(last),
        "age": None if first is None else round(now - first, 3),
        "idle": None if last is None else round(now - last, 3),
        "invalid": invalid,
    }


def _node_row(rank: int | None, node: str, member: Member | None, inst: Instance | None,
              fallback_host: str, state: str, now: float,
              fallback_address: str = "") -> dict[str, Any]:
    # The trainer-store host the node advertises (torchrun's --local-addr), as the round's
    # store shows it; else its service instance's Address (the same under torchrun); for a
    # node already gone from Consul, what the sealed round recorded (rank 0: the store's host).
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
        member, inst = state.members.get(node), view.instances.get(node)
        if member is None:
            st = "gone"
        elif member.modify_index > sealed.members_index:
            st = "rejoining"
        elif inst is not None and inst.status == "critical":
            st = "critical"
        else:
            st = "active"
        host = sealed.hosts[rank] if rank < len(sealed.hosts) else ""
        rows.append(_node_row(rank, node, member, inst, host, st, now,
                              store_host if rank == 0 else ""))
    in_round = set(sealed.ranks) if sealed else set()
    waiting = sorted((m for n, m in state.members.items() if n not in in_round),
                     key=lambda m: (m.create_index, m.node))
    for member in waiting:
        rows.append(_node_row(None, member.node, member, view.instances.get(member.node), "",
                              "waiting", now))
    listed = in_round | set(state.members)
    for node in sorted(set(view.instances) - listed):
        inst = view.instances[node]
        st = "joining" if inst.status != "critical" else "gone"
        rows.append(_node_row(None, node, None, inst, "", st, now))
    lo, hi, minmax_from = _min_max(state)
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


# --------------------------------------------------------------------------------- commands


def _client(args: argparse.Namespace) -> ConsulClient:
    config = ConsulConfig.resolve(
        address=args.address, token_file=args.token_file, datacenter=args.datacenter,
        ca_file=args.ca_file, ca_path=args.ca_path, client_cert=args.client_cert,
        client_key=args.client_key, tls_server_name=args.tls_server_name)
    return ConsulClient(config, timeout=max(1.0, min(10.0, args.consul_timeout)),
                        retry_timeout=args.consul_timeout)


def _reader(args: argparse.Namespace) -> Reader:
    return Reader(_client(args), args.key_prefix, args.service_name)


def _check_run_id(args: argparse.Namespace) -> None:
    """The run id and the key prefix, validated as the library validates them (exit 2)."""
    try:
        RendezvousSettings(run_id=getattr(args, "run_id", "x"), key_prefix=args.key_prefix)
    except ValueError as exc:
        raise UsageError(one_line(exc)) from None


def _no_such_run(view: RunView, what: str = "") -> CliError:
    return CliError(
        f"no such run {view.run_id!r}: nothing under {view.prefix}/ and no instance of service "
        f"{', '.join(view.services)} in Consul at {view.url}{what}. Check the run id and "
        f"--key-prefix (consul-rdzv list shows the runs under {view.key_prefix}/).")


def _print_json(doc: Any, *, compact: bool = False) -> None:
    text = json.dumps(doc, separators=(",", ":")) if compact else json.dumps(doc, indent=2)
    print(text, flush=True)


def _all_runs(args: argparse.Namespace) -> tuple[Reader, dict[str, list[KVEntry]],
                                                  list[dict[str, Any]]]:
    """Every run under the key prefix: the reader, each run's keys, and its
    :func:`run_summary` (by run id): what ``list`` shows and ``gc`` judges."""
    _check_run_id(args)
    reader = _reader(args)
    reader.probe(args.key_prefix)
    runs = reader.runs()
    passing = reader.passing_runs()
    now = time.time()
    rows = [run_summary(run_id, entries, args.key_prefix, now, passing.get(run_id, 0))
            for run_id, entries in sorted(runs.items())]
    return reader, runs, rows


def cmd_list(args: argparse.Namespace) -> int:
    """``list``: one line per run under the key prefix."""
    reader, _, rows = _all_runs(args)
    if args.json:
        _print_json({"key_prefix": args.key_prefix, "consul": reader.url, "runs": rows})
        return 0
    if not rows:
        print(f"no runs under {args.key_prefix}/ on {reader.url}")
        return 0

    def dash(value: Any) -> str:
        return "-" if value is None else str(value)

    print("\n".join(table(
        ["RUN", "STATE", "ROUND", "WORLD", "NODES", "MIN:MAX", "COORDINATOR", "AGE"],
        [[r["run_id"], r["state"], dash(r["round"]), dash(r["world_size"]), str(r["nodes"]),
          f"{r['min_nodes']}:{r['max_nodes']}" if r["max_nodes"] else "-",
          dash(r["coordinator"]), "-" if r["age"] is None else fmt_duration(r["age"])]
         for r in rows])))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``status RUN``: one run's coordinator, round and nodes."""
    _check_run_id(args)
    reader = _reader(args)
    reader.probe(f"{args.key_prefix}/{args.run_id}")
    view = reader.run_view(args.run_id)
    if not view.exists:
        raise _no_such_run(view)
    doc = status_doc(view)
    if args.json:
        _print_json(doc)
    else:
        print("\n".join(render_status(doc)))
    return 0


def _watcher(read: Callable[[int | None], int], changes: queue.Queue, what: str) -> None:
    """Block on one Consul query forever; put ``what`` on ``changes`` whenever its answer may
    hold a change (or the exception that ended it). The main thread re-reads the run and
    compares documents: an answer is only a hint. Index discipline by Consul's rules
    (:class:`BlockingIndex`): an answer that did not move is no change; one that went
    backwards starts the query over, after a pause that grows while it keeps happening (never
    a busy loop against a server with less state)."""
    index = BlockingIndex()
    pause = 0.0
    while True:
        try:
            returned = read(index.param)
        except Exception as exc:  # handed to the main thread, which reports it
            changes.put(exc)
            return
        step = index.update(returned)
        if step is Step.SAME:
            pause = 0.0
            continue
        changes.put(what)
        if step is Step.RESET:
            pause = min(max(pause * 2, 0.1), 5.0)
            time.sleep(pause)
        else:
            pause = 0.0


def cmd_watch(args: argparse.Namespace) -> int:
    """``watch RUN``: the status again each time the run's keys or its nodes' health change."""
    _check_run_id(args)
    if not 0 < args.wait <= 600:
        raise UsageError(f"--wait {args.wait:g}s: give 1s to 10m (Consul caps a blocking "
                         "query's wait at 10 minutes).")
    reader = _reader(args)
    prefix = f"{args.key_prefix}/{args.run_id}"
    reader.probe(prefix)
    services = reader.services_of(args.run_id)
    changes: queue.Queue = queue.Queue()

    def kv(index: int | None) -> int:
        return reader.tree(prefix, index=index, wait=args.wait)[0]

    readers: list[tuple[Callable[[int | None], int], str]] = [(kv, "keys")]
    for name in services:
        def health(index: int | None, name: str = name) -> int:
            return reader.client.read_with_headers(f"/v1/health/service/{name}", index=index,
                                                   wait=args.wait)[0].index
        readers.append((health, f"health of {name}"))
    for read, what in readers:
        threading.Thread(target=_watcher, args=(read, changes, what), daemon=True,
                         name=f"watch {what}").start()
    deadline = time.monotonic() + args.timeout if args.timeout else None
    shown = None
    frames = 0
    while True:
        view = reader.run_view(args.run_id, services=services)
        doc = status_doc(view)
        key = stable(doc)
        if key != shown:
            shown = key
            frames += 1
            if args.json:
                _print_json(doc, compact=True)
            else:
                stamp = time.strftime("%H:%M:%S", time.localtime(view.read_at))
                head = f"--- {stamp}  {args.run_id}: {doc['state']}"
                if doc["round"] is not None:
                    head += f", round {doc['round']}, world {doc['world_size']}"
                if frames > 1:
                    print()
                print(head + " ---")
                print("\n".join(render_status(doc)), flush=True)
        # Wait for the next change; several changes at once make one frame.
        item = _next_change(changes, deadline)
        if item is None:
            return 0
        if isinstance(item, Exception):
            raise item
        while True:
            try:
                item = changes.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Exception):
                raise item


def _next_change(changes: queue.Queue, deadline: float | None) -> Any:
    """The next item of ``changes``, or None once ``deadline`` (monotonic) has passed."""
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None
        try:
            # A bounded get so that Ctrl-C is seen at once on every platform.
            return changes.get(timeout=0.5 if remaining is None else min(0.5, remaining))
        except queue.Empty:
            continue


def _existing_view(args: argparse.Namespace, reader: Reader) -> RunView:
    _check_run_id(args)
    reader.probe(f"{args.key_prefix}/{args.run_id}")
    return reader.run_view(args.run_id)


def cmd_close(args: argparse.Namespace) -> int:
    """``close RUN``: mark the run closed (runs.close: a CAS on its round key), only if the run
    exists."""
    reader = _reader(args)
    view = _existing_view(args, reader)
    if not view.exists:
        raise _no_such_run(view, "; nothing was written")
    done = runs.close(reader.client, Keys(view.prefix), reason=args.reason,
                      by=f"consul-rdzv close on {socket.gethostname()}",
                      deadline=time.monotonic() + max(10.0, args.consul_timeout))
    if done.result is Closing.ALREADY:
        closed = done.round.closed or {}
        print(f"run {args.run_id} was already closed by {closed.get('by', '?')} "
              f"({closed.get('reason', '')}); nothing changed.")
        return 0
    if not done.closed:
        raise CliError(f"could not close run {args.run_id}: its round key kept changing "
                       "(a coordinator sealing rounds); try again")
    live = len(view.state.members) if view.state else 0
    print(f"run {args.run_id} closed ({args.reason}).")
    print("This stops future rounds only: nodes that are training keep training until their "
          "next rendezvous (a failure, a membership change or the end of the job), where they "
          "stop with RendezvousClosedError; nodes waiting in a rendezvous stop now.")
    print(f"{live} node(s) of the run are alive now. Once none is left, the run id can be used "
          "again: the next joiner removes the closed marker (consul-rdzv gc removes it too).")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """``drain RUN NODE``: destroy the node's session, which deletes its member key."""
    if not valid_node_id(args.node):
        raise UsageError(f"node id {args.node!r} is invalid: use {NODE_ID_RULE}")
    reader = _reader(args)
    view = _existing_view(args, reader)
    if not view.exists:
        raise _no_such_run(view, "; nothing was changed")
    keys = Keys(view.prefix)
    state = view.state or RunState()
    done = runs.drain(reader.client, keys, args.node,
                      by=f"consul-rdzv drain ({socket.gethostname()})", reason=args.reason,
                      timeout=max(5.0, args.consul_timeout))
    entry, member = done.entry, done.member
    if entry is None:
        members = ", ".join(sorted(state.members)) or "none"
        raise CliError(f"node {args.node!r} is not in run {args.run_id}: no key "
                       f"{keys.member(args.node)} (nodes present: {members})")
    if member is None:
        print(f"node {args.node}: its member key held no session; deleted it.")
        return 0
    if not done.gone:
        raise CliError(f"destroyed session {entry.session} of node {args.node}, but its member "
                       f"key {keys.member(args.node)} is still there")
    coordinator = state.leader is not None and state.leader_session == entry.session
    current = state.round
    in_round = bool(current and args.node in current.ranks)
    print(f"node {args.node} drained from run {args.run_id}: its Consul session "
          f"{entry.session} is destroyed and its member key is gone"
          + (" (with the coordinator key it held)" if coordinator else "") + ".")
    if in_round:
        print(f"The other participants of round {current.round} see it gone now "
              "(num_nodes_waiting() >= 1) and re-rendezvous at once without it"
              + ("; a waiting node becomes coordinator" if coordinator else "") + ".")
    else:
        print("It was waiting, not in the current round: the next round forms without it"
              + ("; another node becomes coordinator" if coordinator else "") + ".")
    print(f"The drained process (pid {member.pid} on {member.host}) refuses its next round and "
          "leaves the run for good, as if stopped (its torchrun agent exits with "
          "RendezvousClosedError: drained). A new process with the same node id may join again.")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """``gc``: delete runs that ended (closed, no live node) or were abandoned."""
    reader, entries, rows = _all_runs(args)
    doomed, kept = [], []
    for row in rows:
        delete, row["why"] = _gc_reason(row, args.older_than)
        (doomed if delete else kept).append(row)
    deleted = []
    if args.yes:
        for row in doomed:
            try:
                runs.delete_run(reader.client, entries[row["run_id"]])
                deleted.append(row)
            except ConsulTxnConflict:
                row["why"] = "changed while being deleted (a node joined?): left as it is"
                kept.append(row)
    if args.json:
        doc: dict[str, Any] = {"key_prefix": args.key_prefix, "consul": reader.url,
                               "dry_run": not args.yes, "older_than": args.older_than}
        if args.yes:
            doc["deleted"] = deleted
        else:
            doc["would_delete"] = doomed
        doc["kept"] = kept
        _print_json(doc)
        return 0
    gone = deleted if args.yes else doomed
    if not gone:
        print(f"nothing to delete under {args.key_prefix}/ on {reader.url}")
    else:
        verb = "deleted" if args.yes else "would delete"
        print(f"{verb} {len(gone)} run(s) under {args.key_prefix}/ on {reader.url}"
              + ("" if args.yes else " (dry run: --yes deletes them)") + ":")
        print("\n".join(table(
            ["RUN", "STATE", "ROUND", "KEYS", "IDLE", "WHY"],
            [[r["run_id"], r["state"], "-" if r["round"] is None else str(r["round"]),
              str(r["keys"]), "-" if r["idle"] is None else fmt_duration(r["idle"]), r["why"]]
             for r in gone], "  ")))
    if kept:
        print(f"kept {len(kept)} run(s):")
        print("\n".join(table(["RUN", "STATE", "WHY"],
                              [[r["run_id"], r["state"], r["why"]] for r in kept], "  ")))
    return 0


def _gc_reason(row: dict[str, Any], older_than: float) -> tuple[bool, str]:
    """Whether ``gc`` deletes a run (runs.gc_verdict decides), and why (or why not)."""
    idle = row["idle"]
    verdict = runs.gc_verdict(invalid=bool(row["invalid"]), nodes=row["nodes"],
                              closed=row["state"] == "closed",
                              passing=row["passing_instances"], idle=idle,
                              older_than=older_than)
    if verdict is Verdict.INVALID:
        why = "not consul-rdzv state: never touched"
    elif verdict is Verdict.LIVE:
        why = f"{row['nodes']} live node(s)"
    elif verdict is Verdict.CLOSED:
        why = "closed, no live node"
    elif verdict is Verdict.STARTING:
        why = f"{row['passing_instances']} passing service instance(s) (nodes starting)"
    elif verdict is Verdict.RECENT:
        why = (f"no live node for now, last activity {fmt_duration(idle or 0.0)} ago "
               f"(< --older-than {fmt_duration(older_than)})")
    else:
        when = "unknown" if idle is None else f"{fmt_duration(idle)} ago"
        why = f"abandoned: no live node, no passing instance, last activity {when}"
    return verdict.delete, why


def _agent_listen(args: argparse.Namespace) -> tuple[str, int]:
    """Where ``agent`` listens: ``--bind``/``--port``, or ``--address HOST:PORT`` (an explicit
    option only, never CONSUL_HTTP_ADDR: that names an agent to use, not one to start)."""
    import ipaddress

    host, port = args.bind, args.port
    if args.address:
        if args.bind or args.port:
            raise UsageError("give either --address HOST:PORT or --bind/--port, not both")
        from .config import normalize_address

        url = normalize_address(args.address)
        if url.startswith("https://"):
            raise UsageError("the dev agent serves plain http only; give --address HOST:PORT")
        host, _, text = url[len("http://"):].rpartition(":")
        port = int(text)
    host = host or "127.0.0.1"
    try:
        if not isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address):
            raise ValueError
    except ValueError:
        raise UsageError(f"agent address {host!r}: give an IPv4 address of this host, or "
                         "0.0.0.0 for every interface") from None
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"agent port {port}: give a port between 1 and 65535")
    return host, port or 0


def cmd_agent(args: argparse.Namespace) -> int:
    """``agent``: a Consul dev agent until Ctrl-C; local only unless --bind/--address says."""
    from .testing import WILDCARD_HOSTS, ConsulAgent

    host, port = _agent_listen(args)
    stop = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    with ConsulAgent(host=host, http_port=port) as agent:
        listen = f"{host}:{agent.port}"
        if host != "127.0.0.1":
            print(f"WARNING: this Consul dev agent listens on {listen} UNSECURED: no ACLs, no "
                  "TLS, no gossip encryption, everything in memory. Anyone who reaches that "
                  "address can read and change all it holds (and with it any job using it), "
                  "and it forgets everything when it stops. For a first trial on a trusted "
                  "network only; production is Consul servers with ACLs (docs/deployment.md).",
                  file=sys.stderr, flush=True)
        print(f"Consul dev agent at http://{listen} (UI: {agent.url}/ui); Ctrl-C or SIGTERM "
              "stops it.")
        if host in WILDCARD_HOSTS:
            print(f"other hosts: export CONSUL_HTTP_ADDR={socket.getfqdn()}:{agent.port} (or "
                  "another address of this host they reach)")
        print(f"export CONSUL_HTTP_ADDR={agent.address}", flush=True)
        # Blocked, the signals wait for sigwait (even SIGINT, which a shell ignores in
        # background jobs) instead of killing this process and orphaning the agent.
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)
        try:
            signal.sigwait(stop)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
    return 0


def _demo_conf(args: argparse.Namespace, node: int) -> str:
    conf = [f"node_id=demo-node-{node}"]
    for name in ("key_prefix", "token_file", "datacenter", "ca_file", "ca_path", "client_cert",
                 "client_key", "tls_server_name", "service_name"):
        value = getattr(args, name)
        if value and not (name == "key_prefix" and value == DEFAULT_KEY_PREFIX):
            conf.append(f"{name}={value}")
    return ",".join(conf)


class _DemoProgress:
    """What the demo shows while its job runs: the nodes' own consul-rdzv lines (rounds, waits)
    from their logs, and the training's progress (every quarter of the steps)."""

    def __init__(self, out: Path, nodes: int, steps: int) -> None:
        self.out, self.nodes, self.steps = out, nodes, steps
        self.offsets: dict[Path, int] = {}
        self.quarter = 0

    def _new_lines(self, path: Path) -> list[str]:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                fh.seek(self.offsets.get(path, 0))
                text = fh.read()
        except OSError:
            return []
        complete = text[:text.rfind("\n") + 1]
        self.offsets[path] = self.offsets.get(path, 0) + len(complete.encode())
        return complete.splitlines()

    def show(self) -> None:
        for i in range(self.nodes):
            for line in self._new_lines(self.out / f"agent-{i}.log"):
                if "consul_rdzv/" in line and "] " in line:
                    print(f"  node {i}: {line.split('] ', 1)[1]}", flush=True)
        for line in self._new_lines(self.out / "progress.jsonl"):
            with contextlib.suppress(ValueError, KeyError):
                event = json.loads(line)
                if event["event"] == "step" and event["rank"] == 0:
                    quarter = 4 * (event["step"] + 1) // max(1, self.steps)
                    if quarter > self.quarter:
                        self.quarter = quarter
                        print(f"  training: step {event['step'] + 1}/{self.steps} in a world "
                              f"of {event['world_size']}", flush=True)


def demo_script() -> contextlib.AbstractContextManager[Path]:
    """The demo's training script, ``consul_rdzv/examples/train.py``, as a file path (package
    data: torchrun runs it in a subprocess; nothing imports it)."""
    script = importlib.resources.files("consul_rdzv") / "examples" / "train.py"
    if not script.is_file():
        raise CliError(f"the demo's training script {script} is missing from the installed "
                       "package: reinstall consul-rdzv (pip install --force-reinstall "
                       "consul-rdzv)")
    return importlib.resources.as_file(script)


def cmd_demo(args: argparse.Namespace) -> int:
    """``demo``: a real torchrun job of ``--nodes`` nodes on this machine."""
    with demo_script() as script:
        return _run_demo(args, script)


def _run_demo(args: argparse.Namespace, script: Path) -> int:
    agent = None
    if not args.address and not os.environ.get("CONSUL_HTTP_ADDR"):
        from .testing import ConsulAgent

        agent = ConsulAgent().start()
        print(f"Started a local Consul dev agent at {agent.url} (CONSUL_HTTP_ADDR was unset).")
    elif args.keep:
        print("--keep: the demo uses a Consul it did not start; there is no agent to keep.")
    keep = False
    try:
        env = {**os.environ, **(agent.env() if agent else {})}
        url = ConsulConfig.resolve(address=args.address, env=env).url
        run_id = f"demo-{int(time.time())}"
        out = tempfile.mkdtemp(prefix="consul-rdzv-demo-")
        service = args.service_name or service_name(run_id)
        print(f"Consul UI: {url}/ui/dc1/services/{service}/instances")
        print(f"Running a {args.nodes}-node torchrun job (run id {run_id}) with {script.name} ...",
              flush=True)
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        procs = []
        started = time.monotonic()
        for i in range(args.nodes):
            cmd = [*torchrun, f"--nnodes={args.nodes}", "--nproc-per-node=1",
                   "--rdzv-backend=consul", f"--rdzv-id={run_id}",
                   f"--rdzv-endpoint={url}", "--local-addr=127.0.0.1",
                   f"--rdzv-conf={_demo_conf(args, i)}",
                   str(script), "--steps", str(args.steps), "--out", out,
                   "--progress-file", str(Path(out) / "progress.jsonl")]
            log = open(Path(out) / f"agent-{i}.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT),
                          log))
        progress = _DemoProgress(Path(out), args.nodes, args.steps)
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
            progress.show()
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[0][0].wait(timeout=0.5)
        progress.show()
        failed = 0
        for i, (proc, log) in enumerate(procs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
            if proc.returncode != 0:
                failed += 1
                print(f"node {i} failed with exit code {proc.returncode}; its log:")
                print((Path(out) / f"agent-{i}.log").read_text()[-3000:])
        took = time.monotonic() - started
        rows = []
        for path in sorted(Path(out).glob("rank-*.json")):
            rows.append(json.loads(path.read_text()))
        rows.sort(key=lambda r: r["rank"])
        print(f"\n{'rank':>4} {'world':>5} {'restarts':>8}  {'trainer store':<22} checksum")
        for r in rows:
            print(f"{r['rank']:>4} {r['world_size']:>5} {r['restarts']:>8}  {r['master']:<22} "
                  f"{r['checksum']}")
        agree = len({r["checksum"] for r in rows}) == 1 and len(rows) == args.nodes
        print(f"\n{len(rows)} ranks finished in {took:.1f}s; parameters identical on all ranks: "
              f"{'yes' if agree else 'NO'}")
        print(f"Logs: {out}")
        keep = bool(agent and args.keep)
        return 0 if failed == 0 and agree else 1
    finally:
        if agent and keep:
            pid = agent.proc.pid if agent.proc else "?"
            print(f"\nThe Consul agent stays up (--keep): UI {agent.url}/ui, pid {pid}, data and "
                  f"log in {agent.workdir}.")
            print(f"  export CONSUL_HTTP_ADDR={agent.address}   # then: consul-rdzv list")
            print(f"  stop it with: kill {pid} && rm -rf {agent.workdir}", flush=True)
        elif agent:
            agent.close()


# --------------------------------------------------------------------------------- arguments


#: Global options: accepted before or after the command. Their defaults are filled in after
#: parsing (argparse.SUPPRESS everywhere), so a value given before the command is not
#: overwritten by a subcommand's default.
GLOBAL_DEFAULTS: dict[str, Any] = {
    "address": None, "key_prefix": DEFAULT_KEY_PREFIX, "token_file": None, "datacenter": None,
    "ca_file": None, "ca_path": None, "client_cert": None, "client_key": None,
    "tls_server_name": None, "service_name": None, "consul_timeout": 5.0, "debug": False,
}


def _add_global_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "Consul and run options (before or after the command; an option beats its CONSUL_* "
        "variable)")
    s = argparse.SUPPRESS
    g.add_argument("--address", metavar="HOST:PORT", default=s,
                   help="Consul HTTP API address, host:port or http(s)://host:port (default: "
                        "CONSUL_HTTP_ADDR, else 127.0.0.1:8500)")
    g.add_argument("--key-prefix", metavar="P", default=s,
                   help=f"KV prefix of the runs (the key_prefix setting; default "
                        f"{DEFAULT_KEY_PREFIX})")
    g.add_argument("--service-name", metavar="NAME", default=s,
                   help="service name of the run's nodes (the service_name setting; default: "
                        f"{SERVICE_PREFIX}<run_id> and any consul-rdzv service tagged "
                        "run-<run_id>)")
    g.add_argument("--token-file", metavar="FILE", default=s,
                   help="file holding the ACL token (default: CONSUL_HTTP_TOKEN, "
                        "CONSUL_HTTP_TOKEN_FILE); there is no --token: a command line is "
                        "visible in ps")
    g.add_argument("--datacenter", metavar="DC", default=s,
                   help="datacenter to read and write (default: CONSUL_DATACENTER, else the "
                        "agent's)")
    g.add_argument("--ca-file", metavar="FILE", default=s,
                   help="CA bundle to verify Consul's certificate (default: CONSUL_CACERT)")
    g.add_argument("--ca-path", metavar="DIR", default=s,
                   help="directory of CA certificates (default: CONSUL_CAPATH)")
    g.add_argument("--client-cert", metavar="FILE", default=s,
                   help="client certificate for mTLS, with --client-key (default: "
                        "CONSUL_CLIENT_CERT)")
    g.add_argument("--client-key", metavar="FILE", default=s,
                   help="client certificate key (default: CONSUL_CLIENT_KEY)")
    g.add_argument("--tls-server-name", metavar="NAME", default=s,
                   help="name expected in Consul's certificate (default: CONSUL_TLS_SERVER_NAME)")
    g.add_argument("--consul-timeout", metavar="SECONDS", type=float, default=s,
                   help="how long an unreachable Consul is retried before giving up (default 5)")
    g.add_argument("--debug", action="store_true", default=s,
                   help="show a traceback on unexpected errors")


def build_parser() -> argparse.ArgumentParser:
    """The ``consul-rdzv`` argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.splitlines()[0].strip("` ").replace("``", ""),
        epilog="docs/cli.md is the reference; every command has --help.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"{PROG} {__version__}", help="print the version and exit")
    _add_global_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Callable[[argparse.Namespace], int], text: str,
                ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text)
        p.set_defaults(func=func)
        _add_global_options(p)
        return p

    def run_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("run_id", metavar="RUN", help="the run id (torchrun's --rdzv-id)")

    def json_arg(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--json", action="store_true", help=f"print {what} as JSON")

    p = command("list", cmd_list, "list every run under the key prefix: state, round, world "
                "size, nodes present, age")
    json_arg(p, "the runs")
    p = command("status", cmd_status, "show one run: coordinator, min/max, round, each rank's "
                "node, address, health, last heartbeat and state, waiting nodes, trainer store")
    run_arg(p)
    json_arg(p, "the status")
    p = command("watch", cmd_watch, "show a run's status again each time it changes (blocking "
                "queries on its keys and its service health); Ctrl-C stops")
    run_arg(p)
    json_arg(p, "one JSON document (one line) per change")
    p.add_argument("--timeout", metavar="SECONDS", type=parse_duration, default=None,
                   help="stop (exit 0) after this long (default: until Ctrl-C)")
    p.add_argument("--wait", metavar="SECONDS", type=parse_duration, default=WATCH_WAIT,
                   help="longest blocking query (default %(default)gs, at most 10m: Consul's "
                        "cap); a query that times out shows nothing new")
    p = command("close", cmd_close, "close a run: no further rounds (nodes training now keep "
                "training until their next rendezvous)")
    run_arg(p)
    p.add_argument("--reason", default="closed with consul-rdzv close",
                   help="why, shown in the error every node of the run gets")
    p = command("drain", cmd_drain, "take a node out of a run now, as if it stopped: its session "
                "is destroyed, the job re-forms without it, and its process leaves for good")
    run_arg(p)
    p.add_argument("node", metavar="NODE", help="the node id (as status shows it)")
    p.add_argument("--reason", default="drained by an operator",
                   help="why, shown in the error the drained node gets")
    p = command("gc", cmd_gc, "delete runs that ended (closed, no live node) or were abandoned "
                "(no live node, no passing instance, idle for --older-than); a dry run unless "
                "--yes")
    p.add_argument("--yes", action="store_true", help="delete them (default: only list them)")
    p.add_argument("--older-than", metavar="DURATION", type=parse_duration, default=600.0,
                   help="an unclosed run without nodes is abandoned once idle this long "
                        "(e.g. 30s, 10m, 2h; default 10m)")
    json_arg(p, "what would be (or was) deleted and kept")
    p = command("agent", cmd_agent, "run a Consul dev agent until Ctrl-C: on 127.0.0.1 and a "
                "free port, or where --bind/--port (or --address HOST:PORT) say, to serve other "
                "hosts for a first trial (UNSECURED: no ACLs, no TLS)")
    p.add_argument("--bind", metavar="ADDR", default=None,
                   help="IPv4 address of this host to serve the HTTP API on, 0.0.0.0 for every "
                        "interface (default 127.0.0.1: this host only)")
    p.add_argument("--port", metavar="PORT", type=int, default=None,
                   help="HTTP API port (default: a free one, printed)")
    p = command("demo", cmd_demo, "run a real torchrun job with the consul backend on this "
                "machine (a local dev agent unless --address / CONSUL_HTTP_ADDR names one)")
    p.add_argument("--nodes", type=int, default=3, help="number of torchrun agents (default 3)")
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the job before killing it (default 300)")
    p.add_argument("--keep", action="store_true",
                   help="leave the Consul agent the demo started running afterwards, for the UI "
                        "(prints its address and how to stop it)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``consul-rdzv``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, default in GLOBAL_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, default)
    if args.consul_timeout <= 0:
        parser.error("--consul-timeout must be positive")
    where = f"{PROG} {args.command}"
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 0 if args.command == "watch" else 130
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except UsageError as exc:
        print(f"{where}: {one_line(exc)}", file=sys.stderr)
        return 2
    except ConsulUnavailableError as exc:
        print(f"{where}: {one_line(exc)}. Is Consul running there? Give its address with "
              "--address or CONSUL_HTTP_ADDR.", file=sys.stderr)
        return 1
    except (CliError, ConsulError, RendezvousError, ValueError, OSError) as exc:
        print(f"{where}: {one_line(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:
        if args.debug:
            raise
        print(f"{where}: unexpected {type(exc).__name__}: {one_line(exc)} (--debug shows the "
              "traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
