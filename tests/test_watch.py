"""The training watch's decisions and index discipline, without Consul (a unit tier).

:func:`consul_rdzv.watch.judge` is checked on hand-built answers, and :class:`RoundWatch` on
scripted answer streams through a fake transport: a query that times out with a lower index, an
index that goes backwards or to 0, a server behind the round, a participant's rewrite hidden by a
spare leaving in the same answer, a departure that is the job's end; and what a training node
makes of its agent's gossip view. What Consul itself does is tested against real agents
elsewhere (tests/test_long_jobs.py); this file only pins down the decisions.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from consul_rdzv.client import KVEntry, QueryResult, Step
from consul_rdzv.errors import ConsulUnavailableError
from consul_rdzv.keeper import cut_off
from consul_rdzv.layout import Keys, Member, Round
from consul_rdzv.planning import MemberView
from consul_rdzv.settings import RendezvousSettings
from consul_rdzv.watch import Action, RoundWatch, WatchedRound, judge

P = {"a", "b", "c"}


def views(**indexes: int) -> dict[str, MemberView]:
    return {name: MemberView(index) for name, index in indexes.items()}


# ------------------------------------------------------------------------------ judge()


def test_an_answer_that_did_not_move_changes_nothing():
    assert judge(views(a=0, b=0, c=0), P, Step.SAME, P).action is Action.NOTHING


def test_names_that_differ_without_a_move_are_read():
    """Spares present at the seal: the watch starts without them."""
    assert judge(views(a=0, b=0, c=0), P | {"spare"}, Step.SAME, P).action is Action.READ


def test_a_participant_gone_ends_the_round_without_a_read():
    judgement = judge(views(a=0, b=0, c=0), {"a", "c"}, Step.MOVED, P)
    assert judgement.action is Action.OVER and judgement.gone == ("b",)
    assert judgement.reason == "gone: b"


def test_same_names_of_participants_moved_is_a_rewrite():
    judgement = judge(views(a=0, b=0, c=0), P, Step.MOVED, P)
    assert judgement.action is Action.OVER and judgement.asking and not judgement.gone


def test_a_spare_leaving_is_read_because_a_rewrite_may_hide_behind_it():
    """Finding (a): a participant's rewrite and a spare's departure in one answer. The names
    only show the spare gone; the values tell the rewrite."""
    known = views(a=0, b=0, c=0, spare=50)
    assert judge(known, P, Step.MOVED, P).action is Action.READ


def test_a_newcomer_is_read_and_a_reset_is_read():
    assert judge(views(a=0, b=0, c=0), P | {"d"}, Step.MOVED, P).action is Action.READ
    assert judge(views(a=0, b=0, c=0), P, Step.RESET, P).action is Action.READ


def test_same_names_with_a_non_participant_moved_is_read():
    known = views(a=0, b=0, c=0, spare=50)
    assert judge(known, P | {"spare"}, Step.MOVED, P).action is Action.READ


# ------------------------------------------------------------------------------ RoundWatch


KEYS = Keys("t/run")


def entry(node: str, modify_index: int) -> KVEntry:
    value = Member(node=node, host=node, pid=1).encode()
    return KVEntry(KEYS.member(node), value, 1, modify_index, 1, 0, "s")


@dataclass
class FakeConsul:
    """Scripted answers, one list per call kind; an exhausted script blocks (a long poll)
    until the test ends it. Every call is recorded."""

    keys: list = field(default_factory=list)
    lists: list = field(default_factory=list)
    gets: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    delay: float = 0.0  # how long each answer takes

    def _next(self, script: list, what: tuple):
        self.calls.append(what)
        time.sleep(self.delay)
        if not script:
            self.done.wait(10)
            raise ConsulUnavailableError("script over")
        answer = script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def kv_keys_query(self, prefix, *, index=None, wait=None, stale=False, deadline=None,
                      **_):
        return self._next(self.keys, ("keys", index))

    def kv_list(self, prefix, *, stale=False, deadline=None, **_):
        return self._next(self.lists, ("list", None))

    def kv_get(self, key, *, stale=False, deadline=None, **_):
        return self._next(self.gets, ("get", stale))



@dataclass
class Host:
    events: list = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)

    def watch_counted(self, watch, waiting):
        self.events.append(("counted", waiting))

    def watch_over(self, watch, reason, own_key, waiting):
        self.events.append(("over", reason, own_key, waiting))
        self.ended.set()

    def watch_finished(self, watch, closed):
        self.events.append(("finished", closed.get("by")))
        self.ended.set()


def keys(index: int, *names: str) -> QueryResult:
    return QueryResult(index, [KEYS.member(n) for n in names])


def run_watch(fake: FakeConsul, *, members_index: int = 100, joined_index: int = 0,
              max_nodes: int = 3, node: str = "a",
              until=None, timeout: float = 5.0) -> tuple[Host, RoundWatch]:
    settings = RendezvousSettings(run_id="run", min_nodes=1, max_nodes=max_nodes)
    watched = WatchedRound(round=1, participants=["a", "b", "c"], members_index=members_index,
                           joined_index=joined_index, seal_id="seal", max_nodes=max_nodes,
                           settings=settings, node_id=node)
    host = Host()
    watch = RoundWatch(fake, KEYS, watched, host, wait=1.0)  # type: ignore[arg-type]
    watch.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (until() if until else host.ended.is_set()):
        time.sleep(0.005)
    watch.stop()
    fake.done.set()
    return host, watch


def test_a_query_that_times_out_with_the_prefix_s_lower_index_is_no_change():
    """The healthy one-node job restarted 5 min in: the watch starts at the round's
    members_index (an index of P/, raised by the leader key), and the members prefix answers
    its timed-out query with its own lower index. Twice, then once more at that index: never a
    round's end, never a read."""
    fake = FakeConsul(keys=[keys(40, "a", "b", "c"), keys(40, "a", "b", "c"),
                            keys(40, "a", "b", "c")])
    host, watch = run_watch(fake, until=lambda: len(fake.calls) >= 4)
    assert [e[0] for e in host.events] == ["counted"] * 3
    assert all(e[1] == 0 for e in host.events)
    assert fake.calls[:4] == [("keys", 100), ("keys", 40), ("keys", 40), ("keys", 40)]
    assert watch.reads == 0


