"""Nodes of a run for the protocol tests: threads (``ConsulRendezvous`` in this process) and
real child processes (``tests/node_process.py``), the invariants every round must satisfy, and
waiting helpers with deadlines (never fixed sleeps)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
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

from consul_rdzv.errors import RendezvousStateError
from consul_rdzv.layout import Keys, Leader, Member, Round
from consul_rdzv.rendezvous import ConsulRendezvous, RoundResult
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
    the world size, the rank map (participants), the store endpoint and the seal; the
    store is rank 0's endpoint; min_nodes <= W <= max_nodes; and exactly the participants got it.
    """
    assert results, "no results"
    first = next(iter(results.values()))
    world = first.world_size
    assert min_nodes <= world <= max_nodes, (world, min_nodes, max_nodes)
    assert len(first.participants) == world == len(set(first.participants)), first.participants
    assert set(results) == set(first.participants), (sorted(results), first.participants)
    assert sorted(r.rank for r in results.values()) == list(range(world))
    shared = ("run_id", "round", "world_size", "participants", "store", "coordinator",
              "seal_id", "members_index")
    for node_id, result in results.items():
        for name in shared:
            assert getattr(result, name) == getattr(first, name), (node_id, name, result, first)
        assert result.participants[result.rank] == node_id, (node_id, result.rank, result)
    assert first.round >= 1
    assert first.store == endpoint_for(first.participants[0]), first.store
    assert first.coordinator, first


def ranks_of(results: Mapping[str, RoundResult]) -> dict[str, int]:
    return {node: r.rank for node, r in results.items()}


def one(results: Mapping[str, RoundResult]) -> RoundResult:
    return next(iter(results.values()))


def wait_for(predicate: Callable[[], object], timeout: float, what: str,
             interval: float = 0.01, *, ignore: tuple[type[BaseException], ...] = (),
             detail: Callable[[], str] | None = None) -> object:
    """Poll ``predicate`` every ``interval`` seconds until it is truthy and return its value;
    fail after ``timeout`` seconds, saying ``what`` was awaited, the last value, and
    ``detail()`` (e.g. the logs of the processes involved). An exception of a class in
    ``ignore`` (e.g. Consul still down) counts as false. The one wait helper of the tests:
    poll what asks Consul or reads files less often (``interval`` 0.05-0.1)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignore as exc:
            value = exc
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            message = f"still false after {timeout:g}s: {what} (last value: {value!r:.300})"
            raise AssertionError(message + (f"\n{detail()}" if detail is not None else ""))
        time.sleep(interval)


def stays(predicate: Callable[[], bool], window: float, what: str) -> None:
    """Assert ``predicate`` holds throughout an observation window (for negative claims)."""
    end = time.monotonic() + window
    while time.monotonic() < end:
        assert predicate(), what
        time.sleep(0.005)


def signals_of(pid: int, kind: str) -> set[int]:
    """The signals process ``pid`` blocks (``kind`` "SigBlk"), ignores ("SigIgn") or catches
    ("SigCgt"), from /proc/PID/status (its main thread's mask for "SigBlk")."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith(f"{kind}:")), 16)
    return {sig for sig in range(1, 65) if mask & (1 << (sig - 1))}


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
                 join_timeout: float = 60.0, consul_timeout: float = 10.0,
                 node_rank: int | None = None, address: str | None = None,
                 store_port: int | None = None, host: str | None = None) -> None:
        self.node_id = node_id
        self.log_path = log_dir / f"{node_id}.{time.monotonic_ns()}.stderr.log"
        cmd = [sys.executable, str(NODE_SCRIPT), "--run-id", run_id, "--key-prefix", key_prefix,
               "--node-id", node_id, "--min", str(min_nodes), "--max", str(max_nodes),
               "--heartbeat", str(heartbeat), "--last-call", str(last_call),
               "--join-timeout", str(join_timeout), "--consul-timeout", str(consul_timeout)]
        if node_rank is not None:
            cmd += ["--node-rank", str(node_rank)]
        if store_port is not None:
            cmd += ["--store-port", str(store_port)]
        if host is not None:
            cmd += ["--host", host]
        env = {**os.environ, **agent.env()}
        if address is not None:  # e.g. a fault-injecting proxy in front of the agent
            env["CONSUL_HTTP_ADDR"] = address
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env=env, start_new_session=True,
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
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """The nodes of one test's run: settings, threads, processes and cleanup (the ``nodes``
    fixtures of tests/conftest.py). ``run_id`` defaults to the ``run_id`` fixture's
    ``run-<prefix>``: unique per test, as service ids are per agent, not per key prefix."""

    def __init__(self, agent, prefix: str, log_dir: Path, *, run_id: str | None = None) -> None:
        self.agent = agent
        self.prefix = prefix
        self.run_id = run_id or f"run-{prefix}"
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
