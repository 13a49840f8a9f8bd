"""One node's presence in Consul: its service instance, its TTL check, and the session bound to
that check.

How it fails, and what the caller must watch for:

* **The check is passed by a thread of its own** (:mod:`consul_rdzv.heartbeat`: ``pass`` every
  ``keep_alive_interval``, one attempt each, bounded by that interval). Nothing else runs on it:
  a slow Consul server (a leader election, an overloaded cluster) delays session renewals and KV
  calls, never a check pass, so it never makes a live node look dead. Check passes are
  agent-local requests.
* **Cut off.** When no pass has succeeded for ``heartbeat_timeout``, Consul has let (or is about
  to let) the check lapse, which invalidates the session and deletes the node's keys: the node is
  out of the job, and :attr:`Registration.lost` says so at once, whatever else it can reach. A
  node whose agent is cut off from the cluster (its passes still succeed) learns it from its
  agent's gossip (:mod:`consul_rdzv.keeper`).
* **Server RPCs run on a second thread** (:mod:`consul_rdzv.keeper`): probing the session while
  the node joins (a renew answering 404 means it is gone) and publishing the service meta an
  operator sees.
* **The node's standing** (held, suspected, lost, replaced, refused, closed) is one state
  machine, :mod:`consul_rdzv.liveness`; every thread changes it only by its transitions.
* **A lost registration** (session invalidated, check lapsed, agent restarted) is repaired by
  :meth:`Registration.ensure`: a new session bound to the check, after registering the service
  again only if the agent forgot it.
* **One node id, one process.** Check ids carry the process's :class:`Incarnation`, and the
  service id is the node's. A replacement process (a restarted pod, same node id) registers the
  same service id with its own check, which removes the predecessor's check: Consul invalidates
  the predecessor's session at once and deletes its keys, so the replacement takes over without
  waiting for a TTL. A process that finds its service taken by a newer incarnation was replaced:
  :meth:`Registration.ensure` raises instead of taking it back (no ping-pong).
* **One agent.** A TTL check lives on the agent that registered it; an endpoint that reaches
  several agents (a load balancer) is found out (:mod:`consul_rdzv.agents`) and the node stops
  for good with a :class:`ConsulConfigError` naming the cause and the fix.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from . import service as svc
from .agents import AgentLooks
from .client import ConsulClient
from .errors import (
    ConsulBadRequest,
    ConsulConfigError,
    ConsulError,
    ConsulNotFound,
    ConsulUnavailableError,
    RendezvousReplacedError,
    RendezvousStateError,
)
from .heartbeat import Heartbeat
from .keeper import JOINING, Keeper, Shown
from .liveness import Liveness, State
from .service import DEREGISTER_CRITICAL_AFTER as DEREGISTER_CRITICAL_AFTER
from .service import Incarnation
from .settings import RendezvousSettings

logger = logging.getLogger(__name__)

class Registration:
    """Service, TTL check and session of one node, kept alive by two daemon threads.

    ``on_lost(reason)`` is called (from any thread) when the node's standing becomes lost on
    Consul's word, replaced or refused (:mod:`consul_rdzv.liveness`).

    Who owns what (every field shared between threads):

    ==========================  ===============================================================
    field                       owner / guard
    ==========================  ===============================================================
    ``liveness``                its own lock; every thread reads a snapshot, changes it only by
                                its transitions (the session id lives there too)
    ``heartbeat.last_pass``,    the pass thread (and ensure(), when it registers the check
    ``heartbeat.max_gap``       passing); plain floats read anywhere
    ``keeper.*`` schedule       set by the caller's thread (probe_session_from, watch_gossip,
                                publish), read by the keep thread
    ``keeper.shown``            what the instance should show (a frozen :class:`Shown`): set by
                                the caller's thread (publish(), ensure()); read by the pass
                                thread (the note) and the keep thread (its publish)
    ``keeper.published``        the keep thread (its publish) and ensure(), never at once:
                                ensure() resets it only while no round is published
    ``_suspect``                set by the pass thread (a 404), cleared by ensure() or the keep
                                thread under ``_ensure_lock``
    ``_ensure_lock``            held by ensure(); the keep thread's agent look takes it without
                                blocking (no look while this process registers)
    ``register_lock``           around every service registration and close()'s decision to
                                leave: no registration lands after the deregistration
    ==========================  ===============================================================
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
        self.liveness = Liveness(on_lost)
        self.agents = AgentLooks(client, settings, node_id=node_id, service_id=self.service_id,
                                 incarnation_id=incarnation.id, liveness=self.liveness,
                                 stop=self._stop_threads)
        self.heartbeat = Heartbeat(client, settings, check_id=self.check_id, node_id=node_id,
                                   note=self._shown_note, on_refused=self._pass_refused,
                                   on_silent=self._silent)
        self.keeper: Keeper = Keeper(self)
        self._suspect = False
        self._first_looked = False
        self._ensure_lock = threading.Lock()
        self.register_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Registration(service_id={self.service_id!r}, {self.liveness!r})"

    # ------------------------------------------------------------------ state

    @property
    def session(self) -> str | None:
        return self.liveness.session

    @property
    def lost(self) -> bool:
        """Out of its round: lost (on Consul's word or on suspicion), replaced or refused."""
        return self.liveness.out

    @property
    def lost_confirmed(self) -> bool:
        """Lost on Consul's word (a 404, a vanished key), not only our own failed passes."""
        return self.liveness.confirmed

    @property
    def lost_reason(self) -> str:
        return self.liveness.reason

    @property
    def misconfigured(self) -> ConsulConfigError | None:
        """Set when the endpoint turned out to reach several Consul agents."""
        error = self.liveness.error
        return error if self.liveness.state is State.REFUSED and isinstance(
            error, ConsulConfigError) else None

    @property
    def seconds_since_pass(self) -> float:
        """Seconds since the check was last passed (a pass resets Consul's TTL timer)."""
        return self.heartbeat.seconds_since_pass

    def mark_lost(self, reason: str, *, confirmed: bool = True,
                  session: str | None = None) -> None:
        """This node's session or check is gone (or about to be): it is out of its round.

        ``confirmed=False``: only this node's own evidence (its passes failed for the TTL, its
        agent cut off), not Consul's word; :meth:`ensure` keeps the session if it turns out to
        be alive, and ``on_lost`` is not called (an overloaded agent that answers late must not
        end a round that Consul still holds together). ``session``: only if that is still the
        current session.
        """
        changed = (self.liveness.lose(reason, session=session) if confirmed
                   else self.liveness.suspect(reason))
        if changed:
            logger.warning("Node %s of run %s: %s; it will register again at its next round.",
                           self.node_id, self.settings.run_id, reason)

    def probe_session_from(self, when: float | None) -> None:
        """Probe the session every interval from monotonic time ``when`` on (None: never)."""
        self.keeper.probe_session_from(when)

    def watch_gossip(self, on: bool) -> None:
        """While this node trains (``on``), look at its agent's gossip for a cut-off
        (:mod:`consul_rdzv.keeper`)."""
        self.keeper.watch_gossip(on)

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
                              shown=dict(self.keeper.shown.meta), note=self.keeper.shown.note,
                              port=self.keeper.shown.port)

    def ensure(self, deadline: float) -> str:
        """A live session bound to our passing check: the current one, or a new one.

        Raises :class:`RendezvousReplacedError` if a newer process took this node id over, and
        :class:`ConsulConfigError` if the endpoint reaches several Consul agents.
        """
        with self._ensure_lock:
            return self._ensure(deadline)

    def _ensure(self, deadline: float) -> str:
        now = self.liveness.now
        if now.state in (State.REPLACED, State.REFUSED) and now.error is not None:
            raise now.error
        if now.state is State.CLOSED:
            raise self._left_error()
        old = now.session
        if now.state is State.HELD and old is not None:
            return old
        # A suspected loss is checked with Consul first; if Consul cannot be asked, every later
        # step would fail on the same Consul: raise now (one retry window, not one per step).
        if now.state is State.SUSPECTED and old is not None \
                and self._session_alive(old, deadline):
            return old
        checked = False
        if old is not None and (self._suspect or self.heartbeat.kept_up):
            # Lost although our passes kept the check alive (or one answered 404): another
            # agent may hold it. Never register again through an endpoint that spreads us.
            self._check_agents(deadline)
            self._suspect = False
            checked = True
        self.keeper.shown = JOINING
        if old is None or not self._check_still_registered(deadline, checked=checked):
            with self.register_lock:
                if self.liveness.state is State.CLOSED:
                    raise self._left_error()
                self.client.agent_service_register(self.definition(), deadline=deadline)
            self.keeper.published = self.keeper.shown
            self.heartbeat.passed_now()  # registered passing
        # Pass the check from now on: a session create is a server RPC, and a slow server must
        # not let the fresh check lapse before the session binds to it.
        self.heartbeat.start()
        self.keeper.start()
        session = self._create_session(deadline)
        self.heartbeat.reset()
        if not self.liveness.held(session):  # refused or closed meanwhile
            with contextlib.suppress(ConsulError):
                self.client.session_destroy(session, deadline=deadline)
            error = self.liveness.error
            raise error if error is not None else self._left_error()
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
            detail = self.agents.first_look(
                min(deadline, time.monotonic() + self.settings.heartbeat_interval))
            if detail is not None:
                raise self.agents.refuse(detail)
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
                by = svc.holder(service.get("Meta"))
                error = self._replaced_error(by)
                self.liveness.replaced(f"replaced by {by}", error)
                raise error
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
        now = self.liveness.now
        if not now.out:
            return True
        return (now.state is State.SUSPECTED and now.session is not None
                and self._session_alive(now.session, deadline))

    def _session_alive(self, session: str, deadline: float) -> bool:
        """After a suspected loss (passes failed for the TTL: an overloaded or unreachable
        agent): if Consul still holds our session, its check never lapsed and nothing was lost.
        Keep it: a new session would delete our keys and end the round for everyone. If Consul
        says the session is gone, the loss is confirmed."""
        if self.client.session_info(session, deadline=deadline) is None:
            self.mark_lost(f"its Consul session {session} is gone", session=session)
            return False
        if not self.liveness.clear(session):
            return False  # confirmed meanwhile (a 404 pass, a vanished key): no clearing
        logger.info("Node %s of run %s: its session survived the heartbeat gap; it keeps "
                    "its registration.", self.node_id, self.settings.run_id)
        return True

    def _replaced_error(self, by: str) -> RendezvousReplacedError:
        return RendezvousReplacedError(
            f"Node {self.node_id} of run {self.settings.run_id} was replaced by a newer process "
            f"with the same node id ({by}); this process stops. Give every concurrently running "
            "node a unique node id."
        )

    def _left_error(self) -> RendezvousStateError:
        return RendezvousStateError(f"Node {self.node_id} has left run {self.settings.run_id}.")

    # ------------------------------------------------------------------ one agent

    def _check_agents(self, deadline: float) -> None:
        """Raise :class:`ConsulConfigError` if the endpoint reaches several Consul agents
        (:meth:`AgentLooks.check`). Never runs while this process registers its service
        (``_ensure_lock``): a registration landing between two looks would pass for a second
        agent."""
        self.agents.check(deadline)

    def recheck_agents(self, deadline: float) -> None:
        """The keep thread: a pass answered 404 after we registered (ensure() looks itself while
        it runs)."""
        if (not self._suspect or self.liveness.session is None
                or self.liveness.state is State.REFUSED
                or not self._ensure_lock.acquire(blocking=False)):
            return
        try:
            self._suspect = False
            with contextlib.suppress(ConsulConfigError):
                self._check_agents(deadline)
        finally:
            self._ensure_lock.release()

    def _create_session(self, deadline: float) -> str:
        return create_session(self.client, self.settings, node_id=self.node_id,
                              check_id=self.check_id, check_agents=self._check_agents,
                              deadline=deadline)

    # ------------------------------------------------------------------ what an operator sees

    def publish(self, meta: dict[str, str], *, delay: float = 0.0, note: str = "",
                port: int | None = None) -> None:
        """Show ``meta`` (and the check ``note``, and ``port``: the trainer store this node
        hosts, if any) in the service instance ``delay`` seconds from now (keep thread)."""
        self.keeper.publish(Shown(dict(meta), note, port), delay)

    # ------------------------------------------------------------------ the pass thread's news

    def _shown_note(self) -> str:
        return self.keeper.shown.note

    def _pass_refused(self, exc: ConsulNotFound) -> None:
        self._suspect = True  # ensure() or the keep thread asks which agent holds it
        self.keeper.wake()
        if self.liveness.session is not None:
            self.mark_lost(f"its check is gone from the Consul agent ({exc})")

    def _silent(self, silent: float) -> None:
        if self.liveness.session is not None:
            ttl = self.settings.heartbeat_timeout
            self.mark_lost(
                f"its check could not be passed for {silent:.1f}s (heartbeat_timeout "
                f"{ttl:g}s): Consul at {self.client.config.url} is unreachable or too slow, "
                "and has most likely declared this node dead", confirmed=False)

    # ------------------------------------------------------------------ leaving

    def close(self, deadline: float) -> bool:
        """Stop the threads, deregister the service, destroy the session. Idempotent.

        Returns False if a step failed (logged).
        """
        with self.register_lock:  # a publish in flight ends first
            before = self.liveness.now
            self.liveness.close()
        self._stop_threads()
        session = before.session
        if before.state is State.CLOSED or (not self.heartbeat.started and session is None):
            return True
        ok = True
        steps = []
        # Only our own registration: a newer process with our node id may have registered the
        # service since (a replaced process that comes back must not take it away from it).
        if before.state is not State.REPLACED and self.agents.holds_us() is not False:
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
        self.liveness.close(forget_session=False)
        self._stop_threads()

    def _stop_threads(self) -> None:
        self.heartbeat.stop()
        self.keeper.stop()


