"""Long runs: a soak of real torchrun jobs over Consul's real watch wait, and the flatness of
back-to-back rounds.

    python -m bench.soak --minutes 30                  # the soak on one dev agent
    python -m bench.soak --minutes 30 --cluster        # ... and on a ConsulCluster, same run
    python -m bench.soak --rounds 1000 --nodes 8       # flatness (bench/flat.py)

**Soak** (``--minutes M``). On each site (one ``consul agent -dev``; with ``--cluster`` also a
:class:`consul_testing.ConsulCluster` of 3 servers and 4 client agents, one client agent per
simulated host) it runs, at once and with the product's default settings (``watch_wait`` 300 s,
Consul's real blocking wait; ``heartbeat_timeout`` 30 s; only ``key_prefix`` and ``node_id``
are set):

* a 1-node and a 2-node torchrun job (``python -m torch.distributed.run``, one agent per node,
  ``--monitor-interval=0.1``: torch's monitor loop asks ``num_nodes_waiting()`` every 0.1 s and
  restarts the workers when it is > 0), training ``examples/train.py`` with ``--step-time``
  sleeps for at least M minutes, then finishing on their own;
* a 32-node job: 32 handlers from torch's registry in one process (``--child-handlers``, this
  module), each then polling ``num_nodes_waiting()`` every 0.1 s as torch's monitor loop does
  (and calling ``next_rendezvous()`` again when it is > 0, as torch would: a restart), for M
  minutes, then ``shutdown()`` as torch calls it when a job succeeded;
* once, when every job trains, a spare node in each run: it joins (its member key appears beside
  a full round), waits ``--spare-wait`` seconds for a round, gives up (its key is deleted: a KV
  tombstone under ``P/members/``) and leaves. Consul reaps that tombstone after its tombstone
  TTL (15 min), so the members prefix's index goes back down during the soak, under every
  node's training watch.

Every ``--sample`` seconds (30): threads, open fds, RSS and CPU (from /proc) of every node
process (torchrun agents, their workers, the handlers' process); Consul's own request counts
per agent (``consul_api_http_count`` of ``/v1/agent/metrics``, by method and path, the
sampler's own requests subtracted); per run its keys, sessions, service instances and the
members prefix's ``X-Consul-Index``; each agent's RSS and goroutines and the servers' count of
applied tombstone reaps (``consul_fsm_tombstone``). Restarts per job are worker starts beyond
the first per rank (``examples/train.py``'s progress ``start`` events; the handlers count their
own). It prints one line per sample, then a summary table (first, last, max of each series)
and the checks, and writes every sample to a JSON file (``--out``, default
``<workdir>/soak.json``). Logs of every agent and node stay in ``--workdir``.

**Flatness** (``--rounds R --nodes N``): see :mod:`bench.flat`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench.measure import (
    CHECK_PASS,
    ConsulView,
    children,
    fd_kinds,
    fds_flat,
    machine,
    proc_stats,
)

ROOT = Path(__file__).resolve().parent.parent
#: How often torch's monitor loop asks num_nodes_waiting() (torchrun --monitor-interval).
POLL = 0.1
#: A job that is not training this long after its start failed to start.
START_TIMEOUT = 600.0
#: After the planned end, how long the jobs get to finish and leave.
END_GRACE = 600.0
#: Consul reaps a KV tombstone after its tombstone TTL (15 min) plus up to its granularity:
#: a soak that trained at least this long must have seen the spare's tombstone reaped.
TOMBSTONE_JUDGED = 20 * 60.0

logger = logging.getLogger("bench.soak")



class RequestRates:
    """Requests per second an agent served between two samples, by ``METHOD path``, without
    the sampler's own (:attr:`ConsulView.sent`)."""

    def __init__(self) -> None:
        self.last: tuple[float, dict[str, float], Counter[str]] | None = None

    def update(self, now: float, counts: dict[str, float], own: Counter[str]) -> dict | None:
        last, self.last = self.last, (now, dict(counts), Counter(own))
        if last is None:
            return None
        then, before, own_before = last
        seconds = max(1e-6, now - then)
        delta: dict[str, float] = {}
        for key, value in counts.items():
            prev = before.get(key, 0.0)
            d = value - prev if value >= prev else value  # a counter Consul dropped and re-made
            d -= own[key] - own_before[key]
            if d > 0:
                delta[key] = d
        total = sum(delta.values())
        passes = delta.get(CHECK_PASS, 0.0)
        return {"seconds": round(seconds, 1), "per_s": round(total / seconds, 3),
                "check_passes_per_s": round(passes / seconds, 3),
                "rest_per_s": round((total - passes) / seconds, 3),
                "by_path": {k: round(v / seconds, 4) for k, v in sorted(delta.items())}}


