"""A job's whole life with real ``torchrun`` agents: Ctrl-C, SIGTERM, re-runs under the same run
id, a spare node that gives up, and an endpoint that is not Consul. None of these may close,
stall or kill a healthy job (docs/torch.md, "Ending").

Every test runs real agents (``python -m torch.distributed.run``) against a real Consul dev
agent on 127.0.0.1, sends real signals, and waits on conditions with deadlines. Where a test
must tell a graceful leave from Consul's own failure detection it uses a long check TTL
(``heartbeat_timeout=30``): anything that happens well within it cannot be the TTL.
"""

from __future__ import annotations

import http.server
import signal
import threading
import time

import pytest
from torchrun_jobs import TorchrunJob, torch_log_times

from consul_rdzv.testing import free_port

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 150
#: A check TTL far longer than any graceful step, so that TTL expiry cannot explain a result.
LONG_TTL = 30


def conf(prefix: str, **changes) -> dict:
    values = {"key_prefix": prefix, "heartbeat_timeout": 2, "last_call_timeout": 1,
              "join_timeout": 60}
    values.update(changes)
    return values


def keys_of(agent, prefix: str, run_id: str, sub: str = "") -> list[str]:
    client = agent.client()
    try:
        return client.kv_keys(f"{prefix}/{run_id}/{sub}")
    finally:
        client.close()


def services_of(agent, run_id: str) -> list[str]:
    client = agent.client()
    try:
        return [s["ID"] for s in client.agent_services().values()
                if s.get("Service") == f"torchelastic-{run_id}"]
    finally:
        client.close()


def is_closed(agent, prefix: str, run_id: str) -> bool:
    from consul_rdzv.layout import Round

    client = agent.client()
    try:
        entry = client.kv_get(f"{prefix}/{run_id}/round/current").data
        return bool(entry is not None and Round.decode(entry).closed)
    finally:
        client.close()


def trained_together(job: TorchrunJob, names: list[str], world_size: int) -> None:
    results = [r for r in job.results() if r["world_size"] == world_size]
    report = job.report()
    assert sorted(r["rank"] for r in results) == list(range(world_size)), report
    assert len({r["checksum"] for r in results}) == 1, report
    assert len({r["master"] for r in results}) == 1, report
    assert all(job.agents[[a.name for a in job.agents].index(n)].proc.poll() == 0
               for n in names), report


# ----------------------------------------------------------------------------- 1. Ctrl-C, SIGTERM


@pytest.mark.long
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signal_to_a_waiting_agent_leaves_without_closing_the_run(agent, prefix, run_id,
                                                                  tmp_path, sig):
    """Ctrl-C (a KeyboardInterrupt: torch calls shutdown()) or SIGTERM (before torch installs
    its handlers) of an agent waiting for its first round: it leaves at once, and a new pair of
    agents on the same run id trains."""
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="2",
                     rdzv_conf=conf(prefix, heartbeat_timeout=LONG_TTL),
                     train_args=["--steps", "10"]) as job:
        waiting = job.start("node-0")
        job.wait_for(lambda: keys_of(agent, prefix, run_id, "members/"), JOB_TIMEOUT,
                     "the agent waiting in the rendezvous")
        signalled = time.monotonic()
        waiting.signal(sig)
        code = job.wait(30, [waiting])["node-0"]
        job.wait_for(lambda: not keys_of(agent, prefix, run_id, "members/")
                     and not services_of(agent, run_id), 10, "the agent's node gone from Consul")
        gone = time.monotonic() - signalled
        report = job.report()
        assert code not in (0, None), report
        assert gone < LONG_TTL / 3, f"the node stayed {gone:.1f}s: no graceful leave\n{report}"
        assert not is_closed(agent, prefix, run_id), f"the signal closed the run\n{report}"

        pair = [job.start(f"new-{i}") for i in range(2)]
        codes = job.wait(JOB_TIMEOUT, pair)
        assert all(codes[a.name] == 0 for a in pair), f"{codes}\n{job.report()}"
        trained_together(job, [a.name for a in pair], 2)
        print(f"[figure] {sig.name} of a waiting agent: its node gone from Consul {gone:.2f}s "
              "later; a new pair then trained on the same run id")


