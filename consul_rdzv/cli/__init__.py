"""``consul-rdzv``: see and operate consul-rdzv runs in Consul, run a dev agent, run the demo.

The package, by part (docs/cli.md is the user's reference):

* :mod:`.app`: the program: its arguments, ``main()`` (the ``consul-rdzv`` entry point) and
  its exit codes;
* :mod:`.read`: the read model: :class:`Reader` (a run's keys, its nodes' service instances
  and their health), :class:`RunView` (one run at one moment), :class:`Instance`,
  :func:`run_state` and :func:`run_summary`;
* :mod:`.render`: the status document (``status --json``, a ``watch`` frame) and its text;
* :mod:`.commands`: ``list``, ``status``, ``watch``, ``close``, ``drain``, ``gc``;
* :mod:`.devtools`: ``agent``, ``demo``;
* :mod:`.text`: the CLI's errors and text helpers.

The operations on a run are :mod:`consul_rdzv.runs`'s and the service conventions
:mod:`consul_rdzv.service`'s, shared with the nodes. ``python -m consul_rdzv.cli`` runs it.
"""

from ..service import heartbeat_time
from .app import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    GLOBAL_DEFAULTS,
    PROG,
    build_parser,
    main,
)
from .commands import WATCH_WAIT
from .devtools import demo_script
from .read import Instance, Reader, RunView, run_state, run_summary
from .render import render_status, status_doc
from .text import CliError, UsageError, fmt_duration, one_line, parse_duration, table

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "GLOBAL_DEFAULTS",
    "PROG",
    "WATCH_WAIT",
    "CliError",
    "Instance",
    "Reader",
    "RunView",
    "UsageError",
    "build_parser",
    "demo_script",
    "fmt_duration",
    "heartbeat_time",
    "main",
    "one_line",
    "parse_duration",
    "render_status",
    "run_state",
    "run_summary",
    "status_doc",
    "table",
]
