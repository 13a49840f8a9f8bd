"""A campaign's figures: rounds, faults, recovery times, errors and why, as JSON and Markdown.

Recovery time of a fault: from the fault to the next round sealed that does not contain a node
it took out, or that the node's live process joined; for server faults, the next round sealed.
Errors raised by nodes are not violations by themselves: they are counted by type with the
circumstances found in the fault timeline (:func:`_why`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import platform
import statistics
import subprocess
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from consul_rdzv.errors import RendezvousReplacedError
from consul_testing import CONSUL_VERSION

from .checks import check_invariants, check_missed_rounds, loadavg
from .schedule import KINDS, NODE_KILL_KINDS, schedule_digest

if TYPE_CHECKING:
    from .campaign import Affected, Campaign

ROOT = Path(__file__).resolve().parent.parent


def build_report(campaign: Campaign, stop_reason: str, fault_phase: float,
                 duration: float, converged: dict | None, restored: float) -> dict:
    """The campaign's figures and violations, as a JSON-able dict (what ``--out`` writes)."""
    cfg = campaign.cfg
    with campaign.lock:
        reports = sorted(campaign.reports, key=lambda r: (r["serial"], r["recv"]))
        endpoints = {p.serial: p.endpoint for p in campaign.procs.values()}
        node_of = {p.serial: p.node_id for p in campaign.procs.values()}
        violations = check_invariants(reports, list(campaign.consul_values), endpoints,
                                      node_of, min_nodes=cfg.min_nodes,
                                      max_nodes=cfg.max_nodes)
        missed = check_missed_rounds(
            list(campaign.consul_values), dict(campaign.member_history),
            dict(campaign.incarnations), reports, _unavailable(campaign), until=time.time())
        violations += missed
        violations += campaign.liveness
        seals = sorted(campaign.seals.values(), key=lambda s: s["sealed_at"] or 0)
    reported: dict[str, list[dict]] = defaultdict(list)
    for r in reports:
        reported[r["seal_id"]].append(r)
    complete = sum(1 for s in seals
                   if {r["node_id"] for r in reported[s["seal_id"]]} >= set(s["ranks"]))
    intervals = [b["sealed_at"] - a["sealed_at"] for a, b in itertools.pairwise(seals)
                 if a["sealed_at"] and b["sealed_at"]]
    joins = [r["timings"]["released"] - r["timings"]["join_started"] for r in reports
             if "released" in r.get("timings", {})]
    recovery, per_fault = _recovery(campaign, seals, reported)
    return {
        "seed": cfg.seed,
        "config": {**dataclasses.asdict(cfg), "kinds": cfg.kinds},
        "stop_reason": stop_reason,
        "duration_s": round(duration, 1),
        "fault_phase_s": round(fault_phase, 1),
        "machine": _machine(),
        "load_1min": _stats(campaign.loads),
        "schedule_shift_s": round(campaign.schedule_shift, 1),
        "rounds": {
            "sealed": len(seals),
            "reported_by_every_participant": complete,
            "highest_round_number": max((s["round"] for s in seals), default=0),
            "world_sizes": dict(sorted(Counter(len(s["ranks"]) for s in seals).items())),
            "reports": len(reports),
            "seal_interval_s": _stats(intervals),
            "join_s": _stats(joins),
            "consul_values_seen": len(campaign.consul_values),
            "watch_failures": campaign.watch_failures,
        },
        "faults": {
            "injected": len(campaign.faults),
            "by_kind": dict(sorted(Counter(f.spec.kind for f in campaign.faults).items())),
            "skipped_by_kind": dict(sorted(Counter(s["kind"] for s in campaign.skipped).items())),
            "skipped": campaign.skipped,
            "schedule_consumed": len(campaign.consumed_specs),
            "schedule_digest": schedule_digest(campaign.consumed_specs),
            "list": per_fault,
        },
        "recovery_s": recovery,
        "violations": {
            "count": len(violations),
            "by_kind": dict(sorted(Counter(v["kind"] for v in violations).items())),
            "list": violations[:200],
        },
        "errors": _errors_summary(campaign, missed),
        "unexpected_exits": campaign.exits,
        "replaced_processes": {
            "stopped": len(campaign.replaced_exits),
            "exit_codes": dict(Counter(str(e["code"]) for e in campaign.replaced_exits)),
            "after_thaw_s": _stats([e["after_thaw"] for e in campaign.replaced_exits
                                    if e["after_thaw"] is not None]),
        },
        "anomalies": campaign.anomalies,
        "converged": converged,
        "downtime": campaign.downtime,
        "processes": len(campaign.procs),
    }

