"""A node's presence in Consul, as names and values: what :mod:`consul_rdzv.registration` writes
and what ``consul-rdzv`` (:mod:`consul_rdzv.cli`) reads back, each written and parsed here.

Like :mod:`consul_rdzv.layout` for the KV keys, this module is the one place of the service
conventions (docs/protocol.md, "Names"):

| what | format |
|---|---|
| key prefix | ``torchelastic`` (:data:`DEFAULT_KEY_PREFIX`; the ``key_prefix`` setting) |
| service name | ``torchelastic-<run_id>`` (:func:`service_name`; the ``service_name`` setting) |
| node id | 1-160 of ``[A-Za-z0-9_.-]``, not ``.`` or ``..`` (:func:`valid_node_id`) |
| service id | ``<run_id>-<node_id>`` (:func:`service_id`) |
| TTL check id | ``<service id>:ttl:<first 8 of the incarnation id>`` (:func:`check_id`) |
| tags | ``consul-rdzv``, ``run-<run_id>``, ``state-<state>``, ``rank-<rank>`` (:func:`tags`) |
| meta | :data:`RESERVED_META` (:func:`meta`), then the node's ``node_meta`` |
| check notes | ``joining``; ``round 5 · rank 3/8 · training`` (:func:`training_note`) |
| check output | the notes, then `` · heartbeat <UTC time>`` (:func:`heartbeat_note`) |

Pure values and functions: no Consul request, no thread.
"""

from __future__ import annotations

import calendar
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol


class ServiceSettings(Protocol):
    """What the service conventions read of a node's settings (a ``RendezvousSettings``;
    settings.py imports this module for its constants, not the other way round)."""

    @property
    def run_id(self) -> str: ...

    @property
    def service(self) -> str: ...

    @property
    def heartbeat_timeout(self) -> float: ...

    @property
    def node_meta(self) -> Mapping[str, str]: ...

#: The default ``key_prefix`` (the runs' KV prefix), and the default service name's prefix:
#: torch's own name for its elastic jobs.
DEFAULT_KEY_PREFIX = "torchelastic"
#: A run's default service is ``torchelastic-<run_id>`` (the ``service_name`` setting).
SERVICE_PREFIX = f"{DEFAULT_KEY_PREFIX}-"
#: A node id (torchrun's ``node_id`` rdzv conf, or ``default_node_id()``): one KV path segment
#: and part of the service id. ``.`` and ``..`` match it too, and are refused on their own
#: (:func:`valid_node_id`): Consul drops such segments from KV URLs.
NODE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,160}$")
NODE_ID_RULE = "1-160 characters of letters, digits, '_', '.' or '-' (not '.' or '..')"

#: The tag every node's service instance carries, and the prefixes of its other tags.
RDZV_TAG = "consul-rdzv"
RUN_TAG = "run-"
STATE_TAG = "state-"
RANK_TAG = "rank-"
#: Service meta keys consul-rdzv writes itself (:func:`meta`, :func:`training_meta`): a
#: ``node_meta`` item may not replace one (an "incarnation" would defeat the same-node-id
#: takeover).
RESERVED_META = frozenset({"run_id", "node_id", "host", "pid", "incarnation", "started", "ttl",
                           "state", "round", "rank", "world_size", "store",
                           "quarantined"})
#: Consul allows 64 meta pairs per service instance.
MAX_META = 64
#: Consul caps a meta value at 512 characters.
MAX_META_VALUE = 512
#: Deregister a service whose check stayed critical this long (its node is long dead).
DEREGISTER_CRITICAL_AFTER = "1m"

#: A node's state, in its meta ``state``, its ``state-`` tag and its check notes.
JOINING = "joining"
TRAINING = "training"

_HEARTBEAT = re.compile(r"heartbeat (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z")
_ISO = "%Y-%m-%dT%H:%M:%S"


# ----------------------------------------------------------------------------- names


def valid_node_id(node_id: str) -> bool:
    """Whether ``node_id`` is a valid node id (:data:`NODE_ID_RULE`)."""
    return bool(NODE_ID.match(node_id)) and node_id not in (".", "..")


def service_name(run_id: str) -> str:
    """The default service name of a run (the ``service_name`` setting unset)."""
    return f"{SERVICE_PREFIX}{run_id}"


def service_id(run_id: str, node_id: str) -> str:
    """The id of a node's service instance: one per node id on its agent."""
    return f"{run_id}-{node_id}"


def check_id(service: str, incarnation: Incarnation) -> str:
    """The id of the TTL check of one process (``service``: its :func:`service_id`)."""
    return f"{service}:ttl:{incarnation.id[:8]}"


def is_heartbeat_check(check: Mapping, service: str) -> bool:
    """Whether ``check`` (a Consul check object) is the TTL check of service instance
    ``service``: the one whose output carries the heartbeat."""
    return check.get("ServiceID") == service and (
        ":ttl:" in (check.get("CheckID") or "") or check.get("Type") == "ttl")


def node_id_of(service: Mapping, run_id: str) -> str:
    """The node id of a run's service instance (a Consul service object): its meta
    ``node_id``, else read from its id (an instance registered without the meta)."""
    node = (service.get("Meta") or {}).get("node_id")
    if node:
        return str(node)
    sid = str(service.get("ID") or "")
    prefix = service_id(run_id, "")
    return sid[len(prefix):] if sid.startswith(prefix) else sid


def session_name(run_id: str, node_id: str) -> str:
    """The name of a node's session (Consul caps it at 128 characters)."""
    return f"consul-rdzv {run_id} {node_id}"[:128]


def check_name(node_id: str) -> str:
    return f"consul-rdzv heartbeat of {node_id}"


# ----------------------------------------------------------------------------- tags


