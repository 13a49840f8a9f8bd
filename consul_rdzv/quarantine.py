"""Quarantine across jobs: a host that failed repeatedly sits out every run (docs/health.md).

A node records a **failure** of its host when it knows one honestly: its workers failed (it asks
for a new round while its round was intact) or it lost its Consul session while it trained.
Once ``quarantine_failures`` failures fall within ``quarantine_window`` seconds, the host is
**quarantined** until ``now + cooldown``, with an exponential cooldown: level ``n`` (the n-th
quarantine in a row) lasts ``min(quarantine_cooldown_max, quarantine_cooldown * 2**(n-1))``. A
host whose last quarantine ended more than ``quarantine_cooldown_max`` ago starts again at
level 1. An operator adds and clears a quarantine by hand (``consul-rdzv quarantine``): always
honoured, whatever the policy.

The state is one JSON key per host, ``<key_prefix>/~quarantine/<host>`` (the member key's
``host``), shared by every run under the key prefix, written with check-and-set:
``{host, failures: [times], level, until, reason, by, at}``. A quarantined host's nodes are held
out exactly like an unhealthy Consul node (member key ``health``: the reason). Each node watches
its host's key with one blocking query (:class:`QuarantineWatch`, shared by the nodes of a
process on the same host and agent), which also wakes when the cooldown ends.

* pure: :class:`Policy`, :func:`cooldown`, :func:`record_failure`, :func:`add`, :func:`reason`;
* Consul: :func:`read`, :func:`update` (CAS loop), :class:`QuarantineWatch`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .client import BlockingIndex, ConsulClient, KVEntry
from .errors import ConsulError, ConsulPermissionDenied, RendezvousStateError
from .layout import FORMAT_VERSION
from .shared_query import SharedQuery

logger = logging.getLogger(__name__)

#: Failure times kept per host (older ones fall out of any window that matters).
FAILURES_KEPT = 64
#: CAS attempts of one update before giving up.
CAS_ATTEMPTS = 8
RETRY_PAUSE = 0.1
RETRY_PAUSE_MAX = 5.0
#: The longest blocking query of the watch.
WATCH_WAIT = 300.0


@dataclass(frozen=True)
class Policy:
    """When a host's own failures quarantine it (the ``quarantine_*`` settings)."""

    failures: int = 0  # failures within ``window`` that quarantine a host; 0: never by itself
    window: float = 600.0
    cooldown: float = 300.0  # the first quarantine's length; doubled for each level after
    cooldown_max: float = 86400.0

    @property
    def recording(self) -> bool:
        return self.failures > 0


def cooldown(policy: Policy, level: int) -> float:
    """How long quarantine number ``level`` (1, 2, ...) of a host lasts."""
    return min(policy.cooldown_max, policy.cooldown * 2 ** (max(level, 1) - 1))


def utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def active(value: dict[str, Any] | None, now: float) -> bool:
    return bool(value) and float(value.get("until") or 0.0) > now  # type: ignore[union-attr]


def reason(value: dict[str, Any] | None, now: float) -> str:
    """Why the host is held out (``host gpu-07 quarantined until ...Z: ...``), or ""."""
    if value is None or not active(value, now):
        return ""
    return (f"host {value.get('host') or '?'} quarantined until {utc(float(value['until']))}: "
            f"{value.get('reason') or 'no reason given'}")


def record_failure(value: dict[str, Any] | None, *, host: str, now: float, policy: Policy,
                   what: str, by: str) -> dict[str, Any]:
    """The host's value once one more failure (``what``, seen by node ``by``) is counted: the
    failures within the window, and a quarantine (one level up) once they reach the threshold.
    A host already quarantined keeps its quarantine (the failure is counted, nothing more)."""
    value = dict(value or {})
    value["host"] = host
    failures = [float(t) for t in value.get("failures") or [] if float(t) > now - policy.window]
    failures.append(round(now, 3))
    value["failures"] = failures[-FAILURES_KEPT:]
    if not policy.recording or active(value, now) or len(failures) < policy.failures:
        return value
    level = int(value.get("level") or 0)
    until = float(value.get("until") or 0.0)
    if until and now - until > policy.cooldown_max:
        level = 0  # quiet for longer than the longest cooldown: start over
    level += 1
    value.update(level=level, until=round(now + cooldown(policy, level), 3), at=round(now, 3),
                 by=by, failures=[],
                 reason=f"{len(failures)} failures in {policy.window:g}s (last: {what}, "
                        f"seen by node {by}); quarantine level {level}")
    return value


def add(value: dict[str, Any] | None, *, host: str, now: float, seconds: float, why: str,
        by: str) -> dict[str, Any]:
    """An operator's quarantine of ``host`` for ``seconds`` (its level and failures kept)."""
    value = dict(value or {})
    value.update(host=host, until=round(now + seconds, 3), at=round(now, 3), by=by,
                 reason=why or "quarantined by an operator")
    value.setdefault("failures", [])
    value.setdefault("level", 0)
    return value


def encode(value: dict[str, Any]) -> bytes:
    return json.dumps({"v": FORMAT_VERSION, **value}, separators=(",", ":"),
                      sort_keys=True).encode()


