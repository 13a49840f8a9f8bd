"""The long-run tool (``python -m bench.soak``): its request accounting, its refusals, and a
short flatness run end to end (a real dev agent that the tool starts itself)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.soak import CHECK_PASS, RequestRates, parse_args  # noqa: E402


def test_request_rates_subtract_the_samplers_own_requests_and_survive_a_counter_reset():
    rates = RequestRates()
    assert rates.update(0.0, {CHECK_PASS: 10, "GET v1_kv_": 5}, Counter({"GET v1_kv_": 2})) \
        is None
    # 10 s later: 20 more passes, 8 more kv reads of which 3 were the sampler's own.
    r = rates.update(10.0, {CHECK_PASS: 30, "GET v1_kv_": 13}, Counter({"GET v1_kv_": 5}))
    assert r["check_passes_per_s"] == 2.0
    assert r["rest_per_s"] == 0.5
    assert r["by_path"] == {CHECK_PASS: 2.0, "GET v1_kv_": 0.5}
    # Consul dropped the kv counter (Prometheus retention) and made it again from zero.
    r = rates.update(20.0, {CHECK_PASS: 50, "GET v1_kv_": 4}, Counter({"GET v1_kv_": 5}))
    assert r["by_path"]["GET v1_kv_"] == 0.4


@pytest.mark.parametrize("argv, message", [
    ([], "give --minutes M (the soak) or --rounds R (flatness)"),
    (["--minutes", "1", "--rounds", "5"], "give --minutes M (the soak) or --rounds R"),
    (["--minutes", "0"], "--minutes must be positive"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--minutes", "1", "--no-dev"], "--no-dev leaves no site: add --cluster"),
    (["--minutes", "1", "--loopback-hosts"], "--loopback-hosts is for the flatness run"),
])
def test_bad_arguments_get_one_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.consul  # bench.soak starts its own dev agent
@pytest.mark.timeout(180)
def test_a_short_flatness_run_records_samples_and_checks(tmp_path):
    out = tmp_path / "flat.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--rounds", "4", "--nodes", "2", "--every", "2",
         "--workdir", str(tmp_path), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [s["round"] for s in result["samples"]] == [1, 2, 4]
    assert all(c["ok"] for c in result["checks"]), result["checks"]
    assert {s["keys"] for s in result["samples"]} == {4}  # 2 members, leader, round
    assert {s["sessions"] for s in result["samples"]} == {2}
    assert result["samples"][-1]["requests_per_node_round"] > 0
    assert result["after_end"]["services"] == 0
