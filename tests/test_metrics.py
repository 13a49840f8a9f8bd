"""Metrics in Prometheus' format: a node's (the ``metrics_port`` setting) and the fleet's
(``consul-rdzv exporter``), scraped over HTTP during a real job on a real dev agent, and the
dashboard and alert rules shipped in deploy/observability/ checked against the code's names."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rdzv_nodes import HB, wait_for

from consul_rdzv import metrics as node_metrics
from consul_rdzv import quarantine
from consul_rdzv.cli import exporter
from consul_rdzv.layout import quarantine_dir, quarantine_key
from consul_rdzv.settings import RendezvousSettings, settings_from_conf

ROOT = Path(__file__).resolve().parent.parent
OBSERVABILITY = ROOT / "deploy" / "observability"
DASHBOARD = OBSERVABILITY / "grafana-dashboard.json"
ALERTS = OBSERVABILITY / "alerts.yaml"

Samples = dict[tuple[str, frozenset], float]


def scrape(port: int) -> Samples:
    """Every sample of ``http://127.0.0.1:<port>/metrics``: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert found, f"no sample {name}{labels} in {sorted({n for n, _ in samples})}"
    return sum(found)


def base_name(sample: str) -> str:
    """A sample's metric name: histograms' _bucket, _sum and _count removed."""
    return re.sub(r"_(bucket|sum|count)$", "", sample)


# ------------------------------------------------------------------------------ settings


def test_metrics_port_and_host_are_validated():
    assert RendezvousSettings(run_id="j").metrics_port is None  # off by default
    assert settings_from_conf("j", 1, 1, {"metrics_port": "0"}).metrics_port == 0
    s = settings_from_conf("j", 1, 1, {"metrics_port": "9100", "metrics_host": "127.0.0.1"})
    assert (s.metrics_port, s.metrics_host) == (9100, "127.0.0.1")
    for bad in ("x", "65536", "-1"):
        with pytest.raises(ValueError, match="metrics_port"):
            settings_from_conf("j", 1, 1, {"metrics_port": bad})
    with pytest.raises(ValueError, match="metrics_host is set but metrics_port is not"):
        settings_from_conf("j", 1, 1, {"metrics_host": "127.0.0.1"})
    with pytest.raises(ValueError, match="metrics_host"):
        settings_from_conf("j", 1, 1, {"metrics_port": "0", "metrics_host": "a b"})


def test_without_the_client_library_metrics_port_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(ValueError, match=r"pip install 'consul-rdzv\[metrics\]'"):
        node_metrics.NodeMetrics("j", "n", port=0, host="127.0.0.1")


