"""The rendezvous protocol on Consul, as a plain-Python API (no torch here).

One :class:`ConsulRendezvous` per node. ``next_round()`` blocks until a sealed round lists this
node and returns its rank, the world size and rank 0's trainer-store endpoint;
``num_nodes_waiting()`` answers from a background watch with no Consul request; ``close()`` ends
the run for everyone; ``leave()`` takes this node out cleanly. The protocol is written down in
docs/protocol.md; the KV layout in :mod:`consul_rdzv.layout`, the coordinator's decisions in
:mod:`consul_rdzv.planning`, the node's service, check, session and heartbeat in
:mod:`consul_rdzv.registration`, the operations on a whole run (close, drain, clean-up) in
:mod:`consul_rdzv.runs`.

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
import json
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from . import runs
from .client import BlockingIndex, ConsulClient, QueryResult, txn_kv
from .errors import (
    ConsulBadRequest,
    ConsulError,
    ConsulPermissionDenied,
    ConsulSessionInvalid,
    ConsulTxnConflict,
    ConsulUnavailableError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousReplacedError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from .layout import Keys, Leader, Member, Round, RunState
from .planning import (
    MAX_TXN_BYTES,
    active_participants,
    explicit_gap,
    json_len,
    largest_world,
    plan_round,
    round_bytes,
)
from .ranks import Candidate
from .registration import Incarnation, Registration
from .runs import OUTCOME_CLOSED, Closing
from .runs import OUTCOME_FAILED as OUTCOME_FAILED
from .runs import OUTCOME_FINISHED as OUTCOME_FINISHED
from .service import NODE_ID_RULE, training_meta, training_note, valid_node_id
from .settings import RendezvousSettings
from .watch import RoundWatch, WatchedRound

logger = logging.getLogger(__name__)

_SEQ = itertools.count()
#: Longest single blocking query while waiting for a round (a return is cheap; it lets the
#: waiter notice a lost session or a passed deadline).
ROUND_WAIT = 10.0
#: Delay between a round's return and publishing its round/rank in the service meta ...
META_DELAY = 0.5
#: ... plus a random share of world_size x META_SPREAD seconds (at most META_SPREAD_MAX): each
#: publish is a service registration, which a Consul agent serialises and syncs to the servers
#: under the lock that TTL check passes also need (a few ms each). The nodes of a large world
#: sharing one agent must not all re-register at once, or their heartbeats starve.
META_SPREAD = 0.02
META_SPREAD_MAX = 30.0
#: A waiting node logs its progress (INFO) this often.
PROGRESS_EVERY = 15.0


def default_node_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "node"
    return f"{host}-{os.getpid()}-{next(_SEQ)}"


@dataclass
class RoundResult:
    """What one node got from one round."""

    run_id: str
    round: int
    rank: int
    world_size: int
    participants: list[str]
    hosts: list[str]
    store: dict | None
    coordinator: str
    seal_id: str
    members_index: int
    joined_index: int = 0
    round_index: int = 0  # the round key's ModifyIndex as sealed
    min_nodes: int = 0  # the round's, as its coordinator sealed it
    max_nodes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    requests: int = 0


class _Rejoin(Exception):
    """Our session is gone: register again and restart the join (same deadline).

    ``confirmed``: on Consul's word (the usual case); False when this node only suspects it
    (its passes failed for the TTL and Consul could not be asked), so that ensure() asks again
    before it replaces the session."""

    def __init__(self, reason: str, *, confirmed: bool = True) -> None:
        super().__init__(reason)
        self.confirmed = confirmed


class _LostLeadership(Exception):
    """The leader key is no longer ours: go back to waiting."""


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
        _check_round_fits(settings, self.node_id, self.host)
        self.incarnation = Incarnation.new()
        self.registration = Registration(self.client, settings, node_id=self.node_id,
                                         host=self.host, incarnation=self.incarnation,
                                         address=address, on_lost=self._on_lost)
        self._endpoint_provider = endpoint_provider
        self._lock = threading.Lock()
        self._round: RoundResult | None = None
        self._last_round_no = 0
        self._waiting = 0
        self._broken = threading.Event()
        self._broken_reason = ""
        self._broken_listeners: set[threading.Event] = set()
        self._closed_alive: list[str] = []  # nodes of the job that closed the run, still alive
        self._left = False
        #: The current round's watch (None while joining, after leave()).
        self._watch: RoundWatch | None = None
        #: The run was closed as finished in the current round: nothing more can end it.
        self._finished: dict | None = None
        self._warned_settings: tuple[int, int] | None = None

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
        self.registration.watch_gossip(False)
        with self._lock:
            self._stop_watch()  # the previous round's
            self._waiting = 0
            self._finished = None
            self._broken.clear()
        # Probe the session only once the node has waited a while: a quick round needs no
        # probe, and a lost session usually shows up as a lapsed check anyway.
        self.registration.probe_session_from(time.monotonic() + self.settings.heartbeat_timeout)
        started = time.time()
        requests_before = self.client.requests_sent_by_this_thread
        deadline = time.monotonic() + self.settings.join_timeout
        try:
            while True:
                try:
                    self.registration.ensure(self._op_deadline(deadline))
                    result = self._join(deadline)
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
        self._last_round_no = result.round
        with self._lock:
            self._broken.clear()  # a loss repaired during the join does not break the new round
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

    def num_nodes_waiting(self) -> int:
        """See module docstring: a local read, no Consul request.

        0 once the run was closed as finished in this node's round (another node's workers
        succeeded and it left): this node's workers finish their work, nothing restarts them.
        """
        if self._finished is not None:
            return 0
        if self.registration.lost:
            return max(self._waiting, 1)
        return self._waiting

    def wait_round_broken(self, timeout: float) -> str | None:
        """Block up to ``timeout`` until the current round cannot run any more; why, or None.

        A round breaks when a participant is gone (dead, left), asks for a new round, or when
        this node's own registration is lost. Used by the torch adapter while the members of a
        round meet at the trainer store.
        """
        if self._broken.wait(timeout):
            return self._broken_reason
        return None

    def wait_round_broken_or(self, event: threading.Event, timeout: float) -> str | None:
        """Block until ``event`` is set or the current round breaks, at most ``timeout``; why
        the round broke, or None. No polling: breaking the round sets ``event`` too."""
        with self._lock:
            self._broken_listeners.add(event)
        try:
            if not self._broken.is_set():
                event.wait(timeout)
            return self._broken_reason if self._broken.is_set() else None
        finally:
            with self._lock:
                self._broken_listeners.discard(event)

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
            self._stop_watch()
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
        logger.info("Node %s left run %s.", self.node_id, self.run_id)
        return ok

    def halt(self) -> None:
        """Stop this node's threads and leave everything in Consul as it is, as a killed process
        does: its check lapses after heartbeat_timeout (tests and benchmarks simulate a death
        with this). The node cannot be used afterwards."""
        with self._lock:
            self._left = True
            self._stop_watch()  # it ends after its current query
        self.registration.halt()

    # ------------------------------------------------------------------ helpers

    def _op_deadline(self, deadline: float | None = None) -> float:
        """The hard deadline of one Consul call: the caller's (the join deadline), or
        ``consul_timeout`` from now. The client stops retrying ``consul_timeout`` after the
        call's first failure in any case, so a slow answer is retried but an outage is not
        ridden out for longer than ``consul_timeout``."""
        return time.monotonic() + self.settings.consul_timeout if deadline is None else deadline

    def _blocking_list(self, prefix: str, index: BlockingIndex, wait: float,
                       deadline: float) -> QueryResult:
        """A blocking read whose consul_timeout of retries starts when Consul fails.

        A deadline set when the query is sent would be spent by a legitimate wait, and an outage
        late in the wait would then fail at once, without a single retry. After a failure,
        Consul may come back without our session and with lower indexes (state lost): the
        retries do not block (a query at our old index would sit out its whole wait), and our
        session is checked before we wait on. ``index`` is updated here (its answer moved,
        stayed or went backwards; callers decide from the data, never from the index).
        """
        with contextlib.suppress(ConsulUnavailableError):
            res = self.client.kv_list(prefix, index=index.param, wait=wait,
                                      deadline=time.monotonic())  # one attempt, no retries
            index.update(res.index)
            return res
        res = self.client.kv_list(prefix, deadline=self._op_deadline(deadline))
        index.rebase(res.index)
        session = self.registration.session
        if session and self.client.session_info(
                session, deadline=self._op_deadline(deadline)) is None:
            raise _Rejoin("the session did not survive a Consul outage")
        return res

    def _connection_error(self, what: str, exc: ConsulError) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"Node {self.node_id} of run {self.run_id} could not {what} (Consul at "
            f"{self.client.config.url}): {exc}"
        )

    def _on_lost(self, reason: str) -> None:
        self._set_broken(f"this node is out of its round: {reason}")

    def _set_broken(self, reason: str) -> None:
        if not self._broken.is_set():
            self._broken_reason = reason
            self._broken.set()
            for event in list(self._broken_listeners):
                event.set()

    # ------------------------------------------------------------------ joining

    def _member(self) -> Member:
        endpoint = self._endpoint_provider() if self._endpoint_provider else None
        return Member(node=self.node_id, host=self.host, pid=os.getpid(),
                      want=self._last_round_no + 1 if self._last_round_no else 0,
                      rank=self.settings.node_rank, endpoint=endpoint,
                      meta=dict(self.settings.node_meta),
                      incarnation=self.incarnation.id, started=self.incarnation.started,
                      min_nodes=self.settings.min_nodes, max_nodes=self.settings.max_nodes)

    def _write_member(self, deadline: float) -> tuple[int, RunState]:
        """Write our member key (locked by our session) and read the round state, in one txn.

        A key held by an earlier process of ours (same node id and host: a restart) is taken
        over; a key held by a newer one means we were replaced; by a node on another host, that
        the node id is used twice.

        A node that trained in a round rewrites its key only if that round's key is unchanged
        (``check-index``): a rewrite asks every member for a new round, and a run closed since
        (its job finished on another node) must not be asked. If the round key changed, it is
        read: closed, this node's job is over (RendezvousClosedError, its key untouched); a
        newer round, the node announces itself without the guard.
        """
        session = self.registration.session
        key = self.keys.member(self.node_id)
        guard = self._round.round_index if self._round is not None else 0
        for _ in range(4):
            ops = [txn_kv("lock", key, value=self._member().encode(), session=session),
                   txn_kv("get-tree", self.keys.round_dir),
                   txn_kv("get-tree", self.keys.drain(self.node_id))]
            if guard:
                ops.append(txn_kv("check-index", self.keys.round, index=guard))
            try:
                res = self.client.txn(ops, deadline=self._op_deadline(deadline))
            except ConsulTxnConflict as exc:
                if guard and any(e.op_index == 3 for e in exc.errors):
                    guard = 0
                    current = self.client.kv_get(self.keys.round,
                                                 deadline=self._op_deadline(deadline)).data
                    if current is not None and Round.decode(current).closed:
                        raise self._closed_error(Round.decode(current)) from None
                    continue
                holder = self.client.kv_get(key, deadline=self._op_deadline(deadline)).data
                if holder is None or not holder.session or holder.session == session:
                    raise _Rejoin(f"could not lock {key}: {exc}") from exc
                self._take_over(Member.decode(holder), holder.session, deadline)
                continue
            except ConsulSessionInvalid as exc:
                raise _Rejoin(str(exc)) from exc
            # results: the lock's, one per entry of the two trees, the check-index's (no value)
            entries = [e for e in res.data[1:len(res.data) - (1 if guard else 0)]
                       if e is not None]
            state = RunState.parse(self.keys, entries)
            self._check_drained(state, deadline)
            return res.data[0].modify_index, state
        raise _Rejoin(f"could not lock {key} after taking it over")

    def _check_drained(self, state: RunState, deadline: float) -> None:
        """An operator drained this process (``consul-rdzv drain``): leave for good.

        A request that names another process of this node id is stale: we hold the node id
        now (our member key is locked), so that process died or was replaced before it saw the
        request. It is removed, not left behind.
        """
        drain = state.drains.get(self.node_id)
        if drain is None:
            return
        if drain.incarnation not in ("", self.incarnation.id):
            with contextlib.suppress(ConsulError):
                runs.withdraw_drain(self.client, self.keys, self.node_id, drain,
                                    deadline=self._op_deadline(deadline))
                logger.info("Node %s of run %s removed a drain request for an earlier process "
                            "of its node id (incarnation %s), which is gone.", self.node_id,
                            self.run_id, drain.incarnation[:8])
            return
        with contextlib.suppress(ConsulError):
            runs.withdraw_drain(self.client, self.keys, self.node_id, drain,
                                deadline=self._op_deadline(deadline))
        raise RendezvousClosedError(
            f"Node {self.node_id} was drained from run {self.run_id} by {drain.by or '?'}"
            f"{' (' + drain.reason + ')' if drain.reason else ''}: it leaves the run for good, "
            "the others go on without it. Start it again (a new process) to rejoin."
        )

    def _take_over(self, holder: Member, holder_session: str, deadline: float) -> None:
        """Our member key is held by another live session: take it over, or refuse."""
        theirs = Incarnation(holder.started, holder.incarnation)
        if holder.host != self.host:
            raise RendezvousStateError(
                f"Node id {self.node_id!r} is already used by another live node in run "
                f"{self.run_id} (pid {holder.pid} on host {holder.host}, session "
                f"{holder_session}). Give every node a unique node id."
            )
        if theirs > self.incarnation:
            raise RendezvousReplacedError(
                f"Node {self.node_id} of run {self.run_id} was replaced by a newer process with "
                f"the same node id (pid {holder.pid} on host {holder.host}); this process stops."
            )
        logger.warning("Node %s of run %s takes over its node id from an earlier process (pid %d "
                       "on %s) whose session %s still held it.", self.node_id, self.run_id,
                       holder.pid, holder.host, holder_session)
        with contextlib.suppress(ConsulError):
            self.client.session_destroy(holder_session, deadline=self._op_deadline(deadline))

    def _join(self, deadline: float) -> RoundResult:
        self._closed_alive = []
        my_index, state = self._write_member(deadline)
        while state.round and state.round.closed:
            self._reopen(state.round, deadline)
            # Read the round again, without announcing again: a second write of our key would
            # be taken for a request of a new round by a coordinator that sealed us in already.
            state = RunState.parse(self.keys, self.client.kv_list(
                self.keys.round_dir, deadline=self._op_deadline(deadline)).data)
        if self.settings.rank_policy == "explicit":
            self._check_explicit_rank(deadline)
        # Our member write's index, borrowed: an answer of P/round/ at or below it means that
        # nothing was sealed, closed or elected since (see BlockingIndex).
        index = BlockingIndex(my_index, borrowed=True)
        progress = _Progress(self, deadline)
        while True:
            session = self.registration.session
            if state.leader_session is None:
                leader = Leader(node=self.node_id, session=session or "", since=time.time())
                try:
                    acquired = self.client.kv_put(self.keys.leader, leader.encode(),
                                                  acquire=session,
                                                  deadline=self._op_deadline(deadline))
                except ConsulSessionInvalid as exc:
                    raise _Rejoin(str(exc)) from exc
                if acquired:
                    logger.debug("Node %s is the coordinator of run %s.", self.node_id,
                                 self.run_id)
                    state.leader_session = session
            if state.leader_session == session:
                try:
                    return self._coordinate(deadline, my_index, progress)
                except _LostLeadership as exc:
                    logger.warning("Node %s lost the coordinator role of run %s (%s).",
                                   self.node_id, self.run_id, exc)
                    index = BlockingIndex()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout_error()
            if not self.registration.held(self._op_deadline(deadline)):
                raise _Rejoin(self.registration.lost_reason,
                              confirmed=self.registration.lost_confirmed)
            res = self._blocking_list(self.keys.round_dir, index,
                                      min(remaining, ROUND_WAIT, progress.wait()), deadline)
            state = RunState.parse(self.keys, res.data)
            current = state.round
            if current and current.closed:
                raise self._closed_error(current)
            if self._meant_for_me(current, my_index):
                return self._result(current)
            progress.maybe_log(state)

    def _meant_for_me(self, current: Round | None, my_index: int) -> bool:
        """A sealed round that lists this process: its node id, from a member snapshot that
        covers our write, and (rounds that record it) our incarnation: a newer process with our
        node id may have been sealed in, and that round is not ours."""
        if not current or self.node_id not in current.ranks or current.members_index < my_index:
            return False
        if current.incarnations:
            return current.incarnations[current.ranks.index(self.node_id)] == self.incarnation.id
        return True

    def _reopen(self, closed: Round, deadline: float) -> None:
        """The run is closed: start a new job on it, or refuse (RendezvousClosedError).

        * A node of the job that ended refuses: it was in one of its rounds, or its process
          started before the run was closed (a straggler of that job, launched with it but
          late: it must not run the job again on its own).
        * A process started after the close is a new job on the same run id (a re-run). It
          waits, within its join deadline, until no node of the job that ended is left (the
          members whose keys were written before the close: some may still finish their work),
          then removes the closed marker (``delete-cas``) and returns: the caller announces
          itself again, rounds count from 1.
        """
        info = closed.closed or {}
        closed_at = _float(info.get("at"))
        if self._round is not None:
            raise self._closed_error(closed)  # we are a node of the job that ended
        if closed_at and self.incarnation.started < closed_at:
            raise RendezvousClosedError(
                f"Run {self.run_id} was closed by {info.get('by', '?')} "
                f"({info.get('reason', '')}) at {_utc(closed_at)}, after this process started "
                f"(at {_utc(self.incarnation.started)}): node {self.node_id} belongs to the job "
                "that ended and does not start it again on its own. To run the job again, "
                "start its nodes anew, or use a new run id."
            )
        index = BlockingIndex()
        progress = _Progress(self, deadline)
        while True:
            res = self._blocking_list(self.keys.members, index,
                                      min(ROUND_WAIT, progress.wait()), deadline)
            old = sorted(e.key[len(self.keys.members):] for e in res.data
                         if e.modify_index < closed.modify_index)
            if not old:
                break
            self._closed_alive = old
            if time.monotonic() >= deadline:
                raise self._closed_error(closed)
            progress.maybe_log(RunState(), f"run closed by {info.get('by', '?')}: waiting for "
                               f"{len(old)} node(s) of the job that ended to leave "
                               f"({', '.join(old[:8])})")
        self._closed_alive = []
        try:
            self.client.txn([txn_kv("delete-cas", self.keys.round, index=closed.modify_index)],
                            deadline=self._op_deadline(deadline))
        except ConsulTxnConflict:
            return  # someone else reopened it (or closed it again): read it again
        if closed.session:  # the session that kept the marker of a finished run: not needed
            with contextlib.suppress(ConsulError):
                self.client.session_destroy(closed.session, deadline=self._op_deadline(deadline))
        logger.info("Run %s was closed by %s (%s) and no node of that job is left: node %s "
                    "opens it again for a new job.", self.run_id, info.get("by", "?"),
                    info.get("reason", ""), self.node_id)

    def _clean_up_run(self, deadline: float) -> None:
        """Leaving as the run's last member: remove what the run left in Consul, keeping a
        closed run's marker for ``closed_retention`` (:func:`consul_rdzv.runs.clean_up`)."""
        done = runs.clean_up(self.client, self.keys, run_id=self.run_id,
                             closed_retention=self.settings.closed_retention, deadline=deadline)
        if done.removed:
            logger.debug("Node %s removed what run %s left in Consul as its last member%s.",
                         self.node_id, self.run_id,
                         f" (its closed marker stays for {self.settings.closed_retention:g}s)"
                         if done.kept_marker else "")

    def _check_explicit_rank(self, deadline: float) -> None:
        res = self.client.kv_list(self.keys.members, deadline=self._op_deadline(deadline))
        for entry in res.data:
            m = Member.decode(entry)
            if m.node != self.node_id and m.rank == self.settings.node_rank:
                raise RendezvousStateError(
                    f"Nodes {m.node} and {self.node_id} both ask for rank {m.rank} in run "
                    f"{self.run_id} (rank_policy explicit): give every node a distinct node_rank."
                )

    def _coordinate(self, deadline: float, my_index: int, progress: _Progress) -> RoundResult:
        index = BlockingIndex()
        quorum_since: float | None = None
        first_seen = time.time()
        while True:
            if time.monotonic() >= deadline:
                raise self._timeout_error()
            res = self._blocking_list(self.keys.prefix + "/", index,
                                      self._coordinator_wait(deadline, quorum_since, progress),
                                      deadline)
            state = RunState.parse(self.keys, res.data)
            if state.leader_session != self.registration.session:
                raise _LostLeadership("the leader key is held by another session or none")
            me = state.members.get(self.node_id)
            if me is None or me.modify_index < my_index:
                raise _Rejoin("our member key disappeared")
            if state.round and state.round.closed:
                raise self._closed_error(state.round)
            if self._meant_for_me(state.round, my_index):
                return self._result(state.round)  # our own seal, whose answer was lost
            plan = plan_round(state, self.settings, time.monotonic(), quorum_since)
            if quorum_since is None and plan.quorum_since is not None and plan.seal is None:
                logger.debug("Run %s has a quorum; last call for %gs.", self.run_id,
                             self.settings.last_call_timeout)
            quorum_since = plan.quorum_since
            if plan.seal is None:
                logger.debug("Coordinator %s of run %s waits: %s.", self.node_id, self.run_id,
                             plan.reason)
                progress.maybe_log(state, plan.detail)
                continue
            quorum_at = time.time() - (time.monotonic() - (quorum_since or time.monotonic()))
            sealed = self._seal(state, plan.seal, res.index, first_seen, quorum_at, deadline)
            if sealed is not None:
                if self.node_id in sealed.ranks:
                    return self._result(sealed)
                # Not selected (explicit ranks, or more nodes than max_nodes): stay waiting.
                raise _LostLeadership("sealed a round without this node")

    def _coordinator_wait(self, deadline: float, quorum_since: float | None,
                          progress: _Progress) -> float:
        wait = min(deadline - time.monotonic(), ROUND_WAIT, progress.wait())
        if quorum_since is not None:
            wait = min(wait, quorum_since + self.settings.last_call_timeout - time.monotonic())
        return max(wait, 0.001)

    def _seal(self, state: RunState, order: list[str], snapshot_index: int, first_seen: float,
              quorum_at: float, deadline: float) -> Round | None:
        previous = state.round
        number = max([previous.round + 1 if previous else 1,
                      *(state.members[n].want for n in order)])
        rank0 = state.members[order[0]]
        sealed = Round(
            round=number, ranks=order, hosts=[state.members[n].host for n in order],
            store=rank0.endpoint, members_index=snapshot_index,
            joined_index=max(state.members[n].modify_index for n in order),
            coordinator=self.node_id,
            incarnations=[state.members[n].incarnation for n in order],
            seal_id=uuid.uuid4().hex, first_join=first_seen, quorum_at=quorum_at,
            sealed_at=time.time(), min_nodes=self.settings.min_nodes,
            max_nodes=self.settings.max_nodes,
        )
        ops = [txn_kv("check-session", self.keys.leader, session=self.registration.session),
               txn_kv("cas", self.keys.round, value=sealed.encode(),
                      index=previous.modify_index if previous else 0)]
        _check_seal_fits(ops, sealed, self.run_id)
        try:
            res = self.client.txn(ops, deadline=self._op_deadline(deadline))
        except ConsulTxnConflict as exc:
            logger.debug("Coordinator %s of run %s could not seal round %d (%s); re-reading.",
                         self.node_id, self.run_id, number, exc)
            return None
        sealed.modify_index = res.data[1].modify_index if res.data[1] else 0
        logger.debug("Coordinator %s sealed round %d of run %s with %d nodes.", self.node_id,
                     number, self.run_id, len(order))
        return sealed

    def _result(self, current: Round) -> RoundResult:
        return RoundResult(
            run_id=self.run_id, round=current.round, rank=current.ranks.index(self.node_id),
            world_size=current.world_size, participants=list(current.ranks),
            hosts=list(current.hosts), store=current.store, coordinator=current.coordinator,
            seal_id=current.seal_id, members_index=current.members_index,
            joined_index=current.joined_index, round_index=current.modify_index,
            min_nodes=current.min_nodes,
            max_nodes=current.max_nodes,
            timings={"first_join": current.first_join, "quorum": current.quorum_at,
                     "sealed": current.sealed_at},
        )

    def _drop_member(self, *, leader: bool = False) -> None:
        session = self.registration.session
        for key in (self.keys.member(self.node_id), *([self.keys.leader] if leader else [])):
            with contextlib.suppress(ConsulError):
                self.client.txn([txn_kv("check-session", key, session=session),
                                 txn_kv("delete", key)], deadline=self._op_deadline())

    def _closed_error(self, current: Round) -> RendezvousClosedError:
        info = current.closed or {}
        alive = self._closed_alive
        still = ""
        if alive:
            still = (f" {len(alive)} node(s) of that job are still alive "
                     f"({', '.join(alive[:8])}{', ...' if len(alive) > 8 else ''}); once they "
                     "are gone the run id can be used again.")
        return RendezvousClosedError(
            f"Run {self.run_id} was closed by {info.get('by', '?')} ({info.get('reason', '')})."
            f"{still} Start a new run id to train now."
        )

    def _timeout_error(self) -> RendezvousTimeoutError:
        detail = ""
        with contextlib.suppress(ConsulError, RendezvousStateError):
            res = self.client.kv_list(self.keys.prefix + "/", deadline=time.monotonic() + 2)
            state = RunState.parse(self.keys, res.data)
            present = sorted(state.members)
            detail = (f" {len(present)} of min_nodes {self.settings.min_nodes} nodes were present"
                      f" ({', '.join(present[:16])}{', ...' if len(present) > 16 else ''}).")
            if state.round and state.round.ranks:
                missing = [n for n in state.round.ranks if n not in state.members]
                active = active_participants(state)
                if missing:
                    detail += f" Missing from round {state.round.round}: {', '.join(missing[:16])}."
                if active:
                    detail += (f" Round {state.round.round} is still running with "
                               f"{len(active)} of max_nodes {self.settings.max_nodes} nodes; "
                               "this node waits for room.")
            if self.settings.rank_policy == "explicit":
                candidates = [Candidate(m.node, rank=m.rank) for m in state.members.values()]
                detail += f" Explicit ranks: {explicit_gap(candidates)}."
            if state.leader is None:
                detail += " No coordinator held the leader key."
        return RendezvousTimeoutError(
            f"Node {self.node_id} timed out after join_timeout "
            f"({self.settings.join_timeout:g}s) waiting for a round of run {self.run_id}.{detail}"
        )

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
            self._stop_watch()
            if self._left:
                return
            self._watch = RoundWatch(self.client, self.keys, watched, self,
                                     wait=self.settings.watch_wait).start()

    def _stop_watch(self) -> None:
        """End the current round's watch (caller holds ``_lock``)."""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    # What the round's watch reports (consul_rdzv.watch.WatchHost). A watch that was stopped
    # or replaced meanwhile (a new next_round(), leave()) is ignored.

    def watch_counted(self, watch: RoundWatch, waiting: int) -> None:
        with self._lock:
            if watch is not self._watch or waiting == self._waiting:
                return
            self._waiting = waiting
            logger.info("Node %s sees %d node(s) waiting to join run %s (round %d).",
                        self.node_id, waiting, self.run_id, watch.watched.round)

    def watch_over(self, watch: RoundWatch, reason: str, own_key: bool, waiting: int) -> None:
        with self._lock:
            if watch is not self._watch:
                return
            self._watch = None
            if not own_key:
                self.registration.mark_lost("its member key was deleted (session invalidated)")
            self._waiting = max(self._waiting, waiting, 1)
            logger.info("Round %d of run %s is over for node %s (%s).", watch.watched.round,
                        self.run_id, self.node_id, reason)
            self._set_broken(f"round {watch.watched.round} is over ({reason})")
            # nobody watches our key any more
            self.registration.probe_session_from(time.monotonic()
                                                 + self.settings.heartbeat_interval)

    def watch_finished(self, watch: RoundWatch, closed: dict) -> None:
        with self._lock:
            if watch is not self._watch:
                return
            self._watch = None
            self._finished = dict(closed)
            self._waiting = 0
        self.registration.watch_gossip(False)
        logger.info("Run %s finished in round %d (%s, closed by %s): node %s lets its workers "
                    "finish their work.", self.run_id, watch.watched.round,
                    closed.get("reason", ""), closed.get("by", "?"), self.node_id)


