"""The keep thread of one node: the server RPCs and looks that concern its registration, off
the check-pass thread, each only when it is due.

* the **session probe** (a renew, every interval; the session has no TTL, so a renew only asks
  whether it still exists) while the node joins and has waited ``heartbeat_timeout``, and after
  a round it trained in is over (no watch covers it then); never before the first round;
* the **meta publish**: the round, rank and state shown in the service instance (a service
  registration), some time after the round returned; never while the node is out of its round,
  nor after a silence (a process frozen, then thawed), nor unless its agent still holds this
  process's registration: a newer process with the node id may have registered since, and a
  re-registration would take the service back from it;
* the **gossip look** while the node trains: its agent's own view of the cluster
  (``/v1/agent/members``, answered by the agent alone); an agent alone in it for
  ``consul_timeout`` is cut off from the cluster, whose servers then declare the node dead (its
  check passes still succeed locally, and a blocking query may hang in the agent): the node
  takes itself for lost (a suspicion: ``ensure()`` asks Consul before it replaces the session);
* the **agent look** after a check pass was refused with 404: does the endpoint reach several
  agents (:mod:`consul_rdzv.agents`)?

Fields shared with other threads (each written by one side, a plain store read by the other):
``probe_from`` and ``gossip_next`` (the caller's thread turns them on and off), ``shown`` and
``meta_due`` (set by ``publish()``), ``published`` (this thread, and ``ensure()`` while nothing
is published), ``alone_since`` (this thread only), the wake and stop events.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from .agents import AgentLooks
from .client import ConsulClient
from .errors import ConsulError, ConsulNotFound, ConsulSessionInvalid
from .heartbeat import Heartbeat
from .liveness import Liveness, State
from .service import JOINING as JOINING_STATE
from .settings import RendezvousSettings


class Owner(Protocol):
    """What the keep thread uses of the registration that owns it (registration.py imports
    this module, not the other way round)."""

    node_id: str
    settings: RendezvousSettings
    client: ConsulClient
    liveness: Liveness
    heartbeat: Heartbeat
    agents: AgentLooks
    register_lock: threading.Lock

    def definition(self) -> dict: ...

    def mark_lost(self, reason: str, *, confirmed: bool = True,
                  session: str | None = None) -> None: ...

    def recheck_agents(self, deadline: float) -> None: ...

logger = logging.getLogger(__name__)

#: While a node trains, it looks at its agent's gossip this many times per consul_timeout.
GOSSIP_LOOKS = 4


@dataclass(frozen=True)
class Shown:
    """What a node's service instance shows an operator: the service meta it adds, the check's
    note, the port (rank 0's trainer store)."""

    meta: dict[str, str] = field(default_factory=dict)
    note: str = ""
    port: int | None = None


#: What a node shows while it joins.
JOINING = Shown({"state": JOINING_STATE}, JOINING_STATE, None)


def cut_off(members: list[dict]) -> bool:
    """Alone in its agent's gossip view (``/v1/agent/members``): the agent is the only member
    alive (serf status 1) and there are others (failed, left). A lone dev agent is not cut off.
    Quorum lost, or every server down, with other client agents alive is not either: nodes keep
    training while Consul is away, and only a cut-off node's session is surely gone."""
    alive = sum(1 for m in members if m.get("Status") == 1)
    return alive <= 1 and len(members) > 1


class Keeper:
    """The keep thread (see the module docstring)."""

    def __init__(self, registration: Owner) -> None:
        self.reg = registration
        settings = registration.settings
        self.interval = settings.heartbeat_interval
        self.gossip_period = max(1.0, settings.consul_timeout / GOSSIP_LOOKS)
        #: From this monotonic time on, probe the session every interval (None: never).
        self.probe_from: float | None = None
        #: What the instance should show, what it was last registered with, when to publish.
        self.shown = JOINING
        self.published: Shown | None = None
        self.meta_due: float | None = None
        #: When to look at the agent's gossip next (None: off), and since when it is alone.
        self.gossip_next: float | None = None
        self.alone_since: float | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"consul-rdzv-keep-{self.reg.node_id}")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def probe_session_from(self, when: float | None) -> None:
        self.probe_from = when
        self._wake.set()

    def publish(self, shown: Shown, delay: float) -> None:
        self.shown = shown
        self.meta_due = time.monotonic() + delay
        self._wake.set()

    def watch_gossip(self, on: bool) -> None:
        self.gossip_next = time.monotonic() + self.gossip_period if on else None
        self.alone_since = None
        self._wake.set()

    # ------------------------------------------------------------------ the loop

    def _probe_due(self, next_probe: float) -> float | None:
        start = self.probe_from
        return None if start is None else max(start, next_probe)

    def _loop(self) -> None:
        next_probe = time.monotonic() + self.interval
        while not self._stop.is_set():
            due = [t for t in (self._probe_due(next_probe), self.meta_due, self.gossip_next)
                   if t is not None]
            self._wake.wait(max(0.0, min(due) - time.monotonic()) if due else None)
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            probe_at = self._probe_due(next_probe)
            if probe_at is not None and now >= probe_at:
                next_probe = now + self.interval
                self._probe()
            if self.meta_due is not None and time.monotonic() >= self.meta_due:
                self.meta_due = None
                self._publish()
            gossip_at = self.gossip_next
            if gossip_at is not None and time.monotonic() >= gossip_at:
                self.gossip_next = time.monotonic() + self.gossip_period
                self._look_at_gossip()
            # a pass refused with 404 since: does the endpoint reach several agents?
            self.reg.recheck_agents(time.monotonic() + self.interval)

    def _publish(self) -> None:
        reg = self.reg
        shown = self.shown
        now = reg.liveness.now
        if (shown == self.published or now.session is None or now.out
                or reg.heartbeat.seconds_since_pass > reg.settings.heartbeat_timeout):
            return
        with reg.register_lock:
            if reg.liveness.state is State.CLOSED:
                return
            if reg.agents.holds_us() is not True:
                logger.debug("Node %s does not publish its service meta: its agent does not "
                             "hold its registration now.", reg.node_id)
                return
            try:
                reg.client.agent_service_register(reg.definition(),
                                                  deadline=time.monotonic() + self.interval)
                self.published = shown
            except ConsulError as exc:
                logger.debug("Node %s could not publish its service meta: %s", reg.node_id, exc)

    def _probe(self) -> None:
        now = self.reg.liveness.now
        session = now.session
        if session is None or now.out:
            return
        try:
            self.reg.client.session_renew(session, deadline=time.monotonic() + self.interval)
        except (ConsulNotFound, ConsulSessionInvalid) as exc:
            self.reg.mark_lost(f"its Consul session is gone ({exc})", session=session)
        except ConsulError as exc:
            logger.debug("Node %s could not probe its session: %s", self.reg.node_id, exc)

    def _look_at_gossip(self) -> None:
        now = self.reg.liveness.now
        if now.session is None or now.out:
            return
        try:
            members = self.reg.client.agent_members(deadline=time.monotonic() + self.interval)
        except ConsulError:
            self.alone_since = None  # the agent itself does not answer: the pass thread's case
            return
        moment = time.monotonic()
        if not cut_off(members):
            self.alone_since = None
            return
        if self.alone_since is None:
            self.alone_since = moment
            logger.warning("Node %s of run %s: its Consul agent sees no other cluster member "
                           "alive.", self.reg.node_id, self.reg.settings.run_id)
            return
        alone = moment - self.alone_since
        timeout = self.reg.settings.consul_timeout
        if alone >= timeout:
            self.reg.mark_lost(
                f"cut off from the Consul cluster: its agent has seen no other member alive for "
                f"{alone:.0f}s (consul_timeout {timeout:g}s), so the servers have most likely "
                "declared this node dead", confirmed=False)