# ----------------------------------------------------------------------------- 2. re-runs


@pytest.mark.long
@pytest.mark.timeout(400)
def test_the_same_command_runs_twice_on_one_run_id(agent, prefix, run_id, tmp_path):
    """Re-running a finished job (the same --rdzv-id, a re-created Kubernetes job): the second
    job rendezvouses at once, and nothing of either job stays in Consul but the finished job's
    closed marker, shrunk and held by a session of closed_retention's TTL (Consul deletes it
    by itself; it keeps the job's stragglers out meanwhile), which the re-run removes."""
    sessions = []
    for attempt in range(2):
        with TorchrunJob(tmp_path / f"job{attempt}", agent.address, run_id, nnodes="2",
                         rdzv_conf=conf(prefix), train_args=["--steps", "5"]) as job:
            started = time.monotonic()
            for i in range(2):
                job.start(f"node-{i}")
            codes = job.wait(JOB_TIMEOUT)
            report = job.report()
            assert codes == {"node-0": 0, "node-1": 0}, f"job {attempt + 1}: {codes}\n{report}"
            trained_together(job, ["node-0", "node-1"], 2)
            print(f"[figure] job {attempt + 1} on run id {run_id}: "
                  f"{time.monotonic() - started:.1f}s")
        assert keys_of(agent, prefix, run_id) == [f"{prefix}/{run_id}/round/current"], \
            "the finished job left keys in Consul"
        assert services_of(agent, run_id) == []
        sessions.append(kept_marker_session(agent, prefix, run_id))
    client = agent.client()
    try:
        assert client.session_info(sessions[0]) is None, "the re-run kept the old marker"
        alive = {s["ID"] for s in client._call("GET", "/v1/session/list").json()}
    finally:
        client.close()
    assert alive & set(sessions) == {sessions[1]}, (alive, sessions)


def kept_marker_session(agent, prefix: str, run_id: str) -> str:
    """The session keeping a finished run's closed marker (TTL closed_retention, no checks)."""
    from consul_rdzv.layout import Round

    client = agent.client()
    try:
        entry = client.kv_get(f"{prefix}/{run_id}/round/current").data
        assert entry is not None and entry.session, "the closed marker is not kept"
        assert Round.decode(entry).closed["outcome"] == "finished"
        info = client.session_info(entry.session)
        assert info["TTL"] == "600s" and not info["NodeChecks"], info
        return entry.session
    finally:
        client.close()


# ----------------------------------------------------------------------------- 3. spare times out


@pytest.mark.long
@pytest.mark.timeout(400)
def test_spare_that_times_out_beside_a_full_round_does_not_close_the_run(agent, prefix, run_id,
                                                                         tmp_path):
    """A spare node waits beside a full round (W == max_nodes) and gives up after its
    join_timeout: the job goes on, and its next membership change still works."""
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="1:2", max_restarts=3,
                     rdzv_conf=conf(prefix),
                     train_args=["--steps", "400", "--step-time", "0.05"]) as job:
        a, b = job.start("node-a"), job.start("node-b")
        job.wait_for(lambda: len(job.starts(world_size=2)) == 2, JOB_TIMEOUT,
                     "two ranks training in world 2")
        spare = job.start("spare", join_timeout=3)
        code = job.wait(60, [spare])["spare"]
        report = job.report()
        assert code not in (0, None), report
        assert "RendezvousTimeoutError" in spare.log(), report
        assert not is_closed(agent, prefix, run_id), f"the spare closed the run\n{report}"

        # A membership change after the spare left: b dies, a goes on alone.
        killed_at = time.time()
        b.kill()
        codes = job.wait(JOB_TIMEOUT, [a])
        assert codes["node-a"] == 0, f"{codes}\n{job.report()}"
        assert any(e["world_size"] == 1 and e["time"] > killed_at for e in job.starts()), \
            job.report()


