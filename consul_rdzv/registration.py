"""One node's presence in Consul: its service instance, its TTL check, the session bound to that
check, and the two threads that keep them alive.

How it fails, and what the caller must watch for:

* **The check is passed by a thread of its own** (``pass`` every ``keep_alive_interval``, one
  attempt each, bounded by that interval). Nothing else runs on it: a slow Consul server (a
  leader election, an overloaded cluster) delays session renewals and KV calls, never a check
  pass, so it never makes a live node look dead. Check passes are agent-local requests.
* **Cut off.** When no pass has succeeded for ``heartbeat_timeout``, Consul has let (or is about
  to let) the check lapse, which invalidates the session and deletes the node's keys: the node is
  out of the job, and :attr:`Registration.lost` says so at once, whatever else it can reach.
* **Server RPCs run on a second thread**: probing the session while the node joins (a renew
  answering 404 means it is gone) and publishing the service meta an operator sees.
* **A lost registration** (session invalidated, check lapsed, agent restarted) is repaired by
  :meth:`Registration.ensure`: a new session bound to the check, after registering the service
  again only if the agent forgot it.
* **One node id, one process.** Check ids carry the process's :class:`Incarnation`, and the
  service id is the node's. A replacement process (a restarted pod, same node id) registers the
  same service id with its own check, which removes the predecessor's check: Consul invalidates
  the predecessor's session at once and deletes its keys, so the replacement takes over without
  waiting for a TTL. A process that finds its service taken by a newer incarnation was replaced:
  :meth:`Registration.ensure` raises instead of taking it back (no ping-pong).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .client import ConsulClient
from .errors import (
    ConsulBadRequest,
    ConsulError,
    ConsulNotFound,
    ConsulSessionInvalid,
    RendezvousStateError,
)
from .settings import RendezvousSettings

logger = logging.getLogger(__name__)

#: Deregister a service whose check stayed critical this long (its node is long dead).
DEREGISTER_CRITICAL_AFTER = "1m"


def _utc_now() -> str:
    """The time of a heartbeat, in the check's output (``consul-rdzv status`` shows its age)."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


@dataclass(frozen=True, order=True)
class Incarnation:
    """One process's claim on a node id. The newest ``(started, id)`` wins the node id."""

    started: float
    id: str

    @classmethod
    def new(cls) -> Incarnation:
        return cls(time.time(), uuid.uuid4().hex)

    @classmethod
    def of(cls, meta: dict | None) -> Incarnation:
        """The incarnation recorded in service meta or a member value (oldest if none)."""
        meta = meta or {}
        try:
            started = float(meta.get("started", 0.0))
        except (TypeError, ValueError):
            started = 0.0
        return cls(started, str(meta.get("incarnation", "")))