class _Progress:
    """One INFO line every PROGRESS_EVERY seconds while a node waits for its round."""

    def __init__(self, node: ConsulRendezvous, deadline: float) -> None:
        self.node = node
        self.deadline = deadline
        self.due = time.monotonic() + PROGRESS_EVERY

    def wait(self) -> float:
        return max(0.001, self.due - time.monotonic())

    def maybe_log(self, state: RunState, reason: str = "") -> None:
        if time.monotonic() < self.due:
            return
        self.due = time.monotonic() + PROGRESS_EVERY
        node = self.node
        settings = node.settings
        members = sorted(state.members)
        if not members:  # a waiter reads only P/round/: look at the member names once
            with contextlib.suppress(ConsulError):
                members = sorted(k[len(node.keys.members):] for k in node.client.kv_keys(
                    node.keys.members, deadline=time.monotonic() + 2))
        current = state.round
        number = current.round + 1 if current and current.ranks else 1
        missing = ""
        if current and current.ranks:
            gone = [n for n in current.ranks if n not in members]
            if gone:
                missing = f"; gone from round {current.round}: {', '.join(gone[:8])}"
        leader = state.leader.node if state.leader else "none"
        logger.info(
            "Run %s: node %s waits for round %d: %d of min %d nodes present (%s), max %d, "
            "coordinator %s%s%s; join timeout in %.0fs.", node.run_id, node.node_id, number,
            len(members), settings.min_nodes, ", ".join(members[:8]) + (
                ", ..." if len(members) > 8 else ""), settings.max_nodes, leader, missing,
            f"; {reason}" if reason else "", self.deadline - time.monotonic())


