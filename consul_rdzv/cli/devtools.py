"""The developer tools of ``consul-rdzv``: ``agent`` (a Consul dev agent until Ctrl-C) and
``demo`` (a real torchrun job on this machine). Not part of the stable interface
(docs/compatibility.md)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..config import ConsulConfig
from ..service import DEFAULT_KEY_PREFIX, service_name
from .text import CliError, UsageError


def _agent_listen(args: argparse.Namespace) -> tuple[str, int]:
    """Where ``agent`` listens: ``--bind``/``--port``, or ``--address HOST:PORT`` (an explicit
    option only, never CONSUL_HTTP_ADDR: that names an agent to use, not one to start)."""
    import ipaddress

    host, port = args.bind, args.port
    if args.address:
        if args.bind or args.port:
            raise UsageError("give either --address HOST:PORT or --bind/--port, not both")
        from ..config import normalize_address

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
    from ..testing import WILDCARD_HOSTS, ConsulAgent

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
        from ..testing import ConsulAgent

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


