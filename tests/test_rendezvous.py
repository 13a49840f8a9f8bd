"""The rendezvous protocol against real Consul agents (docs/protocol.md).

Every round a test obtains goes through :func:`assert_round_ok`. Nodes run as threads (through
``concurrent.futures`` with timeouts) or as real child processes (``tests/node_process.py``), so a
hang fails the test instead of blocking the run. Tests synchronise on conditions (Consul state,
``num_nodes_waiting()``, a child's output) polled with deadlines, never on fixed sleeps. Figures
worth reporting are printed with a ``[figure]`` tag (``pytest -s`` shows them).
"""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest
from rdzv_nodes import (
    HB,
    assert_round_ok,
    endpoint_for,
    figure,
    one,
    ranks_of,
    stays,
    wait_for,
)

from consul_rdzv.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from consul_rdzv.join import ROUND_WAIT
from consul_rdzv.layout import Leader
from consul_rdzv.rendezvous import ConsulRendezvous
from consul_rdzv.settings import RendezvousSettings

# ============================================================================ 1. threads


@pytest.mark.parametrize("n", [2, 8, 64])
def test_threads_form_one_round_then_rejoin_with_stable_ranks(nodes, n):
    settings = nodes.settings(min_nodes=n, max_nodes=n, last_call_timeout=30.0,
                              join_timeout=90.0, heartbeat_timeout=5.0 if n > 8 else HB)
    ns = [nodes.node(f"n{i}", settings) for i in range(n)]

    started = time.monotonic()
    first = nodes.rounds(ns, timeout=60)
    took_first = time.monotonic() - started
    assert_round_ok(first, n, n)
    assert one(first).round == 1
    assert took_first < 20, "a full round seals at once; it must not wait for the last call"

    started = time.monotonic()
    second = nodes.rounds(ns, timeout=60)
    took_second = time.monotonic() - started
    assert_round_ok(second, n, n)
    assert one(second).round == 2
    assert one(second).seal_id != one(first).seal_id
    assert ranks_of(second) == ranks_of(first), "stable ranks: every node keeps its rank"
    nodes.recorder.assert_sealed_once()

    requests = sorted(r.requests for r in first.values())
    requests2 = sorted(r.requests for r in second.values())
    figure(f"N={n} threads: round 1 in {took_first:.3f}s, round 2 (all re-join) in "
           f"{took_second:.3f}s; Consul requests per node and round: round 1 "
           f"min/median/max {requests[0]}/{requests[n // 2]}/{requests[-1]}, round 2 "
           f"{requests2[0]}/{requests2[n // 2]}/{requests2[-1]}")


# ============================================================================ 2. processes


@pytest.mark.parametrize("n", [3, 8])
def test_processes_form_a_round(nodes, n):
    started = time.monotonic()
    procs = [nodes.process(f"p{i}", min_nodes=n, max_nodes=n, last_call=30.0)
             for i in range(n)]
    first = {p.node_id: p.result(timeout=60) for p in procs}
    took = time.monotonic() - started
    assert_round_ok(first, n, n)
    # really n processes: each member value carries the pid of the process that wrote it
    members = nodes.members()
    assert {m.pid for m in members.values()} == {p.proc.pid for p in procs}

    for p in procs:
        p.send("next")
    second = {p.node_id: p.result(timeout=60) for p in procs}
    assert_round_ok(second, n, n)
    assert one(second).round == one(first).round + 1
    assert ranks_of(second) == ranks_of(first)
    for p in procs:
        p.send("waiting")
    assert all(p.event(timeout=10)["value"] == 0 for p in procs)
    nodes.recorder.assert_sealed_once()
    figure(f"N={n} processes: first round {took:.2f}s after the first process started")

    for p in procs:
        p.send("leave")
    for p in procs:
        assert p.proc.wait(15) == 0
    wait_for(lambda: not nodes.members(), 5, "every process removed its member key")


# ============================================================================ 3. scaling


def test_scale_down_reseals_at_once_and_scale_up_fills_the_round(nodes):
    settings = nodes.settings(min_nodes=2, max_nodes=4, last_call_timeout=30.0)
    ns = {i: nodes.node(i, settings) for i in "abcd"}
    first = nodes.rounds(ns.values(), timeout=20)
    assert_round_ok(first, 2, 4)
    assert one(first).world_size == 4

    # the participant of rank 1 leaves cleanly; the others see it go
    by_rank = {r.rank: node for node, r in first.items()}
    leaver = ns[by_rank[1]]
    assert leaver.leave()
    survivors = [n for n in ns.values() if n is not leaver]
    wait_for(lambda: all(n.num_nodes_waiting() >= 1 for n in survivors), 5,
             "survivors see that a participant left")

    started = time.monotonic()
    second = nodes.rounds(survivors, timeout=20)
    took_down = time.monotonic() - started
    assert_round_ok(second, 2, 4)
    assert one(second).world_size == 3 and leaver.node_id not in one(second).participants
    assert took_down < 5, f"fast re-seal: nobody new, so no last call (took {took_down:.2f}s)"
    # stable ranks: ranks 0 and 2 are kept, the old rank 3 fills the hole at 1
    assert ranks_of(second) == {by_rank[0]: 0, by_rank[2]: 2, by_rank[3]: 1}

    # a new node joins: it waits, the participants see it and re-join
    newcomer = nodes.node("e", settings)
    pending = nodes.start([newcomer])
    wait_for(lambda: all(n.num_nodes_waiting() == 1 for n in survivors), 5,
             "participants see one node waiting")
    assert not pending["e"].done()
    started = time.monotonic()
    futures = {**pending, **nodes.start(survivors)}
    third = nodes.gather(futures, timeout=20)
    took_up = time.monotonic() - started
    assert_round_ok(third, 2, 4)
    assert one(third).world_size == 4 and one(third).round == 3
    assert ranks_of(third) == {**ranks_of(second), "e": 3}
    assert took_up < 5, f"a full round seals at once (took {took_up:.2f}s)"
    nodes.recorder.assert_sealed_once()
    figure(f"scale-down re-seal (last_call 30s): {took_down:.3f}s; scale-up to max: "
           f"{took_up:.3f}s")


