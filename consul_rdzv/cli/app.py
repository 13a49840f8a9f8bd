"""``consul-rdzv``: see and operate consul-rdzv runs in Consul, run a dev agent, run the demo.

    consul-rdzv list                        every run under the key prefix
    consul-rdzv status RUN                  one run: coordinator, round, each node's health
    consul-rdzv watch RUN                   status again on every change (blocking queries)
    consul-rdzv close RUN [--reason TEXT]   no further rounds (training nodes train on)
    consul-rdzv drain RUN NODE              take a node out now: the job re-forms without it
    consul-rdzv gc [--yes]                  delete ended and abandoned runs (dry run by default)
    consul-rdzv quarantine list|add|clear   hosts no run admits (quarantine across jobs)
    consul-rdzv exporter [--bind --port]    serve every run's metrics to Prometheus (/metrics)
    consul-rdzv agent [--bind ADDR --port N] a Consul dev agent until Ctrl-C
    consul-rdzv demo [--keep]               a real 3-node torchrun job on this machine

Global options (``--address``, ``--key-prefix``, ``--token-file``, ...) go before or after the
command. Consul is configured as the library configures it (``ConsulConfig.resolve``): options
first, then the ``CONSUL_*`` variables, then the defaults. Errors are one line on stderr
(``consul-rdzv <command>: <message>``), exit code 1 (2 for usage errors). docs/cli.md is the
reference.

This module is the program itself: its arguments, ``main()`` and its exit codes. The commands
are :mod:`.commands` (list, status, watch, close, drain, gc), :mod:`.exporter` (exporter) and
:mod:`.devtools` (agent, demo).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

from .. import __version__
from ..errors import ConsulError, ConsulUnavailableError, RendezvousError
from ..service import DEFAULT_KEY_PREFIX, SERVICE_PREFIX
from .commands import (
    WATCH_WAIT,
    cmd_close,
    cmd_drain,
    cmd_gc,
    cmd_history,
    cmd_list,
    cmd_quarantine,
    cmd_status,
    cmd_watch,
)
from .devtools import cmd_agent, cmd_demo
from .exporter import DEFAULT_BIND, DEFAULT_PORT, cmd_exporter
from .text import CliError, UsageError, one_line, parse_duration

PROG = "consul-rdzv"
#: Exit codes: success; an error (one line on stderr); a usage error (argparse's too); an
#: interrupt (Ctrl-C; ``watch`` exits with EXIT_OK, as its normal end).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


#: Global options: accepted before or after the command. Their defaults are filled in after
#: parsing (argparse.SUPPRESS everywhere), so a value given before the command is not
#: overwritten by a subcommand's default.
GLOBAL_DEFAULTS: dict[str, Any] = {
    "address": None, "key_prefix": DEFAULT_KEY_PREFIX, "token_file": None, "datacenter": None,
    "ca_file": None, "ca_path": None, "client_cert": None, "client_key": None,
    "tls_server_name": None, "service_name": None, "consul_timeout": 5.0, "debug": False,
}


def _add_global_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "Consul and run options (before or after the command; an option beats its CONSUL_* "
        "variable)")
    s = argparse.SUPPRESS
    g.add_argument("--address", metavar="HOST:PORT", default=s,
                   help="Consul HTTP API address, host:port or http(s)://host:port (default: "
                        "CONSUL_HTTP_ADDR, else 127.0.0.1:8500)")
    g.add_argument("--key-prefix", metavar="P", default=s,
                   help=f"KV prefix of the runs (the key_prefix setting; default "
                        f"{DEFAULT_KEY_PREFIX})")
    g.add_argument("--service-name", metavar="NAME", default=s,
                   help="service name of the run's nodes (the service_name setting; default: "
                        f"{SERVICE_PREFIX}<run_id> and any consul-rdzv service tagged "
                        "run-<run_id>)")
    g.add_argument("--token-file", metavar="FILE", default=s,
                   help="file holding the ACL token (default: CONSUL_HTTP_TOKEN, "
                        "CONSUL_HTTP_TOKEN_FILE); there is no --token: a command line is "
                        "visible in ps")
    g.add_argument("--datacenter", metavar="DC", default=s,
                   help="datacenter to read and write (default: CONSUL_DATACENTER, else the "
                        "agent's)")
    g.add_argument("--ca-file", metavar="FILE", default=s,
                   help="CA bundle to verify Consul's certificate (default: CONSUL_CACERT)")
    g.add_argument("--ca-path", metavar="DIR", default=s,
                   help="directory of CA certificates (default: CONSUL_CAPATH)")
    g.add_argument("--client-cert", metavar="FILE", default=s,
                   help="client certificate for mTLS, with --client-key (default: "
                        "CONSUL_CLIENT_CERT)")
    g.add_argument("--client-key", metavar="FILE", default=s,
                   help="client certificate key (default: CONSUL_CLIENT_KEY)")
    g.add_argument("--tls-server-name", metavar="NAME", default=s,
                   help="name expected in Consul's certificate (default: CONSUL_TLS_SERVER_NAME)")
    g.add_argument("--consul-timeout", metavar="SECONDS", type=float, default=s,
                   help="how long an unreachable Consul is retried before giving up (default 5)")
    g.add_argument("--debug", action="store_true", default=s,
                   help="show a traceback on unexpected errors")


def build_parser() -> argparse.ArgumentParser:
    """The ``consul-rdzv`` argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.splitlines()[0].strip("` ").replace("``", ""),
        epilog="docs/cli.md is the reference; every command has --help.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"{PROG} {__version__}", help="print the version and exit")
    _add_global_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Callable[[argparse.Namespace], int], text: str,
                ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text)
        p.set_defaults(func=func)
        _add_global_options(p)
        return p

    def run_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("run_id", metavar="RUN", help="the run id (torchrun's --rdzv-id)")

    def json_arg(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--json", action="store_true", help=f"print {what} as JSON")

    p = command("list", cmd_list, "list every run under the key prefix: state, round, world "
                "size, nodes present, age")
    json_arg(p, "the runs")
    p = command("status", cmd_status, "show one run: coordinator, min/max, round, each rank's "
                "node, address, health, last heartbeat and state, waiting nodes, trainer store")
    run_arg(p)
    json_arg(p, "the status")
    p = command("watch", cmd_watch, "show a run's status again each time it changes (blocking "
                "queries on its keys and its service health); Ctrl-C stops")
    run_arg(p)
    json_arg(p, "one JSON document (one line) per change")
    p.add_argument("--timeout", metavar="SECONDS", type=parse_duration, default=None,
                   help="stop (exit 0) after this long (default: until Ctrl-C)")
    p.add_argument("--wait", metavar="SECONDS", type=parse_duration, default=WATCH_WAIT,
                   help="longest blocking query (default %(default)gs, at most 10m: Consul's "
                        "cap); a query that times out shows nothing new")
    p = command("history", cmd_history, "show a run's rounds: when each was sealed, how long it "
                "trained, how it ended (who left, died or asked for a new round) and the time "
                "lost until the next one, with the totals")
    run_arg(p)
    json_arg(p, "the history")
    p = command("close", cmd_close, "close a run: no further rounds (nodes training now keep "
                "training until their next rendezvous)")
    run_arg(p)
    p.add_argument("--reason", default="closed with consul-rdzv close",
                   help="why, shown in the error every node of the run gets")
    p = command("drain", cmd_drain, "take a node out of a run now, as if it stopped: its session "
                "is destroyed, the job re-forms without it, and its process leaves for good")
    run_arg(p)
    p.add_argument("node", metavar="NODE", help="the node id (as status shows it)")
    p.add_argument("--reason", default="drained by an operator",
                   help="why, shown in the error the drained node gets")
    p.add_argument("--replace", action="store_true",
                   help="only if a spare waits to take the node's slot (make before break: the "
                        "job re-forms once, with the spare); refused, changing nothing, if none")
    p = command("gc", cmd_gc, "delete runs that ended (closed, no live node) or were abandoned "
                "(no live node, no passing instance, idle for --older-than); a dry run unless "
                "--yes")
    p.add_argument("--yes", action="store_true", help="delete them (default: only list them)")
    p.add_argument("--older-than", metavar="DURATION", type=parse_duration, default=600.0,
                   help="an unclosed run without nodes is abandoned once idle this long "
                        "(e.g. 30s, 10m, 2h; default 10m)")
    p.add_argument("--history-retention", metavar="DURATION", type=parse_duration,
                   default=86400.0,
                   help="how long the round history of a deleted run is kept (0: deleted now; "
                        "else 10s-1d, Consul's session TTL range; default 1d)")
    json_arg(p, "what would be (or was) deleted and kept")
    p = command("quarantine", cmd_quarantine, "list, add or clear the quarantine of hosts: no run "
                "under the key prefix admits a quarantined host's nodes until its quarantine "
                "ends (docs/health.md)")
    p.add_argument("action", choices=("list", "add", "clear"),
                   help="list every host's quarantine; add HOST for --for; clear HOST")
    p.add_argument("host", metavar="HOST", nargs="?", default=None,
                   help="the host (consul-rdzv status --json, field host) for add and clear")
    p.add_argument("--for", dest="seconds", metavar="DURATION", type=parse_duration,
                   default=3600.0, help="how long add quarantines the host (e.g. 30m, 2h; "
                                        "default 1h)")
    p.add_argument("--reason", default="quarantined by an operator",
                   help="why, shown by the held-out nodes and in status")
    json_arg(p, "the hosts (list)")
    p = command("exporter", cmd_exporter, "serve the state of every run under the key prefix "
                "in Prometheus' format on /metrics, read from Consul at each scrape (one "
                "exporter per fleet; needs the metrics extra)")
    p.add_argument("--bind", metavar="ADDR", default=DEFAULT_BIND,
                   help="address to listen on (default %(default)s: every interface)")
    p.add_argument("--port", metavar="PORT", type=int, default=DEFAULT_PORT,
                   help="port to listen on (default %(default)s; 0: any free port, printed)")
    p.add_argument("--timeout", metavar="SECONDS", type=parse_duration, default=None,
                   help="stop (exit 0) after this long (default: until Ctrl-C)")
    p = command("agent", cmd_agent, "run a Consul dev agent until Ctrl-C: on 127.0.0.1 and a "
                "free port, or where --bind/--port (or --address HOST:PORT) say, to serve other "
                "hosts for a first trial (UNSECURED: no ACLs, no TLS)")
    p.add_argument("--bind", metavar="ADDR", default=None,
                   help="IPv4 address of this host to serve the HTTP API on, 0.0.0.0 for every "
                        "interface (default 127.0.0.1: this host only)")
    p.add_argument("--port", metavar="PORT", type=int, default=None,
                   help="HTTP API port (default: a free one, printed)")
    p = command("demo", cmd_demo, "run a real torchrun job with the consul backend on this "
                "machine (a local dev agent unless --address / CONSUL_HTTP_ADDR names one)")
    p.add_argument("--nodes", type=int, default=3, help="number of torchrun agents (default 3)")
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the job before killing it (default 300)")
    p.add_argument("--keep", action="store_true",
                   help="leave the Consul agent the demo started running afterwards, for the UI "
                        "(prints its address and how to stop it)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``consul-rdzv``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, default in GLOBAL_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, default)
    if args.consul_timeout <= 0:
        parser.error("--consul-timeout must be positive")
    where = f"{PROG} {args.command}"
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.command == "watch":
            # Its watchers are daemon threads in blocking reads on the shared connection pool:
            # end at once rather than let the interpreter's finalization race them (seen once
            # in a dozen runs: a hang at exit, or "Exception ignored" tracebacks on stderr).
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
            os._exit(EXIT_OK)
        return EXIT_OK if args.command == "exporter" else EXIT_INTERRUPTED
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except UsageError as exc:
        print(f"{where}: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except ConsulUnavailableError as exc:
        print(f"{where}: {one_line(exc)}. Is Consul running there? Give its address with "
              "--address or CONSUL_HTTP_ADDR.", file=sys.stderr)
        return EXIT_ERROR
    except (CliError, ConsulError, RendezvousError, ValueError, OSError) as exc:
        print(f"{where}: {one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        if args.debug:
            raise
        print(f"{where}: unexpected {type(exc).__name__}: {one_line(exc)} (--debug shows the "
              "traceback)", file=sys.stderr)
        return EXIT_ERROR

