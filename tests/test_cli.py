"""``consul-rdzv`` as a user runs it: real subprocesses (``python -m consul_rdzv.cli``) against a
real dev agent and a running run of ``ConsulRendezvous`` nodes in threads.

Every test waits on conditions with deadlines, never on fixed sleeps.
"""

from __future__ import annotations

import calendar
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rdzv_nodes import HB, Cluster, figure, signals_of, wait_for

from consul_rdzv import __version__
from consul_rdzv.cli import build_parser, fmt_duration, heartbeat_time, parse_duration
from consul_rdzv.errors import RendezvousClosedError
from consul_rdzv.layout import Round
from consul_rdzv.rendezvous import ConsulRendezvous
from consul_rdzv.runs import Verdict, gc_verdict
from consul_rdzv.testing import free_port

pytestmark = pytest.mark.timeout(600)  # a hang guard: CLI_DEADLINE per command

CLI = [sys.executable, "-m", "consul_rdzv.cli"]
#: How long a test waits for a CLI process's first output and for a whole command (deadlines
#: for an interpreter starting on a loaded machine, not claims about speed), and how long a
#: node waits for a round the test completes later.
FIRST_OUTPUT = 60
CLI_DEADLINE = 120
LONG_WAIT = 600.0


def cli(*args: str, env: dict[str, str] | None = None,
        timeout: float = CLI_DEADLINE) -> subprocess.CompletedProcess:
    """One ``consul-rdzv`` command; the environment is the test's (CONSUL_HTTP_ADDR from the
    ``agent`` fixture, or the conftest's address where nothing listens)."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_error_line(proc: subprocess.CompletedProcess, command: str) -> str:
    """The failed command's stderr: exactly one line, ``consul-rdzv <command>: ...``."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"consul-rdzv {command}: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def training(nodes: Cluster, n: int, *, waiting: int = 0, max_nodes: int | None = None) -> list:
    """``n`` nodes in a sealed round (min = max = n unless ``max_nodes``), plus ``waiting``
    nodes beside the full round."""
    settings = nodes.settings(min_nodes=n, max_nodes=max_nodes or n)
    ns = [nodes.node(f"node-{i}", settings) for i in range(n)]
    nodes.rounds(ns, 30)
    # a spare waits until the test ends (its join timeout must not end it while the CLI runs)
    spare_settings = settings.with_(join_timeout=LONG_WAIT)
    spares = [nodes.node(f"spare-{i}", spare_settings) for i in range(waiting)]
    nodes.start(spares)
    wait_for(lambda: len(nodes.members()) == n + waiting, 15, "the spares' member keys")
    return ns + spares


# ----------------------------------------------------------------------------- no Consul needed


def test_version_help_and_usage_errors():
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"consul-rdzv {__version__}"
    # every option and positional argument of every command has a help text
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "status" in a.choices)
    for name, p in [("consul-rdzv", parser), *sub.choices.items()]:
        for action in p._actions:
            if action.dest not in ("help", "command"):
                assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    usage = cli("status")  # RUN missing
    assert usage.returncode == 2 and "RUN" in usage.stderr
    bad_id = cli("status", "a/b")
    assert bad_id.returncode == 2, bad_id.stderr
    assert bad_id.stderr.startswith("consul-rdzv status: run_id 'a/b' is invalid")
    assert cli("gc", "--older-than", "soon").returncode == 2


def test_helpers():
    beat = heartbeat_time("round 5 · rank 3/8 · training · heartbeat 2026-12-03T16:40:01.123Z")
    assert beat == pytest.approx(calendar.timegm((2026, 12, 3, 16, 40, 1, 0, 0, 0)) + 0.123)
    assert heartbeat_time("joining") is None
    assert [fmt_duration(s) for s in (0.42, 42, 185, 7800, 200000)] == \
        ["0.4s", "42s", "3m05s", "2h10m", "2d7h"]
    assert [parse_duration(t) for t in ("90", "30s", "10m", "2h", "1d")] == \
        [90, 30, 600, 7200, 86400]


