"""The HTTP transport (consul_rdzv/transport.py): keep-alive reuse, stale connections, the idle
bound, timeouts, a closed pool, the answer shapes it reads and the ones it refuses.

The mechanics are checked against a small HTTP server of the test's own (what it does to a
connection is what the test needs: answer and close, answer late) and canned answers written
to a socket; that connections are kept and reused against Consul, and every answer Consul gives
the client (chunked and not, errors, TLS), is checked on real dev agents (here and in
tests/test_client.py).
"""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from rdzv_nodes import wait_for

from consul_rdzv.client import ConsulClient
from consul_rdzv.config import ConsulConfig
from consul_rdzv.errors import ConsulConfigError
from consul_rdzv.transport import Pool, TransportError, _readable


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless told otherwise

    def do_GET(self) -> None:
        server = self.server
        server.requests.append((self.path, self.client_address[1]))  # type: ignore[attr-defined]
        if self.path.startswith("/slow"):
            time.sleep(float(self.path.split("=", 1)[1]))
        body = self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        if self.path.startswith("/close"):
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        if self.path.startswith("/drop"):
            # Answered as keep-alive, then gone: an idle connection the server closed.
            self.close_connection = True

    def log_message(self, *args) -> None:
        pass


@contextmanager
def _server() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _get(pool: Pool, path: str, *, read_timeout: float = 5.0) -> bytes:
    return pool.request("GET", path, body=None, headers={}, connect_timeout=5.0,
                        read_timeout=read_timeout).body


def _ports(server) -> list[int]:
    return [port for _, port in server.requests]


def test_one_thread_reuses_one_connection():
    with _server() as server:
        pool = Pool(f"http://127.0.0.1:{server.server_port}")
        assert [_get(pool, f"/k{i}") for i in range(5)] == [f"/k{i}".encode() for i in range(5)]
        assert len(set(_ports(server))) == 1, server.requests
        pool.close()


def test_an_answer_with_connection_close_is_not_reused():
    with _server() as server:
        pool = Pool(f"http://127.0.0.1:{server.server_port}")
        _get(pool, "/close")
        _get(pool, "/after")
        assert len(set(_ports(server))) == 2, server.requests
        pool.close()


def test_an_idle_connection_the_server_closed_is_dropped_before_use():
    with _server() as server:
        pool = Pool(f"http://127.0.0.1:{server.server_port}")
        _get(pool, "/drop")  # kept: the answer said keep-alive; then the server closes it
        (idle,) = pool._idle
        wait_for(lambda: _readable(idle.sock), 5, "the server closing the idle connection")
        # The next request must not be sent on the dead connection (no TransportError).
        for _ in range(3):
            assert _get(pool, "/next") == b"/next"
        assert len(set(_ports(server))) == 2, server.requests
        pool.close()


def test_idle_connections_are_bounded_by_maxsize():
    with _server() as server:
        pool = Pool(f"http://127.0.0.1:{server.server_port}", maxsize=2)
        barrier = threading.Barrier(5)

        def call() -> None:
            barrier.wait()
            _get(pool, "/slow=0.2")

        threads = [threading.Thread(target=call) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(set(_ports(server))) == 5  # five at once: five connections
        assert len(pool._idle) == 2  # two kept
        pool.close()
        assert pool._idle == []


def test_a_read_timeout_is_a_transport_error_and_the_connection_is_not_reused():
    with _server() as server:
        pool = Pool(f"http://127.0.0.1:{server.server_port}")
        started = time.monotonic()
        with pytest.raises(TransportError, match="timed out"):
            _get(pool, "/slow=1.5", read_timeout=0.3)
        assert time.monotonic() - started < 1.4
        assert pool._idle == []
        assert _get(pool, "/fine") == b"/fine"
        pool.close()


def test_a_refused_connection_and_a_closed_pool_are_transport_errors():
    with _server() as server:
        port = server.server_port
    pool = Pool(f"http://127.0.0.1:{port}")  # nothing listens there any more
    with pytest.raises(TransportError):
        _get(pool, "/x")
    pool.close()
    with pytest.raises(TransportError, match="closed"):
        _get(pool, "/x")


@contextmanager
def _canned(*answers: bytes) -> Iterator[int]:
    """A TCP server that reads one request head per answer and writes the answer as it is
    (then closes the connection after the last): the answer shapes Consul's Go server sends."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as reader:
            for answer in answers:
                while reader.readline() not in (b"\r\n", b""):
                    pass
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        thread.join(5)


def test_answer_shapes_chunked_continue_and_up_to_the_end_of_the_connection():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Consul-Index: 7\r\n\r\n"
               b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\n")
    continued = (b"HTTP/1.1 100 Continue\r\n\r\n"
                 b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nVary: a\r\nVary: b\r\n\r\nok")
    until_eof = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
    with _canned(chunked, continued, until_eof) as port:
        pool = Pool(f"http://127.0.0.1:{port}")
        first = pool.request("GET", "/a", body=None, headers={}, connect_timeout=5,
                             read_timeout=5)
        assert (first.status, first.body, first.headers.get("X-CONSUL-INDEX")) == \
            (200, b"hello world", "7")
        second = pool.request("PUT", "/b", body=b"{}", headers={}, connect_timeout=5,
                              read_timeout=5)
        assert (second.status, second.body, second.headers["vary"]) == (200, b"ok", "a, b")
        third = pool.request("GET", "/c", body=None, headers={}, connect_timeout=5,
                             read_timeout=5)
        assert third.status == 400 and b"HTTPS server" in third.body
        assert pool._idle == []  # read up to the end: that connection is not reused
        pool.close()


@pytest.mark.parametrize("answer, error", [
    (b"SSH-2.0-OpenSSH_9.2\r\n", "not an HTTP answer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed after 5 of 10"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
    (b"", "closed the connection without an answer"),
])
def test_an_answer_that_is_not_well_formed_http_is_a_transport_error(answer, error):
    with _canned(answer) as port:
        pool = Pool(f"http://127.0.0.1:{port}")
        with pytest.raises(TransportError, match=error):
            _get(pool, "/x")
        assert pool._idle == []
        pool.close()


def test_an_address_that_cannot_be_connected_to_is_a_config_error():
    with pytest.raises(ConsulConfigError, match="Invalid Consul URL"):
        ConsulClient(ConsulConfig(url="http://127.0.0.1:99999"))
    with pytest.raises(ConsulConfigError, match="Invalid Consul URL"):
        ConsulClient(ConsulConfig(url="unix:///tmp/consul.sock"))


def test_tls_files_that_do_not_load_are_one_config_error_when_the_client_is_made(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    with pytest.raises(ConsulConfigError, match="Cannot load the TLS files") as info:
        ConsulClient(ConsulConfig(url="https://127.0.0.1:8501", verify=str(ca)))
    assert "CONSUL_CACERT" in str(info.value)


def test_the_client_keeps_one_connection_per_thread_to_a_real_agent(agent, prefix, caplog):
    caplog.set_level(logging.DEBUG, logger="consul_rdzv.transport")
    client = ConsulClient(ConsulConfig(url=agent.url))
    try:
        client.kv_put(f"{prefix}/k", b"v")
        for _ in range(20):
            assert client.kv_get(f"{prefix}/k").data.value == b"v"
    finally:
        client.close()
    opened = [r for r in caplog.records if r.getMessage().startswith("New connection")]
    assert len(opened) == 1, [r.getMessage() for r in opened]
