"""HTTP/1.1 to one Consul agent: a thread-safe keep-alive pool of sockets, with timeouts and TLS.

This module only moves bytes: what Consul's answers mean is :mod:`consul_rdzv.client`'s job.
Why not urllib3 or ``http.client`` (docs/consul.md, "Why our own client"): on a machine that
hosts many nodes, the client's CPU per request is the rendezvous' cost. A ``GET /v1/kv`` of a
small key cost 141 us of CPU through a urllib3 pool here, 71-83 us through a bare
``http.client`` connection (a third of it its header parser, the ``email`` package) and 17 us
as a request written to a socket and an answer read from it as below.

What is spoken, and nothing else (the agent is Go's ``net/http`` server):

* a request is one write: request line, ``Host``, the caller's headers, ``Content-Length`` when
  there is a body, the body;
* an answer is a status line, header lines up to an empty one (names case-insensitive, at most
  :data:`MAX_HEADER_LINES` lines of :data:`MAX_LINE` bytes), then a body of ``Content-Length``
  bytes, or ``chunked`` (chunk sizes in hex, extensions and trailers skipped), or, with
  neither, everything up to the end of the connection (Go's HTTP/1.0 answer to plain HTTP on a
  TLS port); 1xx answers are skipped; 204 and 304 have no body;
* a connection is reused (keep-alive) unless the answer said ``Connection: close``, was
  HTTP/1.0 without ``keep-alive``, or had no length; one found readable while idle (the server
  closed it, or sent what nobody asked for) is dropped before use, so a request is not sent on
  a connection the server has already given up;
* at most ``maxsize`` idle connections are kept; more threads at once get connections of their
  own, closed after use;
* the connect timeout covers the TCP connect and the TLS handshake, the read timeout each wait
  for the socket afterwards (a blocking query's caller passes its wait plus slack);
* TLS: ``verify`` is a CA file or directory, True (the system's CAs) or False (no verification:
  logged once per pool, as a warning); ``server_name`` is the name the certificate must carry
  and the SNI sent, when it is not the host connected to.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import BinaryIO, overload
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

#: Bounds on an answer's head: a server that is not HTTP cannot make us read forever.
MAX_LINE = 65536
MAX_HEADER_LINES = 200


class TransportError(Exception):
    """No answer: refused, reset, closed early, timed out, not HTTP, or the pool was closed."""


class TLSError(TransportError):
    """The TLS handshake failed (a certificate not trusted or not for this name, no TLS)."""


class AddressError(ValueError):
    """The base URL cannot be connected to (scheme, host or port)."""


class Headers(dict):
    """An answer's headers by lower-cased name; ``get`` and ``[]`` take any case."""

    @overload  # type: ignore[override]
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        return super().get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())


@dataclass(frozen=True)
class Answer:
    """One HTTP answer, read in full."""

    status: int
    headers: Headers
    body: bytes


def tls_context(verify: bool | str, client_cert: tuple[str, str] | None) -> ssl.SSLContext:
    """The TLS settings of one Consul address (``ssl`` errors for files it cannot load)."""
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif isinstance(verify, str):
        if os.path.isdir(verify):
            context = ssl.create_default_context(capath=verify)
        else:
            context = ssl.create_default_context(cafile=verify)
    else:
        context = ssl.create_default_context()
    if client_cert:
        context.load_cert_chain(*client_cert)
    return context


