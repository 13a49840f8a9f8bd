"""``consul-rdzv exporter``: the fleet's runs in Prometheus' format, read from Consul.

One exporter per fleet (per Consul datacenter and key prefix): at each scrape of ``/metrics`` it
reads Consul with the read model of ``consul-rdzv list`` (:mod:`.read`): every run's keys under
the key prefix (one request, or one per run when round histories are kept there:
:meth:`.read.Reader.runs_and_quarantine`) and the health of every consul-rdzv service instance (one
request), and answers with what they say now. It keeps no state between scrapes, so any number
of exporters may run, and one that restarts loses nothing. The nodes' own metrics (the
``metrics_port`` setting, :mod:`consul_rdzv.metrics`) tell what each node did; this tells what
the runs are. docs/observability.md is the reference.

Labels: ``state`` (a run's, from :data:`RUN_STATES`; a node's, from :data:`NODE_STATES`),
``health`` (:data:`HEALTH`) and ``run_id``: one series per run and value of those sets, for the
runs present in Consul (``consul-rdzv gc`` removes the ended ones).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from .. import quarantine
from ..client import KVEntry
from ..errors import ConsulError, RendezvousError
from ..layout import Keys, RunState
from ..planning import active_participants
from .commands import _check_run_id, _reader
from .read import _STATUS_ORDER, Reader, run_state
from .text import CliError, one_line

logger = logging.getLogger(__name__)

#: The states of a run (:func:`.read.run_state`).
RUN_STATES = ("training", "re-forming", "waiting", "closed", "abandoned", "starting", "invalid")
#: A node of a run (a member key) is in the current round, or waiting outside it.
NODE_STATES = ("in_round", "waiting")
#: The health of a service instance: the worst of its checks.
HEALTH = tuple(_STATUS_ORDER)
#: Where the exporter listens unless --bind/--port say.
DEFAULT_BIND = "0.0.0.0"
DEFAULT_PORT = 9469

#: Every metric name the exporter exposes (as scraped).
EXPORTER_METRICS = (
    "consul_rdzv_exporter_up",
    "consul_rdzv_exporter_read_seconds",
    "consul_rdzv_runs",
    "consul_rdzv_run_state",
    "consul_rdzv_run_nodes",
    "consul_rdzv_run_instances",
    "consul_rdzv_run_round",
    "consul_rdzv_run_world_size",
    "consul_rdzv_run_seconds_since_round",
    "consul_rdzv_quarantined_hosts",
)


def quarantined(entries: list[KVEntry], now: float) -> int:
    """How many hosts are quarantined now (docs/health.md, "Quarantine")."""
    count = 0
    for entry in entries:
        with contextlib.suppress(RendezvousError, ValueError):
            count += bool(quarantine.active(quarantine.decode(entry), now))
    return count


def fleet_and_hosts(reader: Reader, key_prefix: str, now: float) -> tuple[dict[str, Any], int]:
    """What the exporter exposes, read from Consul now (two requests, or one more per run when
    round histories are kept under the prefix): per run its state, its nodes by state, its
    instances by health, its round, world size and when it was sealed; and how many hosts are
    quarantined."""
    found, hosts = reader.runs_and_quarantine()
    health = reader.instance_health()
    runs: dict[str, dict[str, Any]] = {}
    for run_id in sorted(set(found) | set(health)):
        counts = health.get(run_id, dict.fromkeys(HEALTH, 0))
        state: RunState | None = None
        invalid = None
        try:
            state = RunState.parse(Keys(f"{key_prefix}/{run_id}"), found.get(run_id, []))
        except RendezvousError as exc:
            invalid = one_line(exc)
        current = state.round if state else None
        sealed = current if current and current.ranks else None
        active = set(active_participants(state)) if state else set()
        members = list(state.members) if state else []
        runs[run_id] = {
            "state": run_state(state, invalid, passing=counts.get("passing", 0)),
            "nodes": {"in_round": sum(1 for m in members if m in active),
                      "waiting": sum(1 for m in members if m not in active)},
            "instances": counts,
            "round": sealed.round if sealed else 0,
            "world_size": sealed.world_size if sealed else 0,
            "since_round": (max(0.0, now - sealed.sealed_at)
                            if sealed and sealed.sealed_at else None),
        }
    return runs, quarantined(hosts, now)


class FleetCollector:
    """A prometheus-client collector that reads Consul at each scrape (see the module)."""

    def __init__(self, reader: Reader, key_prefix: str) -> None:
        self.reader = reader
        self.key_prefix = key_prefix
        self._lock = threading.Lock()  # one read of Consul at a time

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        began = time.monotonic()
        with self._lock:
            try:
                runs, hosts = fleet_and_hosts(self.reader, self.key_prefix, time.time())
                up = 1.0
            except (ConsulError, CliError) as exc:
                logger.warning("consul-rdzv exporter could not read Consul at %s: %s",
                               self.reader.url, one_line(exc))
                runs, hosts, up = {}, 0, 0.0
        yield _gauge("consul_rdzv_exporter_up", "1 if the last read of Consul succeeded.", [],
                     [([], up)])
        yield _gauge("consul_rdzv_exporter_read_seconds", "How long the read of Consul took.",
                     [], [([], time.monotonic() - began)])
        if not up:
            return
        by_state = dict.fromkeys(RUN_STATES, 0)
        for run in runs.values():
            by_state[run["state"]] = by_state.get(run["state"], 0) + 1
        yield _gauge("consul_rdzv_quarantined_hosts", "Hosts no run under the key prefix admits "
                     "now (their quarantine, docs/health.md).", [], [([], hosts)])
        yield _gauge("consul_rdzv_runs", "Runs under the key prefix, by state.", ["state"],
                     [([s], n) for s, n in by_state.items()])
        yield _gauge("consul_rdzv_run_state", "1 for a run's current state.",
                     ["run_id", "state"], [([r, v["state"]], 1) for r, v in runs.items()])
        yield _gauge("consul_rdzv_run_nodes", "A run's nodes (member keys) in its current round "
                     "and waiting outside it.", ["run_id", "state"],
                     [([r, s], v["nodes"][s]) for r, v in runs.items() for s in NODE_STATES])
        yield _gauge("consul_rdzv_run_instances", "A run's service instances by health (the "
                     "worst of their checks).", ["run_id", "health"],
                     [([r, h], v["instances"].get(h, 0)) for r, v in runs.items()
                      for h in HEALTH])
        yield _gauge("consul_rdzv_run_round", "A run's current sealed round (0: none).",
                     ["run_id"], [([r], v["round"]) for r, v in runs.items()])
        yield _gauge("consul_rdzv_run_world_size", "The world size of a run's current round.",
                     ["run_id"], [([r], v["world_size"]) for r, v in runs.items()])
        yield _gauge("consul_rdzv_run_seconds_since_round", "Seconds since a run's current "
                     "round was sealed.", ["run_id"],
                     [([r], v["since_round"]) for r, v in runs.items()
                      if v["since_round"] is not None])


def _gauge(name: str, text: str, labels: list[str],
           samples: list[tuple[list[str], float]]) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(name, text, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


def cmd_exporter(args: argparse.Namespace) -> int:
    """``exporter``: serve the fleet's metrics until Ctrl-C or SIGTERM (or ``--timeout``)."""
    _check_run_id(args)
    try:
        import prometheus_client
    except ImportError:
        raise CliError("the exporter needs the Prometheus client library: pip install "
                       "'consul-rdzv[metrics]' (or pip install prometheus-client).") from None
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port {args.port} is not a port (0-65535; 0: any free port).")
    reader = _reader(args)
    reader.probe(args.key_prefix)  # a token that may not read the prefix: fail now, clearly
    registry = prometheus_client.CollectorRegistry(auto_describe=True)
    registry.register(FleetCollector(reader, args.key_prefix))
    try:
        server, _ = prometheus_client.start_http_server(args.port, addr=args.bind,
                                                        registry=registry)
    except OSError as exc:
        raise CliError(f"cannot listen on {args.bind}:{args.port}: {exc.strerror or exc}. "
                       "Choose another --port (0: any free port) or --bind address.") from None
    port = server.server_port
    print(f"consul-rdzv exporter: serving http://{args.bind}:{port}/metrics (the runs under "
          f"{args.key_prefix}/ in Consul at {reader.url}); Ctrl-C stops", flush=True)
    stop = threading.Event()
    with contextlib.suppress(ValueError):  # not the main thread: Ctrl-C and --timeout only
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait(args.timeout)
    finally:
        server.shutdown()
        server.server_close()
    return 0
