"""Which ``heartbeat_timeout`` and ``consul_timeout`` ride out a Consul leader election.

    python -m bench.election --trials 6 [--ttls 5,10,15,20] [--consul-timeouts 3,10,30]
                             [--raft-multiplier 5] [--fast-gossip] [--out election.json]

A real :class:`~consul_rdzv.testing.ConsulCluster` (3 servers, 2 client agents) with **Consul's
default timings** (``raft_multiplier = 5``, default LAN gossip) unless told otherwise
(``--raft-multiplier 1``, HashiCorp's advice for production servers; ``--fast-gossip``, the test
harness's 300 ms probes). Every trial SIGKILLs the Raft leader
twice (restarting it and waiting for a healthy cluster in between):

* **training** (the worst case docs/deployment.md describes, "Check passes can wait for the
  servers"): one run per ``--ttls`` value, each of three nodes (one on each client agent, one on
  a follower server: the servers-only shape), all in a round; the leader is killed the moment
  the next round returns, so every node's meta publish (a service registration) is synced
  during the election, while the agent holds the lock that check passes need. Recorded per
  node: the longest time between two check passes, whether it suspected its registration lost,
  whether it was **declared dead** (its session gone or replaced: a false death, the other
  nodes would re-form without it), and whether any node of its run saw a node waiting
  (torchrun would restart the workers).
* **joining**: one run per ``--consul-timeouts`` value (check TTL 30 s), three nodes as above;
  the leader is killed and at once every node asks for the next round. Recorded per node:
  whether ``next_round()`` succeeded and how long it took, or the error.

The election time is from the kill until a new leader takes a KV write. Nothing is asserted:
the figures (and a summary per setting) are printed and, with ``--out``, written as JSON.
docs/deployment.md ("Choosing the timeouts") has the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from consul_rdzv.client import ConsulClient
from consul_rdzv.config import ConsulConfig
from consul_rdzv.errors import RendezvousError
from consul_rdzv.rendezvous import ConsulRendezvous
from consul_rdzv.settings import RendezvousSettings
from consul_rdzv.testing import CONSUL_VERSION
from consul_testing import ClusterMember, ConsulCluster


def _node(member: ClusterMember, prefix: str, node_id: str,
          settings: RendezvousSettings) -> ConsulRendezvous:
    client = ConsulClient(ConsulConfig.resolve(address=member.url, env={}),
                          retry_timeout=settings.consul_timeout)
    return ConsulRendezvous(settings, client, node_id=node_id, host=node_id,
                            endpoint_provider=lambda: {"host": f"{node_id}.store.test",
                                                       "port": 20000})


def _published(member: ClusterMember, node: ConsulRendezvous) -> bool:
    """The node's current round is in its service meta on its agent and in the catalog."""
    round_no = str(node.current_round.round)
    try:
        status, service = member.api("GET", f"/v1/agent/service/{node.service_id}")
        if status != 200 or (service.get("Meta") or {}).get("round") != round_no:
            return False
        status, entries = member.api(
            "GET", f"/v1/health/service/{node.settings.service}?filter="
            + urllib.parse.quote(f'Service.ID == "{node.service_id}"'))
    except OSError:
        return False
    return status == 200 and any((e["Service"].get("Meta") or {}).get("round") == round_no
                                 for e in entries)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:g}s: {what}")
        time.sleep(0.05)


class Run:
    """Three nodes of one run: one per client agent and one on a follower server."""

    def __init__(self, cluster: ConsulCluster, follower: ClusterMember, pool: ThreadPoolExecutor,
                 **settings) -> None:
        self.prefix = f"bench-election-{uuid.uuid4().hex[:8]}"
        self.settings = RendezvousSettings(run_id=f"run-{self.prefix}", key_prefix=self.prefix,
                                           min_nodes=3, max_nodes=3, last_call_timeout=0.3,
                                           join_timeout=120.0, close_timeout=5.0, **settings)
        self.members = [*cluster.clients, follower]
        self.nodes = [_node(m, self.prefix, f"n{i}", self.settings)
                      for i, m in enumerate(self.members)]
        self.pool = pool

    def round(self, timeout: float = 60.0) -> list:
        futures = [self.pool.submit(n.next_round) for n in self.nodes]
        return [f.result(timeout) for f in futures]

    def published(self) -> bool:
        return all(n.registration.lost or _published(m, n)
                   for m, n in zip(self.members, self.nodes, strict=True))

    def leave(self) -> None:
        for future in [self.pool.submit(n.leave, timeout=5) for n in self.nodes]:
            try:
                future.result(30)
            except Exception as exc:
                print(f"  leave failed: {exc!r}", file=sys.stderr)
        for n in self.nodes:
            n.client.close()


