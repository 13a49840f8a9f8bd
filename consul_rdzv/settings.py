"""Validated rendezvous settings, and their parsing from torchrun's ``--rdzv-conf`` strings.

All timeouts live here, in seconds. Bad values fail early with a ValueError naming the key.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from .config import parse_bool
from .health import parse_health_checks
from .ranks import POLICIES
from .service import DEFAULT_KEY_PREFIX, MAX_META, MAX_META_VALUE, RESERVED_META
from .service import service_name as default_service_name

logger = logging.getLogger(__name__)

_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_KEY_PREFIX = re.compile(r"^[A-Za-z0-9_.\-/]{1,200}$")
_META_KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
#: A bind address: an IPv4/IPv6 address or a host name.
_HOST = re.compile(r"^[A-Za-z0-9_.:%-]{1,253}$")
#: Consul allows 64 meta pairs per service instance; consul-rdzv uses the reserved ones
#: (service.RESERVED_META, which a node_meta item may not replace).
MAX_NODE_META = MAX_META - len(RESERVED_META)

#: The check TTL: above the longest stall of check passes measured during a Consul leader
#: election with Consul's default Raft timings (docs/deployment.md, "Choosing the timeouts").
HEARTBEAT_TIMEOUT_DEFAULT = 30.0
#: The retry budget per call: above the longest leader election measured with Consul's default
#: Raft timings, counted from a call's first failure (docs/deployment.md).
CONSUL_TIMEOUT_DEFAULT = 60.0


@dataclass(frozen=True)
class RendezvousSettings:
    """Everything one node needs to know about the run it joins.

    ``heartbeat_timeout`` is the TTL of the node's Consul health check: a node that stops passing
    it for that long is dead, its session is invalidated and its member key deleted.
    ``keep_alive_interval`` (default a third of it, at most half of it) is how often the check is
    passed. ``consul_timeout`` is how long a Consul outage is ridden out (retries with backoff)
    before a call gives up with a connection error. ``read_timeout`` (c10d's key) bounds how long
    a member of a sealed round waits to reach the round's trainer store and for every other
    member to check in there; it is also the timeout of that store's operations.

    One owner per timeout: ``join_timeout`` is the deadline of one ``next_round()``;
    ``consul_timeout`` is the client's retry budget per call (counted from its first failure);
    ``close_timeout`` bounds ``close()`` and ``leave()``; ``heartbeat_timeout`` and
    ``keep_alive_interval`` belong to the registration's heartbeat.

    The defaults are chosen for production and measured (``bench/election.py``,
    docs/deployment.md "Choosing the timeouts"): ``heartbeat_timeout`` and ``consul_timeout``
    ride out a Consul leader election with Consul's default Raft timings, and ``join_timeout``
    is torchrun's own default (it injects ``timeout=900``), so a node waits as long under
    torchrun as through this API.

    ``store_port`` (the torch adapter's) pins rank 0's trainer store to a port or a range
    ``(first, last)`` for firewalled hosts; None lets the kernel choose an ephemeral port.

    ``metrics_port`` (None: off) serves the node's metrics in Prometheus' format on that port
    (0: any free port, logged), bound to ``metrics_host`` (default every interface);
    :mod:`consul_rdzv.metrics`, which needs the ``metrics`` extra.
    """

    run_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    key_prefix: str = DEFAULT_KEY_PREFIX
    service_name: str | None = None
    join_timeout: float = 900.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT_DEFAULT
    keep_alive_interval: float | None = None
    consul_timeout: float = CONSUL_TIMEOUT_DEFAULT
    read_timeout: float = 60.0
    watch_wait: float = 300.0
    closed_retention: float = 600.0
    history_retention: float = 86400.0
    storm_rounds: int = 0
    storm_window: float = 600.0
    storm_min_round: float = 60.0
    rank_policy: str = "stable"
    topology_keys: tuple[str, ...] = ()
    node_rank: int | None = None
    node_meta: Mapping[str, str] = field(default_factory=dict)
    store_port: tuple[int, int] | None = None
    metrics_port: int | None = None
    metrics_host: str | None = None
    #: Node-level Consul checks whose critical state holds this node out of rounds (names or
    #: fnmatch patterns; ``()``: every one but serfHealth; None: gating off). docs/health.md.
    health_checks: tuple[str, ...] | None = ()
    #: A check turning critical (or maintenance) while the node trains takes it out at once.
    health_evict: bool = True
    #: Quarantine across jobs (docs/health.md, "Quarantine"): this many failures of a host
    #: within ``quarantine_window`` quarantine it (0: a node never quarantines its host by
    #: itself; an operator's quarantine is honoured all the same); the cooldown doubles with
    #: each quarantine in a row, from ``quarantine_cooldown`` up to ``quarantine_cooldown_max``.
    quarantine_failures: int = 0
    quarantine_window: float = 600.0
    quarantine_cooldown: float = 300.0
    quarantine_cooldown_max: float = 86400.0

    def __post_init__(self) -> None:
        # "." and ".." path segments are removed from Consul KV URLs (GET /v1/kv/a/../b reads
        # "b"), so they would move the run's keys out of its prefix.
        if not isinstance(self.run_id, str) or not _RUN_ID.match(self.run_id) \
                or self.run_id in (".", ".."):
            raise ValueError(
                f"run_id {self.run_id!r} is invalid: use 1-128 characters of letters, digits, "
                "'_', '.' or '-' (not '.' or '..')."
            )
        if self.run_id.lower() == "none":
            raise ValueError(
                "run_id 'none' is torchrun's default --rdzv-id: every job started without "
                "--rdzv-id would be the same run, and one Consul serves many jobs, so unrelated "
                "nodes would be sealed into one round. Give each job its own id, the same on "
                "every node of the job (e.g. --rdzv-id=$JOB_ID)."
            )
        if not _KEY_PREFIX.match(self.key_prefix) or self.key_prefix.startswith("/") \
                or self.key_prefix.endswith("/") or "//" in self.key_prefix \
                or {".", ".."} & set(self.key_prefix.split("/")):
            raise ValueError(
                f"key_prefix {self.key_prefix!r} is invalid: use letters, digits, '_', '.', '-' "
                "and single '/' separators, with no leading or trailing '/' and no '.' or '..' "
                "segment."
            )
        if not isinstance(self.min_nodes, int) or self.min_nodes < 1:
            raise ValueError(f"min_nodes must be an integer >= 1, not {self.min_nodes!r}.")
        if not isinstance(self.max_nodes, int) or self.max_nodes < self.min_nodes:
            raise ValueError(
                f"max_nodes ({self.max_nodes!r}) must be an integer >= min_nodes "
                f"({self.min_nodes})."
            )
        for name in ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                     "consul_timeout", "read_timeout", "watch_wait"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}.")
        if not isinstance(self.closed_retention, int | float) or not (
                self.closed_retention == 0 or 10 <= self.closed_retention <= 86400):
            raise ValueError(
                f"closed_retention ({self.closed_retention!r}) must be 0 (remove a finished "
                "run's closed marker with its last node) or 10-86400 seconds (the TTL of the "
                "Consul session that keeps it)."
            )
        if not isinstance(self.history_retention, int | float) or not (
                self.history_retention == 0 or 10 <= self.history_retention <= 86400):
            raise ValueError(
                f"history_retention ({self.history_retention!r}) must be 0 (remove a run's round "
                "history with its last node) or 10-86400 seconds (the TTL of the Consul session "
                "that keeps it; Consul allows at most a day)."
            )
        if isinstance(self.storm_rounds, bool) or not isinstance(self.storm_rounds, int) \
                or not 0 <= self.storm_rounds <= 50:
            raise ValueError(
                f"storm_rounds ({self.storm_rounds!r}) must be a whole number from 0 (no "
                "restart-storm stop) to 50: the run is closed once that many rounds in a row "
                "ended within storm_window, each after less than storm_min_round of training."
            )
        for name in ("storm_window", "storm_min_round"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}.")
        if isinstance(self.quarantine_failures, bool) \
                or not isinstance(self.quarantine_failures, int) \
                or not 0 <= self.quarantine_failures <= 64:
            raise ValueError(
                f"quarantine_failures ({self.quarantine_failures!r}) must be a whole number from "
                "0 (a node never quarantines its host by itself) to 64: that many failures of a "
                "host within quarantine_window quarantine it."
            )
        for name in ("quarantine_window", "quarantine_cooldown", "quarantine_cooldown_max"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}.")
        if self.quarantine_cooldown_max < self.quarantine_cooldown:
            raise ValueError(
                f"quarantine_cooldown_max ({self.quarantine_cooldown_max:g}) must be at least "
                f"quarantine_cooldown ({self.quarantine_cooldown:g}): it caps the doubling "
                "cooldown."
            )
        if self.watch_wait > 600:
            raise ValueError(
                f"watch_wait ({self.watch_wait:g}) must be at most 600 seconds: Consul caps a "
                "blocking query's wait at 10 minutes."
            )
        if self.heartbeat_timeout < 1:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must be at least 1 second: it is "
                "the TTL of the node's Consul health check."
            )
        if self.keep_alive_interval is not None and not (
            isinstance(self.keep_alive_interval, int | float)
            and 0 < self.keep_alive_interval <= self.heartbeat_timeout / 2
        ):
            raise ValueError(
                f"keep_alive_interval ({self.keep_alive_interval!r}) must be positive and at most "
                f"half of heartbeat_timeout ({self.heartbeat_timeout:g}s): the check is passed "
                "every keep_alive_interval and lapses after heartbeat_timeout, so one late or "
                "lost pass must not be enough to declare the node dead."
            )
        if self.store_port is not None:
            port = self.store_port
            if not (isinstance(port, tuple) and len(port) == 2
                    and all(isinstance(p, int) and not isinstance(p, bool) for p in port)
                    and 1 <= port[0] <= port[1] <= 65535):
                raise ValueError(
                    f"store_port {port!r} is invalid: give a port (29400) or a range of ports "
                    "(29400-29499), each between 1 and 65535, the first not above the last."
                )
        if self.metrics_port is not None and not (
                isinstance(self.metrics_port, int) and not isinstance(self.metrics_port, bool)
                and 0 <= self.metrics_port <= 65535):
            raise ValueError(
                f"metrics_port {self.metrics_port!r} is invalid: give a port between 1 and "
                "65535 for the node's /metrics endpoint, or 0 for any free port (logged)."
            )
        if self.metrics_host is not None and (
                not isinstance(self.metrics_host, str) or not _HOST.match(self.metrics_host)):
            raise ValueError(
                f"metrics_host {self.metrics_host!r} is invalid: give the address the node's "
                "/metrics endpoint binds to (an IP address or a host name, e.g. 127.0.0.1; "
                "default 0.0.0.0, every interface)."
            )
        if self.metrics_host is not None and self.metrics_port is None:
            raise ValueError(
                "metrics_host is set but metrics_port is not: metrics are served only when "
                "metrics_port is set (0 for any free port)."
            )
        if self.rank_policy not in POLICIES:
            raise ValueError(
                f"rank_policy {self.rank_policy!r} is unknown; choose one of {', '.join(POLICIES)}."
            )
        if self.rank_policy == "topology" and not self.topology_keys:
            raise ValueError("rank_policy 'topology' needs topology_keys (e.g. 'zone:rack').")
        for key in self.topology_keys:
            if not _META_KEY.match(key):
                raise ValueError(
                    f"topology key {key!r} is invalid: use [A-Za-z0-9_-], 1-128 chars."
                )
        if self.rank_policy == "explicit":
            if self.node_rank is None:
                raise ValueError("rank_policy 'explicit' needs node_rank for this node.")
            if not 0 <= self.node_rank < self.max_nodes:
                raise ValueError(
                    f"node_rank {self.node_rank} is outside 0..{self.max_nodes - 1} (max_nodes)."
                )
        if self.health_checks is not None and (
                not isinstance(self.health_checks, tuple)
                or not all(isinstance(p, str) and p.strip() for p in self.health_checks)):
            raise ValueError(
                f"health_checks {self.health_checks!r} is invalid: give a tuple of check names "
                "or fnmatch patterns (--rdzv-conf health_checks=gpu-*:nic), () for every "
                "node-level check but serfHealth, or None (health_checks=off) for no gating."
            )
        if not isinstance(self.health_evict, bool):
            raise ValueError(f"health_evict must be true or false, not {self.health_evict!r}.")
        if len(self.node_meta) > MAX_NODE_META:
            raise ValueError(
                f"node_meta has {len(self.node_meta)} items; at most {MAX_NODE_META} fit (Consul "
                f"allows {MAX_META} meta pairs per service instance, consul-rdzv uses "
                f"{len(RESERVED_META)})."
            )
        for key, value in self.node_meta.items():
            if str(key) in RESERVED_META:
                raise ValueError(
                    f"node meta key {key!r} is reserved: consul-rdzv writes it itself "
                    f"({', '.join(sorted(RESERVED_META))}); choose another key name."
                )
            if not _META_KEY.match(str(key)) or len(str(value)) > MAX_META_VALUE:
                raise ValueError(
                    f"node meta {key!r}={value!r} is invalid: keys are 1-128 chars of "
                    f"[A-Za-z0-9_-], values at most {MAX_META_VALUE} chars."
                )

    @property
    def service(self) -> str:
        return self.service_name or default_service_name(self.run_id)

    @property
    def prefix(self) -> str:
        return f"{self.key_prefix}/{self.run_id}"

    @property
    def heartbeat_interval(self) -> float:
        return self.keep_alive_interval or self.heartbeat_timeout / 3

    def with_(self, **changes) -> RendezvousSettings:
        return replace(self, **changes)


#: ``--rdzv-conf`` keys that map onto settings fields, with their parsers.
_FLOAT_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
               "keep_alive_interval", "consul_timeout", "read_timeout", "watch_wait",
               "closed_retention", "history_retention", "storm_window", "storm_min_round",
               "quarantine_window", "quarantine_cooldown", "quarantine_cooldown_max")
#: Keys the torch adapter reads itself (Consul connection), listed here so one table is the truth.
CONNECTION_KEYS = ("token_file", "datacenter", "ca_file", "ca_path", "client_cert", "client_key",
                   "tls_server_name", "ssl", "verify")
#: Keys of the torch adapter about this node: its id, its trainer-store address and backend.
ADAPTER_KEYS = ("node_id", "local_addr", "use_libuv")
#: Keys whose value is a boolean, parsed by the one boolean parser (``config.parse_bool``).
BOOLEAN_KEYS = ("ssl", "verify", "use_libuv", "is_host", "health_evict")
#: torch's c10d backend's keys that have no equivalent here: accepted (so that a c10d
#: ``--rdzv-conf`` carries over), validated as c10d would, and ignored with an INFO line saying
#: why. (``keep_alive_max_attempt`` is mapped, see :func:`settings_from_conf`.)
IGNORED_KEYS = {
    "is_host": "the rendezvous state lives in Consul, and rank 0 of each round always hosts the "
               "trainer store",
    "store_type": "the rendezvous state lives in Consul, not in a c10d store",
}
#: c10d's keep-alive keys: a node is dead after ``keep_alive_interval x keep_alive_max_attempt``
#: without a heartbeat; torch's defaults (dynamic_rendezvous.py) are 5 s and 3.
C10D_KEEP_ALIVE_INTERVAL = 5.0
C10D_KEEP_ALIVE_MAX_ATTEMPT = 3
#: Keys refused with a message naming what to use instead.
REFUSED_KEYS = {
    "token": "--rdzv-conf is visible to every user in `ps`: give the ACL token with "
             "token_file=PATH, CONSUL_HTTP_TOKEN_FILE or CONSUL_HTTP_TOKEN instead",
}
SETTINGS_KEYS = (*_FLOAT_KEYS, "timeout", "key_prefix", "service_name", "rank_policy",
                 "topology_keys", "node_rank", "node_meta", "store_port",
                 "keep_alive_max_attempt", "storm_rounds", "metrics_port", "metrics_host",
                 "health_checks", "health_evict", "quarantine_failures")
VALID_KEYS = tuple(sorted({*SETTINGS_KEYS, *CONNECTION_KEYS, *ADAPTER_KEYS, *IGNORED_KEYS}))

_PORTS = re.compile(r"^\s*(\d{1,5})\s*(?:-\s*(\d{1,5})\s*)?$")


def _float(key: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv conf {key}={value!r} is not a number of seconds.") from None
    return number


def parse_store_port(value: object) -> tuple[int, int] | None:
    """``29400`` or ``"29400"`` -> (29400, 29400); ``"29400-29499"`` -> (29400, 29499);
    None or "" -> None. Anything else is a ValueError naming ``store_port``."""
    if value is None or value == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        first = last = value
    elif isinstance(value, tuple | list) and len(value) == 2:
        first, last = value
    else:
        m = _PORTS.match(str(value))
        if not m:
            raise ValueError(
                f"rdzv conf store_port={value!r} is invalid: give a port (store_port=29400) or "
                "a range (store_port=29400-29499)."
            )
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) else first
    return (first, last)


def conf_bool(conf: Mapping[str, object], key: str) -> bool | None:
    """A boolean ``--rdzv-conf`` value (None when absent or empty), strictly parsed."""
    value = conf.get(key)
    if value is None or value == "":
        return None
    return parse_bool(f"rdzv conf {key}", value)


def _keep_alive(conf: Mapping[str, object], kwargs: dict) -> str | None:
    """Map c10d's keep-alive keys onto ``heartbeat_timeout`` (in ``kwargs``); return the INFO
    line that says how, or None when there was nothing to map.

    c10d declares a node dead after ``keep_alive_interval x keep_alive_max_attempt`` without a
    heartbeat; here that is ``heartbeat_timeout``, the TTL of the node's Consul check, passed
    every ``keep_alive_interval`` (at most half the TTL). So:

    * ``keep_alive_max_attempt`` given: ``heartbeat_timeout = interval x attempts`` (interval
      c10d's default 5 s if absent). The interval is kept when it fits (attempts >= 2), else
      the check is passed every third of the TTL. With ``heartbeat_timeout`` also given, the
      two would say different things: refused.
    * ``keep_alive_interval`` alone, above half of the default ``heartbeat_timeout`` (so it
      cannot be ours): c10d's meaning with its default 3 attempts. Below that it is ours: the
      check is passed that often and the TTL stays the default.
    """
    attempts_raw = conf.get("keep_alive_max_attempt")
    interval = kwargs.get("keep_alive_interval")
    if attempts_raw not in (None, ""):
        try:
            attempts = int(str(attempts_raw).strip())
        except ValueError:
            attempts = 0
        if attempts < 1:
            raise ValueError(
                f"rdzv conf keep_alive_max_attempt={attempts_raw!r} is not a whole number >= 1."
            )
        if "heartbeat_timeout" in kwargs:
            raise ValueError(
                "rdzv conf keep_alive_max_attempt (c10d's) and heartbeat_timeout both set how "
                "long a silent node lives (c10d: keep_alive_interval x keep_alive_max_attempt; "
                "here: heartbeat_timeout, the TTL of the node's Consul check). Give only "
                "heartbeat_timeout (and keep_alive_interval, at most half of it)."
            )
        given = "keep_alive_interval" in kwargs
    elif interval is not None and "heartbeat_timeout" not in kwargs \
            and interval > HEARTBEAT_TIMEOUT_DEFAULT / 2:
        attempts, given = C10D_KEEP_ALIVE_MAX_ATTEMPT, True
    else:
        return None
    if interval is None:
        interval = C10D_KEEP_ALIVE_INTERVAL
    ttl = interval * attempts
    if ttl < 1:
        raise ValueError(
            f"rdzv conf keep_alive_interval x keep_alive_max_attempt = {interval:g}s x "
            f"{attempts} = {ttl:g}s (c10d's keys, mapped onto heartbeat_timeout): the TTL of a "
            "node's Consul check must be at least 1 second."
        )
    kwargs["heartbeat_timeout"] = ttl
    keep = interval <= ttl / 2
    if keep:
        kwargs["keep_alive_interval"] = interval
    else:
        kwargs.pop("keep_alive_interval", None)
    source = ", ".join(
        [f"keep_alive_interval={interval:g}" + ("" if given else " (c10d's default)"),
         f"keep_alive_max_attempt={attempts}"
         + ("" if attempts_raw not in (None, "") else " (c10d's default)")])
    passed = (f"passed every {interval:g}s" if keep else
              f"passed every {ttl / 3:g}s (a third of it: one pass per interval would let a "
              "single late pass kill the node)")
    return (f"rdzv conf {source}: c10d's keep-alive keys, mapped: a node silent for "
            f"{interval:g}s x {attempts} is dead, as with c10d, so heartbeat_timeout={ttl:g}s "
            f"(the TTL of the node's Consul check), {passed}.")


def settings_from_conf(run_id: str, min_nodes: int, max_nodes: int,
                       conf: Mapping[str, object]) -> RendezvousSettings:
    """Build settings from ``--rdzv-conf`` style values (strings, or already typed).

    Every key is validated here, also those the torch adapter reads itself (booleans strictly).
    ``join_timeout`` wins over ``timeout`` when both are given (torchrun always injects
    ``timeout=900``, its default, which is also ours). c10d's keys carry over: the same ones
    mean the same; ``keep_alive_max_attempt`` is mapped onto ``heartbeat_timeout`` and the keys
    with no equivalent are ignored, each with one INFO line saying how.
    """
    refused = sorted(set(conf) & set(REFUSED_KEYS))
    if refused:
        raise ValueError(f"rdzv conf key {refused[0]} is not accepted: "
                         f"{REFUSED_KEYS[refused[0]]}.")
    unknown = sorted(set(conf) - set(VALID_KEYS))
    if unknown:
        raise ValueError(
            f"Unknown rdzv conf key(s) {', '.join(unknown)}. Valid keys: {', '.join(VALID_KEYS)}."
        )
    for key in BOOLEAN_KEYS:
        conf_bool(conf, key)
    store_type = conf.get("store_type")
    if store_type not in (None, "") and str(store_type).strip().lower() not in ("tcp", "file"):
        raise ValueError(f"rdzv conf store_type={store_type!r} is invalid: c10d knows tcp and "
                         "file (and consul-rdzv ignores it).")
    kwargs: dict = {}
    for key in _FLOAT_KEYS:
        if conf.get(key) not in (None, ""):
            kwargs[key] = _float(key, conf[key])
    if "join_timeout" not in kwargs and conf.get("timeout") not in (None, ""):
        kwargs["join_timeout"] = _float("timeout", conf["timeout"])
    mapped = _keep_alive(conf, kwargs)
    interval = kwargs.get("keep_alive_interval")
    ttl = kwargs.get("heartbeat_timeout", HEARTBEAT_TIMEOUT_DEFAULT)
    if mapped is None and interval is not None and isinstance(ttl, float) and interval > ttl / 2:
        raise ValueError(
            f"rdzv conf keep_alive_interval ({interval:g}) must be at most half of "
            f"heartbeat_timeout ({ttl:g}s): the check is passed every keep_alive_interval and "
            "lapses after heartbeat_timeout. Raise heartbeat_timeout, or, for c10d's meaning (a "
            "node is dead after keep_alive_interval x keep_alive_max_attempt), give "
            "keep_alive_max_attempt instead of heartbeat_timeout."
        )
    for key in ("key_prefix", "service_name", "rank_policy"):
        if conf.get(key) not in (None, ""):
            kwargs[key] = str(conf[key])
    if conf.get("topology_keys") not in (None, ""):
        raw = conf["topology_keys"]
        keys = raw if isinstance(raw, list | tuple) else re.split(r"[:;\s]+", str(raw))
        kwargs["topology_keys"] = tuple(k for k in keys if k)
    if conf.get("storm_rounds") not in (None, ""):
        try:
            kwargs["storm_rounds"] = int(str(conf["storm_rounds"]))
        except (TypeError, ValueError):
            raise ValueError(f"rdzv conf storm_rounds={conf['storm_rounds']!r} is not a whole "
                             "number.") from None
    if conf.get("quarantine_failures") not in (None, ""):
        try:
            kwargs["quarantine_failures"] = int(str(conf["quarantine_failures"]))
        except (TypeError, ValueError):
            raise ValueError(f"rdzv conf quarantine_failures={conf['quarantine_failures']!r} is "
                             "not a whole number.") from None
    if conf.get("node_rank") not in (None, ""):
        try:
            kwargs["node_rank"] = int(str(conf["node_rank"]))
        except (TypeError, ValueError):
            raise ValueError(f"rdzv conf node_rank={conf['node_rank']!r} is not an integer.") \
                from None
    if conf.get("node_meta") not in (None, ""):
        raw = conf["node_meta"]
        if isinstance(raw, Mapping):
            kwargs["node_meta"] = dict(raw)
        else:
            meta = {}
            for item in re.split(r"[;\s]+", str(raw)):
                if not item:
                    continue
                if "=" not in item:
                    raise ValueError(
                        f"rdzv conf node_meta item {item!r} is not key=value "
                        "(separate items with ';', e.g. node_meta='zone=a;rack=r1')."
                    )
                k, v = item.split("=", 1)
                meta[k] = v
            kwargs["node_meta"] = meta
    if conf.get("metrics_port") not in (None, ""):
        raw = conf["metrics_port"]
        try:
            kwargs["metrics_port"] = raw if isinstance(raw, int) else int(str(raw).strip())
        except ValueError:
            raise ValueError(f"rdzv conf metrics_port={raw!r} is not a port number (0 for any "
                             "free port).") from None
    if conf.get("metrics_host") not in (None, ""):
        kwargs["metrics_host"] = str(conf["metrics_host"]).strip()
    if conf.get("health_checks") not in (None, ""):
        kwargs["health_checks"] = parse_health_checks(conf["health_checks"])
    evict = conf_bool(conf, "health_evict")
    if evict is not None:
        kwargs["health_evict"] = evict
    store_port = parse_store_port(conf.get("store_port"))
    if store_port is not None:
        kwargs["store_port"] = store_port
    settings = RendezvousSettings(run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes,
                                  **kwargs)
    if mapped:
        logger.info("%s", mapped)
    for key, why in IGNORED_KEYS.items():
        if conf.get(key) not in (None, ""):
            logger.info("rdzv conf %s=%s (c10d's) is ignored: %s.", key, conf[key], why)
    return settings


def settings_field_names() -> list[str]:
    return [f.name for f in fields(RendezvousSettings)]
