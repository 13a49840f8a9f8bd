"""The unit tier of tests/conftest.py (``make unit``, ``pytest -m unit``): it selects every test
that needs no Consul and none that needs an agent, and a unit test that would start Consul
fails, naming the marker it lacks.

Each check runs a nested pytest on a small test file beside a copy of conftest.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

SAMPLE = '''
import pytest

from consul_rdzv.testing import consul_binary


def test_pure_logic():
    assert 1 + 1 == 2


def test_through_an_agent_fixture(agent):
    pass


def test_through_a_fixture_of_an_agent_fixture(nodes):
    pass


@pytest.mark.consul
def test_runs_the_binary_itself():
    consul_binary(build=False)


@pytest.mark.slow
def test_starts_torchrun():
    pass


def test_starts_consul_unmarked():
    consul_binary(build=False)
'''

BAD_MARK = '''
import pytest


@pytest.mark.unit
def test_marked_unit_but_needs_an_agent(session_agent):
    pass
'''


def nested_pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)])  # consul_testing, rdzv_nodes
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", os.devnull, *args,
                           str(tmp_path / "test_sample.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_unit_selects_the_tests_without_consul_and_fails_one_that_starts_it(tmp_path):
    collected = nested_pytest(tmp_path, SAMPLE, "-m", "unit", "--collect-only", "-q")
    assert collected.returncode == 0, collected.stdout + collected.stderr
    names = {line.split("::")[1] for line in collected.stdout.splitlines() if "::" in line}
    assert names == {"test_pure_logic", "test_starts_consul_unmarked"}, collected.stdout

    ran = nested_pytest(tmp_path, SAMPLE, "-m", "unit", "-q")
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "1 failed, 1 passed" in ran.stdout, ran.stdout
    assert "FAILED" in ran.stdout and "test_starts_consul_unmarked" in ran.stdout
    assert "a-unit-test-runs-no-consul--mark-it-pytest.mark.consul" in ran.stdout, ran.stdout


def test_a_test_marked_unit_that_needs_an_agent_is_a_usage_error(tmp_path):
    proc = nested_pytest(tmp_path, BAD_MARK, "--collect-only", "-q")
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    assert "test_marked_unit_but_needs_an_agent is marked unit but needs Consul " \
        "(session_agent)" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
