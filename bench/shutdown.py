"""What a SIGTERM to a training torchrun agent costs: the figures behind a pod's grace period
(docs/kubernetes.md, "Grace period").

    python -m bench.shutdown                      # 5 repeats of each case below
    python -m bench.shutdown --repeats 10 --cases default,stubborn

Three real torchrun agents (1 worker each, ``examples/train.py``, ``--nnodes=2:3``,
``--max-restarts=3``) train against a Consul dev agent on 127.0.0.1; one agent gets SIGTERM
(as the kubelet sends it to a container's main process) and the bench polls, every 20 ms, until
its workers are gone (``/proc``), its node is gone from Consul (member key and service), and
torchrun has exited. Cases:

* ``default``: the workers exit on SIGTERM (Python's default), ``--shutdown-timeout=30``;
* ``stubborn``: the workers ignore SIGTERM (``--sigterm-delay 3600``), ``--shutdown-timeout=5``:
  torchrun SIGKILLs them after 5 s.

Prints one JSON line per run, then min-max per case, in seconds from the signal.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from consul_rdzv.testing import ConsulAgent

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the torchrun job helper of the end-to-end tests
from torchrun_jobs import TorchrunJob  # noqa: E402

CASES = {
    "default": {"sigterm_delay": None, "shutdown_timeout": 30},
    "stubborn": {"sigterm_delay": 3600, "shutdown_timeout": 5},
}
PREFIX = "bench-shutdown"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _node_present(agent: ConsulAgent, run_id: str, node_id: str) -> bool:
    client = agent.client()
    try:
        keys = client.kv_keys(f"{PREFIX}/{run_id}/members/")
        services = client.agent_services()
    finally:
        client.close()
    return (any(k.endswith(f"/members/{node_id}") for k in keys)
            or f"{run_id}-{node_id}" in services)


def run_once(agent: ConsulAgent, workdir: Path, *, sigterm_delay: float | None,
             shutdown_timeout: int) -> dict:
    run_id = f"sd-{uuid.uuid4().hex[:8]}"
    train = ["--steps", "100000", "--step-time", "0.05"]
    if sigterm_delay is not None:
        train += ["--sigterm-delay", str(sigterm_delay)]
    conf = {"key_prefix": PREFIX, "heartbeat_timeout": 30, "last_call_timeout": 1}
    with TorchrunJob(workdir, agent.address, run_id, nnodes="2:3", rdzv_conf=conf,
                     train_args=train, max_restarts=3,
                     env={"PET_SHUTDOWN_TIMEOUT": str(shutdown_timeout)}) as job:
        for i in range(3):
            job.start(f"node-{i}")
        job.wait_for(lambda: len(job.starts(world_size=3)) == 3
                     and any(e["event"] == "step" and e["step"] >= 5 for e in job.progress()),
                     180, "three agents training")
        victim = job.agents[1]
        workers = {e["pid"] for e in job.starts(world_size=3) if e["agent_pid"] == victim.pid}
        assert workers, job.report()
        took: dict[str, float] = {}
        signalled = time.monotonic()
        victim.signal(signal.SIGTERM)
        while len(took) < 3 and time.monotonic() - signalled < shutdown_timeout + 60:
            now = time.monotonic() - signalled
            if "workers_gone" not in took and not any(_alive(p) for p in workers):
                took["workers_gone"] = now
            if "node_gone" not in took and not _node_present(agent, run_id, victim.name):
                took["node_gone"] = now
            if "agent_exit" not in took and not victim.alive():
                took["agent_exit"] = now
            time.sleep(0.02)
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {sorted(CASES)}")
    rows: dict[str, list[dict]] = {c: [] for c in cases}
    with ConsulAgent() as agent, tempfile.TemporaryDirectory(prefix="bench-shutdown-") as tmp:
        for case in cases:
            for i in range(args.repeats):
                took = run_once(agent, Path(tmp) / f"{case}-{i}", **CASES[case])
                rows[case].append(took)
                print(json.dumps({"case": case, **CASES[case], **took}), flush=True)
    for case, runs in rows.items():
        parts = []
        for key in ("workers_gone", "node_gone", "agent_exit"):
            values = [r[key] for r in runs if key in r]
            parts.append(f"{key} {min(values):.3f}-{max(values):.3f}s" if values
                         else f"{key} never")
        print(f"{case} ({CASES[case]}): " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
