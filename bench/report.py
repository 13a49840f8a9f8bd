"""Tables from bench/results/*.jsonl files.

    python -m bench.report bench/results/<stamp>.jsonl             # the Markdown tables
    python -m bench.report --compare A.jsonl [A2.jsonl ...] --against B.jsonl [B2.jsonl ...]

``bench.run`` prints the tables of its run and writes them beside the JSON lines (``.md``);
``bench.run --compare REV_A REV_B`` prints the comparison of its two sides
(:func:`render_comparison`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path


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


#: Worker threads by name (bench/worker.py ``_thread_cpu``), in the order of the table.
THREAD_GROUPS = (
    ("node", "node threads (`next_rendezvous()`)"),
    ("consul-rdzv-watch", "round watch"),
    ("(ended threads)", "ended threads (the meeting's helper)"),
    ("consul-rdzv-keep", "keep-alive (check passes)"),
)


def thread_cpu_table(t: Table, scenario: str = "fixed") -> list[str]:
    """consul's client CPU per node per round, by worker thread: where the client's share of a
    CPU-bound round goes. Medians over the runs of one N; ``other`` is every other thread."""
    runs = t.runs.get((scenario, "consul", "spread", None), {})
    head = ["N", "client CPU ms per node"] + [label for _, label in THREAD_GROUPS] + ["other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in t.sizes(scenario):
        rows = [r for r in runs.get(n, [])
                if r.get("status") == "ok" and r.get("thread_cpu_s") and r.get("client_cpu_s")]
        if not rows:
            continue
        known = [g for g, _ in THREAD_GROUPS]
        cells = [f"{statistics.median(r['client_cpu_s'] for r in rows) / n * 1000:.2f}"]
        for group in known:
            spent = statistics.median(r["thread_cpu_s"].get(group, 0.0) for r in rows)
            cells.append(f"{spent / n * 1000:.2f}")
        other = statistics.median(sum(v for k, v in r["thread_cpu_s"].items() if k not in known)
                                  for r in rows)
        cells.append(f"{other / n * 1000:.2f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if len(lines) == 2:
        return []
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
        f"consul_rdzv {product_label(meta)}"
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


def render(path: Path) -> str:
    """Every table of one run's JSON lines file, as Markdown."""
    meta, runs, skips = load(path)
    t = Table(runs, skips)
    layouts = sorted({r["layout"] for r in runs}, key=lambda x: x != "spread")
    out = [f"Results of `{Path(path).name}`:", ""]
    out += machine_lines(meta) + load_lines(runs, meta) + [""]
    out += ["Cells: median [min\u2013max] over the repeats, in seconds; `⚠` marks a run with an "
            "invariant violation (listed below); `—` not run, with the reason. Ratios "
            "`consul : c10d` compare medians of the same invocation: `1 : 12` means c10d took "
            "12 times as long.", ""]
    def section(heading: str, body: list[str]) -> list[str]:
        return [heading, "", *body] if body else []

    out += fixed_like(t, "fixed", "fixed: min = max = N, time from the start instant until every "
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
    out += section("consul's client CPU per node by worker thread (fixed, spread layout; CPU "
                   "seconds of each thread from /proc between the workers' `ready` and the "
                   "end of the round, ms per node, medians):", thread_cpu_table(t, "fixed"))
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
    out += single_run_extras(Path(path))
    out += problems(runs, skips)
    return "\n".join(out)


def single_run_extras(path: Path) -> list[str]:
    """The SIGTERM failover, back-to-back rounds and Consul's own request counts of one file."""
    rs = RunSet([path])
    out: list[str] = []
    term = [r for r in rs.runs if r["scenario"] == "failover-term"]
    if term:
        out += ["### failover-term: SIGTERM of the victim's process (torch's `SignalException`, "
                "then its atexit hooks); time from the signal until every survivor returned", "",
                "| N | consul, rejoin on detection | consul, rejoin at the signal | c10d, at the "
                "signal |", "|---|---|---|---|"]
        for n in sorted({r["n"] for r in term}):
            det = rs.select("failover-term", n, trigger="detect", topology=None)
            kill = rs.select("failover-term", n, trigger="kill", topology=None)
            c10d = rs.select("failover-term", n, backend="c10d", trigger="kill", topology=None)
            seen = _med([r.get("detect_first_s") for r in det if not _failed(r)])
            cell = _runs_cell(det) + (f"; seen {seen:.2f}" if det and seen is not None else "")
            out.append(f"| {n} | {cell} | {_runs_cell(kill)} | {_runs_cell(c10d)} |")
        out.append("")
        victims = [r["victim_exit"] for r in term if isinstance(r.get("victim_exit"), dict)
                   and r["victim_exit"].get("exited_s") is not None]
        if victims:
            left = sum(1 for v in victims if v.get("left") and all(v["left"]))
            out += [f"SIGTERM victim: its atexit hooks took median "
                    f"{_med([v['atexit_s'] for v in victims]):.2f} s, the process was gone "
                    f"{_med([v['exited_s'] for v in victims]):.2f} s after the signal; its node "
                    f"had left in {left} of {len(victims)} runs.", ""]
    if rs.select("backtoback", topology=None):
        out += ["### backtoback: each round's time from the last node's entry \u00b7 "
                "Consul-counted requests per node besides check passes", ""]
        out += b2b_table([(_label(rs), rs)], topology=None)
    if any(isinstance(r.get("consul_requests"), dict) for r in rs.runs):
        out += ["### Requests per node counted by Consul (`consul_api_http_count`): fixed, one "
                "round from handler creation", ""]
        out += counted_table([(_label(rs), rs)], topology=None)
    out += round_sections([(_label(rs), rs)])
    return out


def round_sections(sets: list[tuple[str, RunSet]]) -> list[str]:
    """The round's timeline and what it cost the agent (fixed scenario)."""
    out: list[str] = []
    tl = timeline_table(sets)
    if tl:
        out += ["### The round's timeline: each node's moments, ms from the start instant "
                "(fixed)", "",
                "`entry`: `next_rendezvous()` called; `announced`: its member write answered; "
                "`sealed`: the coordinator sealed the round; `seen`: the node saw the sealed "
                "round (older versions: `next_round()` returned); `connected`: its TCPStore "
                "client reached rank 0's store (rank 0: its store started); `met`: every member "
                "checked in; `returned`: `next_rendezvous()` returned. Medians over the runs of "
                "the node median and of the last node.", "", *tl]
    agent = agent_table(sets)
    if agent:
        out += ["### What the round cost the agent, per node (the agent's own metrics, from "
                "the release until every node returned; fixed; on a cluster the servers' "
                "series summed: every server applies every entry, the leader alone counts "
                "`raft applies`)", "", *agent]
    return out


def _label(rs: RunSet) -> str:
    return ", ".join(rs.products())


def product_label(meta: dict) -> str:
    """Which consul_rdzv a run measured: the revision asked for, or the checkout's commit."""
    product = meta.get("product") or {}
    label = product.get("rev") or product.get("git_head") or "?"
    return label + (" + uncommitted" if product.get("consul_rdzv_dirty") else "")


class RunSet:
    """Runs of several JSON lines files, each run tagged with its file's product and topology."""

    def __init__(self, paths: list[Path]) -> None:
        self.metas: list[dict] = []
        self.runs: list[dict] = []
        for path in paths:
            meta, runs, _ = load(path)
            product = product_label(meta)
            self.metas.append({**meta, "_file": Path(path).name})
            for r in runs:
                r["_product"] = product
                r["_file"] = Path(path).name
                r.setdefault("topology", "single")
                self.runs.append(r)

    def products(self) -> list[str]:
        seen: list[str] = []
        for m in self.metas:
            p = product_label(m)
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


def counted_table(sets: list[tuple[str, RunSet]], topology: str | None = "single") -> list[str]:
    """Consul-counted requests per node, fixed scenario, one row per N and set."""
    lines = ["| N | version | all | TTL check passes | the rest | of which registration | "
             "check passes per node per s | product's own count (`RoundResult.requests`, "
             "median / max) |", "|---|---|---|---|---|---|---|---|"]
    sizes = sorted({n for _, s in sets for n in s.sizes("fixed", topology=topology)})
    for n in sizes:
        for label, s in sets:
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


def b2b_table(sets: list[tuple[str, RunSet]], topology: str | None = "single") -> list[str]:
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


# ------------------------------------------------------------------------------ round timeline

#: The segments of a round between two moments of :data:`bench.run.TIMELINE`, as the table
#: names them.
SEGMENTS = (("entry", "announced", "member write"), ("announced", "sealed", "wait for the seal"),
            ("sealed", "seen", "seal seen"), ("seen", "connected", "store reached"),
            ("connected", "met", "meeting"), ("met", "returned", "hand-over"))
#: One letter per moment in the text plot.
MARKS = {"entry": "e", "announced": "a", "sealed": "S", "seen": "v", "connected": "c",
         "met": "m", "returned": "R"}


def _moments(r: dict) -> dict[str, list[float]]:
    """Every node's moments of one run (ms from the start instant), by moment."""
    tl = r.get("timeline") or {}
    events = tl.get("events") or []
    out: dict[str, list[float]] = {e: [] for e in events}
    for row in tl.get("nodes") or []:
        for e, v in zip(events, row[1:], strict=False):
            if v is not None:
                out[e].append(v)
    return out


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def timeline_table(sets: list[tuple[str, RunSet]], topology: str | None = None) -> list[str]:
    """Per N and version: each moment of the round (ms from the start instant; the node median and
    the last node, medians over the runs), then where the last node's milliseconds went."""
    lines = ["| N | version | runs | " + " | ".join(
        f"{e} p50 / last" for e in MARKS) + " |", "|---|---|---|" + "---|" * len(MARKS)]
    seg_lines = ["| N | version | " + " | ".join(
        f"{name} ({a} \u2192 {b})" for a, b, name in SEGMENTS) + " |",
        "|---|---|" + "---|" * len(SEGMENTS)]
    sizes = sorted({n for _, s in sets for n in s.sizes("fixed", topology=topology)})
    for n in sizes:
        for label, s in sets:
            runs = [r for r in s.select("fixed", n, topology=topology)
                    if not _failed(r) and r.get("timeline")]
            if not runs:
                continue
            per = [_moments(r) for r in runs]
            cells, last = [], {}
            for e in MARKS:
                p50 = _med([_q(m.get(e, []), 0.5) for m in per])
                mx = _med([max(m[e]) if m.get(e) else None for m in per])
                last[e] = mx
                cells.append("" if p50 is None else f"{p50:.0f} / {mx:.0f}")
            lines.append(f"| {n} | {label} | {len(runs)} | " + " | ".join(cells) + " |")
            segs = []
            for a, b, _ in SEGMENTS:
                segs.append("" if last.get(a) is None or last.get(b) is None
                            else f"{last[b] - last[a]:.0f}")
            seg_lines.append(f"| {n} | {label} | " + " | ".join(segs) + " |")
    if len(lines) == 2:
        return []
    return [*lines, "", "Where the last node's milliseconds went (differences of the \"last\" "
            "moments above; ms):", "", *seg_lines, "", *timeline_plot(sets, topology), ""]


def timeline_plot(sets: list[tuple[str, RunSet]], topology: str | None = None,
                  width: int = 72) -> list[str]:
    """A text plot of each N's first run per version: one line per moment, ``-`` from the first
    node's to the last node's, ``|`` at the nodes' median, on a scale shared by one N's lines."""
    out = []
    sizes = sorted({n for _, s in sets for n in s.sizes("fixed", topology=topology)})
    for n in sizes:
        rows = []
        for label, s in sets:
            runs = [r for r in s.select("fixed", n, topology=topology)
                    if not _failed(r) and r.get("timeline")]
            if runs:
                rows.append((label, _moments(runs[0])))
        if not rows:
            continue
        end = max((max(v) for _, m in rows for v in m.values() if v), default=0.0) or 1.0
        out.append(f"N = {n} (0 to {end:.0f} ms, the start instant at 0)")
        for label, m in rows:
            for e, mark in MARKS.items():
                vals = m.get(e) or []
                if not vals:
                    continue
                line = [" "] * (width + 1)
                lo, hi = (round(min(vals) / end * width), round(max(vals) / end * width))
                for i in range(max(0, lo), min(width, hi) + 1):
                    line[i] = "-"
                mid = round((_q(vals, 0.5) or 0.0) / end * width)
                line[max(0, min(width, mid))] = "|"
                out.append(f"  {label[:14]:<14} {mark} {e:<9} {''.join(line).rstrip()}")
        out.append("")
    return ["```", *out, "```"] if out else []


#: The agent's own series a round moved, per node (:data:`bench.servers.AGENT_SERIES`).
AGENT_COLUMNS = (("consul_raft_apply", "raft applies", 1.0, "{:.2f}"),
                 ("consul_fsm_txn_count", "txn applies", 1.0, "{:.2f}"),
                 ("consul_fsm_kvs_count", "KV applies", 1.0, "{:.2f}"),
                 ("consul_fsm_register_count", "catalog registers", 1.0, "{:.2f}"),
                 ("consul_rpc_query", "blocking RPC queries", 1.0, "{:.2f}"),
                 ("process_cpu_seconds_total", "agent CPU ms", 1000.0, "{:.2f}"),
                 ("go_memstats_alloc_bytes_total", "agent allocated kB", 1 / 1024, "{:.0f}"))


def agent_table(sets: list[tuple[str, RunSet]], topology: str | None = None,
                key: str = "agent_round") -> list[str]:
    """What the round cost the agent (its own metrics), per node: medians over the runs; then
    the HTTP bytes the nodes sent and received, per node."""
    lines = ["| N | version | runs | Consul requests (besides check passes) | " + " | ".join(
        c[1] for c in AGENT_COLUMNS) + " | HTTP bytes sent / received |",
        "|---|---|---|---|" + "---|" * len(AGENT_COLUMNS) + "---|"]
    sizes = sorted({n for _, s in sets for n in s.sizes("fixed", topology=topology)})
    for n in sizes:
        for label, s in sets:
            runs = [r for r in s.select("fixed", n, topology=topology)
                    if not _failed(r) and isinstance(r.get(key), dict)]
            if not runs:
                continue
            cells = []
            for series, _, scale, fmt in AGENT_COLUMNS:
                v = _med([(r[key].get("servers") or {}).get(series, 0.0) / n for r in runs])
                cells.append(_num(None if v is None else v * scale, fmt))
            reqs = _counted(runs, "consul_requests_round_only", "rest_per_node")
            sent = _med([sum(v[1] for v in (r.get("consul_http_bytes") or {}).values()) / n
                         for r in runs if r.get("consul_http_bytes")])
            got = _med([sum(v[2] for v in (r.get("consul_http_bytes") or {}).values()) / n
                        for r in runs if r.get("consul_http_bytes")])
            http = "" if sent is None or got is None else f"{sent:.0f} / {got:.0f}"
            lines.append(f"| {n} | {label} | {len(runs)} | {_num(reqs, '{:.2f}')} | "
                         + " | ".join(cells) + f" | {http} |")
    return [*lines, ""] if len(lines) > 2 else []


# ------------------------------------------------------------------------------ two products


def render_comparison(a_paths: list[Path], b_paths: list[Path]) -> str:
    """Side A against side B (two products measured by the same bench code): every series both
    sides ran, per N, the medians and B : A; then Consul-counted requests and back-to-back
    rounds of both. Cells: median [min-max] (runs)."""
    a, b = RunSet(a_paths), RunSet(b_paths)
    la, lb = _label(a), _label(b)
    out = [f"## A = consul_rdzv {la}, B = consul_rdzv {lb}", ""]
    for side, rs in (("A", a), ("B", b)):
        for m in rs.metas:
            out.append(f"- {side}: `{m['_file']}`: `python -m bench.run "
                       f"{' '.join(m.get('argv') or [])}`")
    out += ["", "Cells: median [min\u2013max] (runs), seconds; `B : A` is the ratio of the "
            "medians (below 1: B is faster).", ""]
    keys = sorted({_series(r) for r in a.runs} & {_series(r) for r in b.runs},
                  key=lambda k: tuple(str(x) for x in k))
    for key in keys:
        scenario, backend, layout, trigger = key
        title = f"{scenario} {backend} {layout}" + (f" {trigger}" if trigger else "")
        out += [f"### {title}", "", "| N | A | B | B : A |", "|---|---|---|---|"]
        ra = [r for r in a.runs if _series(r) == key]
        rb = [r for r in b.runs if _series(r) == key]
        for n in sorted({r["n"] for r in ra} | {r["n"] for r in rb}):
            xa = [r for r in ra if r["n"] == n]
            xb = [r for r in rb if r["n"] == n]
            ma = _med([r.get("latency_s") for r in xa if not _failed(r)])
            mb = _med([r.get("latency_s") for r in xb if not _failed(r)])
            ratio = f"{mb / ma:.2f}" if ma and mb is not None else ""
            out.append(f"| {n} | {_runs_cell(xa)} | {_runs_cell(xb)} | {ratio} |")
        out.append("")
    sets = [(f"A {la}", a), (f"B {lb}", b)]
    if any(isinstance(r.get("consul_requests"), dict) for r in a.runs + b.runs):
        out += ["### Requests per node counted by Consul: fixed, one round from handler "
                "creation", "", *counted_table(sets, topology=None)]
    out += round_sections(sets)
    if a.select("backtoback", topology=None) or b.select("backtoback", topology=None):
        out += ["### backtoback: each round's time from the last node's entry \u00b7 "
                "Consul-counted requests per node besides check passes", "",
                *b2b_table(sets, topology=None)]
    bad = [r for r in a.runs + b.runs if r.get("violations")]
    if bad:
        out += ["Runs with an invariant violation or an error (every one):", ""]
        for r in bad:
            text = "; ".join(" ".join(v.split()) for v in r["violations"])[:400]
            out.append(f"- {r['_product']} {r['scenario']} {r['backend']} {r['layout']} "
                       f"N={r['n']} rep {r.get('rep')}: {text}")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="*", help="bench/results/*.jsonl file(s): one run's tables")
    p.add_argument("--compare", nargs="+", default=[], metavar="A.jsonl",
                   help="side A of a comparison ...")
    p.add_argument("--against", nargs="+", default=[], metavar="B.jsonl",
                   help="... against side B")
    args = p.parse_args(argv)
    if args.compare or args.against:
        if not (args.compare and args.against):
            p.error("--compare needs both sides: --compare A.jsonl --against B.jsonl")
        print(render_comparison([Path(x) for x in args.compare],
                                [Path(x) for x in args.against]))
        return 0
    if not args.results:
        p.error("give a results file, or --compare A.jsonl --against B.jsonl")
    for results in args.results:
        print(render(Path(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
