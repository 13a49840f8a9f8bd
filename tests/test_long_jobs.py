"""Jobs that run for days: no restart without a cause, a job's end is not a death, nothing left
behind, settings that agree, and the smaller findings of a read of the protocol.

Against real Consul agents (a dev agent, the cluster harness) and, where the launcher matters,
real ``torchrun`` agents. A healthy job is proven in seconds with a short ``watch_wait``: the
training watch's blocking queries then time out many times during a test, which is what a job
meets every 5 minutes with the default wait (the bug this file starts with restarted a healthy
one-node job at its first timeout, 5 min in). The 30-minute soak with the real wait is
``python -m bench.soak`` (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid

import pytest
from rdzv_nodes import (
    HB,
    Cluster,
    assert_round_ok,
    figure,
    one,
    stays,
    wait_for,
)
from torchrun_jobs import TorchrunJob

from consul_rdzv import cli
from consul_rdzv.client import ConsulClient, txn_kv
from consul_rdzv.config import ConsulConfig
from consul_rdzv.errors import RendezvousClosedError, RendezvousStateError
from consul_rdzv.layout import Drain, Round
from consul_rdzv.rendezvous import ConsulRendezvous
from consul_rdzv.settings import RendezvousSettings

#: The training watch's longest blocking query in these tests: many timeouts per test.
SHORT_WAIT = 1.0
JOB_TIMEOUT = 150


def watch_alive(node: ConsulRendezvous) -> bool:
    watch = node.standing.current_watch
    return watch is not None and not watch.stopped


def healthy_throughout(nodes_: list[ConsulRendezvous], window: float) -> int:
    """num_nodes_waiting() polled like torchrun's monitor loop (every 0.05-0.1 s) over
    ``window`` seconds: 0 on every node every time, and every watch still running. Returns how
    many blocking queries the watches made meanwhile."""
    before = sum(n.standing.current_watch.queries for n in nodes_)
    stays(lambda: all(n.num_nodes_waiting() == 0 and watch_alive(n) for n in nodes_), window,
          "a healthy round broke: " + "; ".join(
              f"{n.node_id}={n.num_nodes_waiting()} ({n.standing.broken_reason})" for n in nodes_))
    return sum(n.standing.current_watch.queries for n in nodes_) - before


# ============================================================== 1-2. a healthy job never restarts


@pytest.mark.parametrize("n", [1, 2, 32])
def test_healthy_round_outlives_many_watch_timeouts(nodes, n):
    """Nothing changes after the seal: every node's watch query times out again and again
    (watch_wait 1 s) and nobody ever counts a node waiting. With one node the leader key is
    always the last write before the seal, so the members prefix answers its timed-out query
    with an index below the round's members_index: what used to restart the job."""
    settings = nodes.settings(min_nodes=n, max_nodes=n, watch_wait=SHORT_WAIT)
    members = [nodes.node(f"n{i:02d}", settings) for i in range(n)]
    first = nodes.rounds(members, timeout=60)
    assert_round_ok(first, n, n)
    window = 6 * SHORT_WAIT
    queries = healthy_throughout(members, window)
    assert queries >= n * (window / SHORT_WAIT - 2), queries  # the queries did time out
    assert all(m.current_round.seal_id == one(first).seal_id for m in members)
    figure(f"N={n}: {queries} timed-out watch queries over {window:g}s, num_nodes_waiting() "
           "0 throughout")


def test_healthy_torchrun_job_trains_through_many_watch_timeouts(agent, prefix, run_id, tmp_path):
    """The user's report, as a user runs it: a one-node torchrun job, the watch's queries
    timing out every second: its worker starts once and the job ends with exit 0."""
    conf = {"key_prefix": prefix, "heartbeat_timeout": 5, "watch_wait": SHORT_WAIT,
            "last_call_timeout": 1}
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="1", rdzv_conf=conf,
                     max_restarts=3, train_args=["--steps", "160", "--step-time", "0.05"]) as job:
        job.start("node-0")
        codes = job.wait(JOB_TIMEOUT)
        report = job.report()
        assert codes == {"node-0": 0}, report
        assert len(job.starts()) == 1, f"the worker was restarted\n{report}"
        assert "is over for node" not in job.agents[0].log(), report
    figure(f"one-node torchrun job, {job.starts()[0]['time'] - job.agents[0].started:.1f}s to "
           "its start, trained with watch_wait 1 s: 1 worker start, exit 0")