def test_scale_up_below_max_seals_after_the_last_call(nodes):
    last_call = 0.5
    settings = nodes.settings(min_nodes=2, max_nodes=5, last_call_timeout=last_call)
    ns = [nodes.node(i, settings) for i in "abc"]
    first = nodes.rounds(ns, timeout=20)
    assert_round_ok(first, 2, 5)
    assert one(first).world_size == 3
    timings = one(first).timings
    assert timings["sealed"] - timings["quorum"] >= last_call - 0.05

    newcomer = nodes.node("d", settings)
    pending = nodes.start([newcomer])
    wait_for(lambda: all(n.num_nodes_waiting() == 1 for n in ns), 5,
             "participants see the new node")
    second = nodes.gather({**pending, **nodes.start(ns)}, timeout=20)
    assert_round_ok(second, 2, 5)
    assert one(second).world_size == 4 and one(second).round == 2
    assert ranks_of(second) == {**ranks_of(first), "d": 3}
    timings = one(second).timings
    waited = timings["sealed"] - timings["quorum"]
    assert waited >= last_call - 0.05, f"someone new and room left: last call ({waited:.3f}s)"
    assert waited < last_call + 5
    nodes.recorder.assert_sealed_once()


# ============================================================================ 4. late joiners


def test_late_joiner_waits_and_a_spare_beside_a_full_round_is_not_counted(nodes):
    settings = nodes.settings(min_nodes=2, max_nodes=3, last_call_timeout=0.3)
    a, b, c, d = (nodes.node(i, settings) for i in "abcd")
    first = nodes.rounds([a, b], timeout=20)
    assert_round_ok(first, 2, 3)
    assert one(first).world_size == 2

    # c arrives late: it waits (no error) and the participants see one node waiting
    late = nodes.start([c])
    started = time.monotonic()
    wait_for(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, 5,
             "participants see the late joiner")
    latency = time.monotonic() - started
    assert not late["c"].done()
    second = nodes.gather({**late, **nodes.start([a, b])}, timeout=20)
    assert_round_ok(second, 2, 3)
    assert one(second).world_size == 3
    assert ranks_of(second) == {**ranks_of(first), "c": 2}

    # the round is full (W == max_nodes): a spare that waits does not count
    spare = nodes.start([d])
    wait_for(lambda: "d" in nodes.members(), 5, "the spare's member key")
    window = max(1.0, 20 * latency)
    stays(lambda: a.num_nodes_waiting() == b.num_nodes_waiting() == c.num_nodes_waiting() == 0,
          window, "a spare beside a full round made num_nodes_waiting() positive")
    assert not spare["d"].done()

    # control: once a participant leaves, the gone node and the spare both count
    c.leave()
    wait_for(lambda: a.num_nodes_waiting() == 2 and b.num_nodes_waiting() == 2, 5,
             "participants count the gone node and the spare")
    third = nodes.gather({**spare, **nodes.start([a, b])}, timeout=20)
    assert_round_ok(third, 2, 3)
    assert ranks_of(third) == {"a": ranks_of(second)["a"], "b": ranks_of(second)["b"], "d": 2}
    nodes.recorder.assert_sealed_once()
    figure(f"late joiner seen by participants' num_nodes_waiting() after {latency * 1000:.0f}ms")


# ============================================================================ 5. killed node


