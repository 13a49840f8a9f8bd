"""A node's standing in the round it trains in: how many nodes wait, whether the round is over
and why, whether the job finished. One lock; no I/O but what the registration does.

Fed by the round's :class:`consul_rdzv.watch.RoundWatch` (this object is its ``WatchHost``) and
by the registration's losses; read by ``num_nodes_waiting()`` (torchrun's monitor loop, every
0.1 s) and by the torch adapter's meeting at the trainer store (``wait_broken``). The caller's
thread starts and ends rounds (:meth:`begin`, :meth:`watch`, :meth:`end`).

Fields (all under ``_lock``, except the events, which are thread-safe themselves): ``_watch``
(the current round's watch: answers of any other are ignored), ``_waiting``, ``_finished`` (the
closed marker of a run that finished in this round), ``_broken_reason`` with the ``_broken``
event, ``_listeners`` (events set when the round breaks).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from .watch import RoundWatch

if TYPE_CHECKING:
    from .registration import Registration

logger = logging.getLogger(__name__)


class Standing:
    """See the module docstring."""

    def __init__(self, registration: Registration) -> None:
        self.registration = registration
        self.node_id = registration.node_id
        self.run_id = registration.settings.run_id
        self._lock = threading.Lock()
        self._watch: RoundWatch | None = None
        self._waiting = 0
        self._finished: dict | None = None
        self._broken = threading.Event()
        self._broken_reason = ""
        self._listeners: set[threading.Event] = set()

    # ------------------------------------------------------------------ the caller's thread

    def begin(self) -> None:
        """A new ``next_round()``: the previous round's watch ends; nothing waits, nothing is
        broken, the job has not finished."""
        with self._lock:
            self._stop_watch()
            self._waiting = 0
            self._finished = None
            self._broken.clear()

    def joined(self) -> None:
        """The join returned: a loss repaired during it does not break the new round."""
        with self._lock:
            self._broken.clear()

    def watch(self, watch: RoundWatch) -> None:
        """Watch the round just joined with ``watch`` (started here)."""
        with self._lock:
            self._stop_watch()
            self._watch = watch.start()

    def end(self) -> None:
        """The node left or halted: the watch ends after its current query."""
        with self._lock:
            self._stop_watch()

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    # ------------------------------------------------------------------ reads

    @property
    def current_watch(self) -> RoundWatch | None:
        return self._watch

    @property
    def finished(self) -> dict | None:
        """The closed marker, if the run was closed as finished in this round."""
        return self._finished

    @property
    def broken_reason(self) -> str:
        return self._broken_reason

    @property
    def broken(self) -> bool:
        """The current round cannot run any more (:attr:`broken_reason` says why)."""
        return self._broken.is_set()

    def waiting(self) -> int:
        """``num_nodes_waiting()``: 0 for good once the job finished in this round; at least 1
        while this node is out of its round (lost, suspected, replaced, refused)."""
        if self._finished is not None:
            return 0
        if self.registration.lost:
            return max(self._waiting, 1)
        return self._waiting

    def wait_broken(self, timeout: float) -> str | None:
        if self._broken.wait(timeout):
            return self._broken_reason
        return None

    def wait_broken_or(self, event: threading.Event, timeout: float) -> str | None:
        with self._lock:
            self._listeners.add(event)
        try:
            if not self._broken.is_set():
                event.wait(timeout)
            return self._broken_reason if self._broken.is_set() else None
        finally:
            with self._lock:
                self._listeners.discard(event)

    def set_broken(self, reason: str) -> None:
        """The round cannot run any more (once: the first reason stays)."""
        if not self._broken.is_set():
            self._broken_reason = reason
            self._broken.set()
            for event in list(self._listeners):
                event.set()

    # ------------------------------------------------------------------ the watch's reports

    def watch_counted(self, watch: RoundWatch, waiting: int) -> None:
        with self._lock:
            if watch is not self._watch or waiting == self._waiting:
                return
            self._waiting = waiting
            logger.info("Node %s sees %d node(s) waiting to join run %s (round %d).",
                        self.node_id, waiting, self.run_id, watch.watched.round)

    def watch_over(self, watch: RoundWatch, reason: str, own_key: bool, waiting: int) -> None:
        with self._lock:
            if watch is not self._watch:
                return
            self._watch = None
            if not own_key:
                self.registration.mark_lost("its member key was deleted (session invalidated)")
            logger.info("Round %d of run %s is over for node %s (%s).", watch.watched.round,
                        self.run_id, self.node_id, reason)
            # Broken first, then the count: whoever sees num_nodes_waiting() >= 1 (torchrun,
            # then next_rendezvous() on its thread) must also see why (restart_cause).
            self.set_broken(f"round {watch.watched.round} is over ({reason})")
            self._waiting = max(self._waiting, waiting, 1)
            # nobody watches our key any more
            self.registration.probe_session_from(
                time.monotonic() + self.registration.settings.heartbeat_interval)

    def watch_finished(self, watch: RoundWatch, closed: dict) -> None:
        with self._lock:
            if watch is not self._watch:
                return
            self._watch = None
            self._finished = dict(closed)
            self._waiting = 0
        self.registration.watch_gossip(False)
        logger.info("Run %s finished in round %d (%s, closed by %s): node %s lets its workers "
                    "finish their work.", self.run_id, watch.watched.round,
                    closed.get("reason", ""), closed.get("by", "?"), self.node_id)