@pytest.mark.parametrize("n", [1, 2, 32])
def test_healthy_round_on_the_cluster_outlives_many_watch_timeouts(cluster, cluster_nodes, n):
    """The same on the cluster harness: nodes on two client agents, stale reads from any
    server."""
    settings = cluster_nodes.settings(min_nodes=n, max_nodes=n, watch_wait=SHORT_WAIT,
                                      heartbeat_timeout=10.0, last_call_timeout=2.0)
    members = [cluster_nodes.node(f"n{i:02d}", settings, client=ConsulClient(
        ConsulConfig.resolve(address=cluster.clients[i % 2].url, env={}),
        retry_timeout=settings.consul_timeout)) for i in range(n)]
    for member in members:  # a registration on a loaded agent outlasts a short last call
        member.register(timeout=30)
    first = cluster_nodes.rounds(members, timeout=90)
    assert_round_ok(first, n, n)
    window = 6 * SHORT_WAIT
    queries = healthy_throughout(members, window)
    assert queries >= n * (window / SHORT_WAIT - 2), queries
    figure(f"cluster, N={n}: {queries} timed-out watch queries over {window:g}s, "
           "num_nodes_waiting() 0 throughout")


# ============================================================== 3. a job's end is not a death


def test_a_node_that_finished_and_left_is_not_a_death(nodes):
    """A node whose work succeeded closes the run as finished and leaves: the others' rounds
    go on (num_nodes_waiting() stays 0, their watch says the job finished), and each of them
    ends cleanly later."""
    settings = nodes.settings(min_nodes=3, max_nodes=3, watch_wait=SHORT_WAIT)
    a, b, c = (nodes.node(i, settings) for i in "abc")
    first = nodes.rounds([a, b, c], timeout=30)
    assert a.close_if_current(first["a"], "a's workers succeeded", outcome="finished")
    assert a.leave()
    wait_for(lambda: b.standing.finished is not None and c.standing.finished is not None, 5,
             "b and c see the job finished")
    stays(lambda: b.num_nodes_waiting() == c.num_nodes_waiting() == 0, 3 * SHORT_WAIT,
          "a finished node's departure made the others restart")
    assert b.standing.finished["by"] == "a"
    for node in (b, c):
        assert node.close_if_current(first[node.node_id], "done", outcome="finished")
        assert node.leave()
    assert nodes.admin.kv_keys(nodes.keys.prefix + "/") == [nodes.keys.round]


@pytest.mark.parametrize("outcome", ["failed", "closed"])
def test_a_node_that_closed_otherwise_and_left_ends_the_round(nodes, outcome):
    settings = nodes.settings(min_nodes=3, max_nodes=3, watch_wait=SHORT_WAIT)
    a, b, c = (nodes.node(i, settings) for i in "abc")
    first = nodes.rounds([a, b, c], timeout=30)
    assert a.close_if_current(first["a"], "a's workers failed", outcome=outcome)
    assert a.leave()
    wait_for(lambda: b.num_nodes_waiting() >= 1 and c.num_nodes_waiting() >= 1, 5,
             "b and c see the round over")
    with pytest.raises(RendezvousClosedError):
        b.next_round()


