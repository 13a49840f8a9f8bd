"""The round history (consul_rdzv/history.py, ``consul-rdzv history``) against a real dev agent:
each sealed round and how the one before it ended, written in the seal transaction; the last
HISTORY_ROUNDS kept in detail; archived for history_retention when the run ends."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from rdzv_nodes import HB, figure, wait_for

from consul_rdzv import history
from consul_rdzv.client import MAX_TXN_OPS, txn_kv
from consul_rdzv.errors import RendezvousClosedError
from consul_rdzv.layout import HISTORY_ROUNDS, History, Member, Round, RunState, history_value
from consul_rdzv.planning import MAX_TXN_BYTES
from consul_rdzv.service import INCARNATION_TAG

CLI = [sys.executable, "-m", "consul_rdzv.cli"]


def cli(nodes, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "--key-prefix", nodes.prefix, *args], capture_output=True,
                          text=True, timeout=60)


def history_json(nodes) -> dict:
    proc = cli(nodes, "history", nodes.run_id, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# ----------------------------------------------------------------------------- pure


def _member(node: str, index: int, at: float, incarnation: str = "i") -> Member:
    return Member(node=node, host="h", pid=1, incarnation=incarnation, at=at,
                  modify_index=index)


def test_ending_names_who_went_who_came_back_and_who_asked_first():
    previous = Round(round=4, ranks=["a", "b", "c", "d"], incarnations=["i", "i", "i", "i"],
                     members_index=100, sealed_at=1000.0)
    state = RunState(members={"a": _member("a", 105, 1060.0),  # asked second
                              "b": _member("b", 103, 1050.0),  # asked first
                              "c": _member("c", 104, 1055.0, "new-process"),
                              "e": _member("e", 90, 900.0)})  # new, waited beside the round
    end = history.ending(previous, state, ["b", "a", "c", "e"], now=1070.0)
    assert end["cause"] == "gone" and end["gone"] == ["d"] and end["replaced"] == ["c"]
    assert end["first"] == "b" and end["joined"] == ["e"]
    assert end["ended_at"] == 1050.0 and end["trained"] == 50.0 and end["lost"] == 20.0
    assert history.involved(end) == ["d", "c", "e"]
    quiet = RunState(members={n: _member(n, 101 + i, 1200.0 + i) for i, n in
                              enumerate(previous.ranks)})
    restart = history.ending(previous, quiet, previous.ranks, 1300.0)
    assert restart["cause"] == "restart" and history.involved(restart) == ["a"]


def test_storm_pattern_needs_every_round_short_and_recent():
    def end(n: int, at: float, trained: float, node: str = "flappy") -> dict:
        return {"round": n, "ended_at": at, "trained": trained, "cause": "gone", "nodes": [node]}

    short = [end(i, 1000.0 + 10 * i, 5.0) for i in range(1, 6)]
    joined = {**short[0], "lost": 1.0, "cause": "joined", "gone": [], "replaced": [],
              "joined": ["x"], "first": None}
    assert history.recent(short, joined, 5) == short, "a node joining is no failure"
    reason = history.storm(short, rounds=5, window=600, min_round=60, now=1100.0)
    assert reason and "rounds 1-5" in reason and "flappy (5x)" in reason
    assert history.storm(short, rounds=0, window=600, min_round=60, now=1100.0) is None
    assert history.storm(short[:4], rounds=5, window=600, min_round=60, now=1100.0) is None
    long_one = [*short[:4], end(5, 1050.0, 61.0)]
    assert history.storm(long_one, rounds=5, window=600, min_round=60, now=1100.0) is None
    assert history.storm(short, rounds=5, window=600, min_round=60, now=1700.0) is None


# ----------------------------------------------------------------------------- real rounds


def test_history_records_each_round_and_how_the_previous_ended(nodes):
    settings = nodes.settings(min_nodes=1, max_nodes=2, history_retention=30)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    assert nodes.rounds([a, b], 30)["a"].round == 1
    nodes.rounds([a, b], 30)  # both ask for a new round: a restart
    b.halt()  # b dies: its key goes after the check TTL
    wait_for(lambda: "b" not in nodes.members(), HB * 3, "b's key gone")
    third = nodes.rounds([a], 30)["a"]
    assert third.round == 3 and third.world_size == 1

    doc = history_json(nodes)
    assert doc["state"] == "running" and [r["round"] for r in doc["rounds"]] == [1, 2, 3]
    r1, r2, r3 = doc["rounds"]
    assert r1["ended"]["cause"] == "restart" and r1["ended"]["first"] in ("a", "b")
    assert r2["ended"]["cause"] == "gone" and r2["ended"]["gone"] == ["b"]
    assert r3["ended"] is None and r3.get("running")
    assert all(r["lost"] >= 0 for r in (r1, r2))
    t = doc["totals"]
    assert t["rounds"] == 3 and t["restarts"] == 2 and t["causes"] == {"restart": 1, "gone": 1}
    assert t["lost"] == pytest.approx(r1["lost"] + r2["lost"], abs=0.01)
    text = cli(nodes, "history", nodes.run_id)
    assert text.returncode == 0 and "gone: b" in text.stdout and "3 round(s), 2 restart(s)" \
        in text.stdout, text.stdout

    # the run ends: its last node leaves; the history stays, archived under a session whose
    # TTL is history_retention (Consul removes it), the loose records are gone
    assert a.leave()
    entries = nodes.admin.kv_list(nodes.keys.history).data
    assert entries and all(e.session for e in entries), [(e.key, e.session) for e in entries]
    assert not [e.key for e in entries if "/rounds/" in e.key]
    info = nodes.admin.session_info(entries[0].session)
    assert info["TTL"] == "30s" and info["Behavior"] == "delete"
    after = history_json(nodes)
    assert after["state"] == "ended" and [r["round"] for r in after["rounds"]] == [1, 2, 3]
    assert after["totals"]["restarts"] == 2 and after["ended_at"]
    assert cli(nodes, "list").stdout.count(nodes.run_id) <= 1  # the history is not a run


def test_history_retention_zero_removes_it_with_the_last_node(nodes):
    settings = nodes.settings(min_nodes=1, max_nodes=1, history_retention=0)
    a = nodes.node("a", settings)
    nodes.rounds([a], 30)
    assert nodes.admin.kv_keys(nodes.keys.history)
    assert a.leave()
    assert nodes.admin.kv_keys(nodes.keys.history) == []
    proc = cli(nodes, "history", nodes.run_id)
    assert proc.returncode == 1 and "no round history" in proc.stderr


def test_only_the_last_rounds_are_kept_in_detail(nodes):
    """A run already at round 1500 (seeded): the seal of 1501 drops record 501 in its
    transaction and counts on in the totals."""
    job = "seeded-job"
    nodes.admin.kv_put(nodes.keys.round, Round(
        round=1500, ranks=["ghost"], incarnations=["x"], seal_id="s", job=job,
        sealed_at=time.time() - 5, totals={"rounds": 1500, "restarts": 1499, "lost": 10.0,
                                           "trained": 100.0, "since": 1.0}).encode())
    for n in (500, 501, 502):
        nodes.admin.kv_put(nodes.keys.history_round(job, n),
                           history_value({"round": n, "sealed_at": 1.0, "world": 1}))
    a = nodes.node("a", nodes.settings(min_nodes=1, max_nodes=1))
    assert nodes.rounds([a], 30)["a"].round == 1501
    kept = nodes.admin.kv_keys(nodes.keys.job(job) + "rounds/")
    assert nodes.keys.history_round(job, 1501 - HISTORY_ROUNDS) not in kept
    assert nodes.keys.history_round(job, 500) in kept  # older keys are not this seal's business
    assert nodes.keys.history_round(job, 1501) in kept
    totals = History.parse(nodes.keys, nodes.admin.kv_list(nodes.keys.history).data)[0].totals
    assert totals["rounds"] == 1501 and totals["restarts"] == 1500
    assert totals["causes"] == {"gone": 1}


def test_history_of_ten_thousand_rounds_answers_fast(nodes):
    """A test-made history as the coordinator writes it: 10,000 rounds, the last 1,000 in
    detail. The figure (how long ``consul-rdzv history`` takes) is printed, not asserted."""
    job, now = "big-job", time.time()
    ops = []
    for n in range(9001, 10001):
        end = {"round": n - 1, "sealed_at": now - 100, "ended_at": now - 50, "trained": 50.0,
               "lost": 3.0, "cause": "gone", "gone": ["node-17"], "drained": [],
               "replaced": [], "joined": [], "first": "node-3",
               "counts": {"gone": 1, "drained": 0, "replaced": 0, "joined": 0, "asked": 7}}
        rec = {"round": n, "sealed_at": now - 40, "world": 8, "coordinator": "node-0",
               "first_join": now - 45, "quorum_at": now - 44, "after": end}
        ops.append(txn_kv("set", nodes.keys.history_round(job, n), value=history_value(rec)))
    ops.append(txn_kv("set", nodes.keys.history_totals(job), value=history_value(
        {"rounds": 10000, "restarts": 9999, "lost": 29997.0, "trained": 499950.0,
         "causes": {"gone": 9999}, "since": now - 600000, "round": 10000})))
    for start in range(0, len(ops), MAX_TXN_OPS):
        nodes.admin.txn(ops[start:start + MAX_TXN_OPS])
    started = time.monotonic()
    proc = cli(nodes, "history", nodes.run_id)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert "10000 round(s), 9999 restart(s)" in proc.stdout
    assert "the last 1000 rounds in detail, from round 9001" in proc.stdout
    started = time.monotonic()
    doc = history_json(nodes)
    took_json = time.monotonic() - started
    assert len(doc["rounds"]) == 1000 and doc["totals"]["rounds"] == 10000
    figure(f"consul-rdzv history of a 10,000-round run (1,000 in detail): {took:.2f}s text, "
           f"{took_json:.2f}s --json (whole command, Python start included)")


# ----------------------------------------------------------------------------- restart storm


def test_a_flapping_node_stops_the_run_with_a_restart_storm_error(nodes):
    """Node f keeps joining and leaving (a new process each time); with storm_rounds=3 the
    coordinator closes the run once three rounds in a row ended by a failure (f gone), naming
    the pattern and f. The rounds f's arrivals ended (joined: the job grew) count for nothing."""
    settings = nodes.settings(min_nodes=1, max_nodes=2, storm_rounds=3, storm_window=120,
                              storm_min_round=30)
    a, flapper = nodes.node("a", settings), nodes.node("f", settings)
    assert nodes.rounds([a, flapper], 30)["a"].round == 1
    flapper.leave()
    assert nodes.rounds([a], 30)["a"].round == 2  # round 1 ended: f gone (1)
    for number in (3, 5):
        flapper = nodes.node("f", settings)  # f comes back, a new process, and waits
        waiting = nodes.start([flapper])
        wait_for(lambda: "f" in nodes.members(), 15, "f's member key")
        waiting.update(nodes.start([a]))  # a sees f: a new round with f
        assert nodes.gather(waiting, 30)["a"].round == number  # f joined: no failure
        flapper.leave()
        if number == 3:
            assert nodes.rounds([a], 30)["a"].round == 4  # round 3 ended: f gone (2)
    with pytest.raises(RendezvousClosedError) as err:  # round 5 ended: f gone (3), a storm
        nodes.rounds([a], 30)
    message = str(err.value)
    assert "restart storm" in message and "rounds 1-5" in message and "f (3x)" in message, \
        message
    assert "gone 3x" in message and "consul-rdzv history" in message
    current = nodes.current_round()
    assert current.closed["outcome"] == "failed" and current.round == 5
    doc = history_json(nodes)
    assert doc["state"] == "closed" and "restart storm" in doc["totals"]["storm"]
    assert doc["totals"]["rounds"] == 5 and doc["totals"]["restarts"] == 5
    assert doc["totals"]["causes"] == {"gone": 3, "joined": 2}

    # a node of that job that asks again is refused with the same reason
    with pytest.raises(RendezvousClosedError, match="restart storm"):
        nodes.rounds([a], 30)


