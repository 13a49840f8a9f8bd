"""The tests' one vocabulary of fixtures, and the agents' logs attached to the report of a
failing test.

Consul (real agents from consul_testing/, the harness at the repository's root):

* ``session_agent``, ``acl_agent``, ``tls_agent``, ``mtls_agent``: dev agents shared by the
  session; ``agent``: the shared dev agent with CONSUL_HTTP_ADDR pointing at it; ``consul``: a
  client of it; ``fresh_agent``: a dev agent of the test's own (to stop, restart or freeze).
* ``consul_cluster``: a real cluster (3 servers, 2 client agents) shared by the consecutive
  tests of a process (an xdist worker) that use it, stopped once the next test does not;
  ``cluster``: the same, healthy at the start of the test and restored after it.

A run (tests/rdzv_nodes.py, tests/torch_handlers.py):

* ``prefix``: a KV prefix of the test's own; ``run_id``: a run id of its own (``run-<prefix>``).
* ``nodes``: the nodes of the test's run (:class:`rdzv_nodes.Cluster`: threads and processes)
  on ``agent``; ``fresh_nodes`` on ``fresh_agent``; ``cluster_nodes`` on ``cluster``.
* ``make_handler``: torchrun's handlers through torch's registry (imports torch).

Waiting: :func:`rdzv_nodes.wait_for` and :func:`rdzv_nodes.stays`, never fixed sleeps.

Tiers: every test that asks for no agent fixture and is marked neither ``consul`` nor ``slow``
is marked ``unit`` here (``make unit``: no Consul, in seconds; tests/test_unit_tier.py).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import uuid
from pathlib import Path

import pytest

# The harness (consul_testing/) is not installed: it lives at the repository's root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rdzv_nodes import Cluster

from consul_testing import ConsulAgent, ConsulCluster

#: Where CONSUL_HTTP_ADDR points when a test asked for no agent: a port nothing listens on, so
#: that no test can reach a stray agent on 127.0.0.1:8500 by accident.
NOWHERE = "127.0.0.1:9"


def _default_signal_dispositions() -> None:
    """SIGINT and SIGTERM back to their defaults if the test command started with them ignored
    (a script's background job ignores SIGINT): an ignored signal stays ignored across exec,
    so every process the tests start (torchrun agents, node processes, CLI runs) would ignore
    the Ctrl-C or SIGTERM a test sends it. A handled signal is reset to its default at exec:
    SIGINT gets Python's own handler (KeyboardInterrupt) here, SIGTERM its default
    (tests/test_signals.py)."""
    if threading.current_thread() is not threading.main_thread():
        return  # (a worker thread cannot set handlers; its process inherited them)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def pytest_configure(config):
    _default_signal_dispositions()
    _require_torch()


def _require_torch():
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


# ------------------------------------------------------------------------------ the unit tier

#: The fixtures that start Consul agents; every agent fixture depends on one of them.
AGENT_FIXTURES = frozenset({"session_agent", "acl_agent", "tls_agent", "mtls_agent",
                            "fresh_agent", "consul_cluster"})
#: What CONSUL_BIN says during a unit test: no Consul binary there, so that a unit test that
#: would start Consul (itself or through a child process) fails, naming the marker it lacks.
NO_CONSUL_IN_UNIT_TESTS = "/nonexistent/a-unit-test-runs-no-consul--mark-it-pytest.mark.consul"


#: The marker of a test that starts a multi-member cluster of its own (tests on the shared one
#: ask for ``consul_cluster``): scheduled first, as those are (:func:`_schedule_order`).
CLUSTER_MARKER = "cluster"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The unit tier: every test that asks for no agent fixture (directly or through another
    fixture) and is marked neither ``consul`` (it runs the Consul binary by itself) nor
    ``slow`` (real torchrun jobs) gets the ``unit`` marker (``make unit``, ``pytest -m unit``).
    A test marked ``unit`` by hand that needs an agent is a usage error."""
    for item in items:
        agents = sorted(AGENT_FIXTURES & set(item.fixturenames))
        other = [m for m in ("consul", "slow") if item.get_closest_marker(m)]
        if item.get_closest_marker("unit"):
            if agents or other:
                raise pytest.UsageError(
                    f"{item.nodeid} is marked unit but needs Consul "
                    f"({', '.join(agents + [f'marked {m}' for m in other])}): a unit test runs "
                    "no agent. Remove the unit marker, or the agent from the test.")
        elif not agents and not other:
            item.add_marker(pytest.mark.unit)
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike
        items.sort(key=_schedule_order)


def _schedule_order(item: pytest.Item) -> int:
    """The order xdist hands tests out (``make test``: ``--maxschedchunk 1``, one at a time to
    whichever worker is free): the tests on clusters first, so that each worker runs its share
    of them one after another on one cluster and then stops it; then the tests marked ``long``
    (half a minute or more), then the other torchrun jobs, so that no long test is left for
    the end while the other workers idle; then the other tests on agents; the unit tests fill
    the gaps."""
    if "consul_cluster" in item.fixturenames or item.get_closest_marker(CLUSTER_MARKER):
        return 0
    if item.get_closest_marker("long"):
        return 1
    if item.get_closest_marker("slow"):
        return 2
    return 4 if item.get_closest_marker("unit") else 3


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A unit test, its fixtures included, runs with CONSUL_BIN naming no binary."""
    if not item.get_closest_marker("unit"):
        yield
        return
    saved = os.environ.get("CONSUL_BIN")
    os.environ["CONSUL_BIN"] = NO_CONSUL_IN_UNIT_TESTS
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CONSUL_BIN", None)
        else:
            os.environ["CONSUL_BIN"] = saved


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


#: This process's shared cluster while consecutive tests use it (:func:`consul_cluster`).
_shared_cluster: ConsulCluster | None = None


@pytest.fixture
def consul_cluster():
    """A real cluster shared by the consecutive tests of this process (an xdist worker) that
    ask for it: 3 servers and 2 client agents, each on its own 127.X.Y.Z of a random block
    (see :class:`ConsulCluster`: clusters of several workers coexist). Started by the first
    such test, stopped after the last one before a test that does not use it
    (:func:`pytest_runtest_teardown`): an idle cluster costs 5 agents' CPU for the rest of the
    run. Tests that inject failures use ``cluster``."""
    global _shared_cluster
    if _shared_cluster is None:
        _shared_cluster = ConsulCluster(servers=3, clients=2).start()
    return _shared_cluster


def _uses_shared_cluster(item: pytest.Item | None) -> bool:
    """Whether ``item`` asks for this conftest's ``consul_cluster`` (a module may define its
    own, tests/test_consul_life.py)."""
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    if fixtureinfo is None:
        return False
    defs = fixtureinfo.name2fixturedefs.get("consul_cluster") or ()
    return bool(defs) and getattr(defs[-1].func, "__module__", None) == __name__


def _stop_shared_cluster() -> None:
    global _shared_cluster
    if _shared_cluster is not None:
        cluster, _shared_cluster = _shared_cluster, None
        cluster.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's teardown: the shared cluster stops unless the next test uses it (xdist
    keeps one test pending on a worker, so ``nextitem`` is known until the worker's last)."""
    yield
    if not _uses_shared_cluster(nextitem):
        _stop_shared_cluster()