# --------------------------------------------------------------------------- sites and jobs

@dataclass
class AgentRef:
    name: str
    view: ConsulView
    pid: int | None
    rates: RequestRates = field(default_factory=RequestRates)


@dataclass
class Site:
    """One Consul topology and the jobs on it."""

    name: str
    server: object  # bench.servers.ConsulServer or ClusterServer
    node_agents: list[AgentRef]  # the agents the nodes talk to (requests counted there)
    state_view: ConsulView  # where keys and sessions are read (a server on a cluster)
    server_pids: list[int]
    jobs: list = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    spares: list[dict] = field(default_factory=list)


def start_dev_site() -> Site:
    from bench.servers import ConsulServer

    server = ConsulServer()
    server.start()
    view = ConsulView(server.agent.url)
    ref = AgentRef("dev-agent", view, server.pid)
    return Site("dev", server, [ref], view, [server.pid])


def start_cluster_site(clients: int = 4) -> Site:
    from bench.servers import ClusterServer

    server = ClusterServer(servers=3, clients=clients, raft_multiplier=5)
    server.start()
    cluster = server.cluster
    refs = [AgentRef(m.name, ConsulView(m.url, m.management_token), m.proc.pid)
            for m in cluster.clients]
    s0 = cluster.servers[0]
    return Site("cluster", server, refs, ConsulView(s0.url, s0.management_token),
                [m.proc.pid for m in cluster.servers])


def agent_address(ref: AgentRef) -> str:
    return ref.view.url.split("://", 1)[1]


class TorchJob:
    """A torchrun job of ``nodes`` agents (tests/torchrun_jobs.py), one per given agent."""

    kind = "torchrun"

    def __init__(self, name: str, workdir: Path, key_prefix: str, agents: list[AgentRef],
                 steps: int, step_time: float) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        from torchrun_jobs import TorchrunJob

        self.name = name
        self.nodes = len(agents)
        self.run_id = f"soak-{name}-{uuid.uuid4().hex[:6]}"
        self.key_prefix = key_prefix
        self.agents = agents
        self.job = TorchrunJob(workdir, agent_address(agents[0]), self.run_id,
                               nnodes=str(self.nodes), rdzv_conf={"key_prefix": key_prefix},
                               train_args=["--steps", str(steps), "--step-time", str(step_time)])

    def start(self) -> None:
        for i, ref in enumerate(self.agents):
            self.job.endpoint = agent_address(ref)  # one agent per node (simulated host)
            self.job.start(f"{self.name}-node{i}")

    def training(self) -> bool:
        return len({e["rank"] for e in self.job.starts()}) >= self.nodes

    def restarts(self) -> dict[int, int]:
        starts = Counter(e["rank"] for e in self.job.starts())
        return {rank: n - 1 for rank, n in sorted(starts.items())}

    def done(self) -> bool:
        return all(not a.alive() for a in self.job.agents)

    def failed(self) -> str | None:
        codes = {a.name: a.proc.poll() for a in self.job.agents}
        bad = {k: v for k, v in codes.items() if v not in (None, 0)}
        return f"agents exited with {bad}" if bad else None

    def processes(self) -> dict[str, int]:
        procs = {}
        for agent in self.job.agents:
            if agent.alive():
                procs[f"{agent.name}/agent"] = agent.pid
                for i, pid in enumerate(children(agent.pid, "train.py")):
                    procs[f"{agent.name}/worker{i}"] = pid
        return procs

    def status(self) -> dict:
        return {"restarts": self.restarts(),
                "exit": {a.name: a.proc.poll() for a in self.job.agents},
                "steps": sum(1 for e in self.job.progress() if e["event"] == "step")}

    def logs(self) -> dict[str, str]:
        return {a.name: str(a.log_path) for a in self.job.agents}

    def kill(self) -> None:
        self.job.kill_all()


