"""The operator's commands of ``consul-rdzv``: ``list``, ``status``, ``watch`` (reading), ``close``,
``drain`` and ``gc`` (writing, through :mod:`consul_rdzv.runs`). Each takes the parsed arguments
and returns the exit code; errors are raised (:class:`CliError`, Consul's, the library's) and
reported by ``main()``."""

from __future__ import annotations

import argparse
import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import quarantine, runs
from ..client import BlockingIndex, ConsulClient, KVEntry, Step
from ..config import ConsulConfig
from ..errors import ConsulError, ConsulTxnConflict, RendezvousError
from ..layout import HISTORY_DIR, History, Keys, Round, RunState, quarantine_dir, quarantine_key
from ..runs import Closing, Verdict
from ..service import NODE_ID_RULE, valid_node_id
from ..settings import RendezvousSettings
from .read import Reader, RunView, run_summary
from .render import render_status, stable, status_doc
from .text import CliError, UsageError, fmt_duration, one_line, print_json, table, utc

#: How long one blocking query of ``watch`` waits before it asks again.
WATCH_WAIT = 60.0


def _client(args: argparse.Namespace) -> ConsulClient:
    config = ConsulConfig.resolve(
        address=args.address, token_file=args.token_file, datacenter=args.datacenter,
        ca_file=args.ca_file, ca_path=args.ca_path, client_cert=args.client_cert,
        client_key=args.client_key, tls_server_name=args.tls_server_name)
    return ConsulClient(config, timeout=max(1.0, min(10.0, args.consul_timeout)),
                        retry_timeout=args.consul_timeout)


def _reader(args: argparse.Namespace) -> Reader:
    return Reader(_client(args), args.key_prefix, args.service_name)


def _check_run_id(args: argparse.Namespace) -> None:
    """The run id and the key prefix, validated as the library validates them (exit 2)."""
    try:
        RendezvousSettings(run_id=getattr(args, "run_id", "x"), key_prefix=args.key_prefix)
    except ValueError as exc:
        raise UsageError(one_line(exc)) from None


def _no_such_run(view: RunView, what: str = "") -> CliError:
    return CliError(
        f"no such run {view.run_id!r}: nothing under {view.prefix}/ and no instance of service "
        f"{', '.join(view.services)} in Consul at {view.url}{what}. Check the run id and "
        f"--key-prefix (consul-rdzv list shows the runs under {view.key_prefix}/).")


def _all_runs(args: argparse.Namespace) -> tuple[Reader, dict[str, list[KVEntry]],
                                                  list[dict[str, Any]]]:
    """Every run under the key prefix: the reader, each run's keys, and its
    :func:`run_summary` (by run id): what ``list`` shows and ``gc`` judges."""
    _check_run_id(args)
    reader = _reader(args)
    reader.probe(args.key_prefix)
    found = reader.runs()
    passing = reader.passing_runs()
    now = time.time()
    rows = [run_summary(run_id, entries, args.key_prefix, now, passing.get(run_id, 0))
            for run_id, entries in sorted(found.items())]
    return reader, found, rows


def cmd_list(args: argparse.Namespace) -> int:
    """``list``: one line per run under the key prefix."""
    reader, _, rows = _all_runs(args)
    if args.json:
        print_json({"key_prefix": args.key_prefix, "consul": reader.url, "runs": rows})
        return 0
    if not rows:
        print(f"no runs under {args.key_prefix}/ on {reader.url}")
        return 0

    def dash(value: Any) -> str:
        return "-" if value is None else str(value)

    print("\n".join(table(
        ["RUN", "STATE", "ROUND", "WORLD", "NODES", "MIN:MAX", "COORDINATOR", "AGE"],
        [[r["run_id"], r["state"], dash(r["round"]), dash(r["world_size"]), str(r["nodes"]),
          f"{r['min_nodes']}:{r['max_nodes']}" if r["max_nodes"] else "-",
          dash(r["coordinator"]), "-" if r["age"] is None else fmt_duration(r["age"])]
         for r in rows])))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``status RUN``: one run's coordinator, round and nodes."""
    _check_run_id(args)
    reader = _reader(args)
    reader.probe(f"{args.key_prefix}/{args.run_id}")
    view = reader.run_view(args.run_id)
    if not view.exists:
        raise _no_such_run(view)
    doc = status_doc(view)
    if args.json:
        print_json(doc)
    else:
        print("\n".join(render_status(doc)))
    return 0


