"""One agent per node: does the node's endpoint reach one Consul agent, or several?

A TTL check lives on the agent that registered it. An endpoint that reaches several agents (a
load balancer in front of the servers, a Kubernetes Service) sends some passes elsewhere: they
get a 404, or keep a stray copy of the registration alive while the real check lapses, and the
node would be declared dead again and again. :class:`AgentLooks` finds out with agent-local
requests only (so it also works while the servers are slow or unreachable): it looks, each time
on a new connection, whether the agent that answers holds this process's registration (its
incarnation in the service meta). One agent gives the same answer every time, except that it may
forget the registration between two looks (a restart, a newer process with the node id), never
learn it (nobody registers meanwhile). So an agent without it answering before one with it means
several agents behind one address. Only evidence counts; an inconclusive look (an error, a
frozen agent) says nothing.

No state is shared between threads here: each look builds what it needs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from .client import ConsulClient
from .errors import ConsulConfigError, ConsulError
from .liveness import Liveness
from .service import Incarnation
from .settings import RendezvousSettings

logger = logging.getLogger(__name__)

#: How many times a node looks, each on a new connection, at the agent(s) behind its endpoint
#: when a heartbeat suggests that it reaches several.
AGENT_LOOKS = 4

#: How many looks, each on a new connection, follow a process's first registration. A balancer
#: sends each new connection (or request) to the next agent, but other nodes' connections in
#: between can bring one look back to the agent that holds the check: a second look makes that
#: luck rarer, at one agent-local request more per process.
FIRST_LOOKS = 2


class AgentLooks:
    """Looks at the agent(s) behind one node's endpoint (see the module docstring)."""

    def __init__(self, client: ConsulClient, settings: RendezvousSettings, *, node_id: str,
                 service_id: str, incarnation_id: str, liveness: Liveness,
                 stop: Callable[[], None]) -> None:
        self.client = client
        self.settings = settings
        self.node_id = node_id
        self.service_id = service_id
        self.incarnation_id = incarnation_id
        self.liveness = liveness
        self._stop = stop

    def check(self, deadline: float) -> None:
        """Look (:meth:`spread`, within one heartbeat interval); on evidence of several agents,
        stop for good (:meth:`refuse`) and raise its error."""
        detail = self.spread(min(deadline, time.monotonic() + self.settings.heartbeat_interval))
        if detail is not None:
            raise self.refuse(detail)

    def refuse(self, detail: str) -> ConsulConfigError:
        """Stop for good: no re-registration through an endpoint that spreads the node over
        agents. The node's standing becomes REFUSED (its round ends), its threads stop (the
        check lapses where it lives) and its session is destroyed (its keys go at once, so the
        others re-form without waiting for a TTL). Returns the error to raise."""
        error = self.error(detail)
        session = self.liveness.session
        if not self.liveness.refuse(error):
            earlier = self.liveness.error
            return earlier if isinstance(earlier, ConsulConfigError) else error
        logger.error("Node %s of run %s stops: %s", self.node_id, self.settings.run_id, error)
        self._stop()
        if session is not None:
            with contextlib.suppress(ConsulError):
                self.client.session_destroy(
                    session, deadline=time.monotonic() + self.settings.heartbeat_interval)
        return error

    def holds_us(self, client: ConsulClient | None = None) -> bool | None:
        """Does the agent that answers ``client`` (default: the node's own) hold this process's
        registration (its incarnation in the service meta)? None if it could not tell. One
        attempt; one map lookup on the agent (a filtered check list costs an agent with 1,000
        checks 9 ms, this 1 ms), which needs only ``service:read`` on the node's service, as the
        job's token has."""
        client = client or self.client
        try:
            service = client.agent_service(self.service_id, deadline=0.0)
        except ConsulError as exc:
            logger.debug("Node %s could not look at the agent behind %s: %s", self.node_id,
                         self.client.config.url, exc)
            return None
        return service is not None and (
            Incarnation.of(service.get("Meta")).id == self.incarnation_id)

    def fresh_look(self) -> bool | None:
        """:meth:`holds_us` on a new connection (a balancer sends each new connection, or each
        request, elsewhere)."""
        timeout = max(0.5, min(5.0, self.settings.heartbeat_interval))
        look = ConsulClient(self.client.config, timeout=timeout, retry_timeout=0.0, pool_size=1)
        try:
            return self.holds_us(look)
        finally:
            look.close()

    def spread(self, deadline: float, held: list[bool] | None = None) -> str | None:
        """How the endpoint reaches several agents, or None if there is no evidence of it.

        Looks :data:`AGENT_LOOKS` times (after the answers ``held`` already had)."""
        held = list(held or [])
        for _ in range(AGENT_LOOKS):
            if time.monotonic() >= deadline:
                return None
            answer = self.fresh_look()
            if answer is None:
                return None
            held.append(answer)
            if held[-1] and False in held[:-1]:
                return (f"one agent there does not hold node {self.node_id}'s service and TTL "
                        "check (a heartbeat that reaches it is refused with 404), another one "
                        "does")
        return None

    def first_look(self, deadline: float) -> str | None:
        """Right after the first registration, :data:`FIRST_LOOKS` looks, each on a new
        connection: on one agent they find the service just registered, and that is all
        (agent-local requests, once per process). If one does not, look on (:meth:`spread`),
        and last through the connection it was registered through."""
        held: list[bool] = []
        for _ in range(FIRST_LOOKS):
            answer = self.fresh_look()
            if answer is None:
                return None  # inconclusive: says nothing
            held.append(answer)
            if not answer:
                break
        if all(held):
            return None
        detail = self.spread(deadline, held=held)
        if detail is None and self.holds_us():
            detail = (f"a new connection reached an agent that does not know node "
                      f"{self.node_id}'s service and TTL check, registered a moment before "
                      "through another")
        return detail

    def error(self, detail: str) -> ConsulConfigError:
        """What a node whose endpoint reaches several agents stops with."""
        return ConsulConfigError(
            f"Consul at {self.client.config.url} (CONSUL_HTTP_ADDR / --rdzv-endpoint) reaches "
            f"several Consul agents (a load balancer?): {detail}. A TTL check lives on the agent "
            "that registered it: heartbeats that reach another agent are refused (404) or keep a "
            f"stray copy alive, so the check lapses and node {self.node_id} would be declared "
            "dead again and again. Point each node at one agent, e.g. the local client agent or "
            "one server (docs/deployment.md)."
        )
