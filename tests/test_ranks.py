"""Pure logic, no Consul: rank policies (ranks.py), the coordinator's and the watch's decisions
(planning.py: plan_round, count_waiting, round_broken, active_participants, the round size limit)
on hand-built run states, and the member value's encoding (layout.py)."""

from __future__ import annotations

import json

import pytest

from consul_rdzv.client import KVEntry
from consul_rdzv.layout import FORMAT_VERSION, Member, Round, RunState
from consul_rdzv.planning import (
    MAX_TXN_BYTES,
    MemberView,
    active_participants,
    count_waiting,
    largest_world,
    plan_round,
    round_broken,
    round_bytes,
)
from consul_rdzv.ranks import Candidate, NotReady, assign, explicit_prefix, natural_key, select
from consul_rdzv.service import incarnation_tag
from consul_rdzv.settings import RendezvousSettings

# ----------------------------------------------------------------------------- helpers


def member(node: str, created: int, modified: int | None = None, **kwargs) -> Member:
    kwargs.setdefault("host", f"host-{node}")
    kwargs.setdefault("pid", 1)
    return Member(node=node, create_index=created,
                  modify_index=created if modified is None else modified, **kwargs)


def state(members: list[Member], current: Round | None = None) -> RunState:
    return RunState(members={m.node: m for m in members}, round=current,
                    leader_session="s-leader")


def settings(min_nodes: int, max_nodes: int, **kwargs) -> RendezvousSettings:
    kwargs.setdefault("last_call_timeout", 10.0)
    return RendezvousSettings(run_id="r", min_nodes=min_nodes, max_nodes=max_nodes, **kwargs)


def waiting(s: RunState, current: Round, max_nodes: int, **kwargs) -> int:
    """count_waiting as the training watch of a participant of ``current`` computes it."""
    views = {n: MemberView(m.modify_index, m.rank) for n, m in s.members.items()}
    cfg = settings(1, max_nodes, **kwargs)
    return count_waiting(views, list(current.ranks), current.members_index, cfg)


def cand(node: str, join: int, **kwargs) -> Candidate:
    return Candidate(node=node, host=kwargs.pop("host", node), join_order=join, **kwargs)


# ----------------------------------------------------------------------------- natural_key


def test_natural_key_orders_digits_as_numbers():
    hosts = ["node10", "node9", "node1", "node100", "node2", "gpu-b", "gpu-a"]
    assert sorted(hosts, key=natural_key) == [
        "gpu-a", "gpu-b", "node1", "node2", "node9", "node10", "node100"]
    assert natural_key("a2b9x") < natural_key("a2b10") < natural_key("a10b1")
    assert natural_key("") == ()
    assert sorted(["10", "9", "x"], key=natural_key) == ["9", "10", "x"]  # numbers first


# ----------------------------------------------------------------------------- select


def test_select_takes_survivors_by_old_rank_then_newcomers_by_join_order():
    cands = [cand("new2", 50), cand("old1", 5), cand("new1", 40), cand("old0", 9)]
    previous = {"old0": 0, "old1": 1}
    assert [c.node for c in select(cands, previous, 10)] == ["old0", "old1", "new1", "new2"]
    assert [c.node for c in select(cands, previous, 3)] == ["old0", "old1", "new1"]
    assert [c.node for c in select(cands, {}, 2)] == ["old1", "old0"]


def test_select_explicit_takes_the_first_asker_of_each_rank_within_max_nodes():
    cands = [cand("late-dup", 30, rank=0), cand("a", 10, rank=0), cand("b", 20, rank=1),
             cand("too-high", 5, rank=3), cand("no-rank", 1)]
    chosen = select(cands, {}, 3, "explicit")
    assert [(c.node, c.rank) for c in chosen] == [("a", 0), ("b", 1)]


def test_select_explicit_stops_at_the_first_rank_nobody_asked_for():
    cands = [cand("a", 10, rank=0), cand("b", 20, rank=1), cand("d", 30, rank=3)]
    assert [c.node for c in select(cands, {}, 5, "explicit")] == ["a", "b"]
    assert select([cand("x", 1, rank=1)], {}, 5, "explicit") == []
    assert explicit_prefix([3, 0, 1]) == [0, 1]
    assert explicit_prefix([]) == []


# ----------------------------------------------------------------------------- assign


