"""The training-time watch of one round: ``num_nodes_waiting()`` without a Consul request, and
the moment the round is over.

While a round trains, each node blocks on the *names* of the member keys (``P/members/?keys``,
``?stale``: any server answers, so a leader election does not stall it) and keeps one number,
the nodes waiting (:func:`consul_rdzv.planning.count_waiting`). This module is the one place
that reads those answers; :func:`judge` is its decision, a pure function, unit-tested on answer
streams without Consul.

**Index discipline** (:class:`consul_rdzv.client.BlockingIndex`). The first query blocks at the
round's ``members_index`` (the Raft index of the member snapshot the round was sealed from), a
*borrowed* index: its first answer at or below it means that no member key was written or
deleted since the seal, whatever lower index the members prefix has of its own (the leader key
was often the last write before the seal). From then on the watch compares only its own answers:
an answer below the previous one (a snapshot restore, tombstones reaped, another server) resets
the query and the values are read again; an answer that did not move is no change. What changed
is always decided from data:

* keys vanished and one was a participant's: the round is over (a death, or a node that left);
* a key appeared, or only keys of non-participants vanished (a participant's rewrite may hide
  behind that), or the index reset: the values are read (each key's ``ModifyIndex`` against the
  round's ``members_index``);
* the same names, every one a participant's, and the index moved: a participant rewrote its key,
  it asks for a new round. No value is read for that: at 1024 members the names are ~24 KB per
  watcher, the values ~430 KB, and in a mass re-announcement every survivor wakes at once. Only
  the first move after a failure or a reset is checked by a read: the read that rebuilt the
  baseline may have come from a server with older state (restarted from its last snapshot),
  which catches up a moment later without anything having changed.

**Servers behind the round.** A ``?stale`` answer comes from any server. One whose index is below
the round's ``joined_index`` (the newest member write the round was sealed from) has not applied
the round's own members yet (a server cut off from the leader since before the seal): its answer
is ignored, never taken for participants that are gone.

**A job's end is not a death.** Before it ends a round, the watch reads the round key once: a run
closed as *finished* in this very round (a node whose workers succeeded closed it, then left)
ends nothing; this node's workers finish their work (:meth:`WatchHost.watch_finished`).

A node cut off from the servers is not this watch's business (its query may hang in its agent
for the whole wait): :class:`consul_rdzv.registration.Registration` looks at the agent's gossip.

Once the round is over the watch ends: this node joins the next round anyway, and reading on would
cost every node a request per re-announcement (O(W^2) in a mass re-announcement).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Protocol

from .client import BlockingIndex, ConsulClient, KVEntry, QueryResult, Step
from .errors import ConsulError, RendezvousStateError
from .layout import Keys, Member, Round
from .planning import MemberView, count_waiting, round_broken
from .runs import OUTCOME_FINISHED
from .settings import RendezvousSettings

logger = logging.getLogger(__name__)

#: Longest blocking query of the watch when the settings do not say (Consul caps waits at 10 min).
WATCH_WAIT = 300.0
#: Pause after an answer that could not be used (a server behind the round, a failure), doubling
#: up to the maximum: never a busy loop against a lagging server.
RETRY_PAUSE = 0.05
RETRY_PAUSE_MAX = 2.0
#: How the reason a round is over names its participants that are gone, and those that ask for
#: a new round (known by name, or only from the names' index): :func:`why_over` reads it back.
GONE = "gone: "
ASKING = "asking for a new round: "
ASKS = "a participant asks for a new round"


def why_over(reason: str) -> str | None:
    """What ended a round, from the watch's reason: ``departure`` (a participant is gone),
    ``rejoin`` (one asks for a new round), None (not the watch's reason)."""
    if GONE in reason:
        return "departure"
    if ASKING in reason or ASKS in reason:
        return "rejoin"
    return None


class Action(enum.Enum):
    NOTHING = "nothing"  # the answer changes nothing we know
    READ = "read"  # read the values to know what changed
    OVER = "over"  # the round is over (participants gone, or one asks for a new round)


@dataclass(frozen=True)
class Judgement:
    action: Action
    gone: tuple[str, ...] = ()  # participants whose keys vanished
    asking: bool = False  # a participant rewrote its key (which one is not known from names)

    @property
    def reason(self) -> str:
        if self.gone:
            more = ", ..." if len(self.gone) > 8 else ""
            return f"{GONE}{', '.join(self.gone[:8])}{more}"
        return ASKS if self.asking else ""


def judge(known: Mapping[str, MemberView], names: Set[str], step: Step,
          participants: Set[str], *, trust_moves: bool = True) -> Judgement:
    """What one ``?keys`` answer means, given what the watch knows (see the module doc).

    ``known`` maps each member key we know of to its view; ``names`` are the key names the
    answer listed; ``step`` is what the answer's index did (:meth:`BlockingIndex.update`).
    ``trust_moves`` False: the index's last baseline came from a read after a failure or a
    reset, possibly from a server with older state (one restarted from its last snapshot that
    catches up a moment later): a move with the same names is checked by reading the values,
    not taken for a participant's rewrite.
    """
    if step is Step.RESET:
        return Judgement(Action.READ)
    vanished = known.keys() - names
    gone = tuple(sorted(vanished & participants))
    if step is Step.SAME:
        # Nothing under the prefix was written or deleted since our last answer. Names that
        # differ anyway (spares present at the seal, which the watch starts without): read.
        return Judgement(Action.NOTHING) if names == known.keys() else Judgement(Action.READ)
    if gone:
        return Judgement(Action.OVER, gone=gone)
    if names - known.keys() or vanished:
        # A newcomer (its value tells its rank), or a non-participant that left: a participant's
        # rewrite in the same answer would be invisible in the names.
        return Judgement(Action.READ)
    if names <= participants and trust_moves:
        return Judgement(Action.OVER, asking=True)
    return Judgement(Action.READ)


def view_of(entry: KVEntry) -> MemberView:
    rank, healthy = None, True
    with contextlib.suppress(RendezvousStateError):
        member = Member.decode(entry)
        rank, healthy = member.rank, not member.health
    return MemberView(entry.modify_index, rank, healthy)


class WatchHost(Protocol):
    """What the watch tells the node (each call carries the watch: a stale one is ignored)."""

    def watch_counted(self, watch: RoundWatch, waiting: int) -> None: ...

    def watch_over(self, watch: RoundWatch, reason: str, own_key: bool, waiting: int) -> None:
        ...

    def watch_finished(self, watch: RoundWatch, closed: dict) -> None: ...


@dataclass
class WatchedRound:
    """What the watch needs of the round it watches."""

    round: int
    participants: list[str]
    members_index: int
    joined_index: int  # 0: unknown (a round sealed by an older release)
    seal_id: str
    max_nodes: int  # the round's: room is judged by what the round was sealed with
    settings: RendezvousSettings
    node_id: str


class RoundWatch:
    """One round's watch: a daemon thread from :meth:`start` until the round is over or
    :meth:`stop`."""

    def __init__(self, client: ConsulClient, keys: Keys, watched: WatchedRound,
                 host: WatchHost, *, wait: float = WATCH_WAIT) -> None:
        self.client = client
        self.keys = keys
        self.watched = watched
        self.host = host
        self.wait = wait
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        #: Counters for tests and logs.
        self.reads = 0
        self.queries = 0
        self.ignored = 0

    def start(self) -> RoundWatch:
        self._thread = threading.Thread(
            target=self._run, daemon=True,
            name=f"consul-rdzv-watch-{self.watched.node_id}-r{self.watched.round}")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the current query (its answer is ignored)."""
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        w = self.watched
        prefix = self.keys.members
        participants = set(w.participants)
        index = BlockingIndex(w.members_index, borrowed=True)
        # The participants were members at the seal, written at or before its members_index.
        # (One view for all: a frozen dataclass built per participant costs 0.25 ms at 512.)
        known: dict[str, MemberView] = dict.fromkeys(w.participants, MemberView(0))
        read = False
        failures = 0
        distrust = False  # the baseline came from a read after a failure or a reset
        while not self._stopped.is_set():
            try:
                if read:
                    res = self.client.kv_list(prefix, stale=True, deadline=time.monotonic())
                    self.reads += 1
                    if self._behind(res):
                        raise _Behind(res.index)
                    index.rebase(res.index)
                    known = {e.key[len(prefix):]: view_of(e) for e in res.data}
                    read = False
                    verdict, departed = self._verdict(known)
                else:
                    res = self.client.kv_keys_query(prefix, index=index.param, wait=self.wait,
                                                    stale=True, deadline=time.monotonic())
                    self.queries += 1
                    if self._behind(res):
                        raise _Behind(res.index)
                    step = index.update(res.index)
                    names = {k[len(prefix):] for k in res.data}
                    judgement = judge(known, names, step, participants,
                                      trust_moves=not distrust)
                    if step is Step.RESET:
                        distrust = True
                    elif step is Step.MOVED:
                        distrust = False
                    if judgement.action is Action.READ:
                        read = True
                        continue
                    verdict = judgement.reason if judgement.action is Action.OVER else None
                    departed = bool(judgement.gone)
                    for gone in judgement.gone:
                        known.pop(gone, None)
                failures = 0
            except (ConsulError, _Behind) as exc:
                if self._stopped.is_set():
                    return
                if isinstance(exc, ConsulError):
                    # After a failure, read the values again (without blocking: Consul may be
                    # back with lower indexes, and a query at our old index would sit out its
                    # whole wait).
                    index.reset()
                    read = True
                    distrust = True
                else:
                    self.ignored += 1
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    logger.warning("Node %s cannot watch the members of run %s: %s", w.node_id,
                                   w.settings.run_id, exc)
                self._stopped.wait(min(RETRY_PAUSE * 2 ** failures, RETRY_PAUSE_MAX))
                continue
            if self._stopped.is_set():
                return
            waiting = count_waiting(known, w.participants, w.members_index, w.settings,
                                    max_nodes=w.max_nodes)
            if verdict is None:
                self.host.watch_counted(self, waiting)
                continue
            # A departure may be the job's end (the run closed as finished, then the node left).
            # A participant never asks for a new round of a run closed since: its announcement
            # is guarded by the round key's index (ConsulRendezvous._write_member).
            closed = self._finished(res.index) if departed else None
            if closed is not None:
                self.host.watch_finished(self, closed)
            else:
                self.host.watch_over(self, verdict, w.node_id in known, max(waiting, 1))
            return

    def _verdict(self, known: Mapping[str, MemberView]) -> tuple[str | None, bool]:
        """Why the round is over (None: it is not) from the values, and whether a participant
        is gone."""
        broken = round_broken(known, self.watched.participants, self.watched.members_index)
        if not broken:
            return None, False
        gone = [n for n in broken if n not in known]
        asking = [n for n in broken if n in known]
        return "; ".join(part for part in (
            f"{GONE}{', '.join(gone[:8])}" if gone else "",
            f"{ASKING}{', '.join(asking[:8])}" if asking else "") if part), \
            bool(gone)

    def _behind(self, res: QueryResult) -> bool:
        """A server that has not applied the round's own member writes (see module doc)."""
        return bool(self.watched.joined_index) and res.index < self.watched.joined_index

    def _finished(self, at_index: int) -> dict | None:
        """The run's closed marker if it was closed as finished in this round, else None.

        Read from a server that has applied at least ``at_index`` (the answer that showed the
        round break): the close comes before the closing node's departure.
        """
        w = self.watched
        deadline = time.monotonic() + min(2.0, w.settings.consul_timeout)
        for stale in (True, False):
            try:
                res = self.client.kv_get(self.keys.round, stale=stale, deadline=deadline)
            except ConsulError as exc:
                logger.debug("Node %s could not read the round of run %s: %s", w.node_id,
                             w.settings.run_id, exc)
                continue
            if stale and res.index < at_index:
                continue
            if res.data is None:
                return None
            try:
                current = Round.decode(res.data)
            except RendezvousStateError:
                return None
            closed = current.closed or {}
            if current.seal_id == w.seal_id and closed.get("outcome") == OUTCOME_FINISHED:
                return closed
            return None
        return None


class _Behind(Exception):
    """A ``?stale`` answer from a server that has not applied the round yet."""

    def __init__(self, index: int) -> None:
        super().__init__(f"a Consul server answered at index {index}, behind the round")