def test_the_exporter_without_the_client_library_says_how_to_install_it(monkeypatch, capsys):
    from consul_rdzv.cli import main

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    assert main(["exporter", "--port", "0", "--bind", "127.0.0.1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("consul-rdzv exporter: the exporter needs the Prometheus client")
    assert "pip install 'consul-rdzv[metrics]'" in err


def test_the_restart_cause_is_read_from_the_watchs_reason():
    from consul_rdzv.watch import Action, Judgement, why_over

    assert why_over(Judgement(Action.OVER, gone=("b", "c")).reason) == "departure"
    assert why_over(Judgement(Action.OVER, asking=True).reason) == "rejoin"
    assert why_over("gone: b; asking for a new round: c") == "departure"
    assert why_over("asking for a new round: c") == "rejoin"
    assert why_over("this node is out of its round: its check is gone") is None
    assert why_over("") is None


def test_a_metrics_port_in_use_is_one_clear_error():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=rf"metrics_port={port}: node n cannot serve its "
                           rf"metrics on 127\.0\.0\.1:{port} .*Choose another metrics_port"):
            node_metrics.NodeMetrics("j", "n", port=port, host="127.0.0.1")


def test_label_values_are_bounded():
    assert node_metrics.endpoint_of("/v1/kv/a/b/c") == "kv"
    assert node_metrics.endpoint_of("/v1/agent/check/pass/x") == "agent"
    assert node_metrics.endpoint_of("/v1/acl/token/self") == "other"
    assert node_metrics.endpoint_of("/") == "other"
    assert node_metrics.status_of(200) == "200"
    assert node_metrics.status_of(201) == "2xx"
    assert node_metrics.status_of(418) == "4xx"
    assert node_metrics.status_of(None) == "error"


def test_a_nodes_series_stay_bounded_whatever_it_is_asked():
    m = node_metrics.NodeMetrics("j", "n", port=0, host="127.0.0.1")
    try:
        for i in range(500):
            m.request(f"/v1/{'kv' if i % 2 else f'x{i}'}/k{i}", 200 + i)
            m.restarted(f"cause-{i}")
        samples = scrape(m.port)
    finally:
        m.close()
    requests = {ls for (n, ls) in samples if n == "consul_rdzv_consul_requests_total"}
    endpoints = {dict(ls)["endpoint"] for ls in requests}
    statuses = {dict(ls)["status"] for ls in requests}
    assert endpoints <= {*node_metrics.ENDPOINTS, "other"}
    assert statuses <= {*node_metrics.STATUSES, "2xx", "3xx", "4xx", "5xx", "6xx", "error"}
    causes = {dict(ls)["cause"] for (n, ls) in samples if n == "consul_rdzv_restarts_total"}
    assert causes == set(node_metrics.RESTART_CAUSES)
    assert value(samples, "consul_rdzv_restarts_total", cause="local") == 500
    exposed = {base_name(n) for n, _ in samples if not n.endswith("_created")}
    assert exposed == set(node_metrics.NODE_METRICS)


# ------------------------------------------------------------------------------ shipped files


def _names_used(expr: str) -> set[str]:
    return {base_name(n) for n in re.findall(r"\bconsul_rdzv_[a-z_]+", expr)}


def _dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", {}).get("query", "") if isinstance(v.get("query"), dict)
              else v.get("query", "") for v in doc.get("templating", {}).get("list", [])]
    return exprs


def _alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _promql(expr: str) -> str:
    """A dashboard's or a rule's expression as Prometheus sees it (Grafana's variables
    substituted), parsed by a real PromQL parser: a syntax error fails here."""
    text = expr.replace("$__rate_interval", "5m").replace("$run_id", ".*")
    try:
        promql_parser.parse(text)
    except ValueError as exc:
        raise AssertionError(f"not valid PromQL ({exc}): {expr}") from None
    return text


def test_the_dashboard_and_alerts_parse_and_use_only_metrics_the_code_exports():
    known = set(node_metrics.NODE_METRICS) | set(exporter.EXPORTER_METRICS)
    exprs = [_promql(e) for e in _dashboard_exprs() if "label_values" not in e]
    assert len(exprs) >= 8, "the dashboard has its panels"
    rules = _alert_rules()
    names = {r["alert"] for r in rules}
    assert {"ConsulRdzvRunStuckWaiting", "ConsulRdzvRestartStorm",
            "ConsulRdzvNodeFlapping"} <= names, names
    for rule in rules:
        assert rule["expr"].strip() and rule.get("for") and rule["annotations"]["summary"]
        _promql(rule["expr"])
    exprs += [e for e in _dashboard_exprs() if "label_values" in e]  # the run_id selector
    used = set().union(*(_names_used(e) for e in exprs + [r["expr"] for r in rules]))
    assert used, "the expressions name consul-rdzv metrics"
    assert used <= known, f"not exported by the code: {sorted(used - known)}"
    # and every metric of the code is shown or alerted on somewhere
    unused = known - used
    assert not unused, f"neither on the dashboard nor in an alert: {sorted(unused)}"


