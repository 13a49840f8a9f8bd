"""Node health: whether this node's Consul node may train (docs/health.md).

An operator runs node-level checks on every client agent (GPU, NIC, disk scripts) and puts a
node in maintenance with ``consul maint -enable -reason ...``. A node whose Consul node has a
critical check that counts (setting ``health_checks``), or is in maintenance, is **held out**:
its member key carries the reason (``health``), no coordinator admits it, and no training node
counts it as waiting. Once the check passes again the node rewrites its key and is admitted in
the next round. While it trains, the same turning critical takes it out of the round at once
(``health_evict``): it rewrites its key with the reason, which ends the round for the others.

* :func:`judge_health`: the pure judgement (which checks count, the reason text);
* :class:`NodeHealth`: one node's view, from its registration on; it calls
  ``on_change(reason)`` when the reason changes. The query is a daemon thread with one
  blocking query on ``/v1/health/node/<node>`` (``?stale``: any server answers), shared by
  the nodes of a process that talk to the same agent (:class:`_NodeWatch`).

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
from typing import ClassVar

from .client import BlockingIndex, ConsulClient, Step
from .errors import ConsulError, ConsulPermissionDenied
from .shared_query import SharedQuery

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
#: The pause before the next query after two answers within it. A node's checks change with
#: every round (the node's own check notes), and nodes that share one Consul node (a host's
#: agent serving several processes, the servers without client agents) wake each other's
#: queries: a burst is read in a few answers a second, and an eviction is at most this much
#: later (only when it follows two other answers within it).
MIN_GAP = 0.2
RETRY_PAUSE = 0.1
RETRY_PAUSE_MAX = 5.0
#: The health watch's query: any server answers (``stale``), and only the node-level checks
#: (no ServiceID), the only ones that can hold a node out. Without the filter an answer holds
#: every service check of the Consul node: on an agent that many nodes talk to (the servers,
#: without client agents) that is every node's TTL check, parsed by every process at each
#: check pass of any node.
NODE_CHECKS = {"stale": "", "filter": 'ServiceID == ""'}
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
    """The health of this node's Consul node, for one node (one ``ConsulRendezvous``).
    ``reason`` is "" while the node may train. ``on_change(reason)`` is called from the watch's
    thread after each change, and after the first answer when it holds the node out.

    The query itself is shared (:class:`_NodeWatch`): every node of a process that talks to the
    same agent with the same token watches the same Consul node, so they share one blocking
    query and each judges its answers with its own ``patterns``. ``node_name()`` gives the
    Consul node to watch (read once, by the first node that asks: where its session lives). A
    token that may not read the node's checks (Consul hides them) sets :attr:`error`: the
    caller refuses to join with it.
    """

    def __init__(self, client: ConsulClient, *, patterns: tuple[str, ...], node_id: str,
                 run_id: str, node_name: Callable[[], str],
                 on_change: Callable[[str], None], wait: float = HEALTH_WAIT) -> None:
        self.client = client
        self.patterns = patterns
        self.node_id = node_id
        self.run_id = run_id
        self.node_name = node_name
        self.on_change = on_change
        self.wait = wait
        self._reason = ""
        self.error: str = ""
        self._known = threading.Event()  # set once the first answer (or an error) is in
        self._watch: _NodeWatch | None = None
        #: monotonic time of the last change seen (for figures).
        self.changed_at = 0.0

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def node(self) -> str:
        return self._watch.node if self._watch is not None else ""

    @property
    def queries(self) -> int:
        """Answers of the (shared) query so far."""
        return self._watch.queries if self._watch is not None else 0

    @property
    def started(self) -> bool:
        return self._watch is not None

    def start(self) -> NodeHealth:
        if self._watch is None:
            self._watch = _NodeWatch.join(self)
        return self

    def stop(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.leave(self)

    def wait_known(self, deadline: float) -> bool:
        """Block until the first answer is in (or the deadline passes); True if it is."""
        return self._known.wait(max(0.0, deadline - time.monotonic()))

    def _answer(self, checks: list[dict]) -> None:
        """One answer of the shared query (its thread)."""
        reason = judge_health(checks, self.patterns)
        first = not self._known.is_set()
        changed = reason != self._reason
        self._reason = reason
        self._known.set()
        if changed:
            self.changed_at = time.monotonic()
            if not first or reason:
                self.on_change(reason)

    def _fail(self, node: str, what: str) -> None:
        node = node or "?"
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


class _NodeWatch(SharedQuery):
    """One blocking query on ``/v1/health/node/<node>`` (a daemon thread), shared by the
    :class:`NodeHealth` of every node of this process that talks to the same agent with the same
    token (:meth:`join`); it ends, after its current query, when the last one leaves.

    Index discipline as everywhere (:class:`BlockingIndex`). The query asks for the node-level
    checks only (:data:`NODE_CHECKS`), but Consul answers when any check of the node changes
    (the TTL checks of every node that talks to this agent, too), so an answer may come with
    nothing that counts changed: it is judged from data, and handed to the members only when
    the checks differ from the last answer. After a second answer (index moved) within
    ``MIN_GAP`` the next query waits ``MIN_GAP``: a burst (nodes sharing one Consul node
    register, or republish their services with every round) is read in a few answers a
    second, while a lone change is followed by a query at once.
    """

    _registry: ClassVar[dict[tuple, SharedQuery]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()
    thread_name = "consul-rdzv-health"

    def __init__(self, key: tuple, client: ConsulClient, wait: float) -> None:
        super().__init__(key, client)
        self.wait = wait
        self.node = ""
        self.queries = 0
        self._last: list[dict] | None = None
        self._failed = ""  # an ACL refusal: every member (and every later one) fails

    @classmethod
    def join(cls, member: NodeHealth) -> _NodeWatch:
        config = member.client.config
        key = (config.url, config.token, config.datacenter)
        return cls.attach(key, member, lambda: cls(key, member.client, member.wait))

    def _snapshot(self) -> tuple[list[dict] | None, str]:
        return self._last, self._failed

    def _catch_up(self, member: NodeHealth, snapshot: tuple[list[dict] | None, str]) -> None:
        last, failed = snapshot
        if failed:
            member._fail(self.node, failed)
        elif last is not None:
            member._answer(last)

    def _members_now(self) -> list[NodeHealth]:
        return self.members_now()

    def _find_node(self) -> None:
        failures = 0
        while not self._stopped.is_set() and not self.node:
            error = "no node watches it"
            for member in self._members_now():
                try:
                    self.node = member.node_name()
                    return
                except ConsulError as exc:
                    error = str(exc)
            failures += 1
            if failures == 1 or failures % 30 == 0:
                logger.warning("Cannot find the Consul node of the agent at %s: %s",
                               self.client.config.url, error)
            self._stopped.wait(min(RETRY_PAUSE * 2 ** failures, RETRY_PAUSE_MAX))

    def _loop(self) -> None:
        self._find_node()
        index = BlockingIndex()
        path = f"/v1/health/node/{urllib.parse.quote(self.node, safe='')}"
        failures = 0
        gap_until = last_answer = 0.0
        while not self._stopped.is_set():
            gap = gap_until - time.monotonic()
            if gap > 0 and self._stopped.wait(gap):
                return
            try:
                res, headers = self.client.read_with_headers(
                    path, params=NODE_CHECKS, index=index.param, wait=self.wait,
                    deadline=time.monotonic())
                self.queries += 1
            except ConsulPermissionDenied as exc:
                self._refused(str(exc))
                return
            except ConsulError as exc:
                if self._stopped.is_set():
                    return
                index.reset()
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    logger.warning("Cannot read the health of Consul node %s (agent %s): %s",
                                   self.node, self.client.config.url, exc)
                self._stopped.wait(min(RETRY_PAUSE * 2 ** failures, RETRY_PAUSE_MAX))
                continue
            failures = 0
            if index.update(res.index) is Step.MOVED:
                # An answer right after another one is a burst (registrations, passes of other
                # nodes' checks on this Consul node): read the rest of it in one answer. A lone
                # one (a check failing) is followed by a query at once.
                now = time.monotonic()
                if now - last_answer < MIN_GAP:
                    gap_until = now + MIN_GAP
                last_answer = now
            checks = list(res.data or [])
            # Consul filters the checks by ACL: checks of other services hidden are fine (they
            # never count); the node's own (serfHealth, every node has it) hidden means no
            # node read, and a gate that sees nothing must not let the node in.
            if headers.get("x-consul-results-filtered-by-acls", "").lower() == "true" and not any(
                    c.get("CheckID") == SERF_HEALTH and not c.get("ServiceID") for c in checks):
                self._refused("Consul hid its checks from this token")
                return
            first = self._last is None
            changed = _fingerprint(checks) != _fingerprint(self._last or [])
            with self._registry_lock:
                self._last = checks
            if not (changed or first):
                continue  # the same checks: every member has judged them already
            for member in self._members_now():
                member._answer(checks)

    def _refused(self, what: str) -> None:
        with self._registry_lock:
            self._failed = what
            members = list(self._members)
            self._stopped.set()
            if self._registry.get(self.key) is self:
                del self._registry[self.key]
        for member in members:
            member._fail(self.node, what)


def _fingerprint(checks: list[dict]) -> set[tuple[str, str, int]]:
    return {(str(c.get("CheckID")), str(c.get("ServiceID") or ""), int(c.get("ModifyIndex") or 0))
            for c in checks}
