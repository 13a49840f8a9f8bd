"""Node health gates who trains (docs/health.md): a node whose Consul node has a critical
node-level check that counts (``health_checks``), or is in maintenance, is held out of rounds,
says why (its log, ``consul-rdzv status``), and is admitted again once healthy; while it trains
the same takes it out of its round at once (``health_evict``).

The pure judgement (which checks count, the reason text, the coordinator's and the watch's
counting) is unit-tested here without Consul. Everything about Consul's checks runs on the
cluster harness: a dev agent is one Consul node shared by every node of a test, so node health
needs nodes on separate client agents (each its own Consul node).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from rdzv_nodes import Cluster, figure, stays, wait_for

from consul_rdzv.client import ConsulClient, KVEntry
from consul_rdzv.config import ConsulConfig
from consul_rdzv.health import MAINTENANCE_CHECK, MIN_GAP, counts, judge_health, parse_health_checks
from consul_rdzv.layout import Member, Round, RunState
from consul_rdzv.planning import MemberView, count_waiting, plan_round
from consul_rdzv.rendezvous import ConsulRendezvous
from consul_rdzv.settings import RendezvousSettings, settings_from_conf
from consul_rdzv.testing import consul_binary

# ---------------------------------------------------------------------------- the judgement


def check(check_id: str, status: str = "critical", *, name: str = "", service: str = "",
          output: str = "", notes: str = "") -> dict:
    return {"CheckID": check_id, "Name": name or check_id, "Status": status,
            "ServiceID": service, "Output": output, "Notes": notes}


SERF = check("serfHealth", "passing", name="Serf Health Status")


def test_by_default_every_node_check_but_serf_health_counts_and_no_service_check():
    assert counts(check("gpu"), ())
    assert counts(check("disk", name="Disk space"), ())
    assert not counts(check("serfHealth"), ())
    assert not counts(check("run-a-node-1:ttl:abcd1234", service="run-a-node-1"), ())
    assert not counts(check("web", service="web-1"), ())
    assert not counts(check(MAINTENANCE_CHECK), ())  # maintenance is judged on its own


def test_patterns_match_the_check_id_or_its_name_and_serf_health_only_when_named():
    patterns = ("gpu-*", "NIC link")
    assert counts(check("gpu-ecc"), patterns)
    assert counts(check("nic", name="NIC link"), patterns)
    assert not counts(check("disk"), patterns)
    assert not counts(check("serfHealth"), patterns)
    assert counts(check("serfHealth"), ("serf*",))


def test_the_reason_names_maintenance_with_its_note_and_each_critical_check_with_its_output():
    assert judge_health([SERF, check("gpu", "passing")], ()) == ""
    assert judge_health([SERF, check("gpu", "warning", output="hot")], ()) == ""
    maint = check(MAINTENANCE_CHECK, name="Node Maintenance Mode", notes="swap PSU")
    assert judge_health([SERF, maint], ()) == 'node in maintenance: "swap PSU"'
    assert judge_health([SERF, maint], ("gpu",)) == 'node in maintenance: "swap PSU"'
    gpu = check("gpu", output="ECC errors on GPU 3\nsecond line")
    assert judge_health([gpu, maint, check("disk", output="")], ()) == (
        'node in maintenance: "swap PSU"; check disk critical; '
        'check gpu critical: "ECC errors on GPU 3"')
    assert judge_health([gpu], ("nic",)) == ""
    assert judge_health([gpu, maint], None) == ""  # gating off
    long = judge_health([check("gpu", output="x" * 500)], ())
    assert len(long) < 160 and long.endswith('..."')
    assert judge_health([check(MAINTENANCE_CHECK)], ()) == 'node in maintenance: "no reason given"'


def test_health_checks_setting_parses_patterns_off_and_refuses_mixtures():
    assert parse_health_checks("gpu-*:nic") == ("gpu-*", "nic")
    assert parse_health_checks("gpu nic;disk") == ("gpu", "nic", "disk")
    assert parse_health_checks("off") is None and parse_health_checks("OFF") is None
    assert settings_from_conf("j", 1, 1, {"health_checks": "gpu-*"}).health_checks == ("gpu-*",)
    assert settings_from_conf("j", 1, 1, {"health_checks": "off"}).health_checks is None
    assert settings_from_conf("j", 1, 1, {}).health_checks == ()
    assert settings_from_conf("j", 1, 1, {"health_evict": "false"}).health_evict is False
    with pytest.raises(ValueError, match="health_checks"):
        parse_health_checks("gpu:off")
    with pytest.raises(ValueError, match="health_evict"):
        settings_from_conf("j", 1, 1, {"health_evict": "maybe"})
    with pytest.raises(ValueError, match="health_checks"):
        RendezvousSettings(run_id="j", health_checks=("gpu", ""))


def _member(node: str, index: int, health: str = "") -> Member:
    return Member(node=node, host=node, pid=1, incarnation=node, health=health,
                  create_index=index, modify_index=index)


def _state(members: list[Member], current: Round | None = None) -> RunState:
    return RunState(members={m.node: m for m in members}, round=current)


def test_the_coordinator_admits_no_held_out_member_nor_counts_it_toward_min_nodes():
    settings = RendezvousSettings(run_id="j", min_nodes=2, max_nodes=3)
    held = _member("c", 12, 'node in maintenance: "swap PSU"')
    plan = plan_round(_state([_member("a", 10), _member("b", 11), held]), settings, 130.0, 90.0)
    assert plan.seal == ["a", "b"]  # the last call ran out without c
    plan = plan_round(_state([_member("a", 10), held]), settings, 100.0, None)
    assert plan.seal is None
    assert "1 of min_nodes 2" in plan.reason and 'c: node in maintenance: "swap PSU"' in plan.detail
    # a survivor held out after the round: the others re-seal at once (nobody new)
    current = Round(round=3, ranks=["a", "b", "c"], store=None,
                    members_index=20)
    state = _state([_member("a", 21), _member("b", 22), _member("c", 23, "check gpu critical")],
                   current)
    assert plan_round(state, settings, 100.0, None).seal == ["a", "b"]


def test_a_training_node_counts_no_held_out_newcomer_as_waiting():
    settings = RendezvousSettings(run_id="j", min_nodes=1, max_nodes=3)
    members = {"a": MemberView(5), "b": MemberView(6), "c": MemberView(9, healthy=False)}
    assert count_waiting(members, ["a", "b"], 8, settings) == 0
    members["c"] = MemberView(10)
    assert count_waiting(members, ["a", "b"], 8, settings) == 1
    # a participant held out (its rewrite) breaks the round like any rewrite
    members = {"a": MemberView(5), "b": MemberView(12, healthy=False)}
    assert count_waiting(members, ["a", "b"], 8, settings) == 1


def test_member_health_round_trips_and_an_older_value_without_it_is_healthy():
    m = _member("a", 1, "check gpu critical")
    entry = KVEntry(key="p/members/a", value=m.encode(), create_index=1, modify_index=1,
                    lock_index=0, flags=0, session=None)
    assert Member.decode(entry).health == "check gpu critical"
    old = b'{"v": 1, "node": "a", "host": "a", "pid": 1}'
    assert Member.decode(KVEntry(key="p/members/a", value=old, create_index=1, modify_index=1,
                                 lock_index=0, flags=0, session=None)).health == ""



def test_nodes_of_a_process_on_one_agent_share_one_health_query(nodes):
    """One Consul node, one query: the nodes of a process that talk to the same agent share the
    blocking query on their node's health (each judges it with its own settings); it ends with
    the last of them."""
    settings = nodes.settings(min_nodes=2, max_nodes=2)
    first = nodes.node("n0", settings)
    second = nodes.node("n1", settings.with_(health_checks=("gpu-*",)))
    nodes.rounds([first, second], 30)
    assert first.health is not None and second.health is not None
    shared = first.health._watch
    assert shared is not None and shared is second.health._watch
    assert first.health.node == second.health.node != ""
    assert first.health_reason() == second.health_reason() == ""
    first.leave()
    assert not shared._stopped.is_set()
    second.leave()
    assert shared._stopped.is_set()


def test_a_burst_of_other_services_on_the_node_is_read_in_a_few_answers_a_second(nodes):
    """Nodes that talk to one agent share its Consul node: each registration or republish of
    their services wakes the health query. The query asks for the node-level checks only, and
    after two answers within MIN_GAP it pauses, so that a burst of 120 registrations costs a
    few answers a second, not one per registration; the node stays admitted throughout."""
    node = nodes.node("n0", nodes.settings(min_nodes=1, max_nodes=1))
    node.register(timeout=30)
    assert node.health is not None
    wait_for(lambda: node.health.queries > 0, 15, "the first health answer")
    client = node.client
    ids = [f"burst-{uuid.uuid4().hex[:8]}-{i}" for i in range(120)]
    before = node.health.queries
    began = time.monotonic()
    try:
        for service_id in ids:
            client.agent_service_register({"ID": service_id, "Name": "burst",
                                           "Check": {"CheckID": service_id, "TTL": "1h",
                                                     "Status": "critical"}})
        spent = time.monotonic() - began
        answers = node.health.queries - before
        bound = 3 * spent / MIN_GAP + 5
        figure(f"health answers during {len(ids)} registrations in {spent:.2f} s: {answers} "
               f"(bound {bound:.0f})")
        assert answers <= bound, (answers, spent)
        assert node.health_reason() == ""  # service checks never hold a node out
    finally:
        for service_id in ids:
            client.agent_service_deregister(service_id)


def test_the_health_watch_sees_a_node_check_past_its_query_wait_and_after_the_index_went_back(
        fresh_agent, fresh_nodes, tmp_path):
    """The node-checks query with a 1 s wait: its answers time out unchanged again and again and
    the node stays admitted; a snapshot restore then sends the checks index below the watch's;
    the watch starts over, and a node-level check that fails afterwards still holds the node
    out at once, and its pass lets it in again."""
    node = fresh_nodes.node("n0", fresh_nodes.settings(min_nodes=1, max_nodes=1,
                                                       watch_wait=1.0))
    node.register(timeout=30)
    assert node.health is not None
    wait_for(lambda: node.health.queries > 0, 15, "the first health answer")
    first = node.health.queries
    wait_for(lambda: node.health.queries >= first + 3, 15, "three answers past the query wait")
    assert node.health_reason() == ""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), **fresh_agent.env()}
    binary = consul_binary()

    def consul(*args: str) -> None:
        proc = subprocess.run([binary, *args], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)

    client = node.client
    path = f"/v1/health/node/{node.health.node}"
    snapshot = tmp_path / "agent.snap"
    consul("snapshot", "save", str(snapshot))
    checks = NodeChecks(fresh_agent).register()  # a node-level check (an operator's script)
    check_id = checks.check_id
    wait_for(lambda: any(c.get("CheckID") == check_id
                         for c in client.read_with_headers(path)[0].data or []),
             15, "the node check in the catalog")
    before = client.read_with_headers(path)[0].index
    consul("snapshot", "restore", str(snapshot))
    after = client.read_with_headers(path)[0].index
    assert after < before, f"the checks index did not go backwards: {before} -> {after}"
    try:
        checks.fail("ECC errors on GPU 3")
        wait_for(lambda: check_id in node.health_reason(), 15,
                 "the failing node check holds the node out after the restore")
        assert "ECC errors on GPU 3" in node.health_reason()
        checks.pass_()
        wait_for(lambda: node.health_reason() == "", 15, "the passing check lets it in again")
    finally:
        checks.remove()


# ---------------------------------------------------------------------------- on real agents
#
# Two nodes, each on its own client agent (its own Consul node): ``a`` on client 0, ``b`` on
# client 1, whose health the tests change. Rounds take 1-2 nodes.


def client_of(member, settings: RendezvousSettings) -> ConsulClient:
    return ConsulClient(ConsulConfig.resolve(address=member.url, env={}),
                        retry_timeout=settings.consul_timeout)


def api_ok(member, method: str, path: str, body: dict | None = None) -> None:
    status, answer = member.api(method, path, body)
    assert status == 200, (method, path, status, answer)


class NodeChecks:
    """A node-level TTL check on an agent (a cluster's client agent or a dev agent), as an
    operator's GPU script would register it, and its maintenance mode; both removed at the end
    (a cluster is shared)."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.check_id = f"gpu-{uuid.uuid4().hex[:8]}"

    def register(self, status: str = "passing") -> NodeChecks:
        api_ok(self.agent, "PUT", "/v1/agent/check/register",
               {"ID": self.check_id, "Name": "GPU health", "TTL": "1h", "Status": status})
        return self

    def fail(self, output: str) -> None:
        api_ok(self.agent, "PUT", f"/v1/agent/check/fail/{self.check_id}?note="
               + output.replace(" ", "+"))

    def pass_(self) -> None:
        api_ok(self.agent, "PUT", f"/v1/agent/check/pass/{self.check_id}")

    def maintenance(self, on: bool, reason: str = "") -> None:
        api_ok(self.agent, "PUT", f"/v1/agent/maintenance?enable={'true' if on else 'false'}"
               + (f"&reason={reason.replace(' ', '+')}" if reason else ""))

    def remove(self) -> None:
        self.agent.api("PUT", "/v1/agent/maintenance?enable=false")
        self.agent.api("PUT", f"/v1/agent/check/deregister/{self.check_id}")


@pytest.fixture
def node_checks(cluster):
    checks = NodeChecks(cluster.clients[1])
    yield checks
    checks.remove()


def pair(nodes: Cluster, cluster, **b_settings) -> tuple[ConsulRendezvous, ConsulRendezvous]:
    settings = nodes.settings(min_nodes=1, max_nodes=2, heartbeat_timeout=10.0)
    a = nodes.node("a", settings, client=client_of(cluster.clients[0], settings))
    b_conf = settings.with_(**b_settings)
    b = nodes.node("b", b_conf, client=client_of(cluster.clients[1], b_conf))
    for node in (a, b):
        node.register(timeout=30)
    return a, b


def status_of(cluster, nodes: Cluster) -> tuple[dict, str]:
    env = {**os.environ, "CONSUL_HTTP_ADDR": cluster.clients[0].url}
    args = [sys.executable, "-m", "consul_rdzv.cli", "status", nodes.run_id, "--key-prefix",
            nodes.prefix]
    doc = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True,
                                    timeout=120, env=env, check=True).stdout)
    text = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env,
                          check=True).stdout
    return doc, text