def test_assign_stable_keeps_ranks_below_the_world_size_and_fills_holes():
    # old ranks: a0 b1 c2 d3; b left, e new -> world 4: a, c, d keep; e fills 1
    selected = [cand("a", 1), cand("c", 3), cand("d", 4), cand("e", 9)]
    previous = {"a": 0, "b": 1, "c": 2, "d": 3}
    assert assign(selected, previous) == ["a", "e", "c", "d"]
    # world 3 (d's old rank 3 is out of range): survivors fill holes before newcomers
    selected = [cand("a", 1), cand("d", 4), cand("e", 9)]
    assert assign(selected, previous) == ["a", "d", "e"]
    # no previous round: join order
    assert assign([cand("x", 7), cand("y", 2)], {}) == ["y", "x"]


def test_assign_natural_sorts_hosts_then_node_ids():
    selected = [cand("n1", 1, host="node10"), cand("n2", 2, host="node9"),
                cand("b", 3, host="node2"), cand("a", 4, host="node2")]
    assert assign(selected, {"n1": 0}, "natural") == ["a", "b", "n2", "n1"]


def test_assign_topology_sorts_by_meta_values_then_host():
    selected = [
        cand("p", 1, host="h1", meta={"zone": "b", "rack": "r1"}),
        cand("q", 2, host="h2", meta={"zone": "a", "rack": "r10"}),
        cand("r", 3, host="h3", meta={"zone": "a", "rack": "r2"}),
        cand("s", 4, host="h0", meta={"zone": "a", "rack": "r2"}),
        cand("t", 5, host="h9", meta={}),  # no meta: sorts first
    ]
    assert assign(selected, {}, "topology", ("zone", "rack")) == ["t", "s", "r", "q", "p"]


def test_assign_explicit_needs_exactly_ranks_zero_to_w_minus_one():
    assert assign([cand("a", 1, rank=1), cand("b", 2, rank=0)], {}, "explicit") == ["b", "a"]
    with pytest.raises(NotReady, match=r"\[1\]"):
        assign([cand("a", 1, rank=0), cand("b", 2, rank=2)], {}, "explicit")


def test_assign_rejects_an_unknown_policy():
    with pytest.raises(ValueError, match="unknown rank policy 'random'"):
        assign([cand("a", 1)], {}, "random")


# ----------------------------------------------------------------------------- active_participants


def test_active_participants_are_alive_and_have_not_asked_for_a_new_round():
    current = Round(round=3, ranks=["a", "b", "c", "d"], members_index=100)
    s = state([member("a", 10, 90), member("b", 11, 120), member("d", 12, 100)], current)
    # a: active; b: rewrote its key after the seal; c: gone; d: written at the snapshot index
    assert active_participants(s) == ["a", "d"]
    assert active_participants(state([member("a", 1)])) == []
    closed_only = Round(closed={"reason": "x"})
    assert active_participants(state([member("a", 1)], closed_only)) == []


# ----------------------------------------------------------------------------- plan_round


def test_plan_waits_while_a_participant_of_the_round_is_still_in_it():
    current = Round(round=1, ranks=["a", "b"], members_index=100)
    s = state([member("a", 10, 150), member("b", 11, 50)], current)
    plan = plan_round(s, settings(1, 2), now=1000.0, quorum_since=None)
    assert plan.seal is None and plan.quorum_since is None  # no last call runs meanwhile
    assert "b" in plan.reason and "round 1" in plan.reason


def test_plan_waits_below_min_nodes():
    plan = plan_round(state([member("a", 10)]), settings(2, 4), now=1000.0, quorum_since=None)
    assert plan.seal is None and plan.quorum_since is None
    assert "1 of min_nodes 2" in plan.reason


def test_plan_seals_a_full_round_at_once():
    s = state([member("c", 30), member("a", 10), member("b", 20)])
    plan = plan_round(s, settings(2, 3), now=1000.0, quorum_since=None)
    assert plan.seal == ["a", "b", "c"]


def test_plan_seals_at_most_max_nodes_survivors_first():
    current = Round(round=1, ranks=["b", "a"], members_index=100)
    s = state([member("a", 10, 110), member("b", 20, 120), member("c", 5, 130)], current)
    plan = plan_round(s, settings(1, 2), now=1000.0, quorum_since=None)
    assert plan.seal == ["b", "a"]  # c joined first but the survivors keep their places