@pytest.mark.parametrize("rejoin", ["after_notice", "at_once"])
def test_killed_node_is_detected_and_survivors_reseal(nodes, rejoin):
    settings = nodes.settings(min_nodes=3, max_nodes=4, last_call_timeout=30.0)
    survivors = [nodes.node(f"s{i}", settings) for i in range(3)]
    pending = nodes.start(survivors)
    victim = nodes.process("victim", min_nodes=3, max_nodes=4, heartbeat=HB, last_call=30.0)
    first = nodes.gather(pending, timeout=30)
    first["victim"] = victim.result(timeout=10)
    assert_round_ok(first, 3, 4)
    assert one(first).world_size == 4

    killed = time.monotonic()
    victim.kill()
    if rejoin == "at_once":  # survivors re-join at once, e.g. after a collective failed
        pending = nodes.start(survivors)
    wait_for(lambda: "victim" not in nodes.members(), HB + 4,
             "the killed node's member key is deleted with its session")
    gone = time.monotonic()
    noticed = None
    if rejoin == "after_notice":
        wait_for(lambda: all(n.num_nodes_waiting() >= 1 for n in survivors), 5,
                 "survivors' num_nodes_waiting() > 0")
        noticed = time.monotonic()
        pending = nodes.start(survivors)
    second = nodes.gather(pending, timeout=20)
    sealed = time.monotonic()
    assert_round_ok(second, 3, 4)
    assert one(second).world_size == 3 and "victim" not in one(second).participants
    assert one(second).round == 2
    assert gone - killed <= HB + 3, f"member key gone {gone - killed:.2f}s after the kill"
    assert sealed - gone < 5, "fast re-seal once the dead node's key is gone"
    for node, r in second.items():
        if first[node].rank < 3:
            assert r.rank == first[node].rank, "a survivor below the new world size keeps its rank"
    nodes.recorder.assert_sealed_once()
    figure(f"SIGKILL, heartbeat_timeout={HB:g}s, re-join {rejoin}: key gone after "
           f"{gone - killed:.2f}s"
           + (f", noticed after {noticed - killed:.2f}s" if noticed else "")
           + f", kill-to-sealed {sealed - killed:.2f}s")


# ============================================================================ 6. coordinator killed


@pytest.mark.parametrize("when", ["before_others_arrive", "while_one_waits"])
def test_coordinator_killed_while_a_round_forms(nodes, when):
    coordinator = nodes.process("coord", min_nodes=3, max_nodes=3, heartbeat=HB)
    wait_for(lambda: (nodes.leader() or Leader("", "", 0)).node == "coord", 15,
             "the first process holds P/round/leader")
    settings = nodes.settings(min_nodes=2, max_nodes=3, last_call_timeout=0.3)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    pending = {}
    if when == "while_one_waits":
        pending.update(nodes.start([a]))
        wait_for(lambda: "a" in nodes.members(), 5, "a waits beside the coordinator")
    killed = time.monotonic()
    coordinator.kill()
    pending.update(nodes.start([b] if when == "while_one_waits" else [a, b]))
    results = nodes.gather(pending, timeout=HB + 20)
    took = time.monotonic() - killed
    assert_round_ok(results, 2, 3)
    r = one(results)
    assert r.world_size == 2 and r.round == 1
    assert r.coordinator in ("a", "b")
    assert coordinator.events.get(timeout=5) is None, "the killed coordinator returned a round"
    # sealed once: the round in Consul is the one both got, and no other seal was ever seen
    current = nodes.current_round()
    assert (current.round, current.seal_id) == (r.round, r.seal_id)
    wait_for(lambda: r.round in nodes.recorder.seals, 5, "the recorder saw the seal")
    nodes.recorder.assert_sealed_once()
    assert nodes.recorder.seals == {1: {r.seal_id}}
    # nobody returns a second, different result: both are in the round, waiting for nothing
    assert a.current_round == results["a"] and b.current_round == results["b"]
    assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0
    figure(f"coordinator SIGKILLed ({when}): new round sealed {took:.2f}s after the kill")


# ============================================================================ 7. session destroyed


def test_session_destroyed_from_outside_while_training(nodes, caplog):
    settings = nodes.settings(min_nodes=2, max_nodes=2)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    first = nodes.rounds([a, b], timeout=20)
    assert_round_ok(first, 2, 2)
    old = a.session_id
    assert nodes.keys_held_by(old)

    destroyed = time.monotonic()
    nodes.admin.session_destroy(old)  # as an operator would in the UI
    wait_for(lambda: a.num_nodes_waiting() >= 1, 5, "a notices that its session is gone")
    noticed = time.monotonic() - destroyed
    wait_for(lambda: b.num_nodes_waiting() >= 1, 5, "b sees a's member key vanish")

    # The service and its check outlived the session: the new session needs no new service
    # registration (the agent serialises those), only the check passed.
    joins: list[str] = []
    original = a.client.agent_service_register

    def spy(*args, _orig=original, **kwargs):
        if not threading.current_thread().name.startswith("consul-rdzv-keep"):
            joins.append(threading.current_thread().name)  # not the async meta publish
        return _orig(*args, **kwargs)

    a.client.agent_service_register = spy
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="consul_rdzv.registration"):
        second = nodes.rounds([a, b], timeout=20)
    assert_round_ok(second, 2, 2)
    assert one(second).round == 2
    assert joins == [], "the service was registered again although it still existed"
    assert a.session_id not in (None, old)
    registrations = [r for r in caplog.records if r.getMessage().startswith("Node a of run ")
                     and "registered service" in r.getMessage()]
    assert len(registrations) == 1, "registered more than once (a spurious loss)"
    assert nodes.admin.session_info(old) is None
    assert not nodes.keys_held_by(old), "a key is held by the dead session"
    assert nodes.members()["a"].session == a.session_id
    leader = nodes.leader()
    assert leader is not None and leader.session in (a.session_id, b.session_id)
    assert a.num_nodes_waiting() == 0
    figure(f"session destroyed from outside: the node noticed after {noticed * 1000:.0f}ms")