def _recovery(campaign: Campaign, seals: list[dict], reported: dict[str, list[dict]]
              ) -> tuple[dict, list[dict]]:
    """Seconds from each fault to the next round sealed without an affected node or joined
    by its live process; p50/p99/max per kind."""
    per_kind: dict[str, list[float]] = defaultdict(list)
    unrecovered: Counter[str] = Counter()
    rows = []
    for fault in campaign.faults:
        seconds = None
        for seal in seals:
            if not seal["sealed_at"] or seal["sealed_at"] <= fault.applied:
                continue
            if all(_back(a, seal, reported[seal["seal_id"]]) for a in fault.affected):
                seconds = seal["sealed_at"] - fault.applied
                break
        if seconds is None:
            unrecovered[fault.spec.kind] += 1
        else:
            per_kind[fault.spec.kind].append(seconds)
        rows.append({"index": fault.spec.index, "kind": fault.spec.kind,
                     "planned_at": fault.spec.at, "applied": fault.applied,
                     "target": fault.target, "duration": fault.spec.duration,
                     "detail": fault.detail,
                     "affected": [dataclasses.asdict(a) for a in fault.affected],
                     "recovery_s": None if seconds is None else round(seconds, 3)})
    table = {}
    for kind in sorted(set(per_kind) | set(unrecovered)):
        table[kind] = {**_stats(per_kind[kind]), "unrecovered": unrecovered[kind]}
    everything = [s for v in per_kind.values() for s in v]
    table["all"] = {**_stats(everything), "unrecovered": sum(unrecovered.values())}
    return table, rows

def _unavailable(campaign: Campaign) -> dict[int, list[tuple[float, float]]]:
    """Per process serial, when it could not act: not started or gone, frozen, its agent
    down."""
    never = float("inf")
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for proc in campaign.procs.values():
        spans[proc.serial].append((0.0, proc.started))
        if proc.killed or proc.exit_code is not None or not proc.running:
            spans[proc.serial].append((proc.exited or proc.started, never))
        for down in campaign.downtime:
            if down["member"] == proc.agent.name:
                spans[proc.serial].append((down["down"], down["up"] or never))
    for fault in campaign.faults:
        if fault.spec.kind.startswith(("worker_freeze", "worker_replace")):
            serial = int(fault.target.rsplit("/p", 1)[1])
            thawed = campaign.procs[serial].thawed  # (a replacement's start is fault.ended)
            spans[serial].append((fault.applied, thawed or never))
        if fault.spec.kind in NODE_KILL_KINDS:
            serial = int(fault.target.rsplit("/p", 1)[1])
            spans[serial].append((fault.applied, never))
    return spans

def _errors_summary(campaign: Campaign, missed: list[dict]) -> dict:
    """Errors by type: count, an example, and their circumstances (:meth:`_why`)."""
    flagged = {v["evidence"]["serial"] for v in missed}
    by_type: dict[str, dict] = {}
    for error in campaign.errors:
        entry = by_type.setdefault(error["type"], {"count": 0, "why": Counter(),
                                                   "typed": error.get("typed", True),
                                                   "example": error.get("message", "")[:600]})
        entry["count"] += 1
        if error["serial"] in flagged and "Timeout" in error["type"]:
            why = "VIOLATION own_round_missed: it did not return a round meant for it"
        else:
            why = _why(campaign, error)
        entry["why"][why] += 1
    for entry in by_type.values():
        entry["why"] = dict(entry["why"].most_common())
    return by_type

def _why(campaign: Campaign, error: dict) -> str:
    """The circumstances of a node's error, from the fault timeline."""
    message = error.get("message", "")
    start, end = error.get("join_t") or error["t"], error["t"]
    if error["type"] == RendezvousReplacedError.__name__:
        return "replaced by a newer process (worker_replace): the stop the protocol asks for"
    if "serfHealth" in message:
        return ("session refused: the servers saw its client agent failed (serfHealth "
                "critical), not retried")
    overlapping = [d for d in campaign.downtime
                   if d["down"] <= end and (d["up"] is None or d["up"] >= start)]
    if any(d["member"] == error["agent"] for d in overlapping):
        return "its client agent was down"
    servers = [d for d in overlapping if d["server"]]
    if _most_at_once(servers, start, end) >= 2:
        return "two servers were down at once (quorum lost)"
    frozen = [f for f in campaign.faults
              if f.target == f"{error['node_id']}/p{error['serial']}"
              and f.spec.kind.startswith(("worker_freeze", "worker_replace"))
              and f.applied <= end and (f.ended or end) >= start]
    if frozen:
        return "this node was frozen during the join"
    if servers:
        return "a server was down or restarting during the join"
    latest = max((s for s in campaign.seals.values() if (s["sealed_at"] or 0) <= end),
                 key=lambda s: s["round"], default=None)
    if ("waits for room" in message and latest is not None
            and error["node_id"] not in latest["ranks"]):
        return "a spare: the round was full (max_nodes) and nobody left"
    if "Timeout" in error["type"]:
        return "join timeout, no fault of its agent or the servers during the join"
    return "other"


def _most_at_once(intervals: list[dict], start: float, end: float) -> int:
    """The most of ``intervals`` (``down``/``up`` times; up None: still down) that overlap
    at one instant of [start, end]."""
    edges = []
    for d in intervals:
        edges += [(max(d["down"], start), 1), (min(d["up"] or end, end), -1)]
    most = current = 0
    for _, step in sorted(edges, key=lambda e: (e[0], -e[1])):
        current += step
        most = max(most, current)
    return most


