"""The bench's round timeline and agent series (bench/run.py, bench/servers.py, bench/report.py):
pure parsing and arithmetic, no Consul."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import render, render_comparison  # noqa: E402
from bench.run import TIMELINE, Run, timeline  # noqa: E402
from bench.servers import parse_agent_series, parse_http_counts  # noqa: E402

PROMETHEUS = """\
# HELP consul_raft_apply number of applies
# TYPE consul_raft_apply counter
consul_raft_apply 7
consul_fsm_txn_count{op="apply"} 3
consul_fsm_txn_count{op="other"} 2
consul_fsm_txn_sum{op="apply"} 1.5
consul_raft_applied_index 99
process_cpu_seconds_total 0.25
consul_api_http_count{method="PUT",path="v1_txn"} 4
consul_api_http_sum{method="PUT",path="v1_txn"} 12.5
not_a_number_line consul_raft_apply
"""


def test_agent_series_are_summed_over_their_labels_and_nothing_else_is_taken():
    series = parse_agent_series(PROMETHEUS)
    assert series == {"consul_raft_apply": 7.0, "consul_fsm_txn_count": 5.0,
                      "consul_fsm_txn_sum": 1.5, "process_cpu_seconds_total": 0.25}
    # the same text still gives the request counts
    assert parse_http_counts(PROMETHEUS) == {"PUT v1_txn": [4, 12.5]}


def _rec(rank: int, wall0: float, **ms: float | None) -> dict:
    at = {k: (None if v is None else wall0 + v / 1000) for k, v in ms.items()}
    return {"rank": rank, "wall_start": at.pop("entry"), "wall_end": at.pop("returned"),
            "timings": {"announced": at.get("announced"), "sealed": at.get("sealed"),
                        "seen": at.get("seen"), "store_connected": at.get("connected"),
                        "met": at.get("met")}}


def test_timeline_gives_each_nodes_moments_in_ms_from_the_release_by_rank():
    wall0 = 1_000_000.0
    recs = [_rec(1, wall0, entry=2, announced=5, sealed=9, seen=12, connected=20, met=30,
                 returned=31),
            _rec(0, wall0, entry=1, announced=4, sealed=9, seen=10, connected=None, met=29,
                 returned=30)]
    tl = timeline(recs, wall0)
    assert tl["events"] == list(TIMELINE)
    assert [row[0] for row in tl["nodes"]] == [0, 1]
    assert tl["nodes"][0] == [0, 1.0, 4.0, 9.0, 10.0, None, 29.0, 30.0]
    assert tl["nodes"][1] == [1, 2.0, 5.0, 9.0, 12.0, 20.0, 30.0, 31.0]


def test_an_older_version_without_seen_falls_back_to_released():
    wall0 = 50.0
    rec = {"rank": 0, "wall_start": wall0, "wall_end": wall0 + 0.01,
           "timings": {"released": wall0 + 0.004}}
    row = timeline([rec], wall0)["nodes"][0]
    assert row[TIMELINE.index("seen") + 1] == 4.0


def test_agent_cost_is_what_the_series_moved_between_two_reads():
    run = Run.__new__(Run)
    run.series = {"release": {"servers": {"consul_raft_apply": 10.0, "x": 1.0}},
                  "done": {"servers": {"consul_raft_apply": 18.0, "x": 1.0,
                                       "consul_fsm_register_count": 2.0}}}
    cost = run.agent_cost("release", "done", 4)
    assert cost == {"from": "release", "to": "done", "nodes": 4,
                    "servers": {"consul_raft_apply": 8.0, "consul_fsm_register_count": 2.0}}
    assert run.agent_cost("release", "missing", 4) is None


def _write_run(path: Path, product: str, moments: list[list[float]], raft: float) -> None:
    meta = {"kind": "meta", "stamp": "x", "argv": [], "product": {"rev": product},
            "machine": {"cores": 2}, "procs": 8, "timeout": 60.0, "nofile": 1024}
    run = {"kind": "run", "scenario": "fixed", "backend": "consul", "layout": "spread",
           "trigger": None, "n": 2, "status": "ok", "latency_s": 0.04,
           "timeline": {"events": list(TIMELINE),
                        "nodes": [[rank, *row] for rank, row in enumerate(moments)]},
           "agent_round": {"servers": {"consul_raft_apply": raft}},
           "consul_http_bytes": {"PUT txn": [2, 600, 400]}}
    path.write_text(json.dumps(meta) + "\n" + json.dumps(run) + "\n")


def test_report_shows_the_last_nodes_segments_and_the_agents_cost_per_node(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write_run(a, "old", [[1, 4, 9, 12, 20, 30, 31], [2, 6, 9, 10, 25, 29, 40]], raft=6)
    _write_run(b, "new", [[1, 3, 5, 6, 8, 9, 10], [1, 2, 5, 7, 9, 9, 11]], raft=3)
    text = render(b)
    assert "| 2 | new | 1 | 1 / 1 | 2 / 3 | 5 / 5 | 6 / 7 | 8 / 9 | 9 / 9 | 10 / 11 |" in text
    # the last node's segments: 3-1, 5-3, 7-5, 9-7, 9-9, 11-9
    assert "| 2 | new | 2 | 2 | 2 | 2 | 0 | 2 |" in text
    # per node: 3 raft applies over 2 nodes; 600 / 400 bytes over 2 nodes
    assert "| 1.50 |" in text and "| 300 / 200 |" in text
    both = render_comparison([a], [b])
    assert "| 2 | A old | 4 | 3 | 3 | 13 | 5 | 10 |" in both
    assert "| 2 | B new | 2 | 2 | 2 | 2 | 0 | 2 |" in both


def test_report_splits_the_client_cpu_per_node_by_worker_thread(tmp_path):
    path = tmp_path / "cpu.jsonl"
    _write_run(path, "new", [[1, 3, 5, 6, 8, 9, 10], [1, 2, 5, 7, 9, 9, 11]], raft=3)
    lines = path.read_text().splitlines()
    run = json.loads(lines[1])
    # 2 nodes: 10 ms of client CPU, 6 in the node threads, 1 in the watch, 2 in ended threads,
    # 0.4 in the keep-alive, 0.6 in two other threads
    run.update(client_cpu_s=0.010, thread_cpu_s={
        "node": 0.006, "consul-rdzv-watch": 0.001, "(ended threads)": 0.002,
        "consul-rdzv-keep": 0.0004, "MainThread": 0.0004, "QueueFeederThread": 0.0002})
    path.write_text(lines[0] + "\n" + json.dumps(run) + "\n")
    text = render(path)
    assert "| 2 | 5.00 | 3.00 | 0.50 | 1.00 | 0.20 | 0.30 |" in text
