"""The rendezvous protocol on Consul, as a plain-Python API (no torch here).

One :class:`ConsulRendezvous` per node. ``next_round()`` blocks until a sealed round lists this
node and returns its rank, the world size and rank 0's trainer-store endpoint;
``num_nodes_waiting()`` answers from a background watch with no Consul request; ``close()`` ends
the run for everyone; ``leave()`` takes this node out cleanly. The protocol is written down in
docs/protocol.md; the KV layout in :mod:`consul_rdzv.layout`.

How it fails, and what the caller must watch for:

* A node that stops passing its TTL check for ``heartbeat_timeout`` is dead to Consul: its session
  is invalidated and its member key deleted. Survivors see that through ``num_nodes_waiting()``.
* If this node's own session is invalidated (agent restart, operator), ``num_nodes_waiting()``
  reports at least 1 and the next ``next_round()`` registers again: it never acts on a dead session.
* Consul outages are ridden out with backoff for ``consul_timeout`` per call, and never past the
  join deadline; then :class:`RendezvousConnectionError`.
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
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .client import BlockingIndex, ConsulClient, QueryResult, txn_kv
from .errors import (
    ConsulBadRequest,
    ConsulError,
    ConsulNotFound,
    ConsulPermissionDenied,
    ConsulSessionInvalid,
    ConsulTxnConflict,
    ConsulUnavailableError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from .layout import Keys, Leader, Member, Round, RunState
from .ranks import Candidate, NotReady, assign, select
from .settings import RendezvousSettings

logger = logging.getLogger(__name__)

_NODE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,160}$")
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
#: Longest blocking query of the training-time membership watch.
WATCH_WAIT = 300.0


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
    timings: dict[str, float] = field(default_factory=dict)
    requests: int = 0


@dataclass
class Plan:
    """The coordinator's decision for one view of the run."""

    seal: list[str] | None = None  # node ids in rank order
    wait_until: float | None = None
    quorum_since: float | None = None
    reason: str = ""


def active_participants(state: RunState) -> list[str]:
    """Participants of the current round still in it: alive and not asking for a new round.

    A participant asks for a new round by rewriting its member key, which moves the key's
    ModifyIndex past the member snapshot the round was sealed from.
    """
    current = state.round
    if current is None or not current.ranks:
        return []
    return [n for n in current.ranks
            if n in state.members and state.members[n].modify_index <= current.members_index]


def plan_round(state: RunState, settings: RendezvousSettings, now: float,
               quorum_since: float | None) -> Plan:
    """Decide whether the coordinator seals now, waits for the last call, or waits for nodes."""
    active = active_participants(state)
    current = state.round if state.round and state.round.ranks else None
    if active:
        return Plan(reason=f"{len(active)} node(s) of round {current.round} have not come back "
                           f"yet ({', '.join(sorted(active)[:8])})")
    previous = {n: r for r, n in enumerate(current.ranks)} if current else {}
    candidates = [Candidate(m.node, m.host, m.create_index, m.meta, m.rank)
                  for m in state.members.values()]
    selected = select(candidates, previous, settings.max_nodes, settings.rank_policy)
    if len(selected) < settings.min_nodes:
        return Plan(reason=f"{len(selected)} of min_nodes {settings.min_nodes} nodes present")
    try:
        order = assign(selected, previous, settings.rank_policy, settings.topology_keys)
    except NotReady as exc:
        return Plan(reason=str(exc))
    full = len(selected) >= settings.max_nodes
    nobody_new = current is not None and all(m.node in previous for m in state.members.values())
    if full or nobody_new:
        return Plan(seal=order, quorum_since=quorum_since or now)
    since = now if quorum_since is None else quorum_since
    if now >= since + settings.last_call_timeout:
        return Plan(seal=order, quorum_since=since)
    return Plan(wait_until=since + settings.last_call_timeout, quorum_since=since,
                reason=f"last call: {len(selected)} nodes present, up to {settings.max_nodes}")


def count_waiting(state: RunState, result: RoundResult, max_nodes: int) -> int:
    """``num_nodes_waiting`` from one view of the members.

    Participants of our round whose member key vanished always count (survivors must
    re-rendezvous now rather than hang in a collective); waiting nodes count only while the round
    has room for them, as in torch's c10d backend.
    """
    return _count_waiting({n: m.modify_index for n, m in state.members.items()}, result,
                          max_nodes)