def test_long_rounds_are_no_storm(nodes):
    settings = nodes.settings(min_nodes=1, max_nodes=2, storm_rounds=2, storm_window=120,
                              storm_min_round=0.5)
    a = nodes.node("a", settings)
    for _ in range(4):
        nodes.rounds([a], 30)
        time.sleep(0.6)  # the round trains longer than storm_min_round
    assert nodes.current_round().closed is None


def test_gc_archives_the_history_of_a_run_whose_nodes_all_died(nodes):
    a = nodes.node("a", nodes.settings(min_nodes=1, max_nodes=1))
    nodes.rounds([a], 30)
    a.halt()  # killed: nobody archives the history
    wait_for(lambda: not nodes.members(), HB * 3, "a's key gone")
    assert all(not e.session for e in nodes.admin.kv_list(nodes.keys.history).data)
    proc = cli(nodes, "gc", "--yes", "--older-than", "0")
    assert proc.returncode == 0, proc.stderr
    assert nodes.admin.kv_keys(nodes.keys.prefix + "/") == []
    entries = nodes.admin.kv_list(nodes.keys.history).data
    assert entries and all(e.session for e in entries), [(e.key, e.session) for e in entries]
    assert nodes.admin.session_info(entries[0].session)["TTL"] == "86400s"
    assert history_json(nodes)["state"] == "ended"