class Sampler(threading.Thread):
    """Every 10 ms: each node's time since its last check pass, whether it is suspected lost,
    and whether any node of its run sees a node waiting."""

    def __init__(self, runs: list[Run]) -> None:
        super().__init__(daemon=True, name="sampler")
        self.runs = runs
        self.gap: dict[tuple[int, str], float] = {}
        self.lost: set[tuple[int, str]] = set()
        self.waiting: set[int] = set()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.01):
            for i, run in enumerate(self.runs):
                for n in run.nodes:
                    key = (i, n.node_id)
                    self.gap[key] = max(self.gap.get(key, 0.0), n.registration.seconds_since_pass)
                    if n.registration.lost:
                        self.lost.add(key)
                    if n.num_nodes_waiting() > 0:
                        self.waiting.add(i)

    def stop(self) -> None:
        self._done.set()
        self.join(5)


def _restore(cluster: ConsulCluster, killed: ClusterMember) -> None:
    killed.start()
    cluster.wait_for_leader(120)
    cluster.wait_healthy(120)


def training_trial(cluster: ConsulCluster, ttls: list[float], pool) -> dict:
    leader = cluster.wait_for_leader(60)
    follower = next(s for s in cluster.servers if s is not leader)
    runs = [Run(cluster, follower, pool, heartbeat_timeout=ttl, consul_timeout=30.0)
            for ttl in ttls]
    try:
        for run in runs:
            for n in run.nodes:
                n.register(timeout=30)
        for future in [pool.submit(r.round) for r in runs]:
            future.result(90)
        _wait(lambda: all(r.published() for r in runs), 30, "the first rounds published")
        sessions = [[n.session_id for n in r.nodes] for r in runs]
        sampler = Sampler(runs)
        sampler.start()
        for future in [pool.submit(r.round) for r in runs]:
            future.result(90)
        killed_at = time.monotonic()
        leader.kill()  # every node's meta publish of this round lands in the election
        cluster.wait_for_leader(120, exclude=leader)
        election = time.monotonic() - killed_at
        _wait(lambda: all(r.published() for r in runs), 90, "the second rounds published")
        # A check that went critical meanwhile is synced to the servers, which invalidate the
        # session bound to it: give that time to happen before looking.
        settle = time.monotonic() + 5.0
        while time.monotonic() < settle:
            time.sleep(0.05)
        sampler.stop()
        admin = cluster.clients[1].client()
        try:
            results = []
            for i, (run, before) in enumerate(zip(runs, sessions, strict=True)):
                nodes = []
                for n, session in zip(run.nodes, before, strict=True):
                    dead = n.session_id != session or admin.session_info(session) is None
                    nodes.append({"node": n.node_id, "gap": round(sampler.gap[(i, n.node_id)], 2),
                                  "suspected": (i, n.node_id) in sampler.lost,
                                  "declared_dead": dead})
                results.append({"heartbeat_timeout": run.settings.heartbeat_timeout,
                                "interval": round(run.settings.heartbeat_interval, 2),
                                "nodes": nodes, "saw_waiting": i in sampler.waiting})
        finally:
            admin.close()
        return {"election": round(election, 2), "killed": leader.name, "runs": results}
    finally:
        for run in runs:
            run.leave()
        _restore(cluster, leader)


def joining_trial(cluster: ConsulCluster, consul_timeouts: list[float], pool) -> dict:
    leader = cluster.wait_for_leader(60)
    follower = next(s for s in cluster.servers if s is not leader)
    runs = [Run(cluster, follower, pool, heartbeat_timeout=30.0, consul_timeout=ct)
            for ct in consul_timeouts]
    try:
        for future in [pool.submit(r.round) for r in runs]:
            future.result(90)
        killed_at = time.monotonic()
        leader.kill()
        futures = [[pool.submit(_timed, n.next_round) for n in r.nodes] for r in runs]
        cluster.wait_for_leader(120, exclude=leader)
        election = time.monotonic() - killed_at
        results = []
        for run, fs in zip(runs, futures, strict=True):
            outcomes = [f.result(180) for f in fs]
            results.append({"consul_timeout": run.settings.consul_timeout,
                            "nodes": outcomes})
        return {"election": round(election, 2), "killed": leader.name, "runs": results}
    finally:
        for run in runs:
            run.leave()
        _restore(cluster, leader)


