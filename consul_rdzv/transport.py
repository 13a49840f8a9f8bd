"""HTTP/1.1 to one Consul agent: a thread-safe keep-alive pool of the standard library's
``http.client`` connections, with timeouts and TLS.

This module only moves bytes: what Consul's answers mean is :mod:`consul_rdzv.client`'s job.
Why not urllib3 (docs/consul.md, "Why our own client"): on a machine that hosts many nodes,
the client's CPU per request is the rendezvous' cost. A ``GET /v1/kv`` through a urllib3 pool
cost 141 us of CPU here, through a bare ``http.client`` connection 71 us; what urllib3 adds
around ``http.client`` (a second header dict, its response object, retry and redirect
plumbing) is what this module leaves out.

Rules, the ones urllib3's pool followed for us:

* a connection is reused (keep-alive) unless the answer said ``Connection: close``; one found
  readable while idle (the server closed it, or sent what nobody asked for) is dropped before
  use, so a request is not sent on a connection the server has already given up;
* at most ``maxsize`` idle connections are kept; more threads at once get connections of their
  own, closed after use;
* the connect timeout covers the TCP connect and the TLS handshake, the read timeout each wait
  for the socket afterwards (a blocking query's caller passes its wait plus slack);
* TLS: ``verify`` is a CA file or directory, True (the system's CAs) or False (no verification:
  logged once per pool, as a warning); ``server_name`` is the name the certificate must carry
  and the SNI sent, when it is not the host connected to.
"""

from __future__ import annotations

import http.client
import logging
import os
import select
import socket
import ssl
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)


class TransportError(Exception):
    """No answer: refused, reset, closed early, timed out, or the pool was closed."""


class TLSError(TransportError):
    """The TLS handshake failed (a certificate not trusted or not for this name, no TLS)."""


class AddressError(ValueError):
    """The base URL cannot be connected to (scheme, host or port)."""


@dataclass(frozen=True)
class Answer:
    """One HTTP answer, read in full. ``headers`` look up names case-insensitively
    (``.get``); iterating them gives the names, ``.items()`` the pairs."""

    status: int
    headers: http.client.HTTPMessage
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


class _TLSConnection(http.client.HTTPSConnection):
    """An HTTPS connection whose certificate name (and SNI) may differ from the host."""

    def __init__(self, host: str, port: int, *, timeout: float, context: ssl.SSLContext,
                 server_name: str | None) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(  # type: ignore[attr-defined]
            self.sock, server_hostname=self._server_name or self.host)


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
        self.host = parts.hostname
        self.port = port or (443 if parts.scheme == "https" else 80)
        self.https = parts.scheme == "https"
        self.maxsize = maxsize
        self._tls = tls or (tls_context(True, None) if self.https else None)
        self._server_name = server_name
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False
        if self._tls is not None and self._tls.verify_mode == ssl.CERT_NONE:
            logger.warning("TLS certificate verification is off for Consul at %s:%d "
                           "(CONSUL_HTTP_SSL_VERIFY=false): anyone on the path can read and "
                           "change the rendezvous' traffic.", self.host, self.port)

    def _new(self, connect_timeout: float) -> http.client.HTTPConnection:
        if self._tls is not None:
            return _TLSConnection(self.host, self.port, timeout=connect_timeout,
                                  context=self._tls, server_name=self._server_name)
        return http.client.HTTPConnection(self.host, self.port, timeout=connect_timeout)

    def _take(self) -> http.client.HTTPConnection | None:
        with self._lock:
            if self._closed:
                raise TransportError("the client was closed")
            while self._idle:
                conn = self._idle.pop()
                if conn.sock is not None and not _readable(conn.sock):
                    return conn
                conn.close()
        return None

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.maxsize:
                self._idle.append(conn)
                return
        conn.close()

    def request(self, method: str, target: str, *, body: bytes | None, headers: dict[str, str],
                connect_timeout: float, read_timeout: float) -> Answer:
        """Send one request and read its whole answer; TransportError when none came."""
        conn = self._take()
        try:
            if conn is None:
                conn = self._new(connect_timeout)
                logger.debug("New connection to Consul at %s:%d.", self.host, self.port)
                conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(read_timeout)
            conn.request(method, target, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, ssl.SSLError) and not isinstance(exc, _TLS_EOF):
                # Not trusted, not for this name, no TLS on the port, a client certificate
                # refused (TLS 1.3 says so at the first read, not in the handshake).
                raise TLSError(str(exc)) from exc
            if isinstance(exc, OSError | http.client.HTTPException):
                raise TransportError(_describe(exc)) from exc
            raise
        if resp.will_close:
            conn.close()
        else:
            self._give_back(conn)
        logger.debug("%s %s: HTTP %d, %d bytes.", method, target.split("?", 1)[0],
                     resp.status, len(data))
        return Answer(resp.status, resp.msg, data)

    def close(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


#: A TLS connection cut without its close alert: the peer went away, as a reset would say.
_TLS_EOF = (ssl.SSLEOFError, ssl.SSLZeroReturnError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):  # socket.timeout too
        return "timed out"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the server closed the connection without an answer"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, OSError) else text
