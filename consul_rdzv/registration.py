"""One node's presence in Consul: its service instance, its TTL check, the session bound to that
check, and the two threads that keep them alive.

How it fails, and what the caller must watch for:

* **The check is passed by a thread of its own** (``pass`` every ``keep_alive_interval``, one
  attempt each, bounded by that interval). Nothing else runs on it: a slow Consul server (a
  leader election, an overloaded cluster) delays session renewals and KV calls, never a check
  pass, so it never makes a live node look dead. Check passes are agent-local requests.
* **Cut off.** When no pass has succeeded for ``heartbeat_timeout``, Consul has let (or is about
  to let) the check lapse, which invalidates the session and deletes the node's keys: the node is
  out of the job, and :attr:`Registration.lost` says so at once, whatever else it can reach.
* **Server RPCs run on a second thread**: probing the session while the node joins (a renew
  answering 404 means it is gone) and publishing the service meta an operator sees.
* **A lost registration** (session invalidated, check lapsed, agent restarted) is repaired by
  :meth:`Registration.ensure`: a new session bound to the check, after registering the service
  again only if the agent forgot it.
* **One node id, one process.** Check ids carry the process's :class:`Incarnation`, and the
  service id is the node's. A replacement process (a restarted pod, same node id) registers the
  same service id with its own check, which removes the predecessor's check: Consul invalidates
  the predecessor's session at once and deletes its keys, so the replacement takes over without
  waiting for a TTL. A process that finds its service taken by a newer incarnation was replaced:
  :meth:`Registration.ensure` raises instead of taking it back (no ping-pong).
* **One agent.** A TTL check lives on the agent that registered it. An endpoint that reaches
  several agents (a load balancer in front of the servers) sends some passes elsewhere: they get
  a 404, or keep a stray copy of the registration alive while the real check lapses. When a pass
  answers 404 (the first pass goes out at once), a session create keeps answering "Missing
  check", or the registration is lost although every pass succeeded, the node looks at the
  agent(s) behind its endpoint, each look on a new connection; if one agent there lacks the
  registration while another holds it, the node stops for good with a
  :class:`ConsulConfigError` naming the cause and the fix (no re-registration loop):
  :meth:`Registration.ensure` raises it, and the session is destroyed at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from . import service as svc
from .client import ConsulClient
from .errors import (
    ConsulBadRequest,
    ConsulConfigError,
    ConsulError,
    ConsulNotFound,
    ConsulSessionInvalid,
    ConsulUnavailableError,
    RendezvousReplacedError,
    RendezvousStateError,
)
from .service import DEREGISTER_CRITICAL_AFTER as DEREGISTER_CRITICAL_AFTER
from .service import Incarnation
from .settings import RendezvousSettings

logger = logging.getLogger(__name__)

#: How many times a node looks, each on a new connection, at the agent(s) behind its endpoint
#: when a heartbeat suggests that it reaches several (see Registration._agents_spread).
AGENT_LOOKS = 4
#: While a node trains, it looks at its agent's gossip this many times per consul_timeout.
GOSSIP_LOOKS = 4


def cut_off(members: list[dict]) -> bool:
    """Alone in its agent's gossip view (``/v1/agent/members``): the agent is the only member
    alive (serf status 1) and there are others (failed, left). A lone dev agent is not cut off.
    Quorum lost, or every server down, with other client agents alive is not either: nodes keep
    training while Consul is away, and only a cut-off node's session is surely gone."""
    alive = sum(1 for m in members if m.get("Status") == 1)
    return alive <= 1 and len(members) > 1


