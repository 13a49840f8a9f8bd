"""Node health: whether this node's Consul node may train (docs/health.md).

An operator runs node-level checks on every client agent (GPU, NIC, disk scripts) and puts a
node in maintenance with ``consul maint -enable -reason ...``. A node whose Consul node has a
critical check that counts (setting ``health_checks``), or is in maintenance, is **held out**:
its member key carries the reason (``health``), no coordinator admits it, and no training node
counts it as waiting. Once the check passes again the node rewrites its key and is admitted in
the next round. While it trains, the same turning critical takes it out of the round at once
(``health_evict``): it rewrites its key with the reason, which ends the round for the others.

* :func:`judge_health`: the pure judgement (which checks count, the reason text);
* :class:`NodeHealth`: a daemon thread with one blocking query on
  ``/v1/health/node/<node>`` (``?stale``: any server answers), from the first
  ``next_round()`` on; it calls ``on_change(reason)`` when the reason changes.

The node's Consul node name comes from its own session (``/v1/session/info``: the session lives
on the node's agent), so no new ACL rule is needed for it; reading the node's checks needs
``node:read`` on it (docs/acl-policy.hcl).
"""

from __future__ import annotations

import fnmatch
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping

from .client import BlockingIndex, ConsulClient
from .errors import ConsulError, ConsulPermissionDenied

logger = logging.getLogger(__name__)

#: The check Consul registers on a node in maintenance mode (``consul maint``); its Notes hold
#: the reason.
MAINTENANCE_CHECK = "_node_maintenance"
#: Consul's own gossip check of every node: not counted unless named (a node whose gossip fails
#: loses its session anyway).
SERF_HEALTH = "serfHealth"
#: ``health_checks`` value that turns node-health gating off (no read at all).
OFF = "off"
#: The longest blocking query of the health watch.
HEALTH_WAIT = 300.0
#: The shortest time between two queries. A node's checks change with every round (the node's own
#: check notes), and nodes that share one Consul node (a host's agent serving several nodes, the
#: servers without client agents) wake each other's queries: changes within this gap are read
#: in one answer, so a node never asks more than a few times a second, and an eviction is at
#: most this much later.
MIN_GAP = 0.2
RETRY_PAUSE = 0.1
RETRY_PAUSE_MAX = 5.0
#: A check's output in a reason is cut to this many characters (first line only).
OUTPUT_CHARS = 120


