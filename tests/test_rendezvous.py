"""The rendezvous protocol against real Consul agents (docs/protocol.md).

Every round a test obtains goes through :func:`assert_round_ok`. Nodes run as threads (through
``concurrent.futures`` with timeouts) or as real child processes (``tests/node_process.py``), so a
hang fails the test instead of blocking the run. Tests synchronise on conditions (Consul state,
``num_nodes_waiting()``, a child's output) polled with deadlines, never on fixed sleeps. Figures
worth reporting are printed with a ``[figure]`` tag (``pytest -s`` shows them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest

from consul_rdzv.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from consul_rdzv.layout import Keys, Leader, Member, Round
from consul_rdzv.rendezvous import ROUND_WAIT, ConsulRendezvous, RoundResult
from consul_rdzv.settings import RendezvousSettings

NODE_SCRIPT = Path(__file__).with_name("node_process.py")
ROUND_FIELDS = {f.name for f in dataclasses.fields(RoundResult)}
#: Heartbeat TTL of the tests that detect dead nodes (the smallest the settings allow is 1 s).
HB = 2.0


def figure(text: str) -> None:
    print(f"[figure] {text}", flush=True)


def endpoint_for(node_id: str) -> dict:
    """The trainer-store endpoint a test node advertises (same rule in tests/node_process.py)."""
    return {"host": f"{node_id}.store.test", "port": 20000 + zlib.crc32(node_id.encode()) % 10000}


def assert_round_ok(results: Mapping[str, RoundResult], min_nodes: int, max_nodes: int) -> None:
    """The invariants of one round, from the results its participants got (node id -> result).

    Ranks are exactly 0..W-1, one per participant; every participant agrees on the round number,
    the world size, the rank map (participants and hosts), the store endpoint and the seal; the
    store is rank 0's endpoint; min_nodes <= W <= max_nodes; and exactly the participants got it.
    """
    assert results, "no results"
    first = next(iter(results.values()))
    world = first.world_size
    assert min_nodes <= world <= max_nodes, (world, min_nodes, max_nodes)
    assert len(first.participants) == world == len(set(first.participants)), first.participants
    assert set(results) == set(first.participants), (sorted(results), first.participants)
    assert sorted(r.rank for r in results.values()) == list(range(world))
    shared = ("run_id", "round", "world_size", "participants", "hosts", "store", "coordinator",
              "seal_id", "members_index")
    for node_id, result in results.items():
        for name in shared:
            assert getattr(result, name) == getattr(first, name), (node_id, name, result, first)
        assert result.participants[result.rank] == node_id, (node_id, result.rank, result)
    assert len(first.hosts) == world
    assert first.round >= 1
    assert first.store == endpoint_for(first.participants[0]), first.store
    assert first.coordinator, first


def ranks_of(results: Mapping[str, RoundResult]) -> dict[str, int]:
    return {node: r.rank for node, r in results.items()}


def one(results: Mapping[str, RoundResult]) -> RoundResult:
    return next(iter(results.values()))


def wait_for(predicate: Callable[[], object], timeout: float, what: str,
             interval: float = 0.01) -> object:
    """Poll ``predicate`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"still false after {timeout:g}s: {what}")
        time.sleep(interval)


def stays(predicate: Callable[[], bool], window: float, what: str) -> None:
    """Assert ``predicate`` holds throughout an observation window (for negative claims)."""
    end = time.monotonic() + window
    while time.monotonic() < end:
        assert predicate(), what
        time.sleep(0.005)


class RoundRecorder(threading.Thread):
    """Watches ``P/round/current`` and records every (round number, seal id) it ever holds."""

    def __init__(self, agent, keys: Keys) -> None:
        super().__init__(name="round-recorder", daemon=True)
        self.client = agent.client()
        self.keys = keys
        self.seals: dict[int, set[str]] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        index = 0
        while not self._stop_event.is_set():
            try:
                res = self.client.kv_get(self.keys.round, index=index or None, wait=0.2,
                                         deadline=time.monotonic() + 0.2)
            except Exception:  # agent down or restarting: keep watching
                time.sleep(0.05)
                continue
            index = 0 if res.index < index else res.index
            if res.data is not None:
                with contextlib.suppress(RendezvousStateError):
                    current = Round.decode(res.data)
                    if current.ranks:
                        self.seals.setdefault(current.round, set()).add(current.seal_id)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)
        self.client.close()

    def assert_sealed_once(self) -> None:
        twice = {n: ids for n, ids in self.seals.items() if len(ids) > 1}
        assert not twice, f"round(s) sealed more than once: {twice}"


class NodeProcess:
    """tests/node_process.py as a child process; its JSON lines arrive on a queue."""

    def __init__(self, agent, log_dir: Path, node_id: str, *, run_id: str, key_prefix: str,
                 min_nodes: int, max_nodes: int, heartbeat: float = HB, last_call: float = 0.3,
                 join_timeout: float = 60.0, consul_timeout: float = 10.0) -> None:
        self.node_id = node_id
        self.log_path = log_dir / f"{node_id}.stderr.log"
        cmd = [sys.executable, str(NODE_SCRIPT), "--run-id", run_id, "--key-prefix", key_prefix,
               "--node-id", node_id, "--min", str(min_nodes), "--max", str(max_nodes),
               "--heartbeat", str(heartbeat), "--last-call", str(last_call),
               "--join-timeout", str(join_timeout), "--consul-timeout", str(consul_timeout)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, **agent.env()}, start_new_session=True,
            )
        self.events: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put(None)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-3000:]
        return ""

    def event(self, timeout: float) -> dict | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"process {self.node_id} printed nothing in {timeout:g}s; "
                                 f"its log:\n{self.log_tail()}") from None

    def result(self, timeout: float) -> RoundResult:
        event = self.event(timeout)
        assert event is not None and event["event"] == "round", (
            f"process {self.node_id}: {event}\n{self.log_tail()}")
        return RoundResult(**{k: v for k, v in event.items() if k in ROUND_FIELDS})

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """The nodes of one test's run: settings, threads, processes and cleanup."""

    def __init__(self, agent, prefix: str, log_dir: Path) -> None:
        self.agent = agent
        self.prefix = prefix
        self.run_id = f"run-{prefix}"  # unique per test: service ids are per agent, not prefix
        self.log_dir = log_dir
        self.admin = agent.client()
        self.keys = Keys(f"{prefix}/{self.run_id}")
        self.nodes: list[ConsulRendezvous] = []
        self.processes: list[NodeProcess] = []
        self.pool = ThreadPoolExecutor(max_workers=96, thread_name_prefix="node")
        self.futures: list[Future] = []
        self.recorder = RoundRecorder(agent, self.keys)
        self.recorder.start()

    def settings(self, **changes) -> RendezvousSettings:
        values = dict(run_id=self.run_id, key_prefix=self.prefix, heartbeat_timeout=HB,
                      join_timeout=30.0, last_call_timeout=0.3, close_timeout=3.0,
                      consul_timeout=10.0)
        values.update(changes)
        return RendezvousSettings(**values)

    def node(self, node_id: str, settings: RendezvousSettings, *, host: str | None = None,
             client=None) -> ConsulRendezvous:
        node = ConsulRendezvous(settings, client, node_id=node_id, host=host or node_id,
                                endpoint_provider=lambda: endpoint_for(node_id))
        self.nodes.append(node)
        return node

    def process(self, node_id: str, **kwargs) -> NodeProcess:
        proc = NodeProcess(self.agent, self.log_dir, node_id, run_id=self.run_id,
                           key_prefix=self.prefix, **kwargs)
        self.processes.append(proc)
        return proc

    # -------------------------------------------------------------- running rounds

    def start(self, nodes: Iterable[ConsulRendezvous]) -> dict[str, Future]:
        futures = {n.node_id: self.pool.submit(n.next_round) for n in nodes}
        self.futures.extend(futures.values())
        return futures

    @staticmethod
    def gather(futures: Mapping[str, Future], timeout: float) -> dict[str, RoundResult]:
        deadline = time.monotonic() + timeout
        results = {}
        for node_id, future in futures.items():
            try:
                results[node_id] = future.result(max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                pending = sorted(n for n, f in futures.items() if not f.done())
                raise AssertionError(f"next_round() still running after {timeout:g}s on "
                                     f"{pending}") from None
        return results

    def rounds(self, nodes: Iterable[ConsulRendezvous], timeout: float) -> dict[str, RoundResult]:
        return self.gather(self.start(nodes), timeout)

    # -------------------------------------------------------------- Consul views

    def members(self) -> dict[str, Member]:
        entries = self.admin.kv_list(self.keys.members).data
        return {e.key[len(self.keys.members):]: Member.decode(e) for e in entries}

    def leader(self) -> Leader | None:
        entry = self.admin.kv_get(self.keys.leader).data
        return Leader.decode(entry) if entry is not None and entry.session else None

    def current_round(self) -> Round | None:
        entry = self.admin.kv_get(self.keys.round).data
        return Round.decode(entry) if entry is not None else None

    def keys_held_by(self, session: str) -> list[str]:
        return [e.key for e in self.admin.kv_list(self.prefix + "/").data if e.session == session]

    # -------------------------------------------------------------- cleanup

    def shutdown(self) -> None:
        for proc in self.processes:
            proc.kill()
        if self.nodes and any(not f.done() for f in self.futures):
            # something still waits (the test failed): close the run so it returns now
            with contextlib.suppress(Exception):
                self.nodes[0].close("test teardown")
        leaving = [self.pool.submit(node.leave) for node in self.nodes]
        for future in leaving:
            with contextlib.suppress(Exception):
                future.result(timeout=30)
        for node in self.nodes:
            node.client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.recorder.stop()
        self.admin.close()


@pytest.fixture
def cluster(agent, prefix, tmp_path):
    c = Cluster(agent, prefix, tmp_path)
    yield c
    c.shutdown()


@pytest.fixture
def fresh_cluster(fresh_agent, prefix, tmp_path):
    c = Cluster(fresh_agent, prefix, tmp_path)
    yield c
    c.shutdown()


# ============================================================================ 1. threads


@pytest.mark.parametrize("n", [2, 8, 64])
def test_threads_form_one_round_then_rejoin_with_stable_ranks(cluster, n):
    settings = cluster.settings(min_nodes=n, max_nodes=n, last_call_timeout=30.0,
                                join_timeout=90.0, heartbeat_timeout=5.0 if n > 8 else HB)
    nodes = [cluster.node(f"n{i}", settings) for i in range(n)]

    started = time.monotonic()
    first = cluster.rounds(nodes, timeout=60)
    took_first = time.monotonic() - started
    assert_round_ok(first, n, n)
    assert one(first).round == 1
    assert took_first < 20, "a full round seals at once; it must not wait for the last call"

    started = time.monotonic()
    second = cluster.rounds(nodes, timeout=60)
    took_second = time.monotonic() - started
    assert_round_ok(second, n, n)
    assert one(second).round == 2
    assert one(second).seal_id != one(first).seal_id
    assert ranks_of(second) == ranks_of(first), "stable ranks: every node keeps its rank"
    cluster.recorder.assert_sealed_once()

    requests = sorted(r.requests for r in first.values())
    requests2 = sorted(r.requests for r in second.values())
    figure(f"N={n} threads: round 1 in {took_first:.3f}s, round 2 (all re-join) in "
           f"{took_second:.3f}s; Consul requests per node and round: round 1 "
           f"min/median/max {requests[0]}/{requests[n // 2]}/{requests[-1]}, round 2 "
           f"{requests2[0]}/{requests2[n // 2]}/{requests2[-1]}")


# ============================================================================ 2. processes


@pytest.mark.parametrize("n", [3, 8])
def test_processes_form_a_round(cluster, n):
    started = time.monotonic()
    procs = [cluster.process(f"p{i}", min_nodes=n, max_nodes=n, last_call=30.0)
             for i in range(n)]
    first = {p.node_id: p.result(timeout=60) for p in procs}
    took = time.monotonic() - started
    assert_round_ok(first, n, n)
    # really n processes: each member value carries the pid of the process that wrote it
    members = cluster.members()
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
    cluster.recorder.assert_sealed_once()
    figure(f"N={n} processes: first round {took:.2f}s after the first process started")

    for p in procs:
        p.send("leave")
    for p in procs:
        assert p.proc.wait(15) == 0
    wait_for(lambda: not cluster.members(), 5, "every process removed its member key")


# ============================================================================ 3. scaling


def test_scale_down_reseals_at_once_and_scale_up_fills_the_round(cluster):
    settings = cluster.settings(min_nodes=2, max_nodes=4, last_call_timeout=30.0)
    nodes = {i: cluster.node(i, settings) for i in "abcd"}
    first = cluster.rounds(nodes.values(), timeout=20)
    assert_round_ok(first, 2, 4)
    assert one(first).world_size == 4

    # the participant of rank 1 leaves cleanly; the others see it go
    by_rank = {r.rank: node for node, r in first.items()}
    leaver = nodes[by_rank[1]]
    assert leaver.leave()
    survivors = [n for n in nodes.values() if n is not leaver]
    wait_for(lambda: all(n.num_nodes_waiting() >= 1 for n in survivors), 5,
             "survivors see that a participant left")

    started = time.monotonic()
    second = cluster.rounds(survivors, timeout=20)
    took_down = time.monotonic() - started
    assert_round_ok(second, 2, 4)
    assert one(second).world_size == 3 and leaver.node_id not in one(second).participants
    assert took_down < 5, f"fast re-seal: nobody new, so no last call (took {took_down:.2f}s)"
    # stable ranks: ranks 0 and 2 are kept, the old rank 3 fills the hole at 1
    assert ranks_of(second) == {by_rank[0]: 0, by_rank[2]: 2, by_rank[3]: 1}

    # a new node joins: it waits, the participants see it and re-join
    newcomer = cluster.node("e", settings)
    pending = cluster.start([newcomer])
    wait_for(lambda: all(n.num_nodes_waiting() == 1 for n in survivors), 5,
             "participants see one node waiting")
    assert not pending["e"].done()
    started = time.monotonic()
    futures = {**pending, **cluster.start(survivors)}
    third = cluster.gather(futures, timeout=20)
    took_up = time.monotonic() - started
    assert_round_ok(third, 2, 4)
    assert one(third).world_size == 4 and one(third).round == 3
    assert ranks_of(third) == {**ranks_of(second), "e": 3}
    assert took_up < 5, f"a full round seals at once (took {took_up:.2f}s)"
    cluster.recorder.assert_sealed_once()
    figure(f"scale-down re-seal (last_call 30s): {took_down:.3f}s; scale-up to max: "
           f"{took_up:.3f}s")


def test_scale_up_below_max_seals_after_the_last_call(cluster):
    last_call = 0.5
    settings = cluster.settings(min_nodes=2, max_nodes=5, last_call_timeout=last_call)
    nodes = [cluster.node(i, settings) for i in "abc"]
    first = cluster.rounds(nodes, timeout=20)
    assert_round_ok(first, 2, 5)
    assert one(first).world_size == 3
    timings = one(first).timings
    assert timings["sealed"] - timings["quorum"] >= last_call - 0.05

    newcomer = cluster.node("d", settings)
    pending = cluster.start([newcomer])
    wait_for(lambda: all(n.num_nodes_waiting() == 1 for n in nodes), 5,
             "participants see the new node")
    second = cluster.gather({**pending, **cluster.start(nodes)}, timeout=20)
    assert_round_ok(second, 2, 5)
    assert one(second).world_size == 4 and one(second).round == 2
    assert ranks_of(second) == {**ranks_of(first), "d": 3}
    timings = one(second).timings
    waited = timings["sealed"] - timings["quorum"]
    assert waited >= last_call - 0.05, f"someone new and room left: last call ({waited:.3f}s)"
    assert waited < last_call + 5
    cluster.recorder.assert_sealed_once()


# ============================================================================ 4. late joiners


def test_late_joiner_waits_and_a_spare_beside_a_full_round_is_not_counted(cluster):
    settings = cluster.settings(min_nodes=2, max_nodes=3, last_call_timeout=0.3)
    a, b, c, d = (cluster.node(i, settings) for i in "abcd")
    first = cluster.rounds([a, b], timeout=20)
    assert_round_ok(first, 2, 3)
    assert one(first).world_size == 2

    # c arrives late: it waits (no error) and the participants see one node waiting
    late = cluster.start([c])
    started = time.monotonic()
    wait_for(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, 5,
             "participants see the late joiner")
    latency = time.monotonic() - started
    assert not late["c"].done()
    second = cluster.gather({**late, **cluster.start([a, b])}, timeout=20)
    assert_round_ok(second, 2, 3)
    assert one(second).world_size == 3
    assert ranks_of(second) == {**ranks_of(first), "c": 2}

    # the round is full (W == max_nodes): a spare that waits does not count
    spare = cluster.start([d])
    wait_for(lambda: "d" in cluster.members(), 5, "the spare's member key")
    window = max(1.0, 20 * latency)
    stays(lambda: a.num_nodes_waiting() == b.num_nodes_waiting() == c.num_nodes_waiting() == 0,
          window, "a spare beside a full round made num_nodes_waiting() positive")
    assert not spare["d"].done()

    # control: once a participant leaves, the gone node and the spare both count
    c.leave()
    wait_for(lambda: a.num_nodes_waiting() == 2 and b.num_nodes_waiting() == 2, 5,
             "participants count the gone node and the spare")
    third = cluster.gather({**spare, **cluster.start([a, b])}, timeout=20)
    assert_round_ok(third, 2, 3)
    assert ranks_of(third) == {"a": ranks_of(second)["a"], "b": ranks_of(second)["b"], "d": 2}
    cluster.recorder.assert_sealed_once()
    figure(f"late joiner seen by participants' num_nodes_waiting() after {latency * 1000:.0f}ms")


# ============================================================================ 5. killed node


@pytest.mark.parametrize("rejoin", ["after_notice", "at_once"])
def test_killed_node_is_detected_and_survivors_reseal(cluster, rejoin):
    settings = cluster.settings(min_nodes=3, max_nodes=4, last_call_timeout=30.0)
    survivors = [cluster.node(f"s{i}", settings) for i in range(3)]
    pending = cluster.start(survivors)
    victim = cluster.process("victim", min_nodes=3, max_nodes=4, heartbeat=HB, last_call=30.0)
    first = cluster.gather(pending, timeout=30)
    first["victim"] = victim.result(timeout=10)
    assert_round_ok(first, 3, 4)
    assert one(first).world_size == 4

    killed = time.monotonic()
    victim.kill()
    if rejoin == "at_once":  # survivors re-join at once, e.g. after a collective failed
        pending = cluster.start(survivors)
    wait_for(lambda: "victim" not in cluster.members(), HB + 4,
             "the killed node's member key is deleted with its session")
    gone = time.monotonic()
    noticed = None
    if rejoin == "after_notice":
        wait_for(lambda: all(n.num_nodes_waiting() >= 1 for n in survivors), 5,
                 "survivors' num_nodes_waiting() > 0")
        noticed = time.monotonic()
        pending = cluster.start(survivors)
    second = cluster.gather(pending, timeout=20)
    sealed = time.monotonic()
    assert_round_ok(second, 3, 4)
    assert one(second).world_size == 3 and "victim" not in one(second).participants
    assert one(second).round == 2
    assert gone - killed <= HB + 3, f"member key gone {gone - killed:.2f}s after the kill"
    assert sealed - gone < 5, "fast re-seal once the dead node's key is gone"
    for node, r in second.items():
        if first[node].rank < 3:
            assert r.rank == first[node].rank, "a survivor below the new world size keeps its rank"
    cluster.recorder.assert_sealed_once()
    figure(f"SIGKILL, heartbeat_timeout={HB:g}s, re-join {rejoin}: key gone after "
           f"{gone - killed:.2f}s"
           + (f", noticed after {noticed - killed:.2f}s" if noticed else "")
           + f", kill-to-sealed {sealed - killed:.2f}s")


# ============================================================================ 6. coordinator killed


@pytest.mark.parametrize("when", ["before_others_arrive", "while_one_waits"])
def test_coordinator_killed_while_a_round_forms(cluster, when):
    coordinator = cluster.process("coord", min_nodes=3, max_nodes=3, heartbeat=HB)
    wait_for(lambda: (cluster.leader() or Leader("", "", 0)).node == "coord", 15,
             "the first process holds P/round/leader")
    settings = cluster.settings(min_nodes=2, max_nodes=3, last_call_timeout=0.3)
    a, b = cluster.node("a", settings), cluster.node("b", settings)
    pending = {}
    if when == "while_one_waits":
        pending.update(cluster.start([a]))
        wait_for(lambda: "a" in cluster.members(), 5, "a waits beside the coordinator")
    killed = time.monotonic()
    coordinator.kill()
    pending.update(cluster.start([b] if when == "while_one_waits" else [a, b]))
    results = cluster.gather(pending, timeout=HB + 20)
    took = time.monotonic() - killed
    assert_round_ok(results, 2, 3)
    r = one(results)
    assert r.world_size == 2 and r.round == 1
    assert r.coordinator in ("a", "b")
    assert coordinator.events.get(timeout=5) is None, "the killed coordinator returned a round"
    # sealed once: the round in Consul is the one both got, and no other seal was ever seen
    current = cluster.current_round()
    assert (current.round, current.seal_id) == (r.round, r.seal_id)
    wait_for(lambda: r.round in cluster.recorder.seals, 5, "the recorder saw the seal")
    cluster.recorder.assert_sealed_once()
    assert cluster.recorder.seals == {1: {r.seal_id}}
    # nobody returns a second, different result: both are in the round, waiting for nothing
    assert a.current_round == results["a"] and b.current_round == results["b"]
    assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0
    figure(f"coordinator SIGKILLed ({when}): new round sealed {took:.2f}s after the kill")


# ============================================================================ 7. session destroyed


def test_session_destroyed_from_outside_while_training(cluster, caplog):
    settings = cluster.settings(min_nodes=2, max_nodes=2)
    a, b = cluster.node("a", settings), cluster.node("b", settings)
    first = cluster.rounds([a, b], timeout=20)
    assert_round_ok(first, 2, 2)
    old = a.session_id
    assert cluster.keys_held_by(old)

    destroyed = time.monotonic()
    cluster.admin.session_destroy(old)  # as an operator would in the UI
    wait_for(lambda: a.num_nodes_waiting() >= 1, 5, "a notices that its session is gone")
    noticed = time.monotonic() - destroyed
    wait_for(lambda: b.num_nodes_waiting() >= 1, 5, "b sees a's member key vanish")

    # The service and its check outlived the session: the new session needs no new service
    # registration (the agent serialises those), only the check passed.
    joins: list[str] = []
    original = a._register_service

    def spy(deadline, _orig=original):
        if not threading.current_thread().name.startswith("consul-rdzv-heartbeat"):
            joins.append(threading.current_thread().name)  # not the async meta publish
        return _orig(deadline)

    a._register_service = spy
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="consul_rdzv.rendezvous"):
        second = cluster.rounds([a, b], timeout=20)
    assert_round_ok(second, 2, 2)
    assert one(second).round == 2
    assert joins == [], "the service was registered again although it still existed"
    assert a.session_id not in (None, old)
    registrations = [r for r in caplog.records if r.getMessage().startswith("Node a of run ")
                     and "registered service" in r.getMessage()]
    assert len(registrations) == 1, "registered more than once (a spurious loss)"
    assert cluster.admin.session_info(old) is None
    assert not cluster.keys_held_by(old), "a key is held by the dead session"
    assert cluster.members()["a"].session == a.session_id
    leader = cluster.leader()
    assert leader is not None and leader.session in (a.session_id, b.session_id)
    assert a.num_nodes_waiting() == 0
    figure(f"session destroyed from outside: the node noticed after {noticed * 1000:.0f}ms")


def test_training_heartbeat_passes_the_check_without_probing_the_session(cluster):
    # During training the watch sees our member key vanish if the session dies, so the heartbeat
    # only passes the TTL check (one request a beat, not two).
    settings = cluster.settings(min_nodes=2, max_nodes=2)
    a, b = cluster.node("a", settings), cluster.node("b", settings)
    assert_round_ok(cluster.rounds([a, b], timeout=20), 2, 2)
    before = dict(a.client.request_counts)
    wait_for(lambda: a.client.request_counts["PUT agent"] >= before.get("PUT agent", 0) + 3,
             HB * 5, "three heartbeats of a")
    assert a.client.request_counts["PUT session"] == before.get("PUT session", 0)
    assert a.num_nodes_waiting() == 0


def test_training_watch_reads_key_names_on_a_death_and_values_on_a_rejoin(cluster):
    # At scale every survivor's watch wakes when one node dies: the names of the member keys
    # tell it, without reading (and decoding) every member's value.
    settings = cluster.settings(min_nodes=2, max_nodes=3)
    a, b, c = (cluster.node(i, settings) for i in "abc")
    assert_round_ok(cluster.rounds([a, b, c], timeout=20), 2, 3)
    full_reads: dict[str, int] = {"a": 0, "b": 0}
    for node in (a, b):
        def spy(*args, _id=node.node_id, _orig=node.client.kv_list, **kwargs):
            full_reads[_id] += 1
            return _orig(*args, **kwargs)
        node.client.kv_list = spy

    cluster.admin.session_destroy(c.session_id)  # c's member key goes with its session
    wait_for(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, 5,
             "a and b see c gone")
    assert full_reads == {"a": 0, "b": 0}

    # a asks for a new round: its key is rewritten under the same name, which only the values
    # (ModifyIndex) show; b reads them and counts c gone plus a waiting.
    pending = cluster.start([a])
    wait_for(lambda: b.num_nodes_waiting() == 2, 5, "b sees a waiting for a new round")
    assert full_reads["b"] >= 1
    second = cluster.gather({**pending, **cluster.start([b])}, timeout=20)
    assert_round_ok(second, 2, 3)
    assert one(second).world_size == 2 and one(second).round == 2


def test_session_destroyed_while_coordinating(cluster):
    settings = cluster.settings(min_nodes=2, max_nodes=2)
    a, b = cluster.node("a", settings), cluster.node("b", settings)
    pending = cluster.start([a])
    wait_for(lambda: (cluster.leader() or Leader("", "", 0)).node == "a", 5,
             "a coordinates, alone")
    old = a.session_id
    cluster.admin.session_destroy(old)
    wait_for(lambda: a.session_id not in (None, old), 5, "a registers again")
    pending.update(cluster.start([b]))
    results = cluster.gather(pending, timeout=20)
    assert_round_ok(results, 2, 2)
    assert not cluster.keys_held_by(old)
    assert cluster.members()["a"].session == a.session_id


def test_member_key_deleted_by_hand_from_the_coordinator(cluster):
    """``consul kv delete`` of a live node's key: its session lives on, holding the leader key;
    the node must give that session up (not just stop using it) for a round to form again."""
    settings = cluster.settings(min_nodes=2, max_nodes=2, join_timeout=10.0)
    nodes = {i: cluster.node(i, settings) for i in "ab"}
    first = cluster.rounds(nodes.values(), timeout=20)
    assert_round_ok(first, 2, 2)
    coordinator = nodes[cluster.leader().node]
    old = coordinator.session_id
    assert cluster.admin.kv_delete(cluster.keys.member(coordinator.node_id))
    wait_for(lambda: all(n.num_nodes_waiting() >= 1 for n in nodes.values()), 5,
             "both nodes see the coordinator's key gone")
    second = cluster.rounds(nodes.values(), timeout=20)
    assert_round_ok(second, 2, 2)
    assert one(second).round == 2
    assert cluster.admin.session_info(old) is None, "the abandoned session still exists"
    assert not cluster.keys_held_by(old)


# ============================================================================ 8. Consul outages


@pytest.mark.parametrize("how", ["restart", "crash"])
def test_agent_restart_while_nodes_wait(fresh_cluster, fresh_agent, how):
    cluster = fresh_cluster
    consul_timeout = 3.0
    settings = cluster.settings(min_nodes=3, max_nodes=3, join_timeout=45.0,
                                consul_timeout=consul_timeout)
    a, b, c = (cluster.node(i, settings) for i in "abc")
    pending = cluster.start([a, b])
    wait_for(lambda: {"a", "b"} <= set(cluster.members()) and cluster.leader(), 10,
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
    pending.update(cluster.start([c]))
    try:
        results = cluster.gather(pending, timeout=settings.join_timeout + 10)
    except RendezvousError as exc:
        pytest.fail(f"a {outage:.1f}s outage (consul_timeout {consul_timeout:g}s, waiting for "
                    f"{restarted - waiting_since:.1f}s) was not ridden out: {exc!r}")
    took = time.monotonic() - restarted
    assert_round_ok(results, 3, 3)
    assert one(results).round == 1  # Consul forgot everything; nobody had a round before
    # a retry that blocked at the old agent's index would sit out a whole ROUND_WAIT first
    assert took < ROUND_WAIT / 2, f"round sealed {took:.1f}s after the restart"
    assert not old & {a.session_id, b.session_id}, "nodes registered again with new sessions"
    assert set(cluster.members()) == {"a", "b", "c"}
    figure(f"agent {how} ({outage:.2f}s outage) while 2 nodes waited: round sealed "
           f"{took:.2f}s after the restart began")


def test_agent_down_longer_than_consul_timeout(fresh_cluster, fresh_agent):
    cluster = fresh_cluster
    settings = cluster.settings(min_nodes=2, max_nodes=2, consul_timeout=1.5,
                                join_timeout=6.0, close_timeout=1.0)
    a = cluster.node("a", settings)
    started = time.monotonic()
    pending = cluster.start([a])
    wait_for(lambda: (cluster.leader() or Leader("", "", 0)).node == "a", 5,
             "a waits, coordinating")
    stopped = time.monotonic()  # the outage starts during stop()
    fresh_agent.stop()
    with pytest.raises(RendezvousConnectionError) as info:
        cluster.gather(pending, timeout=settings.join_timeout + 10)
    took = time.monotonic() - stopped
    assert fresh_agent.address in str(info.value)
    # (a call already in flight when Consul went away may have started its budget a bit earlier)
    assert took >= 0.9 * settings.consul_timeout, "the outage was not ridden out"
    assert took < settings.consul_timeout + 3, "retried much longer than consul_timeout"
    assert time.monotonic() - started < settings.join_timeout, "retried past join_timeout"
    # a joiner that starts while the agent is down fails the same way, after consul_timeout
    b = cluster.node("b", settings)
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=re.escape(fresh_agent.address)):
        cluster.rounds([b], timeout=settings.consul_timeout + 10)
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
def test_corrupt_or_foreign_values_are_refused(cluster, key, value):
    full_key = f"{cluster.keys.prefix}/{key}"
    assert cluster.admin.kv_put(full_key, value)
    node = cluster.node("a", cluster.settings(min_nodes=1, max_nodes=1))
    with pytest.raises(RendezvousStateError) as info:
        cluster.rounds([node], timeout=20)
    assert full_key in str(info.value)
    if key != "round/current":
        assert cluster.current_round() is None, "a round was sealed over foreign state"


# ============================================================================ 10. closed runs


def test_close_releases_every_waiter_and_refuses_joiners(cluster):
    settings = cluster.settings(min_nodes=3, max_nodes=3)
    a, b, closer, late = (cluster.node(i, settings) for i in ("a", "b", "closer", "late"))
    pending = cluster.start([a, b])
    wait_for(lambda: {"a", "b"} <= set(cluster.members()), 5, "a and b wait")
    assert not closer.is_closed()

    started = time.monotonic()
    closer.close("test says stop")
    for node_id, future in pending.items():
        with pytest.raises(RendezvousClosedError, match="test says stop"):
            future.result(timeout=5)
        assert node_id
    took = time.monotonic() - started
    assert took < 3, f"waiters released {took:.2f}s after close()"
    assert not cluster.members(), "closed waiters withdraw their member keys"

    started = time.monotonic()
    with pytest.raises(RendezvousClosedError):
        cluster.rounds([late], timeout=10)
    assert time.monotonic() - started < 2
    assert all(n.is_closed() for n in (a, b, closer, late))
    assert not cluster.members()
    figure(f"close(): waiters got RendezvousClosedError after {took * 1000:.0f}ms")


def test_leave_never_closes_the_run(cluster):
    settings = cluster.settings(min_nodes=1, max_nodes=1)
    a, b = cluster.node("a", settings), cluster.node("b", settings)
    first = cluster.rounds([a], timeout=20)
    assert_round_ok(first, 1, 1)
    assert a.leave()
    assert a.leave(), "leave() is idempotent"
    assert not b.is_closed()
    second = cluster.rounds([b], timeout=20)
    assert_round_ok(second, 1, 1)
    assert one(second).round == 2
    with pytest.raises(RendezvousStateError, match="has left"):
        a.next_round()


# ============================================================================ 11. rank policies


def test_natural_rank_policy(cluster):
    settings = cluster.settings(min_nodes=4, max_nodes=4, rank_policy="natural")
    hosts = {"w": "node10", "x": "node9", "y": "node1", "z": "node2"}
    nodes = [cluster.node(n, settings, host=h) for n, h in hosts.items()]
    results = cluster.rounds(nodes, timeout=20)
    assert_round_ok(results, 4, 4)
    assert one(results).hosts == ["node1", "node2", "node9", "node10"]
    assert one(results).participants == ["y", "z", "x", "w"]


def test_topology_rank_policy(cluster):
    spec = {  # node: (host, zone, rack)
        "p": ("h1", "zone-b", "r1"),
        "q": ("h2", "zone-a", "r10"),
        "r": ("h3", "zone-a", "r2"),
        "s": ("h0", "zone-a", "r2"),
    }
    nodes = []
    for node_id, (host, zone, rack) in spec.items():
        settings = cluster.settings(min_nodes=4, max_nodes=4, rank_policy="topology",
                                    topology_keys=("zone", "rack"),
                                    node_meta={"zone": zone, "rack": rack})
        nodes.append(cluster.node(node_id, settings, host=host))
    results = cluster.rounds(nodes, timeout=20)
    assert_round_ok(results, 4, 4)
    assert one(results).participants == ["s", "r", "q", "p"]
    assert one(results).hosts == ["h0", "h3", "h2", "h1"]


def test_explicit_rank_policy_and_duplicate_ranks(cluster):
    def explicit(rank):
        return cluster.settings(min_nodes=3, max_nodes=3, rank_policy="explicit", node_rank=rank)

    nodes = [cluster.node("a", explicit(2)), cluster.node("b", explicit(0))]
    pending = cluster.start(nodes)
    wait_for(lambda: {"a", "b"} <= set(cluster.members()), 5, "a and b wait")
    dup = cluster.node("dup", explicit(0))
    with pytest.raises(RendezvousStateError) as info:
        cluster.rounds([dup], timeout=10)
    assert "b" in str(info.value).split() and "dup" in str(info.value).split()
    assert "dup" not in cluster.members()
    pending.update(cluster.start([cluster.node("c", explicit(1))]))
    results = cluster.gather(pending, timeout=20)
    assert_round_ok(results, 3, 3)
    assert ranks_of(results) == {"a": 2, "b": 0, "c": 1}


def test_stable_rank_policy_survivor_keeps_rank_newcomer_fills_the_hole(cluster):
    settings = cluster.settings(min_nodes=3, max_nodes=3)
    nodes = {i: cluster.node(i, settings) for i in "abc"}
    first = cluster.rounds(nodes.values(), timeout=20)
    assert_round_ok(first, 3, 3)
    by_rank = {r.rank: node for node, r in first.items()}
    assert nodes[by_rank[1]].leave()
    survivors = [nodes[by_rank[0]], nodes[by_rank[2]]]
    newcomer = cluster.node("d", settings)
    second = cluster.rounds([*survivors, newcomer], timeout=20)
    assert_round_ok(second, 3, 3)
    assert ranks_of(second) == {by_rank[0]: 0, by_rank[2]: 2, "d": 1}


# ============================================================================ 12. service


def test_service_instance_is_visible_in_consul_and_leave_cleans_up(cluster):
    settings = cluster.settings(min_nodes=1, max_nodes=1, node_meta={"zone": "z1"})
    node = cluster.node("a", settings, host="host-a")

    def instance():
        entries = cluster.admin.health_service(settings.service, passing=True).data
        mine = [e for e in entries if e["Service"]["ID"] == node.service_id]
        return mine[0] if mine else None

    result = one(cluster.rounds([node], timeout=20))
    entry = wait_for(lambda: (e := instance()) and e["Service"]["Meta"].get("round") == "1" and e,
                     5, "service meta shows the round")
    meta = entry["Service"]["Meta"]
    assert meta["run_id"] == cluster.run_id and meta["node_id"] == "a"
    assert meta["host"] == "host-a" and meta["zone"] == "z1"
    assert meta["rank"] == str(result.rank) and meta["state"] == "training"
    assert all(check["Status"] == "passing" for check in entry["Checks"])

    session = node.session_id
    assert node.leave()
    wait_for(lambda: instance() is None, 5, "the service is deregistered")
    assert not cluster.admin.health_service(settings.service, passing=False).data
    assert "a" not in cluster.members()
    assert cluster.admin.session_info(session) is None


# ============================================================================ 13. no requests


def test_num_nodes_waiting_makes_no_consul_request(cluster):
    # a long heartbeat interval (10 s) keeps the background threads quiet during the count
    settings = cluster.settings(min_nodes=1, max_nodes=1, heartbeat_timeout=30.0)
    node = cluster.node("a", settings)
    one(cluster.rounds([node], timeout=20))
    wait_for(lambda: any(e["Service"]["Meta"].get("round") == "1" for e in
                         cluster.admin.health_service(settings.service).data),
             5, "the heartbeat published the round (its last request for a while)")
    before = node.client.requests_sent
    values = [node.num_nodes_waiting() for _ in range(100)]
    after = node.client.requests_sent
    assert after == before
    assert values == [0] * 100


# ============================================================================ 14. join timeout


def test_join_timeout_says_how_many_nodes_were_present(cluster):
    settings = cluster.settings(min_nodes=3, max_nodes=3, join_timeout=1.5)
    nodes = [cluster.node(i, settings) for i in "ab"]
    started = time.monotonic()
    pending = cluster.start(nodes)
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
    assert not cluster.members(), "nodes that gave up withdrew their member keys"
    assert cluster.leader() is None, "a node that gave up released the coordinator role"


def test_timed_out_node_does_not_hold_back_later_rounds(cluster):
    impatient = cluster.node("impatient", cluster.settings(min_nodes=2, max_nodes=2,
                                                            join_timeout=1.0))
    with pytest.raises(RendezvousTimeoutError):
        cluster.rounds([impatient], timeout=10)
    # it gave up, but its process lives on: it must neither coordinate nor be a candidate
    settings = cluster.settings(min_nodes=2, max_nodes=2, join_timeout=15.0)
    results = cluster.rounds([cluster.node("x", settings), cluster.node("y", settings)],
                             timeout=20)
    assert_round_ok(results, 2, 2)
    assert "impatient" not in one(results).participants


# ============================================================================ names


@pytest.mark.parametrize("node_id", [".", "..", "a/b", "a b", "x" * 161])
def test_bad_node_ids_are_refused(node_id):
    settings = RendezvousSettings(run_id="r")
    with pytest.raises(ValueError, match="node id"):
        ConsulRendezvous(settings, node_id=node_id)


def test_dotted_names_keep_every_key_inside_the_run_prefix(cluster):
    settings = cluster.settings(key_prefix=f"{cluster.prefix}/v1.0/...", min_nodes=2,
                                max_nodes=2)
    nodes = [cluster.node(i, settings) for i in ("a.1", "...")]
    results = cluster.rounds(nodes, timeout=20)
    assert_round_ok(results, 2, 2)
    ours = [k for k in cluster.admin.kv_keys("") if cluster.prefix in k]
    assert sorted(ours) == sorted(f"{settings.prefix}/{k}" for k in
                                  ("members/a.1", "members/...", "round/leader",
                                   "round/current"))


def test_session_is_created_if_the_check_went_critical_before_it(agent, prefix):
    """A slow agent can let the fresh TTL check expire before the session request is served."""
    settings = RendezvousSettings(run_id="slow-agent", key_prefix=prefix, heartbeat_timeout=2)
    node = ConsulRendezvous(settings, agent.client(), node_id="slow")
    node._register_service(time.monotonic() + 10)
    node.client.agent_check_update(node.check_id, "fail")
    try:
        session = node._create_session(time.monotonic() + 10)
        info = node.client.session_info(session)
        assert info is not None
        assert [c["ID"] for c in info.get("ServiceChecks") or []] == [node.check_id]
        node.client.session_destroy(session)
    finally:
        node.client.agent_service_deregister(node.service_id)