class HandlersJob:
    """N nodes as torch handlers in one child process (``--child-handlers``)."""

    kind = "handlers"

    def __init__(self, name: str, workdir: Path, key_prefix: str, agent: AgentRef, nodes: int,
                 seconds: float) -> None:
        self.name = name
        self.nodes = nodes
        self.run_id = f"soak-{name}-{uuid.uuid4().hex[:6]}"
        self.key_prefix = key_prefix
        self.agents = [agent]
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.status_path = workdir / "status.json"
        self.log_path = workdir / "handlers.log"
        self.spec = {"endpoint": agent_address(agent), "run_id": self.run_id,
                     "key_prefix": key_prefix, "nodes": nodes, "seconds": seconds,
                     "status": str(self.status_path), "name": name}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.soak", "--child-handlers", json.dumps(self.spec)],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def read_status(self) -> dict:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.status_path.read_text())
        return {}

    def training(self) -> bool:
        return self.read_status().get("state") in ("training", "leaving", "done")

    def restarts(self) -> dict[int, int]:
        return {i: n for i, n in enumerate(self.read_status().get("restarts", []))}

    def done(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def failed(self) -> str | None:
        code = self.proc.poll() if self.proc else None
        status = self.read_status()
        if code not in (None, 0):
            return f"handlers process exited with {code}: {status.get('error', '')}"
        if status.get("error"):
            return status["error"]
        return None

    def processes(self) -> dict[str, int]:
        alive = self.proc is not None and self.proc.poll() is None
        return {f"{self.name}/process": self.proc.pid} if alive else {}

    def status(self) -> dict:
        status = self.read_status()
        return {"restarts": self.restarts(), "exit": self.proc.poll() if self.proc else None,
                "state": status.get("state"), "waiting_samples": status.get("samples", 0),
                "waiting_hist": status.get("hist", {}), "waiting_nonzero":
                status.get("nonzero", [])[:20], "rounds": status.get("rounds")}

    def logs(self) -> dict[str, str]:
        return {self.name: str(self.log_path)}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)


# --------------------------------------------------------------------------- the spare

def spare_join_and_leave(site: Site, job, ref: AgentRef, wait: float) -> dict:
    """A spare node joins ``job``'s run beside its full round, waits ``wait`` seconds for a
    round (none comes: the round is full and trains), gives up and leaves. What happened."""
    from consul_rdzv.client import ConsulClient
    from consul_rdzv.config import ConsulConfig
    from consul_rdzv.errors import RendezvousTimeoutError
    from consul_rdzv.rendezvous import ConsulRendezvous
    from consul_rdzv.settings import RendezvousSettings

    settings = RendezvousSettings(run_id=job.run_id, min_nodes=job.nodes, max_nodes=job.nodes,
                                  key_prefix=job.key_prefix, join_timeout=wait)
    config = ConsulConfig.resolve(address=ref.view.url, env={})
    rdzv = ConsulRendezvous(settings, ConsulClient(config, retry_timeout=30),
                            node_id=f"{job.name}-spare")
    started = time.time()
    outcome = {"site": site.name, "job": job.name, "run_id": job.run_id, "started": started}
    try:
        rdzv.next_round()
        outcome["result"] = "sealed into a round (unexpected: the round is full)"
    except RendezvousTimeoutError:
        outcome["result"] = "gave up after join_timeout (expected), member key deleted"
    except Exception as exc:  # recorded, judged by the checks
        outcome["result"] = f"error: {type(exc).__name__}: {exc}"
    finally:
        outcome["left"] = rdzv.leave(timeout=30)
        rdzv.client.close()
    outcome["seconds"] = round(time.time() - started, 2)
    return outcome


# --------------------------------------------------------------------------- sampling

def sample_site(site: Site, started: float) -> dict:
    now = time.time()
    sample: dict = {"t": round(now - started, 1), "time": now, "processes": {}, "agents": {},
                    "runs": {}, "jobs": {},
                    "all_running": not any(job.done() for job in site.jobs)}
    consul_ports = {int(ref.view.url.rsplit(":", 1)[1]) for ref in site.node_agents}
    for job in site.jobs:
        for name, pid in job.processes().items():
            stats = proc_stats(pid)
            if stats:
                if "/worker" not in name:
                    stats["fd_kinds"] = fd_kinds(pid, consul_ports)
                sample["processes"][name] = stats
        sample["jobs"][job.name] = job.status()
    for ref in site.node_agents:
        entry: dict = {"rss_mb": (proc_stats(ref.pid) or {}).get("rss_mb")}
        try:
            metrics = ref.view.metrics()
            entry["goroutines"] = metrics["goroutines"]
            entry["requests"] = ref.rates.update(now, metrics["counts"], ref.view.sent)
        except OSError as exc:
            entry["error"] = str(exc)
        sample["agents"][ref.name] = entry
    try:
        if site.state_view not in [r.view for r in site.node_agents]:
            sample["servers"] = {"rss_mb": [(proc_stats(p) or {}).get("rss_mb")
                                            for p in site.server_pids]}
        sample["tombstone_reaps"] = site.state_view.metrics()["tombstone_reaps"]
        sessions = site.state_view.sessions()
        sample["sessions_total"] = len(sessions)
        for job in site.jobs:
            sample["runs"][job.name] = site.state_view.run_state(job.key_prefix, job.run_id,
                                                                 sessions)
    except OSError as exc:
        sample["state_error"] = str(exc)
    return sample