def test_an_index_that_goes_backwards_is_read_again_not_taken_for_a_change():
    """A snapshot restore or reaped tombstones: the index goes down. The values are read (no
    blocking query at the old index) and, unchanged, end nothing."""
    fake = FakeConsul(
        keys=[keys(120, "a", "b", "c", "spare"), keys(90, "a", "b", "c", "spare"),
              keys(95, "a", "b", "c", "spare")],
        lists=[QueryResult(120, [entry(n, 10) for n in "abc"] + [entry("spare", 120)]),
               QueryResult(90, [entry(n, 10) for n in "abc"] + [entry("spare", 85)])])
    host, _ = run_watch(fake, until=lambda: len(fake.calls) >= 6)
    assert not any(e[0] == "over" for e in host.events), host.events
    kinds = [c[0] for c in fake.calls]
    assert kinds[:5] == ["keys", "list", "keys", "list", "keys"], fake.calls
    assert fake.calls[4] == ("keys", 90), "after the read, block at the read's own index"


def test_an_answer_of_index_zero_never_makes_a_busy_loop():
    fake = FakeConsul(keys=[keys(0, "a", "b", "c"), keys(0, "a", "b", "c")])
    host, _ = run_watch(fake, members_index=0, until=lambda: len(fake.calls) >= 3)
    assert fake.calls[1:3] == [("keys", 1), ("keys", 1)]
    assert not any(e[0] == "over" for e in host.events)


def test_a_server_behind_the_round_is_ignored_not_taken_for_deaths():
    """A ?stale answer from a server that has not applied the participants' own writes (it
    lists none of b and c): ignored, then the next server's answer counts."""
    fake = FakeConsul(keys=[keys(30, "a"), keys(100, "a", "b", "c")])
    host, watch = run_watch(fake, joined_index=60, until=lambda: len(fake.calls) >= 3,
                            timeout=8)
    assert not any(e[0] == "over" for e in host.events), host.events
    assert watch.ignored == 1
    assert fake.calls[1] == ("keys", 100), "the ignored answer did not move the index"


