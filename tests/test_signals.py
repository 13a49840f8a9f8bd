"""The processes the tests start get SIGINT and SIGTERM with their default dispositions, however
the test command was started.

A script's background job (``make test &``, a CI step run by ``bash -c '... &'``) starts with
SIGINT ignored, and an ignored signal stays ignored across ``exec``: a torchrun agent or a CLI
run started by such a test run would ignore the Ctrl-C its test sends it. tests/conftest.py
gives the test process default dispositions back, so that its children start with them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rdzv_nodes import signals_of

ROOT = Path(__file__).resolve().parent.parent


def test_spawned_processes_start_with_default_sigint_and_sigterm():
    """A plain child and a Python child: neither ignores SIGINT or SIGTERM, and Python turns
    SIGINT into KeyboardInterrupt (it installs that handler only if SIGINT was not ignored)."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        ignored = signals_of(child.pid, "SigIgn")
    finally:
        child.kill()
        child.wait()
    assert not ignored & {signal.SIGINT, signal.SIGTERM}, sorted(ignored)
    code = ("import signal; "
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
            "signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.split() == ["True", "True"], out


@pytest.mark.consul
@pytest.mark.timeout(300)
def test_ctrl_c_tests_pass_in_a_background_job_that_ignores_sigint():
    """The test command started as a script's background job, with SIGINT and SIGTERM ignored
    (``trap "" INT TERM``): the check above and the CLI's Ctrl-C test (a ``consul-rdzv watch``
    stopped by SIGINT must exit 0) pass there too. torchrun's Ctrl-C tests
    (tests/test_lifecycle.py) signal their children the same way."""
    selected = ["test_signals.py::test_spawned_processes_start_with_default_sigint_and_sigterm",
                "test_cli.py::test_watch_text_frames_and_ctrl_c_exits_0"]
    command = " ".join([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-o", "log_level=WARNING",
                        *(f"tests/{s}" for s in selected)])
    script = f'trap "" INT TERM; {command} & wait $!'
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "2 passed" in proc.stdout, proc.stdout[-3000:]
