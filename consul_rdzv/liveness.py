"""A node's standing in Consul as one explicit state machine: one lock, no I/O.

Every thread of a node asks this object, and only this object changes it: the caller's thread
(joining, leaving), the pass thread (a check pass refused or late), the keep thread (a session
probe, the agent's gossip), the round's watch (its own member key gone). Each transition is a
method; each returns whether it changed anything, so the caller logs once.

::

    UNREGISTERED --held(s)--> HELD --suspect--> SUSPECTED --clear(s)--> HELD
                               |                    |
                               +------lose----------+--> LOST --held(s')--> HELD
    any state but CLOSED --replaced--> REPLACED   (terminal: a newer process has the node id)
    any state but CLOSED --refuse----> REFUSED    (terminal: the endpoint reaches several agents)
    any state --close--> CLOSED                   (terminal: left, or halted)

* **HELD**: a session bound to the node's passing check; nothing says otherwise.
* **SUSPECTED**: lost on this node's own evidence only (no pass succeeded for the TTL, its agent
  alone in its gossip): Consul may still hold the session, and ``ensure()`` asks before it
  replaces it (an overloaded agent that answers late must not end a round Consul still holds).
* **LOST**: on Consul's word (a check pass refused with 404, the session gone, the member key
  vanished). ``on_lost(reason)`` is called once, outside the lock, when a state becomes LOST (or
  REPLACED, REFUSED) from HELD or SUSPECTED: the round this node is in is over for it.
* **REPLACED**, **REFUSED**: the node stops for good; :attr:`Liveness.error` is what it raises.
* **CLOSED**: nothing changes it any more (a late pass failure after ``leave()`` means nothing).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass


class State(enum.Enum):
    UNREGISTERED = "unregistered"
    HELD = "held"
    SUSPECTED = "suspected"
    LOST = "lost"
    REPLACED = "replaced"
    REFUSED = "refused"
    CLOSED = "closed"


#: States in which the node is out of its round (``num_nodes_waiting() >= 1``).
OUT = frozenset({State.SUSPECTED, State.LOST, State.REPLACED, State.REFUSED})
#: ... on Consul's word, not only on this node's own evidence.
CONFIRMED = frozenset({State.LOST, State.REPLACED, State.REFUSED})
#: No transition leaves these (but to CLOSED).
TERMINAL = frozenset({State.REPLACED, State.REFUSED, State.CLOSED})


@dataclass(frozen=True)
class Snapshot:
    """One consistent view: read it once, decide on it."""

    state: State = State.UNREGISTERED
    session: str | None = None
    reason: str = ""
    error: Exception | None = None  # what a REPLACED or REFUSED node raises

    @property
    def out(self) -> bool:
        return self.state in OUT

    @property
    def confirmed(self) -> bool:
        return self.state in CONFIRMED


class Liveness:
    """See the module docstring. Thread-safe; reads are lock-free (an immutable snapshot)."""

    def __init__(self, on_lost: Callable[[str], None] | None = None) -> None:
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._now = Snapshot()

    def __repr__(self) -> str:
        now = self._now
        return f"Liveness({now.state.value}, session={now.session!r})"

    # ------------------------------------------------------------------ reads

    @property
    def now(self) -> Snapshot:
        return self._now

    @property
    def state(self) -> State:
        return self._now.state

    @property
    def session(self) -> str | None:
        return self._now.session

    @property
    def out(self) -> bool:
        return self._now.out

    @property
    def confirmed(self) -> bool:
        return self._now.confirmed

    @property
    def reason(self) -> str:
        return self._now.reason

    @property
    def error(self) -> Exception | None:
        return self._now.error

    # ------------------------------------------------------------------ transitions

    def held(self, session: str) -> bool:
        """A new session bound to the passing check: HELD. Refused (False) in a terminal
        state: the caller raises :attr:`error` (or stops, if CLOSED)."""
        with self._lock:
            if self._now.state in TERMINAL:
                return False
            self._now = Snapshot(State.HELD, session)
            return True

    def suspect(self, reason: str) -> bool:
        """HELD -> SUSPECTED (this node's own evidence). True if it changed the state."""
        with self._lock:
            if self._now.state is not State.HELD:
                return False
            self._now = Snapshot(State.SUSPECTED, self._now.session, reason)
            return True

    def clear(self, session: str) -> bool:
        """SUSPECTED -> HELD: Consul says ``session``, still the current one, is alive."""
        with self._lock:
            if self._now.state is not State.SUSPECTED or self._now.session != session:
                return False
            self._now = Snapshot(State.HELD, session)
            return True

    def lose(self, reason: str, *, session: str | None = None) -> bool:
        """HELD or SUSPECTED -> LOST (Consul's word); with ``session``, only while that is
        still the current session (a late answer about an old one changes nothing). Calls
        ``on_lost`` once. True if it changed the state."""
        with self._lock:
            now = self._now
            if now.state not in (State.HELD, State.SUSPECTED) or (
                    session is not None and now.session != session):
                return False
            self._now = Snapshot(State.LOST, now.session, reason)
        self._lost(reason)
        return True

    def replaced(self, reason: str, error: Exception) -> bool:
        """A newer process took the node id over: REPLACED, for good."""
        return self._terminal(State.REPLACED, reason, error)

    def refuse(self, error: Exception) -> bool:
        """The endpoint reaches several agents: REFUSED, for good."""
        return self._terminal(State.REFUSED, str(error), error)

    def close(self, *, forget_session: bool = True) -> None:
        """Left (the session is forgotten: it is destroyed) or halted (``forget_session`` False:
        the session stays, as a killed process leaves it): CLOSED, for good."""
        with self._lock:
            now = self._now
            self._now = Snapshot(State.CLOSED, None if forget_session else now.session,
                                 now.reason, now.error)

    def _terminal(self, state: State, reason: str, error: Exception) -> bool:
        with self._lock:
            before = self._now.state
            if before in TERMINAL:
                return False
            self._now = Snapshot(state, self._now.session, reason, error)
        if before in (State.HELD, State.SUSPECTED):
            self._lost(reason)
        return True

    def _lost(self, reason: str) -> None:
        if self._on_lost is not None:
            self._on_lost(reason)