def test_participant_whose_workers_fail_after_the_job_finished_does_not_ask_for_a_round(nodes):
    """A finished run is never asked for a new round: the re-announcement of a node that
    trained in it is guarded by the round key's index, so it gets RendezvousClosedError
    without rewriting its key, and the others finish."""
    settings = nodes.settings(min_nodes=3, max_nodes=3, watch_wait=SHORT_WAIT)
    a, b, c = (nodes.node(i, settings) for i in "abc")
    first = nodes.rounds([a, b, c], timeout=30)
    before = nodes.admin.kv_get(nodes.keys.member("b")).data.modify_index
    assert a.close_if_current(first["a"], "done", outcome="finished")
    with pytest.raises(RendezvousClosedError):
        b.next_round()  # b's workers failed and torch restarts them
    assert "b" not in nodes.members() or \
        nodes.admin.kv_get(nodes.keys.member("b")).data.modify_index == before
    stays(lambda: c.num_nodes_waiting() == 0, 2 * SHORT_WAIT, "c was asked to restart")


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_node_that_finishes_long_before_the_others_lets_them_finish(agent, prefix, run_id,
                                                                     tmp_path):
    """torchrun, two nodes: after training, rank 0 works on alone for 8 s (a final evaluation)
    while the other node's agent gives up its exit barrier after 2 s (300 s in torch; lowered
    here), closes the run as finished and leaves. Rank 0's node does not take that for a death:
    its worker is never restarted, finishes its work, and both agents exit 0, as with c10d."""
    conf = {"key_prefix": prefix, "heartbeat_timeout": 5, "last_call_timeout": 1,
            "watch_wait": SHORT_WAIT}
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="2", rdzv_conf=conf,
                     max_restarts=3, exit_barrier=2.0,
                     train_args=["--steps", "20", "--final-work", "0:8"]) as job:
        job.start("node-0")
        job.start("node-1")
        codes = job.wait(JOB_TIMEOUT)
        report = job.report()
        assert codes == {"node-0": 0, "node-1": 0}, report
        events = job.progress()
        assert len(job.starts()) == 2, f"a worker was restarted\n{report}"
        assert [e["event"] for e in events if e["rank"] == 0][-1] == "final-done", report
        logs = "".join(a.log() for a in job.agents)
        assert "finished in round" in logs, report  # the finished node's departure, seen
        assert "RendezvousClosedError" not in logs, report
    figure("a node finishing 6 s past the others' exit barrier: 0 restarts, both agents exit 0")


# ============================================================== 4. nothing left behind