def test_a_node_in_maintenance_is_not_admitted_says_why_and_joins_once_it_is_over(
        cluster, cluster_nodes, node_checks, caplog):
    caplog.set_level(logging.INFO, logger="consul_rdzv")
    node_checks.maintenance(True, "swap PSU")
    a, b = pair(cluster_nodes, cluster)
    held = 'node in maintenance: "swap PSU"'
    wait_for(lambda: b.health_reason() == held, 15, "b sees its node in maintenance")
    futures = cluster_nodes.start([a, b])
    first = futures["a"].result(30)
    assert first.participants == ["a"]
    assert not futures["b"].done()
    wait_for(lambda: cluster_nodes.members().get("b") is not None, 15, "b's member key")
    assert cluster_nodes.members()["b"].health == held
    # it says why: in its log, and in consul-rdzv status
    assert any(held in r.getMessage() and "b" in r.getMessage() for r in caplog.records)
    doc, text = status_of(cluster, cluster_nodes)
    assert doc["held_out"] == {"b": held}, doc
    (row,) = [r for r in doc["nodes"] if r["node"] == "b"]
    assert row["state"] == "held out" and row["held_out"] == held, row
    assert f"b: {held}" in text, text
    # a held-out node restarts nobody
    stays(lambda: a.num_nodes_waiting() == 0, 2.0, "a trains on beside the held-out b")
    assert not futures["b"].done()
    node_checks.maintenance(False)
    wait_for(lambda: a.num_nodes_waiting() == 1, 15, "a sees b waiting once healthy")
    second = cluster_nodes.rounds([a], 30)["a"]
    assert sorted(second.participants) == ["a", "b"]
    assert futures["b"].result(30).round == second.round
    assert cluster_nodes.members()["b"].health == ""


