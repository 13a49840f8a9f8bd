"""A small HTTP proxy in front of a real Consul agent, for fault injection in tests.

    proxy = ConsulProxy(agent.url).start()      # nodes talk to proxy.address
    proxy.delay_server_rpcs(6.0)                 # every request that needs a Consul server
    proxy.black_hole()                           # accept, never answer (a node cut off)
    proxy.heal()

Requests are forwarded as they are (method, path, query, headers, body; blocking queries
included). ``/v1/agent/...`` requests are answered by the agent itself; every other endpoint we
use (KV, txn, sessions, health, catalog) is a server RPC, which a slow or electing cluster
delays. A black-holed proxy keeps accepting connections and reading requests but never answers,
not even requests sent before the cut (a blocking query in flight), which is what a node sees
when its network path to Consul breaks.
"""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

import urllib3

from consul_rdzv.testing import free_port

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def _forwarding_server(port: int, pool: urllib3.PoolManager, upstream: Callable[[str, str], str],
                       *,
                       before: Callable[[str, str], None] | None = None,
                       after: Callable[[str], None] | None = None,
                       ) -> http.server.ThreadingHTTPServer:
    """An HTTP/1.1 server on 127.0.0.1:``port`` that forwards every request as it is (method,
    path, query, headers, body) to ``upstream(method, path)`` and sends its answer back.

    ``before(method, path)`` runs once the request is read, before it is forwarded;
    ``after(path)`` once the answer is in, before it is sent (the faults of ConsulProxy).
    """

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if before is not None:
                before(self.command, self.path)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            try:
                answer = pool.urlopen(
                    self.command, upstream(self.command, self.path) + self.path, body=body,
                    headers=headers,
                    redirect=False, preload_content=True,
                    timeout=urllib3.Timeout(connect=5, read=400))
            except urllib3.exceptions.HTTPError as exc:
                self.send_error(502, f"proxy: {exc}")
                return
            if after is not None:
                after(self.path)
            self.send_response(answer.status)
            for key, value in answer.headers.items():
                if key.lower() not in _HOP_HEADERS:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(answer.data)))
            self.end_headers()
            self.wfile.write(answer.data)

        do_GET = do_PUT = do_DELETE = do_POST = _forward

        def log_message(self, *args) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        allow_reuse_address = True

        def handle_error(self, request, client_address) -> None:
            pass  # a client that went away mid-request is not the test's business

    return Server(("127.0.0.1", port), Handler)


class ConsulProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.server_delay = 0.0
        self.agent_answer_delay = 0.0
        self.counts: Counter[str] = Counter()
        self._healed = threading.Event()
        self._healed.set()
        self._pool = urllib3.PoolManager(maxsize=256, retries=False)
        self._server: http.server.ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------ faults

    def delay_server_rpcs(self, seconds: float) -> None:
        self.server_delay = seconds

    def delay_agent_answers(self, seconds: float) -> None:
        """Forward ``/v1/agent/...`` requests at once but answer them ``seconds`` late: the
        agent acts on them (a check pass resets its TTL) while the caller times out."""
        self.agent_answer_delay = seconds

    def black_hole(self) -> None:
        self._healed.clear()

    def heal(self) -> None:
        self.server_delay = 0.0
        self.agent_answer_delay = 0.0
        self._healed.set()

    def _before(self, method: str, path: str) -> None:
        self._healed.wait()  # black-holed: hold the request (and the connection)
        self.counts[f"{method} {path.split('?')[0]}"] += 1
        if not path.startswith("/v1/agent/") and self.server_delay:
            time.sleep(self.server_delay)

    def _after(self, path: str) -> None:
        # A cut holds answers already in flight too (a blocking query sent before the cut must
        # not deliver its answer through it).
        self._healed.wait()
        if path.startswith("/v1/agent/") and self.agent_answer_delay:
            time.sleep(self.agent_answer_delay)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> ConsulProxy:
        self._server = _forwarding_server(self.port, self._pool, lambda method, path: self.upstream,
                                          before=self._before, after=self._after)
        self._server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name=f"consul-proxy-{self.port}").start()
        return self

    def close(self) -> None:
        self._healed.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._pool.clear()

    def __enter__(self) -> ConsulProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class RoundRobinProxy:
    """A load balancer in front of several Consul agents: each new TCP connection
    (``per="connection"``, an L4 balancer such as a Kubernetes Service) or each HTTP request
    (``per="request"``, an L7 balancer) goes to the next upstream in turn.

        with RoundRobinProxy([s.url for s in cluster.servers]) as lb:
            client = ConsulClient(ConsulConfig.resolve(address=lb.url, env={}))

    ``counts`` tells how many connections or requests each upstream got; ``routed`` lists
    ``(method, path, index)`` of each (method and path empty per connection). With
    ``route(method, path) -> index`` (per request only), that picks the upstream of each request
    instead of the turn: the luck of a round robin shared with other clients, written down so
    that a test can replay it.
    """

    def __init__(self, upstreams: list[str], *, per: str = "connection",
                 route: Callable[[str, str], int] | None = None) -> None:
        if per not in ("connection", "request"):
            raise ValueError(f"per must be 'connection' or 'request', not {per!r}")
        if route is not None and per != "request":
            raise ValueError("route picks the upstream of each request: use it with per='request'")
        if not upstreams:
            raise ValueError("RoundRobinProxy needs at least one upstream")
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self.per = per
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.route = route
        self.counts: Counter[str] = Counter()
        self.routed: list[tuple[str, str, int]] = []
        self._next = 0
        self._lock = threading.Lock()
        self._pool = urllib3.PoolManager(maxsize=256, retries=False)
        self._listener: socket.socket | None = None
        self._server: http.server.ThreadingHTTPServer | None = None
        self._sockets: set[socket.socket] = set()

    def _pick(self, method: str = "", path: str = "") -> str:
        with self._lock:
            if self.route is not None:
                index = self.route(method, path)
            else:
                index = self._next % len(self.upstreams)
                self._next += 1
            upstream = self.upstreams[index]
            self.counts[upstream] += 1
            self.routed.append((method, path, index))
            return upstream

    # ------------------------------------------------------------------ per connection

    def _accept_loop(self) -> None:
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            host, port = self._pick().split("://", 1)[-1].rsplit(":", 1)
            try:
                upstream = socket.create_connection((host, int(port)), timeout=5)
            except OSError:
                conn.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets.update((conn, upstream))
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
            with self._lock:
                self._sockets.discard(s)

    # ------------------------------------------------------------------ per request

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RoundRobinProxy:
        if self.per == "request":
            self._server = _forwarding_server(self.port, self._pool, self._pick)
            threading.Thread(target=self._server.serve_forever, daemon=True,
                             name=f"round-robin-{self.port}").start()
        else:
            self._listener = socket.create_server(("127.0.0.1", self.port), backlog=512,
                                                  reuse_port=False)
            threading.Thread(target=self._accept_loop, daemon=True,
                             name=f"round-robin-{self.port}").start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()
        self._pool.clear()

    def __enter__(self) -> RoundRobinProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