class Registration:
    """Service, TTL check and session of one node, kept alive by two daemon threads.

    ``on_lost(reason)`` is called (from any thread) the first time the registration is found
    lost after each :meth:`ensure`.
    """

    def __init__(self, client: ConsulClient, settings: RendezvousSettings, *, node_id: str,
                 host: str, incarnation: Incarnation, address: str | None = None,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.client = client
        self.settings = settings
        self.node_id = node_id
        self.host = host
        #: The service instance's Address: where this node is reached (its trainer store).
        self.address = address or host
        self.incarnation = incarnation
        self.service_id = f"{settings.run_id}-{node_id}"
        self.check_id = f"{self.service_id}:ttl:{incarnation.id[:8]}"
        #: While True the second thread probes the session every interval (joining nodes); a
        #: training node's membership watch sees its key vanish instead.
        self.probe_session = True
        self._on_lost = on_lost
        self._session: str | None = None
        self._lost = threading.Event()
        self._lost_reason = ""
        self._replaced_by: str | None = None
        self._closed = False
        self._meta: dict[str, str] = {"state": "joining"}
        self._meta_due: float | None = None
        self._published: dict | None = None
        self._note = "joining"
        self._port: int | None = None
        self._last_pass = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []

    def __repr__(self) -> str:
        return f"Registration(service_id={self.service_id!r}, session={self._session!r})"

    # ------------------------------------------------------------------ state

    @property
    def session(self) -> str | None:
        return self._session

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def lost_reason(self) -> str:
        return self._lost_reason

    @property
    def seconds_since_pass(self) -> float:
        """Seconds since the check was last passed (a pass resets Consul's TTL timer)."""
        return time.monotonic() - self._last_pass

    def mark_lost(self, reason: str) -> None:
        """This node's session or check is gone (or about to be): it is out of its round."""
        if self._lost.is_set() or self._closed:
            return
        self._lost_reason = reason
        self._lost.set()
        logger.warning("Node %s of run %s: %s; it will register again at its next round.",
                       self.node_id, self.settings.run_id, reason)
        if self._on_lost:
            self._on_lost(reason)

    # ------------------------------------------------------------------ registering

    def definition(self) -> dict:
        """The service registration: instance, meta, tags and the TTL check (registered passing).

        What an operator filters on in the Consul UI: the tags ``consul-rdzv``, ``run-<id>``,
        ``state-<state>`` and ``rank-<rank>``; the meta; the check's notes ("round 5 · rank 3/8 ·
        training"), which a re-registration syncs to the catalog at once (a TTL check's output
        alone reaches the catalog only after the agent's check_update_interval, 5 min).
        """
        meta = {"run_id": self.settings.run_id, "node_id": self.node_id[:512],
                "host": self.host[:512], "pid": str(os.getpid()),
                "incarnation": self.incarnation.id, "started": f"{self.incarnation.started:.6f}",
                **self._meta}
        meta.update({k: str(v) for k, v in self.settings.node_meta.items()})
        tags = ["consul-rdzv", f"run-{self.settings.run_id}", f"state-{meta['state']}"]
        if "rank" in self._meta:
            tags.append(f"rank-{self._meta['rank']}")
        definition = {
            "ID": self.service_id,
            "Name": self.settings.service,
            "Address": self.address,
            "Tags": tags,
            "Meta": meta,
            "Check": {
                "CheckID": self.check_id,
                "Name": f"consul-rdzv heartbeat of {self.node_id}",
                "Notes": self._note,
                "TTL": f"{self.settings.heartbeat_timeout:g}s",
                "Status": "passing",
                "DeregisterCriticalServiceAfter": DEREGISTER_CRITICAL_AFTER,
            },
        }
        if self._port:
            definition["Port"] = self._port
        return definition

    def ensure(self, deadline: float) -> str:
        """A live session bound to our passing check: the current one, or a new one.

        Raises :class:`RendezvousStateError` if a newer process took this node id over.
        """
        if self._replaced_by:
            raise self._replaced_error()
        old = self._session
        if old is not None and not self._lost.is_set():
            return old
        self._meta, self._note, self._port = {"state": "joining"}, "joining", None
        if old is None or not self._check_still_registered(deadline):
            self.client.agent_service_register(self.definition(), deadline=deadline)
            self._published = self._shown()
            self._last_pass = time.monotonic()  # registered passing
        if not self._threads:
            # Pass the check from now on: a session create is a server RPC, and a slow server
            # must not let the fresh check lapse before the session binds to it.
            self._start_threads()
        session = self._create_session(deadline)
        # Switch sessions before clearing `lost`: nobody may judge the new registration by the
        # old session (a failed probe of the old one would mark us lost again).
        self._session = session
        self._last_pass = time.monotonic()
        self._lost.clear()
        self._lost_reason = ""
        if old is not None:
            # If the old session is in fact alive (our key was deleted by hand: a spurious
            # loss), it would keep holding the leader key or our member key: end it.
            with contextlib.suppress(ConsulError):
                self.client.session_destroy(old, deadline=deadline)
        logger.debug("Node %s of run %s registered service %s (check %s) with session %s.",
                     self.node_id, self.settings.run_id, self.service_id, self.check_id,
                     session)
        return session

    def _check_still_registered(self, deadline: float) -> bool:
        """After a lost session: pass our check; False if the agent forgot our service.

        A session usually dies because its check lapsed (late heartbeats on an overloaded agent)
        while the service stays registered: then passing the check is all a new session needs,
        and it spares the agent a service registration, which it serialises at O(services)
        each. A 404 means the agent forgot our check (restart, operator) or that a newer
        process with our node id replaced our registration: tell which from the service.
        """
        try:
            self.client.agent_check_update(self.check_id, "pass", deadline=deadline)
            return True
        except ConsulNotFound:
            pass
        service = self.client.agent_service(self.service_id, deadline=deadline)
        if service is not None:
            holder = Incarnation.of(service.get("Meta"))
            if holder > self.incarnation:
                meta = service.get("Meta") or {}
                self._replaced_by = (f"pid {meta.get('pid', '?')} on host "
                                     f"{meta.get('host', '?')}")
                raise self._replaced_error()
        return False

    def _replaced_error(self) -> RendezvousStateError:
        return RendezvousStateError(
            f"Node {self.node_id} of run {self.settings.run_id} was replaced by a newer process "
            f"with the same node id ({self._replaced_by}); this process stops. Give every "
            "concurrently running node a unique node id."
        )

    def _create_session(self, deadline: float) -> str:
        """Create our session bound to the TTL check.

        Consul refuses to bind a session to a critical check. The check was registered passing,
        but on a slow agent its TTL can run out before the session request is served, so pass
        it and ask again.
        """
        for attempt in range(3):
            try:
                return self.client.session_create(
                    name=f"consul-rdzv {self.settings.run_id} {self.node_id}"[:128],
                    service_checks=[self.check_id], node_checks=["serfHealth"],
                    behavior="delete", lock_delay="0s", deadline=deadline,
                )
            except ConsulBadRequest as exc:
                if "critical state" not in str(exc) or attempt == 2:
                    raise
                logger.warning("Node %s: its check went critical before its session was "
                               "created; passing it and trying again.", self.node_id)
                self.client.agent_check_update(self.check_id, "pass", deadline=deadline)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ what an operator sees

    def publish(self, meta: dict[str, str], *, delay: float = 0.0, note: str = "",
                port: int | None = None) -> None:
        """Show ``meta`` (and the check ``note``, and ``port``: the trainer store this node
        hosts, if any) in the service instance ``delay`` seconds from now (keep thread)."""
        self._meta = dict(meta)
        self._note = note
        self._port = port
        self._meta_due = time.monotonic() + delay
        self._wake.set()

    def _shown(self) -> dict:
        return {"meta": dict(self._meta), "note": self._note, "port": self._port}

    # ------------------------------------------------------------------ leaving

    def close(self, deadline: float) -> bool:
        """Stop the threads, deregister the service, destroy the session. Idempotent.

        Returns False if a step failed (logged).
        """
        self._closed = True
        self._stop.set()
        self._wake.set()
        session, self._session = self._session, None
        if not self._threads and session is None:
            return True
        self._threads = []
        ok = True
        steps = [("deregister its service",
                  lambda: self.client.agent_service_deregister(self.service_id,
                                                               deadline=deadline))]
        if session is not None:
            steps.append(("destroy its session",
                          lambda: self.client.session_destroy(session, deadline=deadline)))
        for step, call in steps:
            try:
                call()
            except ConsulNotFound:
                pass
            except ConsulError as exc:
                ok = False
                logger.warning("Node %s could not %s while leaving run %s: %s", self.node_id,
                               step, self.settings.run_id, exc)
        return ok

    def halt(self) -> None:
        """Stop the threads and nothing else: the registration stays in Consul until its check
        lapses, as a killed or frozen process leaves it (tests and benchmarks simulate a death
        with this)."""
        self._closed = True
        self._stop.set()
        self._wake.set()

    # ------------------------------------------------------------------ the threads

    def _start_threads(self) -> None:
        for name, target in (("pass", self._pass_loop), ("keep", self._keep_loop)):
            thread = threading.Thread(target=target, daemon=True,
                                      name=f"consul-rdzv-{name}-{self.node_id}")
            self._threads.append(thread)
            thread.start()

    def _pass_loop(self) -> None:
        """Pass the check every interval: one attempt, bounded by the interval, nothing else."""
        interval = self.settings.heartbeat_interval
        ttl = self.settings.heartbeat_timeout
        next_beat = time.monotonic() + interval
        failures = 0
        while not self._stop.wait(max(0.0, next_beat - time.monotonic())):
            started = time.monotonic()
            next_beat = started + interval
            try:
                # deadline=now: a single attempt; the next beat is the retry.
                self.client.agent_check_update(self.check_id, "pass",
                                               note=f"{self._note} · heartbeat {_utc_now()}",
                                               deadline=started, timeout=interval)
                self._last_pass = started
                failures = 0
                continue
            except ConsulNotFound as exc:
                if self._session is not None:
                    self.mark_lost(f"its check is gone from the Consul agent ({exc})")
            except ConsulError as exc:
                failures += 1
                if failures == 1 or failures % 10 == 0:
                    logger.warning("Heartbeat of node %s failed %d time(s): %s", self.node_id,
                                   failures, exc)
            silent = time.monotonic() - self._last_pass
            if silent > ttl and self._session is not None:
                self.mark_lost(
                    f"its check could not be passed for {silent:.1f}s (heartbeat_timeout "
                    f"{ttl:g}s): Consul at {self.client.config.url} is unreachable or too slow "
                    "and has declared this node dead"
                )

    def _keep_loop(self) -> None:
        """Server RPCs, off the check's thread: the session probe, the meta publish."""
        interval = self.settings.heartbeat_interval
        next_probe = time.monotonic() + interval
        while not self._stop.is_set():
            wake_at = next_probe
            if self._meta_due is not None:
                wake_at = min(wake_at, self._meta_due)
            self._wake.wait(max(0.0, wake_at - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            if now >= next_probe:
                next_probe = now + interval
                self._probe()
            if self._meta_due is not None and time.monotonic() >= self._meta_due:
                self._meta_due = None
                self._publish_now()

    def _probe(self) -> None:
        session = self._session
        if session is None or not self.probe_session or self._lost.is_set():
            return
        try:
            # The session has no TTL: renewing it only asks whether it still exists.
            self.client.session_renew(session, deadline=time.monotonic() + self.settings
                                      .heartbeat_interval)
        except (ConsulNotFound, ConsulSessionInvalid) as exc:
            if self._session == session:
                self.mark_lost(f"its Consul session is gone ({exc})")
        except ConsulError as exc:
            logger.debug("Node %s could not probe its session: %s", self.node_id, exc)

    def _publish_now(self) -> None:
        shown = self._shown()
        # Never while lost: if a newer process took our node id, re-registering our service
        # would remove its check and invalidate its session.
        if shown == self._published or self._session is None or self._lost.is_set():
            return
        try:
            self.client.agent_service_register(
                self.definition(), deadline=time.monotonic() + self.settings.heartbeat_interval)
            self._published = shown
        except ConsulError as exc:
            logger.debug("Node %s could not publish its service meta: %s", self.node_id, exc)