def test_a_check_turning_critical_while_training_evicts_the_node_and_the_others_reform(
        cluster, cluster_nodes, node_checks):
    node_checks.register("passing")
    a, b = pair(cluster_nodes, cluster)
    wait_for(lambda: b.health is not None and b.health.queries > 0, 15, "b's health read")
    both = cluster_nodes.rounds([a, b], 30)
    assert sorted(both["a"].participants) == ["a", "b"]
    started = time.monotonic()
    node_checks.fail("ECC errors on GPU 3")
    wait_for(lambda: a.num_nodes_waiting() >= 1, 15, "a sees b leave its round")
    seen = time.monotonic() - started
    assert b.health is not None
    judged = b.health.changed_at - started
    futures = cluster_nodes.start([a, b])
    alone = futures["a"].result(30)
    reformed = time.monotonic() - started
    assert alone.participants == ["a"] and alone.round > both["a"].round
    assert b.health_reason() == (f'check {node_checks.check_id} critical: '
                                 '"ECC errors on GPU 3"')
    assert not futures["b"].done()
    figure(f"health eviction: the evicted node judged its check critical {judged * 1000:.0f} ms, "
           f"the survivor saw the round over {seen * 1000:.0f} ms and trained again "
           f"{reformed * 1000:.0f} ms after the check was failed on the agent")
    node_checks.pass_()
    wait_for(lambda: a.num_nodes_waiting() == 1, 15, "a sees b waiting once healthy")
    again = cluster_nodes.rounds([a], 30)["a"]
    assert sorted(again.participants) == ["a", "b"]
    assert futures["b"].result(30).round == again.round


