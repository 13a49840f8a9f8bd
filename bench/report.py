"""Tables and the plot from a bench/results/*.jsonl file.

    python -m bench.report bench/results/<stamp>.jsonl            # print the markdown tables
    python -m bench.report bench/results/<stamp>.jsonl --docs     # also rewrite the docs
    python -m bench.report MAIN.jsonl --hosts HOSTS.jsonl --docs  # plus a --loopback-hosts run
    python -m bench.report --before B.jsonl --after A.jsonl [A2.jsonl] --cluster C.jsonl --docs

``--docs`` replaces the parts of docs/benchmarks.md between the ``bench:begin``/``bench:end``
(and ``bench-hosts:begin``/``bench-hosts:end``) markers; the prose around them stays. It redraws
docs/benchmark-latency.png. With ``--before``/``--after`` (two products measured by the same
bench code, bench/product.py) and ``--cluster``, it writes the ``bench-compare`` block instead:
before/after tables, the cluster scale tables, and the before/after plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "benchmark-latency.png"


def load(path: Path) -> tuple[dict, list[dict], list[dict]]:
    meta, runs, skips = {}, [], []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        kind = row.get("kind")
        if kind == "meta":
            meta = row
        elif kind == "run":
            runs.append(row)
        elif kind == "skip":
            skips.append(row)
    return meta, runs, skips


def _series(row: dict) -> tuple:
    return (row["scenario"], row["backend"], row["layout"], row.get("trigger"))


class Table:
    """Groups runs by (scenario, backend, layout, trigger) and N."""

    def __init__(self, runs: list[dict], skips: list[dict]) -> None:
        self.runs: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
        for r in runs:
            self.runs[_series(r)][r["n"]].append(r)
        self.skips: dict[tuple, dict[int, str]] = defaultdict(dict)
        for s in skips:
            self.skips[_series(s)][s["n"]] = s["reason"]

    def sizes(self, scenario: str) -> list[int]:
        ns = set()
        for key, by_n in self.runs.items():
            if key[0] == scenario:
                ns.update(by_n)
        for key, by_n in self.skips.items():
            if key[0] == scenario:
                ns.update(by_n)
        return sorted(ns)

    def has(self, key: tuple) -> bool:
        return key in self.runs or key in self.skips

    def values(self, key: tuple, n: int, field: str = "latency_s") -> list[float]:
        return [r[field] for r in self.runs.get(key, {}).get(n, [])
                if r.get("status") == "ok" and r.get(field) is not None]

    def cell(self, key: tuple, n: int, field: str = "latency_s", unit: str = "s") -> str:
        rows = self.runs.get(key, {}).get(n, [])
        skip = self.skips.get(key, {}).get(n)
        if not rows:
            if skip:
                return f"— ({_short(skip)})" if skip.startswith("skipped") else "—"
            return ""
        vals = self.values(key, n, field)
        bad = [r for r in rows if r.get("status") != "ok"]
        warn = " ⚠" if any(r.get("violations") for r in rows) else ""
        if not vals:
            status = bad[0].get("status", "error") if bad else "n/a"
            return f"{status}{warn}"
        text = _fmt(statistics.median(vals), unit)
        if len(vals) > 1:
            text += f" [{_fmt(min(vals), unit, False)}\u2013{_fmt(max(vals), unit, False)}]"
        if bad:
            text += f" ({len(bad)} {bad[0].get('status')})"
        return text + warn

    def ratio(self, a: tuple, b: tuple, n: int, field: str = "latency_s") -> str:
        va, vb = self.values(a, n, field), self.values(b, n, field)
        if not va or not vb:
            return ""
        ra, rb = statistics.median(va), statistics.median(vb)
        if rb <= 0:
            return ""
        return f"1 : {rb / ra:.1f}" if ra > 0 else ""


def _short(reason: str) -> str:
    if reason.startswith("skipped: "):
        return reason[len("skipped: "):].split(" (")[0]
    return reason


def _fmt(v: float, unit: str, with_unit: bool = True) -> str:
    if unit == "s":
        text = f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}"
        return text + (" s" if with_unit else "")
    if unit == "n":
        return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"
    return f"{v:.2f}"


def _stat_cell(t: Table, key: tuple, n: int, field: str, sub: str = "median",
               fmt: str = "{:.0f}") -> str:
    rows = [r for r in t.runs.get(key, {}).get(n, []) if r.get(field)]
    if not rows:
        return ""
    vals = [r[field][sub] for r in rows if r[field].get(sub) is not None]
    return fmt.format(statistics.median(vals)) if vals else ""


def _req_cell(t: Table, key: tuple, n: int, field: str) -> str:
    """'median / max' requests per node per round, medians over the repeats."""
    rows = [r for r in t.runs.get(key, {}).get(n, []) if r.get(field)]
    if not rows:
        return ""
    med = statistics.median(r[field]["median"] for r in rows)
    mx = statistics.median(r[field]["max"] for r in rows)
    return f"{med:.0f} / {mx:.0f}"


def fixed_like(t: Table, scenario: str, title: str, layouts: list[str]) -> list[str]:
    lines = [f"### {title}", ""]
    head = ["N"]
    cols = []
    for layout in layouts:
        suffix = "" if layout == "spread" else " (threads)"
        c10d_name = "c10d (threads, as shipped)" if layout == "threads" else "c10d"
        for backend, name in (("consul", f"consul{suffix}"), ("c10d", c10d_name),
                              ("etcd-v2", f"etcd-v2{suffix}")):
            key = (scenario, backend, layout, None)
            if t.has(key):
                cols.append(("cell", key, name))
                if backend == "c10d" and t.has((scenario, "consul", layout, None)):
                    cols.append(("ratio", ((scenario, "consul", layout, None), key),
                                 f"consul : c10d{suffix}"))
    if not cols:
        return []
    head += [c[2] for c in cols]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for n in t.sizes(scenario):
        if not any(t.runs.get(key, {}).get(n) for kind, key, _ in cols if kind == "cell"):
            continue
        row = [str(n)]
        for kind, key, _ in cols:
            row.append(t.cell(key, n) if kind == "cell" else t.ratio(*key, n))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    return lines


def consul_breakdown(t: Table, scenario: str, prefix: str = "") -> list[str]:
    key = (scenario, "consul", "spread", "detect" if scenario == "failover" else None)
    if key not in t.runs:
        return []
    lines = ["| N | round sealed | every `next_round()` returned | every `next_rendezvous()` "
             "returned | Consul requests per node (median / max) | consul agent CPU s | "
             "client CPU s |", "|---|---|---|---|---|---|---|"]
    for n in sorted(t.runs[key]):
        rows = [r for r in t.runs[key][n] if r.get("status") == "ok"]
        if not rows:
            continue

        def med(field, rows=rows):
            vals = [r[field] for r in rows if r.get(field) is not None]
            return statistics.median(vals) if vals else None

        def f(v, unit="s"):
            return "" if v is None else _fmt(v, unit)

        lines.append(f"| {n} | {f(med(prefix + 'sealed_s'))} | {f(med(prefix + 'released_s'))} "
                     f"| {f(med(prefix + 'latency_s'))} "
                     f"| {_req_cell(t, key, n, prefix + 'product_requests')} "
                     f"| {f(med(prefix + 'server_cpu_s'), 'x')} "
                     f"| {f(med(prefix + 'client_cpu_s'), 'x')} |")
    lines.append("")
    return lines


def cost_table(t: Table, scenario: str = "fixed") -> list[str]:
    """CPU per node per round: the client side (all worker processes) and the server process."""
    backends = [b for b in ("consul", "c10d", "etcd-v2") if (scenario, b, "spread", None) in t.runs]
    if not backends:
        return []
    head = ["N"] + [f"{b}: client / server CPU ms per node" for b in backends]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in t.sizes(scenario):
        cells = []
        for b in backends:
            rows = [r for r in t.runs.get((scenario, b, "spread", None), {}).get(n, [])
                    if r.get("client_cpu_s") is not None and r.get("status") == "ok"]
            if not rows:
                cells.append("")
                continue
            cli = statistics.median(r["client_cpu_s"] for r in rows) / n * 1000
            srv = [r["server_cpu_s"] for r in rows if r.get("server_cpu_s") is not None]
            srv_text = f"{statistics.median(srv) / n * 1000:.1f}" if srv else "?"
            cells.append(f"{cli:.1f} / {srv_text}")
        if any(cells):
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def consul_http_table(t: Table, scenario: str = "fixed") -> list[str]:
    key = (scenario, "consul", "spread", None)
    if key not in t.runs:
        return []
    cats = [("PUT agent/service", "register service"), ("PUT session/create", "create session"),
            ("PUT txn", "txn (member write)"), ("PUT kv", "leader acquire"),
            ("GET kv (blocking)", "blocking list (waits for the seal)"),
            ("PUT agent/check", "check pass"), ("PUT session/renew", "session renew"),
            ("TCPStore client connect", "TCPStore client connect to rank 0")]
    lines = ["| N | " + " | ".join(c[1] for c in cats) + " |", "|---|" + "---|" * len(cats)]
    for n in sorted(t.runs[key]):
        rows = [r for r in t.runs[key][n] if r.get("consul_http")]
        if not rows:
            continue
        http = rows[0]["consul_http"]
        cells = []
        for cat, _ in cats:
            v = http.get(cat)
            cells.append(f"{v['p50_ms']:.0f} / {v['p90_ms']:.0f} / {v['max_ms']:.0f}" if v else "")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def requests_table(t: Table, scenario: str, layout: str = "spread") -> list[str]:
    cols = []
    for backend, field, name in (
        ("consul", "product_requests", "consul: Consul requests (`RoundResult.requests`)"),
        ("c10d", "requests", "c10d: store round trips (get / compare_set)"),
        ("etcd-v2", "requests", "etcd-v2: HTTP requests (rendezvous state)"),
    ):
        trig = "detect" if scenario == "failover" and backend == "consul" else (
            "kill" if scenario == "failover" else None)
        key = (scenario, backend, layout, trig)
        if key in t.runs:
            cols.append((key, field, name))
    if not cols:
        return []
    lines = ["| N | " + " | ".join(c[2] for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for n in t.sizes(scenario):
        cells = [_req_cell(t, key, n, field) for key, field, _ in cols]
        if any(cells):
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def lastcall_extra(t: Table) -> list[str]:
    lines = ["World size reached (median) and nodes left for a later round:", "",
             "| N | " + " | ".join(b for b in ("consul", "c10d", "etcd-v2")
                                  if t.has(("lastcall", b, "spread", None))) + " |"]
    backends = [b for b in ("consul", "c10d", "etcd-v2") if t.has(("lastcall", b, "spread", None))]
    if not backends:
        return []
    lines.append("|---|" + "---|" * len(backends))
    for n in t.sizes("lastcall"):
        if not any(t.runs.get(("lastcall", b, "spread", None), {}).get(n) for b in backends):
            continue
        cells = []
        for b in backends:
            rows = [r for r in t.runs.get(("lastcall", b, "spread", None), {}).get(n, [])
                    if r.get("world")]
            if not rows:
                cells.append("")
                continue
            w = statistics.median(r["world"] for r in rows)
            left = statistics.median(r.get("left_out", 0) for r in rows)
            cells.append(f"W={w:.0f}" + (f", {left:.0f} left" if left else ""))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def failover_table(t: Table) -> list[str]:
    cols = []
    cd = ("failover", "consul", "spread", "detect")
    ck = ("failover", "consul", "spread", "kill")
    c10 = ("failover", "c10d", "spread", "kill")
    et = ("failover", "etcd-v2", "spread", "kill")
    cdt = ("failover", "consul", "threads", "detect")
    if t.has(cd):
        cols.append(("det", cd, "consul: death seen (`num_nodes_waiting() > 0`)"))
        cols.append(("cell", cd, "consul, survivors rejoin on detection"))
    if t.has(ck):
        cols.append(("cell", ck, "consul, survivors rejoin at the kill"))
    if t.has(c10):
        cols.append(("cell", c10, "c10d, survivors rejoin at the kill"))
        if t.has(ck):
            cols.append(("ratio", (ck, c10), "consul : c10d (both at the kill)"))
        elif t.has(cd):
            cols.append(("ratio", (cd, c10), "consul : c10d"))
    if t.has(et):
        cols.append(("cell", et, "etcd-v2, survivors rejoin at the kill"))
    if t.has(cdt):
        cols.append(("cell", cdt, "consul (threads: heartbeat stopped), on detection"))
    if not cols:
        return []
    lines = ["### failover: time from the kill until every survivor returned from the next round",
             "", "| N | " + " | ".join(c[2] for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for n in t.sizes("failover"):
        if not any(t.runs.get(key, {}).get(n) for kind, key, _ in cols if kind != "ratio"):
            continue
        cells = []
        for kind, key, _ in cols:
            if kind == "det":
                cells.append(t.cell(key, n, "detect_first_s"))
            elif kind == "cell":
                cells.append(t.cell(key, n))
            else:
                cells.append(t.ratio(*key, n))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def training_table(t: Table) -> list[str]:
    backends = [b for b in ("consul", "c10d", "etcd-v2") if ("fixed", b, "spread", None) in t.runs]
    if not backends:
        return []
    head = ["N"]
    for b in backends:
        head += [f"{b}: requests/s per node", f"{b}: requests per 200 back-to-back calls",
                 f"{b}: ms per call"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in t.sizes("fixed"):
        row = [str(n)]
        have = False
        for b in backends:
            rows = [r for r in t.runs.get(("fixed", b, "spread", None), {}).get(n, [])
                    if isinstance(r.get("train"), dict) and "req_per_s_per_node" in r["train"]]
            if not rows:
                row += ["", "", ""]
                continue
            have = True
            tr = rows[0]["train"]
            ops = tr.get("ops_per_s_per_node") or {}
            detail = ", ".join(f"{k} {v:.2f}" for k, v in sorted(ops.items()) if v >= 0.005)
            rate = f"{tr['req_per_s_per_node']['mean']:.2f}"
            if detail:
                rate += f" ({detail})"
            calls = tr.get("nnw_calls_per_s_per_node") or {}
            if calls and calls.get("mean", 10) < 9:
                rate += f"; polled only {calls['mean']:.1f}/s"
            probes = tr.get("probe_requests_per_200_calls") or []
            row += [rate, f"{max(probes) if probes else ''}",
                    f"{tr['nnw_mean_ms']['median']:.3f}" if tr.get("nnw_mean_ms") else ""]
        if have:
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    return lines


def problems(runs: list[dict], skips: list[dict]) -> list[str]:
    lines = []
    bad = [r for r in runs if r.get("violations")]
    if bad:
        lines += ["Invariant violations and errors (every one, none hidden):", ""]
        for r in bad:
            seen: list[str] = []
            for v in r["violations"]:
                text = v[len("round: "):] if v.startswith("round: ") else v
                text = " ".join(text.split())  # one line per run in the markdown list
                if text not in seen:
                    seen.append(text)
            lines.append(f"- {r['scenario']} {r['backend']} {r['layout']}"
                         f"{' ' + r['trigger'] if r.get('trigger') else ''} N={r['n']} "
                         f"rep {r.get('rep')}: " + "; ".join(v[:400] for v in seen))
        lines.append("")
    else:
        lines += ["Invariants (ranks 0..W-1 unique, one world size, one round, one trainer-store "
                  "endpoint per round) held in every run.", ""]
    real = [s for s in skips if "not run" not in s["reason"]]
    if real:
        lines += ["Not measured:", ""]
        seen = set()
        for s in real:
            k = (s["scenario"], s["backend"], s["layout"], s.get("trigger"), s["reason"])
            if k in seen:
                continue
            seen.add(k)
            ns = sorted(x["n"] for x in real if (x["scenario"], x["backend"], x["layout"],
                                                   x.get("trigger"), x["reason"]) == k)
            trig = f" {s['trigger']}" if s.get("trigger") else ""
            reason = s["reason"]
            if " timeout" not in reason.split(" (")[0]:
                reason = reason.split(" (per-run timeout")[0]
            lines.append(f"- {s['scenario']} {s['backend']} {s['layout']}{trig} "
                         f"N={','.join(map(str, ns))}: {reason}")
        lines.append("")
    return lines


def machine_lines(meta: dict) -> list[str]:
    m = meta.get("machine", {})
    product = meta.get("product") or {}
    return [
        f"- Machine: {m.get('cores')} cores ({m.get('cpu') or '?'}), {m.get('mem_gb')} GB RAM, "
        f"{m.get('platform')}",
        f"- Python {m.get('python')}, torch {m.get('torch')}, {m.get('consul')} (dev agent), "
        f"etcd {m.get('etcd') or 'not run: ' + str(m.get('etcd_note'))}, python-etcd "
        f"{m.get('python_etcd', '?')}, requests {m.get('requests', '?')}, urllib3 "
        f"{m.get('urllib3', '?')}",
        f"- Run {meta.get('stamp')} with "
        f"`{' '.join(['python -m bench.run', *meta.get('argv', [])])}`; "
        f"consul_rdzv at git {product.get('git_head', '?')}"
        f"{' + uncommitted changes' if product.get('consul_rdzv_dirty') else ''}"
        f" (package digest {product.get('consul_rdzv_sha256', '?')}); "
        f"spread layout over up to {meta.get('procs')} worker processes; per-run timeout "
        f"{meta.get('timeout'):g} s; RLIMIT_NOFILE {meta.get('nofile')}",
    ]


def load_lines(runs: list[dict], meta: dict) -> list[str]:
    """How busy the rest of the machine was while the rounds ran (shared machines)."""
    cores = (meta.get("machine") or {}).get("cores") or 1
    per = []
    for r in runs:
        for prefix in ("", "r1_"):
            m, f = r.get(f"{prefix}machine_cpu_s"), r.get(f"{prefix}foreign_cpu_s")
            if m and f is not None:
                per.append(f / m * cores)
                break
    if not per:
        return []
    per.sort()
    busy = sum(1 for x in per if x > 0.5)
    return [f"- Other processes on the machine used a median {statistics.median(per):.2f} and "
            f"at most {per[-1]:.2f} of the {cores} cores while the rounds ran ({busy} of "
            f"{len(per)} runs above 0.5 core): per-run figures (`foreign_cpu_s`) are in the JSON "
            "lines."]


def render(path: Path, *, plot_rel: str | None = None) -> str:
    meta, runs, skips = load(path)
    t = Table(runs, skips)
    layouts = sorted({r["layout"] for r in runs}, key=lambda x: x != "spread")
    out = [f"Results of `{Path(path).name}`:", ""]
    out += machine_lines(meta) + load_lines(runs, meta) + [""]
    if plot_rel:
        out += [f"![rendezvous latency vs N]({plot_rel})", ""]
    out += ["Cells: median [min\u2013max] over the repeats, in seconds; `⚠` marks a run with an "
            "invariant violation (listed below); `—` not run, with the reason. Ratios "
            "`consul : c10d` compare medians of the same invocation: `1 : 12` means c10d took "
            "12 times as long.", ""]
    def section(heading: str, body: list[str]) -> list[str]:
        return [heading, "", *body] if body else []

    out += fixed_like(t, "fixed", "fixed: min = max = N, time from release until every "
                      "`next_rendezvous()` returned", layouts)
    out += section("Where consul's time goes (spread layout; medians): the coordinator seals the "
                   "round, every node's `next_round()` returns, then the torch handler connects "
                   "its TCPStore client to rank 0 and `next_rendezvous()` returns.",
                   consul_breakdown(t, "fixed"))
    out += section("Consul HTTP latency seen by the nodes during the round (first repeat; "
                   "p50 / p90 / max in ms):", consul_http_table(t, "fixed"))
    out += section("CPU per node per round (spread layout; client = all worker processes, "
                   "server = the consul agent, the TCPStore server process or etcd; medians):",
                   cost_table(t, "fixed"))
    out += section("Requests per node per round (median / max over the nodes; spread layout):",
                   requests_table(t, "fixed"))
    out += section("### training: `num_nodes_waiting()` polled on every node at 0.1 s "
                   "(torchrun's monitor interval)", training_table(t))
    out += fixed_like(t, "lastcall", "lastcall: min = N/2, max = 2N, N nodes, "
                      "last_call_timeout = 1 s", layouts)
    out += lastcall_extra(t)
    out += section("consul lastcall breakdown (spread layout; medians):",
                   consul_breakdown(t, "lastcall"))
    out += section("Requests per node per round (lastcall):", requests_table(t, "lastcall"))
    out += failover_table(t)
    out += section("consul failover breakdown (detect trigger; times from the kill):",
                   consul_breakdown(t, "failover"))
    out += section("Requests per survivor for the failover round:",
                   requests_table(t, "failover"))
    out += single_run_extras(Path(path), meta)
    out += problems(runs, skips)
    return "\n".join(out)


def single_run_extras(path: Path, meta: dict) -> list[str]:
    """The SIGTERM failover, back-to-back rounds and Consul's own request counts of one file."""
    rs = RunSet([path])
    label = f"`{(meta.get('product') or {}).get('git_head') or '?'}`"
    topo = None
    out: list[str] = []
    term = [r for r in rs.runs if r["scenario"] == "failover-term"]
    if term:
        out += ["### failover-term: SIGTERM of the victim's process (torch's `SignalException`, "
                "then its atexit hooks); time from the signal until every survivor returned", "",
                "| N | consul, rejoin on detection | consul, rejoin at the signal | c10d, at the "
                "signal |", "|---|---|---|---|"]
        for n in sorted({r["n"] for r in term}):
            det = rs.select("failover-term", n, trigger="detect", topology=topo)
            kill = rs.select("failover-term", n, trigger="kill", topology=topo)
            c10d = rs.select("failover-term", n, backend="c10d", trigger="kill", topology=topo)
            seen = _med([r.get("detect_first_s") for r in det if not _failed(r)])
            cell = _runs_cell(det) + (f"; seen {seen:.2f}" if det and seen is not None else "")
            out.append(f"| {n} | {cell} | {_runs_cell(kill)} | {_runs_cell(c10d)} |")
        out.append("")
    if rs.select("backtoback", topology=topo):
        out += ["### backtoback: each round's time from the last node's entry \u00b7 "
                "Consul-counted requests per node besides check passes", ""]
        out += compare_b2b([(label, rs)], topology=topo)
    if any(isinstance(r.get("consul_requests"), dict) for r in rs.runs):
        out += ["### Requests per node counted by Consul (`consul_api_http_count`): fixed, one "
                "round from handler creation", ""]
        out += compare_requests(RunSet([]), rs, "-", label.strip("`"), topology=topo)
    return out


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (said on stderr) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: pip install -e '.[bench]'", file=sys.stderr)
        return None
    return plt