# ----------------------------------------------------------------------------- 4. SIGTERM training


@pytest.mark.long
@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_node_stopped_mid_training_leaves_at_once_and_survivors_go_on(agent, prefix, run_id,
                                                                      tmp_path, how):
    """Pod deletion / spot preemption (SIGTERM to the agent) or Ctrl-C (SIGINT to the agent and
    its workers) during training: the node leaves at once, never closing the run, and the
    survivors restart in a smaller world long before the check TTL could expire."""
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="2:3", max_restarts=3,
                     rdzv_conf=conf(prefix, heartbeat_timeout=LONG_TTL),
                     train_args=["--steps", "200", "--step-time", "0.05"]) as job:
        for i in range(3):
            job.start(f"node-{i}")
        job.wait_for(lambda: len(job.starts(world_size=3)) == 3
                     and any(e["event"] == "step" and e["world_size"] == 3 and e["step"] >= 5
                             for e in job.progress()),
                     JOB_TIMEOUT, "all three ranks training in world 3")
        victim = next(a for a in job.agents if a.name == "node-1")
        survivors = [a for a in job.agents if a is not victim]
        signalled = time.time()
        if how == "sigterm":
            victim.signal(signal.SIGTERM)
        else:
            victim.signal(signal.SIGINT, group=True)
        victim_code = job.wait(60, [victim])["node-1"]
        codes = job.wait(JOB_TIMEOUT, survivors)
        report = job.report()
        assert victim_code not in (0, None), report
        assert all(codes[a.name] == 0 for a in survivors), f"{codes}\n{report}"
        trained_together(job, [a.name for a in survivors], 2)
        rounds = sorted(t for a in survivors
                        for t in torch_log_times(a.log(), "Rendezvous complete")
                        if t > signalled)
        assert rounds, report
        took = rounds[0] - signalled
        assert took < LONG_TTL / 2, f"survivors restarted {took:.1f}s after the signal\n{report}"
        print(f"[figure] {how} mid-training: survivors' next round {took:.2f}s after the signal "
              f"(check TTL {LONG_TTL}s)")


# ----------------------------------------------------------------------------- 12. not Consul


class _NotConsul(http.server.BaseHTTPRequestHandler):
    """A web server that is not Consul: HTML 404 for GET, 501 for PUT (http.server's own)."""

    def do_GET(self) -> None:
        self.send_error(404, "Not Found")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def not_consul():
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _NotConsul)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{port}"
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(240)
def test_an_endpoint_that_is_not_consul_fails_at_once_naming_it(not_consul, prefix, run_id,
                                                                tmp_path):
    with TorchrunJob(tmp_path, not_consul, run_id, nnodes="1",
                     rdzv_conf={"key_prefix": prefix}) as job:
        node = job.start("node-0")
        code = job.wait(JOB_TIMEOUT)["node-0"]
        exited = time.time()
        report = job.report()
        started = torch_log_times(node.log(), "Rendezvous'ing worker group")
        # the node gives up: it leaves (torch shuts the handler down after the error); what
        # the interpreter then takes to exit on a loaded machine is not the node's doing
        gave_up = torch_log_times(node.log(), "leaves run")
        assert code not in (0, None), report
        assert started and gave_up, report
        took = gave_up[0] - started[0]
        assert "RendezvousConnectionError" in node.log(), report
        assert f"The server at http://{not_consul} does not answer like a Consul agent" \
            in node.log(), report
        assert took < 5, f"the node gave up {took:.1f}s after it began\n{report}"
        print(f"[figure] torchrun against a web server that is not Consul gave up {took:.2f}s "
              f"after it began the rendezvous, exited {exited - started[0]:.2f}s after")
