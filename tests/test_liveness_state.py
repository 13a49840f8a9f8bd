"""The liveness state machine of a node (consul_rdzv/liveness.py), without Consul: every
transition, what each refuses, and that ``on_lost`` fires once per loss, outside the lock."""

from __future__ import annotations

import threading

import pytest

from consul_rdzv.liveness import Liveness, State


def machine():
    calls: list[str] = []
    live = Liveness(on_lost=calls.append)
    return live, calls


def test_starts_unregistered_and_is_held_with_a_session():
    live, calls = machine()
    assert live.state is State.UNREGISTERED and not live.out and live.session is None
    assert live.held("s1")
    assert live.state is State.HELD and live.session == "s1" and not live.out
    assert calls == []


def test_a_suspicion_is_out_but_not_confirmed_and_consul_can_clear_it():
    live, calls = machine()
    live.held("s1")
    assert live.suspect("passes failed for the TTL")
    assert live.out and not live.confirmed and live.reason == "passes failed for the TTL"
    assert not live.suspect("again"), "already suspected"
    assert not live.clear("s0"), "a clearance for another session changes nothing"
    assert live.clear("s1")
    assert live.state is State.HELD and live.reason == ""
    assert calls == [], "a suspicion never ends a round"


def test_a_loss_on_consul_s_word_fires_on_lost_once():
    live, calls = machine()
    live.held("s1")
    assert live.lose("its member key vanished")
    assert live.confirmed and live.state is State.LOST
    assert not live.lose("its check is gone"), "already lost"
    assert calls == ["its member key vanished"]


def test_a_suspicion_confirmed_by_consul_fires_on_lost():
    live, calls = machine()
    live.held("s1")
    live.suspect("late passes")
    assert live.lose("its session is gone")
    assert live.state is State.LOST and live.reason == "its session is gone"
    assert calls == ["its session is gone"]


def test_news_of_an_old_session_changes_nothing():
    live, calls = machine()
    live.held("s1")
    live.lose("gone")
    live.held("s2")
    assert not live.lose("a late 404 about s1", session="s1")
    assert live.state is State.HELD and live.session == "s2"
    assert live.lose("s2 gone", session="s2")
    assert calls == ["gone", "s2 gone"]


def test_a_new_session_after_a_loss_holds_again():
    live, _ = machine()
    live.held("s1")
    live.lose("gone")
    assert live.held("s2")
    assert live.state is State.HELD and not live.out and live.session == "s2"


@pytest.mark.parametrize("end", ["replaced", "refuse"])
def test_replaced_and_refused_are_for_good(end):
    live, calls = machine()
    live.held("s1")
    error = RuntimeError("stop")
    assert (live.replaced("a newer process", error) if end == "replaced"
            else live.refuse(error))
    assert live.out and live.confirmed and live.error is error
    assert not live.held("s2"), "no registration after the end"
    assert not live.lose("x") and not live.suspect("x") and not live.clear("s1")
    assert not live.replaced("again", error) and not live.refuse(error)
    assert len(calls) == 1, "the round ends once"


def test_an_end_before_any_registration_ends_no_round():
    live, calls = machine()
    assert live.refuse(RuntimeError("several agents"))
    assert calls == []


def test_closed_ignores_everything_late():
    live, calls = machine()
    live.held("s1")
    live.close()
    assert live.state is State.CLOSED and not live.out
    assert not live.lose("a late pass failure") and not live.suspect("x")
    assert not live.held("s2") and not live.refuse(RuntimeError())
    assert calls == []


def test_on_lost_runs_outside_the_lock():
    """A listener that reads the machine (as the node does when it ends its round) must not
    deadlock."""
    seen = []
    live = Liveness(on_lost=lambda reason: seen.append((reason, live.state)))
    live.held("s1")
    done = threading.Event()
    threading.Thread(target=lambda: (live.lose("gone"), done.set())).start()
    assert done.wait(5)
    assert seen == [("gone", State.LOST)]


def test_concurrent_losses_fire_once():
    live, calls = machine()
    live.held("s1")
    threads = [threading.Thread(target=live.lose, args=(f"r{i}",)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
