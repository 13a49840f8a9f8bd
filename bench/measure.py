"""What the long-run tools measure of a process and of Consul: threads, fds (by kind), RSS
and CPU from /proc; a run's keys, sessions and instances and an agent's request counters from
Consul; the machine. Shared by ``bench.soak`` and ``bench.flat``."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

#: Consul's HTTP metric path of a TTL check pass (a cost per second, counted apart).
CHECK_PASS = "PUT v1_agent_check_pass_"


# --------------------------------------------------------------------------- /proc

def proc_stats(pid: int | None) -> dict | None:
    """Threads, open fds, RSS (MB) and CPU seconds of a live process (from /proc), or None."""
    if not pid:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith("Z"):
        return None
    try:
        threads = int(fields["Threads"])
        rss = int(fields.get("VmRSS", "0 kB").split()[0]) / 1024
        cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    except (KeyError, ValueError, IndexError):
        return None
    return {"pid": pid, "threads": threads, "fds": fds, "rss_mb": round(rss, 1),
            "cpu_s": round(cpu, 2)}


def fd_kinds(pid: int, consul_ports: set[int]) -> dict[str, int] | None:
    """What a process's open fds are: TCP connections to Consul (``consul``, remote port one of
    ``consul_ports``), listening sockets (``listen``: a trainer store), other TCP connections
    (``tcp``: trainer-store connections), other sockets, pipes, anon inodes, files."""
    sockets: dict[str, tuple[int, str]] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9:
                sockets[cols[9]] = (int(cols[2].rsplit(":", 1)[1], 16), cols[3])
    kinds: Counter[str] = Counter()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            remote_port, state = sockets.get(target[8:-1], (None, ""))
            if state == "0A":
                kinds["listen"] += 1
            elif remote_port in consul_ports:
                kinds["consul"] += 1
            elif remote_port is not None:
                kinds["tcp"] += 1
            else:
                kinds["socket"] += 1
        elif target.startswith("pipe:["):
            kinds["pipe"] += 1
        elif target.startswith("anon_inode:"):
            kinds["anon"] += 1
        else:
            kinds["file"] += 1
    return dict(sorted(kinds.items()))


def pool_size() -> int:
    """Keep-alive connections a node's ConsulClient keeps at most (its ``pool_size``)."""
    import inspect

    from consul_rdzv.client import ConsulClient

    return int(inspect.signature(ConsulClient.__init__).parameters["pool_size"].default)


def fds_flat(vals: list[dict], nodes: int) -> tuple[bool, str]:
    """Whether a process's fds stayed flat from its first to its last sample: everything but
    its Consul connections no higher, and those within the nodes' keep-alive pools (a pool
    keeps up to ``pool_size`` connections, opened as concurrent requests first need them)."""
    first, last = vals[0], vals[-1]
    text = f"fds {first['fds']}->{last['fds']} (max {max(v['fds'] for v in vals)})"
    kinds0, kinds1 = first.get("fd_kinds"), last.get("fd_kinds")
    if not kinds0 or not kinds1:
        return last["fds"] <= first["fds"], text
    c0, c1 = kinds0.get("consul", 0), kinds1.get("consul", 0)
    o0, o1 = first["fds"] - c0, last["fds"] - c1
    cap = nodes * pool_size()
    return (o1 <= o0 and c1 <= cap,
            f"{text}: Consul connections {c0}->{c1} (keep-alive pools, at most {cap}), the "
            f"rest {o0}->{o1} ({kinds1})")