def test_with_eviction_off_a_node_whose_check_turns_critical_trains_on(
        cluster, cluster_nodes, node_checks, caplog):
    caplog.set_level(logging.INFO, logger="consul_rdzv")
    node_checks.register("passing")
    a, b = pair(cluster_nodes, cluster, health_evict=False)
    both = cluster_nodes.rounds([a, b], 30)
    assert sorted(both["a"].participants) == ["a", "b"]
    before = cluster_nodes.members()["b"].modify_index
    node_checks.fail("ECC errors on GPU 3")
    wait_for(lambda: b.health_reason() != "", 15, "b sees its check critical")
    stays(lambda: a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0, 2.0,
          "both train on")
    assert cluster_nodes.members()["b"].modify_index == before
    assert any("keeps training (health_evict is off)" in r.getMessage() for r in caplog.records)
    # its next round holds it out (admission still applies)
    futures = cluster_nodes.start([a, b])
    assert futures["a"].result(30).participants == ["a"]
    assert not futures["b"].done()




def test_a_node_in_maintenance_is_admitted_to_none_of_100_rounds(cluster, cluster_nodes,
                                                                  node_checks):
    node_checks.maintenance(True, "swap PSU")
    a, b = pair(cluster_nodes, cluster)
    wait_for(lambda: b.health_reason() != "", 15, "b sees its node in maintenance")
    waiting = cluster_nodes.start([b])
    worlds = []
    started = time.monotonic()
    for _ in range(100):
        worlds.append(cluster_nodes.rounds([a], 30)["a"].participants)
    took = time.monotonic() - started
    assert worlds == [["a"]] * 100
    assert not waiting["b"].done()
    figure(f"node in maintenance admitted to 0 of 100 rounds ({took / 100 * 1000:.0f} ms per "
           "round of the other node)")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_node_whose_check_turns_critical_leaves_and_the_other_trains_on(
        cluster, node_checks, prefix, run_id, tmp_path):
    """Through real torchrun: two agents train in a world of 2; the GPU check of node-b's host
    turns critical: node-a's workers restart in a world of 1 at once while node-b waits held
    out; the check passes again and both finish together in a world of 2."""
    from torchrun_jobs import TorchrunJob

    node_checks.register("passing")
    conf = {"key_prefix": prefix, "heartbeat_timeout": 5, "last_call_timeout": 1,
            "join_timeout": 200}
    with TorchrunJob(tmp_path, cluster.clients[0].address, run_id, nnodes="1:2",
                     rdzv_conf=conf, train_args=["--steps", "400", "--step-time", "0.05"]) as job:
        job.start("node-a")
        job.endpoint = cluster.clients[1].address
        evicted = job.start("node-b")
        job.wait_for(lambda: len(job.starts(world_size=2)) == 2, 150, "both training")
        failed = time.monotonic()
        node_checks.fail("ECC errors on GPU 3")
        job.wait_for(lambda: len(job.starts(world_size=1)) == 1, 60, "node-a training alone")
        alone = time.monotonic() - failed
        job.wait_for(lambda: "ECC errors on GPU 3" in evicted.log(), 30,
                     "node-b saying why it left")
        node_checks.pass_()
        job.wait_for(lambda: len(job.starts(world_size=2)) == 4, 150, "both again in world 2")
        codes = job.wait(200)
        report = job.report()
        assert codes == {"node-a": 0, "node-b": 0}, report
        results = job.results()
        assert {r["world_size"] for r in results} == {2}, report
        assert len({r["checksum"] for r in results}) == 1, report
    figure(f"torchrun: check failed on node-b's agent -> node-a's worker training again in a "
           f"world of 1 after {alone:.2f}s (worker restart included)")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_node_in_maintenance_is_held_out_then_joins_the_running_job(
        cluster, node_checks, prefix, run_id, tmp_path):
    """Real torchrun agents, one per client agent (host): the one whose host is in maintenance
    waits held out (saying why in its log) while the other trains alone; once maintenance
    ends, the training one restarts its workers and both finish in one world of 2."""
    from torchrun_jobs import TorchrunJob

    node_checks.maintenance(True, "swap PSU")
    conf = {"key_prefix": prefix, "heartbeat_timeout": 5, "last_call_timeout": 1,
            "join_timeout": 200}
    with TorchrunJob(tmp_path, cluster.clients[0].address, run_id, nnodes="1:2",
                     rdzv_conf=conf, train_args=["--steps", "300", "--step-time", "0.05"]) as job:
        job.start("node-a")
        job.endpoint = cluster.clients[1].address  # node-b talks to the host in maintenance
        held = job.start("node-b")
        job.wait_for(lambda: len(job.starts(world_size=1)) == 1, 150, "node-a training alone")
        job.wait_for(lambda: 'node in maintenance: "swap PSU"' in held.log(), 60,
                     "node-b saying why it is held out")
        stays(lambda: not job.starts(world_size=2), 2.0, "nobody admits node-b")
        node_checks.maintenance(False)
        job.wait_for(lambda: len(job.starts(world_size=2)) == 2, 150, "both training in world 2")
        codes = job.wait(200)
        report = job.report()
        assert codes == {"node-a": 0, "node-b": 0}, report
        results = job.results()
        assert [r["rank"] for r in results] == [0, 1], report
        assert {r["world_size"] for r in results} == {2}, report
        assert len({r["checksum"] for r in results}) == 1, report


