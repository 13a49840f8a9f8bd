"""Real multi-member Consul clusters for tests, the benchmark and the fault campaign.

:class:`ConsulCluster` runs real servers (``-server -bootstrap-expect``, data on disk) and client
agents, each a :class:`ClusterMember` on its own address of a random ``127.X.Y.0/24``, with every
failure of a single agent (kill, stop, restart, freeze) and network partitions
(:meth:`ConsulCluster.partition` / ``heal``).

Root only, and why this is not installed: as root every member runs under a uid of its own, and
a partition is a set of ``ip rule`` (policy routing) entries that refuse traffic by uid; the first
partition moves the host's ``lookup local`` rule (see :func:`_ensure_local_rule_moved`). Without
root the cluster runs under the caller's uid and :meth:`ConsulCluster.partition` raises
:class:`PartitionUnsupported`.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path

from consul_rdzv.testing import consul_binary, free_ports

from .agent import ConsulAgent, acl_hcl, tls_hcl

#: Serf member status codes, as ``/v1/agent/members`` reports them.
SERF_STATUS = {0: "none", 1: "alive", 2: "leaving", 3: "left", 4: "failed"}

#: LAN-gossip timings of a ``fast`` cluster (memberlist: probe every 300 ms, suspicion x3): a
#: dead member is ``failed`` in 1-2 s instead of 5-10 s. Raft runs at ``raft_multiplier = 1``
#: (1 s heartbeat and election timeouts, the fastest Consul allows outside ``-dev``: its
#: ``consul { raft {...} }`` block is overridden by the built-in defaults except in dev mode).
FAST_TIMING_HCL = """\
gossip_lan {
  gossip_interval = "100ms"
  probe_interval = "300ms"
  probe_timeout = "200ms"
  suspicion_mult = 3
}
"""

#: Policy-routing preferences of partition rules (``ip rule``); the ``local`` table's rule, at 0
#: by default, moves to :data:`LOCAL_RULE_PREF` so that they come first.
PARTITION_ALLOW_PREF = 900
PARTITION_DENY_PREF = 901
LOCAL_RULE_PREF = 1000

#: Member processes run under uids from this range when the harness is root (one per member,
#: a random block of 32 per cluster): partition rules select a member's traffic by its uid.
_UID_FLOOR = 2_000_000
_UIDS_PER_CLUSTER = 32


class PartitionUnsupported(RuntimeError):
    """Network partitions need root and ``ip rule`` (policy routing) on this machine."""


def _bound_loopback_blocks() -> set[tuple[int, int]]:
    """The ``127.X.Y`` of every listening or connected TCP and every bound UDP socket."""
    used: set[tuple[int, int]] = set()
    for table in ("/proc/net/tcp", "/proc/net/udp"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local = line.split()[1].split(":")[0]  # little-endian hex, 0100007F = 127.0.0.1
            if len(local) == 8 and local.endswith("7F"):
                used.add((int(local[4:6], 16), int(local[2:4], 16)))
    return used


def pick_loopback_block(rng: random.Random | None = None) -> str:
    """A random ``127.X.Y`` (X >= 16) on which no socket listens: a /24 of one's own."""
    rng = rng or random.SystemRandom()
    used = _bound_loopback_blocks()
    for _ in range(1000):
        block = (rng.randrange(16, 255), rng.randrange(0, 256))
        if block not in used:
            return f"127.{block[0]}.{block[1]}"
    raise RuntimeError("no free 127.X.Y.0/24 block found")


