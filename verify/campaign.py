"""A seeded, randomized fault campaign on a real Consul cluster: the verification suite.

    python -m verify.run --seed 7 --rounds 500 [--nodes 6] [--out report.json]
    python -m verify.run --seed 7 --schedule-only 20    # print the fault schedule only
    python -m verify.run --seed 0 --check-events LOGS/events.jsonl   # check a recorded run

What runs: a :class:`~consul_testing.ConsulCluster` (3 servers and 3 client agents, each on
its own 127.X.Y.Z), ``--nodes`` real node processes (``verify/campaign_node.py``: protocol level,
no torch) spread over the client agents, each joining rounds back to back with a short random
"training" time between, a watcher that records every value of ``P/round/current`` (consistent
blocking reads, from whichever server answers), and a fault injector. A killed node process is
replaced by a new one after a random delay, under the same node id (the takeover of
docs/protocol.md, "One node id, one process") or a new one, on a client agent drawn at random.

Fault kinds (:data:`KINDS`, weights; ``--kinds`` picks some):

* ``worker_kill_training`` / ``worker_kill_joining``: SIGKILL of a node process that trains (it
  has its round and will ask for the next one) or is inside ``next_round()``;
* ``worker_freeze_short`` / ``worker_freeze_long``: SIGSTOP, SIGCONT 0.2-0.7x or 1.5-3x
  ``heartbeat_timeout`` later (the check survives, or lapses and the node comes back);
* ``coordinator_kill``: SIGKILL of the node process that holds ``P/round/leader``;
* ``worker_replace``: a node process is frozen, a new process with its node id starts (on a
  client agent drawn at random), the old one is thawed later and must stop with a
  ``RendezvousStateError`` without ever sharing a round with its replacement;
* ``leader_server_kill``: SIGKILL of the Raft leader, restarted 1-6 s later;
* ``leader_kill_at_seal``: the same, timed at a seal: once every live participant of the last
  round has asked for the next one, the leader is killed ``pick`` x 60 ms later, while the
  coordinator's seal transaction is likely in flight (Consul may commit it and the answer be
  lost);
* ``server_restart``: SIGTERM of a server (graceful), started again 0.5-4 s later;
* ``client_agent_kill``: SIGKILL of a client agent (a host's agent dies), restarted 1-6 s later.

Server faults never overlap (the next one is planned at least :data:`SERVER_SETTLE` s after the
previous server is back): the cluster keeps its quorum, apart from the seconds of an election.

**Seeded.** ``random.Random(seed)`` draws the whole schedule before it is used: the time of each
fault (seconds after the first round), its kind, duration and target choice (a number in [0, 1)
that picks among the candidates sorted by slot: which node trains, which server leads is only
known at run time). The same seed gives the same schedule (``--schedule-only`` prints it); the
outcome is not bit-identical, because timing on a shared machine varies (which node happens to
be joining, how long an election takes).

**Invariants** (:func:`check_invariants`), on every sealed round, from what every node reported
and from every value of ``P/round/current`` the watcher saw: ranks exactly 0..W-1 and unique (and
each node's rank is its index in the participants); every report of a round number agrees on
the round, world size, participants, trainer-store endpoint and seal id, and with
Consul; min_nodes <= W <= max_nodes; one seal per round number; a process never returns a round
number lower than or equal to one it returned before; no two processes of one node id in the
same round; the store is the endpoint advertised by the process of rank 0; round numbers in
Consul never go backwards; the run is never closed. Liveness (:func:`check_missed_rounds`): a
process returns a round meant for it (listing it, covering its current member write) within
20 s while it can (running, not frozen, its agent up); a round is sealed at least every
``--stall-timeout`` seconds; once faults stop and the cluster is restored, a full round of the
live nodes forms. Any violation makes the exit status 1. docs/campaign.md has the long run and
what the campaign found.

**Figures**: rounds, faults by kind (and skipped ones: no candidate within 15 s), violations by
kind, recovery time per fault (from the fault to the next round sealed that does not contain an
affected node, or that its live process joined: a killed node's replacement under the same id,
a thawed node, a node whose agent came back; for server faults the next round sealed), with p50
and p99 per kind, the errors nodes raised (type, count, why), unexpected process exits.
``--out`` writes everything as JSON; node logs, every event and the agents' logs are kept in
``--logs`` (or in a temporary directory that is kept only when there is a violation).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import heapq
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from consul_rdzv.client import ConsulClient
from consul_rdzv.errors import ConsulError
from consul_rdzv.layout import Keys
from consul_testing import ClusterMember, ConsulCluster

from .campaign_node import EXIT_REPLACED, endpoint_for
from .checks import loadavg, seal_of
from .schedule import KINDS, SERVER_KINDS, FaultSpec, fault_schedule, pick

ROOT = Path(__file__).resolve().parent.parent

#: A fault whose target cannot be found (no node joining, no coordinator, a server still down)
#: is tried again for this long after its planned time, then counted as skipped.
DEFER_MAX = 15.0
#: A fault the injector reaches this late (it was held up) shifts the rest of the schedule.
LATE_SHIFT = 1.0
#: A replaced process must have stopped this long after it was thawed.
REPLACED_EXIT_WITHIN = 30.0


# ----------------------------------------------------------------------------------- the run


@dataclass
class CampaignConfig:
    """Everything a campaign run depends on (see ``python -m verify.run --help``)."""

    seed: int
    rounds: int
    nodes: int = 6
    min_nodes: int = 2
    max_nodes: int | None = None  # default nodes - 1: one spare waits beside a full round
    clients: int = 3
    heartbeat: float = 2.0
    last_call: float = 0.3
    join_timeout: float = 30.0
    consul_timeout: float = 10.0
    train: tuple[float, float] = (0.3, 2.0)
    gap: tuple[float, float] = (2.0, 7.0)
    kinds: dict[str, float] = field(default_factory=lambda: dict(KINDS))
    max_seconds: float = 3600.0
    stall_timeout: float = 120.0
    converge_timeout: float = 120.0
    progress_every: float = 30.0
    node_log_level: str = "DEBUG"

    def __post_init__(self) -> None:
        if self.max_nodes is None:
            self.max_nodes = max(self.min_nodes, self.nodes - 1)
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"bad min/max nodes: {self.min_nodes}/{self.max_nodes}")


@dataclass
class NodeProc:
    """One node process of the campaign (a serial per process, several per slot over time)."""

    serial: int
    slot: int
    node_id: str
    agent: ClusterMember
    popen: subprocess.Popen
    log_path: Path
    started: float
    endpoint: dict
    state: str = "starting"  # starting, joining (in next_round), training
    join_t: float = 0.0
    frozen: bool = False
    killed: bool = False  # by the campaign
    replaced_by: int | None = None
    thawed: float | None = None
    exit_code: int | None = None
    exited: float | None = None
    last_error: str = ""

    @property
    def name(self) -> str:
        return f"{self.node_id}/p{self.serial}"

    @property
    def running(self) -> bool:
        return self.popen.poll() is None


@dataclass
class Affected:
    """A node a fault took out: back when absent from a round, or in one that a process of it
    with at least ``serial`` joined (None: only its absence counts)."""

    node_id: str
    serial: int | None = None


@dataclass
class Fault:
    """One injected fault: its spec, when, on what, and the nodes it took out."""

    spec: FaultSpec
    applied: float  # wall clock
    target: str
    detail: dict = field(default_factory=dict)
    affected: list[Affected] = field(default_factory=list)
    ended: float | None = None  # thaw, restart, replacement started


@dataclass
class Outcome:
    """How a campaign ended, for its report (verify/report.py builds it)."""

    stop_reason: str
    fault_phase: float
    elapsed: float
    converged: dict | None
    restored: float


class Campaign:
    """One campaign on a started cluster: node processes, watcher, injector, records."""

    def __init__(self, cfg: CampaignConfig, cluster: ConsulCluster, log_dir: Path,
                 *, out: TextIO = sys.stderr) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.log_dir = log_dir
        self.out = out
        (log_dir / "nodes").mkdir(parents=True, exist_ok=True)
        self.run_id = "campaign"
        self.prefix = f"campaign-{cfg.seed}-{uuid.uuid4().hex[:6]}"
        self.keys = Keys(f"{self.prefix}/{self.run_id}")
        self.lock = threading.RLock()
        self.procs: dict[int, NodeProc] = {}
        self.slots: list[int | None] = [None] * cfg.nodes
        self._serials = itertools.count(1)
        self._new_ids: Counter[int] = Counter()
        self.reports: list[dict] = []
        self.errors: list[dict] = []
        self.consul_values: list[dict] = []
        #: node id -> [(wall time seen, ModifyIndex or None when deleted, incarnation)]
        self.member_history: dict[str, list[tuple[float, int | None, str | None]]] = (
            defaultdict(list))
        self.incarnations: dict[str, int] = {}  # incarnation id -> process serial
        self.seals: dict[str, dict] = {}
        self.last_seal_seen = time.monotonic()
        self.faults: list[Fault] = []
        self.skipped: list[dict] = []
        self.downtime: list[dict] = []
        self.exits: list[dict] = []
        self.replaced_exits: list[dict] = []
        self.anomalies: list[dict] = []
        self.watch_failures = 0
        self.liveness: list[dict] = []
        self.injecting = False
        self.consumed_specs: list[FaultSpec] = []  # injected or skipped, in schedule order
        self.schedule_shift = 0.0
        self.loads: list[float] = []  # 1-minute load average, every 5 s
        self._starting: list[threading.Thread] = []
        self._actions: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._flush = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._events = open(log_dir / "events.jsonl", "a")  # noqa: SIM115 - closed in close()

    # ------------------------------------------------------------------ records

    def log_event(self, event: dict) -> None:
        with self.lock:
            if not self._events.closed:  # a reader may still print after close()
                self._events.write(json.dumps(event, sort_keys=True, default=str) + "\n")

    def say(self, text: str) -> None:
        print(f"[campaign {time.strftime('%H:%M:%S')}] {text}", file=self.out, flush=True)

    def _add_seal(self, values: dict, source: str) -> None:
        seal_id = values.get("seal_id")
        if not seal_id or seal_id in self.seals:
            return
        timings = values.get("timings") or {}
        self.seals[seal_id] = {
            **seal_of(values), "sealed_at": values.get("sealed_at", timings.get("sealed")),
            "first_seen": time.time(), "source": source,
        }
        self.last_seal_seen = time.monotonic()

    # ------------------------------------------------------------------ node processes

    def start_node(self, slot: int, node_id: str, agent: ClusterMember) -> NodeProc:
        serial = next(self._serials)
        cfg = self.cfg
        log_path = self.log_dir / "nodes" / f"{node_id}.p{serial}.log"
        cmd = [sys.executable, "-m", "verify.campaign_node", "--run-id", self.run_id,
               "--key-prefix", self.prefix, "--node-id", node_id, "--serial", str(serial),
               "--min", str(cfg.min_nodes), "--max", str(cfg.max_nodes),
               "--heartbeat", str(cfg.heartbeat), "--last-call", str(cfg.last_call),
               "--join-timeout", str(cfg.join_timeout),
               "--consul-timeout", str(cfg.consul_timeout),
               "--train-min", str(cfg.train[0]), "--train-max", str(cfg.train[1]),
               "--seed", str(cfg.seed * 100_000 + serial), "--log-level", cfg.node_log_level]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUL_")}
        env.update(agent.env())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=log, text=True,
                                     start_new_session=True)
        proc = NodeProc(serial=serial, slot=slot, node_id=node_id, agent=agent, popen=popen,
                        log_path=log_path, started=time.time(),
                        endpoint=endpoint_for(node_id, serial))
        with self.lock:
            self.procs[serial] = proc
            self.slots[slot] = serial
        reader = threading.Thread(target=self._read, args=(proc,), daemon=True,
                                  name=f"read-{proc.name}")
        reader.start()
        self.log_event({"event": "spawn", "t": proc.started, "serial": serial, "slot": slot,
                        "node_id": node_id, "agent": agent.name, "pid": popen.pid})
        return proc

    def _read(self, proc: NodeProc) -> None:
        for line in proc.popen.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "garbage", "line": line[:500]}
            event.update(serial=proc.serial, slot=proc.slot, recv=time.time())
            with self.lock:
                kind = event.get("event")
                if kind == "start":
                    self.incarnations[str(event.get("incarnation"))] = proc.serial
                elif kind == "join":
                    proc.state, proc.join_t = "joining", event.get("t", time.time())
                elif kind == "round":
                    proc.state = "training"
                    self.reports.append(event)
                    self._add_seal(event, proc.name)
                elif kind == "error":
                    proc.last_error = f"{event.get('type')}: {event.get('message', '')[:300]}"
                    self.errors.append({**event, "join_t": proc.join_t,
                                        "agent": proc.agent.name})
            self.log_event(event)

    def live(self) -> list[NodeProc]:
        """The current process of each slot that runs, is not frozen and not killed."""
        with self.lock:
            procs = [self.procs[s] for s in self.slots if s is not None]
        return [p for p in procs if p.running and not p.frozen and not p.killed]

    @staticmethod
    def _signal(proc: NodeProc, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, sig)

    def kill_all(self) -> None:
        """SIGKILL every node process (by its process group) and reap it."""
        for proc in list(self.procs.values()):
            self._signal(proc, signal.SIGCONT)
            self._signal(proc, signal.SIGKILL)
        for proc in list(self.procs.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)

    # ------------------------------------------------------------------ watcher

    def _watch(self) -> None:
        """Record every change under the run's prefix: each value of P/round/current, and each
        member key's (ModifyIndex, incarnation). Consistent blocking reads; the next server when
        one fails."""
        servers = self.cluster.servers
        clients = {s.name: ConsulClient(s.config(), retry_timeout=1.0) for s in servers}
        turn, index, last_modify = 0, 0, None
        members: dict[str, tuple[int, str]] = {}
        try:
            while not self._stop.is_set():
                member = servers[turn % len(servers)]
                if not member.reachable:
                    turn, index = turn + 1, 0
                    time.sleep(0.02)
                    continue
                try:
                    res = clients[member.name].kv_list(
                        self.keys.prefix + "/", index=index or None, wait=1.0, consistent=True,
                        deadline=time.monotonic())
                except ConsulError:
                    self.watch_failures += 1
                    turn, index = turn + 1, 0
                    time.sleep(0.05)
                    continue
                index = 0 if res.index < index else res.index
                now = time.time()
                seen: dict[str, tuple[int, str]] = {}
                round_entry = None
                for entry in res.data:
                    if entry.key == self.keys.round:
                        round_entry = entry
                    elif entry.key.startswith(self.keys.members):
                        try:
                            incarnation = str(json.loads(entry.value or b"{}")["incarnation"])
                        except (ValueError, KeyError, TypeError):
                            incarnation = "?"
                        seen[entry.key[len(self.keys.members):]] = (entry.modify_index,
                                                                    incarnation)
                changes = []
                with self.lock:
                    for node in set(members) | set(seen):
                        if members.get(node) != seen.get(node):
                            value = seen.get(node)
                            change = (now, None if value is None else value[0],
                                      None if value is None else value[1])
                            self.member_history[node].append(change)
                            changes.append({"event": "member", "recv": now, "node_id": node,
                                            "modify_index": change[1],
                                            "incarnation": change[2]})
                    members = seen
                for change in changes:
                    self.log_event(change)
                if round_entry is None or round_entry.modify_index == last_modify:
                    continue
                last_modify = round_entry.modify_index
                try:
                    value = json.loads(round_entry.value or b"null")
                except ValueError:
                    value = {"undecodable": (round_entry.value or b"")[:300].decode(
                        errors="replace")}
                record = {"event": "consul", "recv": now,
                          "modify_index": round_entry.modify_index, "server": member.name,
                          "value": value}
                with self.lock:
                    self.consul_values.append(record)
                    if isinstance(value, dict) and value.get("ranks"):
                        self._add_seal(value, f"consul@{round_entry.modify_index}")
                self.log_event(record)
        finally:
            for client in clients.values():
                client.close()

    # ------------------------------------------------------------------ actions

    def after(self, delay: float, label: str, action: Callable[[], None]) -> None:
        with self.lock:
            heapq.heappush(self._actions, (time.monotonic() + delay, next(self._seq), label,
                                           action))

    def _run_due_actions(self) -> None:
        while True:
            with self.lock:
                if not self._actions or (not self._flush
                                         and self._actions[0][0] > time.monotonic()):
                    return
                _, _, label, action = heapq.heappop(self._actions)
            try:
                action()
            except Exception as exc:  # an action must never stop the injector
                self.anomalies.append({"t": time.time(), "what": f"action {label} failed",
                                       "error": repr(exc)})
                self.say(f"action {label} failed: {exc!r}")

    def pending_actions(self) -> int:
        with self.lock:
            return len(self._actions)

    def _restart_node(self, slot: int, node_id: str, agent: ClusterMember,
                      fault: Fault | None) -> None:
        proc = self.start_node(slot, node_id, agent)
        if fault is not None:
            fault.ended = proc.started
            for affected in fault.affected:
                if affected.node_id == node_id:
                    affected.serial = proc.serial

    def _start_member_soon(self, member: ClusterMember, fault: Fault | None) -> None:
        """Start ``member`` on a thread of its own: on a loaded machine an agent can take tens
        of seconds to answer, and the injector must not wait (thaws stay on time)."""
        thread = threading.Thread(target=self._start_member, args=(member, fault),
                                  name=f"start-{member.name}", daemon=True)
        self._starting = [t for t in self._starting if t.is_alive()] + [thread]
        thread.start()

    def _start_member(self, member: ClusterMember, fault: Fault | None,
                      attempt: int = 1) -> None:
        try:
            member.start(30.0)
        except Exception as exc:
            self.anomalies.append({"t": time.time(), "what": f"{member.name} did not start "
                                   f"(attempt {attempt})", "error": repr(exc)[:500]})
            if attempt < 5:
                time.sleep(2.0)
                self._start_member(member, fault, attempt + 1)
            return
        now = time.time()
        for down in self.downtime:
            if down["member"] == member.name and down["up"] is None:
                down["up"] = now
        if fault is not None:
            fault.ended = now
        self.log_event({"event": "member_up", "t": now, "member": member.name})

    def _member_down(self, member: ClusterMember, how: str) -> None:
        now = time.time()
        self.downtime.append({"member": member.name, "server": member.is_server, "how": how,
                              "down": now, "up": None})

    def _supervise(self) -> None:
        """Note processes that exited; restart a slot whose process exited by itself."""
        for proc in list(self.procs.values()):
            if proc.exit_code is not None or proc.running:
                continue
            proc.exit_code, proc.exited = proc.popen.returncode, time.time()
            if proc.killed:
                continue
            if proc.replaced_by is None and proc.exit_code == EXIT_REPLACED:
                # A process of this node id with a newer incarnation took over (one that was
                # started earlier but frozen before it created its incarnation): it runs on.
                newer = [p for p in self.procs.values() if p.node_id == proc.node_id
                         and p.running and not p.killed and p is not proc]
                if newer and self.slots[proc.slot] == proc.serial:
                    self.slots[proc.slot] = newer[-1].serial
                    newer[-1].replaced_by = None
                    proc.replaced_by = newer[-1].serial
            if proc.replaced_by is not None:
                self.replaced_exits.append({
                    "serial": proc.serial, "node_id": proc.node_id, "code": proc.exit_code,
                    "as_replaced": proc.exit_code == EXIT_REPLACED,
                    "after_thaw": None if proc.thawed is None else proc.exited - proc.thawed,
                    "last_error": proc.last_error})
                continue
            self.exits.append({"t": proc.exited, "serial": proc.serial, "node_id": proc.node_id,
                               "code": proc.exit_code, "last_error": proc.last_error,
                               "log_tail": _tail(proc.log_path, 1500)})
            self.say(f"{proc.name} exited by itself ({proc.exit_code}): {proc.last_error}")
            if self.slots[proc.slot] == proc.serial:
                self.after(1.0, f"restart {proc.node_id}",
                           lambda p=proc: self._restart_node(p.slot, p.node_id, p.agent, None))

    # ------------------------------------------------------------------ faults

    def _leader_node(self) -> str | None:
        """The node id in P/round/leader (if a session holds it), read from a server."""
        for server in self.cluster.servers:
            if not server.reachable:
                continue
            try:
                status, body = server.api("GET", f"/v1/kv/{self.keys.leader}", timeout=2.0)
            except OSError:
                continue
            if status == 404:
                return None
            if status == 200 and body and body[0].get("Session"):
                with contextlib.suppress(ValueError, TypeError):
                    return json.loads(base64.b64decode(body[0]["Value"]))["node"]
                return None
        return None

    def _await_seal(self, timeout: float) -> bool:
        """Wait (polling every 2 ms) until a seal is imminent: every live participant of the
        last round has just asked for the next one (the last within 50 ms)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                latest = max(self.seals.values(), key=lambda s: s["round"], default=None)
                live = {p.node_id: p for p in self.live()}
                parts = [live[n] for n in (latest or {}).get("ranks", []) if n in live]
                if latest and parts and all(
                        p.state == "joining" and p.join_t > latest["first_seen"] for p in parts
                ) and time.time() - max(p.join_t for p in parts) < 0.05:
                    return True
            self._run_due_actions()  # thaws and restarts stay on time meanwhile
            time.sleep(0.002)
        return False

    def apply(self, spec: FaultSpec) -> str | None:
        """Inject ``spec`` now; None if done, else why it cannot be injected yet."""
        kind = spec.kind
        if kind in ("worker_kill_training", "worker_kill_joining"):
            want = "training" if kind == "worker_kill_training" else "joining"
            candidates = [p for p in self.live() if p.state == want]
            if not candidates:
                return f"no node is {want}"
            target = pick(candidates, spec.pick)
            return self._kill_node(spec, target, {"state": target.state})
        if kind == "coordinator_kill":
            node = self._leader_node()
            if node is None:
                return "no session holds the leader key"
            with self.lock:
                holders = [p for p in self.procs.values()
                           if p.node_id == node and p.running and not p.killed]
            if not holders:
                return f"no running process of coordinator {node}"
            target = holders[-1]  # the newest process of that node id
            return self._kill_node(spec, target, {"state": target.state,
                                                  "frozen": target.frozen})
        if kind in ("worker_freeze_short", "worker_freeze_long"):
            candidates = self.live()
            if not candidates:
                return "no live node"
            target = pick(candidates, spec.pick)
            fault = Fault(spec, time.time(), target.name, {"state": target.state},
                          [Affected(target.node_id, target.serial)])
            self._signal(target, signal.SIGSTOP)
            target.frozen = True
            self.faults.append(fault)
            self.after(spec.duration, f"thaw {target.name}", lambda: self._thaw(target, fault))
            return None
        if kind == "worker_replace":
            # Not a process that has not created its incarnation yet: frozen before that, it
            # would be the newer incarnation when thawed, and take the node id back.
            candidates = [p for p in self.live() if p.state != "starting"]
            if not candidates:
                return "no live node"
            target = pick(candidates, spec.pick)
            self._signal(target, signal.SIGSTOP)
            target.frozen = True
            fault = Fault(spec, time.time(), target.name, {"state": target.state},
                          [Affected(target.node_id)])
            self.faults.append(fault)
            agent = pick(self.cluster.clients, spec.agent_pick)
            self._restart_node(target.slot, target.node_id, agent, fault)
            target.replaced_by = fault.affected[0].serial
            fault.detail.update(replacement=f"p{target.replaced_by}", agent=agent.name,
                                old_agent=target.agent.name)
            self.after(spec.duration, f"thaw {target.name}", lambda: self._thaw(target, None))
            self.after(spec.duration + REPLACED_EXIT_WITHIN, f"check {target.name} stopped",
                       lambda: self._check_replaced(target))
            return None
        if (kind in SERVER_KINDS or kind == "client_agent_kill") and any(
                t.is_alive() for t in self._starting):
            return "an agent is still starting"
        if kind in SERVER_KINDS:
            if any(not s.running for s in self.cluster.servers):
                return "a server is still down"
            if kind == "leader_kill_at_seal":
                target = self.cluster.leader()
                if target is None:
                    return "no leader"
                if not self._await_seal(3.0):
                    return "no seal was imminent"
                time.sleep(spec.pick * 0.06)
                target.kill()
                return self._member_fault(spec, target, "kill", [])
            if kind == "leader_server_kill":
                target = self.cluster.leader()
                if target is None:
                    return "no leader"
                target.kill()
            else:
                target = pick(self.cluster.servers, spec.pick)
                target.stop()
            return self._member_fault(spec, target, "kill" if kind == "leader_server_kill"
                                      else "stop", [])
        if kind == "client_agent_kill":
            if any(not c.running for c in self.cluster.clients):
                return "a client agent is still down"
            target = pick(self.cluster.clients, spec.pick)
            with self.lock:
                on_it = [p for p in self.procs.values()
                         if p.agent is target and p.running and not p.killed]
            target.kill()
            return self._member_fault(spec, target, "kill",
                                      [Affected(p.node_id, p.serial) for p in on_it])
        raise ValueError(f"unknown fault kind {kind!r}")

    def _member_fault(self, spec: FaultSpec, member: ClusterMember, how: str,
                      affected: list[Affected]) -> None:
        self._member_down(member, how)
        fault = Fault(spec, time.time(), member.name, {"how": how}, affected)
        self.faults.append(fault)
        self.after(spec.duration, f"start {member.name}",
                   lambda: self._start_member_soon(member, fault))
        return None

    def _kill_node(self, spec: FaultSpec, target: NodeProc, detail: dict) -> None:
        self._signal(target, signal.SIGKILL)
        target.killed = True
        with contextlib.suppress(subprocess.TimeoutExpired):
            target.popen.wait(5)
        fault = Fault(spec, time.time(), target.name, detail, [Affected(target.node_id)])
        self.faults.append(fault)
        if self.slots[target.slot] == target.serial:
            if spec.same_id:
                node_id = target.node_id
            else:
                self._new_ids[target.slot] += 1
                node_id = f"n{target.slot}-{self._new_ids[target.slot]}"
            agent = pick(self.cluster.clients, spec.agent_pick)
            fault.detail.update(replacement_id=node_id, agent=agent.name)
            self.after(spec.duration, f"restart {node_id}",
                       lambda: self._restart_node(target.slot, node_id, agent, fault))
        return None

    def _thaw(self, proc: NodeProc, fault: Fault | None) -> None:
        self._signal(proc, signal.SIGCONT)
        proc.frozen = False
        proc.thawed = time.time()
        if fault is not None:
            fault.ended = proc.thawed

    def _check_replaced(self, proc: NodeProc) -> None:
        due = (proc.thawed or time.time()) + REPLACED_EXIT_WITHIN
        while proc.running and time.time() < due:  # early only when flushed at the end
            time.sleep(0.05)
        if proc.running and not proc.killed and proc.replaced_by is not None:
            self.anomalies.append({"t": time.time(), "what": f"replaced process {proc.name} "
                                   f"still runs {REPLACED_EXIT_WITHIN:g}s after its thaw",
                                   "last_error": proc.last_error,
                                   "log_tail": _tail(proc.log_path, 1500)})
            self._signal(proc, signal.SIGKILL)
            proc.killed = True

    # ------------------------------------------------------------------ driving

    def _drive(self, schedule: Iterator[FaultSpec], start: float) -> None:
        """Inject the schedule's faults at their times, run the due actions, watch the node
        processes. A fault whose target cannot be found is tried again every 0.25 s until
        ``DEFER_MAX`` s after its time or the next fault's time, whichever comes first; then it
        is skipped (so a skipped fault never delays the next ones)."""
        spec, following = next(schedule), next(schedule)
        retry_at = 0.0
        fresh = True  # spec not tried yet
        while not self._stop.is_set():
            self._run_due_actions()
            self._supervise()
            now = time.monotonic()
            late = now - (start + spec.at)
            if self.injecting and fresh and late > LATE_SHIFT:
                # The injector was held up (a slow action on a loaded machine): shift the rest of
                # the schedule rather than inject the faults it missed in a burst.
                start += late
                self.schedule_shift += late
                late = 0.0
            if self.injecting and late >= 0 and now >= retry_at:
                fresh = False
                why = self.apply(spec)
                if why is None:
                    fault = self.faults[-1]
                    self.log_event({"event": "fault", "t": fault.applied,
                                    **dataclasses.asdict(spec), "target": fault.target,
                                    "detail": fault.detail})
                elif now > start + min(spec.at + DEFER_MAX, following.at):
                    self.skipped.append({**dataclasses.asdict(spec), "why": why})
                    self.log_event({"event": "skipped", "t": time.time(),
                                    **dataclasses.asdict(spec), "why": why})
                else:
                    retry_at = now + 0.25
                    continue
                self.consumed_specs.append(spec)
                spec, following = following, next(schedule)
                fresh = True
            time.sleep(0.02)

    def start(self) -> None:
        clients = self.cluster.clients
        for slot in range(self.cfg.nodes):
            self.start_node(slot, f"n{slot}", clients[slot % len(clients)])
        for target, name in ((self._watch, "watch"),):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def run(self) -> dict:
        """Run until ``rounds`` rounds are sealed (or a stall, or ``max_seconds``); then stop
        the faults, restore everything and wait for a full round. Returns the report."""
        cfg = self.cfg
        began = time.monotonic()
        self.start()
        self._wait(lambda: self.seals, 60.0, "the first round")
        start = time.monotonic()
        self.say(f"first round after {start - began:.1f}s; faults from now on")
        schedule = fault_schedule(cfg.seed, gap=cfg.gap, heartbeat=cfg.heartbeat,
                                  kinds=cfg.kinds)
        self.injecting = True
        driver = threading.Thread(target=self._drive, args=(schedule, start), name="drive",
                                  daemon=True)
        driver.start()
        self._threads.append(driver)
        stop_reason = "rounds"
        next_progress = time.monotonic() + cfg.progress_every
        next_load = time.monotonic()
        while len(self.seals) < cfg.rounds:
            time.sleep(0.1)
            if time.monotonic() >= next_load:
                next_load += 5.0
                with contextlib.suppress(OSError, ValueError):
                    self.loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
            if time.monotonic() - self.last_seal_seen > cfg.stall_timeout:
                stop_reason = "stall"
                self.liveness.append({
                    "kind": "stall", "round": None,
                    "detail": f"no round sealed for {cfg.stall_timeout:g}s",
                    "evidence": {"cluster": self.cluster.describe(), "nodes": self._states()}})
                break
            if time.monotonic() - start > cfg.max_seconds:
                stop_reason = "max_seconds"
                break
            if time.monotonic() >= next_progress:
                next_progress += cfg.progress_every
                self.say(self._progress())
        fault_phase = time.monotonic() - start
        self.say(f"stopping faults ({stop_reason}): {self._progress()}")
        self.injecting = False
        self._flush = True  # thaw and restart everything now
        self._wait(lambda: self.pending_actions() == 0, 120.0, "pending restarts")
        self._flush = False
        for thread in list(self._starting):
            thread.join(180.0)
        restored = time.time()
        try:
            self.cluster.restore(60.0)
        except TimeoutError as exc:
            self.anomalies.append({"t": time.time(), "what": "cluster restore failed",
                                   "error": str(exc)[:2000]})
        converged = self._converge(restored) if stop_reason != "stall" else None
        if converged is None and stop_reason != "stall":
            self.liveness.append({
                "kind": "no_convergence", "round": None,
                "detail": f"no full round of the live nodes within {cfg.converge_timeout:g}s "
                          "of the end of the faults",
                "evidence": {"cluster": self.cluster.describe(), "nodes": self._states()}})
        self._stop.set()
        for thread in self._threads:
            thread.join(15)
        return Outcome(stop_reason, fault_phase, time.monotonic() - began, converged, restored)

    def _converge(self, since: float) -> dict | None:
        """Wait for a round sealed after ``since`` with every live node (as many as fit) that
        all its participants reported."""
        deadline = time.monotonic() + self.cfg.converge_timeout
        while time.monotonic() < deadline:
            self._run_due_actions()
            self._supervise()
            live = {p.node_id for p in self.live()}
            want = min(len(live), self.cfg.max_nodes)
            with self.lock:
                reported = defaultdict(set)
                for r in self.reports:
                    reported[r["seal_id"]].add(r["node_id"])
                for seal in self.seals.values():
                    if ((seal["sealed_at"] or 0) > since and len(seal["ranks"]) == want
                            and set(seal["ranks"]) <= live
                            and reported[seal["seal_id"]] >= set(seal["ranks"])):
                        return {"round": seal["round"], "world_size": want,
                                "seconds": seal["sealed_at"] - since}
            time.sleep(0.1)
        return None

    def _wait(self, predicate: Callable[[], object], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"campaign: no {what} within {timeout:g}s\n"
                                   + self.cluster.describe())
            time.sleep(0.05)

    def _states(self) -> list[str]:
        with self.lock:
            return [f"{p.name} on {p.agent.name}: {p.state}"
                    + (" frozen" if p.frozen else "") + (" killed" if p.killed else "")
                    + ("" if p.running else f" exited {p.popen.returncode}")
                    + (f" last error {p.last_error[:120]}" if p.last_error else "")
                    for p in self.procs.values() if p.running or p.exit_code is None]

    def _progress(self) -> str:
        kinds = Counter(f.spec.kind for f in self.faults)
        load = loadavg()
        return (f"{len(self.seals)} rounds, {len(self.faults)} faults "
                f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}), "
                f"{len(self.errors)} node errors, load {load}")

    def close(self) -> None:
        self._stop.set()
        self.kill_all()
        with self.lock:
            self._events.close()


def _tail(path: Path, chars: int) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""
