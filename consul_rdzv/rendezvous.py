"""The rendezvous protocol on Consul, as a plain-Python API (no torch here).

One :class:`ConsulRendezvous` per node. ``next_round()`` blocks until a sealed round lists this
node and returns its rank, the world size and rank 0's trainer-store endpoint;
``num_nodes_waiting()`` answers from a background watch with no Consul request; ``close()`` ends
the run for everyone; ``leave()`` takes this node out cleanly. The protocol is written down in
docs/protocol.md; the KV layout in :mod:`consul_rdzv.layout`, the coordinator's decisions in
:mod:`consul_rdzv.planning`, the node's service, check, session and heartbeat in
:mod:`consul_rdzv.registration`, one ``next_round()``'s work in :mod:`consul_rdzv.join`, the
round a node trains in in :mod:`consul_rdzv.standing`, the operations on a whole run (close,
drain, clean-up) in :mod:`consul_rdzv.runs`.

How it fails, and what the caller must watch for:

* A node that stops passing its TTL check for ``heartbeat_timeout`` is dead to Consul: its session
  is invalidated and its member key deleted. Survivors see that through ``num_nodes_waiting()``
  and :meth:`ConsulRendezvous.wait_round_broken`; the node itself sees it too (its
  ``num_nodes_waiting()`` turns positive), even when it cannot reach Consul at all.
* If this node's own session is invalidated (agent restart, operator), ``num_nodes_waiting()``
  reports at least 1 and the next ``next_round()`` registers again: it never acts on a dead session.
* Consul outages are ridden out with backoff for ``consul_timeout`` per call, and never past the
  join deadline; then :class:`RendezvousConnectionError`.
* A closed run stays closed while any node of the job that closed it is alive; once none is
  left, the next joiner opens it again for a new job (a re-run under the same run id).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from . import quarantine, runs
from .client import ConsulClient, txn_kv
from .errors import (
    ConsulBadRequest,
    ConsulError,
    ConsulPermissionDenied,
    ConsulSessionInvalid,
    ConsulTxnConflict,
    ConsulUnavailableError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from .health import NodeHealth
from .join import Announced, Join, RoundResult, _Rejoin
from .layout import Keys, Round
from .metrics import DEFAULT_HOST, NodeMetrics
from .planning import (
    MAX_TXN_BYTES,
    json_len,
    largest_world,
    round_bytes,
)
from .registration import Incarnation, Registration
from .runs import OUTCOME_CLOSED, Closing
from .runs import OUTCOME_FAILED as OUTCOME_FAILED
from .runs import OUTCOME_FINISHED as OUTCOME_FINISHED
from .service import (
    JOINING,
    MAX_META_VALUE,
    NODE_ID_RULE,
    training_meta,
    training_note,
    valid_node_id,
)
from .settings import RendezvousSettings
from .standing import Standing
from .watch import RoundWatch, WatchedRound, why_over

logger = logging.getLogger(__name__)

_SEQ = itertools.count()
#: Delay between a round's return and publishing its round/rank in the service meta ...
META_DELAY = 0.5
#: ... plus a random share of world_size x META_SPREAD seconds (at most META_SPREAD_MAX): each
#: publish is a service registration, which a Consul agent serialises and syncs to the servers
#: under the lock that TTL check passes also need (a few ms each). The nodes of a large world
#: sharing one agent must not all re-register at once, or their heartbeats starve.
META_SPREAD = 0.02
META_SPREAD_MAX = 30.0
#: How a broken round's reason begins when this node lost its own registration.
OUT_OF_ROUND = "this node is out of its round"


def default_node_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "node"
    return f"{host}-{os.getpid()}-{next(_SEQ)}"


class ConsulRendezvous:
    """One node's handle on one run. Thread-safe for the calls torchrun makes.

    ``endpoint_provider`` is called before each announcement; it returns the trainer-store
    endpoint (``{"host", "port"}``) this node would host if it became rank 0 (the torch adapter
    reserves a socket), or None. ``address`` is where other nodes reach this one (the service
    instance's Address; default ``host``).
    """

    def __init__(self, settings: RendezvousSettings, client: ConsulClient | None = None, *,
                 node_id: str | None = None, host: str | None = None,
                 address: str | None = None,
                 endpoint_provider: Callable[[], dict | None] | None = None) -> None:
        self.settings = settings
        self.client = client or ConsulClient(retry_timeout=settings.consul_timeout)
        self.keys = Keys(settings.prefix)
        self.node_id = node_id or default_node_id()
        if not valid_node_id(self.node_id):
            raise ValueError(f"node id {self.node_id!r} is invalid: use {NODE_ID_RULE}.")
        self.host = host or socket.gethostname()
        _check_round_fits(settings, self.node_id)
        self.incarnation = Incarnation.new()
        self.registration = Registration(self.client, settings, node_id=self.node_id,
                                         host=self.host, incarnation=self.incarnation,
                                         address=address, on_lost=self._on_lost)
        self._endpoint_provider = endpoint_provider
        #: The round this node trains in: nodes waiting, over or not, finished or not.
        self.standing = Standing(self.registration)
        self._lock = threading.Lock()  # guards _left
        self._round: RoundResult | None = None
        self._left = False
        self._warned_settings: tuple[int, int] | None = None
        #: The node's metrics (the ``metrics_port`` setting), None when off.
        self.metrics: NodeMetrics | None = None
        if settings.metrics_port is not None:
            self.metrics = NodeMetrics(settings.run_id, self.node_id,
                                       port=settings.metrics_port,
                                       host=settings.metrics_host or DEFAULT_HOST)
            self.client.observer = self.metrics.request
            self.registration.heartbeat.observer = self.metrics.heartbeat
        #: Our member key as last written; the health thread rewrites it (see Announced).
        self._announced = Announced()
        #: The health of this node's Consul node (None: health_checks=off), from the first
        #: registration on (docs/health.md).
        self.health: NodeHealth | None = None
        if settings.health_checks is not None:
            self.health = NodeHealth(self.client, patterns=settings.health_checks,
                                     node_id=self.node_id, run_id=settings.run_id,
                                     node_name=self._consul_node, on_change=self._health_changed,
                                     wait=settings.watch_wait)
        #: This node's host's quarantine (docs/health.md, "Quarantine"): always watched (an
        #: operator's quarantine is honoured whatever the policy); failures are recorded only
        #: with ``quarantine_failures`` > 0.
        self.quarantine_policy = quarantine.Policy(
            failures=settings.quarantine_failures, window=settings.quarantine_window,
            cooldown=settings.quarantine_cooldown, cooldown_max=settings.quarantine_cooldown_max)
        self.quarantine = quarantine.QuarantineWatch(
            self.client, key=self.keys.quarantined(self.host),
            on_change=self._quarantine_changed, wait=settings.watch_wait)
        #: set by the torch adapter when a round's members did not meet: the next round is no
        #: failure of this host's
        self.abandoned = False

    def __repr__(self) -> str:
        return f"ConsulRendezvous(run={self.settings.run_id!r}, node={self.node_id!r})"

    # ------------------------------------------------------------------ public API

    @property
    def run_id(self) -> str:
        return self.settings.run_id

    @property
    def session_id(self) -> str | None:
        return self.registration.session

    @property
    def service_id(self) -> str:
        return self.registration.service_id

    @property
    def check_id(self) -> str:
        return self.registration.check_id

    @property
    def current_round(self) -> RoundResult | None:
        return self._round

    @property
    def left(self) -> bool:
        return self._left

    def next_round(self) -> RoundResult:
        """Join the next round and block until it is sealed with this node in it."""
        if self._left:
            raise RendezvousStateError(f"Node {self.node_id} has left run {self.run_id}; "
                                       "create a new ConsulRendezvous to join again.")
        self._record_failure()
        if self.metrics is None:
            return self._next_round()
        if self._round is not None:
            self.metrics.restarted(self.restart_cause())
        with self.metrics.rendezvous():
            result = self._next_round()
        self.metrics.joined(result.round, result.world_size)
        return result

    def restart_cause(self) -> str:
        """Why this node enters a new rendezvous after a round it was in, as far as it knows
        without asking Consul (one of :data:`consul_rdzv.metrics.RESTART_CAUSES`)."""
        reason = self.standing.broken_reason if self.standing.broken else ""
        if self.registration.lost or reason.startswith(OUT_OF_ROUND):
            return "health"
        over = why_over(reason)
        if over is not None:
            return over
        if self.standing.waiting() > 0:
            return "spare"
        return "local"

    def _next_round(self) -> RoundResult:
        self.registration.watch_gossip(False)
        self.standing.begin()
        # Probe the session only once the node has waited a while: a quick round needs no
        # probe, and a lost session usually shows up as a lapsed check anyway.
        self.registration.probe_session_from(time.monotonic() + self.settings.heartbeat_timeout)
        started = time.time()
        requests_before = self.client.requests_sent_by_this_thread
        deadline = time.monotonic() + self.settings.join_timeout
        with self._announced.lock:
            self._announced.joining = True
        try:
            while True:
                try:
                    self.registration.ensure(self._op_deadline(deadline))
                    self._know_health(deadline)
                    result = Join(client=self.client, keys=self.keys, settings=self.settings,
                                  registration=self.registration, node_id=self.node_id,
                                  host=self.host, incarnation=self.incarnation, last=self._round,
                                  endpoint_provider=self._endpoint_provider,
                                  deadline=deadline, announced=self._announced,
                                  health=self.health_reason).run()
                    with self._announced.lock:
                        self._announced.joining = False
                    break
                except _Rejoin as exc:
                    self.registration.mark_lost(f"lost its Consul session ({exc})",
                                                confirmed=exc.confirmed)
                    if time.monotonic() >= deadline:
                        raise RendezvousTimeoutError(
                            f"Node {self.node_id} of run {self.run_id} kept losing its Consul "
                            f"session until join_timeout ({self.settings.join_timeout:g}s)."
                        ) from exc
        except (RendezvousTimeoutError, RendezvousStateError, RendezvousClosedError):
            # We stop waiting (a timeout, a refusal, a closed run, a drain): no coordinator may
            # count us in, and a coordinator role we hold would leave the others without one
            # while our session lives on (a re-run under the same id would have none).
            self._drop_member(leader=True)
            raise
        except ConsulPermissionDenied as exc:
            raise RendezvousConnectionError(
                f"Consul at {self.client.config.url} refused node {self.node_id} of run "
                f"{self.run_id}: {exc}"
            ) from exc
        except ConsulUnavailableError as exc:
            raise RendezvousConnectionError(
                f"Consul at {self.client.config.url} is unreachable for node {self.node_id} of "
                f"run {self.run_id} (gave up after {self.settings.consul_timeout:g}s of retries): "
                f"{exc}. Check --rdzv-endpoint / CONSUL_HTTP_ADDR and that the agent is running."
            ) from exc
        except ConsulBadRequest as exc:
            raise RendezvousStateError(
                f"Consul refused a request of node {self.node_id} of run {self.run_id}: {exc}"
            ) from exc
        except ConsulError as exc:
            raise RendezvousConnectionError(
                f"Consul call failed for node {self.node_id} of run {self.run_id}: {exc}"
            ) from exc
        self._check_round_settings(result)
        result.timings.update(join_started=started, released=time.time())
        result.requests = self.client.requests_sent_by_this_thread - requests_before
        self._round = result
        self.standing.joined()
        spread = random.uniform(0.0, min(META_SPREAD_MAX, result.world_size * META_SPREAD))
        store = result.store or {}
        self.registration.publish(
            training_meta(result.round, result.rank, result.world_size, store),
            delay=META_DELAY + spread,
            note=training_note(result.round, result.rank, result.world_size),
            port=store.get("port") if result.rank == 0 and isinstance(store.get("port"), int)
            else None)
        self._start_watch(result)
        logger.info("Node %s joined round %d of run %s as rank %d of %d in %.0f ms (%d Consul "
                    "requests).", self.node_id, result.round, self.run_id, result.rank,
                    result.world_size, (result.timings["released"] - started) * 1000,
                    result.requests)
        return result

    def _check_round_settings(self, result: RoundResult) -> None:
        """Nodes of one run started with different ``--nnodes`` ranges: the coordinator's
        settings shape the rounds (and the room the training watch counts); say so, once."""
        sealed = (result.min_nodes, result.max_nodes)
        mine = (self.settings.min_nodes, self.settings.max_nodes)
        if not result.max_nodes or sealed == mine or sealed == self._warned_settings:
            return
        self._warned_settings = sealed
        logger.warning(
            "Node %s of run %s runs with min_nodes=%d, max_nodes=%d (--nnodes %d:%d), but round "
            "%d was sealed by coordinator %s with min_nodes=%d, max_nodes=%d: the coordinator's "
            "settings decide the rounds. Start every node of a run with the same --nnodes.",
            self.node_id, self.run_id, mine[0], mine[1], mine[0], mine[1], result.round,
            result.coordinator, sealed[0], sealed[1])

    def register(self, timeout: float | None = None) -> None:
        """Register this node's service, check and session now (``next_round()`` does it too).

        Lets a node show up in Consul as soon as it starts, and takes the two registration
        requests off the path of its first round. A predecessor with the same node id on the
        same agent loses its registration at once. ``timeout`` bounds the retries (default
        ``consul_timeout``).
        """
        deadline = time.monotonic() + (timeout or self.settings.consul_timeout)
        try:
            self.registration.ensure(deadline)
        except ConsulError as exc:
            raise self._connection_error("register its service and session", exc) from exc
        if self.health is not None:
            self.health.start()  # its first answer is in before the first announcement
        self.quarantine.start()

    def health_reason(self) -> str:
        """Why this node is held out of rounds: its host is quarantined, or its Consul node has
        a critical node-level check or is in maintenance mode; "" while it may train
        (docs/health.md). No Consul request."""
        reasons = (self.quarantine.reason, self.health.reason if self.health is not None else "")
        return "; ".join(r for r in reasons if r)

    def num_nodes_waiting(self) -> int:
        """See module docstring: a local read, no Consul request.

        0 once the run was closed as finished in this node's round (another node's workers
        succeeded and it left): this node's workers finish their work, nothing restarts them.
        """
        return self.standing.waiting()

    def wait_round_broken(self, timeout: float) -> str | None:
        """Block up to ``timeout`` until the current round cannot run any more; why, or None.

        A round breaks when a participant is gone (dead, left), asks for a new round, or when
        this node's own registration is lost. Used by the torch adapter while the members of a
        round meet at the trainer store.
        """
        return self.standing.wait_broken(timeout)

    def wait_round_broken_or(self, event: threading.Event, timeout: float) -> str | None:
        """Block until ``event`` is set or the current round breaks, at most ``timeout``; why
        the round broke, or None. No polling: breaking the round sets ``event`` too."""
        return self.standing.wait_broken_or(event, timeout)

    def is_closed(self) -> bool:
        try:
            res = self.client.kv_get(self.keys.round, deadline=self._op_deadline())
        except ConsulError as exc:
            raise self._connection_error("read the state of the run", exc) from exc
        return bool(res.data and Round.decode(res.data).closed)

    def close(self, reason: str = "closed", *, timeout: float | None = None) -> None:
        """Mark the run closed: every waiting and future joiner gets RendezvousClosedError,
        until every node of this job is gone (then the run id can be used again)."""
        self._close(reason, None, timeout, OUTCOME_CLOSED)

    def close_if_current(self, result: RoundResult, reason: str, *,
                         outcome: str = OUTCOME_CLOSED, timeout: float | None = None) -> bool:
        """Close the run only if ``result`` is still its current round (this node's job has
        not moved on without it). True if the run is closed now.

        ``outcome`` :data:`OUTCOME_FINISHED` (this node's work succeeded: the job is done) lets
        the other members of the round finish theirs: their watch takes this node's departure
        for the job's end, not a death (:mod:`consul_rdzv.watch`). Any other outcome ends the
        round for everyone, as a departure does.
        """
        return self._close(reason, result.seal_id, timeout, outcome)

    def _close(self, reason: str, seal_id: str | None, timeout: float | None,
               outcome: str) -> bool:
        budget = timeout or self.settings.close_timeout
        try:
            done = runs.close(self.client, self.keys, reason=reason, by=self.node_id,
                              outcome=outcome, seal_id=seal_id,
                              deadline=time.monotonic() + budget)
        except ConsulError as exc:
            raise self._connection_error("close it", exc) from exc
        if done.result is Closing.MOVED_ON:
            logger.info("Node %s does not close run %s: its round is no longer the current one "
                        "(round %d is).", self.node_id, self.run_id, done.round.round)
        elif done.result is Closing.CONTENDED:
            raise RendezvousConnectionError(
                f"Could not close run {self.run_id} within {budget:g}s: the round key kept "
                "changing."
            )
        elif done.result is Closing.CLOSED:
            logger.info("Node %s closed run %s (%s).", self.node_id, self.run_id, reason)
        return done.closed

    def leave(self, *, timeout: float | None = None) -> bool:
        """Leave cleanly: release keys, deregister the service, destroy the session.

        Never closes the run. If this node was the run's last member, what the run left in Consul
        goes too (:meth:`_clean_up_run`): a run that ended leaves nothing behind. Returns False
        if some step failed (logged); idempotent. ``timeout`` bounds it (default
        ``close_timeout``).
        """
        with self._lock:
            already, self._left = self._left, True
        self.standing.end()
        if self.health is not None:
            self.health.stop()
        self.quarantine.stop()
        with self._announced.lock:
            self._announced.member = None
        if already:
            return True
        deadline = time.monotonic() + (timeout or self.settings.close_timeout)
        session = self.registration.session
        ok = True
        if session is not None:
            for key in (self.keys.member(self.node_id), self.keys.leader):
                try:
                    self.client.txn([txn_kv("check-session", key, session=session),
                                     txn_kv("delete", key)], deadline=deadline)
                except ConsulTxnConflict:
                    pass  # not ours (or gone already)
                except ConsulError as exc:
                    ok = False
                    logger.warning("Node %s could not release %s while leaving run %s: %s",
                                   self.node_id, key, self.run_id, exc)
            if ok:
                with contextlib.suppress(ConsulError, RendezvousStateError):
                    self._clean_up_run(deadline)
        ok = self.registration.close(deadline) and ok
        if self.metrics is not None:
            self.metrics.close()
        logger.info("Node %s left run %s.", self.node_id, self.run_id)
        return ok

    def halt(self) -> None:
        """Stop this node's threads and leave everything in Consul as it is, as a killed process
        does: its check lapses after heartbeat_timeout (tests and benchmarks simulate a death
        with this). The node cannot be used afterwards."""
        with self._lock:
            self._left = True
        self.standing.end()  # it ends after its current query
        if self.health is not None:
            self.health.stop()
        self.quarantine.stop()
        self.registration.halt()
        if self.metrics is not None:
            self.metrics.close()

    # ------------------------------------------------------------------ helpers

    def _op_deadline(self, deadline: float | None = None) -> float:
        """The hard deadline of one Consul call: the caller's (the join deadline), or
        ``consul_timeout`` from now. The client stops retrying ``consul_timeout`` after the
        call's first failure in any case, so a slow answer is retried but an outage is not
        ridden out for longer than ``consul_timeout``."""
        return time.monotonic() + self.settings.consul_timeout if deadline is None else deadline

    def _connection_error(self, what: str, exc: ConsulError) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"Node {self.node_id} of run {self.run_id} could not {what} (Consul at "
            f"{self.client.config.url}): {exc}"
        )

    def _on_lost(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.session_lost()
        self.standing.set_broken(f"{OUT_OF_ROUND}: {reason}")

    # ------------------------------------------------------------------ what a run leaves behind

    def _clean_up_run(self, deadline: float) -> None:
        """Leaving as the run's last member: remove what the run left in Consul, keeping a
        closed run's marker for ``closed_retention`` (:func:`consul_rdzv.runs.clean_up`)."""
        done = runs.clean_up(self.client, self.keys, run_id=self.run_id,
                             closed_retention=self.settings.closed_retention, deadline=deadline,
                             history_retention=self.settings.history_retention)
        if done.removed:
            logger.debug("Node %s removed what run %s left in Consul as its last member%s.",
                         self.node_id, self.run_id,
                         f" (its closed marker stays for {self.settings.closed_retention:g}s)"
                         if done.kept_marker else "")

    def _drop_member(self, *, leader: bool = False) -> None:
        with self._announced.lock:
            self._announced.member = None
            self._announced.joining = False
        session = self.registration.session
        for key in (self.keys.member(self.node_id), *([self.keys.leader] if leader else [])):
            with contextlib.suppress(ConsulError):
                self.client.txn([txn_kv("check-session", key, session=session),
                                 txn_kv("delete", key)], deadline=self._op_deadline())

    # ------------------------------------------------------------------ node health

    def _consul_node(self) -> str:
        """The Consul node this node's agent is: where its session lives."""
        session = self.registration.session
        info = self.client.session_info(session, deadline=self._op_deadline()) if session \
            else None
        if not info or not info.get("Node"):
            raise ConsulUnavailableError(f"node {self.node_id} has no session to find its "
                                         "Consul node by yet")
        return str(info["Node"])

    def _know_health(self, deadline: float) -> None:
        """Before announcing: the first answer of the health watch (started here at the
        latest; read while the node registered, so usually in already)."""
        self.quarantine.start()
        if not self.quarantine.wait_known(min(deadline, self._op_deadline())):
            logger.warning("Node %s of run %s could not read the quarantine of its host %s "
                           "within consul_timeout; it announces itself as not quarantined.",
                           self.node_id, self.run_id, self.host)
        health = self.health
        if health is None:
            return
        health.start()
        if not health.wait_known(min(deadline, self._op_deadline())):
            logger.warning("Node %s of run %s could not read the health of its Consul node "
                           "within consul_timeout; it announces itself as healthy.",
                           self.node_id, self.run_id)
        if health.error:
            raise RendezvousConnectionError(health.error[0].upper() + health.error[1:] + ".")

    def _quarantine_changed(self, reason: str) -> None:
        """The quarantine watch saw this node's host quarantined or let out: as for health."""
        if reason:
            logger.warning("Node %s of run %s is held out of rounds: %s.", self.node_id,
                           self.run_id, reason)
            shown = {"state": JOINING, "quarantined": reason[:MAX_META_VALUE]}
            self.registration.publish(shown, note=f"held out: {reason}")
        else:
            logger.info("Node %s of run %s: its host %s is out of quarantine; it may join the "
                        "next round.", self.node_id, self.run_id, self.host)
            if self._announced.joining or self._round is None:
                self.registration.publish({"state": JOINING}, note=JOINING)
        self._hold_changed()

    def _record_failure(self) -> None:
        """Before a new round after one this node was in: count a failure of its host when it
        knows of one (its session was lost while it trained, or its workers failed: it asks
        for a new round while its round was intact), with ``quarantine_failures`` > 0."""
        abandoned, self.abandoned = self.abandoned, False
        if self._round is None or abandoned or not self.quarantine_policy.recording:
            return
        if self.registration.lost:
            what = "its Consul session was lost while it trained"
        elif self.restart_cause() == "local":
            what = "its workers failed"
        else:
            return
        now = time.time()
        try:
            value = quarantine.update(
                self.client, self.keys.quarantined(self.host),
                lambda v: quarantine.record_failure(v, host=self.host, now=now,
                                                    policy=self.quarantine_policy, what=what,
                                                    by=self.node_id),
                deadline=self._op_deadline())
        except (ConsulError, RendezvousStateError) as exc:
            logger.warning("Node %s of run %s could not record a failure of its host %s (%s): "
                           "%s", self.node_id, self.run_id, self.host, what, exc)
            return
        if quarantine.active(value, now) and not value.get("failures"):
            logger.warning("Node %s of run %s recorded a failure of its host %s (%s): the host "
                           "is quarantined (quarantine_failures=%d).", self.node_id, self.run_id,
                           self.host, what, self.quarantine_policy.failures)
        else:
            logger.info("Node %s of run %s recorded a failure of its host %s: %s (%d within "
                        "quarantine_window).", self.node_id, self.run_id, self.host, what,
                        len(value.get("failures") or []))
        self.quarantine.apply(value)  # held out before the next announcement

    def _health_changed(self, reason: str) -> None:
        """The health thread saw this node's Consul node change (as for the quarantine)."""
        node = self.health.node if self.health is not None else "?"
        if reason:
            logger.warning("Node %s of run %s is held out of rounds: its Consul node %s is "
                           "unhealthy (%s).", self.node_id, self.run_id, node, reason)
        else:
            logger.info("Node %s of run %s: its Consul node %s is healthy again; it may join "
                        "the next round.", self.node_id, self.run_id, node)
        self._hold_changed()

    def _hold_changed(self) -> None:
        """Why this node is held out changed: rewrite our member key while we join (a
        coordinator admits or holds out on it), or, while we train, take this node out of its
        round at once (``health_evict``): the others see our key rewritten and re-form without
        us; we wait, held out, until the reason is gone."""
        reason = self.health_reason()
        with self._announced.lock:
            written = self._announced
            if written.member is None or written.session is None \
                    or written.member.health == reason:
                return
            evict = not written.joining
            if evict and (not reason or not self.settings.health_evict):
                if reason:
                    logger.warning("Node %s of run %s keeps training (health_evict is off); "
                                   "its next round holds it out while the node is unhealthy.",
                                   self.node_id, self.run_id)
                return
            key = self.keys.member(self.node_id)
            member = replace(written.member, health=reason)
            try:
                res = self.client.txn(
                    [txn_kv("check-index", key, index=written.index),
                     txn_kv("lock", key, value=member.encode(), session=written.session)],
                    deadline=self._op_deadline())
            except (ConsulTxnConflict, ConsulSessionInvalid):
                written.member = None  # rewritten or gone since: the next announcement tells
                return
            except ConsulError as exc:
                logger.warning("Node %s of run %s could not write its health to its member "
                               "key: %s", self.node_id, self.run_id, exc)
                return
            written.member = member
            entry = res.data[-1] if res.data else None
            written.index = entry.modify_index if entry is not None else written.index
        if evict:
            current = self._round
            logger.warning("Node %s leaves round %s of run %s: it is held out (%s); the others "
                           "re-form without it (health_evict).", self.node_id,
                           current.round if current else "?", self.run_id, reason)

    # ------------------------------------------------------------------ training-time watch

    def _start_watch(self, result: RoundResult) -> None:
        # The watch sees our member key vanish with our session: no need to probe it too. A
        # node cut off from the cluster cannot see that: its agent's gossip tells.
        self.registration.probe_session_from(None)
        self.registration.watch_gossip(True)
        watched = WatchedRound(
            round=result.round, participants=list(result.participants),
            members_index=result.members_index, joined_index=result.joined_index,
            seal_id=result.seal_id, max_nodes=result.max_nodes or self.settings.max_nodes,
            settings=self.settings, node_id=self.node_id)
        with self._lock:
            if self._left:
                return
            self.standing.watch(RoundWatch(self.client, self.keys, watched, self.standing,
                                           wait=self.settings.watch_wait))


def _check_round_fits(settings: RendezvousSettings, node_id: str) -> None:
    """Refuse a max_nodes whose sealed round could not fit Consul's transaction limit."""
    id_len = json_len(node_id)
    if round_bytes(settings.max_nodes, id_len, len(settings.prefix)) <= MAX_TXN_BYTES:
        return
    fits = largest_world(id_len, len(settings.prefix))
    raise ValueError(
        f"max_nodes={settings.max_nodes} does not fit in Consul: a sealed round names every "
        f"node (ids like {node_id!r}, {id_len} characters) in one "
        f"transaction, and Consul refuses transactions over {MAX_TXN_BYTES // 1024} KiB. The "
        f"largest world that fits with such names is about {fits} nodes: use shorter node ids "
        "(rdzv conf node_id) or a lower max_nodes."
    )