def _watcher(read: Callable[[int | None], int], changes: queue.Queue, what: str) -> None:
    """Block on one Consul query forever; put ``what`` on ``changes`` whenever its answer may
    hold a change (or the exception that ended it). The main thread re-reads the run and
    compares documents: an answer is only a hint. Index discipline by Consul's rules
    (:class:`BlockingIndex`): an answer that did not move is no change; one that went
    backwards starts the query over, after a pause that grows while it keeps happening (never
    a busy loop against a server with less state)."""
    index = BlockingIndex()
    pause = 0.0
    while True:
        try:
            returned = read(index.param)
        except Exception as exc:  # handed to the main thread, which reports it
            changes.put(exc)
            return
        step = index.update(returned)
        if step is Step.SAME:
            pause = 0.0
            continue
        changes.put(what)
        if step is Step.RESET:
            pause = min(max(pause * 2, 0.1), 5.0)
            time.sleep(pause)
        else:
            pause = 0.0


def cmd_watch(args: argparse.Namespace) -> int:
    """``watch RUN``: the status again each time the run's keys or its nodes' health change."""
    _check_run_id(args)
    if not 0 < args.wait <= 600:
        raise UsageError(f"--wait {args.wait:g}s: give 1s to 10m (Consul caps a blocking "
                         "query's wait at 10 minutes).")
    reader = _reader(args)
    prefix = f"{args.key_prefix}/{args.run_id}"
    reader.probe(prefix)
    services = reader.services_of(args.run_id)
    changes: queue.Queue = queue.Queue()

    def kv(index: int | None) -> int:
        return reader.tree(prefix, index=index, wait=args.wait)[0]

    readers: list[tuple[Callable[[int | None], int], str]] = [(kv, "keys")]
    for name in services:
        def health(index: int | None, name: str = name) -> int:
            return reader.client.read_with_headers(f"/v1/health/service/{name}", index=index,
                                                   wait=args.wait)[0].index
        readers.append((health, f"health of {name}"))
    for read, what in readers:
        threading.Thread(target=_watcher, args=(read, changes, what), daemon=True,
                         name=f"watch {what}").start()
    deadline = time.monotonic() + args.timeout if args.timeout else None
    shown = None
    frames = 0
    while True:
        view = reader.run_view(args.run_id, services=services)
        doc = status_doc(view)
        key = stable(doc)
        if key != shown:
            shown = key
            frames += 1
            if args.json:
                print_json(doc, compact=True)
            else:
                stamp = time.strftime("%H:%M:%S", time.localtime(view.read_at))
                head = f"--- {stamp}  {args.run_id}: {doc['state']}"
                if doc["round"] is not None:
                    head += f", round {doc['round']}, world {doc['world_size']}"
                if frames > 1:
                    print()
                print(head + " ---")
                print("\n".join(render_status(doc)), flush=True)
        # Wait for the next change; several changes at once make one frame.
        item = _next_change(changes, deadline)
        if item is None:
            return 0
        if isinstance(item, Exception):
            raise item
        while True:
            try:
                item = changes.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Exception):
                raise item


def _next_change(changes: queue.Queue, deadline: float | None) -> Any:
    """The next item of ``changes``, or None once ``deadline`` (monotonic) has passed."""
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return None
        try:
            # A bounded get so that Ctrl-C is seen at once on every platform.
            return changes.get(timeout=0.5 if remaining is None else min(0.5, remaining))
        except queue.Empty:
            continue


def _existing_view(args: argparse.Namespace, reader: Reader) -> RunView:
    _check_run_id(args)
    reader.probe(f"{args.key_prefix}/{args.run_id}")
    return reader.run_view(args.run_id)


def cmd_close(args: argparse.Namespace) -> int:
    """``close RUN``: mark the run closed (runs.close: a CAS on its round key), only if the run
    exists."""
    reader = _reader(args)
    view = _existing_view(args, reader)
    if not view.exists:
        raise _no_such_run(view, "; nothing was written")
    done = runs.close(reader.client, Keys(view.prefix), reason=args.reason,
                      by=f"consul-rdzv close on {socket.gethostname()}",
                      deadline=time.monotonic() + max(10.0, args.consul_timeout))
    if done.result is Closing.ALREADY:
        closed = done.round.closed or {}
        print(f"run {args.run_id} was already closed by {closed.get('by', '?')} "
              f"({closed.get('reason', '')}); nothing changed.")
        return 0
    if not done.closed:
        raise CliError(f"could not close run {args.run_id}: its round key kept changing "
                       "(a coordinator sealing rounds); try again")
    live = len(view.state.members) if view.state else 0
    print(f"run {args.run_id} closed ({args.reason}).")
    print("This stops future rounds only: nodes that are training keep training until their "
          "next rendezvous (a failure, a membership change or the end of the job), where they "
          "stop with RendezvousClosedError; nodes waiting in a rendezvous stop now.")
    print(f"{live} node(s) of the run are alive now. Once none is left, the run id can be used "
          "again: the next joiner removes the closed marker (consul-rdzv gc removes it too).")
    return 0