def sample_line(site: Site, sample: dict) -> str:
    parts = [f"[{site.name} t={sample['t']:.0f}s]"]
    for job in site.jobs:
        st = sample["jobs"].get(job.name, {})
        run = sample["runs"].get(job.name, {})
        restarts = sum(st.get("restarts", {}).values())
        extra = ""
        if job.kind == "handlers":
            hist = st.get("waiting_hist", {})
            nonzero = sum(v for k, v in hist.items() if k != "0")
            extra = f" waiting>0:{nonzero}/{st.get('waiting_samples', 0)}"
        parts.append(f"{job.name}: restarts {restarts}{extra} keys {run.get('keys')} "
                     f"sessions {run.get('sessions')} idx {run.get('members_index')}")
    rss = {k: v["rss_mb"] for k, v in sample["processes"].items()}
    if rss:
        parts.append(f"rss {min(rss.values()):.0f}-{max(rss.values()):.0f}MB")
    reqs = [a.get("requests") for a in sample["agents"].values() if a.get("requests")]
    if reqs:
        parts.append(f"req/s {sum(r['per_s'] for r in reqs):.2f}"
                     f" (passes {sum(r['check_passes_per_s'] for r in reqs):.2f})")
    if sample.get("tombstone_reaps") is not None:
        parts.append(f"reaps {sample['tombstone_reaps']:.0f}")
    return " | ".join(parts)


# --------------------------------------------------------------------------- summary

def series(samples: list[dict]) -> dict[str, list[float]]:
    """Every recorded quantity of a site's samples as a time series (None where absent)."""
    out: dict[str, list] = defaultdict(list)
    n = len(samples)
    for i, s in enumerate(samples):
        def put(name: str, value, i: int = i) -> None:
            values = out[name]
            values.extend([None] * (i - len(values)))
            values.append(value)

        for proc, st in s["processes"].items():
            for key in ("threads", "fds", "rss_mb"):
                put(f"{proc} {key}", st[key])
        for agent, st in s["agents"].items():
            put(f"{agent} rss_mb", st.get("rss_mb"))
            put(f"{agent} goroutines", st.get("goroutines"))
            req = st.get("requests")
            if req:
                put(f"{agent} requests/s (all)", req["per_s"])
                put(f"{agent} requests/s (check passes)", req["check_passes_per_s"])
                put(f"{agent} requests/s (the rest)", req["rest_per_s"])
        for job, run in s["runs"].items():
            for key in ("keys", "sessions", "services", "members_index"):
                put(f"{job} {key}", run.get(key))
        put("sessions in Consul (all)", s.get("sessions_total"))
        put("tombstone reaps applied", s.get("tombstone_reaps"))
    for values in out.values():
        values.extend([None] * (n - len(values)))
    return dict(out)


def first_last_max(values: list) -> tuple | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return present[0], present[-1], max(present), min(present), len(present)


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"
    return f"{v:.0f}" if isinstance(v, float) else str(v)


def summary_table(site: Site, training: list[dict]) -> str:
    """First, last, max and min of every series over the samples taken while every job ran
    (request rates: per interval ending at the sample; the first holds the spare's join)."""
    t = f"t = {training[0]['t']:.0f}-{training[-1]['t']:.0f} s" if training else "none"
    lines = [f"### {site.name}: {len(training)} samples while every job trained ({t})",
             "| series | first | last | max | min | samples |", "|---|---|---|---|---|---|"]
    for name, values in series(training).items():
        flm = first_last_max(values)
        if flm:
            lines.append(f"| {name} | {fmt(flm[0])} | {fmt(flm[1])} | {fmt(flm[2])} | "
                         f"{fmt(flm[3])} | {flm[4]} |")
    return "\n".join(lines)


