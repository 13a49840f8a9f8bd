"""Quarantine across jobs (docs/health.md, "Quarantine"): a host that failed repeatedly, or that
an operator quarantined (``consul-rdzv quarantine add``), is held out of every run under the key
prefix until its cooldown ends or an operator clears it.

The policy (failures in a window, the exponential cooldown) is unit-tested without Consul.
Everything else runs on the shared dev agent: a quarantine is per host name (the member key's
``host``), so nodes of one process on one agent stand for separate hosts.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
from rdzv_nodes import Cluster, figure, stays, wait_for

from consul_rdzv import quarantine
from consul_rdzv.client import KVEntry
from consul_rdzv.errors import RendezvousStateError
from consul_rdzv.layout import Keys
from consul_rdzv.quarantine import Policy, add, cooldown, reason, record_failure
from consul_rdzv.settings import RendezvousSettings, settings_from_conf

# ---------------------------------------------------------------------------- the policy

POLICY = Policy(failures=3, window=600.0, cooldown=60.0, cooldown_max=300.0)


def test_the_cooldown_doubles_with_each_level_up_to_its_bound():
    assert [cooldown(POLICY, level) for level in (1, 2, 3, 4, 5)] == [60, 120, 240, 300, 300]


def test_failures_within_the_window_quarantine_the_host_and_older_ones_do_not_count():
    value = None
    for t in (1000.0, 1100.0):
        value = record_failure(value, host="gpu-7", now=t, policy=POLICY, what="w", by="n")
        assert not quarantine.active(value, t) and reason(value, t) == ""
    # a third failure after the first fell out of the window: still two
    value = record_failure(value, host="gpu-7", now=1650.0, policy=POLICY, what="w", by="n")
    assert value["failures"] == [1100.0, 1650.0] and not quarantine.active(value, 1650.0)
    value = record_failure(value, host="gpu-7", now=1690.0, policy=POLICY,
                           what="its workers failed", by="n3")
    assert value["until"] == 1750.0 and value["level"] == 1 and value["failures"] == []
    why = reason(value, 1690.0)
    assert why == ("host gpu-7 quarantined until 1970-01-01T00:29:10Z: 3 failures in 600s "
                   "(last: its workers failed, seen by node n3); quarantine level 1"), why
    assert reason(value, 1750.0) == ""  # the cooldown is over
    # a failure while quarantined is counted, nothing more
    during = record_failure(value, host="gpu-7", now=1720.0, policy=POLICY, what="w", by="n")
    assert during["until"] == 1750.0 and during["level"] == 1
    # the next quarantine lasts twice as long
    for t in (1800.0, 1801.0, 1802.0):
        value = record_failure(value, host="gpu-7", now=t, policy=POLICY, what="w", by="n")
    assert value["level"] == 2 and value["until"] == 1802.0 + 120.0
    # quiet for longer than the longest cooldown: back to level 1
    for t in (3000.0, 3001.0, 3002.0):
        value = record_failure(value, host="gpu-7", now=t, policy=POLICY, what="w", by="n")
    assert value["level"] == 1 and value["until"] == 3062.0


def test_with_recording_off_failures_are_kept_but_never_quarantine():
    off = Policy()
    value = None
    for t in range(10):
        value = record_failure(value, host="h", now=float(t), policy=off, what="w", by="n")
    assert not quarantine.active(value, 9.0) and len(value["failures"]) == 10


def test_an_operators_quarantine_keeps_the_level_and_says_who_and_why():
    value = add({"host": "h", "level": 2, "failures": [1.0]}, host="h", now=100.0, seconds=50,
                why="bad NIC", by="ops")
    assert value["until"] == 150.0 and value["level"] == 2 and value["by"] == "ops"
    assert reason(value, 120.0) == "host h quarantined until 1970-01-01T00:02:30Z: bad NIC"


def test_a_value_round_trips_and_a_foreign_value_is_refused_naming_the_key():
    value = add(None, host="h", now=1.0, seconds=5, why="x", by="y")
    entry = KVEntry(key="p/~quarantine/h", value=quarantine.encode(value), create_index=1,
                    modify_index=1, lock_index=0, flags=0, session=None)
    assert quarantine.decode(entry) == value
    with pytest.raises(RendezvousStateError, match="p/~quarantine/h"):
        quarantine.decode(KVEntry(key="p/~quarantine/h", value=b"hello", create_index=1,
                                  modify_index=1, lock_index=0, flags=0, session=None))


def test_the_key_is_outside_every_run_and_quotes_the_host():
    keys = Keys("team/rdzv/job7")
    assert keys.quarantine == "team/rdzv/~quarantine/"
    assert keys.quarantined("gpu-07") == "team/rdzv/~quarantine/gpu-07"
    assert keys.quarantined("a/b") == "team/rdzv/~quarantine/a%2Fb"


def test_the_quarantine_settings_parse_and_bad_values_are_refused():
    s = settings_from_conf("j", 1, 1, {"quarantine_failures": "3", "quarantine_window": "300",
                                       "quarantine_cooldown": "60",
                                       "quarantine_cooldown_max": "3600"})
    assert (s.quarantine_failures, s.quarantine_window, s.quarantine_cooldown,
            s.quarantine_cooldown_max) == (3, 300.0, 60.0, 3600.0)
    assert settings_from_conf("j", 1, 1, {}).quarantine_failures == 0
    with pytest.raises(ValueError, match="quarantine_failures"):
        settings_from_conf("j", 1, 1, {"quarantine_failures": "many"})
    with pytest.raises(ValueError, match="quarantine_failures"):
        RendezvousSettings(run_id="j", quarantine_failures=-1)
    with pytest.raises(ValueError, match="quarantine_cooldown_max"):
        RendezvousSettings(run_id="j", quarantine_cooldown=600, quarantine_cooldown_max=60)
    with pytest.raises(ValueError, match="quarantine_window"):
        RendezvousSettings(run_id="j", quarantine_window=0)


# ---------------------------------------------------------------------------- on a real agent


def cli(nodes: Cluster, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "consul_rdzv.cli", *args, "--key-prefix",
                           nodes.prefix], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CONSUL_HTTP_ADDR": nodes.agent.address})
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


def test_an_operators_quarantine_holds_the_host_out_says_why_and_clear_readmits_it(
        nodes, caplog):
    caplog.set_level(logging.INFO, logger="consul_rdzv")
    settings = nodes.settings(min_nodes=1, max_nodes=2)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    both = nodes.rounds([a, b], 30)
    assert sorted(both["a"].participants) == ["a", "b"]
    added = cli(nodes, "quarantine", "add", "b", "--for", "1h", "--reason", "bad NIC")
    assert "host b is quarantined until" in added.stdout
    # b trains: it leaves its round at once (health_evict), and the others re-form without it
    wait_for(lambda: a.num_nodes_waiting() >= 1, 15, "a sees b leave its round")
    futures = nodes.start([a, b])
    alone = futures["a"].result(30)
    assert alone.participants == ["a"]
    why = b.health_reason()
    assert why.startswith("host b quarantined until ") and why.endswith(": bad NIC"), why
    assert nodes.members()["b"].health == why
    assert any(why in r.getMessage() and "Node b " in r.getMessage() for r in caplog.records)
    # status shows it held out, quarantine list shows the host, the UI its service meta
    doc = json.loads(cli(nodes, "status", nodes.run_id, "--json").stdout)
    assert doc["held_out"] == {"b": why}, doc
    listed = json.loads(cli(nodes, "quarantine", "list", "--json").stdout)["hosts"]
    assert [(h["host"], h["quarantined"], h["reason"]) for h in listed] == [
        ("b", True, "bad NIC")]
    assert "bad NIC" in cli(nodes, "quarantine", "list").stdout
    wait_for(lambda: (nodes.admin.agent_service(b.service_id) or {}).get("Meta", {})
             .get("quarantined") == why, 15, "b's service meta names its quarantine")
    stays(lambda: not futures["b"].done() and a.num_nodes_waiting() == 0, 1.5,
          "a trains on beside the quarantined b")
    # cleared: b rewrites its key, a sees it waiting, and the next round takes it in
    assert "out of quarantine" in cli(nodes, "quarantine", "clear", "b").stdout
    wait_for(lambda: a.num_nodes_waiting() == 1, 15, "a sees b waiting once cleared")
    again = nodes.rounds([a], 30)["a"]
    assert sorted(again.participants) == ["a", "b"]
    assert futures["b"].result(30).round == again.round
    assert nodes.members()["b"].health == ""
    assert json.loads(cli(nodes, "quarantine", "list", "--json").stdout)["hosts"] == []
    # how fast a quarantine written in Consul takes a training node out (figure)
    started = time.monotonic()
    quarantine.update(nodes.admin, nodes.keys.quarantined("b"), lambda v: quarantine.add(
        v, host="b", now=time.time(), seconds=600, why="again", by="test"))
    wait_for(lambda: a.num_nodes_waiting() >= 1, 15, "a sees b leave its round again")
    figure(f"quarantine written -> the survivor sees the quarantined node leave its round: "
           f"{(time.monotonic() - started) * 1000:.0f} ms")


def test_a_host_failing_repeatedly_is_quarantined_for_other_runs_until_its_cooldown_ends(
        nodes, agent, prefix, tmp_path):
    cool = 6.0
    settings = nodes.settings(min_nodes=1, max_nodes=2, quarantine_failures=2,
                              quarantine_window=600.0, quarantine_cooldown=cool,
                              quarantine_cooldown_max=cool * 4)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    first = nodes.rounds([a, b], 30)
    assert sorted(first["a"].participants) == ["a", "b"]

    def b_fails() -> dict:
        """b asks for a new round while its round is intact (its workers failed); a follows
        once it sees b waiting, as a torchrun agent does (not a failure of a's)."""
        again = nodes.start([b])
        wait_for(lambda: a.num_nodes_waiting() >= 1, 15, "a sees b ask for a new round")
        again.update(nodes.start([a]))
        return again

    second = nodes.gather(b_fails(), 30)
    assert sorted(second["a"].participants) == ["a", "b"]
    value, _ = quarantine.read(nodes.admin, nodes.keys.quarantined("b"))
    assert value is not None and len(value["failures"]) == 1 and not value.get("until")
    assert quarantine.read(nodes.admin, nodes.keys.quarantined("a"))[0] is None
    # the second failure within the window quarantines host b
    futures = b_fails()
    alone = futures["a"].result(30)
    assert alone.participants == ["a"]
    value, _ = quarantine.read(nodes.admin, nodes.keys.quarantined("b"))
    assert value is not None and value["level"] == 1
    assert "2 failures in 600s (last: its workers failed, seen by node b)" in value["reason"]
    assert quarantine.active(value, time.time())
    # a second run on the same Consul: a node on host b is not admitted
    other = Cluster(agent, prefix, tmp_path, run_id=f"{nodes.run_id}-2")
    try:
        s2 = other.settings(min_nodes=1, max_nodes=2)
        c, b2 = other.node("c", s2), other.node("b2", s2, host="b")
        b2.register(timeout=30)
        wait_for(lambda: b2.health_reason().startswith("host b quarantined until"), 15,
                 "the other run's node on host b sees the quarantine")
        later = other.start([c, b2])
        solo = later["c"].result(30)
        assert solo.participants == ["c"]
        assert other.members()["b2"].health.startswith("host b quarantined until")
        # the cooldown ends: both runs' nodes on host b are admitted again
        wait_for(lambda: c.num_nodes_waiting() == 1, cool + 15, "c sees b2 once it is over")
        again = other.rounds([c], 30)["c"]
        assert sorted(again.participants) == ["b2", "c"]
        assert later["b2"].result(30).round == again.round
        wait_for(lambda: a.num_nodes_waiting() == 1, 15, "a sees b waiting once it is over")
        back = nodes.rounds([a], 30)["a"]
        assert sorted(back.participants) == ["a", "b"]
        assert futures["b"].result(30).round == back.round
    finally:
        other.shutdown()


def test_a_session_lost_while_training_counts_as_a_failure_of_the_host(nodes):
    """The other failure a node knows of: its Consul session lost while it trained (here
    destroyed from outside). One failure is the threshold: the host is quarantined at once,
    and the node's next announcement already carries the reason."""
    settings = nodes.settings(min_nodes=1, max_nodes=2, quarantine_failures=1,
                              quarantine_cooldown=600.0, quarantine_cooldown_max=600.0)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    nodes.rounds([a, b], 30)
    nodes.admin.session_destroy(b.session_id)
    wait_for(lambda: b.num_nodes_waiting() >= 1 and a.num_nodes_waiting() >= 1, 15,
             "both see b's session gone")
    futures = nodes.start([a, b])
    assert futures["a"].result(30).participants == ["a"]
    value, _ = quarantine.read(nodes.admin, nodes.keys.quarantined("b"))
    assert value is not None and quarantine.active(value, time.time())
    assert "its Consul session was lost while it trained" in value["reason"], value
    wait_for(lambda: "b" in nodes.members(), 15, "b announces itself again")
    assert nodes.members()["b"].health == b.health_reason() != ""
    assert quarantine.read(nodes.admin, nodes.keys.quarantined("a"))[0] is None
    assert not futures["b"].done()


@pytest.mark.parametrize(("args", "says"), [
    (["add"], "quarantine add needs a HOST"),
    (["clear"], "quarantine clear needs a HOST"),
    (["list", "gpu-1"], "quarantine list takes no HOST"),
    (["add", "a/b"], "host 'a/b' is invalid"),
    (["add", "gpu-1", "--for", "0"], "give a positive duration"),
])
def test_bad_quarantine_commands_get_one_usage_error(args, says):
    proc = subprocess.run([sys.executable, "-m", "consul_rdzv.cli", "quarantine", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CONSUL_HTTP_ADDR": "127.0.0.1:1"})
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("consul-rdzv quarantine: "), proc.stderr
    assert says in lines[0], lines[0]