def pytest_sessionfinish(session, exitstatus):
    _stop_shared_cluster()


@pytest.fixture
def cluster(consul_cluster):
    """The shared cluster, healthy at the start of the test and restored after it (partitions
    healed, members thawed and started again, a leader and every member alive), with no
    service instance of an earlier test left on any member (``forget_services``)."""
    consul_cluster.restore()
    consul_cluster.forget_services()
    yield consul_cluster
    consul_cluster.restore()


@pytest.fixture
def consul(agent):
    client = agent.client()
    yield client
    client.close()


@pytest.fixture
def prefix():
    """A KV prefix of this test's own."""
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def run_id(prefix):
    """A run id of this test's own (service ids are per agent, not per key prefix), the one
    its ``nodes`` use."""
    return f"run-{prefix}"


def _nodes(agent, prefix: str, run_id: str, log_dir: Path):
    c = Cluster(agent, prefix, log_dir, run_id=run_id)
    yield c
    c.shutdown()


@pytest.fixture
def nodes(agent, prefix, run_id, tmp_path):
    """The nodes of this test's run on the shared dev agent: ``ConsulRendezvous`` threads and
    node processes, left, killed and cleaned up after the test."""
    yield from _nodes(agent, prefix, run_id, tmp_path)


@pytest.fixture
def fresh_nodes(fresh_agent, prefix, run_id, tmp_path):
    """``nodes`` on a dev agent of this test's own (``fresh_agent``)."""
    yield from _nodes(fresh_agent, prefix, run_id, tmp_path)


@pytest.fixture
def cluster_nodes(cluster, prefix, run_id, tmp_path):
    """``nodes`` on the cluster: their own reads (and the seal recorder) go through client
    agent 1, which no test harms; a node gets the client of its own agent from the test."""
    yield from _nodes(cluster.clients[1], prefix, run_id, tmp_path)


@pytest.fixture
def make_handler():
    """``make_handler(endpoint, run_id, prefix, *, min_nodes=1, max_nodes=1, fast=True,
    **conf)``: a torchrun handler built through torch's registry
    (:class:`torch_handlers.HandlerFactory`); each leaves (never closes) at teardown."""
    from torch_handlers import HandlerFactory  # imports torch: only for the tests that ask

    factory = HandlerFactory()
    yield factory
    factory.leave_all()


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
