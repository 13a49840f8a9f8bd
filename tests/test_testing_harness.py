"""The real-agent harness: the binary it finds, the installed dev agent (side by side, nothing but
what the CLI needs), and the test agent's variants and restart with empty state."""

from __future__ import annotations

import inspect
import os
import subprocess
import time

import pytest

from consul_rdzv.testing import (
    CONSUL_VERSION,
    ConsulBinaryError,
    consul_binary,
    main,
)
from consul_rdzv.testing import ConsulAgent as DevAgent
from consul_testing import ConsulAgent


@pytest.mark.consul
def test_consul_binary_returns_executable_of_at_least_1_14_if_available():
    binary = consul_binary(build=False)
    assert os.path.isfile(binary)
    assert os.access(binary, os.X_OK)
    out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30).stdout
    first = out.splitlines()[0]
    assert first.startswith("Consul v")
    version = tuple(int(p) for p in first.removeprefix("Consul v").split("-")[0].split("."))
    assert version >= (1, 14, 0)
    assert tuple(int(p) for p in CONSUL_VERSION.split(".")) >= (1, 14, 0)


@pytest.mark.consul
def test_consul_binary_honours_consul_bin_if_it_is_executable(monkeypatch):
    real = consul_binary(build=False)
    monkeypatch.setenv("CONSUL_BIN", real)
    assert consul_binary(build=False) == real


@pytest.mark.parametrize("kind", ["not-executable", "missing"])
def test_consul_binary_raises_binary_error_if_consul_bin_is_unusable(monkeypatch, tmp_path, kind):
    path = tmp_path / "consul"
    if kind == "not-executable":
        path.write_text("#!/bin/sh\necho Consul v1.14.5\n")
        path.chmod(0o644)
    monkeypatch.setenv("CONSUL_BIN", str(path))
    with pytest.raises(ConsulBinaryError, match="CONSUL_BIN") as info:
        consul_binary(build=False)
    assert str(path) in str(info.value)


@pytest.mark.consul
def test_main_prints_the_binary_path_if_asked_for_path(capsys):
    assert main(["path"]) == 0
    assert capsys.readouterr().out.strip() == consul_binary(build=False)


@pytest.mark.parametrize("argv", [["build"], ["path", "extra"]])
def test_main_refuses_an_unknown_argument_with_its_usage(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: python -m consul_rdzv.testing [path]" in err and argv[-1] in err


@pytest.mark.consul
def test_dev_agents_run_side_by_side_if_started_together(tmp_path):
    with DevAgent() as one, DevAgent() as two:
        assert one.port != two.port
        assert one.proc.poll() is None and two.proc.poll() is None
        c1, c2 = one.client(), two.client()
        try:
            assert {n["Node"] for n in c1.catalog_nodes()} == {one.node_name}
            assert {n["Node"] for n in c2.catalog_nodes()} == {two.node_name}
            c1.kv_put("side/by/side", b"one")
            assert c1.kv_get("side/by/side").data.value == b"one"
            assert c2.kv_get("side/by/side").data is None  # separate state
        finally:
            c1.close()
            c2.close()
    assert one.proc is None and two.proc is None  # stopped on exit
    assert not one.workdir.exists()  # its own temporary directory is removed


def test_installed_dev_agent_has_no_test_variants_or_failure_injection():
    """The package ships what ``consul-rdzv agent`` and ``demo`` need; tests get the rest."""
    for name in ("kill", "restart", "freeze", "thaw"):
        assert not hasattr(DevAgent, name) and callable(getattr(ConsulAgent, name)), name
    for name in ("acl", "tls", "verify_incoming"):
        assert name not in inspect.signature(DevAgent).parameters, name
        assert name in inspect.signature(ConsulAgent).parameters, name
    assert issubclass(ConsulAgent, DevAgent)


@pytest.mark.consul
def test_consul_agent_restart_comes_back_on_same_port_with_empty_kv_if_dev_agent():
    with ConsulAgent() as agent:
        client = agent.client()
        try:
            port, old_pid = agent.port, agent.proc.pid
            for i in range(5):  # leave connections behind, as real tests do
                client.kv_put(f"restart/{i}", b"x")
            started = time.monotonic()
            agent.restart()
            took = time.monotonic() - started
            assert agent.port == port
            assert agent.proc.pid != old_pid
            assert client.kv_list("restart/").data == []
            assert agent.node_name in {n["Node"] for n in client.catalog_nodes()}
            assert took < 10.0  # no waiting out TIME_WAIT connections on the old port
        finally:
            client.close()


def test_consul_agent_env_points_a_process_at_it_if_agent_uses_tls(tls_agent):
    env = tls_agent.env()
    assert env["CONSUL_HTTP_ADDR"] == f"https://{tls_agent.address}"
    assert os.path.isfile(env["CONSUL_CACERT"])
    assert "CONSUL_HTTP_TOKEN" not in env


def test_consul_agent_env_carries_management_token_if_acl_enabled(acl_agent):
    assert acl_agent.env()["CONSUL_HTTP_TOKEN"] == acl_agent.management_token
    assert "CONSUL_HTTP_TOKEN" not in acl_agent.env(token=False)
