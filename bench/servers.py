"""The rendezvous servers the benchmark starts and stops: one fresh server per run.

* consul  - ``consul agent -dev`` from :class:`consul_rdzv.testing.ConsulAgent` (in-memory Raft,
  127.0.0.1, free ports). The harness config already carries
  ``limits { http_max_conns_per_client = 8192 }`` (Consul's default is 200 connections per client
  IP, which 1024 nodes on one loopback address would exceed); :meth:`ConsulServer.start` checks it.
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
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

HTTP_LIMIT_LINE = "limits { http_max_conns_per_client = 8192 }"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process (from /proc), or None."""
    if not pid:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


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
    name = "consul"

    @property
    def pid(self) -> int | None:
        return self.agent.proc.pid if self.agent.proc else None

    def __init__(self) -> None:
        from consul_rdzv.testing import ConsulAgent

        self.agent = ConsulAgent()

    def start(self) -> str:
        self.agent.start()
        hcl = (self.agent.workdir / "agent.hcl").read_text()
        if HTTP_LIMIT_LINE not in hcl:  # pragma: no cover - the harness default changed
            self.agent.close()
            raise RuntimeError(f"ConsulAgent no longer writes {HTTP_LIMIT_LINE!r}; pass it as "
                               "extra_hcl in bench/servers.py.")
        return self.agent.address

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

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-etcd-", dir=base))
        self.port = 0

    def start(self, timeout: float = 30.0) -> str:
        self.port, peer = free_port(), free_port()
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