def test_the_alert_rules_pass_promtool_style_checks():
    """What Prometheus refuses when it loads a rule file: a rule without alert or expr, a
    duplicate alert name in a group, a ``for`` that is no duration, labels not strings, an
    expression that is not PromQL."""
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
        seen = set()
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations",
                                 "keep_firing_for"}, rule
            assert rule["alert"] not in seen
            seen.add(rule["alert"])
            assert re.fullmatch(r"\d+[smhd]", rule["for"]), rule["for"]
            assert all(isinstance(v, str) for v in rule.get("labels", {}).values())
            _promql(rule["expr"])


# ------------------------------------------------------------------------------ a real job


class Exporter:
    """``consul-rdzv exporter`` as a real process on a free loopback port."""

    def __init__(self, agent, prefix: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "consul_rdzv.cli", "exporter", "--address", agent.address,
             "--key-prefix", prefix, "--bind", "127.0.0.1", "--port", "0", "--timeout", "300"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert m, f"exporter said {line!r}; stderr: {self.proc.stderr.read() if not line else ''}"
        self.port = int(m.group(1))

    def scrape(self) -> Samples:
        return scrape(self.port)

    def stop(self) -> int:
        self.proc.terminate()  # SIGTERM: it stops serving and exits 0
        return self.proc.wait(timeout=10)


@pytest.fixture
def fleet_exporter(agent, prefix):
    e = Exporter(agent, prefix)
    yield e
    assert e.stop() == 0


def test_both_endpoints_move_as_a_real_job_does(nodes, fleet_exporter, run_id):
    """Three nodes train; one leaves (a departure: the run re-forms); a spare arrives (the
    others restart to admit it); one asks for a new round (a rejoin); a node loses its session
    (health). After each step the nodes' and the exporter's values say so."""
    settings = nodes.settings(min_nodes=2, max_nodes=4, last_call_timeout=0.3,
                              metrics_port=0, metrics_host="127.0.0.1")
    a, b, c = (nodes.node(n, settings) for n in "abc")
    assert all(n.metrics is not None and n.metrics.port for n in (a, b, c))
    exp = fleet_exporter
    first = nodes.rounds([a, b, c], timeout=30)
    assert {r.world_size for r in first.values()} == {3}
    rnd = first["a"].round

    def node(n) -> Samples:
        return scrape(n.metrics.port)

    s = node(a)
    assert value(s, "consul_rdzv_rounds_joined_total", run_id=run_id, node_id="a") == 1
    assert value(s, "consul_rdzv_round") == rnd and value(s, "consul_rdzv_world_size") == 3
    assert value(s, "consul_rdzv_rendezvous_duration_seconds_count") == 1
    assert value(s, "consul_rdzv_rendezvous_duration_seconds_sum") > 0
    assert value(s, "consul_rdzv_waiting_seconds") == 0  # it trains
    assert value(s, "consul_rdzv_restarts_total") == 0
    assert value(s, "consul_rdzv_consul_requests_total", endpoint="txn") >= 1
    assert value(s, "consul_rdzv_consul_requests_total", endpoint="agent") >= 1
    # every request the node sent is counted, by the one hook in the client, once answered
    # (the watch's blocking query, the keeper's and a heartbeat pass may be on their way)
    sent = a.client.requests_sent
    counted = value(node(a), "consul_rdzv_consul_requests_total")
    assert sent - 3 <= counted <= a.client.requests_sent, (counted, sent)
    wait_for(lambda: value(node(a), "consul_rdzv_heartbeat_pass_seconds_count") >= 1, 10,
             "a heartbeat pass is timed")
    e = wait_for(lambda: (lambda s: s if value(s, "consul_rdzv_run_round", run_id=run_id)
                          == rnd else None)(exp.scrape()), 10, "the exporter sees the round")
    assert value(e, "consul_rdzv_exporter_up") == 1
    assert value(e, "consul_rdzv_run_world_size", run_id=run_id) == 3
    assert value(e, "consul_rdzv_run_state", run_id=run_id, state="training") == 1
    assert value(e, "consul_rdzv_runs", state="training") >= 1
    assert value(e, "consul_rdzv_run_nodes", run_id=run_id, state="in_round") == 3
    assert value(e, "consul_rdzv_run_nodes", run_id=run_id, state="waiting") == 0
    wait_for(lambda: value(exp.scrape(), "consul_rdzv_run_instances", run_id=run_id,
                           health="passing") == 3, 10, "three passing instances")
    since = value(e, "consul_rdzv_run_seconds_since_round", run_id=run_id)
    assert 0 <= since < 60

    # c leaves: the run re-forms without it; a and b count a departure
    assert c.leave()
    wait_for(lambda: value(exp.scrape(), "consul_rdzv_run_state", run_id=run_id,
                           state="re-forming") == 1, 10, "the exporter sees the run re-form")
    wait_for(lambda: a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1, 10,
             "a and b see c go")
    second = nodes.rounds([a, b], timeout=30)
    assert second["a"].world_size == 2 and second["a"].round > rnd
    for n in (a, b):
        s = node(n)
        assert value(s, "consul_rdzv_rounds_joined_total") == 2
        assert value(s, "consul_rdzv_restarts_total", cause="departure") == 1
        assert value(s, "consul_rdzv_round") == second["a"].round
        assert value(s, "consul_rdzv_world_size") == 2
        assert value(s, "consul_rdzv_rendezvous_duration_seconds_count") == 2
    wait_for(lambda: value(exp.scrape(), "consul_rdzv_run_round", run_id=run_id)
             == second["a"].round, 10, "the exporter's round goes up after the re-form")
    e = exp.scrape()
    assert value(e, "consul_rdzv_run_world_size", run_id=run_id) == 2
    assert value(e, "consul_rdzv_run_state", run_id=run_id, state="training") == 1

    # a spare arrives: it waits (its waiting time grows), then a and b restart to admit it
    d = nodes.node("d", settings)
    pending = nodes.start([d])
    wait_for(lambda: value(node(d), "consul_rdzv_waiting_seconds") > 0.2, 10,
             "the spare's waiting time grows while it waits")
    wait_for(lambda: value(exp.scrape(), "consul_rdzv_run_nodes", run_id=run_id,
                           state="waiting") == 1, 10, "the exporter sees one node waiting")
    wait_for(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, 10,
             "a and b see the spare")
    third = nodes.gather({**pending, **nodes.start([a, b])}, timeout=30)
    assert third["d"].world_size == 3
    for n in (a, b):
        s = node(n)
        assert value(s, "consul_rdzv_restarts_total", cause="spare") == 1
        assert value(s, "consul_rdzv_rounds_joined_total") == 3
    s = node(d)
    assert value(s, "consul_rdzv_rounds_joined_total") == 1
    assert value(s, "consul_rdzv_waiting_seconds") == 0
    assert value(s, "consul_rdzv_waited_seconds_total") > 0.2
    assert value(s, "consul_rdzv_restarts_total") == 0

    # d asks for a new round on its own (as torchrun does after its workers failed): d counts
    # a local restart, a and b a rejoin
    pending = nodes.start([d])
    wait_for(lambda: a.num_nodes_waiting() >= 1 and b.num_nodes_waiting() >= 1, 10,
             "a and b see d ask for a new round")
    nodes.gather({**pending, **nodes.start([a, b])}, timeout=30)
    assert value(node(d), "consul_rdzv_restarts_total", cause="local") == 1
    for n in (a, b):
        assert value(node(n), "consul_rdzv_restarts_total", cause="rejoin") == 1

    # a's session is destroyed from outside: a counts a session loss, then a health restart
    nodes.admin.session_destroy(a.session_id)
    wait_for(lambda: value(node(a), "consul_rdzv_session_losses_total") == 1, HB + 10,
             "a counts the loss of its session")
    wait_for(lambda: b.num_nodes_waiting() >= 1 and d.num_nodes_waiting() >= 1, 10,
             "b and d see a go")
    pending = nodes.start([a])
    fourth = nodes.rounds([b, d], timeout=30)
    if "a" not in fourth["b"].participants:
        # b and d (min_nodes 2) sealed a round before a registered again: a waits beside it
        # as a spare, and b and d restart to admit it
        wait_for(lambda: b.num_nodes_waiting() == 1, 10, "b sees a waiting")
        fourth = nodes.gather({**pending, **nodes.start([b, d])}, timeout=30)
    else:
        fourth.update(nodes.gather(pending, timeout=30))
    assert fourth["a"].world_size == 3
    assert value(node(a), "consul_rdzv_restarts_total", cause="health") == 1
    assert value(node(b), "consul_rdzv_restarts_total", cause="departure") == 2
    wait_for(lambda: value(exp.scrape(), "consul_rdzv_run_round", run_id=run_id)
             == fourth["a"].round, 10, "the exporter follows every round")


def test_the_exporter_counts_the_hosts_quarantined_now(agent, prefix, fleet_exporter):
    """consul_rdzv_quarantined_hosts follows the hosts' quarantine keys: an active one counts,
    one whose cooldown ended or a value that is not a quarantine does not."""
    client = agent.client()
    folder = quarantine_dir(prefix)
    try:
        assert value(fleet_exporter.scrape(), "consul_rdzv_quarantined_hosts") == 0
        now = time.time()
        for host, seconds in (("gpu-07", 3600), ("gpu-08", 3600), ("gpu-09", -10)):
            quarantine.update(client, quarantine_key(folder, host),
                              lambda v, h=host, t=seconds: quarantine.add(
                                  v, host=h, now=now, seconds=t, why="test", by="test"))
        client.kv_put(quarantine_key(folder, "junk"), b"not json")
        wait_for(lambda: value(fleet_exporter.scrape(), "consul_rdzv_quarantined_hosts") == 2,
                 30, "two hosts quarantined now")
        client.kv_delete(quarantine_key(folder, "gpu-07"))
        wait_for(lambda: value(fleet_exporter.scrape(), "consul_rdzv_quarantined_hosts") == 1,
                 30, "one host left")
    finally:
        client.close()


def test_a_node_without_metrics_port_serves_nothing_and_imports_nothing(nodes):
    n = nodes.node("plain", nodes.settings())
    assert n.metrics is None and n.client.observer is None
    assert n.registration.heartbeat.observer is None
    nodes.rounds([n], timeout=30)


def test_the_exporter_refuses_a_busy_port(agent, prefix):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "consul_rdzv.cli", "exporter", "--address", agent.address,
             "--key-prefix", prefix, "--bind", "127.0.0.1", "--port", str(port),
             "--timeout", "5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr


def test_under_torch_a_rendezvous_is_timed_once_from_next_rendezvous_to_its_return(
        agent, prefix, run_id, make_handler):
    """Through torch's registry, with --rdzv-conf's metrics keys: one histogram sample per
    next_rendezvous() (the meeting at the trainer store included), and a second one after the
    node's own restart (cause local: nothing broke the round, nobody waits)."""
    handler = make_handler(agent.address, run_id, prefix, metrics_port="0",
                           metrics_host="127.0.0.1")
    m = handler.rendezvous.metrics
    assert m is not None
    handler.next_rendezvous()
    s = scrape(m.port)
    assert value(s, "consul_rdzv_rendezvous_duration_seconds_count") == 1
    assert value(s, "consul_rdzv_rounds_joined_total") == 1
    assert value(s, "consul_rdzv_world_size") == 1
    handler.next_rendezvous()
    s = scrape(m.port)
    assert value(s, "consul_rdzv_rendezvous_duration_seconds_count") == 2
    assert value(s, "consul_rdzv_restarts_total", cause="local") == 1
    assert value(s, "consul_rdzv_restarts_total") == 1
    assert value(s, "consul_rdzv_round") == 2