def _back(affected: Affected, seal: dict, reports: list[dict]) -> bool:
    if affected.node_id not in seal["ranks"]:
        return True
    if affected.serial is None:
        return False
    return any(r["node_id"] == affected.node_id and r["serial"] >= affected.serial
               for r in reports)


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of fewer than 100 values is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(_percentile(values, 0.5), 3),
            "p99": round(_percentile(values, 0.99), 3), "max": round(max(values), 3),
            "mean": round(statistics.fmean(values), 3)}


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def _machine() -> dict:
    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    return {"cpus": os.cpu_count(), "cpu": _cpu_model(), "platform": platform.platform(),
            "python": platform.python_version(), "consul": CONSUL_VERSION,
            "loadavg_end": loadavg(), "commit": commit}


def summary(report: dict) -> str:
    """The report as Markdown tables (what docs/campaign.md records)."""
    r, f, v = report["rounds"], report["faults"], report["violations"]
    m = report["machine"]
    lines = [
        "| figure | value |", "|---|---|",
        f"| seed | {report['seed']} (schedule: {f['schedule_consumed']} faults drawn, digest "
        f"`{f['schedule_digest']}`) |",
        f"| rounds sealed | {r['sealed']} (reported by every participant: "
        f"{r['reported_by_every_participant']}; highest round number "
        f"{r['highest_round_number']}) |",
        f"| world sizes (W: rounds) | "
        f"{', '.join(f'{w}: {n}' for w, n in r['world_sizes'].items())} |",
        f"| faults injected | {f['injected']} (skipped: {sum(f['skipped_by_kind'].values())}) |",
        f"| violations | {v['count']}"
        + (f" ({', '.join(f'{k} {n}' for k, n in v['by_kind'].items())})" if v["count"] else "")
        + " |",
        f"| time between seals | p50 {r['seal_interval_s'].get('p50')} s, p99 "
        f"{r['seal_interval_s'].get('p99')} s, max {r['seal_interval_s'].get('max')} s |",
        f"| next_round() duration | p50 {r['join_s'].get('p50')} s, p99 "
        f"{r['join_s'].get('p99')} s |",
        f"| after the faults | {_converged(report['converged'])} |",
        f"| duration | {report['duration_s']} s ({report['fault_phase_s']} s of faults; the "
        f"injector was held up {report['schedule_shift_s']} s in all) |",
        f"| load average (1 min, every 5 s) | p50 {report['load_1min'].get('p50')}, max "
        f"{report['load_1min'].get('max')} |",
        f"| machine | {m['cpus']} CPUs ({m['cpu']}), {m['platform']}, Python {m['python']}, "
        f"Consul {m['consul']}, load at the end {m['loadavg_end']}, commit {m['commit']} |",
        "",
        "| fault kind | injected | skipped | recovery p50 (s) | p99 (s) | max (s) | unrecovered |",
        "|---|---|---|---|---|---|---|",
    ]
    rec = report["recovery_s"]
    for kind in [*KINDS, "all"]:
        injected = f["injected"] if kind == "all" else f["by_kind"].get(kind, 0)
        skipped = (sum(f["skipped_by_kind"].values()) if kind == "all"
                   else f["skipped_by_kind"].get(kind, 0))
        if not injected and not skipped:
            continue
        s = rec.get(kind, {"n": 0, "unrecovered": 0})
        lines.append(f"| {kind} | {injected} | {skipped} | {s.get('p50', '-')} | "
                     f"{s.get('p99', '-')} | {s.get('max', '-')} | {s.get('unrecovered', 0)} |")
    lines += ["", "| error raised by nodes | count | circumstances |", "|---|---|---|"]
    for kind, e in sorted(report["errors"].items(), key=lambda kv: -kv[1]["count"]):
        why = "; ".join(f"{w}: {n}" for w, n in e["why"].items())
        lines.append(f"| {kind}{'' if e['typed'] else ' (untyped!)'} | {e['count']} | {why} |")
    if not report["errors"]:
        lines.append("| none | 0 | |")
    rp = report["replaced_processes"]
    lines += ["", f"Replaced processes stopped: {rp['stopped']} (exit codes {rp['exit_codes']}, "
              f"seconds after the thaw {rp['after_thaw_s']}); unexpected exits: "
              f"{len(report['unexpected_exits'])}; anomalies: {len(report['anomalies'])}."]
    for violation in v["list"][:20]:
        lines.append(f"- VIOLATION {violation['kind']} (round {violation['round']}): "
                     f"{violation['detail']}")
    return "\n".join(lines)


def _converged(converged: dict | None) -> str:
    if converged is None:
        return "NO full round of the live nodes (liveness violation)"
    return (f"a full round (round {converged['round']}, W={converged['world_size']}) "
            f"{converged['seconds']:.2f} s after the cluster was restored")