def test_a_seal_at_the_transaction_limit_gives_up_the_history_not_the_round(nodes):
    """Long node ids fill the seal transaction: the round alone fits Consul's limit, with its
    history record (which names the gone and joined nodes) it would not. The round is sealed,
    without the record; the totals still count it."""
    long_id = "n" * 150
    gone = [f"gone-{i:02d}-{long_id}" for i in range(16)]
    job, now = "edge-job", time.time()
    nodes.admin.kv_put(nodes.keys.round, Round(
        round=7, ranks=gone, incarnations=["x"] * 16, seal_id="s",
        job=job, members_index=1, sealed_at=now - 5,
        totals={"rounds": 7, "restarts": 6, "since": now - 100}).encode())

    def seal_bytes(world: int, with_history: bool) -> int:
        """The seal transaction's size for ``world`` such members (as join.py builds it)."""
        names = [f"{i:05d}-{long_id}" for i in range(world - 1)] + ["a"]
        sealed = Round(round=8, ranks=names, incarnations=["0" * INCARNATION_TAG] * world,
                       store={"host": "127.0.0.1", "port": 65535}, members_index=10 ** 6,
                       joined_index=10 ** 6, coordinator="a", seal_id="f" * 32,
                       first_join=now, quorum_at=now, sealed_at=now, min_nodes=world,
                       max_nodes=world, job=job, totals={"rounds": 8, "restarts": 7})
        ops = [txn_kv("check-session", nodes.keys.leader, session="s" * 36),
               txn_kv("cas", nodes.keys.round, value=sealed.encode(), index=10 ** 6)]
        if with_history:
            end = {"round": 7, "gone": gone, "joined": names[:16], "first": None,
                   "replaced": [], "drained": [], "cause": "gone", "ended_at": now,
                   "trained": 5.0, "lost": 1.0, "sealed_at": now, "counts": {}}
            ops += history.seal_ops(nodes.keys, sealed, end, txn_kv)
        return len(json.dumps(ops))

    # a margin on both sides: the estimate is not the coordinator's very transaction
    world = next(w for w in range(1500, 3000) if seal_bytes(w, True) > MAX_TXN_BYTES + 1500)
    assert seal_bytes(world, False) < MAX_TXN_BYTES - 1500, "no room between the two sizes"
    members = [Member(node=f"{i:05d}-{long_id}", host="h" * 160, pid=1,
                      incarnation=f"{i:032x}") for i in range(world - 1)]
    ops = [txn_kv("set", nodes.keys.member(m.node), value=m.encode()) for m in members]
    for start in range(0, len(ops), MAX_TXN_OPS):
        nodes.admin.txn(ops[start:start + MAX_TXN_OPS])
    a = nodes.node("a", nodes.settings(min_nodes=world, max_nodes=world))
    result = nodes.rounds([a], 60)["a"]
    assert result.round == 8 and result.world_size == world
    kept = nodes.admin.kv_keys(nodes.keys.job(job))
    assert nodes.keys.history_round(job, 8) not in kept, "the record was expected to give way"
    totals = History.parse(nodes.keys, nodes.admin.kv_list(nodes.keys.history).data)[0].totals
    assert totals["rounds"] == 8 and totals["restarts"] == 7
    a.leave(timeout=10)
    nodes.admin.kv_delete(nodes.keys.prefix + "/", recurse=True)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_job_with_a_flapping_node_stops_instead_of_burning_its_restarts(
        agent, prefix, run_id, tmp_path):
    """Real torchrun agents: node-b is SIGKILLed each time it has joined the training (three
    times). With storm_rounds=3 the run is closed at the third failure: node-a's agent stops
    with the restart-storm error naming node-b, long before its 20 restarts are used up."""
    from torchrun_jobs import TorchrunJob

    conf = {"key_prefix": prefix, "heartbeat_timeout": 2, "last_call_timeout": 1,
            "join_timeout": 60, "storm_rounds": 3, "storm_window": 300, "storm_min_round": 60}
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="1:2", max_restarts=20,
                     rdzv_conf=conf,
                     train_args=["--steps", "100000", "--step-time", "0.05"]) as job:
        stable = job.start("node-a")
        for kill in range(3):
            flapper = job.start("node-b")
            job.wait_for(lambda f=flapper: any(e["event"] == "start" and e["world_size"] == 2
                                               and e["agent_pid"] == f.pid
                                               for e in job.progress()),
                         150, f"node-b training with node-a (time {kill + 1})")
            flapper.kill()
        codes = job.wait(120, [stable])
        log = stable.log()
        assert codes["node-a"] not in (None, 0), job.report()
        assert "restart storm" in log and "node-b (3x)" in log, job.report()
        restarts = log.count("will restart worker group")
        assert restarts < 20, job.report()
        doc = history_json_of(prefix, run_id)
        assert doc["state"] in ("closed", "ended") and "restart storm" in doc["totals"]["storm"]
        figure(f"a torchrun job with a node killed 3 times stopped with the restart-storm error "
               f"after {doc['totals']['rounds']} rounds, {restarts} worker restarts of 20 used")