def steady_requests(training: list[dict]) -> dict[str, dict[str, float]]:
    """Per agent, requests per second by ``METHOD path`` over the training intervals after the
    first (which holds the spare's join and leave): what a healthy job costs."""
    out: dict[str, dict[str, float]] = {}
    for agent in (training[0]["agents"] if training else {}):
        seconds, totals = 0.0, Counter()
        for s in training[2:]:
            req = s["agents"].get(agent, {}).get("requests")
            if req:
                seconds += req["seconds"]
                for key, rate in req["by_path"].items():
                    totals[key] += rate * req["seconds"]
        if seconds:
            out[agent] = {"seconds": round(seconds), "per_s": round(sum(totals.values())
                                                                    / seconds, 4),
                          **{k: round(v / seconds, 4) for k, v in sorted(totals.items())}}
    return out


def checks(site: Site, final: dict, training_samples: list[dict]) -> list[tuple[bool, str]]:
    """(ok, what) for every property a healthy soak must have."""
    out: list[tuple[bool, str]] = []
    training = training_samples
    for job in site.jobs:
        st = job.status()
        restarts = sum(st["restarts"].values())
        out.append((restarts == 0, f"{site.name}/{job.name}: {restarts} restarts"))
        failed = job.failed()
        out.append((failed is None, f"{site.name}/{job.name}: "
                    f"{'exited cleanly' if failed is None else failed}"))
        if job.kind == "handlers":
            hist = st.get("waiting_hist", {})
            nonzero = sum(v for k, v in hist.items() if k != "0")
            out.append((nonzero == 0 and st.get("waiting_samples", 0) > 0,
                        f"{site.name}/{job.name}: num_nodes_waiting() sampled "
                        f"{st.get('waiting_samples', 0)} times, {nonzero} > 0 ({hist})"))
        steady = [s["runs"].get(job.name, {}) for s in training_samples]
        keys = sorted({r.get("keys") for r in steady if r})
        sessions = sorted({r.get("sessions") for r in steady if r})
        want_keys, want_sessions = job.nodes + 2, job.nodes  # members, leader, round
        out.append((max(keys or [0]) <= want_keys + 1 and max(sessions or [0]) <= want_sessions
                    + 1, f"{site.name}/{job.name}: keys while training {keys} (members + leader "
                    f"+ round = {want_keys}; +1 with the spare), sessions {sessions}"))
        run = final.get(job.name, {})
        left = [k for k in run.get("key_names", [])
                if not k.endswith("/round/current")]
        out.append((not left and run.get("services", 0) == 0
                    and run.get("sessions", 0) == run.get("sessions_ended", 0) <= 1,
                    f"{site.name}/{job.name}: after the end: keys {run.get('key_names')}, "
                    f"services {run.get('services')}, sessions {run.get('sessions')} "
                    f"(of which the closed marker's {run.get('sessions_ended')})"))
    # The spare's tombstone under P/members/: reaped after Consul's tombstone TTL (15 min),
    # when each run's members index falls back (and the servers count a reap).
    span = training[-1]["t"] - training[0]["t"] if training_samples else 0.0
    drops = {}
    for job in site.jobs:
        idx = [(s["t"], s["runs"].get(job.name, {}).get("members_index")) for s in training]
        idx = [(t, i) for t, i in idx if i is not None]
        drops[job.name] = [f"{a[1]}->{b[1]} at t={b[0]:.0f}s"
                           for a, b in itertools.pairwise(idx) if b[1] < a[1]]
    reaps = [s.get("tombstone_reaps") for s in training if s.get("tombstone_reaps") is not None]
    what = (f"{site.name}: members index fell back (tombstone reaped) in "
            f"{sum(1 for d in drops.values() if d)} of {len(drops)} runs: {drops}; tombstone "
            f"reaps applied {reaps[0] if reaps else '?'}->{reaps[-1] if reaps else '?'}")
    if span >= TOMBSTONE_JUDGED:
        out.append((all(drops.values()), what))
    else:
        out.append((True, what + f" (soak shorter than {TOMBSTONE_JUDGED / 60:.0f} min: not "
                                 "judged)"))
    # The node processes (torchrun agents, the handlers' process); the workers are
    # examples/train.py, whose fds move with its progress-file writes: recorded, not judged.
    for proc in sorted({p for s in training_samples for p in s["processes"]
                        if "/worker" not in p}):
        vals = [s["processes"][proc] for s in training_samples if proc in s["processes"]]
        if len(vals) < 2:
            continue
        nodes = next((j.nodes for j in site.jobs
                      if j.kind == "handlers" and proc.startswith(f"{j.name}/")), 1)
        dt = vals[-1]["threads"] - vals[0]["threads"]
        fd_ok, fd_text = fds_flat(vals, nodes)
        drss = vals[-1]["rss_mb"] - vals[0]["rss_mb"]
        out.append((dt <= 0 and fd_ok and drss < 20,
                    f"{site.name}/{proc}: threads {vals[0]['threads']}->{vals[-1]['threads']} "
                    f"(max {max(v['threads'] for v in vals)}), {fd_text}, RSS "
                    f"{vals[0]['rss_mb']:.1f}->{vals[-1]['rss_mb']:.1f} MB"))
    return out