def test_a_rewrite_hidden_by_a_spare_leaving_in_the_same_answer_ends_the_round():
    """Finding (a), as the watch sees it: one answer without the spare; the values show b's
    rewrite (its ModifyIndex past members_index)."""
    fake = FakeConsul(
        keys=[keys(100, "a", "b", "c", "spare"), keys(130, "a", "b", "c")],
        lists=[QueryResult(100, [entry(n, 10) for n in "abc"] + [entry("spare", 90)]),
               QueryResult(130, [entry("a", 10), entry("b", 125), entry("c", 10)])])
    host, _ = run_watch(fake)
    assert host.events[-1][0] == "over", host.events
    assert host.events[-1][1] == "asking for a new round: b"


def test_a_departure_in_a_run_closed_as_finished_is_the_job_s_end():
    finished = Round(round=1, ranks=["a", "b", "c"], seal_id="seal",
                     closed={"outcome": "finished", "by": "b", "reason": "done"})
    fake = FakeConsul(keys=[keys(140, "a", "c")],
                      gets=[QueryResult(150, KVEntry(KEYS.round, finished.encode(), 1, 150, 0,
                                                     0, None))])
    host, _ = run_watch(fake)
    assert host.events == [("finished", "b")], host.events
    assert fake.calls[-1] == ("get", True), "read from any server that has applied the break"


@pytest.mark.parametrize("outcome", ["failed", "closed", None])
def test_a_departure_in_a_run_not_closed_as_finished_ends_the_round(outcome):
    closed = {"outcome": outcome, "by": "b"} if outcome else None
    current = Round(round=1, ranks=["a", "b", "c"], seal_id="seal", closed=closed)
    fake = FakeConsul(keys=[keys(140, "a", "c")],
                      gets=[QueryResult(150, KVEntry(KEYS.round, current.encode(), 1, 150, 0, 0,
                                                     None))])
    host, _ = run_watch(fake)
    assert host.events[-1][:3] == ("over", "gone: b", True), host.events


def test_a_finished_marker_seen_by_a_lagging_server_is_asked_of_the_leader():
    finished = Round(round=1, ranks=["a", "b", "c"], seal_id="seal",
                     closed={"outcome": "finished", "by": "b"})
    behind = QueryResult(120, KVEntry(KEYS.round, Round(round=1, ranks=["a", "b", "c"],
                                                        seal_id="seal").encode(), 1, 100, 0,
                                      0, None))
    fake = FakeConsul(keys=[keys(140, "a", "c")],
                      gets=[behind, QueryResult(150, KVEntry(KEYS.round, finished.encode(), 1,
                                                             150, 0, 0, None))])
    host, _ = run_watch(fake)
    assert host.events == [("finished", "b")], host.events
    assert [c for c in fake.calls if c[0] == "get"] == [("get", True), ("get", False)]


# ------------------------------------------------------------------------------ cut off


def test_cut_off_is_an_agent_alone_in_its_gossip_view():
    """What the keep thread of a training node makes of its agent's /v1/agent/members."""
    alive, failed = {"Status": 1}, {"Status": 4}
    assert cut_off([alive, failed, failed, {"Status": 3}]), "every other member failed or left"
    assert not cut_off([alive]), "a lone dev agent is not cut off"
    assert not cut_off([alive, alive, failed, failed]), "quorum lost, a client agent alive"
    assert not cut_off([alive, failed, alive]), "a leader election"


def test_a_move_after_a_failure_is_checked_by_a_read_not_taken_for_a_rewrite():
    """A query fails; the read that rebuilds the baseline comes from a server restarted from an
    older snapshot (index 22); it catches up (29) with the same names and nothing rewritten:
    the move is read, not taken for a participant asking for a new round."""
    fake = FakeConsul(
        keys=[ConsulUnavailableError("server restarting"), keys(29, "a", "b", "c")],
        lists=[QueryResult(22, [entry(n, 10) for n in "abc"]),
               QueryResult(29, [entry(n, 10) for n in "abc"])])
    host, watch = run_watch(fake, until=lambda: len(fake.calls) >= 5, timeout=8)
    assert not any(e[0] == "over" for e in host.events), host.events
    assert [c[0] for c in fake.calls[:4]] == ["keys", "list", "keys", "list"], fake.calls
    assert watch.reads == 2


def test_judge_distrusts_a_move_only_when_told():
    known = views(a=0, b=0, c=0)
    assert judge(known, P, Step.MOVED, P, trust_moves=False).action is Action.READ
    assert judge(known, {"a", "b"}, Step.MOVED, P, trust_moves=False).action is Action.OVER