def test_gc_verdicts():
    def verdict(*, invalid=False, nodes=0, closed=False, passing=0, idle=None, older_than=600):
        return gc_verdict(invalid=invalid, nodes=nodes, closed=closed, passing=passing,
                          idle=idle, older_than=older_than)

    assert verdict(invalid=True, closed=True, idle=1e9) is Verdict.INVALID
    assert verdict(nodes=1, closed=True, idle=1e9) is Verdict.LIVE
    assert verdict(closed=True, passing=2, idle=0) is Verdict.CLOSED
    assert verdict(passing=1, idle=1e9) is Verdict.STARTING
    assert verdict(idle=599) is Verdict.RECENT
    assert verdict(idle=600) is verdict() is Verdict.ABANDONED
    assert verdict(idle=0, older_than=0) is Verdict.ABANDONED
    assert {v for v in Verdict if v.delete} == {Verdict.CLOSED, Verdict.ABANDONED}


def test_unreachable_consul_is_one_line():
    port = free_port()  # nothing listens there
    started = time.monotonic()
    proc = cli("status", "job", "--address", f"127.0.0.1:{port}", "--consul-timeout", "1")
    line = one_error_line(proc, "status")
    assert f"127.0.0.1:{port}" in line and "did not answer" in line, line
    assert "--address" in line
    assert time.monotonic() - started < 20


# ----------------------------------------------------------------------------- reading a run


def test_list_and_status_of_a_running_run(agent, nodes, prefix):
    training(nodes, 2, waiting=1)
    # the global option after the command, and (next) before it
    listed = cli("list", "--key-prefix", prefix)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["RUN", "STATE", "ROUND", "WORLD", "NODES", "MIN:MAX",
                              "COORDINATOR", "AGE"]
    assert len(rows) == 1 and rows[0].split()[:6] == [nodes.run_id, "training", "1", "2", "3",
                                                      "2:2"], listed.stdout
    doc = json.loads(cli("--key-prefix", prefix, "list", "--json").stdout)
    (row,) = doc["runs"]
    assert (row["run_id"], row["state"], row["world_size"], row["nodes"]) == (
        nodes.run_id, "training", 2, 3)

    text = cli("status", nodes.run_id, "--key-prefix", prefix)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    leader = nodes.leader().node
    for expected in (f"coordinator:   {leader}", "min/max:       2/2 nodes", "round:         1, "
                     "world size 2", "trainer store: node-", "waiting:       spare-0"):
        assert expected in out, out
    assert "RANK  NODE" in out and "HEARTBEAT" in out and f" {HB:g}s " in out

    status = json.loads(cli("status", nodes.run_id, "--key-prefix", prefix, "--json").stdout)
    assert status["state"] == "training" and status["round"] == 1
    assert (status["min_nodes"], status["max_nodes"]) == (2, 2)
    assert status["coordinator"] == leader
    current = nodes.current_round()
    assert status["store"] == f"{current.store['host']}:{current.store['port']}"
    ranked = [n for n in status["nodes"] if n["rank"] is not None]
    assert [n["node"] for n in ranked] == current.ranks
    for n in ranked:
        assert n["state"] == "active" and n["health"] == "passing", n
        assert n["ttl"] == f"{HB:g}s", n  # the check's TTL, from the instance's meta
        assert n["address"] == f"{n['node']}.store.test"  # the advertised store host
    # heartbeats are read from the agent that holds the checks: seconds old, never minutes
    wait_for(lambda: all(
        n["heartbeat_source"] == "agent" and n["heartbeat_age"] is not None
        and -1 < n["heartbeat_age"] < 5
        for n in json.loads(cli("status", nodes.run_id, "--key-prefix", prefix,
                                "--json").stdout)["nodes"]), 15, "fresh heartbeats")
    assert status["waiting"] == ["spare-0"]
    (spare,) = [n for n in status["nodes"] if n["rank"] is None]
    assert spare["state"] == "waiting"


