"""End-to-end: real ``torchrun`` agents (``python -m torch.distributed.run``) with the consul
backend against a real Consul dev agent, all on 127.0.0.1, training the demo's script
(``consul_rdzv/examples/train.py``) on gloo.

Every test has a hard timeout, kills every process it started in a ``finally`` (the
``TorchrunJob`` context manager), and puts every agent's log (``LOGLEVEL=INFO``) into its
assertion messages. The failure tests use torchrun's default rendezvous timeout (900 s): they
check that consul_timeout, not join_timeout, bounds how long a node waits for a broken Consul.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from torchrun_jobs import TorchrunJob, torch_log_times

from consul_rdzv.layout import Round

pytestmark = pytest.mark.slow

#: How long one job may take before the test gives up on it (each should take well under 30 s).
JOB_TIMEOUT = 150
#: A node facing a broken Consul must give up (and torchrun exit) within this.
FAIL_FAST = 20.0


def fast_conf(prefix: str) -> dict:
    return {"key_prefix": prefix, "heartbeat_timeout": 2, "last_call_timeout": 1,
            "join_timeout": 60}


def assert_trained_together(job: TorchrunJob, world_size: int) -> list[dict]:
    """Ranks 0..world-1 all finished in one world with identical parameters."""
    results = job.results()
    report = job.report()
    assert [r["rank"] for r in results] == list(range(world_size)), report
    assert {r["world_size"] for r in results} == {world_size}, report
    assert len({r["checksum"] for r in results}) == 1, f"parameters differ between ranks\n{report}"
    assert len({r["master"] for r in results}) == 1, report
    return results


def consul_rdzv_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "consul_rdzv.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def member_keys(agent, prefix: str, run_id: str) -> list[str]:
    client = agent.client()
    try:
        return client.kv_keys(f"{prefix}/{run_id}/members/")
    finally:
        client.close()


# ----------------------------------------------------------------------------- happy path


@pytest.mark.long
@pytest.mark.timeout(400)
def test_three_nodes_train_and_finish(agent, prefix, run_id, tmp_path):
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="3", rdzv_conf=fast_conf(prefix),
                     train_args=["--steps", "30"]) as job:
        started = time.monotonic()
        for i in range(3):
            job.start(f"node-{i}")
        codes = job.wait(JOB_TIMEOUT)
        took = time.monotonic() - started
        assert codes == {"node-0": 0, "node-1": 0, "node-2": 0}, job.report()
        results = assert_trained_together(job, 3)
        assert {r["restarts"] for r in results} == {0}, job.report()
        print(f"3-node torchrun job finished in {took:.1f}s")

    # torch's launcher called shutdown() on success: the run was closed as finished, every node
    # left, and the last one kept only the closed marker, shrunk, under a session with the
    # closed_retention TTL (Consul deletes both by itself): nothing else of the job stays.
    client = agent.client()
    marker = f"{prefix}/{run_id}/round/current"
    assert client.kv_keys(f"{prefix}/{run_id}/") == [marker], "keys of a finished job stayed"
    kept = client.kv_get(marker).data
    assert kept.session and client.session_info(kept.session)["TTL"] == "600s"
    assert Round.decode(kept).closed["outcome"] == "finished" and not Round.decode(kept).ranks
    left = [s for s in client.agent_services().values()
            if s.get("Service") == f"torchelastic-{run_id}"]
    assert left == [], f"services still registered after the job: {left}"
    assert client.health_service(f"torchelastic-{run_id}", passing=False).data == []


# ----------------------------------------------------------------------------- elasticity


@pytest.mark.long
@pytest.mark.timeout(400)
def test_killed_node_survivors_continue_in_a_smaller_world(agent, prefix, run_id, tmp_path):
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="2:3", max_restarts=3,
                     rdzv_conf=fast_conf(prefix),
                     train_args=["--steps", "60", "--step-time", "0.05"]) as job:
        for i in range(3):
            job.start(f"node-{i}")
        job.wait_for(lambda: len(job.starts(world_size=3)) == 3
                     and any(e["event"] == "step" and e["world_size"] == 3 and e["step"] >= 5
                             for e in job.progress()),
                     JOB_TIMEOUT, "all three ranks training in world 3")
        # Kill the node whose worker is rank 0: it also hosts the round's trainer store.
        rank0 = next(e for e in job.starts(world_size=3) if e["rank"] == 0)
        victim = next(a for a in job.agents if a.pid == rank0["agent_pid"])
        survivors = [a for a in job.agents if a is not victim]
        killed_at = time.time()
        victim.kill()

        codes = job.wait(JOB_TIMEOUT, survivors)
        assert all(codes[a.name] == 0 for a in survivors), f"{codes}\n{job.report()}"
        assert victim.proc.wait(5) == -9
        assert_trained_together(job, 2)

        rounds = sorted(t for a in survivors
                        for t in torch_log_times(a.log(), "Rendezvous complete") if t > killed_at)
        restarted = sorted(e["time"] for e in job.starts(world_size=2))
        assert rounds and restarted, job.report()
        kill_to_round = rounds[0] - killed_at
        kill_to_training = restarted[0] - killed_at
        print(f"kill -> survivors' next round: {kill_to_round:.2f}s; kill -> training again in "
              f"world 2: {kill_to_training:.2f}s (heartbeat_timeout 2s)")
        assert kill_to_round < 15, f"survivors took {kill_to_round:.1f}s\n{job.report()}"


@pytest.mark.long
@pytest.mark.timeout(400)
def test_failed_worker_group_restarts_and_finishes(agent, prefix, run_id, tmp_path):
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="2", max_restarts=1,
                     rdzv_conf=fast_conf(prefix),
                     train_args=["--steps", "20", "--step-time", "0.02",
                                 "--fail-once", "1:5"]) as job:
        for i in range(2):
            job.start(f"node-{i}")
        codes = job.wait(JOB_TIMEOUT)
        assert codes == {"node-0": 0, "node-1": 0}, job.report()
        assert (job.out / "failed-once").exists(), job.report()
        results = assert_trained_together(job, 2)
        report = job.report()
        failed = [a for a in job.agents if "injected failure" in a.log()]
        assert len(failed) == 1, report
        # restart_count is per agent, and which agent counts the failure is a race in torch's
        # monitor loop: the failed worker's agent sees its worker exit 1 (counted), unless the
        # other agent, whose worker died with its peer, re-rendezvoused first, so that it sees
        # a membership change (not counted). At least one agent must have used its restart.
        restarted = [a for a in job.agents
                     if "Worker group FAILED. 1/1 attempts left; will restart" in a.log()]
        assert restarted, report
        assert max(r["restarts"] for r in results) == 1, report
        assert all(r["restarts"] in (0, 1) for r in results), report
        # The worker of rank 1 failed once and was started again, in the same world.
        assert len([e for e in job.starts() if e["rank"] == 1]) == 2, report


@pytest.mark.timeout(400)
def test_late_node_joins_mid_training(agent, prefix, run_id, tmp_path):
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="2:3",
                     rdzv_conf=fast_conf(prefix),
                     train_args=["--steps", "100", "--step-time", "0.06"]) as job:
        # The late agent is started now but joins when the gate opens: mid-training, however
        # long its interpreter takes to import torch on a loaded machine.
        late = job.start("late", gated=True)
        for i in range(2):
            job.start(f"node-{i}")
        job.wait_for(lambda: len(job.starts(world_size=2)) == 2, JOB_TIMEOUT,
                     "two ranks training in world 2")
        job.open_gate(late)
        codes = job.wait(JOB_TIMEOUT)
        assert codes == {"node-0": 0, "node-1": 0, "late": 0}, job.report()
        results = assert_trained_together(job, 3)
        # A membership change is no failure: torch does not count it as a restart.
        assert {r["restarts"] for r in results} == {0}, job.report()
        assert len(job.starts(world_size=2)) == 2, job.report()


# ----------------------------------------------------------------------------- closed run


@pytest.mark.long
@pytest.mark.timeout(400)
def test_closed_run_ends_waiting_agents_and_a_new_job_reuses_the_run_id(agent, prefix, run_id,
                                                                       tmp_path):
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="3",
                     rdzv_conf=fast_conf(prefix), train_args=["--steps", "5"]) as job:
        waiting = [job.start(f"node-{i}") for i in range(2)]  # a third never comes
        job.wait_for(lambda: len(member_keys(agent, prefix, run_id)) == 2, JOB_TIMEOUT,
                     "both agents waiting in the rendezvous")
        closed = consul_rdzv_cli("--address", agent.address, "close", run_id,
                                 "--key-prefix", prefix, "--reason", "test says stop")
        assert closed.returncode == 0, closed.stderr
        closed_at = time.monotonic()
        codes = job.wait(30, waiting)
        took = time.monotonic() - closed_at
        report = job.report()
        assert all(c not in (0, None) for c in codes.values()), f"{codes}\n{report}"
        assert took < 10, f"waiting agents took {took:.1f}s to notice the close\n{report}"
        for a in waiting:
            assert "RendezvousClosedError" in a.log(), report
            assert f"Run {run_id} was closed" in a.log(), report
            assert "test says stop" in a.log(), report
        assert not (job.out / "rank-0.json").exists()

        # Every node of the closed job is gone: the same command starts a new job at once.
        again = [job.start(f"again-{i}") for i in range(3)]
        codes = job.wait(JOB_TIMEOUT, again)
        assert all(codes[a.name] == 0 for a in again), f"{codes}\n{job.report()}"
        assert_trained_together(job, 3)


# ----------------------------------------------------------------------------- progress


#: torch's log line prefix, which ours follow under torchrun: level, date, time, pid, file:line.
_OUR_LINE = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ consul_rdzv/\w+\.py:\d+\] ",
                       re.MULTILINE)


@pytest.mark.long
@pytest.mark.timeout(400)
def test_waiting_agent_shows_progress_in_torchs_format_without_any_logging_setup(
        agent, prefix, run_id, tmp_path):
    """No LOGLEVEL, no logging configuration: a node waiting for its partner says so every
    ~15 s (what it waits for, who is there, the coordinator, the time left), then one line for
    its round, formatted like torch's own lines."""
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="2", env={"LOGLEVEL": None},
                     rdzv_conf=fast_conf(prefix), train_args=["--steps", "5"]) as job:
        first = job.start("node-0")
        job.wait_for(lambda: "waits for round 1" in first.log(), 40,
                     "a progress line from the waiting agent")
        log = first.log()
        line = next(x for x in log.splitlines() if "waits for round 1" in x)
        assert _OUR_LINE.match(line), line
        assert "1 of min 2 nodes present (node-0)" in line, line
        assert "coordinator node-0" in line and "join timeout in" in line, line
        job.start("node-1")
        codes = job.wait(JOB_TIMEOUT)
        assert codes == {"node-0": 0, "node-1": 0}, job.report()
        joined = [x for x in first.log().splitlines() if "joined round 1" in x]
        assert len(joined) == 1 and _OUR_LINE.match(joined[0]), first.log()
        assert re.search(r"as rank [01] of 2 in \d+ ms", joined[0]), joined[0]
        ours = _OUR_LINE.findall(first.log())
        assert len(ours) <= 8, f"{len(ours)} lines of ours in a healthy 2-node job:\n{first.log()}"


