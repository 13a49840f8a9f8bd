#!/usr/bin/env python3
"""The installed-wheel smoke test (``make smoke``): consul-rdzv as a user installs it.

In a fresh virtualenv, run from a directory outside the checkout (so nothing of the checkout can
be imported):

1. CPU torch from a local wheel directory, installed FIRST (``pip install --find-links DIR
   torch==X``), so pip never resolves torch from an index; checked to be that local build;
2. the wheel, and nothing else of the checkout; ``pip check``;
3. the imported package is the installed one (site-packages, not editable), with ``py.typed``
   and the example training script; ``consul-rdzv --version`` equals the installed metadata;
4. ``consul-rdzv agent`` starts a Consul dev agent (127.0.0.1, free ports);
5. torch's rendezvous registry builds the ``consul`` handler (the wheel's entry point);
6. a 2-node job with torch's own ``torchrun`` script rendezvouses through that agent and trains
   the packaged example as a module (``-m consul_rdzv.examples.train``): both ranks in a world
   of 2, identical parameters;
7. ``consul-rdzv demo --nodes 2`` (its own dev agent, the script found by path) succeeds.

    python tools/wheel_smoke.py --wheel dist/consul_rdzv-X-py3-none-any.whl \\
        --find-links ../shared/wheels --torch torch==2.13.0 [--consul-bin PATH] [--keep]

Ends with ``smoke: N passed, M failed``; exit 1 on the first failure (its output kept in
the work directory). Standard library only; every wait has a deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

#: Deadlines (seconds): generous for a loaded 2-core machine, never waited out when all is well.
INSTALL_TIMEOUT = 900
AGENT_TIMEOUT = 120
JOB_TIMEOUT = 300


class SmokeFailure(Exception):
    """A step failed; the message says what was expected and what happened."""


class Smoke:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="consul-rdzv-wheel-smoke-"))
        self.venv = self.work / "venv"
        self.bin = self.venv / "bin"
        self.run_dir = self.work / "run"  # the cwd of every command: outside the checkout
        self.run_dir.mkdir()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CONSUL_", "PIP_", "PYTHON", "VIRTUAL_ENV"))}
        env.update({"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1",
                    "OMP_NUM_THREADS": "1"})
        if args.consul_bin:
            env["CONSUL_BIN"] = str(Path(args.consul_bin).resolve())
        self.env = env
        self.agent: subprocess.Popen | None = None
        self.address = ""
        self.passed = 0

    # ------------------------------------------------------------------ helpers

    def run(self, cmd: list[str], *, timeout: float, env: dict | None = None,
            what: str) -> str:
        """Run ``cmd`` in the run directory; its output, or SmokeFailure with it."""
        try:
            proc = subprocess.run(cmd, cwd=self.run_dir, env=env or self.env, timeout=timeout,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True)
        except subprocess.TimeoutExpired as exc:
            raise SmokeFailure(f"{what}: no result within {timeout:.0f}s: {' '.join(cmd)}") \
                from exc
        if proc.returncode != 0:
            raise SmokeFailure(f"{what}: exit {proc.returncode}: {' '.join(cmd)}\n"
                               f"{(proc.stdout + proc.stderr)[-4000:]}")
        return proc.stdout

    def python(self, code: str, *, what: str, timeout: float = 120) -> str:
        return self.run([str(self.bin / "python"), "-c", code], timeout=timeout, what=what)

    def step(self, name: str, func: Callable[[], str]) -> None:
        started = time.monotonic()
        print(f"== {name} ...", flush=True)
        detail = func()
        self.passed += 1
        print(f"   ok in {time.monotonic() - started:.1f}s{': ' + detail if detail else ''}",
              flush=True)

    # ------------------------------------------------------------------ steps

    def install_torch(self) -> str:
        self.run([self.args.python, "-m", "venv", str(self.venv)], timeout=120,
                 what="creating the virtualenv")
        self.run([str(self.bin / "pip"), "install", "-q", "--find-links",
                  str(Path(self.args.find_links).resolve()), self.args.torch],
                 timeout=INSTALL_TIMEOUT, what=f"installing {self.args.torch}")
        version = self.python("import torch; print(torch.__version__)",
                              what="importing torch").strip()
        wanted = self.args.torch.partition("==")[2]
        local = {p.name.split("-")[1] for p in Path(self.args.find_links).glob("torch-*.whl")}
        if version not in local or (wanted and not version.startswith(wanted)):
            raise SmokeFailure(f"torch {version} is installed, not the local build {wanted} "
                               f"from {self.args.find_links} ({sorted(local)}): pip resolved "
                               "torch from an index")
        return f"torch {version} from {self.args.find_links}"

    def install_wheel(self) -> str:
        wheel = Path(self.args.wheel).resolve()
        self.run([str(self.bin / "pip"), "install", "-q", str(wheel)],
                 timeout=INSTALL_TIMEOUT, what=f"installing {wheel.name}")
        self.run([str(self.bin / "pip"), "check"], timeout=120, what="pip check")
        return wheel.name

    def check_installed_package(self) -> str:
        out = self.python(
            "import importlib.metadata as md, importlib.resources as r, json, consul_rdzv, sys\n"
            "d = md.distribution('consul-rdzv')\n"
            "files = r.files('consul_rdzv')\n"
            "print(json.dumps({'file': consul_rdzv.__file__, 'prefix': sys.prefix,\n"
            "  'version': d.version, 'attr': consul_rdzv.__version__,\n"
            "  'direct_url': d.read_text('direct_url.json'),\n"
            "  'py_typed': (files / 'py.typed').is_file(),\n"
            "  'train': (files / 'examples' / 'train.py').is_file(),\n"
            "  'torch_imported': 'torch' in sys.modules,\n"
            "  'handlers': [e.value for e in md.entry_points(group='torchrun.handlers')\n"
            "               if e.name == 'consul']}))",
            what="inspecting the installed package")
        info = json.loads(out)
        site = str(self.venv.resolve())
        if not str(Path(info["file"]).resolve()).startswith(site):
            raise SmokeFailure(f"consul_rdzv was imported from {info['file']}, not from the "
                               f"virtualenv {site}")
        if '"editable": true' in (info["direct_url"] or ""):
            raise SmokeFailure(f"consul-rdzv is installed editable: {info['direct_url']}")
        problems = [what for what, bad in (
            ("no py.typed", not info["py_typed"]),
            ("no examples/train.py", not info["train"]),
            ("importing consul_rdzv imported torch", info["torch_imported"]),
            (f"metadata version {info['version']} != __version__ {info['attr']}",
             info["version"] != info["attr"]),
            (f"torchrun.handlers consul entry point: {info['handlers']}",
             info["handlers"] != ["consul_rdzv.torch:handler_factory"]),
        ) if bad]
        if problems:
            raise SmokeFailure("installed package: " + "; ".join(problems))
        printed = self.run([str(self.bin / "consul-rdzv"), "--version"], timeout=60,
                           what="consul-rdzv --version").strip()
        if printed != f"consul-rdzv {info['version']}":
            raise SmokeFailure(f"consul-rdzv --version printed {printed!r}; the installed "
                               f"metadata says {info['version']}")
        return f"{info['file']}; {printed}"

    def start_agent(self) -> str:
        log = open(self.work / "agent.log", "w")  # noqa: SIM115 - closed with the process
        self.agent = subprocess.Popen([str(self.bin / "consul-rdzv"), "agent"], cwd=self.run_dir,
                                      env=self.env, stdout=subprocess.PIPE, stderr=log,
                                      stdin=subprocess.DEVNULL)
        assert self.agent.stdout is not None
        fd = self.agent.stdout.fileno()  # read unbuffered: select() sees only the pipe
        deadline = time.monotonic() + AGENT_TIMEOUT
        output = b""
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while not self.address:
                left = deadline - time.monotonic()
                if left <= 0 or self.agent.poll() is not None:
                    raise SmokeFailure(f"consul-rdzv agent printed no address within "
                                       f"{AGENT_TIMEOUT}s (exit {self.agent.poll()}): "
                                       f"{output.decode(errors='replace')!r}; log: "
                                       f"{self.work / 'agent.log'}")
                if sel.select(timeout=min(left, 1.0)):
                    output += os.read(fd, 4096)
                    for line in output.decode(errors="replace").split("\n")[:-1]:  # whole
                        if line.startswith("export CONSUL_HTTP_ADDR="):
                            self.address = line.strip().partition("=")[2]
        return f"dev agent at {self.address}"

    def registry_builds_handler(self) -> str:
        out = self.python(
            "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
            "from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler\n"
            f"p = RendezvousParameters(backend='consul', endpoint={self.address!r},\n"
            "    run_id='smoke-registry', min_nodes=1, max_nodes=1, node_id='smoke-registry')\n"
            "h = get_rendezvous_handler(p)\n"
            "print(type(h).__module__, type(h).__name__, h.get_backend(), h.get_run_id())\n"
            "h.shutdown()", what="torch's registry building the consul handler")
        words = out.split()
        if words[:1] != ["consul_rdzv.torch"] or words[2:] != ["consul", "smoke-registry"]:
            raise SmokeFailure(f"torch's registry built {out.strip()!r}, not consul_rdzv.torch's "
                               "handler of backend consul")
        return " ".join(words[:3])

    def torchrun_job(self) -> str:
        run_id = f"smoke-{uuid.uuid4().hex[:8]}"
        out = self.work / "job"
        out.mkdir()
        procs = []
        for i in range(2):
            cmd = [str(self.bin / "torchrun"), "--nnodes=2", "--nproc-per-node=1",
                   "--rdzv-backend=consul", f"--rdzv-endpoint={self.address}",
                   f"--rdzv-id={run_id}", "--local-addr=127.0.0.1",
                   f"--rdzv-conf=node_id=smoke-{i}", "-m", "consul_rdzv.examples.train",
                   "--steps", "20", "--out", str(out)]
            log = open(self.work / f"torchrun-{i}.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(cmd, cwd=self.run_dir, env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True), log))
        deadline = time.monotonic() + JOB_TIMEOUT
        codes = []
        for proc, log in procs:
            try:
                codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
            finally:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                log.close()
        results = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
        worlds = sorted((r["rank"], r["world_size"]) for r in results)
        checksums = {r["checksum"] for r in results}
        if codes != [0, 0] or worlds != [(0, 2), (1, 2)] or len(checksums) != 1:
            logs = "\n".join(f"--- torchrun-{i}.log\n"
                             + (self.work / f"torchrun-{i}.log").read_text()[-3000:]
                             for i in range(2))
            raise SmokeFailure(f"2-node torchrun job {run_id}: exit codes {codes} (None: killed "
                               f"after {JOB_TIMEOUT}s), ranks/worlds {worlds}, checksums "
                               f"{sorted(checksums)}\n{logs}")
        return f"run {run_id}: ranks 0,1 in a world of 2, identical parameters"

    def demo(self) -> str:
        out = self.run([str(self.bin / "consul-rdzv"), "demo", "--nodes", "2", "--steps", "20",
                        "--timeout", str(JOB_TIMEOUT)], timeout=JOB_TIMEOUT + 60,
                       what="consul-rdzv demo --nodes 2")
        if "parameters identical on all ranks: yes" not in out:
            raise SmokeFailure(f"consul-rdzv demo did not report identical parameters:\n{out}")
        return next((line for line in out.splitlines() if "ranks finished" in line), "")

    def stop_agent(self) -> None:
        if self.agent and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)  # it stops its Consul and exits
            try:
                self.agent.wait(60)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", required=True, help="the wheel to install")
    parser.add_argument("--find-links", required=True,
                        help="directory holding the CPU torch wheel")
    parser.add_argument("--torch", default="torch==2.13.0", help="torch requirement, pinned")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter of the virtualenv (must match the torch wheel)")
    parser.add_argument("--consul-bin", default=os.environ.get("CONSUL_BIN"),
                        help="Consul binary for the dev agents (default: CONSUL_BIN, else what "
                             "consul_rdzv.testing finds)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    smoke = Smoke(args)
    started = time.monotonic()
    print(f"wheel smoke in {smoke.work}", flush=True)
    steps = [
        ("fresh virtualenv, CPU torch from the local wheel first", smoke.install_torch),
        ("the wheel, nothing of the checkout", smoke.install_wheel),
        ("the installed package, consul-rdzv --version", smoke.check_installed_package),
        ("consul-rdzv agent", smoke.start_agent),
        ("torch's registry builds the consul handler", smoke.registry_builds_handler),
        ("2-node torchrun job on the packaged example", smoke.torchrun_job),
        ("consul-rdzv demo --nodes 2", smoke.demo),
    ]
    failed = 0
    try:
        for name, func in steps:
            smoke.step(name, func)
    except SmokeFailure as exc:
        failed = 1
        print(f"   FAILED: {exc}", flush=True)
    finally:
        smoke.stop_agent()
    took = time.monotonic() - started
    if failed or args.keep:
        print(f"work directory kept: {smoke.work}")
    else:
        shutil.rmtree(smoke.work, ignore_errors=True)
    print(f"wheel smoke took {took:.0f}s")
    print(f"smoke: {smoke.passed} passed, {failed} failed")
    return 1 if failed or smoke.passed != len(steps) else 0


if __name__ == "__main__":
    raise SystemExit(main())