def everything_of(agent, prefix: str, run_ids: list[str]) -> list[str]:
    """What Consul still holds of these runs: keys, sessions, service instances, checks."""
    client = agent.client()
    try:
        left = list(client.kv_keys(prefix + "/"))
        sessions = client._call("GET", "/v1/session/list").json()
        left += [f"session {s['Name']}" for s in sessions
                 if any(r in s["Name"] for r in run_ids)]
        left += [f"service {s['ID']}" for s in client.agent_services().values()
                 if any(r in s["ID"] for r in run_ids)]
        left += [f"check {c}" for c in client.agent_checks() if any(r in c for r in run_ids)]
        left += [f"catalog {name}" for name in client._call("GET", "/v1/catalog/services").json()
                 if any(r in name for r in run_ids)]
        return left
    finally:
        client.close()


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_runs_that_ended_every_way_leave_nothing_in_consul(agent, prefix, tmp_path, capsys):
    """Short runs ended every way: success, SIGTERM of every node, every node failing its
    rendezvous (torchrun); a drained process that then died, SIGKILL of every node (real node
    processes). After Consul's own clean-up (sessions of dead nodes, their service instances
    after DeregisterCriticalServiceAfter, the finished runs' kept markers after
    closed_retention, their round histories after history_retention) and one ``consul-rdzv
    gc``, Consul's KV, sessions, catalog and checks hold nothing of any of them."""
    conf = {"key_prefix": prefix, "heartbeat_timeout": 2, "last_call_timeout": 1,
            "join_timeout": 60, "closed_retention": 10, "history_retention": 10}
    run_ids = [f"end{i}-{uuid.uuid4().hex[:6]}" for i in range(5)]
    for sub in ("killed", "drained"):
        (tmp_path / sub).mkdir()
    killed = Cluster(agent, prefix, tmp_path / "killed", run_id=run_ids[4])
    drained = Cluster(agent, prefix, tmp_path / "drained", run_id=run_ids[3])
    try:
        # SIGKILL of every node: first, Consul's clean-up takes longest
        procs = [killed.process(f"k{i}", min_nodes=2, max_nodes=2, heartbeat=HB)
                 for i in range(2)]
        for proc in procs:
            proc.result(timeout=30)
        for proc in procs:
            proc.kill()
        killed_at = time.monotonic()

        # a drained process that then died (its drain request was never consumed by it)
        d = drained.process("d0", min_nodes=1, max_nodes=1, heartbeat=HB)
        d.result(timeout=30)
        incarnation = drained.members()["d0"].incarnation
        drained.admin.kv_put(drained.keys.drain("d0"),
                             Drain(node="d0", incarnation=incarnation, by="test").encode())
        d.kill()

        # success, SIGTERM of every node, every node failing its rendezvous: torchrun
        with TorchrunJob(tmp_path / "ok", agent.address, run_ids[0], nnodes="2",
                         rdzv_conf=conf, train_args=["--steps", "5"]) as job:
            job.start("s0"), job.start("s1")
            assert job.wait(JOB_TIMEOUT) == {"s0": 0, "s1": 0}, job.report()
        with TorchrunJob(tmp_path / "term", agent.address, run_ids[1], nnodes="2",
                         rdzv_conf=conf, train_args=["--steps", "100000", "--step-time",
                                                     "0.05"]) as job:
            agents_ = [job.start("t0"), job.start("t1")]
            job.wait_for(lambda: len(job.starts()) == 2, JOB_TIMEOUT, "both ranks training")
            for a in agents_:
                a.signal(signal.SIGTERM)
            assert all(code not in (None, 0) for code in job.wait(60).values()), job.report()
        with TorchrunJob(tmp_path / "timeout", agent.address, run_ids[2], nnodes="3",
                         rdzv_conf={**conf, "join_timeout": 3},
                         train_args=["--steps", "5"]) as job:
            job.start("f0"), job.start("f1")
            assert all(code not in (None, 0) for code in job.wait(60).values()), job.report()

        # Consul's own clean-up of the dead: sessions with the TTL, then their keys
        wait_for(lambda: not killed.members() and not drained.members(), HB + 10,
                 "the killed nodes' sessions and keys gone")
        assert cli.main(["--key-prefix", prefix, "--address", agent.address,
                         "gc", "--older-than", "0", "--yes", "--history-retention", "10s"]) == 0
        gc_output = capsys.readouterr().out
        # service instances of the killed nodes: Consul deregisters them after 1 min critical
        wait_for(lambda: not everything_of(agent, prefix, run_ids), 150,
                 f"Consul holding nothing of the runs: {everything_of(agent, prefix, run_ids)}")
        figure(f"5 runs ended every way: nothing left in Consul "
               f"{time.monotonic() - killed_at:.0f}s after the first SIGKILL")
        assert run_ids[4] in gc_output or run_ids[3] in gc_output, gc_output
    finally:
        killed.shutdown()
        drained.shutdown()


# ============================================================== 5. settings agree or fail clearly


def test_run_id_none_is_refused_naming_rdzv_id():
    with pytest.raises(ValueError, match="--rdzv-id") as info:
        RendezvousSettings(run_id="none")
    assert "one Consul serves many jobs" in str(info.value)


@pytest.mark.slow
def test_torchrun_without_rdzv_id_fails_at_once_naming_it(agent, prefix, tmp_path):
    with TorchrunJob(tmp_path, agent.address, "none", nnodes="1",
                     rdzv_conf={"key_prefix": prefix}, train_args=["--steps", "5"]) as job:
        job.start("node-0")
        codes = job.wait(60)
        assert codes["node-0"] not in (0, None), job.report()
        assert "--rdzv-id" in job.agents[0].log(), job.report()


