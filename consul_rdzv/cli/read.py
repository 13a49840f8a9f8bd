"""The read model of ``consul-rdzv``: what it reads of Consul (a run's keys, its nodes' service
instances and their health: :class:`Reader`), one run read at one moment (:class:`RunView`),
and the one-word state and the summary of a run (:func:`run_state`, :func:`run_summary`).

The KV values are parsed by :mod:`consul_rdzv.layout`, the service instances by the
conventions of :mod:`consul_rdzv.service`, which the nodes write with.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..client import ConsulClient, KVEntry
from ..errors import ConsulError, RendezvousError
from ..layout import HISTORY_DIR, QUARANTINE_DIR, Keys, RunState
from ..planning import active_participants
from ..service import (
    RDZV_TAG,
    Incarnation,
    heartbeat_time,
    is_heartbeat_check,
    node_id_of,
    run_of,
    service_name,
    tagged,
)
from .text import CliError, one_line, utc

_STATUS_ORDER = {"passing": 0, "warning": 1, "critical": 2}


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

    @property
    def started(self) -> float:
        """When the incarnation that registered it started (0 if its meta does not say)."""
        return Incarnation.of(self.meta).started

    @classmethod
    def from_health(cls, entry: dict, run_id: str,
                    agent_checks: dict[str, dict]) -> Instance | None:
        """The run's instance in one ``/v1/health/service`` entry (None if another run's), with
        the heartbeat output and status from the agent's own checks when it holds them."""
        service = entry.get("Service") or {}
        meta = service.get("Meta") or {}
        if meta.get("run_id") not in (None, run_id):
            return None  # another run sharing a service name
        sid = service.get("ID", "")
        consul_node = (entry.get("Node") or {}).get("Node", "")
        statuses, output, source = [], "", "catalog"
        for check in entry.get("Checks") or []:
            status, out = check.get("Status", "critical"), check.get("Output", "")
            local = agent_checks.get(check.get("CheckID", ""))
            if local is not None and local.get("Node") == consul_node:
                status, out = local.get("Status", status), local.get("Output", out)
                if check.get("ServiceID") == sid:
                    source = "agent"
            statuses.append(status)
            if is_heartbeat_check(check, sid):
                output = out
        return cls(node_id=node_id_of(service, run_id), service_id=sid,
                   service=service.get("Service", ""), address=service.get("Address") or "",
                   port=int(service.get("Port") or 0), consul_node=consul_node,
                   status=worst(statuses), output=output, source=source,
                   incarnation=Incarnation.of(meta).id, meta=meta)


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


def worst(statuses: Iterable[str]) -> str:
    """The worst of check statuses: passing < warning < critical (anything else)."""
    found = "passing"
    for status in statuses:
        if _STATUS_ORDER.get(status, 2) > _STATUS_ORDER[found]:
            found = status if status in _STATUS_ORDER else "critical"
    return found


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
                inst = Instance.from_health(entry, run_id, agent_checks)
                if inst is None:
                    continue
                known = found.get(inst.node_id)
                if known is None or inst.started > known.started:
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
        return self.runs_and_quarantine()[0]

    def runs_and_quarantine(self) -> tuple[dict[str, list[KVEntry]], list[KVEntry]]:
        """Every run's keys (as :meth:`runs`) and the hosts' quarantine keys.

        One read of the whole key prefix, unless round histories are kept there (up to 1,000
        records per run, which nothing here needs): then the folders under the key prefix are
        listed (one request) and each but the histories' is read (one request each)."""
        folder = f"{self.key_prefix}/"
        tops = self.client.kv_keys(folder, separator="/")
        if f"{folder}{HISTORY_DIR}/" not in tops:
            _, entries = self.tree(self.key_prefix)
        else:
            entries = []
            for top in tops:
                if top == f"{folder}{HISTORY_DIR}/":
                    continue
                if top.endswith("/"):
                    entries += self.tree(top.rstrip("/"))[1]
                else:  # a key right under the prefix, not in a folder
                    entry = self.client.kv_get(top).data
                    entries += [entry] if entry is not None else []
        runs: dict[str, list[KVEntry]] = {}
        hosts: list[KVEntry] = []
        start = len(self.key_prefix) + 1
        for entry in entries:
            rest = entry.key[start:]
            run_id = rest.split("/", 1)[0]
            # the round histories and the hosts' quarantine are not runs
            if run_id == QUARANTINE_DIR:
                hosts.append(entry)
            elif run_id and run_id != HISTORY_DIR:
                runs.setdefault(run_id, []).append(entry)
        return runs, hosts

    def passing_runs(self) -> dict[str, int]:
        """run id -> how many passing consul-rdzv service instances carry its tag."""
        try:
            health = self.instance_health()
        except ConsulError:
            return {}
        return {run: counts["passing"] for run, counts in health.items()
                if counts.get("passing")}

    def instance_health(self) -> dict[str, dict[str, int]]:
        """run id -> how many consul-rdzv service instances carrying its tag are passing,
        warning and critical (the worst of each instance's checks), in one request."""
        res, _ = self.client.read_with_headers(
            "/v1/health/state/any", params={"filter": f'"{RDZV_TAG}" in ServiceTags'})
        status_of: dict[tuple[str, str], str] = {}  # (Consul node, service id) -> worst
        runs: dict[tuple[str, str], str] = {}
        for check in res.data or []:
            sid = check.get("ServiceID") or ""
            tags = check.get("ServiceTags") or []
            run = run_of(tags)
            if not sid or run is None:
                continue
            key = (check.get("Node") or "", sid)
            status_of[key] = worst([status_of.get(key, "passing"),
                                    check.get("Status", "critical")])
            runs[key] = run
        counts: dict[str, dict[str, int]] = {}
        for key, status in status_of.items():
            per_run = counts.setdefault(runs[key], dict.fromkeys(_STATUS_ORDER, 0))
            per_run[status] += 1
        return counts


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


def min_max(state: RunState) -> tuple[int | None, int | None, str]:
    """A run's min_nodes and max_nodes, and where they come from: the sealing coordinator's,
    else the nodes' own settings."""
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
    lo, hi, _ = min_max(state) if state else (None, None, "")
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


