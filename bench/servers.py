"""The rendezvous servers the benchmark starts and stops: one fresh server per run.

* consul  - ``consul agent -dev`` from :class:`consul_rdzv.testing.ConsulAgent` (in-memory Raft,
  127.0.0.1, free ports). The harness config already carries
  ``limits { http_max_conns_per_client = 8192 }`` (Consul's default is 200 connections per client
  IP, which 1024 nodes on one loopback address would exceed) and
  ``telemetry { prometheus_retention_time }`` (Consul's own request counts:
  :meth:`ConsulServer.http_counts`); :meth:`ConsulServer.start` checks both.
* consul on a cluster (``bench.run --cluster-clients K``) - :class:`ClusterServer`: a
  :class:`consul_testing.ConsulCluster` of real servers and K client agents, each on its own
  127.X.Y.Z; every worker process talks to one client agent (one agent per simulated host).
* c10d    - a ``TCPStore`` server (torch's default libuv backend) in its own process, listening on
  a socket bound to 127.0.0.1 (``master_listen_fd``: a bare ``TCPStore(is_master=True)`` would
  listen on every interface).
* etcd-v2 - Debian's ``etcd`` (3.4) with ``--enable-v2=true`` on free 127.0.0.1 ports, its data
  directory on /dev/shm (tmpfs) so that etcd's WAL fsyncs cost what Consul's in-memory dev Raft
  costs: nothing. Installed with apt-get when missing.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HTTP_LIMIT_LINE = "limits { http_max_conns_per_client = 8192 }"
PROMETHEUS_LINE = "prometheus_retention_time"
#: Consul's HTTP metric path of a TTL check pass (``PUT /v1/agent/check/pass/<id>``): a cost per
#: second (one per keep_alive_interval and node), not per round, so it is counted apart.
CHECK_PASS_PATH = "v1_agent_check_pass_"


#: What the agent's own metrics say a round cost it (cumulative series of
#: ``/v1/agent/metrics?format=prometheus``, summed over their labels): Raft applies and commit
#: time, the state machine's applies by kind, the server RPCs, the process's CPU and the bytes
#: Go allocated. Gauges (``consul_raft_last_index``) are differenced the same way.
AGENT_SERIES = (
    "consul_raft_apply", "consul_raft_commitTime_count", "consul_raft_commitTime_sum",
    "consul_raft_fsm_apply_count", "consul_raft_fsm_apply_sum", "consul_raft_last_index",
    "consul_fsm_kvs_count", "consul_fsm_kvs_sum", "consul_fsm_txn_count", "consul_fsm_txn_sum",
    "consul_fsm_session_count", "consul_fsm_session_sum", "consul_fsm_register_count",
    "consul_fsm_register_sum", "consul_fsm_deregister_count", "consul_fsm_tombstone_count",
    "consul_kvs_apply_count", "consul_kvs_apply_sum", "consul_txn_apply_count",
    "consul_txn_apply_sum", "consul_txn_read_count", "consul_session_apply_count",
    "consul_session_apply_sum", "consul_session_renew_count", "consul_catalog_register_count",
    "consul_catalog_register_sum", "consul_catalog_deregister_count", "consul_rpc_request",
    "consul_rpc_query", "consul_rpc_consistentRead_count", "process_cpu_seconds_total",
    "go_memstats_alloc_bytes_total",
)


def _prometheus(url: str, token: str | None = None) -> str:
    req = urllib.request.Request(f"{url}/v1/agent/metrics?format=prometheus")
    if token:
        req.add_header("X-Consul-Token", token)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read().decode()


def parse_http_counts(text: str) -> dict[str, list[float]]:
    """``[count, sum of ms]`` by ``METHOD path`` (see :func:`agent_http_counts`)."""
    stats: dict[str, list[float]] = {}
    for line in text.splitlines():
        for series, slot in (("consul_api_http_count{", 0), ("consul_api_http_sum{", 1)):
            if not line.startswith(series):
                continue
            labels, value = line.rsplit(" ", 1)
            fields = dict(part.split("=", 1) for part in labels[len(series):-1].split(","))
            method = fields.get("method", "").strip('"')
            path = fields.get("path", "").strip('"')
            if path == "v1_agent_metrics":
                continue
            entry = stats.setdefault(f"{method} {path}", [0, 0.0])
            entry[slot] += float(value)
    return stats


def parse_agent_series(text: str) -> dict[str, float]:
    """The :data:`AGENT_SERIES` of one agent's Prometheus text, each summed over its labels."""
    wanted = set(AGENT_SERIES)
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in wanted:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        found[name] = found.get(name, 0.0) + value
    return found


