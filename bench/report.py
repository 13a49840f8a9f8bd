"""Tables and the plot from a bench/results/*.jsonl file.

    python -m bench.report bench/results/<stamp>.jsonl            # print the markdown tables
    python -m bench.report bench/results/<stamp>.jsonl --docs     # also rewrite the docs
    python -m bench.report MAIN.jsonl --hosts HOSTS.jsonl --docs  # plus a --loopback-hosts run

``--docs`` replaces the parts of docs/benchmarks.md between the ``bench:begin``/``bench:end``
(and ``bench-hosts:begin``/``bench-hosts:end``) markers; the prose around them stays. It redraws
docs/benchmark-latency.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

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
    out += problems(runs, skips)
    return "\n".join(out)


def plot(path: Path, extra: Path | None = None, target: Path = PLOT) -> Path | None:
    """Latency vs N, one panel per scenario; ``extra`` (a --loopback-hosts run) is overlaid."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib missing: pip install -e '.[bench]'", file=sys.stderr)
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
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("nodes N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5)
    axes[0].set_ylabel("seconds (median, min\u2013max)")
    m = meta.get("machine", {})
    fig.suptitle(f"Rendezvous latency, all nodes on one machine: {m.get('cores')} cores, "
                 f"torch {m.get('torch')}, {m.get('consul')}, etcd {m.get('etcd') or '-'}",
                 fontsize=10)
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
    p.add_argument("results", help="a bench/results/*.jsonl file")
    p.add_argument("--hosts", default=None,
                   help="a --loopback-hosts run: its tables go to their own block of the docs "
                        "and consul's series are overlaid on the plot")
    p.add_argument("--docs", action="store_true")
    args = p.parse_args(argv)
    print(render(Path(args.results)))
    if args.docs:
        write_docs(Path(args.results), Path(args.hosts) if args.hosts else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
