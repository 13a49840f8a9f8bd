"""The fault campaign (verify/): its seeded schedule, its invariant checks on hand-built
records (each violation kind is caught), a short campaign on a real cluster (slow), and the
lost-seal-answer stall the campaign found, reproduced deterministically on a dev agent.

The campaign found two product bugs, fixed since and each reproduced below by a deterministic
test: a coordinator that stalled for ``join_timeout`` when the answer to its seal was lost
(``leader_kill_at_seal`` provokes it), and a replaced process that returned its replacement's
round (``worker_replace`` provokes it). The rounds now name each rank's incarnation.
"""

from __future__ import annotations

import itertools
import time

import pytest
from rdzv_nodes import wait_for

from consul_rdzv.client import ConsulClient
from consul_rdzv.errors import ConsulUnavailableError, RendezvousReplacedError
from consul_rdzv.layout import Leader
from verify.campaign import CampaignConfig
from verify.campaign_node import endpoint_for
from verify.checks import check_invariants, check_missed_rounds
from verify.report import summary
from verify.run import run_campaign
from verify.schedule import KINDS, SERVER_KINDS, fault_schedule, schedule_digest

# ------------------------------------------------------------------------------- schedule


def test_fault_schedule_is_identical_for_a_seed_and_differs_between_seeds():
    first = list(itertools.islice(fault_schedule(42), 200))
    again = list(itertools.islice(fault_schedule(42), 200))
    other = list(itertools.islice(fault_schedule(43), 200))
    assert first == again
    assert schedule_digest(first) == schedule_digest(again) != schedule_digest(other)
    assert {s.kind for s in first} == set(KINDS)
    assert [s.index for s in first] == list(range(200))
    assert all(b.at > a.at for a, b in itertools.pairwise(first))


def test_fault_schedule_never_plans_overlapping_server_faults():
    specs = list(itertools.islice(fault_schedule(7), 500))
    servers = [s for s in specs if s.kind in SERVER_KINDS]
    assert len(servers) > 20
    for a, b in itertools.pairwise(servers):
        assert b.at >= a.at + a.duration, (a, b)


def test_fault_schedule_draws_only_the_kinds_asked_for():
    specs = list(itertools.islice(fault_schedule(1, kinds={"worker_freeze_short": 1.0}), 50))
    assert {s.kind for s in specs} == {"worker_freeze_short"}
    with pytest.raises(ValueError, match="unknown fault kinds"):
        next(fault_schedule(1, kinds={"meteor": 1.0}))


# ------------------------------------------------------------------------------- invariants

ENDPOINTS = {1: endpoint_for("a", 1), 2: endpoint_for("b", 2), 3: endpoint_for("c", 3),
             4: endpoint_for("a", 4)}
NODE_OF = {1: "a", 2: "b", 3: "c", 4: "a"}


def seal(number: int, ranks: list[str], *, serials: dict[str, int] | None = None,
         seal_id: str | None = None, **changes) -> dict:
    serials = serials or {"a": 1, "b": 2, "c": 3}
    value = {"round": number, "ranks": ranks,
             "store": endpoint_for(ranks[0], serials[ranks[0]]), "members_index": 10 * number,
             "coordinator": ranks[0], "seal_id": seal_id or f"s{number}"}
    value.update(changes)
    return value


def report(value: dict, node: str, serial: int, **changes) -> dict:
    ranks = value["ranks"]
    event = {"event": "round", "serial": serial, "node_id": node, "round": value["round"],
             "rank": ranks.index(node) if node in ranks else 0, "world_size": len(ranks),
             "participants": ranks, "store": value["store"],
             "members_index": value["members_index"], "coordinator": value["coordinator"],
             "seal_id": value["seal_id"]}
    event.update(changes)
    return event


def consul(*values: dict) -> list[dict]:
    return [{"recv": float(i), "modify_index": 100 + i, "value": v}
            for i, v in enumerate(values)]


def kinds(reports: list[dict], values: list[dict], max_nodes: int = 3) -> list[str]:
    return sorted(v["kind"] for v in check_invariants(
        reports, values, ENDPOINTS, NODE_OF, min_nodes=2, max_nodes=max_nodes))


def test_check_invariants_accepts_consistent_rounds():
    r1, r2 = seal(1, ["a", "b", "c"]), seal(2, ["b", "a"])
    reports = [report(r1, n, s) for n, s in (("a", 1), ("b", 2), ("c", 3))]
    reports += [report(r2, "a", 1), report(r2, "b", 2)]
    assert kinds(reports, consul(r1, r2)) == []