def history_json_of(prefix: str, run_id: str) -> dict:
    proc = subprocess.run([*CLI, "--key-prefix", prefix, "history", run_id, "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_list_and_the_exporter_read_no_round_history(agent, prefix):
    """The read model behind `list`, `status` and the exporter skips the round histories kept
    under the key prefix (up to 1,000 records a run): with histories present it lists the
    folders and reads each but theirs; without, it reads the prefix once."""
    from consul_rdzv.cli.read import Reader

    client = agent.client()
    try:
        client.kv_put(f"{prefix}/run-a/round/current", Round(round=1).encode())
        client.kv_put(f"{prefix}/~quarantine/gpu-07", b"{}")
        reader = Reader(client, prefix)
        read: list[str] = []
        tree = reader.tree
        reader.tree = lambda p, **kw: (read.append(p), tree(p, **kw))[1]  # type: ignore
        runs, hosts = reader.runs_and_quarantine()
        assert set(runs) == {"run-a"} and [e.key for e in hosts] == [f"{prefix}/~quarantine/gpu-07"]
        assert read == [prefix]  # no history: one read of the whole prefix
        for i in range(50):
            client.kv_put(f"{prefix}/~history/run-a/j/rounds/{i:05d}", b"x" * 2000)
        read.clear()
        runs, hosts = reader.runs_and_quarantine()
        assert set(runs) == {"run-a"} and len(hosts) == 1
        assert sorted(read) == [f"{prefix}/run-a", f"{prefix}/~quarantine"], read
    finally:
        client.close()