def test_training_heartbeat_passes_the_check_without_probing_the_session(nodes):
    # During training the watch sees our member key vanish if the session dies, so the heartbeat
    # only passes the TTL check (one request a beat, not two).
    settings = nodes.settings(min_nodes=2, max_nodes=2)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    assert_round_ok(nodes.rounds([a, b], timeout=20), 2, 2)
    before = dict(a.client.request_counts)
    wait_for(lambda: a.client.request_counts["PUT agent"] >= before.get("PUT agent", 0) + 3,
             HB * 5, "three heartbeats of a")
    assert a.client.request_counts["PUT session"] == before.get("PUT session", 0)
    assert a.num_nodes_waiting() == 0


def test_training_watch_reads_key_names_on_a_death_and_stops_once_the_round_is_over(nodes):
    # At scale every survivor's watch wakes when one node dies: the names of the member keys
    # tell it, without reading (and decoding) every member's value. Once a round is over the
    # watch stops: reading on would cost every node a request per re-announcement.
    settings = nodes.settings(min_nodes=2, max_nodes=3)
    a, b, c = (nodes.node(i, settings) for i in "abc")
    assert_round_ok(nodes.rounds([a, b, c], timeout=20), 2, 3)
    full_reads: dict[str, int] = {"a": 0, "b": 0}
    keys_queries: dict[str, int] = {"a": 0, "b": 0}
    for node in (a, b):
        def spy(*args, _id=node.node_id, _orig=node.client.kv_list, **kwargs):
            full_reads[_id] += 1
            return _orig(*args, **kwargs)

        def keys_spy(*args, _id=node.node_id, _orig=node.client.kv_keys_query, **kwargs):
            keys_queries[_id] += 1
            return _orig(*args, **kwargs)
        node.client.kv_list = spy
        node.client.kv_keys_query = keys_spy

    nodes.admin.session_destroy(c.session_id)  # c's member key goes with its session
    wait_for(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, 5,
             "a and b see c gone")
    assert full_reads == {"a": 0, "b": 0}
    for node in (a, b):
        reason = node.wait_round_broken(5)
        assert reason is not None and "gone: c" in reason, reason
    queries = dict(keys_queries)

    # a asks for a new round: b's watch has ended, so a's rewrite costs b nothing
    pending = nodes.start([a])
    wait_for(lambda: "a" in nodes.members() and nodes.members()["a"].modify_index
             > one({"x": a.current_round}).members_index, 5, "a re-announced")
    stays(lambda: keys_queries["b"] == queries["b"] and full_reads["b"] == 0, 0.5,
          "b's watch, which ended, still read the members")
    assert b.num_nodes_waiting() == 1
    second = nodes.gather({**pending, **nodes.start([b])}, timeout=20)
    assert_round_ok(second, 2, 3)
    assert one(second).world_size == 2 and one(second).round == 2


def test_session_destroyed_while_coordinating(nodes):
    settings = nodes.settings(min_nodes=2, max_nodes=2)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    pending = nodes.start([a])
    wait_for(lambda: (nodes.leader() or Leader("", "", 0)).node == "a", 5,
             "a coordinates, alone")
    old = a.session_id
    nodes.admin.session_destroy(old)
    wait_for(lambda: a.session_id not in (None, old), 5, "a registers again")
    pending.update(nodes.start([b]))
    results = nodes.gather(pending, timeout=20)
    assert_round_ok(results, 2, 2)
    assert not nodes.keys_held_by(old)
    assert nodes.members()["a"].session == a.session_id


def test_member_key_deleted_by_hand_from_the_coordinator(nodes):
    """``consul kv delete`` of a live node's key: its session lives on, holding the leader key;
    the node must give that session up (not just stop using it) for a round to form again."""
    settings = nodes.settings(min_nodes=2, max_nodes=2, join_timeout=10.0)
    ns = {i: nodes.node(i, settings) for i in "ab"}
    first = nodes.rounds(ns.values(), timeout=20)
    assert_round_ok(first, 2, 2)
    coordinator = ns[nodes.leader().node]
    old = coordinator.session_id
    assert nodes.admin.kv_delete(nodes.keys.member(coordinator.node_id))
    wait_for(lambda: all(n.num_nodes_waiting() >= 1 for n in ns.values()), 5,
             "both nodes see the coordinator's key gone")
    second = nodes.rounds(ns.values(), timeout=20)
    assert_round_ok(second, 2, 2)
    assert one(second).round == 2
    assert nodes.admin.session_info(old) is None, "the abandoned session still exists"
    assert not nodes.keys_held_by(old)


# ============================================================================ 8. Consul outages