def agent_http_counts(url: str, token: str | None = None) -> dict[str, list[float]]:
    """Consul's own count of the HTTP requests it served and the time it spent on them, by
    ``METHOD path``: ``[count, sum of ms]`` from the ``consul_api_http_count`` and
    ``consul_api_http_sum`` series of ``/v1/agent/metrics?format=prometheus`` (the agent's own
    view, from accepting a request to writing its answer), without the metrics requests."""
    return parse_http_counts(_prometheus(url, token))


def agent_snapshot(url: str, token: str | None = None) -> tuple[dict, dict]:
    """One read of an agent's metrics: (HTTP counts, :data:`AGENT_SERIES`)."""
    text = _prometheus(url, token)
    return parse_http_counts(text), parse_agent_series(text)


class AgentProbe(threading.Thread):
    """Passes a check of its own on an agent every ``interval`` from the runner process (no GIL
    shared with the nodes): how long the agent takes to answer a check pass while the nodes'
    rounds run. Its requests are subtracted from the counts (:attr:`sent`)."""

    CHECK = "bench-probe"

    def __init__(self, url: str, token: str | None = None, interval: float = 0.25) -> None:
        super().__init__(name="bench-agent-probe", daemon=True)
        self.url, self.token, self.interval = url, token, interval
        self.samples: list[tuple[float, float | None]] = []  # (monotonic start, seconds|None)
        self.sent = 0
        self.stop_event = threading.Event()

    def _put(self, path: str, body: bytes | None = None, timeout: float = 60.0) -> None:
        req = urllib.request.Request(f"{self.url}{path}", data=body or b"", method="PUT")
        if self.token:
            req.add_header("X-Consul-Token", self.token)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()

    def register(self) -> None:
        body = json.dumps({"ID": self.CHECK, "Name": "bench probe", "TTL": "1h"}).encode()
        self._put("/v1/agent/check/register", body, timeout=30)

    def run(self) -> None:
        while not self.stop_event.is_set():
            started = time.monotonic()
            took = None
            try:
                self.sent += 1
                self._put(f"/v1/agent/check/pass/{self.CHECK}")
                took = time.monotonic() - started
            except OSError:
                took = None
            self.samples.append((started, took))
            self.stop_event.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def window(self, start: float, end: float) -> dict | None:
        """Latencies of the probe's passes sent between ``start`` and ``end`` (monotonic)."""
        vals = [t for s, t in self.samples if start <= s <= end]
        ok = sorted(t for t in vals if t is not None)
        if not vals:
            return None
        return {"n": len(vals), "failed": len(vals) - len(ok),
                "p50_ms": 1000 * ok[len(ok) // 2] if ok else None,
                "p90_ms": 1000 * ok[min(len(ok) - 1, int(0.9 * len(ok)))] if ok else None,
                "max_ms": 1000 * ok[-1] if ok else None}


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process in MB (from /proc), or None."""
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def loopback_hosts_file(directory: Path) -> Path:
    """A copy of /etc/hosts that also names ::ffff:127.0.0.1 and ::1 (see use_hosts_file)."""
    try:
        text = Path("/etc/hosts").read_text()
    except OSError:
        text = "127.0.0.1 localhost\n"
    extra = [line for line in ("::1 localhost", "::ffff:127.0.0.1 localhost")
             if line.split()[0] not in text.split()]
    path = directory / "hosts"
    path.write_text(text.rstrip("\n") + "\n" + "".join(f"{line}\n" for line in extra))
    return path


def use_hosts_file(path: str) -> None:
    """Give this (still single-threaded) process a private mount namespace in which ``path`` is
    bind-mounted over /etc/hosts. The machine's /etc/hosts is untouched.

    Why: torch's TCPStore reverse-resolves the address of every connection (for a log line). The
    clients connect to 127.0.0.1 as the IPv4-mapped ::ffff:127.0.0.1, which /etc/hosts does not
    name, so glibc asks DNS; a resolver that drops part of a burst of queries (this sandbox's
    does) stalls the connect for glibc's 5 s retry timeout. ``--loopback-hosts`` measures the
    rendezvous without that artifact.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private, ms_bind = 0x00020000, 0x4000, 1 << 18, 4096
    if libc.unshare(clone_newns) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed (needs root)")
    if libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
        raise OSError(ctypes.get_errno(), "making / private in the new namespace failed")
    if libc.mount(os.fsencode(path), b"/etc/hosts", None, ms_bind, None) != 0:
        raise OSError(ctypes.get_errno(), f"bind-mounting {path} over /etc/hosts failed")


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo), or ""."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process (from /proc), or None."""
    if not pid:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def cpu_seconds_all(pids: list[int]) -> float | None:
    """Summed CPU seconds of several processes (a cluster's agents), or None."""
    values = [cpu_seconds(pid) for pid in pids]
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def system_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return (total - idle) / tick, total / tick


