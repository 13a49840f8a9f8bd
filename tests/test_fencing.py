"""Fencing: a worker knows its round's epoch and asks Consul whether its round is still the
run's current one (consul_rdzv.worker), so that a worker of an older round never writes over a
newer one's checkpoint. Against a real dev agent; the last test with real torchrun agents and a
real frozen worker."""

from __future__ import annotations

import json
import os
import signal

import pytest
from torchrun_jobs import TorchrunJob

from consul_rdzv import runs
from consul_rdzv.config import ConsulConfig, WorkerRound, round_env
from consul_rdzv.errors import ConsulConfigError, RendezvousConnectionError
from consul_rdzv.worker import still_current


def worker_of(nodes, result, node) -> WorkerRound:
    """The round a worker of ``node`` gets from its torchrun agent (the adapter's variables)."""
    env = round_env(run_id=result.run_id, prefix=nodes.keys.prefix, node_id=node.node_id,
                    round_no=result.round, epoch=result.round_index, seal_id=result.seal_id,
                    config=node.client.config)
    return WorkerRound.from_env(env)


def test_round_env_round_trip_and_a_clear_error_outside_a_worker(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    config = ConsulConfig(url="https://10.0.0.1:8501", token="secret", datacenter="dc2",
                          verify=str(ca), tls_server_name="consul.example")
    env = round_env(run_id="r", prefix="tp/r", node_id="n1", round_no=7, epoch=4242,
                    seal_id="abc", config=config, token_file=None)
    assert "secret" not in json.dumps(env), "the token never goes into the environment"
    back = WorkerRound.from_env(env)
    assert (back.run_id, back.prefix, back.node_id, back.round, back.epoch, back.seal_id) == (
        "r", "tp/r", "n1", 7, 4242, "abc")
    assert back.config.url == config.url and back.config.datacenter == "dc2"
    assert back.config.verify == str(ca) and back.config.tls_server_name == "consul.example"
    assert WorkerRound.from_env({**env, "CONSUL_RDZV_VERIFY": "false"}).config.verify is False
    with pytest.raises(ConsulConfigError, match="not a worker started by torchrun"):
        WorkerRound.from_env({"CONSUL_HTTP_ADDR": "127.0.0.1:8500"})
    with pytest.raises(ConsulConfigError, match="not whole numbers"):
        WorkerRound.from_env({**env, "CONSUL_RDZV_EPOCH": "x"})


def test_old_round_is_refused_and_epochs_grow(nodes):
    settings = nodes.settings(min_nodes=2, max_nodes=2)
    a, b = nodes.node("a", settings), nodes.node("b", settings)
    first = nodes.rounds([a, b], timeout=30)
    old = worker_of(nodes, first["a"], a)
    assert old.epoch > 0 and old.epoch == nodes.current_round().modify_index
    assert still_current(worker=old)

    second = nodes.rounds([a, b], timeout=30)
    new = worker_of(nodes, second["b"], b)
    assert new.epoch > old.epoch and new.round == old.round + 1
    assert not still_current(worker=old), "a worker of round 1 still believes in its round"
    assert still_current(worker=new)

    # closed as finished in this very round: the job is done, its workers finish their work
    assert a.close_if_current(second["a"], "done", outcome=runs.OUTCOME_FINISHED)
    assert still_current(worker=new) and not still_current(worker=old)


def test_closed_run_or_gone_keys_or_no_consul(nodes, agent):
    settings = nodes.settings(min_nodes=1, max_nodes=1)
    a = nodes.node("a", settings)
    result = nodes.rounds([a], timeout=30)["a"]
    mine = worker_of(nodes, result, a)
    assert still_current(worker=mine)
    a.close("operator")
    assert not still_current(worker=mine), "a run closed (not finished) ended the round"
    nodes.admin.kv_delete(nodes.keys.round)
    assert not still_current(worker=mine)
    nowhere = WorkerRound.from_env({**round_env(
        run_id=mine.run_id, prefix=mine.prefix, node_id="a", round_no=1, epoch=mine.epoch,
        seal_id=mine.seal_id, config=ConsulConfig(url="http://127.0.0.1:1"))})
    with pytest.raises(RendezvousConnectionError, match="still current"):
        still_current(worker=nowhere, timeout=1.0)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_frozen_worker_of_an_old_round_may_not_write_its_checkpoint(agent, prefix, run_id,
                                                                    tmp_path):
    """Node A's worker (rank 0, which writes the checkpoints) freezes right before a checkpoint
    of round 1 (it SIGSTOPs itself at a known step; then the test freezes its agent too, as a
    paused VM would be). Node B goes on alone in round 2 and writes its checkpoints. The worker
    is thawed while its agent stays frozen: its still_current() says no, it writes nothing."""
    ckpt = tmp_path / "ckpt"
    conf = {"key_prefix": prefix, "heartbeat_timeout": 2, "last_call_timeout": 1,
            "join_timeout": 60}
    with TorchrunJob(tmp_path, agent.address, run_id, nnodes="1:2", max_restarts=3,
                     rdzv_conf=conf,
                     train_args=["--steps", "400", "--step-time", "0.05",
                                 "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                                 "--stop-self", "0:10"]) as job:
        job.start("node-a")
        job.start("node-b")
        stopping = job.wait_for(
            lambda: next((e for e in job.progress() if e["event"] == "stopping"), None),
            150, "rank 0 of round 1 freezing itself before a checkpoint")
        assert stopping["world_size"] == 2, job.report()
        old_epoch, worker_pid = stopping["epoch"], stopping["pid"]
        frozen = next(a for a in job.agents if a.pid == stopping["agent_pid"])
        frozen.signal(signal.SIGSTOP, group=True)  # the agent too: the whole node is paused

        newer = job.wait_for(
            lambda: next((e for e in job.progress() if e["event"] == "checkpoint"
                          and e["epoch"] > old_epoch and e["world_size"] == 1), None),
            150, "the job going on without the frozen node and checkpointing in a newer round")
        os.kill(worker_pid, signal.SIGCONT)  # only the worker: its agent stays frozen
        refused = job.wait_for(
            lambda: next((e for e in job.progress() if e["event"] == "checkpoint-refused"
                          and e["pid"] == worker_pid), None),
            60, "the thawed worker asking Consul and refusing its checkpoint")
        assert refused["epoch"] == old_epoch < newer["epoch"], job.report()
        late = [e for e in job.progress() if e["event"] == "checkpoint"
                and e["pid"] == worker_pid and e["time"] > stopping["time"]]
        assert late == [], f"the old round's worker wrote a checkpoint\n{job.report()}"
        import torch  # the file the newer round wrote is untouched

        saved = torch.load(ckpt / "checkpoint.pt")
        assert saved["epoch"] > old_epoch, job.report()
        print(f"[figure] frozen worker of epoch {old_epoch} refused; round 2 writes epoch "
              f"{newer['epoch']}")
        frozen.signal(signal.SIGCONT, group=True)