def _replacements(args: argparse.Namespace, state: RunState) -> list[str]:
    """``drain --replace``: the spares that wait to take the node's slot (announced, alive, not
    in the current round, not held out, not drained), or a CliError that changes nothing."""
    current = state.round
    if current is None or current.closed or args.node not in current.ranks:
        raise CliError(f"--replace: node {args.node!r} is not in the current round of run "
                       f"{args.run_id}: there is no slot to hand over; nothing was changed. "
                       "Drain it without --replace.")
    spares = sorted(node for node, m in state.members.items()
                    if node not in current.ranks and m.session and not m.health
                    and node not in state.drains)
    if not spares:
        raise CliError(f"--replace: no spare waits in run {args.run_id} to take the slot of "
                       f"{args.node} (a spare is a node that announced itself and waits beside "
                       "the round, healthy); nothing was changed. Start one first, or drain "
                       "without --replace to shrink the job.")
    return spares


def cmd_drain(args: argparse.Namespace) -> int:
    """``drain RUN NODE``: destroy the node's session, which deletes its member key."""
    if not valid_node_id(args.node):
        raise UsageError(f"node id {args.node!r} is invalid: use {NODE_ID_RULE}")
    reader = _reader(args)
    view = _existing_view(args, reader)
    if not view.exists:
        raise _no_such_run(view, "; nothing was changed")
    keys = Keys(view.prefix)
    state = view.state or RunState()
    spares = _replacements(args, state) if getattr(args, "replace", False) else []
    done = runs.drain(reader.client, keys, args.node,
                      by=f"consul-rdzv drain ({socket.gethostname()})", reason=args.reason,
                      timeout=max(5.0, args.consul_timeout))
    entry, member = done.entry, done.member
    if entry is None:
        members = ", ".join(sorted(state.members)) or "none"
        raise CliError(f"node {args.node!r} is not in run {args.run_id}: no key "
                       f"{keys.member(args.node)} (nodes present: {members})")
    if member is None:
        print(f"node {args.node}: its member key held no session; deleted it.")
        return 0
    if not done.gone:
        raise CliError(f"destroyed session {entry.session} of node {args.node}, but its member "
                       f"key {keys.member(args.node)} is still there")
    coordinator = state.leader is not None and state.leader_session == entry.session
    current = state.round
    in_round = bool(current and args.node in current.ranks)
    print(f"node {args.node} drained from run {args.run_id}: its Consul session "
          f"{entry.session} is destroyed and its member key is gone"
          + (" (with the coordinator key it held)" if coordinator else "") + ".")
    if in_round and current is not None:
        print(f"The other participants of round {current.round} see it gone now "
              "(num_nodes_waiting() >= 1) and re-rendezvous at once without it"
              + ("; a waiting node becomes coordinator" if coordinator else "") + ".")
    else:
        print("It was waiting, not in the current round: the next round forms without it"
              + ("; another node becomes coordinator" if coordinator else "") + ".")
    if spares:
        print(f"Waiting to take its slot: {', '.join(spares)}; the next round takes "
              + ("it" if len(spares) == 1 else "them") + " in the same round change (one "
              "restart of the job, not two).")
    print(f"The drained process (pid {member.pid} on {member.host}) refuses its next round and "
          "leaves the run for good, as if stopped (its torchrun agent exits with "
          "RendezvousClosedError: drained). A new process with the same node id may join again.")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """``gc``: delete runs that ended (closed, no live node) or were abandoned."""
    if args.history_retention and not 10 <= args.history_retention <= 86400:
        raise UsageError(f"--history-retention {args.history_retention:g}s is outside 10s-1d "
                         "(the TTL of the Consul session that keeps it); 0 deletes it now.")
    reader, entries, rows = _all_runs(args)
    doomed: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    for row in rows:
        delete, row["why"] = _gc_reason(row, args.older_than)
        (doomed if delete else kept).append(row)
    deleted = []
    if args.yes:
        for row in doomed:
            try:
                runs.delete_run(reader.client, entries[row["run_id"]])
                deleted.append(row)
            except ConsulTxnConflict:
                row["why"] = "changed while being deleted (a node joined?): left as it is"
                kept.append(row)
        _archive_histories(reader, args, set(entries) - {r["run_id"] for r in deleted})
    if args.json:
        doc: dict[str, Any] = {"key_prefix": args.key_prefix, "consul": reader.url,
                               "dry_run": not args.yes, "older_than": args.older_than}
        if args.yes:
            doc["deleted"] = deleted
        else:
            doc["would_delete"] = doomed
        doc["kept"] = kept
        print_json(doc)
        return 0
    gone = deleted if args.yes else doomed
    if not gone:
        print(f"nothing to delete under {args.key_prefix}/ on {reader.url}")
    else:
        verb = "deleted" if args.yes else "would delete"
        print(f"{verb} {len(gone)} run(s) under {args.key_prefix}/ on {reader.url}"
              + ("" if args.yes else " (dry run: --yes deletes them)") + ":")
        print("\n".join(table(
            ["RUN", "STATE", "ROUND", "KEYS", "IDLE", "WHY"],
            [[r["run_id"], r["state"], "-" if r["round"] is None else str(r["round"]),
              str(r["keys"]), "-" if r["idle"] is None else fmt_duration(r["idle"]), r["why"]]
             for r in gone], "  ")))
    if kept:
        print(f"kept {len(kept)} run(s):")
        print("\n".join(table(["RUN", "STATE", "WHY"],
                              [[r["run_id"], r["state"], r["why"]] for r in kept], "  ")))
    return 0


