"""A node's metrics in Prometheus' format (opt-in: the ``metrics_port`` setting).

With ``metrics_port`` set, each node serves ``/metrics`` over HTTP (port 0: any free port, logged)
with the standard client library, ``prometheus-client`` (the optional extra
``consul-rdzv[metrics]``: the package itself has no runtime dependency). Without
``metrics_port`` nothing here runs and the library is never imported.

Every metric carries the labels ``run_id`` and ``node_id`` (one value each per node); the other
labels take values from fixed sets (:data:`RESTART_CAUSES`, :data:`ENDPOINTS`, :data:`STATUSES`),
so a node exports a bounded number of series whatever happens. The metrics cost no Consul
request: they count what the node does anyway (the client's one hook, the heartbeat's passes,
the rendezvous' own calls). docs/observability.md is the reference.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

#: Why a node entered a new rendezvous after a round it trained in (``restarts_total{cause}``):
#:
#: * ``departure``: a participant of the round is gone (it died, left or was drained: its
#:   member key vanished; a survivor cannot tell these apart without reading more of Consul);
#: * ``rejoin``: a participant asked for a new round (its workers failed and restarted);
#: * ``spare``: nodes outside the round were waiting (torchrun restarts to admit them);
#: * ``health``: this node lost its own registration (its check lapsed, its session was
#:   invalidated, its agent restarted);
#: * ``local``: none of those: this node's own workers failed, or its caller asked.
RESTART_CAUSES = ("departure", "rejoin", "spare", "health", "local")
#: The endpoint categories of Consul requests (the first path segment after ``/v1/``); any
#: other is counted as ``other``.
ENDPOINTS = ("kv", "txn", "session", "agent", "health", "catalog", "status")
#: HTTP statuses counted by code (anything else by class, e.g. ``2xx``); ``error``: no answer
#: (connection refused, reset, timed out).
STATUSES = ("200", "400", "403", "404", "409", "429", "500", "502", "503", "504")
#: Buckets of the rendezvous duration (seconds): from a quick re-form to torchrun's default
#: join timeout (900 s).
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0)
#: Buckets of a heartbeat pass (seconds): answered by the local agent, usually in a millisecond.
PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Every metric name a node exposes (as scraped: counters end in ``_total``; the histograms
#: add ``_bucket``, ``_sum`` and ``_count``, and the library a ``_created`` per counter and
#: histogram).
NODE_METRICS = (
    "consul_rdzv_rounds_joined_total",
    "consul_rdzv_rendezvous_duration_seconds",
    "consul_rdzv_waiting_seconds",
    "consul_rdzv_waited_seconds_total",
    "consul_rdzv_restarts_total",
    "consul_rdzv_heartbeat_pass_seconds",
    "consul_rdzv_heartbeat_failures_total",
    "consul_rdzv_consul_requests_total",
    "consul_rdzv_session_losses_total",
    "consul_rdzv_round",
    "consul_rdzv_world_size",
)
#: Where a node's metrics listen unless ``metrics_host`` says: every interface, as Prometheus'
#: own exporters do (Prometheus scrapes the node from another host).
DEFAULT_HOST = "0.0.0.0"

INSTALL_HINT = ("pip install 'consul-rdzv[metrics]' (or pip install prometheus-client) on "
                "every node that sets metrics_port")


def require_client() -> Any:
    """The ``prometheus_client`` module, or one clear error saying how to get it."""
    try:
        import prometheus_client
    except ImportError:
        raise ValueError(
            "metrics_port is set but the Prometheus client library is not installed: "
            f"{INSTALL_HINT}, or remove metrics_port from --rdzv-conf."
        ) from None
    return prometheus_client


def endpoint_of(path: str) -> str:
    """The bounded endpoint label of a request path (``/v1/kv/...`` -> ``kv``)."""
    parts = path.split("/", 3)
    group = parts[2] if len(parts) > 2 else ""
    return group if group in ENDPOINTS else "other"


def status_of(code: int | None) -> str:
    """The bounded status label of an answer (None: no answer)."""
    if code is None:
        return "error"
    text = str(code)
    return text if text in STATUSES else f"{code // 100}xx"


class NodeMetrics:
    """One node's metrics and the HTTP server that serves them (see the module docstring).

    The counters and histograms are prometheus-client's, in a registry of this node's own
    (two nodes in one process export separately). The methods are called from the threads that
    do the work (the caller's, the heartbeat's, any that sends a Consul request); each is a few
    lock-free updates of the library's values.
    """

    def __init__(self, run_id: str, node_id: str, *, port: int,
                 host: str = DEFAULT_HOST) -> None:
        prom = require_client()
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.run_id = run_id
        self.node_id = node_id
        self.registry = prom.CollectorRegistry(auto_describe=True)
        labels = ("run_id", "node_id")
        reg = self.registry
        self._rounds = prom.Counter(
            "consul_rdzv_rounds_joined", "Rounds this node was sealed into.", labels,
            registry=reg).labels(run_id, node_id)
        self._duration = prom.Histogram(
            "consul_rdzv_rendezvous_duration_seconds",
            "One rendezvous, from its call (next_rendezvous under torchrun) to its return.",
            labels, buckets=ROUND_BUCKETS, registry=reg).labels(run_id, node_id)
        restarts = prom.Counter(
            "consul_rdzv_restarts", "Rendezvous entered after a round this node was in, by why "
            "that round ended.", (*labels, "cause"), registry=reg)
        self._restarts = {c: restarts.labels(run_id, node_id, c) for c in RESTART_CAUSES}
        self._pass = prom.Histogram(
            "consul_rdzv_heartbeat_pass_seconds", "One pass of the node's TTL check (answered "
            "or not).", labels, buckets=PASS_BUCKETS, registry=reg).labels(run_id, node_id)
        self._pass_failures = prom.Counter(
            "consul_rdzv_heartbeat_failures", "Passes of the node's TTL check that failed.",
            labels, registry=reg).labels(run_id, node_id)
        self._requests = prom.Counter(
            "consul_rdzv_consul_requests", "HTTP requests to Consul, by endpoint category and "
            "status.", (*labels, "endpoint", "status"), registry=reg)
        self._request_children: dict[tuple[str, str], Any] = {}
        self._losses = prom.Counter(
            "consul_rdzv_session_losses", "Times this node lost its Consul registration (its "
            "session invalidated, its check gone, replaced or refused).", labels,
            registry=reg).labels(run_id, node_id)
        self._round = prom.Gauge(
            "consul_rdzv_round", "The round this node is in (0: none yet).", labels,
            registry=reg).labels(run_id, node_id)
        self._world = prom.Gauge(
            "consul_rdzv_world_size", "The world size of the round this node is in.", labels,
            registry=reg).labels(run_id, node_id)
        self._lock = threading.Lock()
        self._depth = 0  # nested rendezvous calls (torch's next_rendezvous, then next_round)
        self._waiting_since: float | None = None
        self._waited = 0.0
        metrics = self

        class _Waiting:
            """The time waiting, read at scrape time (it grows while the node waits)."""

            def collect(self) -> Iterator[Any]:
                now, total = metrics.waiting()
                gauge = GaugeMetricFamily(
                    "consul_rdzv_waiting_seconds", "How long the node has been in its current "
                    "rendezvous (0 while it trains).", labels=list(labels))
                gauge.add_metric([run_id, node_id], now)
                yield gauge
                counter = CounterMetricFamily(
                    "consul_rdzv_waited_seconds", "Time spent in rendezvous, all of them "
                    "(the current one included).", labels=list(labels))
                counter.add_metric([run_id, node_id], total)
                yield counter

            def describe(self) -> list[Any]:
                return []

        reg.register(_Waiting())
        try:
            self.server, self._thread = prom.start_http_server(port, addr=host, registry=reg)
        except OSError as exc:
            raise ValueError(
                f"metrics_port={port}: node {node_id} cannot serve its metrics on {host}:{port} "
                f"({exc.strerror or exc}). Choose another metrics_port (0: any free port) or "
                "a metrics_host of this machine."
            ) from None
        self.host = host
        self.port = int(self.server.server_port)
        logger.info("Node %s of run %s serves its metrics on http://%s:%d/metrics.", node_id,
                    run_id, host, self.port)

    @contextlib.contextmanager
    def rendezvous(self) -> Iterator[None]:
        """Around one rendezvous call; nested calls (the torch adapter's, then the protocol's)
        count once, as the outermost."""
        with self._lock:
            self._depth += 1
            outer = self._depth == 1
            if outer:
                self._waiting_since = time.monotonic()
        began = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if outer:
                    self._waiting_since = None
                    self._waited += time.monotonic() - began
            if outer:
                self._duration.observe(time.monotonic() - began)

    def waiting(self) -> tuple[float, float]:
        """(seconds in the current rendezvous, seconds in all of them)."""
        with self._lock:
            since = self._waiting_since
            current = 0.0 if since is None else time.monotonic() - since
            return current, self._waited + current

    def joined(self, round_no: int, world_size: int) -> None:
        self._rounds.inc()
        self._round.set(round_no)
        self._world.set(world_size)

    def restarted(self, cause: str) -> None:
        self._restarts[cause if cause in self._restarts else "local"].inc()

    def heartbeat(self, seconds: float, ok: bool) -> None:
        self._pass.observe(seconds)
        if not ok:
            self._pass_failures.inc()

    def request(self, path: str, code: int | None) -> None:
        """One Consul request answered with ``code`` (None: no answer): the client's hook."""
        key = (endpoint_of(path), status_of(code))
        child = self._request_children.get(key)
        if child is None:
            child = self._requests.labels(self.run_id, self.node_id, *key)
            self._request_children[key] = child
        child.inc()

    def session_lost(self) -> None:
        self._losses.inc()

    def close(self) -> None:
        """Stop serving (the values stay readable in :attr:`registry`)."""
        with contextlib.suppress(Exception):
            self.server.shutdown()
            self.server.server_close()
