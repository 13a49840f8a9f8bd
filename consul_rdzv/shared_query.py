"""One blocking query per process, shared by the nodes that watch the same thing.

Nodes of one process (torchrun runs one, a benchmark or a test many) that watch the same Consul
object through the same agent with the same token share one query: one daemon thread, one
connection, one answer handed to each of them. :class:`SharedQuery` holds that sharing: a
registry per subclass, keyed by what makes two watches the same; :meth:`SharedQuery.attach`
adds a watcher (starting the query for the first one, handing a later one the last answer at
once), :meth:`SharedQuery.leave` removes one, and the last to leave stops the query after its
current request. Subclasses write the loop (:meth:`_loop`) and what a late watcher is given
(:meth:`_snapshot`, :meth:`_catch_up`). Used by :mod:`.health` and :mod:`.quarantine`.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from .client import ConsulClient


class SharedQuery:
    #: Each subclass defines its own (the registry of its running queries).
    _registry: ClassVar[dict[tuple, SharedQuery]]
    _registry_lock: ClassVar[threading.Lock]
    thread_name: ClassVar[str] = "consul-rdzv-query"

    def __init__(self, key: tuple, client: ConsulClient) -> None:
        self.key = key
        # a connection of its own: a blocking query holds it for up to its wait
        self.client = ConsulClient(client.config, retry_timeout=client.retry_timeout)
        self._members: list[Any] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=self.thread_name)

    @classmethod
    def attach(cls, key: tuple, member: Any, make: Any) -> Any:
        """The running query of ``key`` with ``member`` added (``make()`` builds and starts a
        new one if there is none); a later member gets the last answer at once."""
        with cls._registry_lock:
            query = cls._registry.get(key)
            if query is None or query._stopped.is_set():
                query = make()
                cls._registry[key] = query
                query._members.append(member)
                query._thread.start()
                return query
            query._members.append(member)
            snapshot = query._snapshot()
        query._catch_up(member, snapshot)
        return query

    def leave(self, member: Any) -> None:
        with self._registry_lock:
            if member in self._members:
                self._members.remove(member)
            if not self._members:
                self._stopped.set()
                if self._registry.get(self.key) is self:
                    del self._registry[self.key]

    def members_now(self) -> list[Any]:
        with self._registry_lock:
            return list(self._members)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.client.close()

    def _loop(self) -> None:  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def _snapshot(self) -> Any:
        """What a watcher that attaches now is given (called under the registry lock)."""
        raise NotImplementedError  # pragma: no cover

    def _catch_up(self, member: Any, snapshot: Any) -> None:
        """Give a watcher that attached to a running query the last answer (no lock held)."""
        raise NotImplementedError  # pragma: no cover