def _log_axes(axes: Any) -> None:
    """Log-log panels of seconds against N, labelled in plain numbers, with their legends."""
    import matplotlib.ticker

    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("nodes N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5)
    axes[0].set_ylabel("seconds (median, min\u2013max)")


def _save_png(plt: Any, fig: Any, target: Path) -> Path:
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=80)
    plt.close(fig)
    try:  # a palette PNG is a third of the size: fit for committing
        from PIL import Image

        with Image.open(target) as img:
            img.convert("RGB").quantize(colors=64).save(target, optimize=True)
    except Exception:
        pass
    return target


def plot(path: Path, extra: Path | None = None, target: Path = PLOT) -> Path | None:
    """Latency vs N, one panel per scenario; ``extra`` (a --loopback-hosts run) is overlaid."""
    plt = _pyplot()
    if plt is None:
        return None
    meta, runs, skips = load(path)
    tables = [(Table(runs, skips), "")]
    if extra:
        xmeta, xruns, xskips = load(extra)
        head = (xmeta.get("product") or {}).get("git_head") or "?"
        tables.append((Table(xruns, xskips), f", loopback hosts (git {head})"))
    styles = {
        ("consul", "spread"): ("tab:blue", "-", "o"),
        ("consul", "threads"): ("tab:blue", ":", "s"),
        ("c10d", "spread"): ("tab:red", "-", "o"),
        ("c10d", "threads"): ("tab:red", ":", "s"),
        ("etcd-v2", "spread"): ("tab:green", "-", "o"),
        ("etcd-v2", "threads"): ("tab:green", ":", "s"),
    }
    panels = [("fixed", "fixed (min = max = N)"), ("lastcall", "lastcall (last call 1 s)"),
              ("failover", "failover (from the kill)")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.4))
    for ax, (scenario, title) in zip(axes, panels, strict=True):
        for t, tag in tables:
            for key, by_n in sorted(t.runs.items(), key=lambda kv: str(kv[0])):
                if key[0] != scenario:
                    continue
                _, backend, layout, trigger = key
                if tag and backend != "consul":
                    continue  # the overlay shows consul only (c10d does not connect in a round)
                ns, med, lo, hi = [], [], [], []
                for n in sorted(by_n):
                    vals = t.values(key, n)
                    if vals:
                        ns.append(n)
                        m = statistics.median(vals)
                        med.append(m)
                        lo.append(m - min(vals))
                        hi.append(max(vals) - m)
                if not ns:
                    continue
                color, ls, marker = styles.get((backend, layout), ("gray", "-", "x"))
                label = f"{backend} {layout}"
                if layout == "threads" and backend == "c10d":
                    label = "c10d threads (as shipped)"
                if trigger == "kill":
                    ls, label = "--", label + " (rejoin at kill)"
                elif trigger == "detect":
                    label += " (rejoin on detection)"
                if tag:
                    color, marker = "tab:cyan", "^"
                    label += tag
                ax.errorbar(ns, med, yerr=[lo, hi], color=color, linestyle=ls, marker=marker,
                            markersize=4, capsize=2, linewidth=1.2, label=label)
        ax.set_title(title, fontsize=10)
    _log_axes(axes)
    m = meta.get("machine", {})
    fig.suptitle(f"Rendezvous latency, all nodes on one machine: {m.get('cores')} cores, "
                 f"torch {m.get('torch')}, {m.get('consul')}, etcd {m.get('etcd') or '-'}",
                 fontsize=10)
    return _save_png(plt, fig, target)