def decode(entry: KVEntry | None) -> dict[str, Any] | None:
    """A quarantine value; a RendezvousStateError naming the key if it is not one."""
    if entry is None or not entry.value:
        return None
    try:
        data = json.loads(entry.value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        data = None
    if not isinstance(data, dict) or data.get("v") != FORMAT_VERSION:
        raise RendezvousStateError(
            f"Consul key {entry.key!r} does not hold a consul-rdzv quarantine of format version "
            f"{FORMAT_VERSION}: delete it (consul-rdzv quarantine clear, or consul kv delete).")
    data.pop("v", None)
    return data


def read(client: ConsulClient, key: str, *,
         deadline: float | None = None) -> tuple[dict[str, Any] | None, int]:
    """A host's value (None: no key) and the key's ModifyIndex (0: no key)."""
    entry = client.kv_get(key, deadline=deadline).data
    return decode(entry), (entry.modify_index if entry is not None else 0)


def update(client: ConsulClient, key: str,
           change: Callable[[dict[str, Any] | None], dict[str, Any]], *,
           deadline: float | None = None) -> dict[str, Any]:
    """Read, change and write a host's value with check-and-set (retried on a conflict)."""
    for _ in range(CAS_ATTEMPTS):
        value, index = read(client, key, deadline=deadline)
        new = change(value)
        if client.kv_put(key, encode(new), cas=index, deadline=deadline):
            return new
    raise ConsulError(f"could not update {key}: {CAS_ATTEMPTS} check-and-set conflicts in a row")


class QuarantineWatch:
    """The quarantine of one host as one node sees it: ``reason`` ("" while the host may
    train), and ``on_change(reason)`` after each change (and after the first answer when it
    holds the host out), from the watch's thread.

    The query (a blocking read of the host's key, ``?stale``) is shared by every node of this
    process that watches the same key through the same agent with the same token; it wakes by
    itself when a quarantine's cooldown ends.
    """

    def __init__(self, client: ConsulClient, *, key: str, on_change: Callable[[str], None],
                 wait: float = WATCH_WAIT) -> None:
        self.client = client
        self.key = key
        self.on_change = on_change
        self.wait = wait
        self.value: dict[str, Any] | None = None
        self._reason = ""
        self._known = threading.Event()
        self._query: _KeyQuery | None = None

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def started(self) -> bool:
        return self._query is not None

    def start(self) -> QuarantineWatch:
        if self._query is None:
            self._query = _KeyQuery.join(self)
        return self

    def stop(self) -> None:
        query, self._query = self._query, None
        if query is not None:
            query.leave(self)

    def wait_known(self, deadline: float) -> bool:
        return self._known.wait(max(0.0, deadline - time.monotonic()))

    def apply(self, value: dict[str, Any] | None) -> None:
        """A value of the key (read by the watch, or just written by this node)."""
        self.value = value
        why = reason(value, time.time())
        first = not self._known.is_set()
        changed = why != self._reason
        self._reason = why
        self._known.set()
        if changed and (not first or why):
            self.on_change(why)


class _KeyQuery(SharedQuery):
    """One blocking query on a host's quarantine key (a daemon thread), shared by the watches
    of this process on the same key, agent and token; it ends when the last one leaves."""

    _registry: ClassVar[dict[tuple, SharedQuery]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()
    thread_name = "consul-rdzv-quarantine"

    def __init__(self, key: tuple, client: ConsulClient, path: str, wait: float) -> None:
        super().__init__(key, client)
        self.path = path
        self.wait = wait
        self._last: tuple[dict[str, Any] | None] | None = None

    @classmethod
    def join(cls, member: QuarantineWatch) -> _KeyQuery:
        config = member.client.config
        key = (config.url, config.token, config.datacenter, member.key)
        return cls.attach(key, member,
                          lambda: cls(key, member.client, member.key, member.wait))

    def _snapshot(self) -> tuple[dict[str, Any] | None] | None:
        return self._last

    def _catch_up(self, member: QuarantineWatch,
                  snapshot: tuple[dict[str, Any] | None] | None) -> None:
        if snapshot is not None:
            member.apply(snapshot[0])

    def _loop(self) -> None:
        index = BlockingIndex()
        failures = 0
        value: dict[str, Any] | None = None
        while not self._stopped.is_set():
            wait = self.wait
            if active(value, time.time()):
                # wake when the cooldown ends, even if nobody writes the key
                wait = max(0.05, min(wait, float(value["until"]) - time.time() + 0.05))  # type: ignore[index]
            try:
                res = self.client.kv_get(self.path, index=index.param, wait=wait, stale=True,
                                         deadline=time.monotonic())
                value = decode(res.data)
            except ConsulPermissionDenied as exc:
                self._refused(str(exc))
                return
            except (ConsulError, RendezvousStateError) as exc:
                if self._stopped.is_set():
                    return
                index.reset()
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    logger.warning("Cannot read the quarantine key %s: %s", self.path, exc)
                self._stopped.wait(min(RETRY_PAUSE * 2 ** failures, RETRY_PAUSE_MAX))
                continue
            failures = 0
            index.update(res.index)
            with self._registry_lock:
                self._last = (value,)
                members = list(self._members)
            for member in members:
                member.apply(value)

    def _refused(self, what: str) -> None:
        """The token may not read the key: the nodes join without the quarantine (their own
        keys' permissions are checked, and refused with the rule to add, by the join)."""
        logger.warning("Cannot read the quarantine key %s (%s): the nodes of this process on "
                       "that host join without it. Give the token key_prefix \"<key_prefix>/\" "
                       "{ policy = \"write\" } (docs/acl-policy.hcl).", self.path, what)
        with self._registry_lock:
            self._stopped.set()
            if self._registry.get(self.key) is self:
                del self._registry[self.key]
            members = list(self._members)
        for member in members:
            member.apply(None)