def test_status_shows_a_dead_node_as_critical_or_gone(agent, nodes, prefix):
    ns = training(nodes, 2)
    sealed = nodes.current_round()
    victim = next(n for n in ns if n.node_id == sealed.ranks[0])  # rank 0: hosts the store
    victim.halt()  # as if SIGKILLed: its check lapses after the TTL

    def victim_row() -> dict:
        doc = json.loads(cli("status", nodes.run_id, "--key-prefix", prefix, "--json").stdout)
        return next(n for n in doc["nodes"] if n["node"] == victim.node_id)

    wait_for(lambda: victim_row()["state"] == "gone", 20, "the killed node shown as gone")
    assert json.loads(cli("status", nodes.run_id, "--key-prefix", prefix,
                          "--json").stdout)["state"] == "re-forming"
    # Once Consul has reaped its service instance too (done here at once, as the agent's
    # DeregisterCriticalServiceAfter would), the gone rank 0 is still shown at the address it
    # advertised, the round's trainer store, not at its host name.
    nodes.admin.agent_service_deregister(victim.registration.service_id)
    wait_for(lambda: victim_row()["health"] is None, 10, "the killed node's service reaped")
    row = victim_row()
    assert row["state"] == "gone" and row["rank"] == 0, row
    assert row["address"] == sealed.store["host"] == f"{victim.node_id}.store.test", row


def test_no_such_run_exits_1(agent, prefix):
    proc = cli("status", "no-such-job", "--key-prefix", prefix)
    line = one_error_line(proc, "status")
    assert "no such run 'no-such-job'" in line and f"{prefix}/no-such-job/" in line, line
    assert proc.stdout == ""
    listed = cli("list", "--key-prefix", prefix)
    assert listed.returncode == 0 and "no runs under" in listed.stdout


def test_explicit_address_beats_the_environment(agent, nodes, prefix):
    training(nodes, 1)
    nowhere = {"CONSUL_HTTP_ADDR": f"127.0.0.1:{free_port()}"}
    proc = cli("status", nodes.run_id, "--address", agent.address, "--key-prefix", prefix,
               env=nowhere)
    assert proc.returncode == 0, proc.stderr


def test_acl_denied_is_one_line_naming_the_rule(acl_agent, prefix, tmp_path):
    admin = acl_agent.client()
    admin.kv_put(f"{prefix}/job/round/current", Round(round=0).encode())
    for args in (["list"], ["status", "job"], ["close", "job"]):
        proc = cli("--address", acl_agent.address, *args, "--key-prefix", prefix)
        line = one_error_line(proc, args[0])
        assert "key_prefix" in line and f'"{prefix}/' in line and "read" in line, line
    assert admin.kv_get(f"{prefix}/job/round/current").data.value == Round(round=0).encode()
    token = tmp_path / "token"
    token.write_text(acl_agent.management_token)
    ok = cli("--address", acl_agent.address, "--token-file", str(token), "list",
             "--key-prefix", prefix)
    assert ok.returncode == 0 and "job" in ok.stdout, ok.stderr
    admin.close()


# ----------------------------------------------------------------------------- watch