def _replace_block(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip() + "\n\n" + block + "\n"


def write_docs(path: Path | None, hosts: Path | None = None) -> None:
    """Rewrite the generated blocks of docs/benchmarks.md (and the plot, given a main run)."""
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    if path is not None:
        png = plot(Path(path), Path(hosts) if hosts else None)
        rel = png.relative_to(DOCS.parent).as_posix() if png else None
        text = _replace_block(text, "bench", render(Path(path), plot_rel=rel))
    if hosts is not None:
        text = _replace_block(text, "bench-hosts", render(Path(hosts)))
    DOCS.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report")
    p.add_argument("results", nargs="?", help="a bench/results/*.jsonl file")
    p.add_argument("--before", nargs="*", default=[],
                   help="before/after report: runs of the old product (bench.run --product)")
    p.add_argument("--after", nargs="*", default=[], help="... runs of the new product")
    p.add_argument("--cluster", nargs="*", default=[],
                   help="... runs on a cluster (bench.run --cluster-clients)")
    p.add_argument("--hosts", default=None,
                   help="a --loopback-hosts run: its tables go to their own block of the docs "
                        "and consul's series are overlaid on the plot")
    p.add_argument("--docs", action="store_true")
    args = p.parse_args(argv)
    if args.before or args.after:
        paths = [[Path(x) for x in group] for group in (args.before, args.after, args.cluster)]
        print(render_compare(*paths))
        if args.docs:
            write_compare_docs(*paths)
        return 0
    if not args.results:
        p.error("give a results file, or --before/--after")
    print(render(Path(args.results)))
    if args.docs:
        write_docs(Path(args.results), Path(args.hosts) if args.hosts else None)
    return 0



# =========================================================================== before / after

#: Goals of issues 11 and 12 (docs/benchmarks.md judges them from these tables).
HEARTBEAT_TTL = 5.0


class RunSet:
    """Runs of several JSON lines files, each run tagged with its file's product and topology."""

    def __init__(self, paths: list[Path]) -> None:
        self.metas: list[dict] = []
        self.runs: list[dict] = []
        for path in paths:
            meta, runs, _ = load(path)
            product = (meta.get("product") or {}).get("git_head") or "?"
            self.metas.append({**meta, "_file": Path(path).name})
            for r in runs:
                r["_product"] = product
                r["_file"] = Path(path).name
                r.setdefault("topology", "single")
                self.runs.append(r)

    def products(self) -> list[str]:
        seen: list[str] = []
        for m in self.metas:
            p = (m.get("product") or {}).get("git_head") or "?"
            if p not in seen:
                seen.append(p)
        return seen

    def select(self, scenario: str, n: int | None = None, *, backend: str = "consul",
               trigger: str | None = None, topology: str | None = "single",
               agents: int | None = None, product: str | None = None,
               ok: bool = False) -> list[dict]:
        out = []
        for r in self.runs:
            if r["scenario"] != scenario or r["backend"] != backend:
                continue
            if r.get("layout", "spread") != "spread":
                continue
            if trigger is not None and r.get("trigger") != trigger:
                continue
            if n is not None and r["n"] != n:
                continue
            if topology is not None and r.get("topology", "single") != topology:
                continue
            if agents is not None and r.get("agents") != agents:
                continue
            if product is not None and r["_product"] != product:
                continue
            if ok and r.get("status") != "ok":
                continue
            out.append(r)
        return out

    def sizes(self, scenario: str, **kw) -> list[int]:
        return sorted({r["n"] for r in self.select(scenario, **kw)})


def _vals_cell(vals: list[float], bad: int = 0, warn: bool = False, unit: str = "s") -> str:
    if not vals:
        return ("failed" if bad else "") + (" ⚠" if warn else "")
    text = _fmt(statistics.median(vals), unit)
    if len(vals) > 1:
        text += f" [{_fmt(min(vals), unit, False)}\u2013{_fmt(max(vals), unit, False)}]"
        text += f" ({len(vals)})"
    if bad:
        text += f" + {bad} failed"
    return text + (" ⚠" if warn else "")


def _failed(r: dict) -> bool:
    """A run that timed out, or in which a node raised (the round did not complete for all)."""
    return r.get("status") != "ok" or any("raised" in v for v in r.get("violations") or [])


def _runs_cell(runs: list[dict], field: str = "latency_s") -> str:
    vals = [r[field] for r in runs if not _failed(r) and r.get(field) is not None]
    bad = sum(1 for r in runs if _failed(r))
    warn = any(r.get("violations") for r in runs)
    return _vals_cell(vals, bad, warn)


def _med(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _num(v: float | None, fmt: str = "{:.1f}") -> str:
    return "" if v is None else fmt.format(v)


def _counted(runs: list[dict], key: str, field: str) -> float | None:
    return _med([(r.get(key) or {}).get(field) for r in runs if isinstance(r.get(key), dict)])


def _pass_rate(runs: list[dict], key: str = "consul_requests") -> float | None:
    """Check passes per node per second, pooled over the runs' windows (a pass every
    keep_alive_interval: a window of one or two intervals says little on its own)."""
    passes = node_seconds = 0.0
    for r in runs:
        c = r.get(key)
        if isinstance(c, dict) and c.get("seconds") and "passes" in c:
            passes += c["passes"]
            node_seconds += c["nodes"] * c["seconds"]
    return passes / node_seconds if node_seconds else None


def compare_fixed(before: RunSet, after: RunSet, pb: str, pa: str) -> list[str]:
    sizes = sorted(set(before.sizes("fixed")) | set(after.sizes("fixed")))
    lines = [f"| N | before (`{pb}`) | after (`{pa}`) | c10d (in the after run) | "
             "after : c10d | before : after |", "|---|---|---|---|---|---|"]
    for n in sizes:
        b, a = before.select("fixed", n), after.select("fixed", n)
        c = after.select("fixed", n, backend="c10d", topology=None)
        mb = _med([r["latency_s"] for r in b if r.get("status") == "ok" and r.get("latency_s")])
        ma = _med([r["latency_s"] for r in a if r.get("status") == "ok" and r.get("latency_s")])
        mc = _med([r["latency_s"] for r in c if r.get("status") == "ok" and r.get("latency_s")])
        ratio = f"1 : {mc / ma:.1f}" if ma and mc else ""
        speed = f"{mb / ma:.2f} : 1" if ma and mb else ""
        lines.append(f"| {n} | {_runs_cell(b)} | {_runs_cell(a)} | {_runs_cell(c)} | {ratio} "
                     f"| {speed} |")
    return [*lines, ""]


def compare_breakdown(sets: list[tuple[str, RunSet]], scenario: str = "fixed",
                      topology: str = "single") -> list[str]:
    lines = ["| N | version | round sealed | every `next_round()` returned | every "
             "`next_rendezvous()` returned | agent CPU s | client CPU s | foreign CPU (cores) |",
             "|---|---|---|---|---|---|---|---|"]
    sizes = sorted({n for _, s in sets for n in s.sizes(scenario, topology=topology)})
    for n in sizes:
        for label, s in sets:
            runs = s.select(scenario, n, topology=topology, ok=True)
            if not runs:
                continue

            def m(field, runs=runs):
                return _med([r.get(field) for r in runs])

            foreign = _med([r["foreign_cpu_s"] / r["machine_cpu_s"] * 2 for r in runs
                            if r.get("foreign_cpu_s") is not None and r.get("machine_cpu_s")])
            lines.append(f"| {n} | {label} | {_num(m('sealed_s'), '{:.3f}')} | "
                         f"{_num(m('released_s'), '{:.3f}')} | {_num(m('latency_s'), '{:.3f}')} "
                         f"| {_num(m('server_cpu_s'), '{:.2f}')} | "
                         f"{_num(m('client_cpu_s'), '{:.2f}')} | {_num(foreign, '{:.2f}')} |")
    return [*lines, ""]


def compare_failover(before: RunSet, after: RunSet, pb: str, pa: str,
                     topology: str = "single") -> list[str]:
    lines = ["| N | survivors rejoin | SIGKILL: before | SIGKILL: after | SIGTERM: before | "
             "SIGTERM: after | c10d SIGKILL | c10d SIGTERM |", "|---|---|---|---|---|---|---|---|"]
    sizes = sorted(set(before.sizes("failover", topology=topology))
                   | set(after.sizes("failover", topology=topology))
                   | set(before.sizes("failover-term", topology=topology))
                   | set(after.sizes("failover-term", topology=topology)))
    for n in sizes:
        for trigger, name in (("detect", "on detection"), ("kill", "at the signal")):
            cells = []
            for s, scenario in ((before, "failover"), (after, "failover"),
                                (before, "failover-term"), (after, "failover-term")):
                runs = s.select(scenario, n, trigger=trigger, topology=topology)
                cell = _runs_cell(runs)
                seen = _med([r.get("detect_first_s") for r in runs if r.get("status") == "ok"])
                if cell and trigger == "detect" and seen is not None:
                    cell += f"; seen {seen:.2f}"
                cells.append(cell)
            for scenario in ("failover", "failover-term"):
                runs = after.select(scenario, n, backend="c10d", trigger="kill",
                                    topology=None) if trigger == "kill" else []
                cells.append(_runs_cell(runs))
            if any(cells):
                lines.append(f"| {n} | {name} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def victim_lines(after: RunSet) -> list[str]:
    runs = [r for r in after.select("failover-term") if isinstance(r.get("victim_exit"), dict)]
    exits = [r["victim_exit"]["exited_s"] for r in runs if "exited_s" in r["victim_exit"]]
    atexit = [r["victim_exit"]["atexit_s"] for r in runs if "atexit_s" in r["victim_exit"]]
    left = sum(1 for r in runs if all(r["victim_exit"].get("left") or [False]))
    if not exits:
        return []
    return [f"SIGTERM victim (after): its atexit leave took median "
            f"{statistics.median(atexit):.2f} s "
            f"[{min(atexit):.2f}\u2013{max(atexit):.2f}], the process was gone "
            f"{statistics.median(exits):.2f} s after the signal; its node had left in {left} of "
            f"{len(runs)} runs.", ""]


def compare_requests(before: RunSet, after: RunSet, pb: str, pa: str,
                     topology: str = "single") -> list[str]:
    """Consul-counted requests per node, fixed scenario."""
    lines = ["| N | version | all | TTL check passes | the rest | of which registration | "
             "check passes per node per s | product's own count (`RoundResult.requests`, "
             "median / max) |", "|---|---|---|---|---|---|---|---|"]
    sizes = sorted(set(before.sizes("fixed", topology=topology))
                   | set(after.sizes("fixed", topology=topology)))
    for n in sizes:
        for label, s in ((f"before `{pb}`", before), (f"after `{pa}`", after)):
            runs = s.select("fixed", n, topology=topology)
            runs = [r for r in runs if not _failed(r) and isinstance(r.get("consul_requests"), dict)
                    and "per_node" in r["consul_requests"]]
            if not runs:
                continue
            prod = [r.get("product_requests") for r in runs if r.get("product_requests")]
            own = (f"{_med([p['median'] for p in prod]):.0f} / {_med([p['max'] for p in prod]):.0f}"
                   if prod else "")
            lines.append(
                f"| {n} | {label} | {_num(_counted(runs, 'consul_requests', 'per_node'))} | "
                f"{_num(_counted(runs, 'consul_requests', 'passes_per_node'))} | "
                f"{_num(_counted(runs, 'consul_requests', 'rest_per_node'))} | "
                f"{_num(_counted(runs, 'consul_requests_registration', 'rest_per_node'))} | "
                f"{_num(_pass_rate(runs), '{:.2f}')} | "
                f"{own} |")
    return [*lines, ""]


def compare_b2b(sets: list[tuple[str, RunSet]], topology: str = "single") -> list[str]:
    """Back-to-back rounds: each round's time (from the last entry) and Consul-counted requests
    per node besides check passes."""
    lines = ["| N | version | round 1 (all at once) | round 2 | round 3 | round 4 | rounds 2-4: "
             "requests per node per round (besides check passes) | check passes per node "
             "per s | slowest round 2-4, from the first entry |",
             "|---|---|---|---|---|---|---|---|---|"]
    sizes = sorted({n for _, s in sets for n in s.sizes("backtoback", topology=topology)})
    for n in sizes:
        for label, s in sets:
            runs = s.select("backtoback", n, topology=topology)
            if not runs:
                continue
            good = [r for r in runs if r.get("status") == "ok"]
            bad = len(runs) - len(good)
            r1_t = _med([r.get("r1_latency_s") for r in good])
            r1_q = _med([(r.get("r1_consul_requests") or {}).get("rest_per_node") for r in good])
            cells = [f"{_num(r1_t, '{:.3f}')} s · {_num(r1_q)} req" if r1_t is not None else ""]
            per_round_rest = []
            firsts = []
            for phase in (2, 3, 4):
                rows = [x for r in good for x in r.get("b2b_rounds") or []
                        if x.get("phase") == phase]
                t = [x.get("from_last_entry_s") for x in rows]
                q = [(x.get("consul_requests") or {}).get("rest_per_node") for x in rows]
                firsts += [x.get("from_first_entry_s") for x in rows]
                per_round_rest += [v for v in q if v is not None]
                tv = [v for v in t if v is not None]
                cell = ""
                if tv:
                    cell = _fmt(statistics.median(tv), "s")
                    if len(tv) > 1:
                        cell += f" [{_fmt(min(tv), 's', False)}\u2013{_fmt(max(tv), 's', False)}]"
                    cell += f" · {_num(_med(q))} req"
                cells.append(cell)
            mean_rest = (sum(per_round_rest) / len(per_round_rest)) if per_round_rest else None
            rate = _pass_rate(good)
            first = max((v for v in firsts if v is not None), default=None)
            lines.append(f"| {n} | {label}{f' ({bad} failed)' if bad else ''} | "
                         + " | ".join(cells) + f" | {_num(mean_rest)} | {_num(rate, '{:.2f}')} | "
                         f"{_num(first, '{:.2f}')} s |")
    return [*lines, ""]


def cluster_fixed(cluster: RunSet, single: list[tuple[str, RunSet]]) -> list[str]:
    """Fixed rounds on one dev agent vs spread over client agents, N >= 128."""
    lines = ["| N | where | nodes per agent | version | every `next_rendezvous()` returned, "
             "median [min\u2013max] (runs) | round sealed | every `next_round()` returned | "
             "requests per node besides passes (Consul-counted) | agents' CPU s | client CPU s "
             "| foreign CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for _, s in single:
        for r in s.select("fixed", topology="single"):
            groups[(r["n"], 1, "one dev agent", r["_product"])].append(r)
    for r in cluster.select("fixed", topology="cluster"):
        groups[(r["n"], r.get("agents") or 1,
                f"cluster: 3 servers + {r.get('agents')} client agents", r["_product"])].append(r)
    for (n, agents, where, product), runs in sorted(groups.items()):
        if n < 128:
            continue
        good = [r for r in runs if not _failed(r)]
        lines.append(
            f"| {n} | {where} | {n // agents} | `{product}` | {_runs_cell(runs)} | "
            f"{_num(_med([r.get('sealed_s') for r in good]), '{:.2f}')} | "
            f"{_num(_med([r.get('released_s') for r in good]), '{:.2f}')} | "
            f"{_num(_counted(good, 'consul_requests_round', 'rest_per_node'))} | "
            f"{_num(_med([r.get('server_cpu_s') for r in runs]), '{:.1f}')} | "
            f"{_num(_med([r.get('client_cpu_s') for r in runs]), '{:.1f}')} | "
            f"{_num(_med([r.get('foreign_cpu_s') for r in runs]), '{:.1f}')} |")
    return [*lines, ""]


def cluster_failover(cluster: RunSet) -> list[str]:
    lines = ["| N | where | version | SIGKILL, rejoin on detection: all back (death seen) | "
             "SIGTERM, on detection |", "|---|---|---|---|---|"]
    groups: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for scenario in ("failover", "failover-term"):
        for r in cluster.select(scenario, trigger="detect", topology="cluster"):
            groups[(r["n"], r.get("agents"), r["_product"])][scenario].append(r)
    for (n, agents, product), by in sorted(groups.items()):
        cells = []
        for scenario in ("failover", "failover-term"):
            runs = by.get(scenario, [])
            cell = _runs_cell(runs)
            seen = _med([r.get("detect_first_s") for r in runs if not _failed(r)])
            if cell and seen is not None:
                cell += f" (seen {seen:.2f})"
            cells.append(cell)
        lines.append(f"| {n} | cluster, {agents} client agents | `{product}` | "
                     + " | ".join(cells) + " |")
    return [*lines, ""]


def cluster_resources(sets: list[tuple[str, RunSet]]) -> list[str]:
    rss_s, rss_c, starts, agents = [], [], [], set()
    for _, s in sets:
        for r in s.runs:
            srv = r.get("server") or {}
            if srv.get("topology") != "cluster":
                continue
            rss_s += srv.get("server_rss_mb") or []
            rss_c += srv.get("client_rss_mb") or []
            if srv.get("start_s"):
                starts.append(srv["start_s"])
            agents.add(srv.get("clients"))
    if not rss_c:
        return []
    return [f"Cluster agents (at the start of each run): servers {statistics.median(rss_s):.0f} MB "
            f"RSS each, client agents {statistics.median(rss_c):.0f} MB each (median); a "
            f"cluster of 3 + {max(a for a in agents if a)} was up in "
            f"{statistics.median(starts):.1f} s (median).", ""]


def load_summary(sets: list[tuple[str, RunSet]]) -> list[str]:
    lines = []
    for label, s in sets:
        for meta in s.metas:
            runs = [r for r in s.runs if r["_file"] == meta["_file"]]
            foreign = load_lines(runs, meta)
            product = meta.get("product") or {}
            argv = " ".join(["python -m bench.run", *meta.get("argv", [])])
            lines.append(f"- `{meta['_file']}` ({label}, consul_rdzv `{product.get('git_head')}`,"
                         f" digest {product.get('consul_rdzv_sha256')}): `{argv}`")
            if foreign:
                lines.append("  " + foreign[0][2:])
    return [*lines, ""]


def render_compare(before: list[Path], after: list[Path], cluster: list[Path],
                   plot_rel: str | None = None) -> str:
    b, a = RunSet(before), RunSet(after)
    c = RunSet(cluster) if cluster else None
    pb, pa = "/".join(b.products()), "/".join(a.products())
    out = []
    meta = (a.metas or b.metas)[0]
    m = meta.get("machine", {})
    out += [machine_lines(meta)[0],
            f"- Python {m.get('python')}, torch {m.get('torch')}, {m.get('consul')}", ""]
    out += ["Runs (every line of every file is in the tables below; foreign CPU = what other "
            "processes on this shared machine used while the rounds ran):", ""]
    sets = [("before", b), ("after", a)] + ([("cluster", c)] if c else [])
    out += load_summary(sets)
    if plot_rel:
        out += [f"![before/after]({plot_rel})", ""]
    out += ["Cells: median [min\u2013max] (number of runs), seconds; `⚠` a run with an "
            "invariant violation (listed at the end). All on one dev agent unless said otherwise.",
            ""]
    out += ["#### fixed: min = max = N, from the release until every `next_rendezvous()` "
            "returned", ""]
    out += compare_fixed(b, a, pb, pa)
    out += ["Where the time goes (medians; seconds from the release):", ""]
    out += compare_breakdown([(f"before `{pb}`", b), (f"after `{pa}`", a)])
    out += ["#### failover: from the signal until every survivor returned from the next round "
            f"(TTL {HEARTBEAT_TTL:g} s; \"seen\": the first survivor's `num_nodes_waiting() > 0`)",
            ""]
    out += compare_failover(b, a, pb, pa)
    out += victim_lines(a)
    out += ["#### Requests per node, counted by Consul (`consul_api_http_count`): fixed, one "
            "round from handler creation (registration + round + its meta publish)", ""]
    out += compare_requests(b, a, pb, pa)
    out += ["#### back-to-back: round 1, then 3 rounds in which every node re-rendezvouses, "
            "entering 20 ms apart (at most 0.64 s in all); each round: time from the last "
            "node's entry until every node returned · Consul-counted requests per node besides "
            "check passes", ""]
    out += compare_b2b([(f"before `{pb}`", b), (f"after `{pa}`", a)])
    if c:
        out += ["#### scale: one dev agent vs a cluster of 3 servers and 16 client agents (each "
                "worker process's nodes on one client agent), fixed, N >= 128", ""]
        out += cluster_fixed(c, [("before", b), ("after", a)])
        out += ["Failover on the cluster (one node's process SIGKILLed / SIGTERMed, TTL 5 s):", ""]
        out += cluster_failover(c)
        if c.select("backtoback", topology="cluster"):
            out += ["Back-to-back on the cluster:", ""]
            out += compare_b2b([(f"`{p}`", c) for p in c.products()
                                if c.select("backtoback", topology="cluster", product=p)],
                               topology="cluster")
        out += cluster_resources([("cluster", c)])
    out += compare_problems(sets)
    return "\n".join(out)


def compare_problems(sets: list[tuple[str, RunSet]]) -> list[str]:
    bad = [(label, r) for label, s in sets for r in s.runs
           if r.get("violations") or r.get("status") != "ok"]
    if not bad:
        return ["Invariants (ranks 0..W-1 unique, one world size, one round, one trainer-store "
                "endpoint and one seal id per round; failover: W = N-1 without the victim, "
                "round number up) held in every run of every file above.", ""]
    lines = ["Runs with an invariant violation or an error (every one):", ""]
    for label, r in bad:
        text = "; ".join(" ".join(v.split())[:300] for v in r.get("violations") or [])
        if r.get("status") != "ok":
            phases = ", ".join(f"phase {k}: {v['ok']} returned ok"
                               for k, v in (r.get("phases_returned") or {}).items())
            where = f" ({phases} of N={r['n']})" if phases else ""
            text = f"{r.get('status')}{where}" + (f"; {text}" if text else "")
        lines.append(f"- {label} {r['_file']} {r['scenario']} {r.get('trigger') or ''} "
                     f"N={r['n']} rep {r.get('rep')} ({r.get('topology')}): {text}")
    return [*lines, ""]


def plot_compare(before: list[Path], after: list[Path], cluster: list[Path],
                 target: Path = PLOT) -> Path | None:
    """Three panels: fixed latency vs N, failover vs N (SIGKILL/SIGTERM), back-to-back rounds."""
    plt = _pyplot()
    if plt is None:
        return None
    b, a = RunSet(before), RunSet(after)
    c = RunSet(cluster) if cluster else None
    pb, pa = "/".join(b.products()), "/".join(a.products())

    failed_at: dict[str, list[int]] = {}

    def series(s: RunSet, scenario: str, field: str = "latency_s", **kw):
        ns, med, lo, hi = [], [], [], []
        for n in s.sizes(scenario, **{k: v for k, v in kw.items() if k != "ok"}):
            runs = s.select(scenario, n, **kw)
            if any(_failed(r) for r in runs):
                failed_at.setdefault(scenario, []).append(n)
            vals = [r[field] for r in runs if not _failed(r) and r.get(field) is not None]
            if vals:
                m = statistics.median(vals)
                ns.append(n)
                med.append(m)
                lo.append(m - min(vals))
                hi.append(max(vals) - m)
        return ns, med, [lo, hi]

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6))
    ax = axes[0]
    for s, label, color, ls, kw in (
        (b, f"consul before ({pb}), one agent", "tab:blue", "--", {}),
        (a, f"consul after ({pa}), one agent", "tab:blue", "-", {}),
        (a, "c10d (after's run)", "tab:red", "-", {"backend": "c10d", "topology": None}),
    ):
        ns, med, err = series(s, "fixed", **kw)
        if ns:
            ax.errorbar(ns, med, yerr=err, color=color, linestyle=ls, marker="o", markersize=4,
                        capsize=2, linewidth=1.2, label=label)
    if c:
        for product in c.products():
            ns, med, err = series(c, "fixed", topology="cluster", product=product)
            if ns:
                ax.errorbar(ns, med, yerr=err, color="tab:green" if product == pa else "tab:olive",
                            linestyle="-" if product == pa else "--", marker="s", markersize=4,
                            capsize=2, linewidth=1.2, label=f"consul {product}, cluster")
    if failed_at.get("fixed"):
        ns = sorted(set(failed_at["fixed"]))
        ax.plot(ns, [60.0] * len(ns), linestyle="none", marker="X", color="black", markersize=7,
                label="a run failed at this N (not plotted; see the tables)")
    ax.set_title("fixed (min = max = N)", fontsize=10)
    ax = axes[1]
    for s, scenario, label, color, ls in (
        (b, "failover", f"SIGKILL, before ({pb})", "tab:purple", "--"),
        (a, "failover", f"SIGKILL, after ({pa})", "tab:purple", "-"),
        (b, "failover-term", f"SIGTERM, before ({pb})", "tab:orange", "--"),
        (a, "failover-term", f"SIGTERM, after ({pa})", "tab:orange", "-"),
    ):
        ns, med, err = series(s, scenario, trigger="detect")
        if ns:
            ax.errorbar(ns, med, yerr=err, color=color, linestyle=ls, marker="o", markersize=4,
                        capsize=2, linewidth=1.2, label=label + ", rejoin on detection")
    for scenario, marker in (("failover", "x"), ("failover-term", "+")):
        ns, med, _ = series(a, scenario, backend="c10d", topology=None, trigger="kill")
        if ns:
            ax.plot(ns, med, color="tab:red", marker=marker, linestyle="none", markersize=8,
                    label=f"c10d {'SIGKILL' if scenario == 'failover' else 'SIGTERM'}")
    if c:
        ns, med, err = series(c, "failover", trigger="detect", topology="cluster")
        if ns:
            ax.errorbar(ns, med, yerr=err, color="tab:green", marker="s", markersize=4,
                        capsize=2, linewidth=1.2, label="SIGKILL, after, cluster")
    if failed_at.get("failover"):
        ns = sorted(set(failed_at["failover"]))
        ax.plot(ns, [30.0] * len(ns), linestyle="none", marker="X", color="black", markersize=7,
                label="a run failed at this N")
    ax.axhline(HEARTBEAT_TTL + 1, color="gray", linestyle=":", linewidth=1)
    ax.set_title("failover (from the signal; TTL 5 s)", fontsize=10)
    ax = axes[2]
    for s, label, color, ls in ((b, f"before ({pb})", "tab:blue", "--"),
                                (a, f"after ({pa})", "tab:blue", "-")):
        ns, slow = [], []
        for n in s.sizes("backtoback"):
            times = [x.get("from_last_entry_s") for r in s.select("backtoback", n, ok=True)
                     for x in r.get("b2b_rounds") or []]
            times = [t for t in times if t is not None]
            if times:
                ns.append(n)
                slow.append(max(times))
        if ns:
            ax.plot(ns, slow, color=color, linestyle=ls, marker="o", markersize=4,
                    label=f"slowest round 2-4, {label}")
    ax.axhline(0.3, color="gray", linestyle=":", linewidth=1)
    ax.set_title("back-to-back rounds (from the last entry)", fontsize=10)
    _log_axes(axes)
    meta = (a.metas or b.metas)[0]
    m = meta.get("machine", {})
    fig.suptitle(f"consul-rdzv before/after, all nodes on one {m.get('cores')}-core machine "
                 f"(shared), torch {m.get('torch')}, {m.get('consul')}", fontsize=10)
    return _save_png(plt, fig, target)


def write_compare_docs(before: list[Path], after: list[Path], cluster: list[Path]) -> None:
    """Rewrite the ``bench-compare`` block of docs/benchmarks.md and the plot."""
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    png = plot_compare(before, after, cluster)
    rel = png.relative_to(DOCS.parent).as_posix() if png else None
    text = _replace_block(text, "bench-compare",
                          render_compare(before, after, cluster, plot_rel=rel))
    DOCS.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
