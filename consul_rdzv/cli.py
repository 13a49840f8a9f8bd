"""``consul-rdzv``: inspect and close runs, run a local dev agent, run the demo job.

    consul-rdzv status RUN_ID [--key-prefix P]     the current round, members and leader
    consul-rdzv close RUN_ID [--reason TEXT]        close a run (every joiner gets an error)
    consul-rdzv agent                               a local Consul dev agent until Ctrl-C
    consul-rdzv demo [--nodes 3] [--steps 200]      a real 3-node torchrun job on this machine

The Consul address comes from ``--address`` or the usual ``CONSUL_*`` environment variables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .client import ConsulClient
from .config import ConsulConfig
from .errors import ConsulError, RendezvousError
from .layout import Keys, RunState
from .rendezvous import ConsulRendezvous, active_participants
from .settings import RendezvousSettings

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _client(args: argparse.Namespace) -> ConsulClient:
    return ConsulClient(ConsulConfig.resolve(address=args.address), retry_timeout=5.0)


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    keys = Keys(f"{args.key_prefix}/{args.run_id}")
    state = RunState.parse(keys, client.kv_list(keys.prefix + "/").data)
    current = state.round
    if args.json:
        print(json.dumps({
            "run_id": args.run_id,
            "leader": state.leader.node if state.leader else None,
            "round": current.round if current else None,
            "ranks": current.ranks if current else [],
            "store": current.store if current else None,
            "closed": current.closed if current else None,
            "members": sorted(state.members),
        }, indent=2))
        return 0
    print(f"run {args.run_id} (prefix {keys.prefix}) on {client.config.url}")
    print(f"  coordinator: {state.leader.node if state.leader else '-'}")
    if current and current.closed:
        print(f"  CLOSED by {current.closed.get('by')}: {current.closed.get('reason')}")
    if current and current.ranks:
        store = current.store or {}
        print(f"  round {current.round}: world size {current.world_size}, "
              f"trainer store {store.get('host')}:{store.get('port')}")
        active = set(active_participants(state))
        print(f"  {'rank':>4}  {'node':<40} {'host':<24} state")
        for rank, node in enumerate(current.ranks):
            host = current.hosts[rank] if rank < len(current.hosts) else ""
            st = "active" if node in active else ("gone" if node not in state.members
                                                  else "rejoining")
            print(f"  {rank:>4}  {node:<40} {host:<24} {st}")
    else:
        print("  no round sealed yet")
    waiting = sorted(n for n in state.members if not current or n not in current.ranks)
    if waiting:
        print(f"  waiting: {', '.join(waiting)}")
    return 0


def cmd_close(args: argparse.Namespace) -> int:
    settings = RendezvousSettings(run_id=args.run_id, key_prefix=args.key_prefix)
    ConsulRendezvous(settings, _client(args), node_id="consul-rdzv-cli").close(args.reason)
    print(f"run {args.run_id} closed")
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from .testing import ConsulAgent

    with ConsulAgent() as agent:
        print(f"Consul dev agent at {agent.url} (UI: {agent.url}/ui); Ctrl-C stops it.")
        print(f"export CONSUL_HTTP_ADDR={agent.address}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    script = EXAMPLES / "train.py"
    if not script.is_file():
        print(f"error: the demo needs {script} (run it from a source checkout).", file=sys.stderr)
        return 2
    agent = None
    if not os.environ.get("CONSUL_HTTP_ADDR"):
        from .testing import ConsulAgent

        agent = ConsulAgent().start()
        print(f"Started a local Consul dev agent at {agent.url} (CONSUL_HTTP_ADDR was unset).")
    try:
        env = {**os.environ, **(agent.env() if agent else {})}
        url = ConsulConfig.resolve(env=env).url
        run_id = f"demo-{int(time.time())}"
        out = tempfile.mkdtemp(prefix="consul-rdzv-demo-")
        print(f"Consul UI: {url}/ui/dc1/services/torchelastic-{run_id}/instances")
        print(f"Running a {args.nodes}-node torchrun job (run id {run_id}) with {script.name} ...",
              flush=True)
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        procs = []
        started = time.monotonic()
        for i in range(args.nodes):
            cmd = [*torchrun, f"--nnodes={args.nodes}", "--nproc-per-node=1",
                   "--rdzv-backend=consul", f"--rdzv-id={run_id}",
                   f"--rdzv-endpoint={url}", "--local-addr=127.0.0.1",
                   f"--rdzv-conf=node_id=demo-node-{i}",
                   str(script), "--steps", str(args.steps), "--out", out]
            log = open(Path(out) / f"agent-{i}.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT),
                          log))
        failed = 0
        for i, (proc, log) in enumerate(procs):
            try:
                proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
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
        return 0 if failed == 0 and agree else 1
    finally:
        if agent:
            agent.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="consul-rdzv", description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="Consul address (default: CONSUL_HTTP_ADDR)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("status", help="show a run's round, members and coordinator")
    p.add_argument("run_id")
    p.add_argument("--key-prefix", default="torchelastic")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("close", help="close a run")
    p.add_argument("run_id")
    p.add_argument("--key-prefix", default="torchelastic")
    p.add_argument("--reason", default="closed with consul-rdzv close")
    p.set_defaults(func=cmd_close)
    p = sub.add_parser("agent", help="run a local Consul dev agent on a free port")
    p.set_defaults(func=cmd_agent)
    p = sub.add_parser("demo", help="run a real torchrun job with the consul backend")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConsulError, RendezvousError, ValueError) as exc:
        print(f"consul-rdzv {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