class Lines(threading.Thread):
    """The stdout lines of a running process, on a queue."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.proc = proc
        self.lines: queue.Queue = queue.Queue()
        self.start()

    def run(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def until(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line for {what} in {timeout:g}s") from None
            if line is None:
                raise AssertionError(f"the process ended before {what}: "
                                     f"{self.proc.stderr.read()}")
            if predicate(line):
                return line


def test_watch_prints_a_frame_per_change_and_stops_at_its_timeout(agent, nodes, prefix):
    settings = nodes.settings(min_nodes=2, max_nodes=2, join_timeout=LONG_WAIT)
    first = nodes.node("node-a", settings)
    nodes.start([first])
    wait_for(lambda: "node-a" in nodes.members(), 15, "node-a waiting")
    started = time.monotonic()
    proc = subprocess.Popen([*CLI, "watch", nodes.run_id, "--key-prefix", prefix, "--json",
                             "--timeout", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = Lines(proc)
        frame = json.loads(lines.until(lambda line: True, FIRST_OUTPUT, "the first frame"))
        watching = time.monotonic()  # (the watch's 8 s began after its interpreter started)
        assert frame["state"] == "waiting" and frame["waiting"] == ["node-a"], frame
        nodes.start([nodes.node("node-b", settings)])  # the second node joins: the round seals
        line = lines.until(lambda line: json.loads(line)["state"] == "training", 15,
                           "a frame of the sealed round")
        sealed = json.loads(line)
        assert sorted(n["node"] for n in sealed["nodes"]) == ["node-a", "node-b"]
        assert proc.wait(timeout=CLI_DEADLINE) == 0, proc.stderr.read()
        ended = time.monotonic()
        assert ended - started >= 8, ended - started
        assert ended - watching < 16, ended - watching
    finally:
        proc.kill()
        proc.wait()


def test_watch_shows_nothing_new_while_its_queries_time_out_on_a_healthy_run(agent, nodes,
                                                                             prefix):
    """Index discipline: with 1 s queries, each of them times out several times over 6 s on a
    run where nothing changes; a timed-out answer is no change, so one frame only."""
    training(nodes, 1)
    proc = subprocess.run([*CLI, "watch", nodes.run_id, "--key-prefix", prefix, "--json",
                           "--wait", "1", "--timeout", "6"], capture_output=True, text=True,
                          timeout=CLI_DEADLINE)
    assert proc.returncode == 0, proc.stderr
    frames = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(frames) == 1, frames
    assert frames[0]["state"] == "training"
    bad = subprocess.run([*CLI, "watch", nodes.run_id, "--key-prefix", prefix, "--wait", "11m"],
                         capture_output=True, text=True, timeout=CLI_DEADLINE)
    assert bad.returncode == 2 and "at most 10 minutes" not in bad.stdout, bad
    assert "--wait 660s: give 1s to 10m" in bad.stderr, bad.stderr


def test_watch_text_frames_and_ctrl_c_exits_0(agent, nodes, prefix):
    training(nodes, 1)
    proc = subprocess.Popen([*CLI, "watch", nodes.run_id, "--key-prefix", prefix],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc)
        head = lines.until(lambda line: line.startswith("---"), FIRST_OUTPUT, "the frame header")
        assert f"{nodes.run_id}: training, round 1, world 1" in head, head
        lines.until(lambda line: "RANK" in line, 30, "the rank table")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=CLI_DEADLINE) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------- changing runs


def test_drain_takes_a_node_out_and_the_job_reforms(agent, nodes, prefix):
    ns = [nodes.node(f"node-{i}", nodes.settings(min_nodes=2, max_nodes=3)) for i in range(3)]
    nodes.rounds(ns, 30)
    victim, others = ns[2], ns[:2]
    proc = cli("drain", nodes.run_id, victim.node_id, "--key-prefix", prefix,
               "--reason", "bad GPU")
    assert proc.returncode == 0, proc.stderr
    assert "re-rendezvous" in proc.stdout and "leaves the run for good" in proc.stdout, \
        proc.stdout
    assert victim.node_id not in nodes.members()
    wait_for(lambda: all(n.num_nodes_waiting() >= 1 for n in others), 10,
             "the others see the drained node gone")
    # the drained process leaves for good, as if stopped: its next round is refused, the
    # others re-form without it, and its drain request is consumed
    with pytest.raises(RendezvousClosedError, match=r"was drained .*\(bad GPU\)"):
        victim.next_round()
    second = nodes.rounds(others, timeout=30)
    assert {r.world_size for r in second.values()} == {2}
    assert victim.node_id not in nodes.members()
    assert nodes.admin.kv_keys(f"{nodes.keys.prefix}/drain/") == []
    missing = cli("drain", nodes.run_id, "nobody", "--key-prefix", prefix)
    assert "is not in run" in one_error_line(missing, "drain")


def _drain_to_training(nodes, prefix, *, spare: bool) -> tuple[float, dict]:
    """a and b train (max 2), c waits beside the full round if ``spare``; b is drained (with
    --replace when a spare waits). Seconds from the drain's end to the next round, and it."""
    s = nodes.settings(min_nodes=1, max_nodes=2)
    a, b = nodes.node("a", s), nodes.node("b", s)
    first = nodes.rounds([a, b], 30)
    assert {r.round for r in first.values()} == {1}
    pending = {}
    if spare:
        pending = nodes.start([nodes.node("c", s)])
        wait_for(lambda: "c" in nodes.members(), 30, "the spare's key")
        assert a.num_nodes_waiting() == 0  # a spare beside a full round restarts nobody
    args = ["drain", nodes.run_id, "b", "--key-prefix", prefix] + (["--replace"] if spare else [])
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    began = time.monotonic()
    if spare:
        assert "Waiting to take its slot: c" in proc.stdout, proc.stdout
    wait_for(lambda: a.num_nodes_waiting() >= 1, 10, "a sees b gone")
    pending.update(nodes.start([a]))
    second = nodes.gather(pending, 30)
    return time.monotonic() - began, second