def children(pid: int, needle: str = "") -> list[int]:
    """Live child processes of ``pid`` whose command line contains ``needle``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != pid:
                continue
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if needle in cmdline:
            found.append(int(entry))
    return sorted(found)


# --------------------------------------------------------------------------- Consul

class ConsulView:
    """Reads what the soak records from one Consul agent (plain HTTP, no consul_rdzv code), and
    counts its own requests by Consul's metric label, so that they can be subtracted."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self.token = token
        self.sent: Counter[str] = Counter()

    def _get(self, path: str, label: str) -> tuple[int, object, int]:
        """(status, JSON body or None, X-Consul-Index) of a GET; 404 is an answer."""
        self.sent[f"GET {label}"] += 1
        req = urllib.request.Request(f"{self.url}{path}")
        if self.token:
            req.add_header("X-Consul-Token", self.token)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                body = resp.read()
                return resp.status, json.loads(body) if body else None, \
                    int(resp.headers.get("X-Consul-Index") or 0)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            return 404, None, int(exc.headers.get("X-Consul-Index") or 0)

    def metrics_text(self) -> str:
        """The agent's Prometheus metrics (Consul does not count these requests)."""
        req = urllib.request.Request(f"{self.url}/v1/agent/metrics?format=prometheus")
        if self.token:
            req.add_header("X-Consul-Token", self.token)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.read().decode()

    def metrics(self) -> dict:
        """Request counts by ``METHOD path`` (``consul_api_http_count``, without the metrics
        requests), goroutines, and the tombstone reaps this agent's FSM applied."""
        counts: dict[str, float] = {}
        gauges: dict[str, float] = {}
        for line in self.metrics_text().splitlines():
            if line.startswith("consul_api_http_count{"):
                labels, value = line.rsplit(" ", 1)
                fields = dict(part.split("=", 1)
                              for part in labels[len("consul_api_http_count{"):-1].split(","))
                method = fields.get("method", "").strip('"')
                path = fields.get("path", "").strip('"')
                if path != "v1_agent_metrics":
                    key = f"{method} {path}"
                    counts[key] = counts.get(key, 0.0) + float(value)
            elif line.startswith("go_goroutines "):
                gauges["goroutines"] = float(line.split()[1])
            elif line.startswith("consul_fsm_tombstone_count"):
                # consul_fsm_tombstone_count{op="reap"} N (plus an unlabelled 0 series)
                gauges["reaps"] = gauges.get("reaps", 0.0) + float(line.rsplit(" ", 1)[1])
        return {"counts": counts, "goroutines": gauges.get("goroutines"),
                "tombstone_reaps": gauges.get("reaps")}

    def sessions(self) -> list[dict]:
        _, body, _ = self._get("/v1/session/list", "v1_session_list")
        return list(body or [])

    def run_state(self, key_prefix: str, run_id: str, sessions: list[dict]) -> dict:
        """One run's keys, member keys, members-prefix index, sessions and service instances."""
        prefix = f"{key_prefix}/{run_id}"
        _, keys, _ = self._get(f"/v1/kv/{prefix}/?keys", "v1_kv_")
        _, members, members_index = self._get(f"/v1/kv/{prefix}/members/?keys", "v1_kv_")
        _, services, _ = self._get(f"/v1/catalog/service/torchelastic-{run_id}",
                                   "v1_catalog_service_")
        mine = [s for s in sessions if s.get("Name", "").startswith(f"consul-rdzv {run_id} ")]
        return {"keys": len(keys or []), "members": len(members or []),
                "members_index": members_index, "sessions": len(mine),
                "sessions_ended": sum(1 for s in mine if s["Name"].endswith(" ended")),
                "sessions_history": sum(1 for s in mine if s["Name"].endswith(" history")),
                "session_names": sorted(s["Name"] for s in mine),
                "services": len(services or []), "key_names": sorted(keys or [])}


def machine() -> dict:
    import importlib.metadata as md

    from bench import servers

    mem = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 1024 / 1024, 1)
    info = {"cores": os.cpu_count(), "cpu": servers.cpu_model(), "mem_gb": mem,
            "python": platform.python_version(), "platform": platform.platform(),
            "consul": servers.ConsulServer.version()}
    with contextlib.suppress(md.PackageNotFoundError):
        info["torch"] = md.version("torch")
    return info