def _case(case: str) -> tuple[list[dict], list[dict], int]:
    """(reports, consul values, max_nodes) of a run with one violation of the named kind."""
    r1 = seal(1, ["a", "b"])
    reports = [report(r1, "a", 1), report(r1, "b", 2)]
    values = consul(r1)
    if case == "ranks":  # a node twice in the rank list
        return [], consul(seal(1, ["a", "a"])), 3
    if case == "wrong rank":
        reports[1]["rank"] = 0
    elif case == "world_size":
        return [], consul(seal(1, ["a", "b", "c"])), 2
    elif case == "store_endpoint":  # nobody advertised it
        return [], consul(seal(1, ["a", "b"], store={"host": "elsewhere", "port": 1})), 3
    elif case == "stale store":  # a's process p4 is rank 0 but the round has p1's endpoint
        return [report(r1, "a", 4)], [], 3
    elif case == "disagreement":
        reports[1]["members_index"] = 99
    elif case == "sealed_twice":
        values = consul(r1, seal(1, ["b", "a"], seal_id="other"))
    elif case == "round_not_increasing":
        reports.append(report(r1, "a", 1))
    elif case == "not_a_participant":
        reports.append(report(r1, "c", 3))
    elif case == "node_twice_in_round":
        r1 = seal(1, ["b", "a"])
        return [report(r1, "b", 2), report(r1, "a", 1), report(r1, "a", 4)], consul(r1), 3
    elif case == "round_went_back":
        return [], consul(r1, seal(3, ["a", "b"]), seal(2, ["a", "b"])), 3
    elif case == "run_closed":
        values = consul(r1, {**r1, "closed": {"reason": "x", "at": 1, "by": "a"}})
    return reports, values, 3


@pytest.mark.parametrize(("case", "expected"), [
    ("ranks", "ranks"), ("wrong rank", "ranks"), ("world_size", "world_size"),
    ("store_endpoint", "store_endpoint"), ("stale store", "store_endpoint"),
    ("disagreement", "disagreement"), ("sealed_twice", "sealed_twice"),
    ("round_not_increasing", "round_not_increasing"), ("not_a_participant", "not_a_participant"),
    ("node_twice_in_round", "node_twice_in_round"), ("round_went_back", "round_went_back"),
    ("run_closed", "run_closed"),
])
def test_check_invariants_reports_each_kind_of_violation(case, expected):
    reports, values, max_nodes = _case(case)
    assert set(kinds(reports, values, max_nodes)) == {expected}


def _missed(case: str) -> list[dict]:
    """check_missed_rounds on node a (process 1, incarnation i1), which announced at t=10
    (ModifyIndex 50); round 3, sealed from index 55 and listing it, is readable from t=11."""
    history = {"a": [(10.0, 50, "i1")]}
    value = {"round": 3, "ranks": ["b", "a"], "members_index": 55, "sealed_at": 10.9,
             "coordinator": "a"}
    reports = [{"serial": 2, "round": 3, "recv": 11.1}]
    unavailable: dict[int, list[tuple[float, float]]] = {1: [(0.0, 5.0)]}
    if case == "reported":
        reports.append({"serial": 1, "round": 3, "recv": 11.2})
    elif case == "reported a later round":
        reports.append({"serial": 1, "round": 4, "recv": 25.0})
    elif case == "reported too late":
        reports.append({"serial": 1, "round": 3, "recv": 40.0})
    elif case == "older write":  # the round was sealed before this write
        value["members_index"] = 45
    elif case == "rewritten":  # the node lost its session and announced again
        history["a"].append((20.0, 70, "i1"))
    elif case == "deleted at its timeout":  # after the window
        history["a"].append((41.0, None, None))
    elif case == "other incarnation":
        history["a"] = [(10.0, 50, "i9")]
    elif case == "not listed":
        value["ranks"] = ["b", "c"]
    elif case == "frozen":
        unavailable[1].append((9.0, 15.0))
    elif case == "killed":
        unavailable[1].append((20.0, float("inf")))
    elif case == "records end":
        return check_missed_rounds([{"recv": 11.0, "value": value}], history, {"i1": 1},
                                   reports, unavailable, until=30.0)
    return check_missed_rounds([{"recv": 11.0, "value": value}], history, {"i1": 1}, reports,
                               unavailable, until=100.0)


