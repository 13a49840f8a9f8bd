"""Flatness over many back-to-back rounds: ``python -m bench.soak --rounds R --nodes N``.

N nodes, each a handler from torch's registry (the path torchrun takes), as threads of this
process, all on one ``consul agent -dev`` (``--cluster``: a ConsulCluster of 3 servers and 2
client agents, nodes alternating between them), default settings (only ``key_prefix`` and
``node_id`` set). Round after round every node calls ``next_rendezvous()`` at once (a pool of N
threads, the same threads every round) and the rounds are checked (ranks 0..N-1, one round
number, one trainer store). After the first round and every ``--every`` rounds, after a 1 s
pause (so that the round's deferred service-meta publishes are done), it records this
process's threads, open fds and RSS (from /proc), the requests Consul served per node and round
since the last sample (``consul_api_http_count``, check passes apart, the sampler's own
requests subtracted), the run's keys, sessions and service instances in Consul, the agent's RSS
and goroutines, and the median round time. Then every node ``shutdown()``s as torch calls it
when a job succeeded, and what stays in Consul is recorded. The nodes log warnings only
(``LOGLEVEL=INFO`` for a line per node and round).

Flat means: threads no higher at the last sample than at the first, fds too except the nodes'
connections to Consul, which stay within their keep-alive pools (``pool_size`` per node: a
pool opens a connection when its node's threads first need one more at once), RSS growth after
the first interval under 20 MB (also reported per 1,000 rounds), keys = N members + leader +
round and sessions = N at every sample, requests per node and round no higher in the later
half of the run than in the earlier half (+0.5), and after the shutdown nothing but the closed
marker under its retention session.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.measure import CHECK_PASS, ConsulView, fd_kinds, fds_flat, machine, proc_stats

#: Pause before a sample: the round's service-meta publishes (0.5 s + 20 ms per member) are done.
SETTLE = 1.0
#: Largest RSS growth (MB) over the run that still counts as bounded.
RSS_BOUND_MB = 20.0


def check_round(infos, n: int) -> str | None:
    ranks = sorted(i.rank for i in infos)
    worlds = {i.world_size for i in infos}
    rounds = {i.result.round for i in infos}
    stores = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
              for i in infos}
    if ranks != list(range(n)) or worlds != {n} or len(stores) != 1 or len(rounds) != 1:
        return f"ranks {ranks}, worlds {worlds}, rounds {rounds}, stores {stores}"
    return None


def run_flat(opts) -> int:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from bench.run import product_version, raise_nofile
    from bench.servers import (
        ClusterServer,
        ConsulServer,
        loopback_hosts_file,
        use_hosts_file,
    )

    raise_nofile()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = Path(opts.workdir or f"/tmp/consul-rdzv-flat-{stamp}")
    workdir.mkdir(parents=True, exist_ok=True)
    if opts.loopback_hosts:  # while this process is single-threaded (bench/servers.py)
        use_hosts_file(str(loopback_hosts_file(workdir)))
    # One INFO line per node and round would bury the samples: warnings only, unless asked.
    os.environ.setdefault("LOGLEVEL", "WARNING")
    n, rounds, every = opts.nodes, opts.rounds, opts.every
    out_path = Path(opts.out or workdir / "flat.json")
    key_prefix, run_id = f"flat-{stamp}", f"flat-{uuid.uuid4().hex[:6]}"
    meta = {"command": " ".join(["python -m bench.soak", *sys.argv[1:]]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(), "product": product_version(), "nodes": n, "rounds": rounds,
            "every": every, "cluster": bool(opts.cluster), "run_id": run_id,
            "loopback_hosts": bool(opts.loopback_hosts),
            "key_prefix": key_prefix}
    server = ClusterServer(servers=3, clients=2) if opts.cluster else ConsulServer()
    samples: list[dict] = []
    violations: list[str] = []
    handlers = []
    result: dict = {"meta": meta, "samples": samples}
    code = 1
    try:
        server.start()
        if opts.cluster:
            members = server.cluster.clients
            views = [ConsulView(m.url, m.management_token) for m in members]
            agent_pids = [m.proc.pid for m in members]
            s0 = server.cluster.servers[0]
            state = ConsulView(s0.url, s0.management_token)
        else:
            views = [ConsulView(server.agent.url)]
            agent_pids = [server.pid]
            state = views[0]
        endpoints = [v.url.split("://", 1)[1] for v in views]
        consul_ports = {int(e.rsplit(":", 1)[1]) for e in endpoints}

        def make(i: int):
            return get_rendezvous_handler(RendezvousParameters(
                backend="consul", endpoint=endpoints[i % len(endpoints)], run_id=run_id,
                min_nodes=n, max_nodes=n, local_addr="127.0.0.1", key_prefix=key_prefix,
                node_id=f"flat-n{i:03d}"))

        def counts() -> tuple[dict[str, float], dict[str, int]]:
            total: dict[str, float] = {}
            for view in views:
                for key, value in view.metrics()["counts"].items():
                    total[key] = total.get(key, 0.0) + value
            own: dict[str, int] = {}
            for view in views:
                for key, value in view.sent.items():
                    own[key] = own.get(key, 0) + value
            return total, own

        last = {"round": 0, "time": time.monotonic(), "counts": None}
        times: list[float] = []

        def sample(done: int) -> None:
            time.sleep(SETTLE)
            now = time.monotonic()
            total, own = counts()
            entry: dict = {"round": done, **(proc_stats(os.getpid()) or {}),
                           "fd_kinds": fd_kinds(os.getpid(), consul_ports)}
            if last["counts"] is not None:
                before, own_before = last["counts"]
                delta = {k: v - before.get(k, 0.0) - (own.get(k, 0) - own_before.get(k, 0))
                         for k, v in total.items()}
                delta = {k: v for k, v in delta.items() if v > 0}
                passes = delta.get(CHECK_PASS, 0.0)
                per = max(1, done - last["round"]) * n
                entry["requests_per_node_round"] = round((sum(delta.values()) - passes) / per,
                                                         2)
                entry["check_passes_per_node_s"] = round(passes / n / (now - last["time"]), 3)
                entry["by_path_per_node_round"] = {k: round(v / per, 3)
                                                   for k, v in sorted(delta.items())
                                                   if k != CHECK_PASS}
            if times:
                entry["round_s_median"] = round(statistics.median(times), 4)
                entry["round_s_max"] = round(max(times), 4)
            times.clear()
            sessions = state.sessions()
            run = state.run_state(key_prefix, run_id, sessions)
            run.pop("key_names")
            entry.update(run)
            entry["agent_rss_mb"] = [(proc_stats(p) or {}).get("rss_mb") for p in agent_pids]
            entry["agent_goroutines"] = [v.metrics()["goroutines"] for v in views]
            samples.append(entry)
            _, own = counts()  # the metrics reads themselves are not counted by Consul
            last.update(round=done, time=time.monotonic(), counts=(total, own))
            print(f"round {done}: threads {entry.get('threads')} fds {entry.get('fds')} "
                  f"{entry.get('fd_kinds')} rss "
                  f"{entry.get('rss_mb')}MB req/node/round "
                  f"{entry.get('requests_per_node_round', '-')} keys {entry['keys']} sessions "
                  f"{entry['sessions']} services {entry['services']} agent rss "
                  f"{entry['agent_rss_mb']}MB goroutines {entry['agent_goroutines']} round "
                  f"{entry.get('round_s_median', '-')}s", flush=True)

        print(f"flat: {rounds} rounds of {n} nodes on "
              f"{'a cluster' if opts.cluster else 'one dev agent'}; JSON {out_path}", flush=True)
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="node") as pool:
            handlers = list(pool.map(make, range(n)))
            started = time.monotonic()
            for r in range(1, rounds + 1):
                t0 = time.monotonic()
                infos = list(pool.map(lambda h: h.next_rendezvous(), handlers, timeout=300))
                times.append(time.monotonic() - t0)
                bad = check_round(infos, n)
                if bad:
                    violations.append(f"round {r}: {bad}")
                del infos
                if r == 1 or r % every == 0 or r == rounds:
                    sample(r)
            meta["seconds"] = round(time.monotonic() - started, 1)
            left = list(pool.map(lambda h: h.shutdown(), handlers))
        handlers = []
        time.sleep(SETTLE)
        final = state.run_state(key_prefix, run_id, state.sessions())
        result.update(after_end=final, shutdown=left, violations=violations)
        first, last_s = samples[0], samples[-1]
        warm = samples[1] if len(samples) > 2 else first
        growth = last_s["rss_mb"] - warm["rss_mb"]
        per_round = [s["requests_per_node_round"] for s in samples
                     if "requests_per_node_round" in s]
        flat_checks = [
            (not violations, f"{rounds} rounds, every round ranks 0..{n - 1}, one world, one "
                             f"round number, one store ({len(violations)} violations)"),
            (last_s["threads"] <= first["threads"],
             f"threads {first['threads']} (round 1) -> {last_s['threads']} (round {rounds}), "
             f"max {max(s['threads'] for s in samples)}"),
            fds_flat(samples, n),
            (growth < RSS_BOUND_MB,
             f"RSS {first['rss_mb']} MB (round 1), {warm['rss_mb']} MB (round "
             f"{warm['round']}) -> {last_s['rss_mb']} MB (round {rounds}): "
             f"{growth:+.1f} MB after warm-up, {1000 * growth / max(1, rounds - warm['round']):.1f}"
             f" MB per 1,000 rounds"),
            (max(s["keys"] for s in samples) <= n + 2 and max(s["sessions"] for s in samples) <= n,
             f"keys {sorted({s['keys'] for s in samples})} (N + 2 = {n + 2}), sessions "
             f"{sorted({s['sessions'] for s in samples})} (N = {n}), services "
             f"{sorted({s['services'] for s in samples})}"),
            # what an ended run keeps on purpose, each under one session of a TTL: the closed
            # marker (closed_retention) and the round history (history_retention)
            (final["keys"] <= 1 and final["services"] == 0
             and final["sessions_ended"] <= 1 and final["sessions_history"] <= 1
             and final["sessions"] == final["sessions_ended"] + final["sessions_history"],
             f"after shutdown: keys {final['key_names']}, services {final['services']}, "
             f"sessions {final['sessions']} (closed marker's {final['sessions_ended']}, "
             f"round history's {final['sessions_history']})"),
        ]
        if per_round:
            # No growth: the later half of the intervals asks no more than the earlier half.
            half = (len(per_round) + 1) // 2
            flat_checks.append((max(per_round[half:] or [0]) <= max(per_round[:half]) + 0.5,
                                f"requests per node and round (check passes apart): "
                                f"{min(per_round)}-{max(per_round)}, first {per_round[0]}, last "
                                f"{per_round[-1]}"))
        result["checks"] = [{"ok": ok, "what": what} for ok, what in flat_checks]
        print(f"\n{rounds} rounds in {meta['seconds']}s", flush=True)
        print("| round | threads | fds | of which to Consul | RSS MB | req/node/round | keys | "
              "sessions | services | agent RSS MB | goroutines | round s (median) |", flush=True)
        print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        for s in samples:
            print(f"| {s['round']} | {s['threads']} | {s['fds']} | "
                  f"{(s.get('fd_kinds') or {}).get('consul', '')} | {s['rss_mb']} | "
                  f"{s.get('requests_per_node_round', '')} | {s['keys']} | {s['sessions']} | "
                  f"{s['services']} | {'/'.join(str(x) for x in s['agent_rss_mb'])} | "
                  f"{'/'.join(f'{x:.0f}' for x in s['agent_goroutines'])} | "
                  f"{s.get('round_s_median', '')} |", flush=True)
        print("\nchecks:", flush=True)
        for ok, what in flat_checks:
            print(f"- {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        code = 0 if all(ok for ok, _ in flat_checks) else 1
    finally:
        for handler in handlers:  # an interrupted run: leave, do not close
            with contextlib.suppress(Exception):
                handler.rendezvous.leave(timeout=5)
        try:
            server.stop(keep_log=str(workdir / "consul.log"))
        finally:
            out_path.write_text(json.dumps(result, indent=1, default=str))
            print(f"\nJSON: {out_path}", flush=True)
    return code