def test_nodes_with_different_nnodes_agree_on_the_room_of_the_round(nodes, caplog):
    """b (--nnodes 2:2) coordinates; a runs with 2:4. A spare c beside the full round (the
    round's max_nodes is 2) is counted by nobody, so the job is not restarted again and again;
    a says once that the coordinator's settings decide."""
    b = nodes.node("b", nodes.settings(min_nodes=2, max_nodes=2, watch_wait=SHORT_WAIT))
    pending = nodes.start([b])
    wait_for(lambda: nodes.leader() is not None, 10, "b coordinating")
    a = nodes.node("a", nodes.settings(min_nodes=2, max_nodes=4, watch_wait=SHORT_WAIT))
    first = nodes.gather({**pending, **nodes.start([a])}, timeout=30)
    assert one(first).max_nodes == 2 and one(first).world_size == 2
    spare = nodes.node("c", nodes.settings(min_nodes=2, max_nodes=4))
    nodes.start([spare])
    wait_for(lambda: "c" in nodes.members(), 10, "the spare waiting")
    stays(lambda: a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0, 3 * SHORT_WAIT,
          "a node judged the room by its own max_nodes")
    assert any("the coordinator's settings decide the rounds" in r.getMessage()
               for r in caplog.records)


# ============================================================== 6. the smaller findings


