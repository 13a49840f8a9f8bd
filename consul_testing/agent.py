"""A dev agent for tests: ACL and TLS variants, and failure injection.

:class:`ConsulAgent` is :class:`consul_rdzv.testing.ConsulAgent` (``consul agent -dev`` on
127.0.0.1, free ports) plus: ``acl=True`` (default deny, a management token handed to the
caller, also the agent token), ``tls=True`` (HTTPS only, CA and certificates made with ``consul
tls``; ``verify_incoming=True`` for mutual TLS), and failure injection: :meth:`~ConsulAgent.kill`,
:meth:`~ConsulAgent.restart` (a dev agent forgets everything), :meth:`~ConsulAgent.freeze` /
:meth:`~ConsulAgent.thaw`.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from consul_rdzv.config import ConsulConfig
from consul_rdzv.testing import ConsulAgent as DevAgent


def acl_hcl(token: str | None) -> list[str]:
    """ACLs on, default deny, ``token`` as the initial management and the agent token."""
    return [
        "acl {",
        "  enabled = true",
        '  default_policy = "deny"',
        "  enable_token_persistence = false",
        f'  tokens {{ initial_management = "{token}" agent = "{token}" }}',
        "}",
    ]


def tls_hcl(ca_file, cert_file, key_file, *, verify_incoming: bool) -> list[str]:
    vi = "true" if verify_incoming else "false"
    return [
        "tls {",
        "  defaults {",
        f'    ca_file = "{ca_file}"',
        f'    cert_file = "{cert_file}"',
        f'    key_file = "{key_file}"',
        f"    verify_incoming = {vi}",
        "  }",
        "  internal_rpc { verify_incoming = false }",
        "}",
    ]


class ConsulAgent(DevAgent):
    """One real ``consul agent -dev`` on 127.0.0.1 with free ports, for tests.

    Use as a context manager or call :meth:`start` / :meth:`stop`. ``extra_hcl`` is appended to
    the generated configuration.
    """

    def __init__(self, *, acl: bool = False, tls: bool = False, verify_incoming: bool = False,
                 extra_hcl: str = "", workdir: str | None = None, node_name: str | None = None,
                 binary: str | None = None, log_level: str = "info", host: str | None = None,
                 http_port: int = 0) -> None:
        super().__init__(extra_hcl=extra_hcl, workdir=workdir, node_name=node_name,
                         binary=binary, log_level=log_level, host=host, http_port=http_port)
        self.acl = acl
        self.tls = tls or verify_incoming
        self.verify_incoming = verify_incoming
        self.management_token = str(uuid.uuid4()) if acl else None
        self.ca_file: Path | None = None
        self.server_cert: Path | None = None
        self.server_key: Path | None = None
        self.client_cert: Path | None = None
        self.client_key: Path | None = None

    # -------------------------------------------------------------- addresses

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def env(self, *, token: bool = True) -> dict[str, str]:
        """``CONSUL_*`` variables that point a process at this agent."""
        env = super().env(token=token)
        if self.tls and self.ca_file:
            env["CONSUL_CACERT"] = str(self.ca_file)
        if self.verify_incoming and self.client_cert:
            env["CONSUL_CLIENT_CERT"] = str(self.client_cert)
            env["CONSUL_CLIENT_KEY"] = str(self.client_key)
        return env

    def config(self, **overrides) -> ConsulConfig:
        kwargs = {
            "ca_file": str(self.ca_file) if self.ca_file else None,
            "client_cert": str(self.client_cert) if self.verify_incoming else None,
            "client_key": str(self.client_key) if self.verify_incoming else None,
        }
        kwargs.update(overrides)
        return super().config(**kwargs)

    # -------------------------------------------------------------- HTTP

    def api(self, method: str, path: str, body: bytes | str | dict | list | None = None, *,
            token: bool = True, timeout: float = 2.0) -> tuple[int, Any]:
        """One plain HTTP(S) request to this agent: ``(status, decoded JSON or text)``.

        Independent of :class:`ConsulClient` (no retries, no proxies, one connection per call);
        raises ``OSError`` (refused, timeout) or ``http.client.HTTPException``.
        """
        if self.tls:
            ctx = ssl.create_default_context(cafile=str(self.ca_file))
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self.bind_host, self.port, timeout=timeout, context=ctx)
        else:
            conn = http.client.HTTPConnection(self.bind_host, self.port, timeout=timeout)
        headers = {}
        if token and self.management_token:
            headers["X-Consul-Token"] = self.management_token
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode(errors="replace")

    # -------------------------------------------------------------- configuration

    def _prepare(self) -> None:
        if self.tls:
            self._make_certs()

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

    def _ports(self) -> tuple[int, int]:
        return (-1, self.port) if self.tls else (self.port, -1)

    def _hcl_extra(self) -> list[str]:
        lines = []
        if self.acl:
            lines += acl_hcl(self.management_token)
        if self.tls:
            lines += tls_hcl(self.ca_file, self.server_cert, self.server_key,
                             verify_incoming=self.verify_incoming)
        return lines

    # -------------------------------------------------------------- failure injection

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
                    s.bind((self.host, self.port))
                break
            except OSError:
                time.sleep(0.05)
        self.start(timeout)

    def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOP the agent: it stays reachable at TCP level but answers nothing. Returns once
        every thread of it is stopped (``kill`` returns before the signal has taken effect: on
        a loaded machine the agent could still answer a request sent right after)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not _stopped(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.001)

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)


def _stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (state T in /proc), or it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("T", "t"):
            return False
    return True