# ----------------------------------------------------------------------------- broken Consul


def default_conf(prefix: str) -> dict:
    """No join timeout: torchrun's own timeout=900 is join_timeout. consul_timeout 10 s: the
    default (60 s, to ride out a leader election) would make each of these tests a minute long;
    what they check is that a broken Consul fails the job within consul_timeout, never after
    join_timeout."""
    return {"key_prefix": prefix, "consul_timeout": 10}


def time_to_exit(job: TorchrunJob, timeout: float) -> tuple[int | None, float]:
    """Wait for the job's only agent; its exit code and seconds from its rendezvous start
    (torch's "Rendezvous'ing" log line: torch's own start-up time does not count)."""
    (agent,) = job.agents
    code = job.wait(timeout)[agent.name]
    exited = time.time()
    started = torch_log_times(agent.log(), "Rendezvous'ing worker group")
    assert started, job.report()
    return code, exited - started[0]


def fails_fast_with_connection_error(job: TorchrunJob) -> tuple[int | None, float, str, str]:
    """Start the job's one agent; it must exit non-zero within FAIL_FAST of its rendezvous
    start with a RendezvousConnectionError. Its exit code, seconds, log and the job report."""
    node = job.start("node-0")
    code, took = time_to_exit(job, JOB_TIMEOUT)
    report = job.report()
    assert code not in (0, None), report
    assert took < FAIL_FAST, f"torchrun took {took:.1f}s\n{report}"
    assert "RendezvousConnectionError" in node.log(), report
    return code, took, node.log(), report