class GatedClient(ConsulClient):
    """A real client whose watch queries (``?keys``) and/or service registrations wait at a
    gate the test opens: to make two changes land in one watch answer, or a meta publish be in
    flight when leave() runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = 0
        self.gated: set[str] = set()

    def _wait(self, what: str) -> None:
        if what in self.gated and not self.gate.is_set():
            self.waiting += 1
            self.gate.wait(30)

    def kv_keys_query(self, *args, **kwargs):
        self._wait("keys")
        return super().kv_keys_query(*args, **kwargs)

    def agent_service_register(self, *args, **kwargs):
        self._wait("register")
        return super().agent_service_register(*args, **kwargs)


def gated(agent, settings: RendezvousSettings) -> GatedClient:
    return GatedClient(ConsulConfig.resolve(address=agent.url, env={}),
                       retry_timeout=settings.consul_timeout)


@pytest.mark.long
def test_a_rewrite_and_a_spare_leaving_in_one_watch_answer_end_the_round(agent, nodes):
    """(a) b asks for a new round while a spare leaves, both before a's watch asks again: the
    answer's names only show the spare gone. a reads the values and sees b's rewrite."""
    settings = nodes.settings(min_nodes=2, max_nodes=2, watch_wait=30.0)
    client = gated(agent, settings)
    a = nodes.node("a", settings, client=client)
    b = nodes.node("b", settings)
    first = nodes.rounds([a, b], timeout=30)
    assert_round_ok(first, 2, 2)
    spare = nodes.node("spare", settings)
    spare_join = nodes.start([spare])
    wait_for(lambda: "spare" in nodes.members(), 10, "the spare's key")
    wait_for(lambda: a.standing.current_watch.reads >= 1 and a.num_nodes_waiting() == 0, 10,
             "a's watch read the spare's value")
    client.gated.add("keys")
    client.gate.clear()
    wait_for(lambda: client.waiting >= 1, 40, "a's next watch query at the gate")
    spare.leave()
    spare_join["spare"].cancel()
    asking = nodes.start([b])
    members_index = one(first).members_index
    wait_for(lambda: nodes.members()["b"].modify_index > members_index, 10, "b's rewrite")
    client.gate.set()
    wait_for(lambda: a.num_nodes_waiting() >= 1, 5, "a sees b ask for a new round")
    second = nodes.gather({**asking, **nodes.start([a])}, timeout=30)
    assert_round_ok(second, 2, 2)


def test_a_coordinator_stopped_by_a_close_or_a_drain_releases_the_leader_key(nodes):
    """(b) the coordinator's next_round() ends with RendezvousClosedError (the run closed, or
    it was drained) while its process lives on: the leader key is released, so a re-run has a
    coordinator."""
    settings = nodes.settings(min_nodes=3, max_nodes=3)
    coord = nodes.node("coord", settings)
    pending = nodes.start([coord])
    wait_for(lambda: nodes.leader() is not None and nodes.leader().node == "coord", 10,
             "coord coordinating")
    nodes.node("closer", settings).close("operator")
    with pytest.raises(RendezvousClosedError):
        pending["coord"].result(timeout=10)
    assert nodes.leader() is None, "a closed coordinator kept the leader key"
    assert not coord.left

    # drained: the coordinator of a one-node run announces itself again and finds the request
    drained = Cluster(nodes.agent, nodes.prefix, nodes.log_dir)
    try:
        d = drained.node("d", drained.settings(min_nodes=1, max_nodes=1))
        drained.rounds([d], timeout=20)
        assert drained.leader().node == "d"
        drained.admin.kv_put(drained.keys.drain("d"), Drain(node="d", by="test").encode())
        with pytest.raises(RendezvousClosedError, match="drained"):
            d.next_round()
        assert drained.leader() is None, "a drained coordinator kept the leader key"
        assert not d.left
    finally:
        drained.shutdown()


def test_a_replaced_process_thawed_does_not_take_the_service_back(agent, nodes):
    """(e) x trains with y; x is frozen just after its round returned (its meta publish still
    due); a new process with x's node id takes over and forms a round with y; x is thawed: its
    publish does not re-register the service (which would remove its replacement's check and
    invalidate its session), and the new round goes on."""
    ttl = 10.0  # the freeze stays within the TTL: only the agent's registration tells
    x1 = nodes.process("x", min_nodes=2, max_nodes=2, heartbeat=ttl)
    y = nodes.process("y", min_nodes=2, max_nodes=2, heartbeat=ttl)
    x1.result(timeout=30)
    x1.freeze()
    frozen_at = time.monotonic()
    y.result(timeout=30)
    x2 = nodes.process("x", min_nodes=2, max_nodes=2, heartbeat=ttl)
    wait_for(lambda: y.send("waiting") or (y.event(10) or {}).get("value", 0) >= 1, 20,
             "y sees the old x gone")
    y.send("next")
    second = [x2.result(timeout=30), y.result(timeout=30)]
    assert {r.participants[r.rank] for r in second} == {"x", "y"}
    session = nodes.members()["x"].session
    assert time.monotonic() - frozen_at < ttl, "the freeze outlasted the TTL: test too slow"
    x1.thaw()
    stays(lambda: nodes.members().get("x") is not None
          and nodes.members()["x"].session == session, 3.0,
          "the thawed process took the service back: its replacement lost its session")
    y.send("waiting")
    assert y.event(10)["value"] == 0


def test_a_meta_publish_in_flight_when_leave_runs_does_not_bring_the_service_back(agent, nodes):
    """(e) leave() deregisters the service while the keep thread's meta publish is in flight:
    the publish lands first, the deregistration after it, and the service stays gone."""
    settings = nodes.settings(min_nodes=1, max_nodes=1)
    client = gated(agent, settings)
    client.gated.add("register")
    a = nodes.node("a", settings, client=client)
    a.register()
    client.gate.clear()
    nodes.rounds([a], timeout=20)
    wait_for(lambda: client.waiting >= 1, 10, "the meta publish at the gate")
    leaving = threading.Thread(target=a.leave)
    leaving.start()
    leaving.join(0.5)  # leave() waits for the publish in flight (or, before the fix, is done)
    client.gate.set()
    leaving.join(10)
    admin = agent.client()
    try:
        stays(lambda: a.service_id not in admin.agent_services(), 2.0,
              "the service came back after leave()")
    finally:
        admin.close()


def test_a_malformed_round_value_is_a_state_error_not_an_index_error(nodes):
    """(g) a round whose incarnations do not match its ranks (written by hand, or by a broken
    release): a RendezvousStateError naming the key."""
    bad = json.dumps({"v": 1, "round": 3, "ranks": ["a", "b"], "hosts": ["a", "b"],
                      "incarnations": ["only-one"], "members_index": 10 ** 9,
                      "seal_id": "x"}).encode()
    nodes.admin.kv_put(nodes.keys.round, bad)
    node = nodes.node("a", nodes.settings(min_nodes=1, max_nodes=1, join_timeout=5))
    with pytest.raises(RendezvousStateError, match="round/current") as info:
        node.next_round()
    assert "1 incarnations for 2 ranks" in str(info.value)
    with pytest.raises(RendezvousStateError):
        Round.decode(nodes.admin.kv_get(nodes.keys.round).data)
    nodes.admin.txn([txn_kv("delete", nodes.keys.round)])