def _count_waiting(members: Mapping[str, int], result: RoundResult, max_nodes: int) -> int:
    """:func:`count_waiting` on ``{node id: ModifyIndex of its member key}``."""
    gone = [n for n in result.participants if n not in members]
    active = [n for n in result.participants
              if n in members and members[n] <= result.members_index]
    waiting = [n for n in members if n not in active]
    room = len(active) < max_nodes
    return len(gone) + (len(waiting) if room else 0)


class _Rejoin(Exception):
    """Our session is gone: register again and restart the join (same deadline)."""


class _LostLeadership(Exception):
    """The leader key is no longer ours: go back to waiting."""


class ConsulRendezvous:
    """One node's handle on one run. Thread-safe for the calls torchrun makes."""

    def __init__(self, settings: RendezvousSettings, client: ConsulClient | None = None, *,
                 node_id: str | None = None, host: str | None = None,
                 endpoint_provider: Callable[[], dict | None] | None = None) -> None:
        self.settings = settings
        self.client = client or ConsulClient(retry_timeout=settings.consul_timeout)
        self.keys = Keys(settings.prefix)
        self.node_id = node_id or default_node_id()
        if not _NODE_ID.match(self.node_id) or self.node_id in (".", ".."):  # see settings.py
            raise ValueError(
                f"node id {self.node_id!r} is invalid: use 1-160 characters of letters, digits, "
                "'_', '.' or '-' (not '.' or '..')."
            )
        self.host = host or socket.gethostname()
        self.service_id = f"{settings.run_id}-{self.node_id}"
        self.check_id = f"{self.service_id}:ttl"
        self._endpoint_provider = endpoint_provider
        self._session: str | None = None
        self._lost = threading.Event()
        self._lock = threading.Lock()
        self._generation = 0
        self._round: RoundResult | None = None
        self._last_round_no = 0
        self._waiting = 0
        self._heartbeat: _Heartbeat | None = None
        self._watch: threading.Thread | None = None
        self._watch_generation = -1
        self._left = False
        self._meta: dict[str, str] = {"state": "joining"}
        self._meta_changed = 0.0

    def __repr__(self) -> str:
        return f"ConsulRendezvous(run={self.settings.run_id!r}, node={self.node_id!r})"

    # ------------------------------------------------------------------ public API

    @property
    def run_id(self) -> str:
        return self.settings.run_id

    @property
    def session_id(self) -> str | None:
        return self._session

    @property
    def current_round(self) -> RoundResult | None:
        return self._round

    def next_round(self) -> RoundResult:
        """Join the next round and block until it is sealed with this node in it."""
        if self._left:
            raise RendezvousStateError(f"Node {self.node_id} has left run {self.run_id}; "
                                       "create a new ConsulRendezvous to join again.")
        with self._lock:
            self._generation += 1  # pauses the training watch
            self._waiting = 0
        started = time.time()
        requests_before = self.client.requests_sent
        deadline = time.monotonic() + self.settings.join_timeout
        try:
            while True:
                try:
                    self._ensure_registered(deadline)
                    result = self._join(deadline, started)
                    break
                except _Rejoin as exc:
                    logger.warning("Node %s of run %s lost its Consul session (%s); registering "
                                   "again.", self.node_id, self.run_id, exc)
                    self._lost.set()  # _ensure_registered destroys and replaces the session
                    if time.monotonic() >= deadline:
                        raise RendezvousTimeoutError(
                            f"Node {self.node_id} of run {self.run_id} kept losing its Consul "
                            f"session until join_timeout ({self.settings.join_timeout:g}s)."
                        ) from exc
        except RendezvousTimeoutError:
            # We stop waiting: no coordinator may count us in, and a coordinator role we hold
            # would leave the others without one while our session lives on.
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
        except ConsulError as exc:
            raise RendezvousConnectionError(
                f"Consul call failed for node {self.node_id} of run {self.run_id}: {exc}"
            ) from exc
        result.timings.update(join_started=started, released=time.time())
        result.requests = self.client.requests_sent - requests_before
        self._round = result
        self._last_round_no = result.round
        self._meta = {"state": "training", "round": str(result.round), "rank": str(result.rank)}
        self._meta_changed = time.monotonic() + random.uniform(
            0.0, min(META_SPREAD_MAX, result.world_size * META_SPREAD))
        self._start_watch(result)
        if self._heartbeat:
            self._heartbeat.wake()  # it publishes the new meta META_DELAY (+ spread) from now
        logger.info("Node %s joined round %d of run %s as rank %d of %d (%.3fs, %d Consul "
                    "requests).", self.node_id, result.round, self.run_id, result.rank,
                    result.world_size, result.timings["released"] - started, result.requests)
        return result

    def register(self, timeout: float | None = None) -> None:
        """Register this node's service, check and session now (``next_round()`` does it too).

        Lets a node show up in Consul as soon as it starts, and takes the two registration
        requests off the path of its first round. ``timeout`` bounds the retries (default
        ``consul_timeout``).
        """
        deadline = time.monotonic() + (timeout or self.settings.consul_timeout)
        try:
            self._ensure_registered(deadline)
        except ConsulError as exc:
            raise self._connection_error("register in Consul", exc) from exc

    def num_nodes_waiting(self) -> int:
        """See module docstring: a local read, no Consul request."""
        if self._lost.is_set():
            return max(self._waiting, 1)
        return self._waiting

    def is_closed(self) -> bool:
        try:
            res = self.client.kv_get(self.keys.round, deadline=self._op_deadline())
        except ConsulError as exc:
            raise self._connection_error("read the run state", exc) from exc
        return bool(res.data and Round.decode(res.data).closed)

    def close(self, reason: str = "closed") -> None:
        """Mark the run closed: every waiting and future joiner gets RendezvousClosedError."""
        deadline = time.monotonic() + self.settings.close_timeout
        try:
            while True:
                res = self.client.kv_get(self.keys.round, consistent=True, deadline=deadline)
                current = Round.decode(res.data) if res.data else Round()
                if current.closed:
                    return
                current.closed = {"reason": reason, "at": time.time(), "by": self.node_id}
                cas = res.data.modify_index if res.data else 0
                if self.client.kv_put(self.keys.round, current.encode(), cas=cas,
                                      deadline=deadline):
                    logger.info("Node %s closed run %s (%s).", self.node_id, self.run_id, reason)
                    return
                if time.monotonic() > deadline:
                    raise RendezvousConnectionError(
                        f"Could not close run {self.run_id} within close_timeout "
                        f"({self.settings.close_timeout:g}s): the round key kept changing."
                    )
        except ConsulError as exc:
            raise self._connection_error("close the run", exc) from exc

    def leave(self) -> bool:
        """Leave cleanly: release keys, deregister the service, destroy the session.

        Never closes the run. Returns False if some step failed (logged); idempotent.
        """
        with self._lock:
            self._left = True
            self._generation += 1
        if self._heartbeat:
            self._heartbeat.stop()
            self._heartbeat = None
        session, self._session = self._session, None
        if session is None:
            return True
        deadline = time.monotonic() + self.settings.close_timeout
        ok = True
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
        for step, call in (
            ("deregister its service", lambda: self.client.agent_service_deregister(
                self.service_id, deadline=deadline)),
            ("destroy its session", lambda: self.client.session_destroy(session,
                                                                        deadline=deadline)),
        ):
            try:
                call()
            except ConsulNotFound:
                pass
            except ConsulError as exc:
                ok = False
                logger.warning("Node %s could not %s while leaving run %s: %s", self.node_id,
                               step, self.run_id, exc)
        logger.info("Node %s left run %s.", self.node_id, self.run_id)
        return ok

    # ------------------------------------------------------------------ registration

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
        session is checked before we wait on.
        """
        with contextlib.suppress(ConsulUnavailableError):
            return self.client.kv_list(prefix, index=index.param, wait=wait,
                                       deadline=time.monotonic())  # one attempt, no retries
        res = self.client.kv_list(prefix, deadline=self._op_deadline(deadline))
        if self._session and self.client.session_info(
                self._session, deadline=self._op_deadline(deadline)) is None:
            raise _Rejoin("the session did not survive a Consul outage")
        return res

    def _connection_error(self, what: str, exc: ConsulError) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            f"Node {self.node_id} could not {what} of run {self.run_id} in Consul at "
            f"{self.client.config.url}: {exc}"
        )

    def _service_definition(self) -> dict:
        meta = {"run_id": self.run_id, "node_id": self.node_id[:512], "host": self.host[:512],
                "pid": str(os.getpid()), **self._meta}
        meta.update({k: str(v) for k, v in self.settings.node_meta.items()})
        return {
            "ID": self.service_id,
            "Name": self.settings.service,
            "Address": self.host,
            "Tags": ["consul-rdzv", f"run-{self.run_id}"],
            "Meta": meta,
            "Check": {
                "CheckID": self.check_id,
                "Name": f"consul-rdzv heartbeat of {self.node_id}",
                "TTL": f"{self.settings.heartbeat_timeout:g}s",
                "Status": "passing",
                "DeregisterCriticalServiceAfter": "1m",
            },
        }

    def _register_service(self, deadline: float) -> None:
        self.client.agent_service_register(self._service_definition(), deadline=deadline)

    def _ensure_registered(self, deadline: float) -> None:
        if self._session is not None and not self._lost.is_set():
            return
        op = self._op_deadline(deadline)
        old = self._session
        self._meta = {"state": "joining"}
        if not self._service_still_registered(old, op):
            self._register_service(op)
        session = self._create_session(op)
        # Switch sessions before clearing _lost: the heartbeat must never judge the new
        # registration by the old session (a failed renew of the old one would mark us lost).
        self._session = session
        self._lost.clear()
        if old is not None:
            # If the old session is in fact alive (our key was deleted by hand, a spurious
            # loss), it would keep holding the leader key or our member key: end it.
            with contextlib.suppress(ConsulError):
                self.client.session_destroy(old, deadline=op)
        logger.debug("Node %s of run %s registered service %s with session %s.", self.node_id,
                     self.run_id, self.service_id, self._session)
        if self._heartbeat is None:
            self._heartbeat = _Heartbeat(self)
            self._heartbeat.start()

    def _service_still_registered(self, old_session: str | None, deadline: float) -> bool:
        """After a lost session, is our service (and its check) still on the agent?

        A session usually dies because its check went critical (heartbeats late on an
        overloaded agent) while the service stays registered. Then passing the check is all a
        new session needs, and it spares the agent a service registration, which it serialises
        at O(services) each: a thousand nodes re-registering at once is how an overloaded agent
        stays overloaded. A 404 means the agent forgot us (restart): register again.
        """
        if old_session is None:
            return False
        try:
            self.client.agent_check_update(self.check_id, "pass", deadline=deadline)
        except ConsulNotFound:
            return False
        return True

    def _create_session(self, deadline: float) -> str:
        """Create our session bound to the TTL check.

        Consul refuses to bind a session to a critical check. The check was registered passing,
        but on a slow agent its TTL can run out before the session request is served (the
        heartbeat only beats once there is a session), so pass it and ask again.
        """
        for attempt in range(3):
            try:
                return self.client.session_create(
                    name=f"consul-rdzv {self.run_id} {self.node_id}"[:128],
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

    def _mark_lost(self, reason: str) -> None:
        if not self._lost.is_set() and not self._left:
            logger.warning("Node %s of run %s: %s; it will register again at its next round.",
                           self.node_id, self.run_id, reason)
            self._lost.set()

    # ------------------------------------------------------------------ joining

    def _member(self) -> Member:
        endpoint = self._endpoint_provider() if self._endpoint_provider else None
        return Member(node=self.node_id, host=self.host, pid=os.getpid(),
                      want=self._last_round_no + 1 if self._last_round_no else 0,
                      rank=self.settings.node_rank, endpoint=endpoint,
                      meta=dict(self.settings.node_meta), nonce=uuid.uuid4().hex)

    def _write_member(self, deadline: float) -> tuple[int, RunState]:
        """Write our member key (locked by our session) and read the round state, in one txn."""
        session = self._session
        key = self.keys.member(self.node_id)
        ops = [txn_kv("lock", key, value=self._member().encode(), session=session),
               txn_kv("get-tree", self.keys.round_dir)]
        try:
            res = self.client.txn(ops, deadline=self._op_deadline(deadline))
        except ConsulTxnConflict as exc:
            holder = self.client.kv_get(key, deadline=self._op_deadline(deadline)).data
            if holder is not None and holder.session and holder.session != session:
                raise RendezvousStateError(
                    f"Node id {self.node_id!r} is already used by another live node in run "
                    f"{self.run_id} (session {holder.session}). Give every node a unique node id."
                ) from exc
            raise _Rejoin(f"could not lock {key}: {exc}") from exc
        except ConsulSessionInvalid as exc:
            raise _Rejoin(str(exc)) from exc
        entries = [e for e in res.data[1:] if e is not None]
        my_index = res.data[0].modify_index
        return my_index, RunState.parse(self.keys, entries)

    def _join(self, deadline: float, started: float) -> RoundResult:
        my_index, state = self._write_member(deadline)
        if state.round and state.round.closed:
            self._drop_member()
            raise self._closed_error(state.round)
        if self.settings.rank_policy == "explicit":
            self._check_explicit_rank(deadline)
        index = BlockingIndex(my_index)
        while True:
            if state.leader_session is None:
                leader = Leader(node=self.node_id, session=self._session or "", since=time.time())
                try:
                    acquired = self.client.kv_put(self.keys.leader, leader.encode(),
                                                  acquire=self._session,
                                                  deadline=self._op_deadline(deadline))
                except ConsulSessionInvalid as exc:
                    raise _Rejoin(str(exc)) from exc
                if acquired:
                    logger.info("Node %s is the coordinator of run %s.", self.node_id,
                                self.run_id)
                    state.leader_session = self._session
            if state.leader_session == self._session:
                try:
                    return self._coordinate(deadline, my_index, started)
                except _LostLeadership as exc:
                    logger.warning("Node %s lost the coordinator role of run %s (%s).",
                                   self.node_id, self.run_id, exc)
                    index = BlockingIndex()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout_error(deadline)
            if self._lost.is_set():
                raise _Rejoin("the heartbeat found the session or check gone")
            res = self._blocking_list(self.keys.round_dir, index, min(remaining, ROUND_WAIT),
                                      deadline)
            index.update(res.index)
            state = RunState.parse(self.keys, res.data)
            current = state.round
            if current and current.closed:
                self._drop_member()
                raise self._closed_error(current)
            if current and self.node_id in current.ranks and current.members_index >= my_index:
                return self._result(current)

    def _check_explicit_rank(self, deadline: float) -> None:
        res = self.client.kv_list(self.keys.members, deadline=self._op_deadline(deadline))
        for entry in res.data:
            m = Member.decode(entry)
            if m.node != self.node_id and m.rank == self.settings.node_rank:
                self._drop_member()
                raise RendezvousStateError(
                    f"Nodes {m.node} and {self.node_id} both ask for rank {m.rank} in run "
                    f"{self.run_id} (rank_policy explicit): give every node a distinct node_rank."
                )

    def _coordinate(self, deadline: float, my_index: int, started: float) -> RoundResult:
        index = BlockingIndex()
        quorum_since: float | None = None
        first_seen = time.time()
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout_error(deadline)
            res = self._blocking_list(self.keys.prefix + "/", index,
                                      self._coordinator_wait(deadline, quorum_since), deadline)
            index.update(res.index)
            state = RunState.parse(self.keys, res.data)
            if state.leader_session != self._session:
                raise _LostLeadership("the leader key is held by another session or none")
            me = state.members.get(self.node_id)
            if me is None or me.modify_index < my_index:
                raise _Rejoin("our member key disappeared")
            if state.round and state.round.closed:
                self._drop_member()
                raise self._closed_error(state.round)
            plan = plan_round(state, self.settings, time.monotonic(), quorum_since)
            if quorum_since is None and plan.quorum_since is not None:
                logger.info("Run %s has a quorum; last call for %gs.", self.run_id,
                            self.settings.last_call_timeout)
            quorum_since = plan.quorum_since
            if plan.seal is None:
                logger.debug("Coordinator %s of run %s waits: %s.", self.node_id, self.run_id,
                             plan.reason)
                continue
            quorum_at = time.time() - (time.monotonic() - (quorum_since or time.monotonic()))
            sealed = self._seal(state, plan.seal, res.index, first_seen, quorum_at, deadline)
            if sealed is not None:
                if self.node_id in sealed.ranks:
                    return self._result(sealed)
                # Not selected (explicit ranks, or more nodes than max_nodes): stay waiting.
                raise _LostLeadership("sealed a round without this node")

    def _coordinator_wait(self, deadline: float, quorum_since: float | None) -> float:
        wait = min(deadline - time.monotonic(), ROUND_WAIT)
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
            store=rank0.endpoint, members_index=snapshot_index, coordinator=self.node_id,
            seal_id=uuid.uuid4().hex, first_join=first_seen, quorum_at=quorum_at,
            sealed_at=time.time(),
        )
        ops = [txn_kv("check-session", self.keys.leader, session=self._session),
               txn_kv("cas", self.keys.round, value=sealed.encode(),
                      index=previous.modify_index if previous else 0)]
        try:
            res = self.client.txn(ops, deadline=self._op_deadline(deadline))
        except ConsulTxnConflict as exc:
            logger.info("Coordinator %s of run %s could not seal round %d (%s); re-reading.",
                        self.node_id, self.run_id, number, exc)
            return None
        sealed.modify_index = res.data[1].modify_index if res.data[1] else 0
        logger.info("Coordinator %s sealed round %d of run %s with %d nodes.", self.node_id,
                    number, self.run_id, len(order))
        return sealed

    def _result(self, current: Round) -> RoundResult:
        return RoundResult(
            run_id=self.run_id, round=current.round, rank=current.ranks.index(self.node_id),
            world_size=current.world_size, participants=list(current.ranks),
            hosts=list(current.hosts), store=current.store, coordinator=current.coordinator,
            seal_id=current.seal_id, members_index=current.members_index,
            timings={"first_join": current.first_join, "quorum": current.quorum_at,
                     "sealed": current.sealed_at},
        )

    def _drop_member(self, *, leader: bool = False) -> None:
        for key in (self.keys.member(self.node_id), *([self.keys.leader] if leader else [])):
            with contextlib.suppress(ConsulError):
                self.client.txn([txn_kv("check-session", key, session=self._session),
                                 txn_kv("delete", key)], deadline=self._op_deadline())

    def _closed_error(self, current: Round) -> RendezvousClosedError:
        info = current.closed or {}
        return RendezvousClosedError(
            f"Run {self.run_id} was closed by {info.get('by', '?')} ({info.get('reason', '')}); "
            "start a new run id to train again."
        )

    def _timeout_error(self, deadline: float) -> RendezvousTimeoutError:
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
            if state.leader is None:
                detail += " No coordinator held the leader key."
        return RendezvousTimeoutError(
            f"Node {self.node_id} timed out after join_timeout "
            f"({self.settings.join_timeout:g}s) waiting for a round of run {self.run_id}.{detail}"
        )

    # ------------------------------------------------------------------ training-time watch

    def _start_watch(self, result: RoundResult) -> None:
        generation = self._generation
        thread = threading.Thread(target=self._watch_loop, args=(result, generation),
                                  name=f"consul-rdzv-watch-{self.node_id}", daemon=True)
        self._watch = thread
        self._watch_generation = generation
        thread.start()

    def _watching(self) -> bool:
        """True while the training watch of the current round runs: it sees our member key
        vanish when our session is invalidated, so the heartbeat need not renew the session."""
        watch = self._watch
        return (watch is not None and watch.is_alive()
                and self._watch_generation == self._generation)

    def _watch_loop(self, result: RoundResult, generation: int) -> None:
        """Keeps ``num_nodes_waiting()`` current during training.

        Blocks on the member key *names* (``?keys``), and reads the values (for their
        ModifyIndex) only when the names cannot tell: a key was added or rewritten. When keys
        only vanished and a participant is among them (a node died: the case that matters at
        scale, where every survivor wakes at once), the names are enough; a full read of a
        1024-node run is ~430 KB and ~9 ms of client CPU per watcher, the names ~24 KB and
        0.3 ms.
        """
        prefix = self.keys.members
        index = BlockingIndex(result.members_index)
        # node id -> ModifyIndex of its member key at our last full read. The participants were
        # members at the seal, written at or before its members_index.
        known: dict[str, int] = dict.fromkeys(result.participants, 0)
        failures = 0
        while self._generation == generation:
            try:
                res = self.client.kv_keys_query(prefix, index=index.param, wait=WATCH_WAIT,
                                                deadline=time.monotonic())  # retried below
                names = {k[len(prefix):] for k in res.data}
                changed = res.index != index.index or names != known.keys()
                index.update(res.index)
                died = names < known.keys() and any(
                    p in known and p not in names for p in result.participants)
                if died:
                    known = {n: known[n] for n in names}
                elif changed:
                    full = self.client.kv_list(prefix, deadline=time.monotonic())
                    index.update(full.index)
                    known = {e.key[len(prefix):]: e.modify_index for e in full.data}
                failures = 0
            except ConsulError as exc:
                # After a failure, read without blocking: Consul may be back with lower indexes
                # (state lost), and a query at our old index would sit out its whole wait.
                index = BlockingIndex()
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    logger.warning("Node %s cannot watch the members of run %s: %s",
                                   self.node_id, self.run_id, exc)
                time.sleep(min(0.1 * 2 ** failures, 2.0))
                continue
            waiting = _count_waiting(known, result, self.settings.max_nodes)
            with self._lock:
                if self._generation != generation:
                    return  # a new next_round() rewrites our key: its absence means nothing
                if self.node_id not in known:
                    self._mark_lost("its member key was deleted (session invalidated)")
                if waiting != self._waiting:
                    logger.info("Node %s sees %d node(s) waiting in run %s (round %d).",
                                self.node_id, waiting, self.run_id, result.round)
                self._waiting = waiting


class _Heartbeat(threading.Thread):
    """Passes the node's TTL check every ``heartbeat_interval``; renews (probes) its session
    while no training watch is running.

    Waits on an Event (stop or wake), beats early rather than late, warns when a beat overruns.
    """

    def __init__(self, node: ConsulRendezvous) -> None:
        super().__init__(name=f"consul-rdzv-heartbeat-{node.node_id}", daemon=True)
        self.node = node
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._published: dict[str, str] | None = None
        self._failures = 0
        self._overruns = 0

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def run(self) -> None:
        interval = self.node.settings.heartbeat_interval
        next_beat = time.monotonic() + interval
        while not self._stop.is_set():
            wake_at = next_beat
            if self.node._meta != self._published:
                # Publish a new round's meta a moment later, off the round's busiest instant.
                wake_at = min(wake_at, self._meta_due())
            self._wake.wait(max(0.0, wake_at - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            if time.monotonic() >= next_beat:
                started = time.monotonic()
                self.beat(interval)
                took = time.monotonic() - started
                if took > interval:
                    self._overruns += 1
                    if self._overruns == 1 or self._overruns % 20 == 0:
                        logger.warning("Heartbeat of node %s took %.2fs, longer than its "
                                       "interval %.2fs (%d time(s) so far).", self.node.node_id,
                                       took, interval, self._overruns)
                next_beat = time.monotonic() + interval
            if time.monotonic() >= self._meta_due():
                self.publish_meta(interval)

    def _meta_due(self) -> float:
        changed = self.node._meta_changed
        return changed + META_DELAY if changed else 0.0

    def beat(self, interval: float) -> None:
        node = self.node
        session = node._session
        if session is None:
            return
        deadline = time.monotonic() + interval
        try:
            # The check is passed even while the session is lost: next_round() registers the
            # service again and creates the new session bound to it, which takes the check
            # passing (a slow session create must not let its TTL run out).
            node.client.agent_check_update(node.check_id, "pass", deadline=deadline)
            # The session has no TTL: renewing it only asks whether it still exists. While the
            # training watch runs it answers that for free (our member key is the session's),
            # which halves a training node's requests; joining nodes still ask.
            if not node._lost.is_set() and not node._watching():
                node.client.session_renew(session, deadline=deadline)
            self._failures = 0
        except (ConsulNotFound, ConsulSessionInvalid) as exc:
            if node._session == session:
                node._mark_lost(f"its Consul registration is gone ({exc})")
        except ConsulError as exc:
            self._failures += 1
            if self._failures == 1 or self._failures % 10 == 0:
                logger.warning("Heartbeat of node %s failed %d time(s): %s", node.node_id,
                               self._failures, exc)

    def publish_meta(self, interval: float) -> None:
        node = self.node
        meta = dict(node._meta)
        if meta == self._published or node._session is None or node._lost.is_set():
            return
        try:
            node._register_service(time.monotonic() + interval)
            self._published = meta
        except ConsulError as exc:
            logger.debug("Node %s could not publish its service meta: %s", node.node_id, exc)