def _archive_histories(reader: Reader, args: argparse.Namespace, live: set[str]) -> None:
    """The round histories of the runs ``gc`` deleted, and of runs gone otherwise (every node
    died), are archived as the last node would have (kept for ``--history-retention``, then
    removed by Consul)."""
    _, found = reader.tree(f"{args.key_prefix}/{HISTORY_DIR}")
    start = len(args.key_prefix) + len(HISTORY_DIR) + 2
    orphans = {e.key[start:].split("/", 1)[0] for e in found if not e.session} - live - {""}
    for run_id in sorted(orphans):
        with contextlib.suppress(ConsulError, RendezvousError):
            runs.archive_history(reader.client, Keys(f"{args.key_prefix}/{run_id}"),
                                 run_id=run_id, retention=args.history_retention,
                                 deadline=time.monotonic() + args.consul_timeout)


def _gc_reason(row: dict[str, Any], older_than: float) -> tuple[bool, str]:
    """Whether ``gc`` deletes a run (runs.gc_verdict decides), and why (or why not)."""
    idle = row["idle"]
    verdict = runs.gc_verdict(invalid=bool(row["invalid"]), nodes=row["nodes"],
                              closed=row["state"] == "closed",
                              passing=row["passing_instances"], idle=idle,
                              older_than=older_than)
    if verdict is Verdict.INVALID:
        why = "not consul-rdzv state: never touched"
    elif verdict is Verdict.LIVE:
        why = f"{row['nodes']} live node(s)"
    elif verdict is Verdict.CLOSED:
        why = "closed, no live node"
    elif verdict is Verdict.STARTING:
        why = f"{row['passing_instances']} passing service instance(s) (nodes starting)"
    elif verdict is Verdict.RECENT:
        why = (f"no live node for now, last activity {fmt_duration(idle or 0.0)} ago "
               f"(< --older-than {fmt_duration(older_than)})")
    else:
        when = "unknown" if idle is None else f"{fmt_duration(idle)} ago"
        why = f"abandoned: no live node, no passing instance, last activity {when}"
    return verdict.delete, why




