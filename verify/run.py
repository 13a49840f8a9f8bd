"""The fault campaign's entry points: ``python -m verify.run --seed S --rounds R`` (every
option: ``--help``), and :func:`run_campaign` for tests. A cluster is started, the campaign
runs (verify/campaign.py), its report is built (verify/report.py), everything stops."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from consul_testing import ConsulCluster

from .campaign import Campaign, CampaignConfig
from .checks import check_events_file
from .report import build_report, summary
from .schedule import KINDS, fault_schedule, schedule_digest


def run_campaign(cfg: CampaignConfig, *, log_dir: Path | None = None,
                 out: TextIO = sys.stderr) -> dict:
    """Start a cluster, run one campaign, stop everything (by PID); the report.

    Logs (node stderr, events.jsonl, the agents' logs) go to ``log_dir``; without one, to a
    temporary directory that is removed unless there was a violation (``report["logs"]``).
    """
    keep = log_dir is not None
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="consul-rdzv-campaign-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = ConsulCluster(servers=3, clients=cfg.clients)
    campaign: Campaign | None = None
    report: dict = {}
    try:
        cluster.start()
        print(f"[campaign] cluster {cluster} up in {cluster.start_seconds:.1f}s; logs in "
              f"{log_dir}", file=out, flush=True)
        campaign = Campaign(cfg, cluster, log_dir, out=out)
        outcome = campaign.run()
        report = build_report(campaign, outcome.stop_reason, outcome.fault_phase,
                              outcome.elapsed, outcome.converged, outcome.restored)
        return report
    finally:
        if campaign is not None:
            campaign.close()
        violated = bool(report.get("violations", {}).get("count")) or not report
        if keep or violated:
            consul_logs = log_dir / "consul"
            consul_logs.mkdir(exist_ok=True)
            for member in cluster.members:
                with contextlib.suppress(OSError):
                    shutil.copy(member.log_path, consul_logs / f"{member.name}.log")
        cluster.close()
        if report:
            report["logs"] = str(log_dir) if keep or violated else None
        if not (keep or violated):
            shutil.rmtree(log_dir, ignore_errors=True)


def _pair(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(","))
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=500, help="stop after this many rounds")
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--min-nodes", type=int, default=2)
    parser.add_argument("--max-nodes", type=int, default=None,
                        help="default: nodes - 1 (a spare waits beside a full round)")
    parser.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat_timeout (s)")
    parser.add_argument("--join-timeout", type=float, default=30.0)
    parser.add_argument("--train", type=_pair, default=(0.3, 2.0), metavar="MIN,MAX",
                        help="training time between rounds (s), ended early if the round breaks")
    parser.add_argument("--gap", type=_pair, default=(2.0, 7.0), metavar="MIN,MAX",
                        help="time between two faults (s)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"fault kinds to inject (default all: {', '.join(KINDS)})")
    parser.add_argument("--max-seconds", type=float, default=3600.0)
    parser.add_argument("--stall-timeout", type=float, default=120.0)
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--markdown", type=Path, help="write the summary tables here")
    parser.add_argument("--logs", type=Path, help="keep node and agent logs here")
    parser.add_argument("--schedule-only", type=int, metavar="N",
                        help="print the first N faults of the seed's schedule and exit")
    parser.add_argument("--check-events", type=Path, metavar="EVENTS_JSONL",
                        help="check the round invariants of a recorded run (e.g. an interrupted "
                             "one) from its events.jsonl, and exit")
    args = parser.parse_args(argv)

    kinds = {k.strip(): KINDS[k.strip()] for k in args.kinds.split(",") if k.strip() in KINDS}
    unknown = [k for k in args.kinds.split(",") if k.strip() and k.strip() not in KINDS]
    if unknown or not kinds:
        parser.error(f"unknown fault kinds {unknown}; known: {', '.join(KINDS)}")
    if args.check_events is not None:
        return check_events_file(args.check_events, min_nodes=args.min_nodes,
                                 max_nodes=args.max_nodes or max(args.min_nodes, args.nodes - 1))
    if args.schedule_only is not None:
        specs = list(itertools.islice(fault_schedule(args.seed, gap=args.gap,
                                                     heartbeat=args.heartbeat, kinds=kinds),
                                      args.schedule_only))
        for spec in specs:
            print(json.dumps(dataclasses.asdict(spec)))
        print(f"digest {schedule_digest(specs)}")
        return 0
    def stop(signum: int, frame: object) -> None:  # clean up (finally blocks) on SIGTERM too
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)  # also when started in the background (SIG_IGN)
    cfg = CampaignConfig(seed=args.seed, rounds=args.rounds, nodes=args.nodes,
                         min_nodes=args.min_nodes, max_nodes=args.max_nodes,
                         heartbeat=args.heartbeat, join_timeout=args.join_timeout,
                         train=args.train, gap=args.gap, kinds=kinds,
                         max_seconds=args.max_seconds, stall_timeout=args.stall_timeout)
    report = run_campaign(cfg, log_dir=args.logs)
    text = summary(report)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if report["violations"]["count"]:
        print(f"{report['violations']['count']} violation(s); logs kept in {report['logs']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