@pytest.mark.parametrize("how", ["restart", "crash"])
def test_agent_restart_while_nodes_wait(fresh_nodes, fresh_agent, how):
    consul_timeout = 3.0
    settings = fresh_nodes.settings(min_nodes=3, max_nodes=3, join_timeout=45.0,
                                    consul_timeout=consul_timeout)
    a, b, c = (fresh_nodes.node(i, settings) for i in "abc")
    pending = fresh_nodes.start([a, b])
    wait_for(lambda: {"a", "b"} <= set(fresh_nodes.members()) and fresh_nodes.leader(), 10,
             "a and b wait, one of them coordinating")
    waiting_since = time.monotonic()
    old = {a.session_id, b.session_id}
    # let their blocking queries run longer than consul_timeout before Consul goes away:
    # a short outage must be ridden out whenever it happens during a wait
    time.sleep(consul_timeout + 0.5)
    restarted = time.monotonic()
    # a dev agent comes back empty: sessions, services and keys are gone
    fresh_agent.restart(crash=how == "crash")
    outage = time.monotonic() - restarted
    assert outage < consul_timeout, f"restart took {outage:.1f}s; the test needs a short outage"
    pending.update(fresh_nodes.start([c]))
    try:
        results = fresh_nodes.gather(pending, timeout=settings.join_timeout + 10)
    except RendezvousError as exc:
        pytest.fail(f"a {outage:.1f}s outage (consul_timeout {consul_timeout:g}s, waiting for "
                    f"{restarted - waiting_since:.1f}s) was not ridden out: {exc!r}")
    took = time.monotonic() - restarted
    assert_round_ok(results, 3, 3)
    assert one(results).round == 1  # Consul forgot everything; nobody had a round before
    # a retry that blocked at the old agent's index would sit out a whole ROUND_WAIT first
    assert took < ROUND_WAIT / 2, f"round sealed {took:.1f}s after the restart"
    assert not old & {a.session_id, b.session_id}, "nodes registered again with new sessions"
    assert set(fresh_nodes.members()) == {"a", "b", "c"}
    figure(f"agent {how} ({outage:.2f}s outage) while 2 nodes waited: round sealed "
           f"{took:.2f}s after the restart began")


def test_agent_down_longer_than_consul_timeout(fresh_nodes, fresh_agent):
    settings = fresh_nodes.settings(min_nodes=2, max_nodes=2, consul_timeout=1.5,
                                    join_timeout=6.0, close_timeout=1.0)
    a = fresh_nodes.node("a", settings)
    started = time.monotonic()
    pending = fresh_nodes.start([a])
    wait_for(lambda: (fresh_nodes.leader() or Leader("", "", 0)).node == "a", 5,
             "a waits, coordinating")
    stopped = time.monotonic()  # the outage starts during stop()
    fresh_agent.stop()
    with pytest.raises(RendezvousConnectionError) as info:
        fresh_nodes.gather(pending, timeout=settings.join_timeout + 10)
    took = time.monotonic() - stopped
    assert fresh_agent.address in str(info.value)
    # (a call already in flight when Consul went away may have started its budget a bit earlier)
    assert took >= 0.9 * settings.consul_timeout, "the outage was not ridden out"
    assert took < settings.consul_timeout + 3, "retried much longer than consul_timeout"
    assert time.monotonic() - started < settings.join_timeout, "retried past join_timeout"
    # a joiner that starts while the agent is down fails the same way, after consul_timeout
    b = fresh_nodes.node("b", settings)
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=re.escape(fresh_agent.address)):
        fresh_nodes.rounds([b], timeout=settings.consul_timeout + 10)
    took_b = time.monotonic() - started
    assert settings.consul_timeout <= took_b < settings.consul_timeout + 3
    figure(f"agent stopped under a waiting node: RendezvousConnectionError after {took:.2f}s "
           f"(consul_timeout {settings.consul_timeout:g}s, join_timeout "
           f"{settings.join_timeout:g}s); a new joiner got it after {took_b:.2f}s")


# ============================================================================ 9. corrupt state


@pytest.mark.parametrize(("key", "value"), [
    ("round/current", b"\x00\xff garbage \xfe"),
    ("round/current", b'{"v": 2, "round": 1, "ranks": ["x"]}'),
    ("round/current", b'{"v": 1, "round": "one", "ranks": ["x"]}'),
    ("members/ghost", b"not json"),
    ("members/ghost", b'{"v": 1, "node": "other", "host": "h", "pid": 1}'),
    ("foo", b'{"v": 1}'),
])
def test_corrupt_or_foreign_values_are_refused(nodes, key, value):
    full_key = f"{nodes.keys.prefix}/{key}"
    assert nodes.admin.kv_put(full_key, value)
    node = nodes.node("a", nodes.settings(min_nodes=1, max_nodes=1))
    with pytest.raises(RendezvousStateError) as info:
        nodes.rounds([node], timeout=20)
    assert full_key in str(info.value)
    if key != "round/current":
        assert nodes.current_round() is None, "a round was sealed over foreign state"


# ============================================================================ 10. closed runs


def test_close_releases_every_waiter_and_the_run_opens_again_once_they_are_gone(nodes):
    settings = nodes.settings(min_nodes=3, max_nodes=3)
    a, b, closer = (nodes.node(i, settings) for i in ("a", "b", "closer"))
    pending = nodes.start([a, b])
    wait_for(lambda: {"a", "b"} <= set(nodes.members()), 5, "a and b wait")
    assert not closer.is_closed()

    started = time.monotonic()
    closer.close("test says stop")
    for node_id, future in pending.items():
        with pytest.raises(RendezvousClosedError, match="test says stop"):
            future.result(timeout=5)
        assert node_id
    took = time.monotonic() - started
    assert took < 3, f"waiters released {took:.2f}s after close()"
    assert not nodes.members(), "closed waiters withdraw their member keys"
    assert all(n.is_closed() for n in (a, b, closer))

    # Nobody of the closed job is left: a process started now is a new job on the run id (a
    # re-run), and opens the run again.
    late = nodes.node("late", settings)
    reopened = nodes.start([late])
    wait_for(lambda: "late" in nodes.members() and not closer.is_closed(), 5,
             "the late joiner reopened the run and waits for a new round")
    assert not reopened["late"].done()
    figure(f"close(): waiters got RendezvousClosedError after {took * 1000:.0f}ms")