def history_doc(run_id: str, jobs: list[History], current: Round | None,
                now: float) -> dict[str, Any]:
    """``history``'s document: the newest job of the run, round by round, and its totals."""
    hist = jobs[-1]
    rows: list[dict[str, Any]] = []
    records = hist.records
    for i, rec in enumerate(records):
        nxt = records[i + 1] if i + 1 < len(records) else None
        end = nxt.get("after") if nxt else None
        if end is not None and end.get("round") != rec.get("round"):
            end = None  # a round whose record fell out, or a gap in the numbers
        rows.append({"round": rec.get("round"), "sealed_at": utc(rec.get("sealed_at")),
                     "world": rec.get("world"), "coordinator": rec.get("coordinator"),
                     "trained": end.get("trained") if end else None,
                     "ended": end, "lost": end.get("lost") if end else None})
    totals = dict(hist.totals)
    closed = totals.get("closed")
    last = rows[-1] if rows else None
    live = current is not None and current.job == hist.job
    if live and current is not None and current.closed:
        closed = current.closed
    if last is not None and last["ended"] is None:
        until = (_float(closed.get("at")) if closed else 0.0) or _float(totals.get("ended_at")) \
            or (now if live else 0.0)
        if until and records:
            last["trained"] = round(max(0.0, until - _float(records[-1].get("sealed_at"))), 3)
        last["running"] = live and not closed
    rounds = int(totals.get("rounds", 0))
    # the totals count the rounds that ended; the last one has trained until now (or its end)
    current_share = last["trained"] if last is not None and last["ended"] is None else None
    trained = _float(totals.get("trained")) + _float(current_share)
    lost = _float(totals.get("lost"))
    return {
        "run_id": run_id, "job": hist.job, "jobs": [h.job for h in jobs],
        "state": "running" if live and not closed else ("closed" if closed else "ended"),
        "closed": closed, "ended_at": utc(totals.get("ended_at")),
        "archived": bool(hist.session),
        "totals": {"rounds": rounds, "restarts": int(totals.get("restarts", 0)),
                   "trained": round(trained, 3), "lost": round(lost, 3),
                   "lost_share": round(lost / (lost + trained), 4) if lost + trained else 0.0,
                   "causes": totals.get("causes") or {}, "since": utc(totals.get("since")),
                   "storm": totals.get("storm")},
        "detail": {"rounds": len(rows), "first": rows[0]["round"] if rows else None},
        "rounds": rows,
    }