def test_plan_fast_reseal_when_nobody_new_waits():
    current = Round(round=4, ranks=["a", "b", "c"], members_index=100)
    s = state([member("a", 10, 110), member("c", 12, 120)], current)  # b is gone
    plan = plan_round(s, settings(2, 4), now=1000.0, quorum_since=None)
    assert plan.seal == ["a", "c"]


def test_plan_last_call_when_someone_new_and_room_left():
    current = Round(round=1, ranks=["a", "b"], members_index=100)
    members = [member("a", 10, 110), member("b", 11, 111), member("new", 105)]
    cfg = settings(2, 4, last_call_timeout=5.0)
    plan = plan_round(state(members, current), cfg, now=1000.0, quorum_since=None)
    assert plan.seal is None and plan.quorum_since == 1000.0
    assert "last call" in plan.reason
    plan = plan_round(state(members, current), cfg, now=1004.9, quorum_since=1000.0)
    assert plan.seal is None and plan.quorum_since == 1000.0
    plan = plan_round(state(members, current), cfg, now=1005.0, quorum_since=1000.0)
    assert plan.seal == ["a", "b", "new"] and plan.quorum_since == 1000.0


def test_plan_first_round_below_max_waits_for_the_last_call():
    cfg = settings(2, 4, last_call_timeout=5.0)
    s = state([member("a", 10), member("b", 11)])
    assert plan_round(s, cfg, now=1.0, quorum_since=None).seal is None
    assert plan_round(s, cfg, now=6.0, quorum_since=1.0).seal == ["a", "b"]


def test_plan_explicit_waits_for_missing_ranks_and_names_the_gap():
    cfg = settings(2, 3, rank_policy="explicit", node_rank=0)
    s = state([member("a", 10, rank=0), member("b", 11, rank=2)])
    plan = plan_round(s, cfg, now=1000.0, quorum_since=0.0)
    assert plan.seal is None
    assert "rank 1 has no node, so rank(s) 2 cannot be placed" in plan.reason
    s = state([member("a", 10, rank=2), member("b", 11, rank=0), member("c", 12, rank=1)])
    assert plan_round(s, cfg, now=1000.0, quorum_since=None).seal == ["b", "c", "a"]


def test_plan_explicit_seals_the_ranks_before_a_gap_without_a_last_call():
    # round 1 ran with ranks 0, 1; both came back and d asks for rank 3 (nobody asks for 2):
    # the round re-seals at once with 0 and 1, and d keeps waiting.
    cfg = settings(2, 4, rank_policy="explicit", node_rank=0, last_call_timeout=30.0)
    current = Round(round=1, ranks=["a", "b"], members_index=100)
    s = state([member("a", 10, 110, rank=0), member("b", 11, 111, rank=1),
               member("d", 105, rank=3)], current)
    assert plan_round(s, cfg, now=1000.0, quorum_since=None).seal == ["a", "b"]


def test_plan_after_close_marker_without_round_is_a_first_round():
    s = state([member("a", 10), member("b", 11)], Round(closed={"reason": "x"}))
    cfg = settings(1, 3, last_call_timeout=5.0)
    plan = plan_round(s, cfg, now=1.0, quorum_since=None)
    assert plan.seal is None and plan.quorum_since == 1.0 and "last call" in plan.reason
    assert plan_round(s, cfg, now=5.9, quorum_since=1.0).seal is None
    assert plan_round(s, cfg, now=6.0, quorum_since=1.0).seal == ["a", "b"]


# ----------------------------------------------------------------------------- count_waiting


def test_count_waiting_is_zero_while_everyone_is_in_the_round():
    current = Round(round=1, ranks=["a", "b"], members_index=100)
    s = state([member("a", 10, 90), member("b", 11, 100)], current)
    assert waiting(s, current, max_nodes=3) == 0


def test_count_waiting_counts_gone_participants_even_when_full():
    current = Round(round=1, ranks=["a", "b"], members_index=100)
    s = state([member("a", 10, 90)], current)
    assert waiting(s, current, max_nodes=2) == 1


def test_count_waiting_counts_a_participant_asking_for_a_new_round():
    current = Round(round=1, ranks=["a", "b"], members_index=100)
    s = state([member("a", 10, 90), member("b", 11, 140)], current)
    assert waiting(s, current, max_nodes=2) == 1


def test_count_waiting_ignores_a_spare_beside_a_full_round():
    current = Round(round=1, ranks=["a", "b"], members_index=100)
    members = [member("a", 10, 90), member("b", 11, 95), member("spare", 130)]
    assert waiting(state(members, current), current, max_nodes=2) == 0
    assert waiting(state(members, current), current, max_nodes=3) == 1