def parse_health_checks(value: object) -> tuple[str, ...] | None:
    """``--rdzv-conf health_checks`` -> patterns: ``()`` (every node-level check but
    serfHealth), None (``off``: no gating), or the names/fnmatch patterns given, separated by
    ``:``, ``;`` or spaces (``,`` cannot appear in ``--rdzv-conf`` values)."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        items = [str(v).strip() for v in value]
    else:
        text = str(value).strip()
        if text.lower() == OFF:
            return None
        items = [p.strip() for p in text.replace(";", ":").replace(",", ":").replace(" ", ":")
                 .split(":")]
    patterns = tuple(p for p in items if p)
    if any(p.lower() == OFF for p in patterns):
        if len(patterns) > 1:
            raise ValueError(f"health_checks {value!r}: 'off' cannot be combined with patterns.")
        return None
    return patterns


def counts(check: Mapping[str, object], patterns: tuple[str, ...]) -> bool:
    """Whether a critical ``check`` holds the node out (maintenance aside, which always does).

    Only node-level checks count (no ServiceID: consul-rdzv's own TTL checks and any service's
    checks never do). With no patterns, every one but Consul's ``serfHealth``; else those whose
    CheckID or Name matches a pattern (fnmatch, case-sensitive)."""
    if check.get("ServiceID"):
        return False
    check_id = str(check.get("CheckID") or "")
    name = str(check.get("Name") or "")
    if check_id == MAINTENANCE_CHECK:
        return False
    if not patterns:
        return check_id != SERF_HEALTH
    return any(fnmatch.fnmatchcase(check_id, p) or fnmatch.fnmatchcase(name, p)
               for p in patterns)


def _first_line(text: str) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= OUTPUT_CHARS else line[:OUTPUT_CHARS - 3] + "..."


def judge_health(checks: Iterable[Mapping[str, object]], patterns: tuple[str, ...] | None) -> str:
    """Why the node is held out, or "" when it may train.

    ``node in maintenance: "swap PSU"``, then each critical check that counts, by CheckID:
    ``check gpu-health critical: "ECC errors on GPU 3"`` (the first line of its output), joined
    with ``; ``. ``patterns`` None: gating is off, always "".
    """
    if patterns is None:
        return ""
    reasons = []
    checks = sorted(checks, key=lambda c: str(c.get("CheckID") or ""))
    for check in checks:
        if check.get("CheckID") == MAINTENANCE_CHECK and not check.get("ServiceID"):
            note = _first_line(str(check.get("Notes") or "")) or "no reason given"
            reasons.append(f'node in maintenance: "{note}"')
    for check in checks:
        if check.get("Status") == "critical" and counts(check, patterns):
            output = _first_line(str(check.get("Output") or ""))
            reasons.append(f"check {check.get('CheckID')} critical"
                           + (f': "{output}"' if output else ""))
    return "; ".join(reasons)


class NodeHealth:
    """The health of this node's Consul node, kept current by one blocking query (a daemon
    thread). ``reason`` is "" while the node may train. ``on_change(reason)`` is called from the
    thread after each change, and after the first answer when it holds the node out.

    ``node_name()`` gives the Consul node to watch (read once, when the thread starts: the
    node's session lives on it). A token that may not read the node's checks (Consul filters
    them out) stops the thread with :attr:`error` set: the caller refuses to join with it.
    """

    def __init__(self, client: ConsulClient, *, patterns: tuple[str, ...], node_id: str,
                 run_id: str, node_name: Callable[[], str],
                 on_change: Callable[[str], None], wait: float = HEALTH_WAIT) -> None:
        self.client = client
        self.patterns = patterns
        self.node_id = node_id
        self.run_id = run_id
        self._node_name = node_name
        self.on_change = on_change
        self.wait = wait
        self.node = ""
        self._reason = ""
        self.error: str = ""
        self._known = threading.Event()  # set once the first answer (or an error) is in
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        #: Counters for tests and logs.
        self.queries = 0
        #: monotonic time of the last change seen (for figures).
        self.changed_at = 0.0

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> NodeHealth:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                             name=f"consul-rdzv-health-{self.node_id}")
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def wait_known(self, deadline: float) -> bool:
        """Block until the first answer is in (or the deadline passes); True if it is."""
        return self._known.wait(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        failures = 0
        while not self._stopped.is_set() and not self.node:
            try:
                self.node = self._node_name()
            except ConsulError as exc:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    logger.warning("Node %s of run %s cannot find its Consul node name: %s",
                                   self.node_id, self.run_id, exc)
                self._stopped.wait(min(RETRY_PAUSE * 2 ** failures, RETRY_PAUSE_MAX))
        index = BlockingIndex()
        path = f"/v1/health/node/{urllib.parse.quote(self.node, safe='')}"
        failures = 0
        last = 0.0
        while not self._stopped.is_set():
            gap = last + MIN_GAP - time.monotonic()
            if gap > 0 and self._stopped.wait(gap):
                return
            last = time.monotonic()
            try:
                res, headers = self.client.read_with_headers(
                    path, params={"stale": ""}, index=index.param, wait=self.wait,
                    deadline=time.monotonic())
                self.queries += 1
            except ConsulPermissionDenied as exc:
                self._fail(str(exc))
                return
            except ConsulError as exc:
                if self._stopped.is_set():
                    return
                index.reset()
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    logger.warning("Node %s of run %s cannot read the health of its Consul node "
                                   "%s: %s", self.node_id, self.run_id, self.node, exc)
                self._stopped.wait(min(RETRY_PAUSE * 2 ** failures, RETRY_PAUSE_MAX))
                continue
            failures = 0
            index.update(res.index)
            # Consul filters the checks by ACL: checks of other services hidden are fine (they
            # never count); the node's own (serfHealth, every node has it) hidden means no
            # node read, and a gate that sees nothing must not let the node in.
            if headers.get("x-consul-results-filtered-by-acls", "").lower() == "true" and not any(
                    c.get("CheckID") == SERF_HEALTH and not c.get("ServiceID")
                    for c in res.data or []):
                self._fail("Consul hid its checks from this token")
                return
            reason = judge_health(res.data or [], self.patterns)
            first = not self._known.is_set()
            changed = reason != self._reason
            self._reason = reason
            self._known.set()
            if changed:
                self.changed_at = time.monotonic()
                if not first or reason:
                    self.on_change(reason)

    def _fail(self, what: str) -> None:
        node = self.node or "?"
        self.error = (
            f"node {self.node_id} of run {self.run_id} cannot read the health checks of its "
            f"Consul node {node} ({what}): its token lacks permission 'node:read' on "
            f"\"{node}\". Add the rule node \"{node}\" {{ policy = \"read\" }} to the "
            "token's policy, or the shipped prefix rule node_prefix \"<node-prefix>\" "
            "{ policy = \"read\" } (docs/acl-policy.hcl); or turn node-health gating off "
            "with --rdzv-conf health_checks=off"
        )
        logger.error("%s.", self.error[0].upper() + self.error[1:])
        self._known.set()