class ConsulServer:
    """One ``consul agent -dev``: server and the agent of every node at once."""

    name = "consul"
    topology = "single"

    @property
    def pid(self) -> int | None:
        return self.agent.proc.pid if self.agent.proc else None

    @property
    def pids(self) -> list[int]:
        return [self.pid] if self.pid else []

    def __init__(self) -> None:
        from consul_rdzv.testing import ConsulAgent

        self.agent = ConsulAgent()
        self.endpoints: list[str] = []

    def start(self) -> str:
        self.agent.start()
        hcl = (self.agent.workdir / "agent.hcl").read_text()
        for line in (HTTP_LIMIT_LINE, PROMETHEUS_LINE):
            if line not in hcl:  # pragma: no cover - the harness default changed
                self.agent.close()
                raise RuntimeError(f"ConsulAgent no longer writes {line!r}; pass it as "
                                   "extra_hcl in bench/servers.py.")
        self.endpoints = [self.agent.address]
        return self.agent.address

    def http_counts(self) -> dict[str, list[float]]:
        """Consul's own request counts (see :func:`agent_http_counts`)."""
        return agent_http_counts(self.agent.url)

    def snapshot(self) -> tuple[dict, dict]:
        """Request counts and the agent's own series (:func:`agent_snapshot`): the one agent
        is the server too."""
        http, series = agent_snapshot(self.agent.url)
        return http, {"servers": series}

    def probe(self) -> AgentProbe:
        return AgentProbe(self.agent.url)

    def describe(self) -> dict:
        return {"topology": "single", "agents": 1, "rss_mb": rss_mb(self.pid)}

    def stop(self, keep_log: str | None = None) -> None:
        self.agent.stop()
        if keep_log:
            with contextlib.suppress(OSError):
                shutil.copyfile(self.agent.log_path, keep_log)
        self.agent.close()

    @staticmethod
    def version() -> str:
        from consul_rdzv.testing import consul_binary

        out = subprocess.run([consul_binary(), "version"], capture_output=True, text=True,
                             timeout=30).stdout
        return out.splitlines()[0].strip() if out else "?"


class ClusterServer:
    """A :class:`consul_testing.ConsulCluster`: ``servers`` servers and ``clients`` client
    agents on their own loopback addresses, default gossip timings (``fast=False``: the harness's
    fast gossip is for failure tests, and costs CPU in every agent), ``log_level`` warn, and
    ``raft_multiplier`` (the harness runs Raft at 1, production timing for dedicated servers;
    Consul's default is 5: on this shared 2-core box, with 1024 node threads beside them, servers
    at 1 lost their leadership under load: "leadership lost while committing log"). The nodes
    talk to the client agents only (:attr:`endpoints`, one per simulated host)."""

    name = "consul"
    topology = "cluster"

    def __init__(self, servers: int = 3, clients: int = 16, raft_multiplier: int = 5) -> None:
        from consul_testing import ConsulCluster

        self.raft_multiplier = raft_multiplier
        self.cluster = ConsulCluster(
            servers, clients, fast=False, log_level="warn",
            extra_hcl=f"performance {{ raft_multiplier = {raft_multiplier} }}")
        self.endpoints: list[str] = []
        self.start_s: float | None = None

    @property
    def pids(self) -> list[int]:
        return [m.proc.pid for m in self.cluster.members if m.proc and m.proc.poll() is None]

    def start(self) -> str:
        self.cluster.start(timeout=120)
        self.start_s = self.cluster.start_seconds
        hcl = (self.cluster.members[0].workdir / "agent.hcl").read_text()
        if PROMETHEUS_LINE not in hcl:  # pragma: no cover - the harness default changed
            self.cluster.close()
            raise RuntimeError(f"ClusterMember no longer writes {PROMETHEUS_LINE!r}.")
        self.endpoints = [m.address for m in self.cluster.clients] or [
            m.address for m in self.cluster.servers]
        return self.endpoints[0]

    def http_counts(self) -> dict[str, list[float]]:
        """Requests the nodes' agents (the client agents) served, summed."""
        total: dict[str, list[float]] = {}
        for m in self.cluster.clients or self.cluster.servers:
            for key, (count, ms) in agent_http_counts(m.url, m.management_token).items():
                entry = total.setdefault(key, [0, 0.0])
                entry[0] += count
                entry[1] += ms
        return total

    def snapshot(self) -> tuple[dict, dict]:
        """Request counts summed over the nodes' agents (the client agents), and the agent
        series summed over the servers and over the client agents apart."""
        total: dict[str, list[float]] = {}
        series: dict[str, dict[str, float]] = {"servers": {}, "clients": {}}
        nodes_agents = self.cluster.clients or self.cluster.servers
        for m in self.cluster.members:
            http, found = agent_snapshot(m.url, m.management_token)
            kind = "servers" if m in self.cluster.servers else "clients"
            for key, value in found.items():
                series[kind][key] = series[kind].get(key, 0.0) + value
            if m not in nodes_agents:
                continue
            for key, (count, ms) in http.items():
                entry = total.setdefault(key, [0, 0.0])
                entry[0] += count
                entry[1] += ms
        return total, series

    def probe(self) -> AgentProbe:
        """On the first client agent (the one of the first worker process)."""
        member = (self.cluster.clients or self.cluster.servers)[0]
        return AgentProbe(member.url, member.management_token)

    def describe(self) -> dict:
        rss = {m.name: rss_mb(m.proc.pid if m.proc else None) for m in self.cluster.members}
        servers = [v for k, v in rss.items() if k.startswith("server") and v]
        clients = [v for k, v in rss.items() if k.startswith("client") and v]
        return {"topology": "cluster", "servers": len(self.cluster.servers),
                "clients": len(self.cluster.clients), "start_s": self.start_s,
                "raft_multiplier": self.raft_multiplier,
                "server_rss_mb": servers, "client_rss_mb": clients}

    def stop(self, keep_log: str | None = None) -> None:
        if keep_log:
            with contextlib.suppress(OSError), open(keep_log, "w") as out:
                for m in self.cluster.members:
                    out.write(f"==== {m.name} {m.ip}\n{m.log_text(200000)}\n")
        self.cluster.close()