@pytest.mark.timeout(240)
def test_wrong_endpoint_fails_fast(prefix, run_id, tmp_path):
    with TorchrunJob(tmp_path, "127.0.0.1:9", run_id, nnodes="1",
                     rdzv_conf=default_conf(prefix)) as job:
        code, took, log, report = fails_fast_with_connection_error(job)
        assert "http://127.0.0.1:9 is unreachable" in log, report
        print(f"torchrun against 127.0.0.1:9 exited {code} {took:.1f}s after it began the "
              "rendezvous")


@pytest.mark.timeout(400)
def test_consul_agent_stopped_under_waiting_nodes_fails_fast(fresh_agent, prefix, run_id,
                                                             tmp_path):
    with TorchrunJob(tmp_path, fresh_agent.address, run_id, nnodes="3",
                     rdzv_conf=default_conf(prefix)) as job:
        nodes = [job.start(f"node-{i}") for i in range(2)]  # a third never comes
        job.wait_for(lambda: len(member_keys(fresh_agent, prefix, run_id)) == 2, JOB_TIMEOUT,
                     "both agents waiting in the rendezvous")
        fresh_agent.stop()
        stopped = time.monotonic()
        codes = job.wait(JOB_TIMEOUT)
        took = time.monotonic() - stopped
        report = job.report()
        assert all(c not in (0, None) for c in codes.values()), f"{codes}\n{report}"
        assert took < FAIL_FAST, f"torchrun took {took:.1f}s after Consul stopped\n{report}"
        for node in nodes:
            assert "RendezvousConnectionError" in node.log(), report
            assert f"Consul at {fresh_agent.url}" in node.log(), report
        print(f"torchrun agents exited {took:.1f}s after Consul stopped")


@pytest.mark.timeout(240)
def test_missing_acl_permission_fails_fast_naming_it(acl_agent, prefix, run_id, tmp_path):
    with TorchrunJob(tmp_path, acl_agent.address, run_id, nnodes="1",
                     rdzv_conf=default_conf(prefix)) as job:
        _code, _took, log, report = fails_fast_with_connection_error(job)
        assert "lacks permission 'service:write'" in log, report
        assert f'on "torchelastic-{run_id}"' in log, report
        assert 'service_prefix "torchelastic-" { policy = "write" }' in log, report
        assert "No token was sent" in log and "docs/acl-policy.hcl" in log, report
