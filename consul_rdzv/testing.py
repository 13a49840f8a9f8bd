"""Real Consul agents for tests, examples, benchmarks and the demo.

Nothing here is a fake: :class:`ConsulAgent` starts ``consul agent -dev`` on 127.0.0.1 with every
port chosen free (DNS, gRPC and WAN off), waits until it has a leader and its node is in the
catalog, and stops it by PID. Variants: ``acl=True`` (default deny, a management token handed to
the caller) and ``tls=True`` (HTTPS only, CA and certificates made with ``consul tls``;
``verify_incoming=True`` for mutual TLS). Failure injection: :meth:`ConsulAgent.stop`,
:meth:`ConsulAgent.restart` (a dev agent forgets everything), :meth:`ConsulAgent.freeze`/``thaw``.

The binary is found by :func:`consul_binary`: ``CONSUL_BIN``; a previous build in the cache;
``consul`` on PATH if it is v1.14 or newer; else it is built from ``tools/consul`` with Go.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
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


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports: every socket stays bound until all are chosen."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports


class ConsulAgent:
    """One real ``consul agent -dev`` on 127.0.0.1 with free ports.

    Use as a context manager or call :meth:`start` / :meth:`stop`. ``extra_hcl`` is appended to
    the generated configuration.
    """

    def __init__(self, *, acl: bool = False, tls: bool = False, verify_incoming: bool = False,
                 extra_hcl: str = "", workdir: str | None = None, node_name: str | None = None,
                 binary: str | None = None, log_level: str = "info") -> None:
        self.acl = acl
        self.tls = tls or verify_incoming
        self.verify_incoming = verify_incoming
        self.extra_hcl = extra_hcl
        self.binary = binary or consul_binary()
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="consul-rdzv-agent-"))
        self.node_name = node_name or f"node-{uuid.uuid4().hex[:8]}"
        self.log_level = log_level
        self.management_token = str(uuid.uuid4()) if acl else None
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._extra_ports: list[int] = []
        self.ca_file = self.server_cert = self.server_key = None
        self.client_cert = self.client_key = None
        self._log_handle = None

    # -------------------------------------------------------------- addresses

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

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
        if self.tls and self.ca_file:
            env["CONSUL_CACERT"] = str(self.ca_file)
        if self.verify_incoming and self.client_cert:
            env["CONSUL_CLIENT_CERT"] = str(self.client_cert)
            env["CONSUL_CLIENT_KEY"] = str(self.client_key)
        return env

    def config(self, **overrides) -> ConsulConfig:
        kwargs = {
            "address": self.url,
            "token": self.management_token,
            "ca_file": str(self.ca_file) if self.ca_file else None,
            "client_cert": str(self.client_cert) if self.verify_incoming else None,
            "client_key": str(self.client_key) if self.verify_incoming else None,
        }
        kwargs.update(overrides)
        return ConsulConfig.resolve(env={}, **kwargs)

    def client(self, **overrides) -> ConsulClient:
        return ConsulClient(self.config(**overrides))

    # -------------------------------------------------------------- lifecycle

    def _make_certs(self) -> None:
        certs = self.workdir / "certs"
        if (certs / "consul-agent-ca.pem").exists():
            return
        certs.mkdir(parents=True, exist_ok=True)
        for args in (["tls", "ca", "create"],
                     ["tls", "cert", "create", "-server", "-dc", "dc1"],
                     ["tls", "cert", "create", "-client", "-dc", "dc1"]):
            subprocess.run([self.binary, *args], cwd=certs, check=True, capture_output=True,
                           timeout=60)
        self.ca_file = certs / "consul-agent-ca.pem"
        self.server_cert = certs / "dc1-server-consul-0.pem"
        self.server_key = certs / "dc1-server-consul-0-key.pem"
        self.client_cert = certs / "dc1-client-consul-0.pem"
        self.client_key = certs / "dc1-client-consul-0-key.pem"

    def _hcl(self) -> str:
        http = -1 if self.tls else self.port
        https = self.port if self.tls else -1
        lines = [
            'bind_addr = "127.0.0.1"',
            'client_addr = "127.0.0.1"',
            'advertise_addr = "127.0.0.1"',
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
        ]
        if self.acl:
            lines += [
                "acl {",
                "  enabled = true",
                '  default_policy = "deny"',
                "  enable_token_persistence = false",
                f'  tokens {{ initial_management = "{self.management_token}" '
                f'agent = "{self.management_token}" }}',
                "}",
            ]
        if self.tls:
            vi = "true" if self.verify_incoming else "false"
            lines += [
                "tls {",
                "  defaults {",
                f'    ca_file = "{self.ca_file}"',
                f'    cert_file = "{self.server_cert}"',
                f'    key_file = "{self.server_key}"',
                f"    verify_incoming = {vi}",
                "  }",
                "  internal_rpc { verify_incoming = false }",
                "}",
            ]
        lines.append(self.extra_hcl)
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 60.0) -> ConsulAgent:
        if self.proc and self.proc.poll() is None:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.tls:
            self._make_certs()
        if not self.port:
            self.port, *self._extra_ports = free_ports(4)
        cfg = self.workdir / "agent.hcl"
        cfg.write_text(self._hcl())
        self._log_handle = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [self.binary, "agent", "-dev", f"-node={self.node_name}", f"-config-file={cfg}"],
            stdout=self._log_handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self.client()
        last: Exception | None = None
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"consul agent exited with {self.proc.returncode} during start-up:\n"
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

    def kill(self) -> None:
        """SIGKILL the agent (no graceful leave)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(15)
        self.stop()

    def restart(self, timeout: float = 60.0, *, crash: bool = False) -> None:
        """Stop (SIGKILL if ``crash``) and start again on the same port.

        A dev agent comes back with empty state. ``crash`` resets connections mid-query and
        drains nothing, as a crashed agent would.
        """
        if crash:
            self.kill()
        else:
            self.stop()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the port can linger briefly after exit
            try:
                with socket.socket() as s:
                    # Consul (Go) listens with SO_REUSEADDR, so connections left in TIME_WAIT
                    # do not block it; without the flag this probe waited them out for 15 s.
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", self.port))
                break
            except OSError:
                time.sleep(0.05)
        self.start(timeout)

    def freeze(self) -> None:
        """SIGSTOP the agent: it stays reachable at TCP level but answers nothing."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ConsulAgent:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m consul_rdzv.testing [build|path]``: obtain the Consul binary."""
    args = argv if argv is not None else sys.argv[1:]
    path = consul_binary()
    if args[:1] == ["path"]:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
