"""Real ``torchrun`` jobs for the end-to-end tests (no pytest in here, so it can be reused).

:class:`TorchrunJob` starts torchrun agents (``python -m torch.distributed.run``) running
the demo's training script (``consul_rdzv/examples/train.py``, package data of the
installed package), each in its own session (so one agent and its workers can be SIGKILLed as
a group), with stdout+stderr in a log file per agent and ``LOGLEVEL=INFO``. It reads back what
the training script wrote (``rank-N.json`` results and a shared JSON-lines progress file), and
:meth:`TorchrunJob.report` gathers every agent's log for an assertion message. Use it as a
context manager: every process it started is killed on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.resources
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rdzv_nodes import wait_for

#: The training script, found as ``consul-rdzv demo`` finds it: in the installed package.
TRAIN = Path(str(importlib.resources.files("consul_rdzv") / "examples" / "train.py"))
#: torchrun with a lowered exit-barrier timeout (``exit_barrier=`` below) or a start gate
LAUNCHER = Path(__file__).resolve().parent / "torchrun_launcher.py"

#: torch's log line prefix: ``I1203 04:51:24.873000 13557 torch/...py:553] ...``
_TORCH_LOG = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) \d+ ")


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen
    log_path: Path
    started: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the agent and its workers (its whole process group), no goodbye."""
        self.signal(signal.SIGKILL, group=True)

    def signal(self, sig: int, *, group: bool = False) -> None:
        """Send ``sig`` to the agent, or to its whole process group (agent and workers, as a
        Ctrl-C in a terminal does)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                os.kill(self.proc.pid, sig)


class TorchrunJob:
    def __init__(self, workdir: Path, endpoint: str, run_id: str, *, nnodes: str,
                 rdzv_conf: dict | None = None, train_args: list[str] | None = None,
                 max_restarts: int = 0, env: dict | None = None,
                 exit_barrier: float | None = None) -> None:
        self.workdir = Path(workdir)
        self.out = self.workdir / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.progress_path = self.workdir / "progress.jsonl"
        self.endpoint = endpoint
        self.run_id = run_id
        self.nnodes = nnodes
        self.rdzv_conf = dict(rdzv_conf or {})
        self.train_args = list(train_args or [])
        self.max_restarts = max_restarts
        env = {**os.environ, "LOGLEVEL": "INFO", "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": "1", **(env or {})}
        # torch's agent waits up to 300 s at its exit barrier; tests of a node that finishes
        # long before the others lower it (tests/torchrun_launcher.py)
        self.launcher = ([str(LAUNCHER)] if exit_barrier is not None
                         else ["-m", "torch.distributed.run"])
        if exit_barrier is not None:
            env["CONSUL_RDZV_TEST_EXIT_BARRIER"] = str(exit_barrier)
        self.env = {k: v for k, v in env.items() if v is not None}  # None: unset it
        self.agents: list[Agent] = []

    # ------------------------------------------------------------------ processes

    def command(self, node_id: str, *, launcher: list[str] | None = None, **conf) -> list[str]:
        values = {**self.rdzv_conf, "node_id": node_id, **conf}
        rdzv_conf = ",".join(f"{k}={v}" for k, v in values.items())
        return [
            sys.executable, *(launcher or self.launcher),
            f"--nnodes={self.nnodes}", "--nproc-per-node=1",
            "--rdzv-backend=consul", f"--rdzv-id={self.run_id}",
            f"--rdzv-endpoint={self.endpoint}", "--local-addr=127.0.0.1",
            f"--rdzv-conf={rdzv_conf}", "--monitor-interval=0.1",
            f"--max-restarts={self.max_restarts}",
            str(TRAIN), "--out", str(self.out), "--progress-file", str(self.progress_path),
            *self.train_args,
        ]

    def start(self, node_id: str, *, gated: bool = False, **conf) -> Agent:
        """Start the agent of ``node_id``; ``gated``: it imports torch, then waits for
        :meth:`open_gate` before it runs (tests/torchrun_launcher.py)."""
        log_path = self.workdir / f"agent-{node_id}.log"
        env, launcher = self.env, None
        if gated:
            env = {**self.env, "CONSUL_RDZV_TEST_START_GATE": str(self._gate(node_id))}
            launcher = [str(LAUNCHER)]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(self.command(node_id, launcher=launcher, **conf), env=env,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.workdir,
                                    start_new_session=True)
        agent = Agent(node_id, proc, log_path)
        self.agents.append(agent)
        return agent

    def _gate(self, node_id: str) -> Path:
        return self.workdir / f"gate-{node_id}"

    def open_gate(self, agent: Agent) -> None:
        """Let a gated agent run."""
        self._gate(agent.name).touch()

    def wait(self, timeout: float, agents: list[Agent] | None = None) -> dict[str, int | None]:
        """Wait until the agents exit or ``timeout`` passes; exit codes (None: still running)."""
        agents = self.agents if agents is None else agents
        deadline = time.monotonic() + timeout
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(max(0.0, deadline - time.monotonic()))
        return {a.name: a.proc.poll() for a in agents}

    def kill_all(self) -> None:
        """SIGKILL every agent with its group, then every worker of this job still running:
        torchrun starts each worker in a session of its own, which an agent's death leaves
        running (one that ignores SIGTERM and trains on with its peers outlived the test run)."""
        for agent in self.agents:
            agent.kill()
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.proc.wait(10)
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def worker_pids(self) -> list[int]:
        """The running processes started with this job's progress file (its workers: the
        path is this job's own)."""
        wanted = os.fsencode(str(self.progress_path))
        pids = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                    argv = fh.read().split(b"\0")
            except OSError:
                continue
            if wanted in argv and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
        return pids

    def __enter__(self) -> TorchrunJob:
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

    # ------------------------------------------------------------------ what the job wrote

    def results(self) -> list[dict]:
        rows = [json.loads(p.read_text()) for p in sorted(self.out.glob("rank-*.json"))]
        return sorted(rows, key=lambda r: r["rank"])

    def progress(self) -> list[dict]:
        try:
            lines = self.progress_path.read_text().splitlines()
        except OSError:
            return []
        events = []
        for line in lines:
            with contextlib.suppress(ValueError):  # a line being written right now
                events.append(json.loads(line))
        return events

    def starts(self, world_size: int | None = None) -> list[dict]:
        """The 'start' events (a worker past DDP's first broadcast), optionally of one world."""
        return [e for e in self.progress() if e["event"] == "start"
                and (world_size is None or e["world_size"] == world_size)]

    def wait_for(self, predicate, timeout: float, what: str) -> object:
        """:func:`rdzv_nodes.wait_for` every 0.1 s; on timeout it fails with every agent's
        log."""
        return wait_for(predicate, timeout, what, 0.1, detail=self.report)

    def report(self, tail: int = 6000) -> str:
        parts = []
        for agent in self.agents:
            code = agent.proc.poll()
            parts.append(f"===== agent {agent.name} (pid {agent.pid}, exit "
                         f"{'running' if code is None else code}) =====\n{agent.log()[-tail:]}")
        events = self.progress()
        parts.append(f"===== progress ({len(events)} events; starts and last 5) =====\n"
                     + "\n".join(json.dumps(e) for e in
                                 [e for e in events if e["event"] == "start"] + events[-5:]))
        parts.append(f"===== results =====\n{json.dumps(self.results(), indent=1)}")
        return "\n".join(parts)


def torch_log_times(text: str, needle: str) -> list[float]:
    """Epoch times of torch log lines (``LOGLEVEL=INFO`` format) that contain ``needle``."""
    now = datetime.datetime.now()
    times = []
    for line in text.splitlines():
        m = _TORCH_LOG.match(line)
        if not m or needle not in line:
            continue
        stamp = datetime.datetime.strptime(f"{now.year}{m.group(1)} {m.group(2)}",
                                           "%Y%m%d %H:%M:%S.%f")
        if stamp > now + datetime.timedelta(days=1):  # logged in December, read in January
            stamp = stamp.replace(year=now.year - 1)
        times.append(stamp.timestamp())
    return times