@pytest.mark.parametrize("case", ["unreported", "reported too late", "deleted at its timeout"])
def test_check_missed_rounds_flags_a_round_its_node_did_not_return(case):
    assert [(v["kind"], v["round"], v["evidence"]["serial"]) for v in _missed(case)] == [
        ("own_round_missed", 3, 1)]


@pytest.mark.parametrize("case", ["reported", "reported a later round", "older write",
                                  "rewritten", "other incarnation", "not listed", "frozen",
                                  "killed", "records end"])
def test_check_missed_rounds_accepts_a_round_not_meant_for_it_or_not_missed(case):
    assert _missed(case) == []


# ------------------------------------------------------------------------------- the campaign


@pytest.mark.slow
@pytest.mark.cluster  # it starts a cluster of its own: scheduled first (conftest.py)
def test_short_campaign_on_a_cluster_keeps_every_invariant(tmp_path):
    cfg = CampaignConfig(seed=20261203, rounds=50, gap=(1.5, 4.0), kinds=dict(KINDS),
                         max_seconds=300.0, stall_timeout=60.0)
    started = time.monotonic()
    report_ = run_campaign(cfg)
    text = summary(report_)
    print(text)
    print(f"[figure] short campaign: {time.monotonic() - started:.0f}s")
    violations = report_["violations"]
    assert violations["count"] == 0, text
    assert report_["rounds"]["sealed"] >= 50, text
    assert len(report_["faults"]["by_kind"]) >= 4, text
    assert report_["faults"]["injected"] >= 10, text
    assert report_["converged"] is not None, text
    assert not report_["unexpected_exits"], report_["unexpected_exits"]
    assert not [e for e in report_["errors"].values() if not e["typed"]], report_["errors"]


# ------------------------------------------------------------------------------- found by it


class SealAnswerLost(ConsulClient):
    """Consul commits the first seal transaction, then its answer is lost (as when the Raft
    leader dies between the commit and its reply: the client agent answers 500 and the client
    retries): what ``leader_kill_at_seal`` provokes on a cluster."""

    lost = 0

    def _request(self, method, path, **kwargs):
        resp = super()._request(method, path, **kwargs)
        raw = kwargs.get("raw") or b""
        if (method == "PUT" and path == "/v1/txn" and not self.lost and b'"cas"' in raw
                and b"round/current" in raw):
            self.lost += 1
            raise ConsulUnavailableError("the answer to the seal was lost (test)")
        return resp


def test_coordinator_returns_its_round_if_the_answer_to_its_seal_is_lost(agent, nodes):
    settings = nodes.settings(min_nodes=2, max_nodes=2, join_timeout=8.0)
    lossy = SealAnswerLost(agent.config(), retry_timeout=settings.consul_timeout)
    a = nodes.node("a", settings, client=lossy)
    b = nodes.node("b", settings)
    pending = nodes.start([a])
    wait_for(lambda: (nodes.leader() or Leader("", "", 0)).node == "a", 10, "a coordinating")
    pending.update(nodes.start([b]))
    results = nodes.gather(pending, timeout=15)
    assert lossy.lost == 1
    assert results["a"].seal_id == results["b"].seal_id


def test_replaced_waiter_never_returns_its_replacements_round(nodes):
    settings = nodes.settings(min_nodes=3, max_nodes=3, join_timeout=20.0)
    coordinator = nodes.node("c", settings)
    pending = nodes.start([coordinator])
    wait_for(nodes.leader, 10, "a coordinator")
    old = nodes.node("x", settings)  # then blocked in its wait for round 1 (2 of 3 nodes)
    old_result = nodes.start([old])["x"]
    wait_for(lambda: "x" in nodes.members(), 10, "x waiting")
    new = nodes.node("x", settings)  # same node id and host, newer incarnation: takes over
    pending["x"] = nodes.start([new])["x"]

    def holder() -> str | None:  # one read: the key vanishes between old and new
        member = nodes.members().get("x")
        return member.incarnation if member else None

    wait_for(lambda: holder() == new.incarnation.id, 10, "the new x holding the member key")
    wait_for(lambda: old.registration.lost, 10, "the old x noticing that its session is gone")
    pending.update(nodes.start([nodes.node("d", settings)]))
    results = nodes.gather(pending, timeout=15)
    assert results["x"].participants == results["c"].participants
    with pytest.raises(RendezvousReplacedError):  # it stops (docs/protocol.md)
        got = old_result.result(timeout=15)
        pytest.fail(f"the replaced process returned round {got.round} as rank {got.rank}, "
                    f"the round of its replacement (seal {got.seal_id}, the same as "
                    f"{results['x'].seal_id})")