def _timed(call) -> dict:
    started = time.monotonic()
    try:
        call()
        return {"ok": True, "seconds": round(time.monotonic() - started, 2)}
    except RendezvousError as exc:
        return {"ok": False, "seconds": round(time.monotonic() - started, 2),
                "error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def summarize(report: dict) -> list[str]:
    lines = []
    elections = [t["election"] for t in report["training"] + report["joining"]]
    if elections:
        lines.append(f"elections: {len(elections)}, {min(elections):.2f}-{max(elections):.2f}s "
                     f"(median {statistics.median(elections):.2f}s)")
    for ttl in report["ttls"]:
        rows = [r for t in report["training"] for r in t["runs"] if r["heartbeat_timeout"] == ttl]
        nodes = [n for r in rows for n in r["nodes"]]
        if not nodes:
            continue
        lines.append(
            f"heartbeat_timeout {ttl:g}s: {sum(n['declared_dead'] for n in nodes)} of "
            f"{len(nodes)} nodes declared dead, {sum(n['suspected'] for n in nodes)} suspected "
            f"themselves lost, {sum(r['saw_waiting'] for r in rows)} of {len(rows)} runs saw a "
            f"node waiting; longest time between passes {max(n['gap'] for n in nodes):.2f}s")
    for ct in report["consul_timeouts"]:
        nodes = [n for t in report["joining"] for r in t["runs"] if r["consul_timeout"] == ct
                 for n in r["nodes"]]
        if not nodes:
            continue
        ok = [n["seconds"] for n in nodes if n["ok"]]
        failed = [n for n in nodes if not n["ok"]]
        lines.append(
            f"consul_timeout {ct:g}s: {len(failed)} of {len(nodes)} joins failed"
            + (f" (after {min(n['seconds'] for n in failed):.1f}-"
               f"{max(n['seconds'] for n in failed):.1f}s)" if failed else "")
            + (f"; joined after {min(ok):.2f}-{max(ok):.2f}s" if ok else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--ttls", type=_floats, default=[5.0, 10.0, 15.0, 20.0])
    parser.add_argument("--consul-timeouts", type=_floats, default=[3.0, 10.0, 30.0])
    parser.add_argument("--raft-multiplier", type=int, default=5,
                        help="Consul's performance.raft_multiplier (default 5, Consul's own)")
    parser.add_argument("--fast-gossip", action="store_true",
                        help="the test harness's LAN gossip timings (300 ms probes)")
    parser.add_argument("--skip-joining", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    timings = (f"raft_multiplier {args.raft_multiplier}, "
               f"{'fast' if args.fast_gossip else 'default'} gossip")
    report: dict = {"consul": CONSUL_VERSION, "timings": timings,
                    "ttls": args.ttls, "consul_timeouts": args.consul_timeouts,
                    "training": [], "joining": [], "load": []}
    cluster = ConsulCluster(
        servers=3, clients=2, fast=args.fast_gossip,
        extra_hcl=f"performance {{ raft_multiplier = {args.raft_multiplier} }}\n")
    pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="bench-node")
    cluster.start(120)
    try:
        for trial in range(args.trials):
            report["load"].append(os.getloadavg()[0])
            t = training_trial(cluster, args.ttls, pool)
            report["training"].append(t)
            print(f"[trial {trial}] training: {json.dumps(t)}", flush=True)
            if not args.skip_joining:
                j = joining_trial(cluster, args.consul_timeouts, pool)
                report["joining"].append(j)
                print(f"[trial {trial}] joining: {json.dumps(j)}", flush=True)
    finally:
        cluster.close()
        pool.shutdown(wait=False, cancel_futures=True)
    report["summary"] = summarize(report)
    print(f"Consul {CONSUL_VERSION}, {timings}, load average "
          f"{min(report['load']):.1f}-{max(report['load']):.1f}:")
    for line in report["summary"]:
        print("  " + line)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