def test_finished_run_refuses_its_stragglers_and_a_rerun_waits_for_its_nodes(nodes):
    """The finished job's nodes close the run. A straggler of that job (a process started
    before the close) is refused, never running the job again on its own; a re-run (a process
    started after the close) waits while a node of the job lives, and starts a new job, rounds
    counted from 1, once the last one has left."""
    settings = nodes.settings(min_nodes=2, max_nodes=2)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    straggler = nodes.node("straggler", nodes.settings(min_nodes=1, max_nodes=1))
    first = nodes.rounds([a, b], timeout=20)
    assert_round_ok(first, 2, 2)
    assert a.close_if_current(first["a"], "job finished", outcome="finished")
    assert b.close_if_current(first["b"], "job finished"), "already closed counts as closed"
    assert a.leave()

    with pytest.raises(RendezvousClosedError) as info:
        nodes.rounds([straggler], timeout=10)
    assert "job finished" in str(info.value)
    assert "belongs to the job that ended" in str(info.value), str(info.value)
    assert "straggler" not in nodes.members()

    rerun = [nodes.node(f"new-{i}", settings) for i in range(2)]
    pending = nodes.start(rerun)
    wait_for(lambda: {"new-0", "new-1"} <= set(nodes.members()), 10, "the re-run's nodes")
    stays(lambda: not any(f.done() for f in pending.values()) and nodes.current_round()
          and nodes.current_round().closed, 1.0,
          "the re-run started (or failed) while a node of the finished job was alive")

    assert b.leave()  # the last node of the finished job: the re-run starts now
    second = nodes.gather(pending, timeout=20)
    assert_round_ok(second, 2, 2)
    assert one(second).round == 1
    for node in rerun:
        assert node.leave()
    assert not nodes.admin.kv_keys(nodes.keys.prefix + "/"), "keys of an ended job stayed"


def test_finished_run_keeps_its_closed_marker_for_a_while_after_its_last_node(nodes):
    """The last node of a finished job leaves the closed marker (shrunk) under a session with
    the closed_retention TTL: a straggler started before the close is still refused, a re-run
    reopens the run at once and removes marker and session; left alone, Consul deletes the
    marker when the session expires."""
    settings = nodes.settings(min_nodes=1, max_nodes=1, closed_retention=10)
    a = nodes.node("a", settings)
    straggler = nodes.node("straggler", settings)
    first = one(nodes.rounds([a], timeout=20))
    assert a.close_if_current(first, "job finished", outcome="finished")
    assert a.leave()
    entry = nodes.admin.kv_get(nodes.keys.round).data
    assert entry is not None and entry.session, "the closed marker was not kept"
    kept = nodes.admin.session_info(entry.session)
    assert kept["TTL"] == "10s" and kept["Behavior"] == "delete" and not kept["NodeChecks"]
    assert nodes.admin.kv_keys(nodes.keys.prefix + "/") == [nodes.keys.round]
    assert len(entry.value) < 400, "the kept marker should not carry the round's ranks"
    with pytest.raises(RendezvousClosedError, match="belongs to the job that ended"):
        nodes.rounds([straggler], timeout=10)

    rerun = nodes.node("rerun", settings)
    second = one(nodes.rounds([rerun], timeout=20))
    assert second.round == 1 and second.participants == ["rerun"]
    assert nodes.admin.session_info(entry.session) is None, "the marker's session stayed"
    assert rerun.close_if_current(second, "job finished", outcome="finished")
    assert rerun.leave()
    entry = nodes.admin.kv_get(nodes.keys.round).data
    assert entry is not None and entry.session
    # Consul deletes the marker when its session's TTL runs out (servers allow up to 2x TTL)
    wait_for(lambda: not nodes.admin.kv_keys(nodes.keys.prefix + "/"), 2 * 10 + 10,
             "Consul deleting the kept marker")
    assert nodes.admin.session_info(entry.session) is None


def test_closed_run_whose_nodes_all_died_opens_again_for_a_new_job(nodes):
    """The closed marker stays when the job's last node dies instead of leaving: the next
    joiner finds no live node of that job and reopens the run."""
    settings = nodes.settings(min_nodes=1, max_nodes=1)
    victim = nodes.process("victim", min_nodes=1, max_nodes=1, heartbeat=HB)
    first = victim.result(timeout=20)
    closer = nodes.node("closer", settings)
    closer.close("the job failed")
    victim.kill()
    wait_for(lambda: "victim" not in nodes.members(), HB + 5, "the dead node's key is gone")
    assert closer.is_closed()
    late = nodes.node("late", settings)
    result = one(nodes.rounds([late], timeout=20))
    assert result.participants == ["late"]
    assert result.round == 1, "a new job counts its rounds from 1"
    assert first.round == 1
    assert not late.is_closed()