def _ip_rule(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    ip = shutil.which("ip") or "/usr/sbin/ip"
    proc = subprocess.run([ip, "rule", *args], capture_output=True, text=True, timeout=15)
    if check and proc.returncode != 0:
        raise PartitionUnsupported(f"`ip rule {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _ensure_local_rule_moved() -> None:
    """Move the ``lookup local`` rule from preference 0 to :data:`LOCAL_RULE_PREF`.

    Every address of 127/8 is in the ``local`` table, whose rule is looked up first: a rule meant
    to refuse some loopback traffic must come before it. Routing is unchanged otherwise; the
    rule is added at its new place before the old one goes, so loopback never breaks, and it
    stays there (moving it back could undo a concurrent cluster's partition).
    """
    rules = _ip_rule("show").stdout
    local = [int(m.group(1)) for m in re.finditer(r"^(\d+):\s+from all lookup local", rules, re.M)]
    if LOCAL_RULE_PREF not in local:
        proc = _ip_rule("add", "pref", str(LOCAL_RULE_PREF), "lookup", "local", check=False)
        if proc.returncode != 0 and "exists" not in proc.stderr:
            raise PartitionUnsupported(f"cannot add a local-table rule: {proc.stderr.strip()}")
    for pref in local:
        if pref < PARTITION_DENY_PREF:
            _ip_rule("del", "pref", str(pref), "lookup", "local", check=False)
    rules = _ip_rule("show").stdout
    early = [m for m in re.finditer(r"^(\d+):\s+from all lookup local", rules, re.M)
             if int(m.group(1)) <= PARTITION_DENY_PREF]
    if early:
        raise PartitionUnsupported(f"a local-table rule still precedes partition rules:\n{rules}")


class ClusterMember(ConsulAgent):
    """One agent of a :class:`ConsulCluster`: a server or a client agent on its own 127.X.Y.Z.

    Unlike a dev agent it keeps its data directory across :meth:`stop`/:meth:`kill` and
    :meth:`start`/:meth:`restart` (same address, same ports; a server keeps its Raft state).
    Use :attr:`ip`, :attr:`address` (``ip:http port``), :attr:`url`, :meth:`env`,
    :meth:`client` and :meth:`api` to talk to it.
    """

    def __init__(self, cluster: ConsulCluster, name: str, ip: str, *, is_server: bool,
                 uid: int | None) -> None:
        super().__init__(acl=cluster.acl, tls=cluster.tls, extra_hcl=cluster.extra_hcl,
                         workdir=str(cluster.workdir / name), node_name=name,
                         binary=cluster.binary, log_level=cluster.log_level)
        self.cluster = cluster
        self.host = ip
        self.is_server = is_server
        self.uid = uid
        self.management_token = cluster.management_token
        self.frozen = False
        self.partitioned = False

    # -------------------------------------------------------------- addresses

    @property
    def name(self) -> str:
        return self.node_name

    @property
    def ip(self) -> str:
        return self.host

    @property
    def serf_port(self) -> int:
        return self._extra_ports[0]

    @property
    def server_port(self) -> int:
        return self._extra_ports[2]

    @property
    def serf_address(self) -> str:
        return f"{self.ip}:{self.serf_port}"

    @property
    def rpc_address(self) -> str:
        """``ip:port`` of the server RPC port: what ``/v1/status/leader`` and ``peers`` name."""
        return f"{self.ip}:{self.server_port}"

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def reachable(self) -> bool:
        """Running and not frozen: its HTTP API answers (partitioned or not)."""
        return self.running and not self.frozen

    @property
    def in_contact(self) -> bool:
        """Reachable and not partitioned: the other members can reach it."""
        return self.reachable and not self.partitioned

    def __repr__(self) -> str:
        kind = "server" if self.is_server else "client"
        return f"<ClusterMember {self.name} {kind} {self.ip}>"

    # -------------------------------------------------------------- lifecycle

    def _make_certs(self) -> None:
        """The cluster made one CA and certificate for all its members."""

    def _hcl(self) -> str:
        c = self.cluster
        http = -1 if self.tls else self.port
        https = self.port if self.tls else -1
        join = ", ".join(f'"{s.serf_address}"' for s in c.servers)
        lines = [
            f'data_dir = "{self.data_dir}"',
            f'bind_addr = "{self.ip}"',
            f'client_addr = "{self.ip}"',
            f'advertise_addr = "{self.ip}"',
            f'log_level = "{self.log_level}"',
            "disable_update_check = true",
            f"server = {'true' if self.is_server else 'false'}",
            f"retry_join = [{join}]",
            f'retry_interval = "{c.retry_interval}"',
            "ports {",
            f"  http = {http}",
            f"  https = {https}",
            "  dns = -1",
            "  grpc = -1",
            "  grpc_tls = -1",
            f"  serf_lan = {self.serf_port}",
            f"  serf_wan = {self._extra_ports[1] if self.is_server else -1}",
            f"  server = {self.server_port}",
            "}",
            "limits { http_max_conns_per_client = 8192 }",
            'telemetry { prometheus_retention_time = "1h" }',
            "performance { raft_multiplier = 1 }",
        ]
        if self.is_server:
            lines += [
                f"bootstrap_expect = {len(c.servers)}",
                # Never prune a dead server from the Raft configuration: a killed server that
                # restarts finds the configuration it left; a newcomer votes after 1 s.
                f'autopilot {{ min_quorum = {len(c.servers)} server_stabilization_time = "1s" }}',
            ]
        if c.fast:
            lines.append(FAST_TIMING_HCL)
        if self.acl:
            lines += acl_hcl(self.management_token)
        if self.tls:
            lines += tls_hcl(self.ca_file, self.server_cert, self.server_key,
                              verify_incoming=False)
        return "\n".join(lines) + "\n"

    def _command(self, config_file: Path) -> list[str]:
        cmd = [self.binary, "agent", f"-node={self.node_name}", f"-config-file={config_file}"]
        if self.extra_hcl:
            extra = self.workdir / "extra.hcl"
            extra.write_text(self.extra_hcl + "\n")
            cmd.append(f"-config-file={extra}")  # read last: overrides the generated file
        return cmd

    def _popen_kwargs(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUL_")}
        env["HOME"] = str(self.workdir)
        kwargs: dict = {"env": env, "cwd": str(self.workdir)}
        if self.uid is not None:
            kwargs.update(user=self.uid, group=self.uid, extra_groups=[])
        return kwargs

    def start(self, timeout: float = 60.0, *, wait: bool = True) -> ClusterMember:
        """Start (or start again) with the same data directory, address and ports.

        Returns once its HTTP API answers (unless ``wait`` is false);
        :meth:`ConsulCluster.wait_healthy` waits until it has rejoined. A partitioned member
        stays partitioned.
        """
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.uid is not None:  # all of it: a workdir given to the cluster may be reused
            os.chown(self.workdir, self.uid, self.uid)
            for root, dirs, files in os.walk(self.data_dir):
                for name in (".", *dirs, *files):
                    os.chown(os.path.join(root, name), self.uid, self.uid)
        self.frozen = False
        super().start(timeout, wait=wait)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"consul agent {self.name} exited with {self.proc.returncode} during "
                    "start-up:\n" + self.log_text(4000))
            try:  # needs no token: with ACLs, tokens work only once a leader bootstrapped them
                status, last = self.api("GET", "/v1/status/leader", token=False, timeout=1.0)
                if status == 200:
                    return
            except (OSError, http.client.HTTPException) as exc:
                last = exc
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"consul agent {self.name} not answering after {timeout}s ({last}):\n"
                           + self.log_text(4000))

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (a client agent leaves the cluster, a server does not), SIGKILL after
        ``timeout``. The data directory stays."""
        self.frozen = False
        super().stop(timeout)

    def kill(self) -> None:
        """SIGKILL: no leave, no flush; the others see the member ``failed``."""
        self.frozen = False
        super().kill()

    def freeze(self) -> None:
        super().freeze()
        self.frozen = True

    def thaw(self) -> None:
        super().thaw()
        self.frozen = False

    def close(self) -> None:
        self.stop()


class ConsulCluster:
    """Real Consul servers plus client agents, each on its own loopback address.

    ``servers`` servers (``-server -bootstrap-expect``, data in a temporary directory) and
    ``clients`` client agents run on ``127.X.Y.2``, ``.3``, ... of a random ``127.X.Y.0/24`` on
    which nothing else is bound (so concurrent clusters never collide), every port free, DNS,
    gRPC and WAN off for clients. :meth:`start` returns once a leader serves KV writes and every
    member is ``alive`` on every server (:attr:`start_seconds`). ``acl=True``: default deny, the
    :attr:`management_token` is the initial management token and every member's agent token.
    ``tls=True``: HTTPS only, one CA and one certificate naming every member's address.
    ``fast`` (default) shortens LAN gossip timings (:data:`FAST_TIMING_HCL`); Raft always runs
    at ``raft_multiplier = 1``. ``extra_hcl`` is a last configuration file: it overrides.
    As root, every member runs under a uid of its own (``separate_uids``), which partitions
    need; its files are in ``workdir`` (default: a new temporary directory, removed on close).
    Servers are named ``server-0``, ...; client agents ``client-0``, ... unless
    ``client_names`` names them (Consul node names: per-team ACL session rules need them).

    Failure injection: each member's :meth:`~ClusterMember.kill`, ``stop``, ``start``,
    ``restart``, ``freeze``, ``thaw``; :meth:`partition` / :meth:`heal` cut members off the
    others at the network level (policy routing by uid; needs root) while their HTTP API stays
    reachable from the test.
    """

    def __init__(self, servers: int = 3, clients: int = 2, *, acl: bool = False,
                 tls: bool = False, fast: bool = True, extra_hcl: str = "",
                 workdir: str | None = None, binary: str | None = None,
                 log_level: str = "info", retry_interval: str = "200ms",
                 separate_uids: bool | None = None,
                 client_names: list[str] | None = None) -> None:
        if servers < 1 or clients < 0 or servers + clients > _UIDS_PER_CLUSTER - 1:
            raise ValueError(f"bad cluster size: {servers} servers, {clients} clients")
        names = list(client_names) if client_names is not None else [
            f"client-{i}" for i in range(clients)]
        if len(names) != clients or len(set(names)) != clients or any(
                not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}", n) or n.startswith("server-")
                for n in names):
            raise ValueError(f"client_names {client_names!r}: give {clients} distinct names of "
                             "letters, digits and '-' (not server-N)")
        self.acl = acl
        self.tls = tls
        self.fast = fast
        self.extra_hcl = extra_hcl
        self.binary = binary or consul_binary()
        self.log_level = log_level
        self.retry_interval = retry_interval
        self.management_token = str(uuid.uuid4()) if acl else None
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="consul-rdzv-cluster-"))
        self.block = pick_loopback_block()
        if separate_uids is None:
            separate_uids = os.geteuid() == 0
        self.uid_base = (_UID_FLOOR + random.SystemRandom().randrange(1_000_000)
                         * _UIDS_PER_CLUSTER) if separate_uids else None
        self.members: list[ClusterMember] = []
        for i in range(servers + clients):
            is_server = i < servers
            name = f"server-{i}" if is_server else names[i - servers]
            uid = None if self.uid_base is None else self.uid_base + 1 + i
            self.members.append(ClusterMember(self, name, f"{self.block}.{i + 2}",
                                              is_server=is_server, uid=uid))
        self.ca_file: Path | None = None
        self.start_seconds: float | None = None
        self._rules: dict[str, list[tuple[str, ...]]] = {}

    # -------------------------------------------------------------- members

    @property
    def servers(self) -> list[ClusterMember]:
        return [m for m in self.members if m.is_server]

    @property
    def clients(self) -> list[ClusterMember]:
        return [m for m in self.members if not m.is_server]

    def member(self, name: str) -> ClusterMember:
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(name)

    def __repr__(self) -> str:
        return (f"<ConsulCluster {self.block}.0/24 {len(self.servers)} servers "
                f"{len(self.clients)} clients>")

    # -------------------------------------------------------------- lifecycle

    def _make_certs(self) -> None:
        certs = self.workdir / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        ips = [arg for m in self.members for arg in ("-additional-ipaddress", m.ip)]
        for args in (["tls", "ca", "create"],
                     ["tls", "cert", "create", "-server", "-dc", "dc1", *ips]):
            subprocess.run([self.binary, *args], cwd=certs, check=True, capture_output=True,
                           timeout=60)
        for path in certs.iterdir():  # members run under other uids; these are test keys
            path.chmod(0o644)
        self.ca_file = certs / "consul-agent-ca.pem"
        for m in self.members:
            m.ca_file = self.ca_file
            m.server_cert = certs / "dc1-server-consul-0.pem"
            m.server_key = certs / "dc1-server-consul-0-key.pem"

    def _share_binary(self) -> None:
        """Members under other uids may not traverse the binary's directory (``~/.cache`` of
        root is 0700): give them a hard link (or a copy) in the cluster's directory."""
        shared = self.workdir / "bin" / "consul"
        if not shared.exists():
            shared.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(self.binary, shared)
            except OSError:
                shutil.copy2(self.binary, shared)
        for m in self.members:
            m.binary = str(shared)

    def start(self, timeout: float = 60.0) -> ConsulCluster:
        """Start every member at once; return when the cluster is healthy (see class doc)."""
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir.chmod(0o755)  # members run under their own uids
        if self.tls and self.ca_file is None:
            self._make_certs()
        if self.uid_base is not None:
            self._share_binary()
        for m in self.members:
            if not m.port:
                m.port, *m._extra_ports = free_ports(4, m.ip)
        try:
            for m in self.members:
                m.start(timeout, wait=False)
            deadline = started + timeout
            for m in self.members:
                m._wait_ready(max(1.0, deadline - time.monotonic()))
            self.wait_for_leader(max(1.0, deadline - time.monotonic()))
            self.wait_healthy(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def close(self) -> None:
        """Heal partitions, SIGKILL every member (its state is thrown away), remove the files."""
        with contextlib.suppress(PartitionUnsupported):
            self.heal(rejoin=False)
        for m in self.members:
            if m.proc and m.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(m.proc.pid, signal.SIGKILL)
        for m in self.members:
            m.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ConsulCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def restore(self, timeout: float = 60.0) -> None:
        """Undo every injected failure: heal, thaw, start what is stopped, wait until healthy."""
        self.heal()
        for m in self.members:
            if m.frozen:
                m.thaw()
        for m in self.members:
            if not m.running:
                m.start(timeout)
        self.wait_for_leader(timeout)
        self.wait_healthy(timeout)

    def forget_services(self, timeout: float = 30.0) -> int:
        """Deregister every service instance left on a member (by a killed node, or one whose
        leave failed) and wait until the catalog holds none: return how many there were.

        A test's killed node leaves its service behind: its check turns critical one TTL later
        and the agent reaps it a minute after that. Each is a change the agent syncs to the
        servers while holding the lock that every check pass on that agent needs (Consul 1.14
        ``agent/local/state.go``: ``SyncChanges``), so when it falls in the next test's server
        outage, that test's live nodes cannot pass their checks for as long as the sync waits
        for a leader. Call between tests, with every member running and in contact.
        """
        deadline = time.monotonic() + timeout
        left = 0
        for m in self.members:
            status, services = m.api("GET", "/v1/agent/services", timeout=5.0)
            if status != 200:
                raise RuntimeError(f"/v1/agent/services on {m.name}: {status} {services}")
            for service_id in services:
                left += 1
                status, text = m.api("PUT", "/v1/agent/service/deregister/"
                                     + urllib.parse.quote(service_id, safe=""), timeout=5.0)
                if status != 200:
                    raise RuntimeError(f"deregistering {service_id} on {m.name}: {status} {text}")
        leader = self.wait_for_leader(max(1.0, deadline - time.monotonic()))
        while remaining := self._services_in_catalog(leader):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the catalog still holds services or checks within "
                                   f"{timeout}s of their deregistration: {remaining}")
            time.sleep(0.05)
        return left

    def _services_in_catalog(self, observer: ClusterMember) -> dict[str, list[str]]:
        """The service instances and service checks (not ``consul`` nor ``serfHealth``) that
        ``observer``'s catalog holds, by member name; members that hold none are left out."""
        held: dict[str, list[str]] = {}
        for m in self.members:
            status, checks = observer.api("GET", f"/v1/health/node/{m.name}", timeout=5.0)
            if status != 200:
                raise RuntimeError(f"/v1/health/node/{m.name} on {observer.name}: {status} "
                                   f"{checks}")
            ids = [c["CheckID"] for c in checks if c.get("ServiceID")]
            status, node = observer.api("GET", f"/v1/catalog/node/{m.name}", timeout=5.0)
            if status != 200:
                raise RuntimeError(f"/v1/catalog/node/{m.name} on {observer.name}: {status} "
                                   f"{node}")
            ids += [s for s in ((node or {}).get("Services") or {}) if s != "consul"]
            if ids:
                held[m.name] = ids
        return held

    # -------------------------------------------------------------- observation

    def leader(self) -> ClusterMember | None:
        """The server a majority of all servers names as Raft leader (asking every server in
        contact), or None."""
        votes: dict[str, int] = {}
        for s in self.servers:
            if not s.in_contact:
                continue
            try:
                status, addr = s.api("GET", "/v1/status/leader", timeout=1.0)
            except (OSError, http.client.HTTPException):
                continue
            if status == 200 and addr:
                votes[addr] = votes.get(addr, 0) + 1
        for s in self.servers:
            if votes.get(s.rpc_address, 0) > len(self.servers) // 2:
                return s
        return None

    def wait_for_leader(self, timeout: float = 30.0,
                        exclude: ClusterMember | None = None) -> ClusterMember:
        """Wait until a leader other than ``exclude`` is elected and takes a KV write."""
        deadline = time.monotonic() + timeout
        last: object = "no leader"
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None and leader is not exclude:
                try:
                    status, last = leader.api("PUT", "/v1/kv/consul-rdzv-harness/leader-probe",
                                              body=leader.name, timeout=2.0)
                    if status == 200 and last is True:
                        return leader
                except (OSError, http.client.HTTPException) as exc:
                    last = exc
            elif leader is exclude and leader is not None:
                last = f"leader is still {leader.name}"
            time.sleep(0.05)
        raise TimeoutError(f"no leader (other than {exclude}) took a KV write within {timeout}s:"
                           f" {last}\n{self.describe()}")

    def members_seen_by(self, observer: ClusterMember) -> dict[str, dict]:
        """``/v1/agent/members`` of ``observer`` by node name, with ``status`` as a word."""
        status, members = observer.api("GET", "/v1/agent/members", timeout=2.0)
        if status != 200:
            raise RuntimeError(f"/v1/agent/members on {observer.name}: {status} {members}")
        return {m["Name"]: {**m, "status": SERF_STATUS.get(m["Status"], str(m["Status"]))}
                for m in members}

    def member_status(self, member: ClusterMember, observer: ClusterMember) -> str | None:
        """How ``observer`` sees ``member``: alive, failed, left, ... (None if unknown)."""
        entry = self.members_seen_by(observer).get(member.name)
        return entry["status"] if entry else None

    def wait_member_status(self, member: ClusterMember, status: str, timeout: float = 30.0,
                           observers: list[ClusterMember] | None = None) -> float:
        """Wait until every observer (default: the servers in contact, but ``member``) sees
        ``member`` with ``status``; return the seconds it took."""
        started = time.monotonic()
        deadline = started + timeout
        seen: dict[str, object] = {}
        while time.monotonic() < deadline:
            obs = observers if observers is not None else [
                s for s in self.servers if s.in_contact and s is not member]
            seen = {}
            for o in obs:
                try:
                    seen[o.name] = self.member_status(member, o)
                except (OSError, http.client.HTTPException, RuntimeError) as exc:
                    seen[o.name] = exc
            if obs and all(v == status for v in seen.values()):
                return time.monotonic() - started
            time.sleep(0.05)
        raise TimeoutError(f"{member.name} not {status!r} within {timeout}s: {seen}\n"
                           + self.describe())

    def wait_healthy(self, timeout: float = 60.0) -> float:
        """Wait until every server in contact names the same leader and sees every member in
        contact ``alive`` at its own address; return the seconds it took."""
        started = time.monotonic()
        deadline = started + timeout
        problem: object = "not checked"
        while time.monotonic() < deadline:
            problem = self._health_problem()
            if problem is None:
                return time.monotonic() - started
            time.sleep(0.05)
        raise TimeoutError(f"cluster not healthy within {timeout}s: {problem}\n"
                           + self.describe())

    def _health_problem(self) -> str | None:
        observers = [s for s in self.servers if s.in_contact]
        if not observers:
            return "no server in contact"
        expected = [m for m in self.members if m.in_contact]
        leaders = set()
        for o in observers:
            try:
                status, leader = o.api("GET", "/v1/status/leader", timeout=2.0)
                seen = self.members_seen_by(o)
            except (OSError, http.client.HTTPException, RuntimeError) as exc:
                return f"{o.name}: {exc!r}"
            if status != 200 or not leader:
                return f"{o.name} has no leader"
            leaders.add(leader)
            for m in expected:
                entry = seen.get(m.name)
                if entry is None or entry["status"] != "alive":
                    return f"{o.name} sees {m.name} {entry['status'] if entry else 'nowhere'}"
                if (entry["Addr"], int(entry["Port"])) != (m.ip, m.serf_port):
                    return f"{o.name} sees {m.name} at {entry['Addr']}:{entry['Port']}"
        if len(leaders) != 1:
            return f"servers disagree on the leader: {sorted(leaders)}"
        return None

    def describe(self) -> str:
        """One line per member: state, and the leader and member view of each server."""
        lines = []
        for m in self.members:
            state = ("stopped" if not m.running else "frozen" if m.frozen else
                     "partitioned" if m.partitioned else "running")
            line = f"  {m.name} {m.ip} http:{m.port} serf:{m.serf_port} {state}"
            if m.is_server and m.reachable:
                try:
                    _, leader = m.api("GET", "/v1/status/leader", timeout=1.0)
                    seen = self.members_seen_by(m)
                    view = " ".join(f"{n}={e['status']}" for n, e in sorted(seen.items()))
                    line += f" leader={leader or '-'} sees: {view}"
                except (OSError, http.client.HTTPException, RuntimeError) as exc:
                    line += f" ({exc!r})"
            lines.append(line)
        return "\n".join(lines)

    # -------------------------------------------------------------- partitions

    def partition(self, *members: ClusterMember) -> None:
        """Cut ``members`` off every other member of the cluster; among themselves they stay in
        contact. Their HTTP API stays reachable from the test (it is not a member).

        How: every member runs under a uid of its own, and ``ip rule`` (policy routing, looked
        up for every packet a socket sends, loopback included) refuses what a partitioned
        member's uid sends to the cluster's /24 and what the other members' uids send to its
        address. Answers to the test process go to 127.0.0.1 and its own uid is not selected.
        Needs root and ``ip``; raises :class:`PartitionUnsupported` otherwise. :meth:`heal`
        undoes it; :meth:`close` heals whatever is left.
        """
        if not members:
            raise ValueError("partition() needs at least one member")
        if self.uid_base is None:
            raise PartitionUnsupported(
                "partitions need members under separate uids (the harness must run as root)")
        if not shutil.which("ip") and not os.access("/usr/sbin/ip", os.X_OK):
            raise PartitionUnsupported("partitions need the `ip` command (iproute2)")
        _ensure_local_rule_moved()
        all_uids = f"{self.uid_base}-{self.uid_base + _UIDS_PER_CLUSTER - 1}"
        for m in members:
            if m.name in self._rules:
                raise ValueError(f"{m.name} is already partitioned")
            uid = f"{m.uid}-{m.uid}"
            rules = [("pref", str(PARTITION_ALLOW_PREF), "uidrange", uid, "to", f"{g.ip}/32",
                      "lookup", "local") for g in members]
            rules += [
                ("pref", str(PARTITION_DENY_PREF), "uidrange", uid,
                 "to", f"{self.block}.0/24", "prohibit"),
                ("pref", str(PARTITION_DENY_PREF), "uidrange", all_uids,
                 "to", f"{m.ip}/32", "prohibit"),
            ]
            self._rules[m.name] = []
            for rule in rules:
                _ip_rule("add", *rule)
                self._rules[m.name].append(rule)
            m.partitioned = True

    def heal(self, *members: ClusterMember, rejoin: bool = True) -> None:
        """Undo :meth:`partition` for ``members`` (default: all partitioned members).

        Raft needs nothing more: a healed server follows the leader within one heartbeat. Serf
        does: the others declared the member dead and gossiped that while it was cut off, so it
        learns (and refutes) it only at memberlist's next push/pull or serf's reconnect, each
        every 30 s, which Consul does not let us shorten. With ``rejoin`` (default) each healed
        member that runs is asked to join the servers (``PUT /v1/agent/join``, what an operator
        would do), which exchanges state at once: it is ``alive`` again within a second or two.
        ``rejoin=False`` leaves the recovery to Consul (up to about a minute).
        """
        names = [m.name for m in members] if members else list(self._rules)
        for name in names:
            for rule in self._rules.pop(name, []):
                _ip_rule("del", *rule, check=False)
            self.member(name).partitioned = False
        if not rejoin:
            return
        for name in names:
            m = self.member(name)
            if m.reachable:
                self.rejoin(m)

    def rejoin(self, member: ClusterMember) -> None:
        """Ask ``member`` to join every other server in contact (``/v1/agent/join``, best
        effort: a refused join is left to Consul's own reconnection)."""
        for s in self.servers:
            if s is member or not s.in_contact:
                continue
            with contextlib.suppress(OSError, http.client.HTTPException):
                member.api("PUT", f"/v1/agent/join/{s.serf_address}", timeout=5.0)