def test_drain_replace_hands_the_slot_to_the_waiting_spare_in_one_round_change(nodes, prefix):
    took, second = _drain_to_training(nodes, prefix, spare=True)
    # one round change: round 2 is a and the spare, nobody needs a third round
    assert {k: (r.round, r.world_size) for k, r in second.items()} == {"a": (2, 2), "c": (2, 2)}
    figure(f"drain --replace with a spare waiting: round 2 of a and the spare {took:.3f}s after "
           "the drain (one restart)")


def test_a_node_that_leaves_while_a_spare_waits_is_replaced_in_one_round_change(nodes):
    """Make before break without an operator: a node stopped gracefully (torch's shutdown()
    leaves) hands its slot to the spare waiting beside the full round, in the same change."""
    s = nodes.settings(min_nodes=1, max_nodes=2)
    a, b = nodes.node("a", s), nodes.node("b", s)
    nodes.rounds([a, b], 30)
    pending = nodes.start([nodes.node("c", s)])
    wait_for(lambda: "c" in nodes.members(), 30, "the spare's key")
    assert b.leave(timeout=10)
    began = time.monotonic()
    wait_for(lambda: a.num_nodes_waiting() >= 1, 10, "a sees b gone")
    pending.update(nodes.start([a]))
    second = nodes.gather(pending, 30)
    assert {k: (r.round, r.world_size) for k, r in second.items()} == {"a": (2, 2), "c": (2, 2)}
    figure(f"a node left with a spare waiting: round 2 of a and the spare "
           f"{time.monotonic() - began:.3f}s after the leave")


def test_plain_drain_shrinks_the_job_in_one_round_change(nodes, prefix):
    took, second = _drain_to_training(nodes, prefix, spare=False)
    assert {k: (r.round, r.world_size) for k, r in second.items()} == {"a": (2, 1)}
    figure(f"plain drain, no spare: round 2 of a alone {took:.3f}s after the drain")


def test_drain_replace_without_a_spare_or_a_slot_changes_nothing(nodes, prefix):
    s = nodes.settings(min_nodes=1, max_nodes=2)
    ns = [nodes.node(n, s) for n in ("a", "b")]
    nodes.rounds(ns, 30)
    proc = cli("drain", nodes.run_id, "b", "--key-prefix", prefix, "--replace")
    assert "no spare waits in run" in one_error_line(proc, "drain")
    assert set(nodes.members()) == {"a", "b"}
    assert all(n.num_nodes_waiting() == 0 for n in ns)
    # a node waiting beside the round has no slot to hand over
    held = nodes.node("h", s)
    pending = nodes.start([held])
    wait_for(lambda: "h" in nodes.members(), 30, "h's key")
    proc = cli("drain", nodes.run_id, "h", "--key-prefix", prefix, "--replace")
    assert "is not in the current round" in one_error_line(proc, "drain")
    assert "h" in nodes.members()
    del pending


def test_close_stops_future_rounds_and_refuses_a_missing_run(agent, nodes, prefix):
    waiter = nodes.node("lonely", nodes.settings(min_nodes=2, max_nodes=2))
    (future,) = nodes.start([waiter]).values()
    wait_for(lambda: "lonely" in nodes.members(), 15, "the waiting node's key")
    proc = cli("close", nodes.run_id, "--key-prefix", prefix, "--reason", "maintenance window")
    assert proc.returncode == 0, proc.stderr
    assert "stops future rounds only" in proc.stdout and "keep training" in proc.stdout
    with pytest.raises(RendezvousClosedError, match="maintenance window"):
        future.result(timeout=15)
    status = json.loads(cli("status", nodes.run_id, "--key-prefix", prefix, "--json").stdout)
    assert status["state"] == "closed"
    # the closed marker a node writes (runs.close): an operator's close has outcome "closed"
    closed = status["closed"]
    assert (closed["reason"], closed["outcome"]) == ("maintenance window", "closed"), closed
    assert closed["by"].startswith("consul-rdzv close on ")

    admin = agent.client()
    missing = cli("close", "typo-job", "--key-prefix", prefix)
    assert "no such run 'typo-job'" in one_error_line(missing, "close")
    assert admin.kv_list(f"{prefix}/typo-job/").data == []
    admin.close()


