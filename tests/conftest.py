"""Fixtures: real Consul agents (dev, ACL, TLS, mTLS), a real multi-member Consul cluster (both
from consul_testing/, the harness at the repository's root), a unique KV prefix per test, and the
agents' logs attached to the report of a failing test."""

from __future__ import annotations

import importlib
import os
import sys
import uuid
from pathlib import Path

import pytest

# The harness (consul_testing/) is not installed: it lives at the repository's root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from consul_testing import ConsulAgent, ConsulCluster

#: Where CONSUL_HTTP_ADDR points when a test asked for no agent: a port nothing listens on, so
#: that no test can reach a stray agent on 127.0.0.1:8500 by accident.
NOWHERE = "127.0.0.1:9"


def pytest_configure(config):
    """``make test`` sets CONSUL_RDZV_REQUIRE_TORCH=1 on the main interpreter: there a torch that
    cannot be imported is one error before any test runs, so no torch test is lost to a skip or
    hidden among import errors. The torch-free runs on other interpreters leave it unset."""
    if os.environ.get("CONSUL_RDZV_REQUIRE_TORCH") != "1":
        return
    try:
        importlib.import_module("torch.distributed.elastic.rendezvous")
    except ImportError as exc:
        raise pytest.UsageError(
            f"CONSUL_RDZV_REQUIRE_TORCH=1 but torch cannot be imported ({exc}). Install it "
            "(make test installs the CPU wheel from ../shared/wheels into .venv), or unset "
            "CONSUL_RDZV_REQUIRE_TORCH to run only the torch-free tests."
        ) from exc


@pytest.fixture(autouse=True)
def _isolated_consul_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CONSUL_") and name not in ("CONSUL_BIN",):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", NOWHERE)


def _agent(request, **kwargs):
    agent = ConsulAgent(**kwargs).start()
    request.addfinalizer(agent.close)
    return agent


@pytest.fixture(scope="session")
def session_agent(request):
    return _agent(request)


@pytest.fixture(scope="session")
def acl_agent(request):
    return _agent(request, acl=True)


@pytest.fixture(scope="session")
def tls_agent(request):
    return _agent(request, tls=True)


@pytest.fixture(scope="session")
def mtls_agent(request):
    return _agent(request, verify_incoming=True)


@pytest.fixture
def agent(session_agent, monkeypatch):
    """The shared dev agent, with CONSUL_HTTP_ADDR pointing at it for this test."""
    monkeypatch.setenv("CONSUL_HTTP_ADDR", session_agent.address)
    return session_agent


@pytest.fixture
def fresh_agent(request, monkeypatch):
    """A dev agent of this test's own, for tests that stop, restart or freeze it."""
    a = _agent(request)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", a.address)
    return a


@pytest.fixture(scope="session")
def consul_cluster(request):
    """A real cluster shared by the session: 3 servers and 2 client agents, each on its own
    127.X.Y.Z (see :class:`ConsulCluster`). Tests that inject failures use ``cluster``."""
    c = ConsulCluster(servers=3, clients=2).start()
    request.addfinalizer(c.close)
    return c


@pytest.fixture
def cluster(consul_cluster):
    """The shared cluster, healthy at the start of the test and restored after it (partitions
    healed, members thawed and started again, a leader and every member alive)."""
    consul_cluster.restore()
    yield consul_cluster
    consul_cluster.restore()


@pytest.fixture
def consul(agent):
    client = agent.client()
    yield client
    client.close()


@pytest.fixture
def prefix(request):
    """A KV prefix of this test's own."""
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    funcargs = getattr(item, "funcargs", {})
    seen = set()
    for name, value in funcargs.items():
        for candidate in (value, getattr(value, "agent", None)):
            if isinstance(candidate, ConsulAgent) and id(candidate) not in seen:
                seen.add(id(candidate))
                report.sections.append((f"consul agent log ({name})", candidate.log_text(8000)))
        if isinstance(value, ConsulCluster) and id(value) not in seen:
            seen.add(id(value))
            for member in value.members:
                report.sections.append((f"consul agent log ({name}: {member.name})",
                                        member.log_text(4000)))