def test_leave_never_closes_the_run(nodes):
    settings = nodes.settings(min_nodes=1, max_nodes=1)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    first = nodes.rounds([a], timeout=20)
    assert_round_ok(first, 1, 1)
    assert a.leave()
    assert a.leave(), "leave() is idempotent"
    assert not b.is_closed()
    assert not nodes.admin.kv_keys(nodes.keys.prefix + "/"), "the last leaver left keys"
    second = nodes.rounds([b], timeout=20)
    assert_round_ok(second, 1, 1)
    assert one(second).round == 1, "a job started on an emptied run counts from round 1"
    with pytest.raises(RendezvousStateError, match="has left"):
        a.next_round()


# ============================================================================ 11. rank policies


def test_natural_rank_policy(nodes):
    settings = nodes.settings(min_nodes=4, max_nodes=4, rank_policy="natural")
    hosts = {"w": "node10", "x": "node9", "y": "node1", "z": "node2"}
    ns = [nodes.node(n, settings, host=h) for n, h in hosts.items()]
    results = nodes.rounds(ns, timeout=20)
    assert_round_ok(results, 4, 4)
    assert one(results).participants == ["y", "z", "x", "w"]  # node1, node2, node9, node10


def test_topology_rank_policy(nodes):
    spec = {  # node: (host, zone, rack)
        "p": ("h1", "zone-b", "r1"),
        "q": ("h2", "zone-a", "r10"),
        "r": ("h3", "zone-a", "r2"),
        "s": ("h0", "zone-a", "r2"),
    }
    ns = []
    for node_id, (host, zone, rack) in spec.items():
        settings = nodes.settings(min_nodes=4, max_nodes=4, rank_policy="topology",
                                  topology_keys=("zone", "rack"),
                                  node_meta={"zone": zone, "rack": rack})
        ns.append(nodes.node(node_id, settings, host=host))
    results = nodes.rounds(ns, timeout=20)
    assert_round_ok(results, 4, 4)
    assert one(results).participants == ["s", "r", "q", "p"]  # hosts h0, h3, h2, h1


def test_explicit_rank_policy_and_duplicate_ranks(nodes):
    def explicit(rank):
        return nodes.settings(min_nodes=3, max_nodes=3, rank_policy="explicit", node_rank=rank)

    ns = [nodes.node("a", explicit(2)), nodes.node("b", explicit(0))]
    pending = nodes.start(ns)
    wait_for(lambda: {"a", "b"} <= set(nodes.members()), 5, "a and b wait")
    dup = nodes.node("dup", explicit(0))
    with pytest.raises(RendezvousStateError) as info:
        nodes.rounds([dup], timeout=10)
    assert "b" in str(info.value).split() and "dup" in str(info.value).split()
    assert "dup" not in nodes.members()
    pending.update(nodes.start([nodes.node("c", explicit(1))]))
    results = nodes.gather(pending, timeout=20)
    assert_round_ok(results, 3, 3)
    assert ranks_of(results) == {"a": 2, "b": 0, "c": 1}


def test_stable_rank_policy_survivor_keeps_rank_newcomer_fills_the_hole(nodes):
    settings = nodes.settings(min_nodes=3, max_nodes=3)
    ns = {i: nodes.node(i, settings) for i in "abc"}
    first = nodes.rounds(ns.values(), timeout=20)
    assert_round_ok(first, 3, 3)
    by_rank = {r.rank: node for node, r in first.items()}
    assert ns[by_rank[1]].leave()
    survivors = [ns[by_rank[0]], ns[by_rank[2]]]
    newcomer = nodes.node("d", settings)
    second = nodes.rounds([*survivors, newcomer], timeout=20)
    assert_round_ok(second, 3, 3)
    assert ranks_of(second) == {by_rank[0]: 0, by_rank[2]: 2, "d": 1}


# ============================================================================ 12. service


def test_service_instance_is_visible_in_consul_and_leave_cleans_up(nodes):
    settings = nodes.settings(min_nodes=1, max_nodes=1, node_meta={"zone": "z1"})
    node = nodes.node("a", settings, host="host-a")

    def instance():
        entries = nodes.admin.health_service(settings.service, passing=True).data
        mine = [e for e in entries if e["Service"]["ID"] == node.service_id]
        return mine[0] if mine else None

    result = one(nodes.rounds([node], timeout=20))
    entry = wait_for(lambda: (e := instance()) and e["Service"]["Meta"].get("round") == "1" and e,
                     5, "service meta shows the round")
    meta = entry["Service"]["Meta"]
    assert meta["run_id"] == nodes.run_id and meta["node_id"] == "a"
    assert meta["host"] == "host-a" and meta["zone"] == "z1"
    assert meta["rank"] == str(result.rank) and meta["state"] == "training"
    assert meta["world_size"] == "1"
    store = endpoint_for("a")
    assert meta["store"] == f"{store['host']}:{store['port']}"
    assert all(check["Status"] == "passing" for check in entry["Checks"])
    # what an operator filters on and reads in the UI, in the catalog (not only on the agent)
    service = entry["Service"]
    assert service["Address"] == "host-a"
    assert service["Port"] == store["port"], "rank 0 shows the trainer store it hosts"
    assert {"consul-rdzv", f"run-{nodes.run_id}", "state-training", "rank-0"} \
        <= set(service["Tags"])
    ours = [c for c in entry["Checks"] if c["CheckID"] == node.check_id]
    assert ours and ours[0]["Notes"] == "round 1 · rank 0/1 · training", ours

    session = node.session_id
    assert node.leave()
    wait_for(lambda: instance() is None, 5, "the service is deregistered")
    assert not nodes.admin.health_service(settings.service, passing=False).data
    assert "a" not in nodes.members()
    assert nodes.admin.session_info(session) is None