def create_session(client: ConsulClient, settings: RendezvousSettings, *, node_id: str,
                   check_id: str, check_agents: Callable[[float], None],
                   deadline: float) -> str:
    """Create a node's session bound to its TTL check (and its agent's serfHealth).

    Consul refuses to bind a session to a critical check. The check was registered passing,
    but on a slow agent its TTL can run out before the session request is served, so pass
    it and ask again.

    Consul also answers "Missing check ... registration" (retried) until our check reached
    the catalog, and for good when the request reached an agent that does not hold the
    check (an endpoint that reaches several agents): after one interval of retries, look
    into that (``check_agents``), then retry until ``deadline`` as before.
    """
    looked = False
    critical = 0
    while True:
        soon = min(deadline, time.monotonic() + settings.heartbeat_interval)
        try:
            return client.session_create(
                name=svc.session_name(settings.run_id, node_id),
                service_checks=[check_id], node_checks=["serfHealth"],
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
                            node_id)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            critical += 1
            if critical == 3:
                raise
            logger.warning("Node %s: its check went critical before its session was "
                           "created; passing it and trying again.", node_id)
            client.agent_check_update(check_id, "pass", deadline=deadline)
        except ConsulUnavailableError as exc:
            if looked or time.monotonic() >= deadline:
                raise
            looked = True
            if "Missing check" in str(exc):
                check_agents(deadline)
