"""The Consul binary and a local dev agent: what ``consul-rdzv agent`` and ``demo`` run.

:func:`consul_binary` finds the binary: ``CONSUL_BIN``; a previous build in the cache; ``consul``
on PATH if it is v1.14 or newer; else it is built from ``tools/consul`` with Go (a source
checkout). :class:`ConsulAgent` starts ``consul agent -dev`` on 127.0.0.1 with every port chosen
free (DNS, gRPC and WAN off), waits until it has a leader and its node is in the catalog, and
stops it by process group. Nothing here needs root.

The test harness (``consul_testing/`` in a source checkout, not installed) builds on these: agents
with ACLs or TLS and failure injection, and multi-member clusters with network partitions.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import BinaryIO

from .client import ConsulClient
from .config import ConsulConfig
from .errors import ConsulError

CONSUL_VERSION = "1.14.5"
_REPO_TOOLS = Path(__file__).resolve().parent.parent / "tools" / "consul"


class ConsulBinaryError(RuntimeError):
    """No usable Consul binary, and none could be built."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "consul-rdzv"


def _version_of(binary: str) -> tuple[int, int, int] | None:
    try:
        out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Consul v(\d+)\.(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def consul_binary(*, build: bool = True, quiet: bool = False) -> str:
    """Return the path of a Consul >= 1.14 binary, building v1.14.5 from source if need be."""
    explicit = os.environ.get("CONSUL_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ConsulBinaryError(f"CONSUL_BIN={explicit!r} is not an executable file.")
        return explicit
    cached = cache_dir() / "bin" / f"consul-{CONSUL_VERSION}"
    if os.access(cached, os.X_OK):
        return str(cached)
    on_path = shutil.which("consul")
    if on_path:
        version = _version_of(on_path)
        if version and version >= (1, 14, 0):
            return on_path
    if not build:
        raise ConsulBinaryError("No Consul binary found; set CONSUL_BIN or run `make consul`.")
    return build_consul(cached, quiet=quiet)


def build_consul(target: Path, *, quiet: bool = False) -> str:
    """Build Consul from the Go module in tools/consul into ``target`` (once; file-locked)."""
    go = shutil.which("go")
    if not go:
        raise ConsulBinaryError(
            "Consul is not installed and Go is not on PATH to build it. Install Go >= 1.24 "
            "(e.g. `apt-get install golang-go`, or from go.dev) or set CONSUL_BIN to a Consul "
            ">= 1.14 binary."
        )
    if not (_REPO_TOOLS / "go.mod").is_file():
        raise ConsulBinaryError(
            f"Cannot build Consul: {_REPO_TOOLS}/go.mod is missing (this is a source checkout "
            "feature). Set CONSUL_BIN to a Consul >= 1.14 binary."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / ".build.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(target, os.X_OK):
            return str(target)
        if not quiet:
            print(f"building Consul v{CONSUL_VERSION} from source, first time only, ~4 min ...",
                  file=sys.stderr, flush=True)
        tmp = target.with_suffix(".tmp")
        started = time.monotonic()
        proc = subprocess.run(
            [go, "build", "-trimpath", "-ldflags", "-s -w", "-o", str(tmp),
             "github.com/hashicorp/consul"],
            cwd=_REPO_TOOLS, capture_output=True, text=True,
            env={**os.environ, "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"},
        )
        if proc.returncode != 0:
            raise ConsulBinaryError(
                f"Building Consul v{CONSUL_VERSION} failed (go build exit {proc.returncode}):\n"
                + (proc.stderr or proc.stdout)[-3000:]
            )
        os.replace(tmp, target)
        if not quiet:
            print(f"built Consul v{CONSUL_VERSION} in {time.monotonic() - started:.0f}s: {target}",
                  file=sys.stderr, flush=True)
        return str(target)


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


#: Where :func:`free_ports` looks when the kernel's ephemeral range cannot be read (Linux's
#: default ``ip_local_port_range`` is 32768-60999).
_EPHEMERAL_DEFAULT = (32768, 60999)
_LOWEST = 10000


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports: every socket stays bound until all are chosen.

    The ports are taken below the kernel's ephemeral range when there is room (10000 up to
    it): a port of that range, free while an agent is stopped, can be taken meanwhile as the
    local port of any outgoing connection on the host, and the agent restarted on it then
    fails with "address already in use" (seen with parallel test runs). Outside that range only
    another listener can take it."""
    low, high = _ephemeral_range()
    span = range(_LOWEST, low) if low - _LOWEST >= 1000 else range(high + 1, 65536)
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(50 * count):
            if len(ports) == count:
                break
            port = random.choice(span) if len(span) >= 1000 else 0
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind((host, port))
            except OSError:
                continue
            chosen = s.getsockname()[1]
            if chosen not in ports:
                ports.append(chosen)
        while len(ports) < count:  # nothing free in the span: the kernel's choice
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports


#: Addresses that mean "every interface of this host".
WILDCARD_HOSTS = ("0.0.0.0",)


class ConsulAgent:
    """One real ``consul agent -dev`` on 127.0.0.1 with free ports.

    Use as a context manager or call :meth:`start` / :meth:`stop`. ``extra_hcl`` is appended to
    the generated configuration. ``host`` (an IPv4 address of this host, or ``0.0.0.0`` for all)
    is where the HTTP API listens, default 127.0.0.1; ``http_port`` fixes its port (default: a
    free one). Gossip and server RPC stay on ``host`` (127.0.0.1 for ``0.0.0.0``): a dev agent
    is a cluster of one. Subclasses (the test harness) add ACLs, TLS and failure
    injection through the hooks :meth:`_prepare`, :meth:`_ports`, :meth:`_hcl_extra`,
    :meth:`_command` and :meth:`_popen_kwargs`.
    """

    #: The address the agent binds, listens and advertises on (see ``host=``).
    host = "127.0.0.1"

    def __init__(self, *, extra_hcl: str = "", workdir: str | None = None,
                 node_name: str | None = None, binary: str | None = None,
                 log_level: str = "info", host: str | None = None, http_port: int = 0) -> None:
        if host is not None:
            self.host = host
        self.http_port = http_port
        self.extra_hcl = extra_hcl
        self.binary = binary or consul_binary()
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="consul-rdzv-agent-"))
        self.node_name = node_name or f"node-{uuid.uuid4().hex[:8]}"
        self.log_level = log_level
        #: The token a client needs (None: ACLs are off).
        self.management_token: str | None = None
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._extra_ports: list[int] = []
        self._log_handle: BinaryIO | None = None

    # -------------------------------------------------------------- addresses

    @property
    def scheme(self) -> str:
        return "http"

    @property
    def bind_host(self) -> str:
        """Gossip and server RPC: the agent's own address (loopback for a wildcard ``host``)."""
        return "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host

    @property
    def address(self) -> str:
        """``host:port`` to reach the HTTP API from this host."""
        return f"{self.bind_host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "consul.log"

    def log_text(self, tail: int = 20000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def env(self, *, token: bool = True) -> dict[str, str]:
        """``CONSUL_*`` variables that point a process at this agent."""
        env = {"CONSUL_HTTP_ADDR": self.url}
        if token and self.management_token:
            env["CONSUL_HTTP_TOKEN"] = self.management_token
        return env

    def config(self, **overrides) -> ConsulConfig:
        kwargs = {"address": self.url, "token": self.management_token, **overrides}
        return ConsulConfig.resolve(env={}, **kwargs)

    def client(self, **overrides) -> ConsulClient:
        return ConsulClient(self.config(**overrides))

    # -------------------------------------------------------------- configuration

    def _prepare(self) -> None:
        """Before the configuration is written (a subclass makes its certificates here)."""

    def _ports(self) -> tuple[int, int]:
        """The ``(http, https)`` ports: -1 turns one off."""
        return self.port, -1

    def _hcl_extra(self) -> list[str]:
        """Configuration lines a subclass adds (ACLs, TLS), before ``extra_hcl``."""
        return []

    def _hcl(self) -> str:
        http, https = self._ports()
        lines = [
            f'bind_addr = "{self.bind_host}"',
            f'client_addr = "{self.host}"',
            f'advertise_addr = "{self.bind_host}"',
            f'log_level = "{self.log_level}"',
            "ports {",
            f"  http = {http}",
            f"  https = {https}",
            "  dns = -1",
            "  grpc = -1",
            "  grpc_tls = -1",
            f"  serf_lan = {self._extra_ports[0]}",
            f"  serf_wan = {self._extra_ports[1]}",
            f"  server = {self._extra_ports[2]}",
            "}",
            "limits { http_max_conns_per_client = 8192 }",
            'telemetry { prometheus_retention_time = "1h" }',
            *self._hcl_extra(),
            self.extra_hcl,
        ]
        return "\n".join(lines) + "\n"

    def _command(self, config_file: Path) -> list[str]:
        return [self.binary, "agent", "-dev", f"-node={self.node_name}",
                f"-config-file={config_file}"]

    def _popen_kwargs(self) -> dict:
        """Extra ``subprocess.Popen`` arguments (a subclass may run the agent elsewhere)."""
        return {}

    # -------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 60.0, *, wait: bool = True) -> ConsulAgent:
        """Start the agent; unless ``wait`` is false, return once it is ready."""
        if self.proc and self.proc.poll() is None:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._prepare()
        if not self.port and self.http_port:
            with socket.socket() as probe:
                try:
                    probe.bind((self.host, self.http_port))
                except OSError as exc:
                    raise OSError(
                        f"port {self.http_port} on {self.host} is not free ({exc.strerror}): "
                        "another Consul agent? Choose another port.") from None
                self._extra_ports = free_ports(3, self.bind_host)  # not the one probed
            self.port = self.http_port
        elif not self.port:
            self.port, *self._extra_ports = free_ports(4, self.host)
        cfg = self.workdir / "agent.hcl"
        cfg.write_text(self._hcl())
        self._log_handle = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self._command(cfg),
            stdout=self._log_handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, **self._popen_kwargs(),
        )
        if wait:
            self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None, "start() first"
        proc = self.proc
        deadline = time.monotonic() + timeout
        client = self.client()
        last: Exception | None = None
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"consul agent exited with {proc.returncode} during start-up:\n"
                        + self.log_text(4000)
                    )
                try:
                    if client.status_leader(deadline=0) and any(
                        n.get("Node") == self.node_name for n in client.catalog_nodes(deadline=0)
                    ):
                        return
                except ConsulError as exc:
                    last = exc
                time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise RuntimeError(f"consul agent not ready after {timeout}s ({last}):\n"
                           + self.log_text(4000))

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (SIGCONT first, should it be stopped), SIGKILL after ``timeout``."""
        proc, self.proc = self.proc, None
        if proc and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        if self._log_handle:
            self._log_handle.close()
            self._log_handle = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ConsulAgent:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m consul_rdzv.testing [path]``: obtain the Consul binary (build it if need be);
    with ``path``, print where it is."""
    args = argv if argv is not None else sys.argv[1:]
    if args not in ([], ["path"]):
        print(f"usage: python -m consul_rdzv.testing [path] (got {' '.join(args)!r})",
              file=sys.stderr)
        return 2
    path = consul_binary()
    if args:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