# ---------------------------------------------------------------------------- docs/health.md

DOC = Path(__file__).resolve().parent.parent / "docs" / "health.md"


def doc_block(lang: str) -> str:
    (block,) = re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.DOTALL)
    return block


@pytest.mark.parametrize(("gpus", "rc", "code", "says"), [
    ("0, 0\n1, 0\n", 0, 0, "2 GPUs healthy"),
    ("0, 0\n1, [N/A]\n", 0, 0, "2 GPUs healthy"),
    ("0, 0\n1, 3\n", 0, 2, "GPU 1: 3 uncorrected ECC errors"),
    ("0, 0\n", 0, 2, "1 of 2 GPUs visible"),
    ("NVIDIA-SMI has failed\n", 9, 2, "nvidia-smi failed: NVIDIA-SMI has failed"),
])
def test_the_docs_gpu_check_script_judges_gpus_as_consul_reads_exit_codes(tmp_path, gpus, rc,
                                                                         code, says):
    script = tmp_path / "check-gpus"
    script.write_text(doc_block("sh"))
    script.chmod(0o755)
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nprintf '%s' '{gpus}'\nexit {rc}\n")
    fake.chmod(0o755)
    proc = subprocess.run([str(script)], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{fake.parent}:/usr/bin:/bin", "EXPECTED_GPUS": "2"})
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert says in proc.stdout.splitlines()[0], proc.stdout


@pytest.mark.consul  # runs the Consul binary (consul validate)
@pytest.mark.parametrize("lang", ["hcl", "json"])
def test_the_docs_check_registration_is_valid_agent_configuration(tmp_path, lang):
    from consul_rdzv.testing import consul_binary

    (tmp_path / f"gpu-check.{lang}").write_text(doc_block(lang))
    (tmp_path / "base.hcl").write_text(f'data_dir = "{tmp_path / "data"}"\n')
    proc = subprocess.run([str(consul_binary()), "validate", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Configuration is valid" in proc.stdout
