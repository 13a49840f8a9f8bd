"""Rendezvous benchmark: consul vs torch's c10d and etcd-v2 backends, through torch's registry.

    python -m bench.run                       # the full benchmark (about 35 minutes here)
    python -m bench.run --quick               # N = 2, 8, 32, one repeat, consul + c10d (< 3 min)
    python -m bench.run --backends consul --sizes 8,64 --scenarios fixed
    python -m bench.run --compare HEAD~5 .    # the same series on two versions of consul_rdzv

Every simulated node is a thread in a worker process and builds its handler with
``get_rendezvous_handler(RendezvousParameters(...))``, the path torchrun takes. Layouts:

* ``spread``  - nodes spread over min(N, --procs) processes (N <= 8: one process per node).
* ``threads`` - every node in one process: how torch's c10d handler is usually exercised, and
  where its per-call ``inspect.stack()`` walks serialise on the GIL ("c10d as shipped").

Scenarios (all servers fresh per run, all on 127.0.0.1):

* ``fixed``    - min = max = N; all nodes released from a barrier; time until every
  ``next_rendezvous()`` returned. The first repeat then polls ``num_nodes_waiting()`` at 0.1 s for
  --train-seconds and counts the requests this costs per node.
* ``lastcall`` - min = N/2, max = 2N, N nodes, last_call_timeout = 1 s for every backend.
* ``failover`` - round 1 with N nodes (min = N-1, max = N); one node dies (SIGKILL of its own
  process; ``threads`` layout: its heartbeat stops, no cleanup); the survivors re-rendezvous.
  Trigger ``detect``: each survivor calls ``next_rendezvous()`` once its ``num_nodes_waiting()``
  (polled at 0.1 s, torchrun's monitor loop) is > 0. Trigger ``kill``: survivors call it at the
  kill (as when their workers crash at once). c10d and etcd-v2 report only their wait list in
  ``num_nodes_waiting()``, never a dead participant, so they only have the ``kill`` trigger.
* ``failover-term`` - the same, but the victim's process gets SIGTERM and exits as a torchrun
  agent does: torch's handler raises ``SignalException`` in its main thread, the process unwinds
  and its ``atexit`` hooks run (consul_rdzv.torch leaves from one). Time from the signal.
* ``backtoback`` - min = max = N; round 1 as in ``fixed``, then every node re-rendezvouses
  --b2b-rounds times, entering --b2b-stagger apart (at most --b2b-window in all: torchrun's
  monitor loops notice a change at different moments). Per round: time from the last node's
  entry (and from the first) until every node returned.

Consul backends also count requests the way Consul does (``consul_api_http_count`` of the
agent's ``/v1/agent/metrics``, read before and after): all requests, and TTL check passes (a
cost per second) apart from the rest. ``--cluster-clients K`` runs consul on a ConsulCluster
(``--cluster-servers`` servers, K client agents; each worker process talks to one client agent)
instead of one dev agent. ``--compare REV_A REV_B`` runs the same series on two versions of
consul_rdzv (revisions of this repository, or ``.`` for this checkout) with this bench code and
prints one against the other (bench/compare.py).

Raw figures: one JSON line per run in bench/results/<timestamp>.jsonl, its tables beside it
(<timestamp>.md, bench/report.py).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import multiprocessing as mp
import os
import queue
import resource
import signal
import statistics
import sys
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

ALL_BACKENDS = ("consul", "c10d", "etcd-v2")
ALL_SIZES = (2, 8, 32, 64, 128, 256, 512, 1024)
ALL_SCENARIOS = ("fixed", "lastcall", "failover", "failover-term", "backtoback")
FAILOVERS = ("failover", "failover-term")
HEARTBEAT_TIMEOUT = 5  # consul's heartbeat_timeout, set explicitly (the default is 30 s)
#: torch's DynamicRendezvousHandler defaults (c10d, etcd-v2): keep_alive_interval=5 s,
#: keep_alive_max_attempt=3 (a node is dead 15 s after its last keep-alive), last_call 30 s,
#: state cache 1 s, 1 s sleep between polls, read_timeout 60 s.
DYNAMIC_DEFAULTS = {"keep_alive_interval_s": 5, "keep_alive_max_attempt": 3,
                    "last_call_timeout_s": 30, "join_timeout_s": 600, "sync_delay_s": 1,
                    "state_cache_s": 1}

#: Full-run limits per (backend, layout, scenario, trigger): the largest N tried (0: not run in
#: that layout); larger N are skipped up front and recorded. Independently, a run that fails or
#: passes --timeout skips every larger N of its series. Chosen so that the full run stays under
#: ~40 minutes on 2 cores; --no-caps lifts them.
FULL_CAPS = {
    ("consul", "threads", "fixed", None): 512,
    ("consul", "threads", "lastcall", None): 64,
    ("consul", "threads", "failover", "detect"): 8,
    ("consul", "threads", "failover", "kill"): 0,
    ("c10d", "threads", "fixed", None): 128,
    ("c10d", "threads", "lastcall", None): 64,
    ("c10d", "threads", "failover", "kill"): 0,
    ("consul", "spread", "lastcall", None): 512,
    ("c10d", "spread", "lastcall", None): 128,
    ("etcd-v2", "spread", "lastcall", None): 128,
    ("consul", "spread", "failover", "detect"): 256,
    ("consul", "spread", "failover", "kill"): 128,
    ("c10d", "spread", "failover", "kill"): 64,
    ("etcd-v2", "spread", "failover", "kill"): 32,
    # SIGTERM: c10d and etcd-v2 have no exit hook, so it is SIGKILL again: N=8 shows it.
    ("consul", "threads", "failover-term", "detect"): 0,
    ("consul", "threads", "failover-term", "kill"): 0,
    ("c10d", "threads", "failover-term", "kill"): 0,
    ("consul", "spread", "failover-term", "detect"): 256,
    ("consul", "spread", "failover-term", "kill"): 128,
    ("c10d", "spread", "failover-term", "kill"): 8,
    ("etcd-v2", "spread", "failover-term", "kill"): 0,
    ("consul", "spread", "backtoback", None): 128,
    ("consul", "threads", "backtoback", None): 0,
    ("c10d", "spread", "backtoback", None): 0,
    ("c10d", "threads", "backtoback", None): 0,
    ("etcd-v2", "spread", "backtoback", None): 0,
}
#: Repeats per series where one is all the time allows (c10d/etcd-v2 failover: ~45-60 s a run).
FULL_REPEATS = {
    ("c10d", "spread", "failover", "kill"): 1,
    ("etcd-v2", "spread", "failover", "kill"): 1,
    ("consul", "spread", "failover", "kill"): 1,
    ("consul", "threads", "failover", "detect"): 1,
    ("c10d", "spread", "failover-term", "kill"): 1,
    ("consul", "spread", "failover-term", "kill"): 1,
}
#: Consul's meta publish after a round: META_DELAY (0.5 s) + up to 20 ms per member (at most
#: 30 s), in every version measured. Request counts wait for it (and a margin) before the last
#: read.
META_SETTLE = (0.5, 0.02, 30.0, 1.0)


def meta_settle(world: int) -> float:
    delay, per_member, cap, margin = META_SETTLE
    return delay + min(cap, per_member * world) + margin


def _worker_entry(spec, conn, go, start_at, out) -> None:
    """Worker process target: imports bench.worker there (bench.compare.activate must run first
    in that process; the runner itself never imports the measured consul_rdzv.torch)."""
    from bench import worker

    worker.main(spec, conn, go, start_at, out)


#: The first round starts this long after the release, at one instant for every node (the
#: system-wide monotonic clock): waking the worker processes and their node threads takes up to
#: ~10 ms at N = 8 on 2 cores, and that skew is the benchmark's, not the backend's. A node that
#: wakes after the instant starts late, and its lateness counts against the backend.
START_LEAD = 0.2


def _now() -> float:
    return time.monotonic()


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def raise_nofile() -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --------------------------------------------------------------------------- invariants

def check_round(recs: list[dict], *, expect_world: int | None = None,
                world_range: tuple[int, int] | None = None) -> tuple[list[str], dict]:
    """Check one round's results. Returns (violations, summary)."""
    violations: list[str] = []
    ok = [r for r in recs if r.get("ok")]
    errors = [r for r in recs if not r.get("ok")]
    if errors:
        violations.append(f"{len(errors)} node(s) raised, e.g. node {errors[0]['idx']}: "
                          f"{errors[0].get('error', '?')}")
    if not ok:
        return violations, {"world": None, "round": None, "returned": 0}
    worlds = Counter(r["world"] for r in ok)
    rounds = Counter(r["round"] for r in ok)
    world = worlds.most_common(1)[0][0]
    if len(worlds) > 1:
        violations.append(f"world sizes disagree: {dict(worlds)}")
    if len(rounds) > 1:
        violations.append(f"round numbers disagree: {dict(rounds)}")
    ranks = Counter(r["rank"] for r in ok)
    dups = sorted(k for k, v in ranks.items() if v > 1)
    if dups:
        violations.append(f"duplicate ranks {dups[:10]}")
    bad = sorted(k for k in ranks if not 0 <= k < world)
    if bad:
        violations.append(f"ranks outside 0..{world - 1}: {bad[:10]}")
    if len(ok) > world:
        violations.append(f"{len(ok)} nodes returned from a round of world size {world}")
    elif len(ok) == world and set(ranks) != set(range(world)):
        violations.append(f"ranks are not 0..{world - 1}")
    endpoints = Counter(r.get("endpoint") for r in ok)
    if len(endpoints) > 1:
        violations.append(f"members of one round got {len(endpoints)} different trainer-store "
                          f"endpoints: {dict(endpoints.most_common(3))}")
    seals = Counter(r.get("seal_id") for r in ok if r.get("seal_id"))
    if len(seals) > 1:
        violations.append(f"consul seal ids disagree: {len(seals)} different")
    if expect_world is not None and world != expect_world:
        violations.append(f"world size {world}, expected {expect_world}")
    if world_range and not world_range[0] <= world <= world_range[1]:
        violations.append(f"world size {world} outside {world_range}")
    return violations, {"world": world, "round": rounds.most_common(1)[0][0],
                        "returned": len(ok)}


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _stats(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    values = sorted(values)
    return {"min": values[0], "median": statistics.median(values), "max": values[-1],
            "mean": statistics.fmean(values),
            "p90": _nearest_rank(values, 0.9), "n": len(values)}


#: A round's moments per node, in order (bench/timeline.py): the node enters
#: ``next_rendezvous()``, its member write is answered, the coordinator seals (the same moment
#: for every node), the node sees the sealed round (its ``next_round()``'s wait returns; older
#: versions: ``released``, when ``next_round()`` returns), its TCPStore client reached rank 0's
#: store, every member has checked in (the meeting is done), ``next_rendezvous()`` returns.
TIMELINE = ("entry", "announced", "sealed", "seen", "connected", "met", "returned")


def timeline(recs: list[dict], wall0: float) -> dict:
    """The round's moments of every node (ms from ``wall0``, the release), by rank."""
    rows = []
    for r in sorted(recs, key=lambda r: r.get("rank", 0)):
        t = r.get("timings") or {}
        moments = {"entry": r.get("wall_start"), "announced": t.get("announced"),
                   "sealed": t.get("sealed"), "seen": t.get("seen") or t.get("released"),
                   "connected": t.get("store_connected"), "met": t.get("met"),
                   "returned": r.get("wall_end")}
        rows.append([r.get("rank")] + [round((moments[k] - wall0) * 1000, 2)
                                       if moments[k] else None for k in TIMELINE])
    return {"events": list(TIMELINE), "nodes": rows}


# --------------------------------------------------------------------------- one run

class Run:
    """One benchmark run: a fresh server, fresh worker processes, one scenario."""

    def __init__(self, ctx, opts, backend: str, layout: str, scenario: str, n: int, rep: int,
                 trigger: str | None, etcd_bin: str | None) -> None:
        self.ctx, self.opts = ctx, opts
        self.backend, self.layout, self.scenario = backend, layout, scenario
        self.n, self.rep, self.trigger = n, rep, trigger
        self.etcd_bin = etcd_bin
        self.run_id = f"b-{scenario}-{n}-{rep}-{uuid.uuid4().hex[:6]}"
        self.out = ctx.Queue()
        self.go = ctx.Event()
        self.start_at = ctx.Value("d", 0.0, lock=False)  # the first round's instant (monotonic)
        self.workers: list[tuple] = []  # (process, conn, node indices)
        self.results: dict[int, dict[int, dict]] = defaultdict(dict)
        self.counts: list[tuple] = []  # Consul's request counts, read in turn
        self.series: dict[str, dict] = {}  # the agents' own series, by the label of the read
        self.probe = None  # an AgentProbe on the (first) agent while the run lasts
        self.thread_cpu: dict[str, float] = {}
        self.detects: dict[int, float] = {}
        self.trains: list[dict] = []
        self.killed_at: float | None = None
        self.fatal: list[str] = []
        self.ready: dict[int, dict] = {}
        self.cpus: dict[int, float] = {}
        self.http: dict[str, list[float]] = {}
        self.http_bytes: dict[str, list[int]] = {}  # [requests, sent, received] by category
        self.server = None
        self.log_path = RESULTS / "logs" / f"{self.run_id}.log"

    # -- layout
    @property
    def cluster(self) -> bool:
        return self.backend == "consul" and bool(self.opts.cluster_clients)

    def groups(self) -> list[list[int]]:
        n = self.n
        victim = n - 1 if self.scenario in FAILOVERS else None
        if self.layout == "threads":
            return [list(range(n))]
        rest = [i for i in range(n) if i != victim]
        wanted = self.opts.procs
        if self.cluster:  # one client agent per process at least: every agent gets nodes
            wanted = max(wanted, self.opts.cluster_clients + (1 if victim is not None else 0))
        procs = min(len(rest), wanted - (1 if victim is not None else 0))
        procs = max(procs, 1)
        groups = [rest[i::procs] for i in range(procs)]
        if victim is not None:
            groups.append([victim])  # alone in its process, spawned last (highest pid)
        return groups

    def params(self) -> tuple[int, int, dict]:
        n, b = self.n, self.backend
        conf: dict = {}
        if self.scenario == "lastcall":
            lo, hi = max(1, n // 2), 2 * n
            conf["last_call_timeout"] = "1"
        elif self.scenario in ("fixed", "backtoback"):
            lo, hi = n, n
        else:
            lo, hi = max(1, n - 1), n
        if b == "consul":
            conf["heartbeat_timeout"] = str(HEARTBEAT_TIMEOUT)
        elif b == "c10d":
            conf["is_host"] = "false"
        return lo, hi, conf

    def _server_args(self) -> tuple:
        if self.cluster:
            return (self.opts.cluster_servers, self.opts.cluster_clients,
                    self.opts.cluster_raft_multiplier)
        if self.backend == "c10d":
            return (self.ctx, self.opts.hosts_file)
        if self.backend == "etcd-v2":
            return (self.etcd_bin,)
        return ()

    # -- plumbing
    def _pump(self, until, deadline: float) -> bool:
        while True:
            if until():
                return True
            remaining = deadline - _now()
            if remaining <= 0:
                return until()
            try:
                msg = self.out.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                if any(not p.is_alive() and p.exitcode not in (0, -signal.SIGKILL)
                       for p, _, _ in self.workers):
                    self.fatal.append("a worker process died: exit codes "
                                      f"{[p.exitcode for p, _, _ in self.workers]}")
                    return until()
                continue
            kind = msg["type"]
            if kind == "result":
                self.results[msg["phase"]][msg["idx"]] = msg
            elif kind == "detect":
                self.detects.setdefault(msg["idx"], msg["t"])
            elif kind == "ready":
                self.ready[msg["pid"]] = msg
            elif kind == "train":
                self.trains.append(msg)
            elif kind == "cpu":
                self.cpus[msg["pid"]] = msg["cpu"]
                for group, sec in (msg.get("threads") or {}).items():
                    self.thread_cpu[group] = self.thread_cpu.get(group, 0.0) + sec
                for cat, times in (msg.get("http") or {}).items():
                    self.http.setdefault(cat, []).extend(times)
                for cat, sizes in (msg.get("http_bytes") or {}).items():
                    total = self.http_bytes.setdefault(cat, [0, 0, 0])
                    for i, v in enumerate(sizes):
                        total[i] += v
            elif kind == "killed":
                self.killed_at = msg["t"]
            elif kind == "fatal":
                self.fatal.append(msg["error"])
                return True

    def _send(self, cmd, workers=None) -> None:
        for proc, conn, _ in workers or self.workers:
            if proc.is_alive():
                with contextlib.suppress(OSError, BrokenPipeError):
                    conn.send(cmd)

    def count_requests(self, label: str) -> None:
        """Read Consul's own request counts (consul backends) and remember them as ``label``."""
        if self.backend != "consul" or self.server is None:
            return
        probe_sent = self.probe.sent if self.probe else 0
        try:
            if hasattr(self.server, "snapshot"):
                counts, series = self.server.snapshot()
                self.series[label] = series
            else:
                counts = self.server.http_counts()
        except Exception as exc:  # recorded, never fatal
            self.counts.append((label, _now(), {"error": f"{type(exc).__name__}: {exc}"}, 0))
            return
        self.counts.append((label, _now(), counts, probe_sent))

    def agent_cost(self, first: str, last: str, nodes: int) -> dict | None:
        """What the agents' own series moved between two reads (:data:`bench.servers.
        AGENT_SERIES`), per kind of agent (``servers``; ``clients`` on a cluster): totals, and
        per node."""
        a, b = self.series.get(first), self.series.get(last)
        if not a or not b:
            return None
        out: dict = {"from": first, "to": last, "nodes": nodes}
        for kind in b:
            diff = {k: b[kind][k] - a.get(kind, {}).get(k, 0.0) for k in b[kind]}
            out[kind] = {k: round(v, 6) for k, v in diff.items() if v}
        return out

    def counted(self, first: str, last: str, nodes: int) -> dict | None:
        """Requests Consul served between two reads, per node, TTL check passes apart (the
        runner's probe passes taken out); the agent-side milliseconds they took, on average."""
        from bench.servers import CHECK_PASS_PATH

        marks = {label: (t, c, p) for label, t, c, p in self.counts}
        if first not in marks or last not in marks:
            return None
        (t0, c0, p0), (t1, c1, p1) = marks[first], marks[last]
        if "error" in c0 or "error" in c1:
            return {"error": c0.get("error") or c1.get("error")}
        zero = [0, 0.0]
        diff = {k: (c1.get(k, zero)[0] - c0.get(k, zero)[0],
                    c1.get(k, zero)[1] - c0.get(k, zero)[1]) for k in set(c0) | set(c1)}
        diff = {k: v for k, v in diff.items() if v[0]}
        probe = p1 - p0
        pass_keys = [k for k in diff if CHECK_PASS_PATH in k]
        passes = sum(diff[k][0] for k in pass_keys) - probe
        pass_ms = sum(diff[k][1] for k in pass_keys)
        total = sum(v[0] for v in diff.values()) - probe
        rest = total - passes
        rest_ms = sum(v[1] for k, v in diff.items() if k not in pass_keys)
        seconds = t1 - t0
        return {"from": first, "to": last, "seconds": seconds, "nodes": nodes,
                "total": total, "passes": passes, "rest": rest, "probe": probe,
                "per_node": total / nodes, "passes_per_node": passes / nodes,
                "rest_per_node": rest / nodes,
                "passes_per_node_s": passes / nodes / seconds if seconds > 0 else None,
                "agent_ms_per_pass": pass_ms / (passes + probe) if passes + probe else None,
                "agent_ms_per_other": rest_ms / rest if rest else None,
                "by_path": {k: v[0] for k, v in sorted(diff.items(), key=lambda kv: -kv[1][0])},
                "agent_ms_by_path": {k: round(v[1] / v[0], 3) for k, v in diff.items()}}

    def probe_window(self, rec: dict, key: str, start: float, end: float) -> None:
        if self.probe is not None:
            rec[key] = self.probe.window(start, end)

    def execute(self) -> dict:
        from bench import servers

        o = self.opts
        lo, hi, conf = self.params()
        rec: dict = {
            "backend": self.backend, "layout": self.layout, "scenario": self.scenario,
            "trigger": self.trigger, "n": self.n, "rep": self.rep, "run_id": self.run_id,
            "min_nodes": lo, "max_nodes": hi, "conf": conf, "status": "ok", "violations": [],
            "started": time.time(), "loadavg": _loadavg(),
            "loopback_hosts": bool(o.hosts_file),
            "topology": "cluster" if self.cluster else "single",
        }
        server_cls = {"consul": servers.ConsulServer, "c10d": servers.TCPStoreServer,
                      "etcd-v2": servers.EtcdServer}[self.backend]
        if self.cluster:
            server_cls = servers.ClusterServer
        server = server_cls(*self._server_args())
        self.server = server
        t_setup = _now()
        for attempt in range(3):  # free ports are picked before the server binds them: races
            try:
                endpoint = server.start()
                break
            except RuntimeError as exc:
                rec.setdefault("server_start_failures", []).append(str(exc)[:300])
                server.stop()
                if attempt == 2:
                    raise
                server = self.server = type(server)(*self._server_args())
        groups = self.groups()
        rec["procs"] = len(groups)
        rec["max_threads_per_proc"] = max(len(g) for g in groups)
        rec["server"] = server.describe() if hasattr(server, "describe") else None
        endpoints = getattr(server, "endpoints", None) or [endpoint]
        rec["agents"] = len(endpoints)
        victim = self.n - 1 if self.scenario in FAILOVERS else None
        if self.backend == "consul" and not o.no_probe:
            with contextlib.suppress(Exception):
                probe = server.probe()
                probe.register()
                probe.start()
                self.probe = probe
        self.count_requests("start")
        try:
            for j, g in enumerate(groups):
                parent, child = self.ctx.Pipe()
                spec = {"backend": self.backend, "endpoint": endpoints[j % len(endpoints)],
                        "run_id": self.run_id,
                        "min_nodes": lo, "max_nodes": hi, "conf": conf, "nodes": g,
                        "log_path": str(self.log_path), "log_level": o.log_level,
                        "hosts_file": o.hosts_file,
                        "term_victim": self.scenario == "failover-term" and g == [victim]}
                proc = self.ctx.Process(target=_worker_entry,
                                        args=(spec, child, self.go, self.start_at, self.out),
                                        daemon=True)
                proc.start()
                child.close()
                self.workers.append((proc, parent, g))
            rec["nodes_per_agent"] = dict(Counter(
                endpoints[j % len(endpoints)] for j, g in enumerate(groups) for _ in g))
            self._pump(lambda: len(self.ready) == len(groups), _now() + o.setup_timeout)
            rec["setup_s"] = _now() - t_setup
            if self.fatal or len(self.ready) < len(groups):
                rec["status"] = "error"
                rec["violations"].append("setup failed: " + "; ".join(self.fatal or
                                         [f"only {len(self.ready)} of {len(groups)} workers"]))
                return rec
            if self.backend == "consul":
                wrong = self._check_product(rec)
                if wrong:
                    rec["status"] = "error"
                    rec["violations"].append(wrong)
                    return rec
            names = {}
            for msg in self.ready.values():
                names.update({int(k): v for k, v in msg["nodes"].items()})
            rec["nofile"] = min(m["nofile"] for m in self.ready.values())
            getattr(self, f"_scenario_{self.scenario.replace('-', '_')}")(rec, names)
            return rec
        finally:
            if self.probe is not None:
                self.probe.stop_event.set()
            self._send(("exit",))
            for proc, conn, _ in self.workers:
                proc.join(2)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
                conn.close()
            server.stop(keep_log=str(self.log_path.with_suffix(".server.log"))
                        if self.opts.keep_logs else None)
            self.out.close()
            self.out.join_thread()
            rec["wall_s"] = _now() - t_setup
            with contextlib.suppress(OSError):
                if self.log_path.exists() and self.log_path.stat().st_size == 0:
                    self.log_path.unlink()
            if self.log_path.exists():
                rec["log"] = str(self.log_path.relative_to(HERE.parent))

    def _check_product(self, rec: dict) -> str | None:
        """Every worker must have loaded the consul_rdzv being measured (bench/compare.py)."""
        want = Path(self.opts.product_dir or HERE.parent).resolve() / "consul_rdzv"
        files = {pid: m.get("files") or {} for pid, m in self.ready.items()}
        rec["consul_rdzv_files"] = sorted({f for fs in files.values() for f in fs.values()
                                           if f})
        for pid, fs in files.items():
            for what, path in fs.items():
                if not path or Path(path).resolve().parent != want:
                    return (f"worker {pid} loaded {what} from {path}, not from {want}: the run "
                            "would not measure the product asked for")
        return None

    # -- the phases
    def _release(self) -> float:
        from bench.servers import cpu_seconds_all, system_cpu

        self.count_requests("release")
        self.server_cpu0 = cpu_seconds_all(self.server.pids)
        self.sys_cpu0 = system_cpu()
        self.t_go = _now() + START_LEAD
        self.wall_go = time.time() + START_LEAD
        self.start_at.value = self.t_go
        self.go.set()
        return self.t_go

    def _note_phases(self, rec: dict) -> None:
        """A run that timed out: how many nodes had returned from each phase (and how many of
        those with an error), for the record and the report."""
        rec["phases_returned"] = {
            str(phase): {"returned": len(res), "ok": sum(1 for r in res.values() if r.get("ok"))}
            for phase, res in sorted(self.results.items())}

    def _phase_summary(self, rec: dict, phase: int, t0: float, prefix: str, **expect) -> None:
        recs = sorted(self.results[phase].values(), key=lambda r: r["idx"])
        violations, summary = check_round(recs, **expect)
        ok = [r for r in recs if r.get("ok")]
        rec[f"{prefix}round_violations"] = violations
        rec["violations"] += [f"{prefix or 'round'}: {v}" for v in violations]
        rec[f"{prefix}world"] = summary["world"]
        rec[f"{prefix}round"] = summary["round"]
        rec[f"{prefix}returned"] = summary["returned"]
        rec[f"{prefix}latency_s"] = (max(r["t_end"] for r in ok) - t0) if ok else None
        rec[f"{prefix}node_latency"] = _stats([r["t_end"] - t0 for r in ok])
        rec[f"{prefix}call_latency"] = _stats([r["t_end"] - r["t_start"] for r in ok])
        rec[f"{prefix}requests"] = _stats([r["requests"] for r in ok])
        node_cpu = [r["thread_cpu_s"] for r in ok if r.get("thread_cpu_s") is not None]
        if node_cpu:  # the CPU of the threads that called next_rendezvous(), summed over nodes
            rec[f"{prefix}node_thread_cpu_s"] = round(sum(node_cpu), 4)
        ops = Counter()
        for r in ok:
            ops.update(r.get("ops") or {})
        rec[f"{prefix}ops_total"] = dict(ops)
        rec[f"{prefix}bootstrap_ops"] = _stats([r.get("bootstrap_ops") for r in ok])
        if self.backend == "consul" and ok:
            rec[f"{prefix}product_requests"] = _stats([r.get("product_requests") for r in ok])
            sealed = [r["sealed_wall"] for r in ok if r.get("sealed_wall")]
            wall0 = self.wall_go if phase == 1 else self.wall_kill  # b2b: the round's start
            if sealed:
                rec[f"{prefix}sealed_s"] = max(sealed) - wall0
            released = [r["released_wall"] for r in ok if r.get("released_wall")]
            if released:
                rec[f"{prefix}released_s"] = max(released) - wall0
            starts = [r["join_started_wall"] for r in ok if r.get("join_started_wall")]
            if starts:
                rec[f"{prefix}last_join_started_s"] = max(starts) - wall0
            rec[f"{prefix}coordinator"] = ok[0].get("coordinator")
            rec[f"{prefix}timeline"] = timeline(ok, wall0)
        rec[f"{prefix}nodes"] = {
            "idx": [r["idx"] for r in recs],
            "latency": [round(r["t_end"] - t0, 4) for r in recs],
            "call": [round(r["t_end"] - r["t_start"], 4) for r in recs],
            "rank": [r.get("rank") for r in recs],
            "requests": [r.get("requests") for r in recs],
        }

    def _cpu(self, rec: dict, prefix: str = "") -> None:
        """CPU seconds the round cost: the server process(es), and all worker processes."""
        from bench.servers import cpu_seconds_all, system_cpu

        server_cpu = cpu_seconds_all(self.server.pids)
        busy, total = system_cpu()
        if server_cpu is not None and self.server_cpu0 is not None:
            rec[f"{prefix}server_cpu_s"] = server_cpu - self.server_cpu0
        rec[f"{prefix}machine_busy_cpu_s"] = busy - self.sys_cpu0[0]
        rec[f"{prefix}machine_cpu_s"] = total - self.sys_cpu0[1]
        self.cpus = {}
        self.thread_cpu = {}
        live = [w for w in self.workers if w[0].is_alive()]
        self._send(("cpu",), live)
        self._pump(lambda: len(self.cpus) >= len(live), _now() + 30)
        if self.thread_cpu:  # since the workers were ready, as client_cpu_s
            rec[f"{prefix}thread_cpu_s"] = dict(sorted(
                ((k, round(v, 3)) for k, v in self.thread_cpu.items()), key=lambda kv: -kv[1]))
        before = {pid: m["cpu"] for pid, m in self.ready.items()}
        spent = [cpu - before[pid] for pid, cpu in self.cpus.items() if pid in before]
        if spent:
            rec[f"{prefix}client_cpu_s"] = sum(spent)
            # CPU the rest of the machine burnt meanwhile (other jobs on a shared box).
            rec[f"{prefix}foreign_cpu_s"] = max(0.0, rec[f"{prefix}machine_busy_cpu_s"]
                                                - sum(spent) - rec.get(f"{prefix}server_cpu_s", 0))
        if self.http:
            rec[f"{prefix}consul_http"] = {
                cat: {"n": len(v), "mean_ms": 1000 * statistics.fmean(v),
                      "p50_ms": 1000 * statistics.median(v),
                      "p90_ms": 1000 * _nearest_rank(v, 0.9),
                      "max_ms": 1000 * max(v)}
                for cat, v in sorted(self.http.items())}
            self.http = {}
        if self.http_bytes:
            rec[f"{prefix}consul_http_bytes"] = dict(sorted(self.http_bytes.items()))
            self.http_bytes = {}

    def _train(self, rec: dict) -> None:
        if not self.opts.train_seconds:
            return
        self.trains = []
        self._send(("train", self.opts.train_seconds, 0.1))
        self._pump(lambda: len(self.trains) == len(self.workers),
                   _now() + self.opts.train_seconds + 120)
        per_node = [p for t in self.trains for p in t["per_node"]]
        secs = statistics.fmean(t["seconds"] for t in self.trains) if self.trains else 0
        if not per_node or not secs:
            rec["train"] = {"error": "no training figures"}
            return
        ops = Counter()
        for p in per_node:
            ops.update(p["ops"])
        probes = [t["probe"] for t in self.trains if t.get("probe")]
        rec["train"] = {
            "seconds": secs, "nodes": len(per_node),
            "req_per_s_per_node": _stats([p["requests"] / secs for p in per_node]),
            "state_req_per_s_per_node": _stats([p["state_requests"] / secs for p in per_node]),
            "nnw_calls_per_s_per_node": _stats([p["nnw_calls"] / secs for p in per_node]),
            "nnw_mean_ms": _stats([p["nnw_mean_s"] * 1000 for p in per_node
                                   if p["nnw_mean_s"] is not None]),
            "ops_per_s_per_node": {k: v / secs / len(per_node) for k, v in ops.items()},
            "errors": sum(p["errors"] for p in per_node),
            "wire_requests": sum(t["wire_requests"] for t in self.trains),
            "late_ticks": sum(t["late_ticks"] for t in self.trains),
            "ticks": sum(t["ticks"] for t in self.trains),
            "probe_requests_per_200_calls": [p["requests"] for p in probes],
            "probe_ms_per_call": statistics.fmean(p["seconds"] for p in probes) / 200 * 1000
            if probes else None,
        }

    def _settle_and_count(self, rec: dict, since: float, first: str, nodes: int,
                          key: str = "consul_requests") -> None:
        """Wait until the round's meta publishes are due (META_SETTLE from ``since``), read
        Consul's counts, record the requests between read ``first`` and now."""
        if self.backend != "consul":
            return
        self._pump(lambda: False, since + meta_settle(self.n))
        self.count_requests("end")
        rec[key] = self.counted(first, "end", nodes)

    def _scenario_fixed(self, rec: dict, names: dict) -> None:
        t0 = self._release()
        done = self._pump(lambda: len(self.results[1]) == self.n, t0 + self.opts.timeout)
        t_done = _now()
        self.count_requests("done")
        self.probe_window(rec, "agent_probe", t0, t_done)
        self._phase_summary(rec, 1, t0, "", expect_world=self.n)
        rec["latency_s"] = rec["latency_s"] if done else None
        self._cpu(rec)
        if not done or self.fatal:
            rec["status"] = "timeout" if not self.fatal else "error"
            self._note_phases(rec)
            rec["violations"] += self.fatal
            return
        if self.rep == 0 and self.layout == "spread":
            self._train(rec)
        # Consul's count: registration at handler creation + the round + its meta publish
        # (+ check passes over the whole window, a cost per second).
        self._settle_and_count(rec, t_done, "start", self.n)
        if self.backend == "consul":
            rec["consul_requests_registration"] = self.counted("start", "release", self.n)
            rec["consul_requests_round"] = self.counted("release", "end", self.n)
            # the round alone (release until every node returned), and what followed it (the
            # deferred meta publishes, the watches' first queries)
            rec["consul_requests_round_only"] = self.counted("release", "done", self.n)
            rec["agent_registration"] = self.agent_cost("start", "release", self.n)
            rec["agent_round"] = self.agent_cost("release", "done", self.n)
            rec["agent_after_round"] = self.agent_cost("done", "end", self.n)

    def _scenario_backtoback(self, rec: dict, names: dict) -> None:
        """Round 1 as in fixed; then every node re-rendezvouses, entering ``stagger`` apart,
        --b2b-rounds times. Consul's counts are read at every round's start."""
        n, o = self.n, self.opts
        t0 = self._release()
        done = self._pump(lambda: len(self.results[1]) == n, t0 + o.timeout)
        self.probe_window(rec, "r1_agent_probe", t0, _now())
        self._phase_summary(rec, 1, t0, "r1_", expect_world=n)
        self._cpu(rec, "r1_")
        rec["latency_s"] = rec.get("r1_latency_s") if done else None
        if not done or self.fatal:
            rec["status"] = "timeout" if not self.fatal else "error"
            self._note_phases(rec)
            rec["violations"] += self.fatal
            return
        stagger = min(o.b2b_stagger, o.b2b_window / max(1, n - 1))
        rec["b2b_stagger_s"] = stagger
        rounds = []
        previous = rec.get("r1_round")
        for phase in range(2, 2 + o.b2b_rounds):
            label = f"round{phase}"
            self.count_requests(label)
            start = _now() + 0.02
            self.wall_kill = time.time() + 0.02
            self._send(("rounds", phase, start, stagger))
            done = self._pump(lambda phase=phase: len(self.results[phase]) == n,
                              start + n * stagger + o.timeout)
            prefix = f"b{phase}_"
            self.probe_window(rec, f"{prefix}agent_probe", start, _now())
            self._phase_summary(rec, phase, start, prefix, expect_world=n)
            ok = [r for r in self.results[phase].values() if r.get("ok")]
            info = {"phase": phase, "round": rec.get(f"{prefix}round"), "returned": len(ok),
                    "agent_probe": rec.get(f"{prefix}agent_probe")}
            if ok:
                first = min(r["t_start"] for r in ok)
                last = max(r["t_start"] for r in ok)
                end = max(r["t_end"] for r in ok)
                info.update(from_last_entry_s=end - last, from_first_entry_s=end - first,
                            entry_window_s=last - first,
                            product_requests=rec.get(f"{prefix}product_requests"),
                            sealed_after_last_entry_s=(rec[f"{prefix}sealed_s"]
                                                       - (last - start))
                            if rec.get(f"{prefix}sealed_s") is not None else None)
            if info.get("round") is not None and previous is not None \
                    and info["round"] <= previous:
                rec["violations"].append(f"round {info['round']} is not after {previous}")
            previous = info.get("round") or previous
            rounds.append(info)
            if not done or self.fatal:
                rec["status"] = "timeout" if not self.fatal else "error"
                self._note_phases(rec)
                rec["violations"] += self.fatal
                rec["latency_s"] = None
                break
        t_done = _now()
        self._settle_and_count(rec, t_done, "start", n)
        if self.backend == "consul":
            labels = ["release"] + [f"round{r['phase']}" for r in rounds] + ["end"]
            for info, (a, b) in zip([{"phase": 1}, *rounds], itertools.pairwise(labels),
                                    strict=False):
                info["consul_requests"] = self.counted(a, b, n)
                info["agent"] = self.agent_cost(a, b, n)
            rec["r1_consul_requests"] = self.counted("release", "round2", n)
            rec["consul_requests_registration"] = self.counted("start", "release", n)
            rec["b2b_consul_requests"] = self.counted("round2", "end", n)
        rec["b2b_rounds"] = rounds
        times = [r.get("from_last_entry_s") for r in rounds]
        rec["b2b_max_from_last_entry_s"] = max(times) if times and None not in times else None

    def _scenario_lastcall(self, rec: dict, names: dict) -> None:
        t0 = self._release()
        state = {"last": None}

        def until() -> bool:
            got = [r for r in self.results[1].values() if r.get("ok")]
            if len(self.results[1]) == self.n:
                return True
            if not got:
                return False
            world = Counter(r["world"] for r in got).most_common(1)[0][0]
            if len(got) >= world:  # the sealed round is back; give stragglers 2 s
                state["last"] = state["last"] or _now()
                return _now() - state["last"] > 2.0
            return False

        done = self._pump(until, t0 + self.opts.timeout)
        self._phase_summary(rec, 1, t0, "", world_range=(max(1, self.n // 2), self.n))
        rec["left_out"] = self.n - len([r for r in self.results[1].values() if r.get("ok")])
        self._cpu(rec)
        if not done or self.fatal:
            rec["status"] = "timeout" if not self.fatal else "error"
            self._note_phases(rec)
            rec["violations"] += self.fatal
            rec["latency_s"] = None

    def _scenario_failover(self, rec: dict, names: dict, sig: int = signal.SIGKILL) -> None:
        n, o = self.n, self.opts
        victim = n - 1
        t0 = self._release()
        done = self._pump(lambda: len(self.results[1]) == n, t0 + o.timeout)
        self.probe_window(rec, "r1_agent_probe", t0, _now())
        self._phase_summary(rec, 1, t0, "r1_", expect_world=n)
        self._cpu(rec, "r1_")
        if not done or self.fatal:
            rec["status"] = "timeout" if not self.fatal else "error"
            self._note_phases(rec)
            rec["violations"] += self.fatal
            rec["latency_s"] = None
            return
        vres = self.results[1][victim]
        rec["victim"] = {"idx": victim, "name": names.get(victim), "rank": vres.get("rank"),
                         "coordinator": (vres.get("coordinator") == names.get(victim))
                         if self.backend == "consul" else None}
        survivors_workers = [w for w in self.workers if w[2] != [victim]]
        self._send(("monitor", 0.1, self.trigger == "detect"), survivors_workers)
        self._pump(lambda: False, _now() + o.settle)
        spurious = {i: t for i, t in self.detects.items()}
        if spurious:
            rec["violations"].append(f"{len(spurious)} survivor(s) saw num_nodes_waiting() > 0 "
                                     "before the kill")
        self.detects.clear()
        self.count_requests("kill")
        vconn = None
        if self.layout == "threads":
            self.wall_kill = time.time()
            self._send(("kill", victim))
            self._pump(lambda: self.killed_at is not None, _now() + 30)
            t_kill = self.killed_at
            rec["kill"] = "heartbeat stopped (thread)"
        else:
            vproc, vconn, _ = next(w for w in self.workers if w[2] == [victim])
            self.wall_kill = time.time()
            t_kill = _now()
            os.kill(vproc.pid, sig)
            rec["kill"] = (f"{signal.Signals(sig).name} of the victim's process"
                           + (" (SignalException, atexit hooks)" if sig == signal.SIGTERM
                              else ""))
        if self.trigger == "kill":
            self._send(("rejoin",), survivors_workers)
        done = self._pump(lambda: len(self.results[2]) == n - 1, t_kill + o.timeout)
        t_done = _now()
        self.probe_window(rec, "agent_probe", t_kill, t_done)
        self._phase_summary(rec, 2, t_kill, "", expect_world=n - 1)
        det = [t - t_kill for i, t in self.detects.items() if i != victim]
        rec["detect_first_s"] = min(det) if det else None
        rec["detect_last_s"] = max(det) if det else None
        rec["detected_by"] = len(det)
        if vconn is not None and sig == signal.SIGTERM:
            rec["victim_exit"] = self._victim_exit(vconn, t_kill)
        r1 = rec.get("r1_round")
        if rec.get("round") is not None and r1 is not None and rec["round"] <= r1:
            rec["violations"].append(f"round 2 number {rec['round']} is not after round 1 ({r1})")
        if any(r.get("idx") == victim for r in self.results[2].values()):
            rec["violations"].append("the killed node returned from round 2")
        if not done or self.fatal:
            rec["status"] = "timeout" if not self.fatal else "error"
            self._note_phases(rec)
            rec["violations"] += self.fatal
            rec["latency_s"] = None
            return
        self._settle_and_count(rec, t_done, "kill", n - 1)

    def _scenario_failover_term(self, rec: dict, names: dict) -> None:
        self._scenario_failover(rec, names, signal.SIGTERM)

    @staticmethod
    def _victim_exit(conn, t_kill: float) -> dict:
        """What the SIGTERM victim reported: when it caught the signal, how long its atexit
        hooks (the leave) took, whether its node left."""
        msg = None
        with contextlib.suppress(OSError, EOFError):
            if conn.poll(10):
                msg = conn.recv()
        if not isinstance(msg, dict) or msg.get("type") != "terminated":
            return {"error": "the victim reported nothing (killed outright?)"}
        return {"exception": msg.get("exception"), "caught_s": msg["t_caught"] - t_kill,
                "atexit_s": msg["t_atexit_done"] - msg["t_caught"],
                "exited_s": msg["t_atexit_done"] - t_kill, "left": msg.get("left"),
                "error": msg.get("error")}


# --------------------------------------------------------------------------- the series

def machine_info(etcd_bin: str | None, etcd_note: str) -> dict:
    import torch

    from bench import measure, servers

    info = measure.machine()
    info.update(torch=torch.__version__, etcd=None, etcd_note=etcd_note)
    with contextlib.suppress(Exception):
        import importlib.metadata as md

        info["python_etcd"] = md.version("python-etcd")
        info["requests"] = md.version("requests")
        info["urllib3"] = md.version("urllib3")
    if etcd_bin:
        info["etcd"] = servers.EtcdServer.version(etcd_bin)
    return info


def product_version() -> dict:
    """The consul_rdzv code this run measures: git HEAD, and a digest of the package files
    (the working tree may carry uncommitted changes)."""
    import hashlib
    import subprocess

    root = HERE.parent
    digest = hashlib.sha256()
    for path in sorted((root / "consul_rdzv").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    head = dirty = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "consul_rdzv"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    return {"git_head": head, "consul_rdzv_dirty": dirty,
            "consul_rdzv_sha256": digest.hexdigest()[:16]}


def parse_only(text: str) -> list[dict]:
    """``--only``: ``backend:scenario[:trigger][@N+N...][xREPEATS]``, comma-separated."""
    items = []
    for raw in (t.strip() for t in text.split(",")):
        if not raw:
            continue
        head, reps = raw, None
        if "x" in raw.rsplit("@", 1)[-1] and "@" in raw:
            head, rep_text = raw.rsplit("x", 1)
            reps = int(rep_text)
        head, _, sizes = head.partition("@")
        parts = head.split(":")
        if len(parts) not in (2, 3) or parts[0] not in ALL_BACKENDS \
                or parts[1] not in ALL_SCENARIOS:
            raise ValueError(f"bad --only item {raw!r}: backend:scenario[:trigger][@N+N][xR]")
        items.append({"backend": parts[0], "scenario": parts[1],
                      "trigger": parts[2] if len(parts) == 3 else None,
                      "sizes": [int(x) for x in sizes.split("+")] if sizes else None,
                      "reps": reps})
    return items


def build_plan(opts) -> list[tuple]:
    """(scenario, n, backend, layout, trigger, repeats or None) in run order: by scenario, then
    N ascending (``--only``: its items in the order given, with their repeats)."""
    if opts.only:
        plan = []
        for item in opts.only:
            b, scenario = item["backend"], item["scenario"]
            for n in item["sizes"] or opts.sizes:
                for layout in opts.layouts:
                    if layout == "threads" and scenario == "failover-term":
                        continue  # a signal needs a process of its own
                    triggers = [None]
                    if scenario in FAILOVERS:
                        triggers = ["detect", "kill"] if b == "consul" else ["kill"]
                    for trigger in triggers:
                        if item["trigger"] in (None, trigger):
                            plan.append((scenario, n, b, layout, trigger, item["reps"]))
        return plan
    plan = []
    for scenario in opts.scenarios:
        for n in opts.sizes:
            for layout in opts.layouts:
                for backend in opts.backends:
                    if layout == "threads" and backend not in opts.thread_backends:
                        continue
                    if scenario == "backtoback" and backend != "consul":
                        continue  # consul's request budget; c10d's rounds take >= 1 s each
                    if layout == "threads" and scenario == "failover-term":
                        continue  # a signal needs a process of its own
                    triggers = [None]
                    if scenario in FAILOVERS:
                        triggers = ["detect", "kill"] if backend == "consul" else ["kill"]
                        if backend == "consul" and not opts.consul_kill_trigger:
                            triggers = ["detect"]
                    for trigger in triggers:
                        plan.append((scenario, n, backend, layout, trigger, None))
    return plan


def series_key(scenario, backend, layout, trigger) -> tuple:
    return (backend, layout, scenario, trigger)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--backends", default=",".join(ALL_BACKENDS))
    p.add_argument("--sizes", default=",".join(map(str, ALL_SIZES)))
    p.add_argument("--scenarios", default=",".join(ALL_SCENARIOS))
    p.add_argument("--layouts", default="spread,threads",
                   help="spread: nodes over min(N, --procs) processes; threads: one process")
    p.add_argument("--thread-backends", default="consul,c10d",
                   help="backends also run in the threads layout")
    p.add_argument("--procs", type=int, default=8, help="worker processes of the spread layout")
    p.add_argument("--repeats", type=int, default=3, help="repeats for N <= --small")
    p.add_argument("--repeats-large", type=int, default=1, help="repeats for N > --small")
    p.add_argument("--small", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120.0, help="per-run (per-phase) timeout")
    p.add_argument("--setup-timeout", type=float, default=180.0)
    p.add_argument("--settle", type=float, default=1.0,
                   help="failover: seconds of training between round 1 and the kill")
    p.add_argument("--train-seconds", type=float, default=5.0)
    p.add_argument("--no-caps", action="store_true", help="ignore the full run's size caps")
    p.add_argument("--skip", default="", help="series not to run, e.g. c10d:failover,etcd-v2:fixed")
    p.add_argument("--no-consul-kill-trigger", dest="consul_kill_trigger", action="store_false")
    p.add_argument("--budget-min", type=float, default=45.0,
                   help="stop starting new runs after this many minutes")
    p.add_argument("--quick", action="store_true",
                   help="N = 2,8,32, one repeat, all scenarios, consul + c10d, spread layout")
    p.add_argument("--log-level", default="WARNING", help="log level of the worker processes")
    p.add_argument("--keep-logs", action="store_true", help="keep the server's log per run")
    p.add_argument("--b2b-rounds", type=int, default=3,
                   help="backtoback: rounds after the first")
    p.add_argument("--b2b-stagger", type=float, default=0.02,
                   help="backtoback: seconds between two nodes' entries ...")
    p.add_argument("--b2b-window", type=float, default=0.64,
                   help="... but all enter within this many seconds")
    p.add_argument("--cluster-clients", type=int, default=0, metavar="K",
                   help="consul on a ConsulCluster with K client agents (each worker process "
                        "talks to one) instead of one dev agent")
    p.add_argument("--cluster-servers", type=int, default=3)
    p.add_argument("--cluster-raft-multiplier", type=int, default=5,
                   help="performance.raft_multiplier of the cluster's agents (Consul's default)")
    p.add_argument("--keep-going", action="store_true",
                   help="a failed or timed-out run does not skip the rest of its series")
    p.add_argument("--no-probe", action="store_true",
                   help="consul: no check-pass probe from the runner (bench/servers.AgentProbe)")
    p.add_argument("--compare", nargs=2, metavar=("REV_A", "REV_B"), default=None,
                   help="run the series on two versions of consul_rdzv (git revisions of this "
                        "repository; '.' is this checkout as it is) and compare them "
                        "(bench/compare.py)")
    p.add_argument("--passes", type=int, default=1,
                   help="--compare: run A then B this many times (alternating sees through "
                        "the machine's drift)")
    p.add_argument("--product-dir", default=None, metavar="DIR",
                   help="measure the consul_rdzv package in DIR (what --compare runs; "
                        "bench/compare.py)")
    p.add_argument("--only", default="",
                   help="run only these series/sizes, e.g. consul:failover-term:detect@8+32")
    p.add_argument("--loopback-hosts", action="store_true",
                   help="run workers with a private /etc/hosts naming ::ffff:127.0.0.1 (avoids "
                        "the reverse-DNS stalls of TCPStore connects; see bench/servers.py)")
    p.add_argument("--out", default="", help="JSON lines file (default bench/results/<ts>.jsonl)")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.backends, opts.sizes, opts.layouts = "consul,c10d", "2,8,32", "spread"
        opts.repeats = opts.repeats_large = 1
        opts.train_seconds = min(opts.train_seconds, 3.0)
        opts.consul_kill_trigger = False
        opts.budget_min = min(opts.budget_min, 10.0)
    opts.backends = [b.strip() for b in opts.backends.split(",") if b.strip()]
    opts.thread_backends = [b.strip() for b in opts.thread_backends.split(",") if b.strip()]
    opts.sizes = sorted(int(s) for s in opts.sizes.split(",") if s.strip())
    opts.scenarios = [s.strip() for s in opts.scenarios.split(",") if s.strip()]
    opts.layouts = [s.strip() for s in opts.layouts.split(",") if s.strip()]
    opts.skip = {s.strip() for s in opts.skip.split(",") if s.strip()}
    try:
        opts.only = parse_only(opts.only)
    except ValueError as exc:
        p.error(str(exc))
    for b in opts.backends:
        if b not in ALL_BACKENDS:
            p.error(f"unknown backend {b!r}")
    for s in opts.scenarios:
        if s not in ALL_SCENARIOS:
            p.error(f"unknown scenario {s!r}")
    if opts.passes < 1:
        p.error(f"--passes must be at least 1, got {opts.passes}")
    if opts.product_dir and not (Path(opts.product_dir) / "consul_rdzv" / "__init__.py").is_file():
        p.error(f"--product-dir {opts.product_dir} holds no consul_rdzv package")
    return opts


def caps_for(opts) -> dict:
    if opts.no_caps:
        return {}
    caps = dict(FULL_CAPS)
    if opts.quick:
        # c10d's failover takes ~45-60 s per run (15 s to expire the dead node's keep-alives,
        # then the default 30 s last call): one size keeps the quick mode near 4 minutes; its
        # SIGTERM variant is the same for c10d (no exit hook), so not run.
        caps = {("c10d", "spread", "failover", "kill"): 8,
                ("c10d", "spread", "failover-term", "kill"): 0,
                ("etcd-v2", "spread", "failover-term", "kill"): 0}
    return caps


#: Sizes the quick mode runs for a series (c10d's failover: N = 8 only).
QUICK_ONLY = {("c10d", "spread", "failover", "kill"): {8}}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.compare:
        from bench import compare

        RESULTS.mkdir(parents=True, exist_ok=True)
        return compare.run(list(sys.argv[1:] if argv is None else argv), opts.compare,
                           opts.passes, RESULTS)
    # Stopped by SIGTERM, or SIGINT (ignored by default in a background job): unwind, so that
    # every run's `finally` stops its workers and its Consul agents.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "logs").mkdir(exist_ok=True)
    nofile = raise_nofile()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # TCPStore hostname warnings
    for name in list(os.environ):  # nothing may point a handler elsewhere
        if name.startswith(("CONSUL_HTTP", "ETCD")):
            del os.environ[name]
    from bench import servers

    etcd_bin, etcd_note = (None, "not requested")
    if "etcd-v2" in opts.backends:
        etcd_bin, etcd_note = servers.ensure_etcd()
        if etcd_bin is None:
            print(f"[bench] etcd-v2 skipped: {etcd_note}", flush=True)
        else:
            try:
                import etcd  # noqa: F401
            except ImportError:
                etcd_bin, etcd_note = None, ("python-etcd is not installed "
                                             "(pip install -e '.[bench]')")
                print(f"[bench] etcd-v2 skipped: {etcd_note}", flush=True)

    product = product_version()
    if opts.product_dir:
        from bench import compare

        opts.product_dir = Path(opts.product_dir).resolve()
        product = compare.describe(opts.product_dir)
        compare.use_product(opts.product_dir)  # before the forkserver starts: workers inherit
        print(f"[bench] measuring consul_rdzv {product['rev'] or ''} from "
              f"{opts.product_dir} (digest {product['consul_rdzv_sha256']})", flush=True)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["bench.worker"])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    suffix = "-quick" if opts.quick else ""
    out_path = Path(opts.out) if opts.out else RESULTS / f"{stamp}{suffix}.jsonl"
    machine = machine_info(etcd_bin, etcd_note)
    opts.hosts_file = None
    if opts.loopback_hosts:
        opts.hosts_file = str(servers.loopback_hosts_file(RESULTS))
    header = {"kind": "meta", "stamp": stamp, "argv": sys.argv[1:] if argv is None else argv,
              "machine": machine, "nofile": nofile, "quick": opts.quick,
              "heartbeat_timeout": HEARTBEAT_TIMEOUT, "dynamic_defaults": DYNAMIC_DEFAULTS,
              "procs": opts.procs, "timeout": opts.timeout, "train_seconds": opts.train_seconds,
              "consul_http_limit": servers.HTTP_LIMIT_LINE, "product": product,
              "loopback_hosts": bool(opts.hosts_file),
              "cluster": {"servers": opts.cluster_servers, "clients": opts.cluster_clients}
              if opts.cluster_clients else None,
              "b2b": {"rounds": opts.b2b_rounds, "stagger": opts.b2b_stagger,
                      "window": opts.b2b_window}}
    print(f"[bench] {machine['cores']} cores, {machine['mem_gb']} GB, torch {machine['torch']}, "
          f"{machine['consul']}, etcd {machine['etcd'] or etcd_note} -> {out_path}", flush=True)
    caps = caps_for(opts)
    skipped: dict[tuple, str] = {}
    started = _now()
    with open(out_path, "w") as fh:
        fh.write(json.dumps(header) + "\n")
        for scenario, n, backend, layout, trigger, item_reps in build_plan(opts):
            key = series_key(scenario, backend, layout, trigger)
            reason = None
            if f"{backend}:{scenario}" in opts.skip:
                continue
            if backend == "etcd-v2" and etcd_bin is None:
                reason = f"etcd unavailable: {etcd_note}"
            elif key in skipped:
                reason = skipped[key]
            elif key in caps and n > caps[key] and not opts.only:
                reason = (f"capped at N <= {caps[key]} in this run" if caps[key]
                          else "not run in this layout or mode")
            elif opts.quick and key in QUICK_ONLY and n not in QUICK_ONLY[key]:
                reason = f"quick mode runs N = {sorted(QUICK_ONLY[key])} only"
            elif (_now() - started) / 60 > opts.budget_min:
                reason = f"time budget of {opts.budget_min:g} min used up"
            if reason:
                row = {"kind": "skip", "backend": backend, "layout": layout, "scenario": scenario,
                       "trigger": trigger, "n": n, "reason": reason}
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                continue
            reps = opts.repeats if n <= opts.small else opts.repeats_large
            if not opts.no_caps and not opts.only:
                reps = min(reps, FULL_REPEATS.get(key, reps))
            if item_reps:
                reps = item_reps
            for rep in range(reps):
                run = Run(ctx, opts, backend, layout, scenario, n, rep, trigger, etcd_bin)
                try:
                    rec = run.execute()
                except Exception as exc:
                    rec = {"backend": backend, "layout": layout, "scenario": scenario,
                           "trigger": trigger, "n": n, "rep": rep, "status": "error",
                           "violations": [f"runner error: {type(exc).__name__}: {exc}"]}
                rec["kind"] = "run"
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                lat = rec.get("latency_s")
                extra = ""
                if scenario in FAILOVERS and rec.get("detect_first_s") is not None:
                    extra = f" detect {rec['detect_first_s']:.2f}s"
                if rec.get("victim_exit"):
                    ve = rec["victim_exit"]
                    extra += (f" victim left {ve['exited_s']:.2f}s" if "exited_s" in ve
                              else f" victim: {ve.get('error')}")
                req = rec.get("product_requests") or rec.get("requests")
                if req:
                    extra += f" req/node med {req['median']:.0f} max {req['max']:.0f}"
                for r in rec.get("b2b_rounds") or []:
                    cr = r.get("consul_requests") or {}
                    if r.get("from_last_entry_s") is not None:
                        extra += (f" | r{r['phase']} {r['from_last_entry_s']:.3f}s"
                                  f" {cr.get('rest_per_node', float('nan')):.1f}req")
                cr = rec.get("consul_requests") or {}
                if "rest_per_node" in cr:
                    extra += (f" consul-counted/node {cr['per_node']:.1f} (passes "
                              f"{cr['passes_per_node']:.1f}, rest {cr['rest_per_node']:.1f})")
                if rec.get("topology") == "cluster":
                    extra += f" [cluster {rec.get('agents')} agents]"
                if rec.get("train"):
                    t = rec["train"]
                    if "req_per_s_per_node" in t:
                        extra += f" train {t['req_per_s_per_node']['mean']:.2f} req/s/node"
                shown = f"{lat:.3f}s" if lat is not None else rec["status"]
                if rec.get("violations"):
                    extra += "  VIOLATIONS: " + "; ".join(rec["violations"])[:300]
                print(f"[bench {(_now() - started) / 60:5.1f}m] {scenario:13} {backend:7} "
                      f"{layout:7} {trigger or '':6} N={n:<5} rep {rep}: {shown:>9}{extra}",
                      flush=True)
                if (rec["status"] != "ok" or (lat is not None and lat > opts.timeout)) \
                        and not opts.keep_going:
                    skipped[key] = f"skipped: N={n} {rec['status']}" + (
                        f" (per-run timeout {opts.timeout:g} s)" if rec["status"] == "timeout"
                        else "")
                    break
    print(f"[bench] done in {(_now() - started) / 60:.1f} min: {out_path}", flush=True)
    from bench import report

    text = report.render(out_path)
    md_path = out_path.with_suffix(".md")
    md_path.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