def _check_round_fits(settings: RendezvousSettings, node_id: str, host: str) -> None:
    """Refuse a max_nodes whose sealed round could not fit Consul's transaction limit."""
    id_len, host_len = json_len(node_id), json_len(host)
    if round_bytes(settings.max_nodes, id_len, host_len, len(settings.prefix)) <= MAX_TXN_BYTES:
        return
    fits = largest_world(id_len, host_len, len(settings.prefix))
    raise ValueError(
        f"max_nodes={settings.max_nodes} does not fit in Consul: a sealed round names every "
        f"node (ids like {node_id!r}, {id_len} characters, on hosts like {host!r}) in one "
        f"transaction, and Consul refuses transactions over {MAX_TXN_BYTES // 1024} KiB. The "
        f"largest world that fits with such names is about {fits} nodes: use shorter node ids "
        "(rdzv conf node_id) or a lower max_nodes."
    )


def _check_seal_fits(ops: list[dict], sealed: Round, run_id: str) -> None:
    size = len(json.dumps(ops))
    if size <= MAX_TXN_BYTES:
        return
    longest_id = max(json_len(n) for n in sealed.ranks)
    longest_host = max((json_len(h) for h in sealed.hosts), default=0)
    fits = largest_world(longest_id, longest_host)
    raise RendezvousStateError(
        f"Round {sealed.round} of run {run_id} with {sealed.world_size} nodes cannot be sealed: "
        f"its transaction is {size // 1024} KiB and Consul refuses transactions over "
        f"{MAX_TXN_BYTES // 1024} KiB. With node ids of up to {longest_id} characters the "
        f"largest world that fits is about {fits} nodes: use shorter node ids or lower "
        "max_nodes."
    )


def _float(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