def test_gc_lists_then_deletes_ended_and_abandoned_runs_only(agent, nodes, prefix):
    admin = agent.client()
    live = training(nodes, 1)[0]
    # an abandoned run: its only node died (its round stays behind once Consul drops its key)
    ghost = ConsulRendezvous(nodes.settings(run_id="abandoned-job", min_nodes=1, max_nodes=1),
                             node_id=f"ghost-{prefix}", host="ghost")
    ghost.next_round()
    ghost.halt()
    wait_for(lambda: admin.kv_keys(f"{prefix}/abandoned-job/") ==
             [f"{prefix}/abandoned-job/round/current"], 20, "the dead node's key gone")
    ghost.client.close()
    # an ended run: a closed marker nobody removed
    admin.kv_put(f"{prefix}/ended-job/round/current",
                 Round(closed={"reason": "done", "at": time.time(), "by": "test"}).encode())
    # a finished run whose last node left: its marker kept by a session (closed_retention)
    fin = ConsulRendezvous(nodes.settings(run_id="finished-job", min_nodes=1, max_nodes=1),
                           node_id=f"fin-{prefix}", host="fin")
    fin.close_if_current(fin.next_round(), "done", outcome="finished")
    fin.leave()
    fin.client.close()
    kept = admin.kv_get(f"{prefix}/finished-job/round/current").data
    assert kept is not None and kept.session

    dry = cli("gc", "--key-prefix", prefix, "--older-than", "0")
    assert dry.returncode == 0, dry.stderr
    assert "would delete 3 run(s)" in dry.stdout and "abandoned-job" in dry.stdout, dry.stdout
    plan = json.loads(cli("gc", "--key-prefix", prefix, "--older-than", "0", "--json").stdout)
    assert sorted(r["run_id"] for r in plan["would_delete"]) == [
        "abandoned-job", "ended-job", "finished-job"]
    assert [r["run_id"] for r in plan["kept"]] == [nodes.run_id]
    assert admin.kv_keys(f"{prefix}/abandoned-job/")  # a dry run deletes nothing
    young = json.loads(cli("gc", "--key-prefix", prefix, "--json").stdout)  # default 10m
    assert sorted(r["run_id"] for r in young["would_delete"]) == ["ended-job", "finished-job"]

    done = cli("gc", "--key-prefix", prefix, "--older-than", "0", "--yes")
    assert done.returncode == 0, done.stderr
    assert "deleted 3 run(s)" in done.stdout, done.stdout
    for job in ("abandoned-job", "ended-job", "finished-job"):
        assert admin.kv_keys(f"{prefix}/{job}/") == [], job
    assert admin.session_info(kept.session) is None, "gc left the kept marker's session"
    assert live.node_id in nodes.members() and nodes.current_round().round == 1
    assert live.num_nodes_waiting() == 0
    admin.close()


def test_demo_keep_is_documented():
    proc = cli("demo", "--help")
    assert proc.returncode == 0 and "--keep" in proc.stdout


def test_cli_reference_names_every_command_and_option():
    reference = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "status" in a.choices)
    for name, p in sub.choices.items():
        assert f"consul-rdzv {name}" in reference, name
        for action in p._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert option in reference, f"{name} {option} missing from docs/cli.md"


# ----------------------------------------------------------------------------- agent