def test_count_waiting_gone_participant_makes_room_for_the_spare():
    current = Round(round=1, ranks=["a", "b"], members_index=100)
    members = [member("a", 10, 90), member("spare", 130)]
    assert waiting(state(members, current), current, max_nodes=2) == 2


def test_count_waiting_explicit_ignores_a_rank_beyond_a_gap_until_the_gap_is_filled():
    kwargs = {"rank_policy": "explicit", "node_rank": 0}
    current = Round(round=1, ranks=["a", "b"], members_index=100)
    running = [member("a", 10, 90, rank=0), member("b", 11, 95, rank=1)]
    # d asks for rank 3 while nobody asks for 2: it cannot be placed, the round goes on
    s = state([*running, member("d", 130, rank=3)], current)
    assert waiting(s, current, max_nodes=4, **kwargs) == 0
    # c asks for rank 2: now both can be placed
    s = state([*running, member("d", 130, rank=3), member("c", 140, rank=2)], current)
    assert waiting(s, current, max_nodes=4, **kwargs) == 2
    # a second node asking for a rank in use is refused at its join: never counted
    s = state([*running, member("dup", 150, rank=1)], current)
    assert waiting(s, current, max_nodes=4, **kwargs) == 0


def test_round_broken_names_gone_and_rewritten_participants():
    views = {"a": MemberView(90), "b": MemberView(140), "x": MemberView(150)}
    assert round_broken(views, ["a", "b", "c"], 100) == ["b", "c"]
    assert round_broken(views, ["a"], 100) == []


# ----------------------------------------------------------------------------- member value


def _entry(value: bytes) -> KVEntry:
    return KVEntry(key="p/r/members/a", value=value, create_index=7, modify_index=9,
                   lock_index=1, flags=0, session="s-a")


def test_member_value_round_trips_without_a_nonce():
    written = Member(node="a", host="h", pid=3, want=2, meta={"zone": "z1"},
                     incarnation="i-1", started=5.0, min_nodes=1, max_nodes=4)
    assert "nonce" not in json.loads(written.encode())
    read = Member.decode(_entry(written.encode()))
    assert read == written
    assert (read.create_index, read.modify_index, read.session) == (7, 9, "s-a")


def test_member_value_of_an_older_release_with_a_nonce_still_decodes():
    older = {"v": FORMAT_VERSION, "node": "a", "host": "h", "pid": 3, "want": 0, "rank": None,
             "endpoint": None, "meta": {}, "nonce": "0f" * 16, "incarnation": "i-1",
             "started": 5.0, "min_nodes": 1, "max_nodes": 4}
    read = Member.decode(_entry(json.dumps(older).encode()))
    assert read == Member(node="a", host="h", pid=3, incarnation="i-1", started=5.0,
                          min_nodes=1, max_nodes=4)


# ----------------------------------------------------------------------------- round size


def test_round_size_estimate_bounds_the_real_document():
    import json

    from consul_rdzv.client import txn_kv

    ids = [f"{'n' * 150}-{i:05d}" for i in range(1000)]
    doc = Round(round=7, ranks=ids, store={"host": "h", "port": 1},
                members_index=123456, coordinator=ids[0], seal_id="f" * 32, first_join=1e9,
                quorum_at=1e9, sealed_at=1e9, min_nodes=1000, max_nodes=1000,
                incarnations=[incarnation_tag("0123456789abcdef" * 2)] * 1000).encode()
    prefix = "p" * 200
    ops = [txn_kv("check-session", f"{prefix}/round/leader", session="s" * 36),
           txn_kv("cas", f"{prefix}/round/current", value=doc, index=999999)]
    real = len(json.dumps(ops))
    estimate = round_bytes(1000, max(map(len, ids)), len(prefix))
    assert real <= estimate < real * 1.1


def test_largest_world_fits_and_one_more_does_not():
    for id_len in (160, 30, 1):
        fits = largest_world(id_len)
        assert round_bytes(fits, id_len) <= MAX_TXN_BYTES
        assert round_bytes(fits + 2, id_len) > MAX_TXN_BYTES
    assert 2000 < largest_world(160) < 2200  # 160-character ids: about 2,100 nodes
    assert largest_world(30, 12) > 4500  # the default node ids: far beyond real jobs