def tags(run_id: str, state: str, rank: object = None) -> list[str]:
    """The tags of a node's service instance: what an operator filters on in the Consul UI."""
    found = [RDZV_TAG, f"{RUN_TAG}{run_id}", f"{STATE_TAG}{state}"]
    if rank is not None:
        found.append(f"{RANK_TAG}{rank}")
    return found


def run_of(service_tags: Iterable[str] | None) -> str | None:
    """The run id in a service instance's tags, or None (not a consul-rdzv instance's)."""
    for tag in service_tags or ():
        if tag.startswith(RUN_TAG):
            return tag[len(RUN_TAG):]
    return None


def tagged(service_tags: Iterable[str] | None, run_id: str) -> bool:
    """Whether the tags are those of a consul-rdzv instance of run ``run_id``."""
    found = list(service_tags or ())
    return RDZV_TAG in found and f"{RUN_TAG}{run_id}" in found


# ----------------------------------------------------------------------------- incarnation


#: How much of an incarnation id a sealed round records per rank (``Round.incarnations``): 12
#: hex digits (48 bits) tell the processes of one node id apart (two colliding: about 1 in
#: 2.8e14) at a third of the full id's bytes, and every node reads the round at each seal.
INCARNATION_TAG = 12


def incarnation_tag(incarnation_id: str) -> str:
    """What a sealed round records of an incarnation id (:data:`INCARNATION_TAG`)."""
    return incarnation_id[:INCARNATION_TAG]


@dataclass(frozen=True, order=True)
class Incarnation:
    """One process's claim on a node id. The newest ``(started, id)`` wins the node id."""

    started: float
    id: str

    @classmethod
    def new(cls) -> Incarnation:
        return cls(time.time(), uuid.uuid4().hex)

    @classmethod
    def of(cls, meta: Mapping | None) -> Incarnation:
        """The incarnation recorded in service meta or a member value (oldest if none)."""
        meta = meta or {}
        try:
            started = float(meta.get("started", 0.0))
        except (TypeError, ValueError):
            started = 0.0
        return cls(started, str(meta.get("incarnation", "")))


# ----------------------------------------------------------------------------- meta and notes


def meta(settings: ServiceSettings, *, node_id: str, host: str, incarnation: Incarnation,
         shown: Mapping[str, str]) -> dict[str, str]:
    """The service meta of a node: who it is (run, node, host, pid, incarnation, TTL), what it
    does (``shown``: ``{"state": "joining"}`` or :func:`training_meta`), then its node_meta."""
    found = {"run_id": settings.run_id, "node_id": node_id[:MAX_META_VALUE],
             "host": host[:MAX_META_VALUE], "pid": str(os.getpid()),
             "incarnation": incarnation.id, "started": f"{incarnation.started:.6f}",
             "ttl": f"{settings.heartbeat_timeout:g}s", **shown}
    found.update({k: str(v) for k, v in settings.node_meta.items()})
    return found


def holder(service_meta: Mapping | None) -> str:
    """Who registered a service instance, from its meta: ``pid P on host H``."""
    service_meta = service_meta or {}
    return f"pid {service_meta.get('pid', '?')} on host {service_meta.get('host', '?')}"


def training_meta(round_no: int, rank: int, world_size: int,
                  store: Mapping | None) -> dict[str, str]:
    """What a node shows while it trains in a round (``store``: the round's trainer store)."""
    store = store or {}
    return {"state": TRAINING, "round": str(round_no), "rank": str(rank),
            "world_size": str(world_size),
            "store": f"{store.get('host', '')}:{store.get('port', '')}"}


def training_note(round_no: int, rank: int, world_size: int) -> str:
    """The check notes of a training node."""
    return f"round {round_no} · rank {rank}/{world_size} · {TRAINING}"


def definition(settings: ServiceSettings, *, node_id: str, host: str, address: str,
               incarnation: Incarnation, shown: Mapping[str, str], note: str,
               port: int | None = None) -> dict:
    """The service registration of a node: instance, meta, tags and the TTL check (registered
    passing); ``shown`` and ``note`` are what it does (its meta ``state``, ``round``, ... and
    its check notes), ``port`` the trainer store it hosts, if any."""
    sid = service_id(settings.run_id, node_id)
    found = meta(settings, node_id=node_id, host=host, incarnation=incarnation, shown=shown)
    registration: dict[str, object] = {
        "ID": sid,
        "Name": settings.service,
        "Address": address,
        "Tags": tags(settings.run_id, found["state"], shown.get("rank")),
        "Meta": found,
        "Check": {
            "CheckID": check_id(sid, incarnation),
            "Name": check_name(node_id),
            "Notes": note,
            "TTL": f"{settings.heartbeat_timeout:g}s",
            "Status": "passing",
            "DeregisterCriticalServiceAfter": DEREGISTER_CRITICAL_AFTER,
        },
    }
    if port:
        registration["Port"] = int(port)
    return registration


# ----------------------------------------------------------------------------- heartbeat


def utc_iso(ts: float) -> str:
    """``ts`` as an ISO time in UTC, to the millisecond: ``2026-12-03T16:40:01.123Z``."""
    return time.strftime(_ISO, time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


def heartbeat_note(note: str, now: float | None = None) -> str:
    """The output a check pass writes: the notes, then the time of the pass (``consul-rdzv
    status`` shows its age)."""
    return f"{note} · heartbeat {utc_iso(time.time() if now is None else now)}"


def heartbeat_time(output: str) -> float | None:
    """The wall-clock time of the heartbeat in a check's output (:func:`heartbeat_note`), or
    None if it holds none."""
    m = _HEARTBEAT.search(output or "")
    if not m:
        return None
    try:
        base = calendar.timegm(time.strptime(m.group(1), _ISO))
    except ValueError:
        return None
    return base + float(m.group(2) or 0.0)