def _http_get(host: str, port: int, path: str = "/v1/status/leader") -> int:
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def _start_agent(*args: str) -> tuple[subprocess.Popen, list[str]]:
    """``consul-rdzv agent ARGS`` in the background; its stdout lines once it is up."""
    proc = subprocess.Popen([*CLI, "agent", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while not any(line.startswith("export CONSUL_HTTP_ADDR=") for line in lines):
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"agent exited {proc.wait()}: {proc.stderr.read()}")
        lines.append(line.rstrip("\n"))
        assert time.monotonic() < deadline, lines
    return proc, lines


def _waits_for_its_stop_signal(pid: int) -> bool:
    """The command blocked the stop signals, or waits for them in sigwait (which unblocks the
    signals it waits for while it waits: /proc shows them blocked only until then)."""
    with open(f"/proc/{pid}/wchan") as wchan:
        return "sigtimedwait" in wchan.read() or signal.SIGTERM in signals_of(pid, "SigBlk")


def _stop_agent(proc: subprocess.Popen) -> str:
    # The command prints the address, then blocks the stop signals to sigwait for them: a
    # SIGTERM in between kills it (default disposition) and orphans its Consul agent.
    try:
        wait_for(lambda: _waits_for_its_stop_signal(proc.pid), 30,
                 "the agent command waiting for its stop signal")
    finally:
        proc.send_signal(signal.SIGTERM)  # (even after a failure: leave no agent behind)
    assert proc.wait(timeout=CLI_DEADLINE) == 0
    return proc.stderr.read()


@pytest.mark.consul
def test_agent_default_is_local_only_and_quiet():
    proc, lines = _start_agent()
    try:
        address = lines[-1].split("=", 1)[1]
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1"
        assert _http_get(host, int(port)) == 200
    finally:
        stderr = _stop_agent(proc)
    assert "WARNING" not in stderr and "other hosts" not in "\n".join(lines)


@pytest.mark.consul
def test_agent_bind_serves_that_address_only_with_a_loud_warning():
    """--bind 127.0.0.2 --port P: the HTTP API answers at 127.0.0.2:P (where another host
    would reach it), not at 127.0.0.1:P; the warning says it is unsecured."""
    port = free_port("127.0.0.2")
    proc, lines = _start_agent("--bind", "127.0.0.2", "--port", str(port))
    try:
        text = "\n".join(lines)
        assert f"Consul dev agent at http://127.0.0.2:{port}" in text, text
        assert lines[-1] == f"export CONSUL_HTTP_ADDR=127.0.0.2:{port}", text
        assert _http_get("127.0.0.2", port) == 200
        with pytest.raises(ConnectionRefusedError):
            _http_get("127.0.0.1", port)
        # a job on "another host" uses it through CONSUL_HTTP_ADDR
        status = cli("list", "--key-prefix", "nothing-here",
                     env={"CONSUL_HTTP_ADDR": f"127.0.0.2:{port}"})
        assert status.returncode == 0, status.stderr
    finally:
        stderr = _stop_agent(proc)
    assert f"WARNING: this Consul dev agent listens on 127.0.0.2:{port} UNSECURED" in stderr
    assert "no ACLs, no TLS" in stderr


@pytest.mark.consul
def test_agent_address_option_is_honoured():
    port = free_port("127.0.0.3")
    proc, lines = _start_agent("--address", f"127.0.0.3:{port}")
    try:
        assert lines[-1] == f"export CONSUL_HTTP_ADDR=127.0.0.3:{port}"
        assert _http_get("127.0.0.3", port) == 200
    finally:
        assert "UNSECURED" in _stop_agent(proc)


@pytest.mark.parametrize(("args", "message"), [
    (["--bind", "localhost"], "give an IPv4 address of this host, or 0.0.0.0"),
    (["--bind", "::1"], "give an IPv4 address of this host"),
    (["--port", "70000"], "give a port between 1 and 65535"),
    (["--address", "https://127.0.0.2:8501"], "plain http only"),
    (["--address", "127.0.0.2:8500", "--bind", "127.0.0.2"], "not both"),
])
def test_agent_bad_listen_address_is_a_usage_error(args, message):
    proc = cli("agent", *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("consul-rdzv agent: ") and message in proc.stderr, proc.stderr


@pytest.mark.consul
def test_agent_port_in_use_is_one_clear_line():
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.2", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        proc = cli("agent", "--bind", "127.0.0.2", "--port", str(port))
    line = one_error_line(proc, "agent")
    assert f"port {port} on 127.0.0.2 is not free" in line, line