class _Connection:
    """One socket to the agent and the buffered reader of its answers."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader: BinaryIO = sock.makefile("rb")

    def close(self) -> None:
        try:
            self.reader.close()
        finally:
            self.sock.close()


def _readable(sock: socket.socket) -> bool:
    """An idle keep-alive connection with something to read was closed (or spoken to) by the
    server: it must not carry a request. ``poll``, not ``select``: a process hosting many
    nodes has descriptors above 1023."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class Pool:
    """Keep-alive connections to the one address of ``url`` (``http://`` or ``https://``)."""

    def __init__(self, url: str, *, maxsize: int = 8, tls: ssl.SSLContext | None = None,
                 server_name: str | None = None) -> None:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError as exc:
            raise AddressError(f"invalid port ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise AddressError("expected http(s)://host:port")
        https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if https else 80)
        self.maxsize = maxsize
        self._tls = tls or (tls_context(True, None) if https else None)
        self._server_name = server_name
        self._idle: list[_Connection] = []
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_line = f"Host: {host}:{self.port}\r\n"
        self._lock = threading.Lock()
        self._closed = False
        if self._tls is not None and self._tls.verify_mode == ssl.CERT_NONE:
            logger.warning("TLS certificate verification is off for Consul at %s:%d "
                           "(CONSUL_HTTP_SSL_VERIFY=false): anyone on the path can read and "
                           "change the rendezvous' traffic.", self.host, self.port)

    def _connect(self, connect_timeout: float) -> _Connection:
        logger.debug("New connection to Consul at %s:%d.", self.host, self.port)
        sock = socket.create_connection((self.host, self.port), timeout=connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock,
                                             server_hostname=self._server_name or self.host)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock)

    def _take(self) -> _Connection | None:
        with self._lock:
            if self._closed:
                raise TransportError("the client was closed")
            while self._idle:
                conn = self._idle.pop()
                if not _readable(conn.sock):
                    return conn
                conn.close()
        return None

    def _give_back(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.maxsize:
                self._idle.append(conn)
                return
        conn.close()

    def request(self, method: str, target: str, *, body: bytes | None, headers: dict[str, str],
                connect_timeout: float, read_timeout: float) -> Answer:
        """Send one request and read its whole answer; TransportError when none came."""
        if any(c in target for c in " \r\n"):
            raise ValueError(f"request target {target!r} holds a space or a line break")
        head = [f"{method} {target} HTTP/1.1\r\n", self._host_line]
        head.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        if body is not None or method in ("PUT", "POST"):
            head.append(f"Content-Length: {len(body or b'')}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + (body or b"")
        conn = self._take()
        try:
            if conn is None:
                conn = self._connect(connect_timeout)
            conn.sock.settimeout(read_timeout)
            conn.sock.sendall(data)
            answer, keep = _read_answer(conn.reader)
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, ssl.SSLError) and not isinstance(exc, _TLS_EOF):
                # Not trusted, not for this name, no TLS on the port, a client certificate
                # refused (TLS 1.3 says so at the first read, not in the handshake).
                raise TLSError(str(exc)) from exc
            if isinstance(exc, OSError):
                raise TransportError(_describe(exc)) from exc
            raise
        if keep:
            self._give_back(conn)
        else:
            conn.close()
        logger.debug("%s %s: HTTP %d, %d bytes.", method, target.split("?", 1)[0],
                     answer.status, len(answer.body))
        return answer

    def close(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _line(reader: BinaryIO) -> bytes:
    line = reader.readline(MAX_LINE + 1)
    if len(line) > MAX_LINE:
        raise TransportError(f"an answer line longer than {MAX_LINE} bytes: not Consul's HTTP")
    if not line:
        raise TransportError("the server closed the connection without an answer")
    return line


def _read_answer(reader: BinaryIO) -> tuple[Answer, bool]:
    """Read one answer; also whether the connection may carry another request."""
    while True:
        status_line = _line(reader)
        version, _, rest = status_line.partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or not code.isdigit():
            raise TransportError(f"not an HTTP answer: {status_line[:80]!r}")
        status = int(code)
        headers = Headers()
        for _ in range(MAX_HEADER_LINES):
            line = _line(reader)
            if line in (b"\r\n", b"\n"):
                break
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise TransportError(f"a malformed header line: {line[:80]!r}")
            key = name.strip().lower()
            value = value.strip()
            headers[key] = f"{dict.get(headers, key)}, {value}" if key in headers else value
        else:
            raise TransportError(f"more than {MAX_HEADER_LINES} header lines: not Consul's HTTP")
        if not 100 <= status < 200:
            break  # (a 1xx answer is followed by the real one)
    connection = (headers.get("connection") or "").lower()
    keep = "close" not in connection if version == b"HTTP/1.1" else "keep-alive" in connection
    if status in (204, 304):
        return Answer(status, headers, b""), keep
    if "chunked" in (headers.get("transfer-encoding") or "").lower():
        return Answer(status, headers, _read_chunked(reader)), keep
    length = headers.get("content-length")
    if length is None:
        return Answer(status, headers, reader.read()), False  # up to the end of the connection
    try:
        size = int(length)
    except ValueError:
        raise TransportError(f"a malformed Content-Length: {length!r}") from None
    body = reader.read(size)
    if len(body) != size:
        raise TransportError(f"the connection closed after {len(body)} of {size} bytes")
    return Answer(status, headers, body), keep


def _read_chunked(reader: BinaryIO) -> bytes:
    parts = []
    while True:
        size_line = _line(reader).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise TransportError(f"a malformed chunk size: {size_line[:40]!r}") from None
        if size == 0:
            break
        chunk = reader.read(size)
        if len(chunk) != size:
            raise TransportError(f"the connection closed inside a chunk ({len(chunk)} of {size})")
        parts.append(chunk)
        _line(reader)  # the CRLF after the chunk
    for _ in range(MAX_HEADER_LINES):  # trailers, up to the empty line
        if _line(reader) in (b"\r\n", b"\n"):
            return b"".join(parts)
    raise TransportError(f"more than {MAX_HEADER_LINES} trailer lines: not Consul's HTTP")


#: A TLS connection cut without its close alert: the peer went away, as a reset would say.
_TLS_EOF = (ssl.SSLEOFError, ssl.SSLZeroReturnError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):  # socket.timeout too
        return "timed out"
    return str(exc) or type(exc).__name__