def _float(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0


def _ended_by(end: dict | None) -> str:
    if not end:
        return "-"
    nodes = [*end.get("gone", []), *end.get("replaced", [])]
    if not nodes and end.get("first"):
        nodes = [end["first"]]
    counts = end.get("counts") or {}
    more = max(0, counts.get("gone", 0) + counts.get("replaced", 0) - len(nodes))
    names = ", ".join(nodes[:3]) + (f" +{len(nodes) - 3 + more}" if len(nodes) > 3 or more
                                    else "")
    return f"{end.get('cause', '?')}: {names}" if names else str(end.get("cause", "?"))


def render_history(doc: dict[str, Any]) -> list[str]:
    t = doc["totals"]
    lines = [f"run {doc['run_id']} · job {doc['job'][:12]} · {doc['state']} · {t['rounds']} "
             f"round(s), {t['restarts']} restart(s) since {t['since'] or '?'}",
             f"trained {fmt_duration(t['trained'])} · lost {fmt_duration(t['lost'])} "
             f"({t['lost_share'] * 100:.1f}%) between rounds"
             + (f" · {fmt_duration(t['lost'] / t['restarts'])} per restart" if t["restarts"]
                else "")]
    if t["causes"]:
        lines.append("restarts by cause: " + ", ".join(f"{k} {v}" for k, v in
                                                      sorted(t["causes"].items())))
    if doc["closed"]:
        c = doc["closed"]
        lines.append(f"closed ({c.get('outcome', '?')}) by {c.get('by', '?')}: "
                     f"{c.get('reason', '')}")
    detail = doc["detail"]
    if detail["rounds"] < t["rounds"]:
        lines.append(f"(the last {detail['rounds']} rounds in detail, from round "
                     f"{detail['first']})")
    if len(doc["jobs"]) > 1:
        earlier = ", ".join(j[:12] for j in doc["jobs"][:-1])
        lines.append(f"(earlier jobs on this run id: {earlier})")
    lines.append("")
    rows = []
    for r in doc["rounds"]:
        trained = "-" if r["trained"] is None else fmt_duration(r["trained"])
        if r.get("running"):
            trained += " (running)"
        rows.append([str(r["round"]), r["sealed_at"] or "-", str(r["world"]), trained,
                     _ended_by(r["ended"]), "-" if r["lost"] is None else fmt_duration(r["lost"])])
    lines += table(["ROUND", "SEALED", "WORLD", "TRAINED", "ENDED BY", "LOST"], rows)
    return lines


def cmd_history(args: argparse.Namespace) -> int:
    """``history RUN``: the run's rounds, how each ended and the time lost, and its totals."""
    _check_run_id(args)
    reader = _reader(args)
    reader.probe(args.key_prefix)
    keys = Keys(f"{args.key_prefix}/{args.run_id}")
    _, entries = reader.tree(keys.history.rstrip("/"))
    jobs = History.parse(keys, entries)
    if not jobs:
        raise CliError(
            f"no round history for run {args.run_id!r} under {keys.history} in Consul at "
            f"{reader.url}: no round of it was sealed, or it ended more than history_retention "
            f"ago. Check the run id and --key-prefix (consul-rdzv list shows the runs).")
    entry = reader.client.kv_get(keys.round).data
    current = Round.decode(entry) if entry is not None else None
    doc = history_doc(args.run_id, jobs, current, time.time())
    if args.json:
        print_json(doc)
    else:
        print("\n".join(render_history(doc)))
    return 0


# ----------------------------------------------------------------------------- quarantine


def quarantine_doc(entries: list[KVEntry], now: float) -> list[dict[str, Any]]:
    """``quarantine list``'s rows: every host with a quarantine key, quarantined or not."""
    rows = []
    for entry in entries:
        if entry.key.endswith("/"):
            continue
        try:
            value = quarantine.decode(entry) or {}
        except RendezvousError as exc:
            rows.append({"host": entry.key.rsplit("/", 1)[-1], "key": entry.key,
                         "quarantined": False, "error": str(exc)})
            continue
        until = float(value.get("until") or 0.0)
        rows.append({"host": value.get("host") or entry.key.rsplit("/", 1)[-1],
                     "key": entry.key, "quarantined": quarantine.active(value, now),
                     "until": utc(until), "remaining": round(max(0.0, until - now), 1),
                     "level": int(value.get("level") or 0), "reason": value.get("reason") or "",
                     "by": value.get("by") or "", "failures": len(value.get("failures") or [])})
    return sorted(rows, key=lambda r: r["host"])


def cmd_quarantine(args: argparse.Namespace) -> int:
    """``quarantine list / add HOST / clear HOST``: the hosts no run admits (docs/health.md)."""
    if args.action == "list" and args.host:
        raise UsageError(f"quarantine list takes no HOST (got {args.host!r}): it lists every "
                         "host; use add HOST or clear HOST for one.")
    if args.action != "list" and not args.host:
        raise UsageError(f"quarantine {args.action} needs a HOST: consul-rdzv quarantine "
                         f"{args.action} HOST (the node's host name).")
    if args.host and "/" in args.host:
        raise UsageError(f"host {args.host!r} is invalid: give the host name as the member "
                         "key's host (consul-rdzv status --json shows it: field host).")
    if args.action == "add" and args.seconds <= 0:
        raise UsageError(f"--for {args.seconds:g}s: give a positive duration (e.g. 30m, 2h).")
    reader = _reader(args)
    folder = quarantine_dir(args.key_prefix)
    if args.action == "list":
        _, entries = reader.tree(folder.rstrip("/"))
        rows = quarantine_doc(entries, time.time())
        if args.json:
            print_json({"hosts": rows})
            return 0
        if not rows:
            print(f"no host is quarantined (no key under {folder}).")
            return 0
        print("\n".join(table(
            ["HOST", "QUARANTINED", "UNTIL", "LEVEL", "FAILURES", "REASON"],
            [[r["host"], "yes" if r["quarantined"] else "no",
              (r["until"] or "-") if r["quarantined"] else "-", str(r.get("level", "-")),
              str(r.get("failures", "-")), r.get("reason") or r.get("error", "")]
             for r in rows])))
        return 0
    key = quarantine_key(folder, args.host)
    if args.action == "clear":
        if reader.client.kv_get(key).data is None:
            print(f"host {args.host} is not quarantined (no key {key}); nothing was changed.")
            return 0
        reader.client.kv_delete(key)
        print(f"host {args.host} is out of quarantine: its nodes rejoin their runs at their "
              "next round (its failures and level are forgotten).")
        return 0
    now = time.time()
    by = f"consul-rdzv quarantine ({socket.gethostname()})"
    value = quarantine.update(
        reader.client, key,
        lambda v: quarantine.add(v, host=args.host, now=now, seconds=args.seconds,
                                 why=args.reason, by=by))
    print(f"host {args.host} is quarantined until {quarantine.utc(float(value['until']))} "
          f"({fmt_duration(args.seconds)}): no run under {args.key_prefix} admits its nodes; "
          "a node of it that trains now leaves its round (health_evict). "
          f"consul-rdzv quarantine clear {args.host} ends it.")
    return 0