class Registration:
    """Service, TTL check and session of one node, kept alive by two daemon threads.

    ``on_lost(reason)`` is called (from any thread) the first time the registration is found
    lost after each :meth:`ensure`.
    """

    def __init__(self, client: ConsulClient, settings: RendezvousSettings, *, node_id: str,
                 host: str, incarnation: Incarnation, address: str | None = None,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.client = client
        self.settings = settings
        self.node_id = node_id
        self.host = host
        #: The service instance's Address: where this node is reached (its trainer store).
        self.address = address or host
        self.incarnation = incarnation
        self.service_id = svc.service_id(settings.run_id, node_id)
        self.check_id = svc.check_id(self.service_id, incarnation)
        #: From this monotonic time on, the keep thread probes the session every interval (a
        #: node that has been joining for a while); None: no probing (a training node's
        #: membership watch sees its key vanish instead; a node registered at handler creation
        #: but not joining yet has nothing to notice: next_round() starts it). See
        #: probe_session_from().
        self._probe_from: float | None = None
        self._on_lost = on_lost
        self._session: str | None = None
        self._lost = threading.Event()
        self._lost_reason = ""
        #: Lost only on our own evidence (no pass succeeded for the TTL), not Consul's word.
        self._lost_suspected = False
        self._replaced_by: str | None = None
        self._closed = False
        self._meta: dict[str, str] = {"state": svc.JOINING}
        self._meta_due: float | None = None
        self._published: dict | None = None
        self._note = svc.JOINING
        self._port: int | None = None
        self._last_pass = 0.0
        #: Longest time between two successful passes since the session was created: a loss
        #: that this cannot explain (shorter than the TTL) is looked into (see _check_agents).
        self._max_gap = 0.0
        #: A pass answered 404: ensure() or the keep thread looks at the agents behind the
        #: endpoint (see _agents_spread).
        self._suspect = False
        self._misconfigured: ConsulConfigError | None = None
        self._first_looked = False
        self._refuse_lock = threading.Lock()
        #: Guards the lost / suspected transitions (the pass thread suspects while ensure() or
        #: held() clears a suspicion that Consul contradicts).
        self._lost_lock = threading.Lock()
        #: Held while ensure() registers: no look at the agents may run meanwhile.
        self._ensure_lock = threading.Lock()
        #: Held around every service registration and around close()'s decision to leave:
        #: no registration may land after the deregistration (it would bring the service
        #: back, with a passing check nobody passes, until Consul reaps it a minute later).
        self._register_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        #: While training: when the keep thread next looks at the agent's gossip (None: off),
        #: and since when the agent has been alone in it (see watch_gossip()).
        self._gossip_next: float | None = None
        self._alone_since: float | None = None

    def __repr__(self) -> str:
        return f"Registration(service_id={self.service_id!r}, session={self._session!r})"

    # ------------------------------------------------------------------ state

    @property
    def session(self) -> str | None:
        return self._session

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def lost_confirmed(self) -> bool:
        """Lost on Consul's word (a 404, a vanished key), not only our own failed passes."""
        return self._lost.is_set() and not self._lost_suspected

    @property
    def lost_reason(self) -> str:
        return self._lost_reason

    @property
    def misconfigured(self) -> ConsulConfigError | None:
        """Set when the endpoint turned out to reach several Consul agents (see module doc)."""
        return self._misconfigured

    @property
    def seconds_since_pass(self) -> float:
        """Seconds since the check was last passed (a pass resets Consul's TTL timer)."""
        return time.monotonic() - self._last_pass

    def mark_lost(self, reason: str, *, confirmed: bool = True) -> None:
        """This node's session or check is gone (or about to be): it is out of its round.

        ``confirmed=False``: only this node's own evidence (its passes failed for the TTL), not
        Consul's word; :meth:`ensure` keeps the session if it turns out to be alive, and
        ``on_lost`` is not called (an overloaded agent that answers late must not end a round
        that Consul still holds together).
        """
        if self._closed:
            return
        with self._lost_lock:
            if self._lost.is_set():
                if not (confirmed and self._lost_suspected):
                    return
                self._lost_suspected = False
                fresh = False
            else:
                self._lost_reason = reason
                self._lost_suspected = not confirmed
                self._lost.set()
                fresh = True
        if fresh:
            logger.warning("Node %s of run %s: %s; it will register again at its next round.",
                           self.node_id, self.settings.run_id, reason)
        if confirmed and self._on_lost:
            self._on_lost(reason)

    def watch_gossip(self, on: bool) -> None:
        """While this node trains (``on``), look at its agent's own gossip view every
        ``consul_timeout`` / :data:`GOSSIP_LOOKS` (``/v1/agent/members``: the agent answers it
        alone, also while it reaches no server). An agent cut off from the cluster still passes
        the node's check (agent-local), but the servers declare its node failed and invalidate
        the node's session: no Consul request of the node's can tell it, and a blocking query
        may hang in the agent for its whole wait. Once the agent has been alone in its gossip
        view (:func:`cut_off`) for ``consul_timeout``, the node takes itself for lost (on its
        own evidence: ``ensure()`` asks Consul before it replaces the session)."""
        period = max(1.0, self.settings.consul_timeout / GOSSIP_LOOKS)
        self._gossip_next = time.monotonic() + period if on else None
        self._alone_since = None
        self._wake.set()

    def probe_session_from(self, when: float | None) -> None:
        """Probe the session every interval from monotonic time ``when`` on (None: never)."""
        self._probe_from = when
        self._wake.set()

    # ------------------------------------------------------------------ registering

    def definition(self) -> dict:
        """The service registration: instance, meta, tags and the TTL check (registered passing).

        What an operator filters on in the Consul UI: the tags ``consul-rdzv``, ``run-<id>``,
        ``state-<state>`` and ``rank-<rank>``; the meta; the check's notes ("round 5 · rank 3/8 ·
        training"), which a re-registration syncs to the catalog at once (a TTL check's output
        alone reaches the catalog only after the agent's check_update_interval, 5 min). The
        formats are :mod:`consul_rdzv.service`'s.
        """
        return svc.definition(self.settings, node_id=self.node_id, host=self.host,
                              address=self.address, incarnation=self.incarnation,
                              shown=self._meta, note=self._note, port=self._port)

    def ensure(self, deadline: float) -> str:
        """A live session bound to our passing check: the current one, or a new one.

        Raises :class:`RendezvousReplacedError` if a newer process took this node id over, and
        :class:`ConsulConfigError` if the endpoint reaches several Consul agents.
        """
        with self._ensure_lock:
            return self._ensure(deadline)

    def _ensure(self, deadline: float) -> str:
        if self._replaced_by:
            raise self._replaced_error()
        if self._misconfigured is not None:
            raise self._misconfigured
        old = self._session
        if old is not None and not self._lost.is_set():
            return old
        # A suspected loss is checked with Consul first; if Consul cannot be asked, every later
        # step would fail on the same Consul: raise now (one retry window, not one per step).
        if old is not None and self._lost_suspected and self._session_alive(old, deadline):
            return old
        checked = False
        if old is not None and (self._suspect or self._heartbeat_kept_up()):
            # Lost although our passes kept the check alive (or one answered 404): another
            # agent may hold it. Never register again through an endpoint that spreads us.
            self._check_agents(deadline)
            self._suspect = False
            checked = True
        self._meta, self._note, self._port = {"state": svc.JOINING}, svc.JOINING, None
        if old is None or not self._check_still_registered(deadline, checked=checked):
            with self._register_lock:
                if self._closed:
                    raise RendezvousStateError(f"Node {self.node_id} has left run "
                                               f"{self.settings.run_id}.")
                self.client.agent_service_register(self.definition(), deadline=deadline)
            self._published = self._shown()
            self._last_pass = time.monotonic()  # registered passing
        if not self._threads:
            # Pass the check from now on: a session create is a server RPC, and a slow server
            # must not let the fresh check lapse before the session binds to it.
            self._start_threads()
        session = self._create_session(deadline)
        # Switch sessions before clearing `lost`: nobody may judge the new registration by the
        # old session (a failed probe of the old one would mark us lost again).
        self._session = session
        self._last_pass = time.monotonic()
        self._max_gap = 0.0
        self._lost.clear()
        self._lost_reason = ""
        if self._suspect:
            # A pass (the first one goes out at once) was refused with a 404 while we
            # registered: find out now, before this node announces itself, whether the
            # endpoint spreads its requests over several agents.
            self._suspect = False
            self._check_agents(deadline)
        elif old is None and not self._first_looked:
            # Once per process: one look on a new connection, which a balancer per
            # connection (a Kubernetes Service) is likely to send to another agent.
            self._first_looked = True
            detail = self._first_look(min(deadline,
                                          time.monotonic() + self.settings.heartbeat_interval))
            if detail is not None:
                raise self._refuse(detail)
        if old is not None:
            # If the old session is in fact alive (our key was deleted by hand: a spurious
            # loss), it would keep holding the leader key or our member key: end it.
            with contextlib.suppress(ConsulError):
                self.client.session_destroy(old, deadline=deadline)
        logger.debug("Node %s of run %s registered service %s (check %s) with session %s.",
                     self.node_id, self.settings.run_id, self.service_id, self.check_id,
                     session)
        return session

    def _check_still_registered(self, deadline: float, *, checked: bool = False) -> bool:
        """After a lost session: pass our check; False if the agent forgot our service.

        A session usually dies because its check lapsed (late heartbeats on an overloaded agent)
        while the service stays registered: then passing the check is all a new session needs,
        and it spares the agent a service registration, which it serialises at O(services)
        each. A 404 means the agent forgot our check (restart, operator) or that a newer
        process with our node id replaced our registration: tell which from the service.
        """
        try:
            self.client.agent_check_update(self.check_id, "pass", deadline=deadline)
            return True
        except ConsulNotFound:
            pass
        if not checked:
            self._check_agents(deadline)
        service = self.client.agent_service(self.service_id, deadline=deadline)
        if service is not None:
            holder = Incarnation.of(service.get("Meta"))
            # Compare ids first: the meta's start time is rounded to the microsecond, so our
            # own registration (held by another agent behind a balancer) could look newer.
            if holder.id != self.incarnation.id and holder > self.incarnation:
                self._replaced_by = svc.holder(service.get("Meta"))
                raise self._replaced_error()
        return False

    def held(self, deadline: float) -> bool:
        """Does this node still hold its registration? True if it was never lost, or lost only
        on suspicion (its passes failed for the TTL) while Consul still holds its session: the
        suspicion is then cleared. A joining node asks this before it gives up its member key:
        rejoining on a suspicion alone would replace a session Consul never dropped, deleting
        the key of a node that may already be sealed into the round.

        Raises :class:`ConsulError` if Consul could not be asked (the client's retries spent):
        ensure() would fail on the same Consul, so the caller's error comes one retry window
        sooner."""
        if not self._lost.is_set():
            return True
        session = self._session
        return (session is not None and self._lost_suspected
                and self._session_alive(session, deadline))

    def _session_alive(self, session: str, deadline: float) -> bool:
        """After a suspected loss (passes failed for the TTL: an overloaded or unreachable
        agent): if Consul still holds our session, its check never lapsed and nothing was lost.
        Keep it: a new session would delete our keys and end the round for everyone. If Consul
        says the session is gone, the loss is confirmed."""
        alive = self.client.session_info(session, deadline=deadline) is not None
        if not alive:
            self.mark_lost(f"its Consul session {session} is gone")
            return False
        with self._lost_lock:
            if not self._lost_suspected or self._session != session:
                return False  # confirmed meanwhile (a 404 pass, a vanished key): no clearing
            self._lost_suspected = False
            self._lost_reason = ""
            self._lost.clear()
        logger.info("Node %s of run %s: its session survived the heartbeat gap; it keeps "
                    "its registration.", self.node_id, self.settings.run_id)
        return True

    def _replaced_error(self) -> RendezvousReplacedError:
        return RendezvousReplacedError(
            f"Node {self.node_id} of run {self.settings.run_id} was replaced by a newer process "
            f"with the same node id ({self._replaced_by}); this process stops. Give every "
            "concurrently running node a unique node id."
        )

    # ------------------------------------------------------------------ one agent

    def _heartbeat_kept_up(self) -> bool:
        """True if every pass since the session was created came well within the TTL: a loss of
        the registration is then not explained by our own heartbeat."""
        ttl = self.settings.heartbeat_timeout
        return self._max_gap < ttl and self.seconds_since_pass < ttl

    def _check_agents(self, deadline: float) -> None:
        """Raise :class:`ConsulConfigError` if the endpoint reaches several Consul agents.

        Only evidence refuses; an inconclusive look (an error, a frozen agent) changes nothing.
        Agent-local requests only, so it also works while the servers are slow or unreachable.
        Never runs while this process registers its service (``_ensure_lock``): a registration
        landing between two looks would pass for a second agent.
        """
        deadline = min(deadline, time.monotonic() + self.settings.heartbeat_interval)
        detail = self._agents_spread(deadline)
        if detail is not None:
            raise self._refuse(detail)

    def _holds_us(self, client: ConsulClient) -> bool | None:
        """Does the agent that answers ``client`` hold this process's registration (our
        incarnation in the service meta)? None if it could not tell. One attempt; one map
        lookup on the agent (a filtered check list costs an agent with 1,000 checks 9 ms, this
        1 ms), which needs only ``service:read`` on our service, as the job's token has."""
        try:
            service = client.agent_service(self.service_id, deadline=0.0)
        except ConsulError as exc:
            logger.debug("Node %s could not look at the agent behind %s: %s", self.node_id,
                         self.client.config.url, exc)
            return None
        return service is not None and (
            Incarnation.of(service.get("Meta")).id == self.incarnation.id)

    def _fresh_look(self) -> bool | None:
        """:meth:`_holds_us` on a new connection (a balancer sends each new connection, or
        each request, elsewhere)."""
        timeout = max(0.5, min(5.0, self.settings.heartbeat_interval))
        look = ConsulClient(self.client.config, timeout=timeout, retry_timeout=0.0, pool_size=1)
        try:
            return self._holds_us(look)
        finally:
            look.close()

    def _agents_spread(self, deadline: float, held: list[bool] | None = None) -> str | None:
        """How the endpoint reaches several agents, or None if there is no evidence of it.

        Looks :data:`AGENT_LOOKS` times, each on a new connection, whether the agent that
        answers holds this process's registration (after the answers ``held`` already had).
        One agent gives the same answer every time, except that it may forget the registration
        between two looks (a restart, a newer process with our node id), never learn it (we do
        not register meanwhile). So an agent without it answering before one with it means
        several agents behind one address.
        """
        held = list(held or [])
        for _ in range(AGENT_LOOKS):
            if time.monotonic() >= deadline:
                return None
            answer = self._fresh_look()
            if answer is None:
                return None
            held.append(answer)
            if held[-1] and False in held[:-1]:
                return (f"one agent there does not hold node {self.node_id}'s service and TTL "
                        "check (a heartbeat that reaches it is refused with 404), another one "
                        "does")
        return None

    def _first_look(self, deadline: float) -> str | None:
        """Right after the first registration, one look on a new connection: on one agent it
        finds the service we just registered, and that is all (one agent-local request, once
        per process). If it does not, look on (:meth:`_agents_spread`), and last through the
        connection we registered it through."""
        if self._fresh_look() is not False:
            return None
        detail = self._agents_spread(deadline, held=[False])
        if detail is None and self._holds_us(self.client):
            detail = (f"a new connection reached an agent that does not know node "
                      f"{self.node_id}'s service and TTL check, registered a moment before "
                      "through another")
        return detail

    def _refuse(self, detail: str) -> ConsulConfigError:
        """Stop for good: no re-registration through an endpoint that spreads us over agents.

        Destroys the session (our keys go at once, so the others re-form without waiting for a
        TTL) and stops passing the check (it lapses where it lives).
        """
        with self._refuse_lock:
            if self._misconfigured is not None:
                return self._misconfigured
            url = self.client.config.url
            self._misconfigured = ConsulConfigError(
                f"Consul at {url} (CONSUL_HTTP_ADDR / --rdzv-endpoint) reaches several Consul "
                f"agents (a load balancer?): {detail}. A TTL check lives on the agent that "
                "registered it: heartbeats that reach another agent are refused (404) or keep a "
                f"stray copy alive, so the check lapses and node {self.node_id} would be declared "
                "dead again and again. Point each node at one agent, e.g. the local client agent "
                "or one server (docs/deployment.md)."
            )
            error = self._misconfigured
            session = self._session
        logger.error("Node %s of run %s stops: %s", self.node_id, self.settings.run_id, error)
        self._stop.set()
        self._wake.set()
        if not self._lost.is_set() and not self._closed:
            self._lost_reason = str(error)
            self._lost.set()
            if self._on_lost:
                self._on_lost(self._lost_reason)
        if session is not None:
            with contextlib.suppress(ConsulError):
                self.client.session_destroy(
                    session, deadline=time.monotonic() + self.settings.heartbeat_interval)
        return error

    def _create_session(self, deadline: float) -> str:
        """Create our session bound to the TTL check.

        Consul refuses to bind a session to a critical check. The check was registered passing,
        but on a slow agent its TTL can run out before the session request is served, so pass
        it and ask again.

        Consul also answers "Missing check ... registration" (retried) until our check reached
        the catalog, and for good when the request reached an agent that does not hold the
        check (an endpoint that reaches several agents): after one interval of retries, look
        into that (:meth:`_check_agents`), then retry until ``deadline`` as before.
        """
        looked = False
        critical = 0
        while True:
            soon = min(deadline, time.monotonic() + self.settings.heartbeat_interval)
            try:
                return self.client.session_create(
                    name=svc.session_name(self.settings.run_id, self.node_id),
                    service_checks=[self.check_id], node_checks=["serfHealth"],
                    behavior="delete", lock_delay="0s", deadline=deadline if looked else soon,
                )
            except ConsulBadRequest as exc:
                if "critical state" not in str(exc):
                    raise
                if "serfHealth" in str(exc):
                    # This host's agent is not (yet) a healthy member of the cluster: it has
                    # just (re)started, or it is cut off. Transient: wait for it, within the
                    # deadline (the session binds to serfHealth so that a dead host's nodes go).
                    if time.monotonic() >= deadline:
                        raise
                    logger.info("Node %s: its Consul agent is not a healthy cluster member "
                                "yet (serfHealth critical); creating its session again in 1s.",
                                self.node_id)
                    self._stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                    continue
                critical += 1
                if critical == 3:
                    raise
                logger.warning("Node %s: its check went critical before its session was "
                               "created; passing it and trying again.", self.node_id)
                self.client.agent_check_update(self.check_id, "pass", deadline=deadline)
            except ConsulUnavailableError as exc:
                if looked or time.monotonic() >= deadline:
                    raise
                looked = True
                if "Missing check" in str(exc):
                    self._check_agents(deadline)

    # ------------------------------------------------------------------ what an operator sees

    def publish(self, meta: dict[str, str], *, delay: float = 0.0, note: str = "",
                port: int | None = None) -> None:
        """Show ``meta`` (and the check ``note``, and ``port``: the trainer store this node
        hosts, if any) in the service instance ``delay`` seconds from now (keep thread)."""
        self._meta = dict(meta)
        self._note = note
        self._port = port
        self._meta_due = time.monotonic() + delay
        self._wake.set()

    def _shown(self) -> dict:
        return {"meta": dict(self._meta), "note": self._note, "port": self._port}

    # ------------------------------------------------------------------ leaving

    def close(self, deadline: float) -> bool:
        """Stop the threads, deregister the service, destroy the session. Idempotent.

        Returns False if a step failed (logged).
        """
        with self._register_lock:  # a publish in flight ends first
            self._closed = True
        self._stop.set()
        self._wake.set()
        session, self._session = self._session, None
        if not self._threads and session is None:
            return True
        self._threads = []
        ok = True
        steps = []
        # Only our own registration: a newer process with our node id may have registered the
        # service since (a replaced process that comes back must not take it away from it).
        if self._replaced_by is None and self._holds_us(self.client) is not False:
            steps.append(("deregister its service",
                          lambda: self.client.agent_service_deregister(self.service_id,
                                                                       deadline=deadline)))
        if session is not None:
            steps.append(("destroy its session",
                          lambda: self.client.session_destroy(session, deadline=deadline)))
        for step, call in steps:
            try:
                call()
            except ConsulNotFound:
                pass
            except ConsulError as exc:
                ok = False
                logger.warning("Node %s could not %s while leaving run %s: %s", self.node_id,
                               step, self.settings.run_id, exc)
        return ok

    def halt(self) -> None:
        """Stop the threads and nothing else: the registration stays in Consul until its check
        lapses, as a killed or frozen process leaves it (tests and benchmarks simulate a death
        with this)."""
        self._closed = True
        self._stop.set()
        self._wake.set()

    # ------------------------------------------------------------------ the threads

    def _start_threads(self) -> None:
        for name, target in (("pass", self._pass_loop), ("keep", self._keep_loop)):
            thread = threading.Thread(target=target, daemon=True,
                                      name=f"consul-rdzv-{name}-{self.node_id}")
            self._threads.append(thread)
            thread.start()

    def _pass_loop(self) -> None:
        """Pass the check every interval: one attempt, bounded by the interval, nothing else."""
        interval = self.settings.heartbeat_interval
        ttl = self.settings.heartbeat_timeout
        # The first pass goes out at once: through an endpoint that reaches several agents it is
        # the request most likely to land on one that does not hold the check (a 404 that
        # ensure() looks into before the node announces itself).
        next_beat = time.monotonic()
        failures = 0
        while not self._stop.wait(max(0.0, next_beat - time.monotonic())):
            started = time.monotonic()
            next_beat = started + interval
            try:
                # deadline=now: a single attempt; the next beat is the retry.
                self.client.agent_check_update(self.check_id, "pass",
                                               note=svc.heartbeat_note(self._note),
                                               deadline=started, timeout=interval)
                self._max_gap = max(self._max_gap, started - self._last_pass)
                self._last_pass = started
                failures = 0
                continue
            except ConsulNotFound as exc:
                self._suspect = True  # ensure() or the keep thread asks which agent holds it
                self._wake.set()
                if self._session is not None:
                    self.mark_lost(f"its check is gone from the Consul agent ({exc})")
            except ConsulError as exc:
                failures += 1
                if failures == 1 or failures % 10 == 0:
                    logger.warning("Heartbeat of node %s failed %d time(s): %s", self.node_id,
                                   failures, exc)
            silent = time.monotonic() - self._last_pass
            if silent > ttl and self._session is not None:
                self.mark_lost(
                    f"its check could not be passed for {silent:.1f}s (heartbeat_timeout "
                    f"{ttl:g}s): Consul at {self.client.config.url} is unreachable or too slow, "
                    "and has most likely declared this node dead", confirmed=False)

    def _keep_loop(self) -> None:
        """Server RPCs, off the check's thread: the session probe, the meta publish. Sleeps
        until one is due (a training node's keep thread wakes only to publish its meta)."""
        interval = self.settings.heartbeat_interval
        next_probe = time.monotonic() + interval
        gossip_period = max(1.0, self.settings.consul_timeout / GOSSIP_LOOKS)
        while not self._stop.is_set():
            due = [t for t in (self._probe_due(next_probe), self._meta_due, self._gossip_next)
                   if t is not None]
            self._wake.wait(max(0.0, min(due) - time.monotonic()) if due else None)
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            probe_at = self._probe_due(next_probe)
            if probe_at is not None and now >= probe_at:
                next_probe = now + interval
                self._probe()
            if self._meta_due is not None and time.monotonic() >= self._meta_due:
                self._meta_due = None
                self._publish_now()
            gossip_at = self._gossip_next
            if gossip_at is not None and time.monotonic() >= gossip_at:
                self._gossip_next = time.monotonic() + gossip_period
                self._look_at_gossip()
            if (self._suspect and self._session is not None and self._misconfigured is None
                    and self._ensure_lock.acquire(blocking=False)):
                # A pass answered 404 after we registered (ensure() looks itself while it runs).
                try:
                    self._suspect = False
                    with contextlib.suppress(ConsulConfigError):
                        self._check_agents(time.monotonic() + interval)
                finally:
                    self._ensure_lock.release()

    def _look_at_gossip(self) -> None:
        """See :meth:`watch_gossip`."""
        if self._session is None or self._lost.is_set():
            return
        try:
            members = self.client.agent_members(
                deadline=time.monotonic() + self.settings.heartbeat_interval)
        except ConsulError:
            self._alone_since = None  # the agent itself does not answer: the pass thread's case
            return
        now = time.monotonic()
        if not cut_off(members):
            self._alone_since = None
            return
        if self._alone_since is None:
            self._alone_since = now
            logger.warning("Node %s of run %s: its Consul agent sees no other cluster member "
                           "alive.", self.node_id, self.settings.run_id)
            return
        alone = now - self._alone_since
        if alone >= self.settings.consul_timeout:
            self.mark_lost(
                f"cut off from the Consul cluster: its agent has seen no other member alive for "
                f"{alone:.0f}s (consul_timeout {self.settings.consul_timeout:g}s), so the servers "
                "have most likely declared this node dead", confirmed=False)

    def _probe_due(self, next_probe: float) -> float | None:
        start = self._probe_from
        return None if start is None else max(start, next_probe)

    def _probe(self) -> None:
        session = self._session
        if session is None or self._lost.is_set():
            return
        try:
            # The session has no TTL: renewing it only asks whether it still exists.
            self.client.session_renew(session, deadline=time.monotonic() + self.settings
                                      .heartbeat_interval)
        except (ConsulNotFound, ConsulSessionInvalid) as exc:
            if self._session == session:
                self.mark_lost(f"its Consul session is gone ({exc})")
        except ConsulError as exc:
            logger.debug("Node %s could not probe its session: %s", self.node_id, exc)

    def _publish_now(self) -> None:
        shown = self._shown()
        # Never while lost, nor after a silence (a process frozen, then thawed): if a newer
        # process took our node id, re-registering our service would remove its check and
        # invalidate its session.
        if (shown == self._published or self._session is None or self._lost.is_set()
                or self.seconds_since_pass > self.settings.heartbeat_timeout):
            return
        with self._register_lock:
            if self._closed:
                return
            # The agent must still hold *our* registration (one agent-local lookup): a newer
            # process with our node id may have registered since (while this one was frozen
            # for a moment), and a re-registration would take the service back from it.
            if self._holds_us(self.client) is not True:
                logger.debug("Node %s does not publish its service meta: its agent does not "
                             "hold its registration now.", self.node_id)
                return
            try:
                self.client.agent_service_register(
                    self.definition(),
                    deadline=time.monotonic() + self.settings.heartbeat_interval)
                self._published = shown
            except ConsulError as exc:
                logger.debug("Node %s could not publish its service meta: %s", self.node_id,
                             exc)
