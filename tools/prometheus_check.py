"""The shipped dashboard and alert rules against a real Prometheus, during a real job.

Needs ``prometheus`` and ``promtool`` on PATH (Debian: ``apt-get install prometheus``); the
tests do not (they parse the same expressions with a PromQL parser, tests/test_metrics.py). On
a dev agent on this machine: four ``ConsulRendezvous`` nodes with metrics and one
``consul-rdzv exporter``, scraped every second by a Prometheus that loads
deploy/observability/alerts.yaml; the job forms a round, loses a node, admits a spare, then
re-forms five times in a row (a restart storm). Then every query of the dashboard is run
against Prometheus and the number of series it returns printed, with each alert rule's health
and state. Exit 1 if ``promtool check rules`` fails, a query fails, a query that the job must
have fed returns nothing, or a rule is unhealthy.

    python tools/prometheus_check.py
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from consul_rdzv.client import ConsulClient  # noqa: E402
from consul_rdzv.rendezvous import ConsulRendezvous  # noqa: E402
from consul_rdzv.settings import RendezvousSettings  # noqa: E402
from consul_testing import ConsulAgent  # noqa: E402

DASHBOARD = ROOT / "deploy" / "observability" / "grafana-dashboard.json"
ALERTS = ROOT / "deploy" / "observability" / "alerts.yaml"
#: Queries that may rightly be empty at the end of the job (nobody waits then).
MAY_BE_EMPTY = {"waiting now"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            print(f"{tool} is not on PATH (Debian: apt-get install prometheus)", file=sys.stderr)
            return 1
    subprocess.run(["promtool", "check", "rules", str(ALERTS)], check=True)
    work = Path(tempfile.mkdtemp(prefix="prometheus-check-"))
    agent = ConsulAgent().start()
    procs: list[subprocess.Popen] = []
    failed = 0
    try:
        exporter = subprocess.Popen(
            [sys.executable, "-m", "consul_rdzv.cli", "exporter", "--address", agent.address,
             "--key-prefix", "check", "--bind", "127.0.0.1", "--port", "0", "--timeout", "600"],
            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        procs.append(exporter)
        line = exporter.stdout.readline() if exporter.stdout else ""
        exporter_port = int(re.search(r":(\d+)/metrics", line).group(1))  # type: ignore[union-attr]
        settings = RendezvousSettings(run_id="job1", key_prefix="check", min_nodes=2,
                                      max_nodes=4, last_call_timeout=0.3,
                                      metrics_port=0, metrics_host="127.0.0.1")
        nodes = {n: ConsulRendezvous(settings, ConsulClient(agent.config()), node_id=n,
                                     endpoint_provider=lambda: {"host": "h", "port": 1})
                 for n in "abcd"}
        targets = [f"127.0.0.1:{n.metrics.port}" for n in nodes.values() if n.metrics]
        port = free_port()
        (work / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{ALERTS}]\n"
            "scrape_configs:\n"
            f"  - {{job_name: nodes, static_configs: [{{targets: {json.dumps(targets)}}}]}}\n"
            "  - {job_name: exporter, static_configs: [{targets: "
            f"['127.0.0.1:{exporter_port}']}}]}}\n")
        procs.append(subprocess.Popen(
            ["prometheus", f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(work / "prometheus.log").open("w")))
        pool = ThreadPoolExecutor(8)

        def rounds(members: list[ConsulRendezvous]) -> None:
            for future in [pool.submit(n.next_round) for n in members]:
                future.result(60)

        a, b, c, d = nodes.values()
        rounds([a, b, c])
        time.sleep(8)
        c.leave()  # a departure
        time.sleep(1)
        rounds([a, b])
        time.sleep(8)
        spare = pool.submit(d.next_round)  # a spare, admitted
        time.sleep(3)
        rounds([a, b])
        spare.result(30)
        time.sleep(5)
        for _ in range(5):  # a restart storm
            rounds([a, b, d])
            time.sleep(1)
        time.sleep(8)

        def query(expr: str) -> dict:
            url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(
                {"query": expr})
            with urllib.request.urlopen(url, timeout=10) as answer:
                return json.loads(answer.read())

        dashboard = json.loads(DASHBOARD.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", "30s").replace("$run_id", ".*")
                answer = query(expr)
                series = len(answer["data"]["result"]) if answer["status"] == "success" else -1
                legend = target["legendFormat"]
                bad = series < 0 or (series == 0 and not any(
                    m in legend for m in MAY_BE_EMPTY))
                failed += bad
                print(f"{'FAIL' if bad else 'ok  '} {series:3d} series  {panel['title']}: "
                      f"{legend}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=10) as r:
            groups = json.loads(r.read())["data"]["groups"]
        for group in groups:
            for rule in group["rules"]:
                bad = rule["health"] != "ok"
                failed += bad
                print(f"{'FAIL' if bad else 'ok  '} rule {rule['name']}: {rule['health']}, "
                      f"{rule['state']} {rule.get('lastError', '')}")
        for node in (a, b, d):
            node.leave()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
        agent.close()
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
