"""One ``next_round()``'s work, on the caller's thread only: announce, elect, then wait for a
round or coordinate one (docs/protocol.md, "One round, as seen by a node").

:class:`Join` is created by :meth:`consul_rdzv.rendezvous.ConsulRendezvous.next_round` for one
attempt (the join deadline is passed in) and never shared with another thread; what it reads of
the node (its registration's session, its last round) it reads once, here. :class:`Coordinator`
is the part a node runs while it holds the leader key. No field here is shared between threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from . import history, runs
from .client import BlockingIndex, ConsulClient, QueryResult, txn_kv
from .errors import (
    ConsulError,
    ConsulSessionInvalid,
    ConsulTxnConflict,
    ConsulUnavailableError,
    RendezvousClosedError,
    RendezvousReplacedError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from .layout import Keys, Leader, Member, Round, RunState, history_value
from .planning import (
    MAX_TXN_BYTES,
    active_participants,
    explicit_gap,
    json_len,
    largest_world,
    plan_round,
)
from .ranks import Candidate
from .registration import Incarnation, Registration
from .service import incarnation_tag
from .settings import RendezvousSettings

logger = logging.getLogger(__name__)

#: Longest single blocking query while waiting for a round (a return is cheap; it lets the
#: waiter notice a lost session or a passed deadline).
ROUND_WAIT = 10.0
#: A waiting node logs its progress (INFO) this often.
PROGRESS_EVERY = 15.0


@dataclass
class RoundResult:
    """What one node got from one round."""

    run_id: str
    round: int
    rank: int
    world_size: int
    participants: list[str]
    store: dict | None
    coordinator: str
    seal_id: str
    members_index: int
    joined_index: int = 0
    round_index: int = 0  # the round key's ModifyIndex as sealed
    min_nodes: int = 0  # the round's, as its coordinator sealed it
    max_nodes: int = 0
    #: Wall-clock moments of the round (``time.time()``): ``first_join``, ``quorum`` and
    #: ``sealed`` are the coordinator's (from the round value); ``join_started``,
    #: ``announced`` (the member write answered), ``seen`` (this node saw the sealed round)
    #: and ``released`` (``next_round()`` returns) this node's; the torch adapter adds its
    #: meeting's (``store_connected``, ``met``).
    timings: dict[str, float] = field(default_factory=dict)
    requests: int = 0


@dataclass
class Announced:
    """This node's member key as it last wrote it, shared by the caller's thread (each
    announcement) and the health thread (a rewrite when the node's health changes): every write
    of the key happens under ``lock``, so a rewrite never lands before, or instead of, the
    announcement it follows. ``joining``: inside ``next_round()`` (any health change is written);
    otherwise the node trains (only a turn to unhealthy is written, with ``health_evict``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    member: Member | None = None
    index: int = 0
    session: str | None = None
    joining: bool = False


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


class Join:
    """One attempt of one node to join the next round (see the module docstring)."""

    def __init__(self, *, client: ConsulClient, keys: Keys, settings: RendezvousSettings,
                 registration: Registration, node_id: str, host: str,
                 incarnation: Incarnation, last: RoundResult | None,
                 endpoint_provider: Callable[[], dict | None] | None,
                 deadline: float, announced: Announced | None = None,
                 health: Callable[[], str] | None = None) -> None:
        self.client = client
        #: Our member key as last written (shared with the health thread, see Announced).
        self.announced = announced or Announced()
        #: Why this node's Consul node holds it out of rounds ("" when it may train).
        self.health = health or (lambda: "")
        self.keys = keys
        self.settings = settings
        self.registration = registration
        self.node_id = node_id
        self.run_id = settings.run_id
        self.host = host
        self.incarnation = incarnation
        #: The last round this node was in (None: it never was in one).
        self.last = last
        self.last_round_no = last.round if last is not None else 0
        self.endpoint_provider = endpoint_provider
        self.deadline = deadline
        #: Nodes of the job that closed the run, still alive (for the error message).
        self.closed_alive: list[str] = []
        #: When our member write was answered (wall clock; RoundResult.timings).
        self.announced_at = 0.0

    def op_deadline(self, deadline: float | None = None) -> float:
        """The hard deadline of one Consul call: the caller's (the join deadline), or
        ``consul_timeout`` from now. The client stops retrying ``consul_timeout`` after the
        call's first failure in any case, so a slow answer is retried but an outage is not
        ridden out for longer than ``consul_timeout``."""
        return time.monotonic() + self.settings.consul_timeout if deadline is None else deadline

    def _member(self) -> Member:
        endpoint = self.endpoint_provider() if self.endpoint_provider else None
        return Member(node=self.node_id, host=self.host, pid=os.getpid(),
                      want=self.last_round_no + 1 if self.last_round_no else 0,
                      rank=self.settings.node_rank, endpoint=endpoint,
                      meta=dict(self.settings.node_meta),
                      incarnation=self.incarnation.id, started=self.incarnation.started,
                      min_nodes=self.settings.min_nodes, max_nodes=self.settings.max_nodes,
                      health=self.health(), at=time.time())

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
        guard = self.last.round_index if self.last is not None else 0
        announced = self.announced
        for _ in range(4):
            try:
                with announced.lock:  # the health thread rewrites the key only after this
                    member = self._member()
                    ops = [txn_kv("lock", key, value=member.encode(), session=session),
                           txn_kv("get-tree", self.keys.round_dir),
                           txn_kv("get-tree", self.keys.drain(self.node_id))]
                    if guard:
                        ops.append(txn_kv("check-index", self.keys.round, index=guard))
                    res = self.client.txn(ops, deadline=self.op_deadline(deadline))
                    announced.member, announced.session = member, session
                    announced.index = res.data[0].modify_index
            except ConsulTxnConflict as exc:
                if guard and any(e.op_index == 3 for e in exc.errors):
                    guard = 0
                    current = self.client.kv_get(self.keys.round,
                                                 deadline=self.op_deadline(deadline)).data
                    if current is not None and Round.decode(current).closed:
                        raise self._closed_error(Round.decode(current)) from None
                    continue
                holder = self.client.kv_get(key, deadline=self.op_deadline(deadline)).data
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
                                    deadline=self.op_deadline(deadline))
                logger.info("Node %s of run %s removed a drain request for an earlier process "
                            "of its node id (incarnation %s), which is gone.", self.node_id,
                            self.run_id, drain.incarnation[:8])
            return
        with contextlib.suppress(ConsulError):
            runs.withdraw_drain(self.client, self.keys, self.node_id, drain,
                                deadline=self.op_deadline(deadline))
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
            self.client.session_destroy(holder_session, deadline=self.op_deadline(deadline))

    def run(self) -> RoundResult:
        """Announce, elect, then wait for a round or coordinate one; the round that lists this
        process. Raises _Rejoin when its session is gone (the caller registers again)."""
        deadline = self.deadline
        self.closed_alive = []
        my_index, state = self._write_member(deadline)
        self.announced_at = time.time()
        while state.round and state.round.closed:
            self._reopen(state.round, deadline)
            # Read the round again, without announcing again: a second write of our key would
            # be taken for a request of a new round by a coordinator that sealed us in already.
            state = RunState.parse(self.keys, self.client.kv_list(
                self.keys.round_dir, deadline=self.op_deadline(deadline)).data)
        if self.settings.rank_policy == "explicit":
            self._check_explicit_rank(deadline)
        # Our member write's index, borrowed: an answer of P/round/ at or below it means that
        # nothing was sealed, closed or elected since (see BlockingIndex).
        index = BlockingIndex(my_index, borrowed=True)
        progress = Progress(self, deadline)
        while True:
            session = self.registration.session
            if state.leader_session is None:
                leader = Leader(node=self.node_id, session=session or "", since=time.time())
                try:
                    acquired = self.client.kv_put(self.keys.leader, leader.encode(),
                                                  acquire=session,
                                                  deadline=self.op_deadline(deadline))
                except ConsulSessionInvalid as exc:
                    raise _Rejoin(str(exc)) from exc
                if acquired:
                    logger.debug("Node %s is the coordinator of run %s.", self.node_id,
                                 self.run_id)
                    state.leader_session = session
            if state.leader_session == session:
                try:
                    return Coordinator(self, my_index, progress).run()
                except _LostLeadership as exc:
                    logger.warning("Node %s lost the coordinator role of run %s (%s).",
                                   self.node_id, self.run_id, exc)
                    index = BlockingIndex()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout_error()
            if not self.registration.held(self.op_deadline(deadline)):
                raise _Rejoin(self.registration.lost_reason,
                              confirmed=self.registration.lost_confirmed)
            res = self._blocking_list(self.keys.round_dir, index,
                                      min(remaining, ROUND_WAIT, progress.wait()), deadline)
            state = RunState.parse(self.keys, res.data)
            current = state.round
            if current and current.closed:
                raise self._closed_error(current)
            if current is not None and self._meant_for_me(current, my_index):
                return self._result(current)
            progress.maybe_log(state)

    def _meant_for_me(self, current: Round | None, my_index: int) -> bool:
        """A sealed round that lists this process: its node id, from a member snapshot that
        covers our write, and (rounds that record it) our incarnation: a newer process with our
        node id may have been sealed in, and that round is not ours."""
        if not current or self.node_id not in current.ranks or current.members_index < my_index:
            return False
        if current.incarnations:
            return (current.incarnations[current.ranks.index(self.node_id)]
                    == incarnation_tag(self.incarnation.id))
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
        if self.last is not None:
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
        progress = Progress(self, deadline)
        while True:
            res = self._blocking_list(self.keys.members, index,
                                      min(ROUND_WAIT, progress.wait()), deadline)
            old = sorted(e.key[len(self.keys.members):] for e in res.data
                         if e.modify_index < closed.modify_index)
            if not old:
                break
            self.closed_alive = old
            if time.monotonic() >= deadline:
                raise self._closed_error(closed)
            progress.maybe_log(RunState(), f"run closed by {info.get('by', '?')}: waiting for "
                               f"{len(old)} node(s) of the job that ended to leave "
                               f"({', '.join(old[:8])})")
        self.closed_alive = []
        try:
            self.client.txn([txn_kv("delete-cas", self.keys.round, index=closed.modify_index)],
                            deadline=self.op_deadline(deadline))
        except ConsulTxnConflict:
            return  # someone else reopened it (or closed it again): read it again
        if closed.session:  # the session that kept the marker of a finished run: not needed
            with contextlib.suppress(ConsulError):
                self.client.session_destroy(closed.session, deadline=self.op_deadline(deadline))
        logger.info("Run %s was closed by %s (%s) and no node of that job is left: node %s "
                    "opens it again for a new job.", self.run_id, info.get("by", "?"),
                    info.get("reason", ""), self.node_id)

    def _check_explicit_rank(self, deadline: float) -> None:
        res = self.client.kv_list(self.keys.members, deadline=self.op_deadline(deadline))
        for entry in res.data:
            m = Member.decode(entry)
            if m.node != self.node_id and m.rank == self.settings.node_rank:
                raise RendezvousStateError(
                    f"Nodes {m.node} and {self.node_id} both ask for rank {m.rank} in run "
                    f"{self.run_id} (rank_policy explicit): give every node a distinct node_rank."
                )

    def _result(self, current: Round) -> RoundResult:
        return RoundResult(
            run_id=self.run_id, round=current.round, rank=current.ranks.index(self.node_id),
            world_size=current.world_size, participants=list(current.ranks),
            store=current.store, coordinator=current.coordinator,
            seal_id=current.seal_id, members_index=current.members_index,
            joined_index=current.joined_index, round_index=current.modify_index,
            min_nodes=current.min_nodes,
            max_nodes=current.max_nodes,
            timings={"first_join": current.first_join, "quorum": current.quorum_at,
                     "sealed": current.sealed_at, "announced": self.announced_at,
                     "seen": time.time()},
        )

    def _closed_error(self, current: Round) -> RendezvousClosedError:
        info = current.closed or {}
        alive = self.closed_alive
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
            held = [f"{m.node} ({m.health})" for m in state.members.values() if m.health]
            if held:
                detail += f" Held out by their Consul node's health: {'; '.join(held[:16])}."
        return RendezvousTimeoutError(
            f"Node {self.node_id} timed out after join_timeout "
            f"({self.settings.join_timeout:g}s) waiting for a round of run {self.run_id}.{detail}"
        )

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
        res = self.client.kv_list(prefix, deadline=self.op_deadline(deadline))
        index.rebase(res.index)
        session = self.registration.session
        if session and self.client.session_info(
                session, deadline=self.op_deadline(deadline)) is None:
            raise _Rejoin("the session did not survive a Consul outage")
        return res



class Coordinator:
    """The coordinator's part of a join: watch the whole run, plan, seal (docs/protocol.md,
    step 5)."""

    def __init__(self, join: Join, my_index: int, progress: Progress) -> None:
        self.join = join
        self.my_index = my_index
        self.progress = progress

    def run(self) -> RoundResult:
        join, deadline, my_index, progress = self.join, self.join.deadline, self.my_index, \
            self.progress
        index = BlockingIndex()
        quorum_since: float | None = None
        first_seen = time.time()
        while True:
            if time.monotonic() >= deadline:
                raise join._timeout_error()
            res = join._blocking_list(join.keys.prefix + "/", index,
                                      self._wait(deadline, quorum_since, progress),
                                      deadline)
            state = RunState.parse(join.keys, res.data)
            if state.leader_session != join.registration.session:
                raise _LostLeadership("the leader key is held by another session or none")
            me = state.members.get(join.node_id)
            if me is None or me.modify_index < my_index:
                raise _Rejoin("our member key disappeared")
            if state.round and state.round.closed:
                raise join._closed_error(state.round)
            if state.round is not None and join._meant_for_me(state.round, my_index):
                return join._result(state.round)  # our own seal, whose answer was lost
            plan = plan_round(state, join.settings, time.monotonic(), quorum_since)
            if quorum_since is None and plan.quorum_since is not None and plan.seal is None:
                logger.debug("Run %s has a quorum; last call for %gs.", join.run_id,
                             join.settings.last_call_timeout)
            quorum_since = plan.quorum_since
            if plan.seal is None:
                logger.debug("Coordinator %s of run %s waits: %s.", join.node_id, join.run_id,
                             plan.reason)
                progress.maybe_log(state, plan.detail)
                continue
            quorum_at = time.time() - (time.monotonic() - (quorum_since or time.monotonic()))
            sealed = self._seal(state, plan.seal, res.index, first_seen, quorum_at, deadline)
            if sealed is not None:
                if join.node_id in sealed.ranks:
                    return join._result(sealed)
                # Not selected (explicit ranks, or more nodes than max_nodes): stay waiting.
                raise _LostLeadership("sealed a round without this node")

    def _wait(self, deadline: float, quorum_since: float | None,
              progress: Progress) -> float:
        join = self.join
        wait = min(deadline - time.monotonic(), ROUND_WAIT, progress.wait())
        if quorum_since is not None:
            wait = min(wait, quorum_since + join.settings.last_call_timeout - time.monotonic())
        return max(wait, 0.001)

    def _seal(self, state: RunState, order: list[str], snapshot_index: int, first_seen: float,
              quorum_at: float, deadline: float) -> Round | None:
        join = self.join
        settings = join.settings
        previous = state.round
        number = max([previous.round + 1 if previous else 1,
                      *(state.members[n].want for n in order)])
        rank0 = state.members[order[0]]
        now = time.time()
        # How the previous round ended, for the history and the storm check: known only now.
        after = history.ending(previous, state, order, now) if previous and previous.ranks \
            else None
        endings = history.recent(previous.recent if previous else [], after,
                                 settings.storm_rounds)
        seal_id = uuid.uuid4().hex
        job = previous.job if previous and previous.job else seal_id
        sealed = Round(
            round=number, ranks=order,
            store=rank0.endpoint, members_index=snapshot_index,
            joined_index=max(state.members[n].modify_index for n in order),
            coordinator=join.node_id,
            incarnations=[incarnation_tag(state.members[n].incarnation) for n in order],
            seal_id=seal_id, first_join=first_seen, quorum_at=quorum_at,
            sealed_at=now, min_nodes=settings.min_nodes,
            max_nodes=settings.max_nodes, job=job, recent=endings,
        )
        sealed.totals = history.totals(previous.totals if previous and previous.job else {},
                                       sealed, after)
        storm = history.storm(endings, rounds=settings.storm_rounds,
                              window=settings.storm_window, min_round=settings.storm_min_round,
                              now=now)
        if storm is not None and previous is not None:
            self._stop_storm(previous, sealed, storm, deadline)
            return None  # the round key changed meanwhile: read it again
        ops = [txn_kv("check-session", join.keys.leader, session=join.registration.session),
               txn_kv("cas", join.keys.round, value=sealed.encode(),
                      index=previous.modify_index if previous else 0),
               *history.seal_ops(join.keys, sealed, after, txn_kv)]
        if len(json.dumps(ops)) > MAX_TXN_BYTES:
            # A world at the edge of Consul's transaction limit: the round comes first, its
            # history record and the storm window's endings give way (the totals still count).
            logger.warning("Round %d of run %s is sealed without its history record: the seal "
                           "transaction would exceed Consul's limit.", number, join.run_id)
            sealed.recent = []
            ops = [*ops[:1], txn_kv("cas", join.keys.round, value=sealed.encode(),
                                    index=previous.modify_index if previous else 0),
                   *history.seal_ops(join.keys, sealed, after, txn_kv)[1:2]]
        _check_seal_fits(ops, sealed, join.run_id)
        try:
            res = join.client.txn(ops, deadline=join.op_deadline(deadline))
        except ConsulTxnConflict as exc:
            logger.debug("Coordinator %s of run %s could not seal round %d (%s); re-reading.",
                         join.node_id, join.run_id, number, exc)
            return None
        sealed.modify_index = res.data[1].modify_index if res.data[1] else 0
        logger.debug("Coordinator %s sealed round %d of run %s with %d nodes.", join.node_id,
                     number, join.run_id, len(order))
        return sealed

    def _stop_storm(self, previous: Round, sealed: Round, storm: str, deadline: float) -> None:
        """The run's rounds keep breaking without training: close it (outcome ``failed``) in
        place of the seal, with the pattern and the nodes in the reason; every member waiting
        for this round wakes and raises RendezvousClosedError, and so does this node."""
        join = self.join
        closed = dataclasses.replace(previous)
        closed.closed = runs.closed_marker(
            f"{storm}. Find out why these nodes keep failing or leaving (their logs, `consul-rdzv "
            f"history {join.run_id}`), then start the job again", join.node_id, runs.OUTCOME_FAILED)
        closed.recent, closed.totals = sealed.recent, dict(sealed.totals, storm=storm)
        closed.totals.update(rounds=sealed.totals["rounds"] - 1, round=previous.round,
                             last_sealed_at=previous.sealed_at)
        ops = [txn_kv("check-session", join.keys.leader, session=join.registration.session),
               txn_kv("cas", join.keys.round, value=closed.encode(), index=previous.modify_index)]
        if previous.job:
            ops.append(txn_kv("set", join.keys.history_totals(previous.job),
                              value=history_value(closed.totals)))
        try:
            join.client.txn(ops, deadline=join.op_deadline(deadline))
        except ConsulTxnConflict as exc:
            logger.debug("Coordinator %s of run %s could not close it for a restart storm (%s); "
                         "re-reading.", join.node_id, join.run_id, exc)
            return
        logger.error("Coordinator %s closed run %s: %s.", join.node_id, join.run_id, storm)
        raise join._closed_error(closed)


class Progress:
    """One INFO line every PROGRESS_EVERY seconds while a node waits for its round."""

    def __init__(self, node: Join, deadline: float) -> None:
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
        health = node.health()
        if health:
            reason = "; ".join(p for p in (reason, f"this node is held out by its Consul "
                                                   f"node's health: {health}") if p)
        logger.info(
            "Run %s: node %s waits for round %d: %d of min %d nodes present (%s), max %d, "
            "coordinator %s%s%s; join timeout in %.0fs.", node.run_id, node.node_id, number,
            len(members), settings.min_nodes, ", ".join(members[:8]) + (
                ", ..." if len(members) > 8 else ""), settings.max_nodes, leader, missing,
            f"; {reason}" if reason else "", self.deadline - time.monotonic())


def _check_seal_fits(ops: list[dict], sealed: Round, run_id: str) -> None:
    size = len(json.dumps(ops))
    if size <= MAX_TXN_BYTES:
        return
    longest_id = max(json_len(n) for n in sealed.ranks)
    fits = largest_world(longest_id)
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
