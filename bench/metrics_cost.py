"""What a node's metrics cost: CPU and Consul requests of nodes with and without ``metrics_port``
in the same run, over the same rounds (docs/observability.md, "What the metrics cost").

One run of 5 node processes on a dev agent: a coordinator (started first, so that it holds the
leader key throughout and the four others have the same role), two nodes with metrics (``--on``,
default a1 and a2, scraped every ``--scrape`` seconds, harsher than Prometheus' usual 15 s) and
two without (run it again with ``--on b1,b2`` to swap them). Each round the
nodes "train" for ``--train`` seconds (the heartbeat and the watch run), then all join the next
round. Each node measures its own CPU time (``time.process_time()``) and counts its Consul
requests by endpoint from the first round to the last, and reports them as JSON.

    python -m bench.metrics_cost [--rounds 30] [--train 2] [--scrape 5] [--on a1,a2]

Also timed in this process: one call of each hook (a request counted, a heartbeat pass
observed) and one scrape's rendering.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import timeit
import urllib.request

NODES = ("coord", "a1", "a2", "b1", "b2")


def child(args: argparse.Namespace) -> None:
    from consul_rdzv.client import ConsulClient
    from consul_rdzv.rendezvous import ConsulRendezvous
    from consul_rdzv.settings import RendezvousSettings

    settings = RendezvousSettings(
        run_id="metrics-cost", key_prefix=args.prefix, min_nodes=len(NODES),
        max_nodes=len(NODES), last_call_timeout=0.5, join_timeout=120.0,
        metrics_port=0 if args.metrics else None,
        metrics_host="127.0.0.1" if args.metrics else None)
    node = ConsulRendezvous(settings, ConsulClient(retry_timeout=30.0), node_id=args.node,
                            endpoint_provider=lambda: {"host": "127.0.0.1", "port": 1})
    if node.metrics is not None:
        print(json.dumps({"port": node.metrics.port}), flush=True)
    cpu0, wall0, sent0 = time.process_time(), time.monotonic(), node.client.requests_sent
    before = dict(node.client.request_counts)
    rounds = 0
    for _ in range(args.rounds):
        node.next_round()
        rounds += 1
        time.sleep(args.train)  # training: the heartbeat and the watch run
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    counts = {k: v - before.get(k, 0) for k, v in node.client.request_counts.items()}
    print(json.dumps({"node": args.node, "metrics": args.metrics, "rounds": rounds,
                      "cpu": cpu, "wall": wall, "requests": node.client.requests_sent - sent0,
                      "by_endpoint": counts}), flush=True)
    node.leave()


def hooks() -> dict:
    from consul_rdzv.metrics import NodeMetrics

    m = NodeMetrics("bench", "node", port=0, host="127.0.0.1")
    try:
        n = 100_000
        request = timeit.timeit(lambda: m.request("/v1/kv/a/b", 200), number=n) / n
        beat = timeit.timeit(lambda: m.heartbeat(0.001, True), number=n) / n
        for i in range(200):
            m.request(f"/v1/{('kv', 'txn', 'agent', 'session')[i % 4]}/x", (200, 404, 409)[i % 3])
        url = f"http://127.0.0.1:{m.port}/metrics"
        size = len(urllib.request.urlopen(url, timeout=10).read())
        scrape = timeit.timeit(lambda: urllib.request.urlopen(url, timeout=10).read(),
                               number=200) / 200
    finally:
        m.close()
    return {"request_hook_us": request * 1e6, "heartbeat_hook_us": beat * 1e6,
            "scrape_ms": scrape * 1e3, "scrape_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--train", type=float, default=2.0)
    parser.add_argument("--scrape", type=float, default=5.0)
    parser.add_argument("--on", default="a1,a2", help="the nodes with metrics (of a1 a2 b1 b2)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--node", help=argparse.SUPPRESS)
    parser.add_argument("--metrics", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="bench-metrics", help=argparse.SUPPRESS)
    args = parser.parse_args()
    on_nodes = set(args.on.split(","))
    if not on_nodes <= set(NODES[1:]):
        parser.error(f"--on names nodes of {' '.join(NODES[1:])}, not {args.on}")
    if args.child:
        child(args)
        return
    from consul_testing import ConsulAgent

    agent = ConsulAgent().start()
    procs: dict[str, subprocess.Popen] = {}
    stop = threading.Event()
    scrapes = {"ok": 0, "failed": 0}
    try:
        env = {**os.environ, "CONSUL_HTTP_ADDR": agent.address}
        prefix = f"bench-metrics-{os.getpid()}"
        for name in NODES:
            on = name in on_nodes
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "bench.metrics_cost", "--child", "--node", name,
                 "--prefix", prefix, "--rounds", str(args.rounds), "--train", str(args.train),
                 *(["--metrics"] if on else [])], env=env, stdout=subprocess.PIPE, text=True)
            if name == "coord":  # it takes the leader key before anyone else arrives
                client = agent.client()
                deadline = time.monotonic() + 30
                while client.kv_get(f"{prefix}/metrics-cost/round/leader").data is None:
                    if time.monotonic() > deadline:
                        raise SystemExit("the coordinator did not take the leader key")
                    time.sleep(0.05)
        ports = [json.loads(procs[n].stdout.readline())["port"]  # type: ignore[union-attr]
                 for n in NODES if n in on_nodes]

        def scraper() -> None:
            while not stop.wait(args.scrape):
                for port in ports:
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                               timeout=5).read()
                        scrapes["ok"] += 1
                    except OSError:
                        scrapes["failed"] += 1

        threading.Thread(target=scraper, daemon=True).start()
        results = []
        for proc in procs.values():
            out, _ = proc.communicate(timeout=args.rounds * (args.train + 30) + 120)
            results.append(json.loads(out.strip().splitlines()[-1]))
        stop.set()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        agent.close()
    report = {"rounds": args.rounds, "train": args.train, "scrape_every": args.scrape,
              "scrapes": scrapes, "nodes": results, "hooks": hooks()}
    print(json.dumps(report, indent=2))
    with_m = [r for r in results if r["metrics"]]
    without = [r for r in results if not r["metrics"] and r["node"] != "coord"]

    def mean(rows: list[dict], key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    extra = mean(with_m, "cpu") - mean(without, "cpu")
    wall = mean(with_m, "wall")
    print(f"CPU per node over {args.rounds} rounds ({wall:.0f} s): with metrics "
          f"{mean(with_m, 'cpu'):.3f} s, without {mean(without, 'cpu'):.3f} s: "
          f"{extra:+.3f} s = {100 * extra / wall:+.3f}% of one core; Consul requests: with "
          f"{[r['requests'] for r in with_m]}, without {[r['requests'] for r in without]}")


if __name__ == "__main__":
    main()