# --------------------------------------------------------------------------- the soak

def run_soak(opts) -> int:
    from bench.run import product_version, raise_nofile

    raise_nofile()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = Path(opts.workdir or f"/tmp/consul-rdzv-soak-{stamp}")
    workdir.mkdir(parents=True, exist_ok=True)
    out_path = Path(opts.out or workdir / "soak.json")
    seconds = opts.minutes * 60
    steps = math.ceil(seconds / opts.step_time)
    key_prefix = f"soak-{stamp}"
    meta = {"command": " ".join(["python -m bench.soak", *sys.argv[1:]]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(), "product": product_version(), "minutes": opts.minutes,
            "step_time": opts.step_time, "steps": steps, "sample_s": opts.sample,
            "handlers": opts.handlers, "spare_wait": opts.spare_wait, "workdir": str(workdir),
            "key_prefix": key_prefix}
    print(f"soak: {opts.minutes} min, workdir {workdir}, JSON {out_path}", flush=True)
    sites: list[Site] = []
    result = {"meta": meta, "sites": {}}
    exit_code = 1
    try:
        if not opts.no_dev:
            sites.append(start_dev_site())
        if opts.cluster:
            sites.append(start_cluster_site())
        for site in sites:
            def pick(i: int, agents: list[AgentRef] = site.node_agents) -> AgentRef:
                return agents[i % len(agents)]  # one agent per simulated host

            base = workdir / site.name
            site.jobs = [
                TorchJob("job1", base / "job1", key_prefix, [pick(0)], steps, opts.step_time),
                TorchJob("job2", base / "job2", key_prefix, [pick(1), pick(2)], steps,
                         opts.step_time),
                HandlersJob(f"job{opts.handlers}", base / f"job{opts.handlers}", key_prefix,
                            pick(3), opts.handlers, seconds),
            ]
            for job in site.jobs:
                job.start()
            print(f"[{site.name}] started " + ", ".join(
                f"{j.name} ({j.nodes} node{'s' if j.nodes > 1 else ''}, run {j.run_id})"
                for j in site.jobs), flush=True)
        deadline = time.monotonic() + START_TIMEOUT
        for site in sites:
            for job in site.jobs:
                while not job.training():
                    failed = job.failed() or (job.done() and "exited before training")
                    if failed or time.monotonic() > deadline:
                        raise RuntimeError(f"{site.name}/{job.name} did not start training: "
                                           f"{failed or 'timeout'}; logs: {job.logs()}")
                    time.sleep(1)
        started = time.time()
        meta["training_since"] = started
        print(f"all jobs training; sampling every {opts.sample:g}s", flush=True)
        for site in sites:
            site.samples.append(sample_site(site, started))
            print(sample_line(site, site.samples[-1]), flush=True)
        spare_threads = []
        for site in sites:
            for job in site.jobs:
                ref = job.agents[0]

                def spare(site=site, job=job, ref=ref) -> None:
                    site.spares.append(spare_join_and_leave(site, job, ref, opts.spare_wait))

                spare_threads.append(threading.Thread(target=spare, daemon=True))
                spare_threads[-1].start()
        alarms: set[str] = set()
        end_deadline = time.monotonic() + seconds + END_GRACE
        next_sample = time.monotonic() + opts.sample
        while True:
            all_done = all(job.done() for site in sites for job in site.jobs)
            if all_done or time.monotonic() > end_deadline:
                break
            time.sleep(max(0.0, min(next_sample - time.monotonic(), 5.0)))
            for site in sites:
                for job in site.jobs:
                    trouble = []
                    if sum(job.restarts().values()):
                        trouble.append(f"restarts {job.restarts()}")
                    if job.failed():
                        trouble.append(job.failed())
                    if trouble and f"{site.name}/{job.name}" not in alarms:
                        alarms.add(f"{site.name}/{job.name}")
                        print(f"!!! {site.name}/{job.name}: {'; '.join(trouble)}; logs: "
                              f"{job.logs()}", flush=True)
            if time.monotonic() >= next_sample:
                next_sample += opts.sample
                for site in sites:
                    site.samples.append(sample_site(site, started))
                    print(sample_line(site, site.samples[-1]), flush=True)
        for thread in spare_threads:
            thread.join(60)
        ended = time.time()
        meta["soak_seconds"] = round(ended - started, 1)
        # The jobs finished: what stays in Consul (a closed marker under its retention
        # session at most), and one last sample of the agents.
        time.sleep(2)
        exit_code = 0
        for site in sites:
            final_sessions = site.state_view.sessions()
            final = {job.name: site.state_view.run_state(job.key_prefix, job.run_id,
                                                         final_sessions) for job in site.jobs}
            training = [s for s in site.samples if s["all_running"]]
            site_checks = checks(site, final, training)
            if not all(ok for ok, _ in site_checks):
                exit_code = 1
            result["sites"][site.name] = {
                "jobs": {j.name: {"kind": j.kind, "nodes": j.nodes, "run_id": j.run_id,
                                  "status": j.status(), "logs": j.logs()} for j in site.jobs},
                "spares": site.spares, "samples": site.samples, "after_end": final,
                "checks": [{"ok": ok, "what": what} for ok, what in site_checks],
                "series": series(site.samples)}
            steady = steady_requests(training)
            result["sites"][site.name]["steady_requests_per_s"] = steady
            print(f"\n{summary_table(site, training)}\n", flush=True)
            print(f"### {site.name}: requests per second while training, after the spare's "
                  "interval (Consul's count, the sampler's own subtracted)", flush=True)
            for agent, rates in steady.items():
                print(f"- {agent}: " + ", ".join(f"{k} {v:g}" for k, v in rates.items()),
                      flush=True)
            print(f"### {site.name}: after the end", flush=True)
            for name, run in final.items():
                print(f"- {name}: keys {run['key_names']}, sessions {run['sessions']} (the "
                      f"closed marker's {run['sessions_ended']}), services {run['services']}",
                      flush=True)
            print(f"### {site.name}: spares", flush=True)
            for spare in site.spares:
                print(f"- {spare['job']}: {spare['result']} in {spare['seconds']}s, "
                      f"left: {spare['left']}", flush=True)
            print(f"### {site.name}: checks", flush=True)
            for ok, what in site_checks:
                print(f"- {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    finally:
        for site in sites:
            for job in site.jobs:
                job.kill()
            with contextlib.suppress(Exception):
                site.server.stop(keep_log=str(workdir / f"{site.name}-consul.log"))
        out_path.write_text(json.dumps(result, indent=1, default=str))
        print(f"\nJSON: {out_path}\nlogs: {workdir}", flush=True)
    return exit_code


# --------------------------------------------------------------------------- the handlers child

def child_handlers(spec: dict) -> int:
    """``--child-handlers SPEC``: N handlers from torch's registry in this process, each
    polling ``num_nodes_waiting()`` every 0.1 s after its round, for ``seconds``; then
    ``shutdown()`` on each, as torch calls it when the job succeeded. Status in a JSON file."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    n = int(spec["nodes"])
    status_path = Path(spec["status"])
    lock = threading.Lock()
    status: dict = {"state": "starting", "pid": os.getpid(), "nodes": n, "samples": 0,
                    "hist": {}, "nonzero": [], "restarts": [0] * n, "rounds": [None] * n,
                    "error": None}

    def write() -> None:
        with lock:
            text = json.dumps(status)
        tmp = status_path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(status_path)

    def make(i: int):
        return get_rendezvous_handler(RendezvousParameters(
            backend="consul", endpoint=spec["endpoint"], run_id=spec["run_id"], min_nodes=n,
            max_nodes=n, local_addr="127.0.0.1", key_prefix=spec["key_prefix"],
            node_id=f"{spec['name']}-h{i:02d}"))

    stop = threading.Event()
    write()
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            handlers = list(pool.map(make, range(n)))
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        with lock:
            status["rounds"] = [h.rendezvous.current_round.round for h in handlers]
            status["ranks"] = [info.rank for info in infos]
            status["state"] = "training"
            status["training_since"] = time.time()
        write()
        del infos

        def monitor(i: int, handler) -> None:
            """torch's monitor loop: num_nodes_waiting() every 0.1 s, a restart when > 0."""
            hist: Counter[int] = Counter()
            while not stop.wait(POLL):
                waiting = handler.num_nodes_waiting()
                hist[waiting] += 1
                with lock:
                    status["samples"] += 1
                    status["hist"][str(waiting)] = status["hist"].get(str(waiting), 0) + 1
                    if waiting:
                        status["nonzero"].append([time.time(), i, waiting])
                        status["restarts"][i] += 1
                if waiting:
                    logger.warning("node %d: num_nodes_waiting() = %d: restarting", i, waiting)
                    info = handler.next_rendezvous()
                    with lock:
                        status["rounds"][i] = handler.rendezvous.current_round.round
                    del info

        threads = [threading.Thread(target=monitor, args=(i, h), daemon=True,
                                    name=f"monitor-{i}") for i, h in enumerate(handlers)]
        for thread in threads:
            thread.start()
        end = time.monotonic() + float(spec["seconds"])
        while time.monotonic() < end:
            time.sleep(min(5.0, max(0.0, end - time.monotonic())))
            write()
        stop.set()
        for thread in threads:
            thread.join(60)
        with lock:
            status["state"] = "leaving"
        write()
        with ThreadPoolExecutor(max_workers=n) as pool:
            left = list(pool.map(lambda h: h.shutdown(), handlers))
        with lock:
            status["shutdown"] = left
            status["state"] = "done"
        write()
        return 0
    except BaseException as exc:
        with lock:
            status["error"] = f"{type(exc).__name__}: {exc}"
            status["state"] = "failed"
        write()
        raise


# --------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description="Long runs: a soak of real torchrun jobs over Consul's real watch wait "
                    "(--minutes), or the flatness of back-to-back rounds (--rounds).")
    p.add_argument("--minutes", type=float, help="soak: train at least this long")
    p.add_argument("--cluster", action="store_true",
                   help="soak also on a ConsulCluster (3 servers, 4 client agents), same run")
    p.add_argument("--no-dev", action="store_true", help="soak: skip the dev agent site")
    p.add_argument("--handlers", type=int, default=32,
                   help="soak: nodes of the handlers job (default 32)")
    p.add_argument("--step-time", type=float, default=1.0,
                   help="soak: seconds per training step of examples/train.py (default 1)")
    p.add_argument("--sample", type=float, default=30.0,
                   help="seconds between samples (soak; default 30)")
    p.add_argument("--spare-wait", type=float, default=10.0,
                   help="soak: seconds the spare node waits for a round (default 10)")
    p.add_argument("--rounds", type=int, help="flatness: back-to-back rounds (bench/flat.py)")
    p.add_argument("--nodes", type=int, default=8, help="flatness: nodes (default 8)")
    p.add_argument("--every", type=int, default=50,
                   help="flatness: sample every this many rounds (default 50)")
    p.add_argument("--loopback-hosts", action="store_true",
                   help="flatness: a private /etc/hosts naming ::ffff:127.0.0.1 (root; see "
                        "docs/benchmarks.md, 'Measuring on one machine')")
    p.add_argument("--workdir", help="logs and files (default /tmp/consul-rdzv-soak-<stamp>)")
    p.add_argument("--out", help="JSON file of the samples (default <workdir>/soak.json)")
    p.add_argument("--child-handlers", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.child_handlers is None and (opts.minutes is None) == (opts.rounds is None):
        p.error("give --minutes M (the soak) or --rounds R (flatness)")
    for name in ("minutes", "step_time", "sample", "spare_wait"):
        value = getattr(opts, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, not {value:g}")
    for name in ("handlers", "nodes", "every", "rounds"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1, not {value}")
    if opts.loopback_hosts and opts.rounds is None:
        p.error("--loopback-hosts is for the flatness run (--rounds): the soak's rounds are few")
    if opts.loopback_hosts and os.geteuid() != 0:
        p.error("--loopback-hosts needs root (a private mount namespace over /etc/hosts); run "
                "without it, or as root")
    if opts.no_dev and not opts.cluster:
        p.error("--no-dev leaves no site: add --cluster")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.child_handlers is not None:
        return child_handlers(json.loads(opts.child_handlers))
    if opts.rounds is not None:
        from bench import flat

        return flat.run_flat(opts)
    return run_soak(opts)


if __name__ == "__main__":
    raise SystemExit(main())
