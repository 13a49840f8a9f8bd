"""The check-pass loop of one node: a daemon thread that does one thing.

``PUT /v1/agent/check/pass/<check>`` every ``keep_alive_interval``, one attempt each, bounded by
that interval; nothing else ever runs on this thread, so a slow Consul server (a leader
election, an overloaded cluster) delays session renewals and KV calls, never a check pass. A
pass is answered by the local agent alone.

It reports two things to its owner (:class:`consul_rdzv.registration.Registration`), from this
thread: a pass refused with 404 (the check is gone from the agent: a restart, an operator, a
newer process with the node id, or an endpoint that reaches another agent), and a silence
longer than the TTL (no pass succeeded for ``heartbeat_timeout``: Consul has declared, or is
about to declare, the node dead).

Fields shared with other threads: ``last_pass`` and ``max_gap`` (floats, written here and by
the owner when it registers the check passing, read anywhere; a float store is atomic) and the
stop event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .client import ConsulClient
from .errors import ConsulError, ConsulNotFound
from .service import heartbeat_note
from .settings import RendezvousSettings

logger = logging.getLogger(__name__)


class Heartbeat:
    """See the module docstring. ``note()`` is the check's output before the pass time;
    ``on_refused(exc)`` and ``on_silent(seconds)`` are called from the pass thread."""

    def __init__(self, client: ConsulClient, settings: RendezvousSettings, *, check_id: str,
                 node_id: str, note: Callable[[], str],
                 on_refused: Callable[[ConsulNotFound], None],
                 on_silent: Callable[[float], None]) -> None:
        self.client = client
        self.settings = settings
        self.check_id = check_id
        self.node_id = node_id
        self._note = note
        self._on_refused = on_refused
        self._on_silent = on_silent
        #: Monotonic time of the last successful pass (or of a registration, which registers
        #: the check passing).
        self.last_pass = 0.0
        #: Longest time between two successful passes since reset(): a loss of the
        #: registration that this cannot explain (shorter than the TTL) is looked into.
        self.max_gap = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Called after each pass with its duration and whether it succeeded (the node's
        #: metrics, when on), from this thread.
        self.observer: Callable[[float, bool], None] | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def seconds_since_pass(self) -> float:
        """Seconds since the check was last passed (a pass resets Consul's TTL timer)."""
        return time.monotonic() - self.last_pass

    @property
    def kept_up(self) -> bool:
        """Every pass since :meth:`reset` came well within the TTL: a loss of the registration
        is then not explained by this node's own heartbeat."""
        ttl = self.settings.heartbeat_timeout
        return self.max_gap < ttl and self.seconds_since_pass < ttl

    def passed_now(self) -> None:
        """The check was just registered passing."""
        self.last_pass = time.monotonic()

    def reset(self) -> None:
        """A new session: gaps are counted from now."""
        self.last_pass = time.monotonic()
        self.max_gap = 0.0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"consul-rdzv-pass-{self.node_id}")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        interval = self.settings.heartbeat_interval
        ttl = self.settings.heartbeat_timeout
        # The first pass goes out at once: through an endpoint that reaches several agents it is
        # the request most likely to land on one that does not hold the check (a 404 that the
        # registration looks into before the node announces itself).
        next_beat = time.monotonic()
        failures = 0
        while not self._stop.wait(max(0.0, next_beat - time.monotonic())):
            started = time.monotonic()
            next_beat = started + interval
            try:
                # deadline=now: a single attempt; the next beat is the retry.
                self.client.agent_check_update(self.check_id, "pass",
                                               note=heartbeat_note(self._note()),
                                               deadline=started, timeout=interval)
                self.max_gap = max(self.max_gap, started - self.last_pass)
                self.last_pass = started
                failures = 0
                if self.observer is not None:
                    self.observer(time.monotonic() - started, True)
                continue
            except ConsulNotFound as exc:
                self._observe_failure(started)
                self._on_refused(exc)
            except ConsulError as exc:
                self._observe_failure(started)
                failures += 1
                if failures == 1 or failures % 10 == 0:
                    logger.warning("Heartbeat of node %s failed %d time(s): %s", self.node_id,
                                   failures, exc)
            silent = time.monotonic() - self.last_pass
            if silent > ttl:
                self._on_silent(silent)

    def _observe_failure(self, started: float) -> None:
        if self.observer is not None:
            self.observer(time.monotonic() - started, False)