# ============================================================================ 13. no requests


def test_num_nodes_waiting_makes_no_consul_request(nodes):
    # a long heartbeat interval (10 s) keeps the background threads quiet during the count
    settings = nodes.settings(min_nodes=1, max_nodes=1, heartbeat_timeout=30.0)
    node = nodes.node("a", settings)
    one(nodes.rounds([node], timeout=20))
    wait_for(lambda: any(e["Service"]["Meta"].get("round") == "1" for e in
                         nodes.admin.health_service(settings.service).data),
             5, "the heartbeat published the round (its last request for a while)")
    before = node.client.requests_sent
    values = [node.num_nodes_waiting() for _ in range(100)]
    after = node.client.requests_sent
    assert after == before
    assert values == [0] * 100


# ============================================================================ 14. join timeout


def test_join_timeout_says_how_many_nodes_were_present(nodes):
    settings = nodes.settings(min_nodes=3, max_nodes=3, join_timeout=1.5)
    ns = [nodes.node(i, settings) for i in "ab"]
    started = time.monotonic()
    pending = nodes.start(ns)
    counts = []
    for node_id, future in pending.items():
        with pytest.raises(RendezvousTimeoutError) as info:
            future.result(timeout=15)
        found = re.search(r"(\d+) of min_nodes 3 nodes were present \(([^)]*)\)", str(info.value))
        assert found, str(info.value)
        present = found.group(2).split(", ")
        assert int(found.group(1)) == len(present) and node_id in present
        assert set(present) <= {"a", "b"}
        counts.append(len(present))
    took = time.monotonic() - started
    # the first node to give up saw both (a node withdraws only after its message is written)
    assert max(counts) == 2, counts
    assert 1.5 <= took < 6
    assert not nodes.members(), "nodes that gave up withdrew their member keys"
    assert nodes.leader() is None, "a node that gave up released the coordinator role"


def test_timed_out_node_does_not_hold_back_later_rounds(nodes):
    impatient = nodes.node("impatient", nodes.settings(min_nodes=2, max_nodes=2,
                                                       join_timeout=1.0))
    with pytest.raises(RendezvousTimeoutError):
        nodes.rounds([impatient], timeout=10)
    # it gave up, but its process lives on: it must neither coordinate nor be a candidate
    settings = nodes.settings(min_nodes=2, max_nodes=2, join_timeout=15.0)
    results = nodes.rounds([nodes.node("x", settings), nodes.node("y", settings)],
                           timeout=20)
    assert_round_ok(results, 2, 2)
    assert "impatient" not in one(results).participants


# ============================================================================ names


@pytest.mark.parametrize("node_id", [".", "..", "a/b", "a b", "x" * 161])
def test_bad_node_ids_are_refused(node_id):
    settings = RendezvousSettings(run_id="r")
    with pytest.raises(ValueError, match="node id"):
        ConsulRendezvous(settings, node_id=node_id)


def test_dotted_names_keep_every_key_inside_the_run_prefix(nodes):
    settings = nodes.settings(key_prefix=f"{nodes.prefix}/v1.0/...", min_nodes=2,
                              max_nodes=2)
    ns = [nodes.node(i, settings) for i in ("a.1", "...")]
    results = nodes.rounds(ns, timeout=20)
    assert_round_ok(results, 2, 2)
    ours = [k for k in nodes.admin.kv_keys("") if nodes.prefix in k]
    history = f"{settings.key_prefix}/~history/{settings.run_id}/"
    assert sorted(k for k in ours if not k.startswith(history)) == sorted(
        f"{settings.prefix}/{k}" for k in ("members/a.1", "members/...", "round/leader",
                                           "round/current"))
    # the round history: H/<job>/..., beside the run's prefix, inside the key prefix
    assert sorted(k[len(history):].split("/", 1)[1] for k in ours if k.startswith(history)) \
        == ["rounds/0000000001", "totals"]


def test_session_is_created_if_the_check_went_critical_before_it(agent, prefix):
    """A slow agent can let the fresh TTL check expire before the session request is served."""
    settings = RendezvousSettings(run_id="slow-agent", key_prefix=prefix, heartbeat_timeout=2)
    node = ConsulRendezvous(settings, agent.client(), node_id="slow")
    registration = node.registration
    node.client.agent_service_register(registration.definition())
    node.client.agent_check_update(node.check_id, "fail")
    try:
        session = registration._create_session(time.monotonic() + 10)
        info = node.client.session_info(session)
        assert info is not None
        assert [c["ID"] for c in info.get("ServiceChecks") or []] == [node.check_id]
        node.client.session_destroy(session)
    finally:
        node.client.agent_service_deregister(node.service_id)