def _tcpstore_server_main(port_conn, stop_event, hosts_file=None) -> None:
    """Body of the c10d store process: a TCPStore server on 127.0.0.1 until told to stop."""
    import resource

    import torch.distributed as dist

    if hosts_file:
        use_hosts_file(hosts_file)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=600),
                          wait_for_workers=False, master_listen_fd=sock.detach(),
                          multi_tenant=True)
    port_conn.send(port)
    stop_event.wait()
    del store


class TCPStoreServer:
    name = "c10d"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def pids(self) -> list[int]:
        return [self.pid] if self.pid else []

    def __init__(self, ctx, hosts_file: str | None = None) -> None:
        self.ctx = ctx
        self.hosts_file = hosts_file
        self.proc = None
        self._stop = None

    def start(self) -> str:
        parent, child = self.ctx.Pipe()
        self._stop = self.ctx.Event()
        self.proc = self.ctx.Process(target=_tcpstore_server_main,
                                     args=(child, self._stop, self.hosts_file),
                                     name="bench-tcpstore", daemon=True)
        self.proc.start()
        if not parent.poll(60):
            self.stop()
            raise RuntimeError("the TCPStore server process did not start within 60 s")
        return f"127.0.0.1:{parent.recv()}"

    def stop(self, keep_log: str | None = None) -> None:
        if self.proc is None:
            return
        self._stop.set()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.proc = None


def ensure_etcd() -> tuple[str | None, str]:
    """Return (path of etcd, note). Installs Debian's etcd-server with apt-get if missing."""
    path = shutil.which("etcd")
    if path:
        return path, "found on PATH"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "etcd missing and apt-get unavailable (not root?)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "etcd-server"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode != 0:
            return None, f"{' '.join(cmd)} failed: {(proc.stderr or proc.stdout)[-400:]}"
    path = shutil.which("etcd")
    return (path, "installed with apt-get") if path else (None, "apt-get ran but no etcd binary")


class EtcdServer:
    name = "etcd-v2"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def pids(self) -> list[int]:
        return [self.pid] if self.pid else []

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-etcd-", dir=base))
        self.port = 0

    def start(self, timeout: float = 30.0) -> str:
        from consul_rdzv.testing import free_ports

        self.port, peer = free_ports(2)
        client_url, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        log = open(self.workdir / "etcd.log", "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [self.binary, "--name", "bench", "--data-dir", str(self.workdir / "data"),
             "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"bench={peer_url}", "--initial-cluster-state", "new",
             "--enable-v2=true", "--log-level", "warn", "--logger", "zap"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("etcd exited during start-up:\n" + self.log_text())
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"{client_url}/v2/keys/?recursive=false", timeout=1) as resp:
                if resp.status == 200:
                    return f"127.0.0.1:{self.port}"
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd not ready after {timeout}s:\n" + self.log_text())

    def log_text(self) -> str:
        try:
            return (self.workdir / "etcd.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self, keep_log: str | None = None) -> None:
        if keep_log:
            with contextlib.suppress(OSError):
                shutil.copyfile(self.workdir / "etcd.log", keep_log)
        proc, self.proc = self.proc, None
        if proc and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    @staticmethod
    def version(binary: str) -> str:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
        first = out.splitlines()[0].strip() if out else "?"
        return first.replace("etcd Version:", "").strip()
