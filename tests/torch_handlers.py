"""torchrun's rendezvous handlers, built as torchrun builds them, for the tests (the
``make_handler`` fixture of tests/conftest.py).

torch's registry, which found ``consul`` through the ``torchrun.handlers`` entry point, turns a
``RendezvousParameters`` (string conf values, as ``--rdzv-conf`` gives them) into a handler.
This module imports torch: only tests that build handlers import it (through the fixture).
"""

from __future__ import annotations

import threading

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from consul_rdzv.torch import ConsulRendezvousHandler

#: Short timeouts for tests, as strings: that is what torchrun's --rdzv-conf parser produces.
FAST = {"heartbeat_timeout": "2", "last_call_timeout": "1", "join_timeout": "30",
        "close_timeout": "5", "consul_timeout": "5"}


def make_params(endpoint: str, run_id: str, prefix: str | None = None, *, min_nodes: int = 1,
                max_nodes: int = 1, fast: bool = True, **conf) -> RendezvousParameters:
    """torchrun's parameters: ``--rdzv-endpoint``, ``--rdzv-id``, ``--nnodes`` and
    ``--rdzv-conf`` (:data:`FAST` unless ``fast=False``, then ``conf``). A ``prefix`` of None,
    or a conf value of None, leaves that key out (the default key prefix)."""
    values = {**(FAST if fast else {}), "key_prefix": prefix, **conf}
    return RendezvousParameters(
        backend="consul", endpoint=endpoint, run_id=run_id, min_nodes=min_nodes,
        max_nodes=max_nodes, local_addr="127.0.0.1",
        **{k: v for k, v in values.items() if v is not None},
    )


class HandlerFactory:
    """``make_handler(endpoint, run_id, prefix, **kwargs)``: a handler through torch's registry
    (the arguments of :func:`make_params`); every handler made leaves (never closes) at
    :meth:`leave_all`, in parallel and within seconds, since a test may have stopped Consul
    under its nodes. A handler's Consul token is the environment's, as torchrun's nodes get
    it (``monkeypatch.setenv("CONSUL_HTTP_TOKEN", ...)`` before making it)."""

    def __init__(self) -> None:
        self.made: list[ConsulRendezvousHandler] = []

    def __call__(self, *args, **kwargs) -> ConsulRendezvousHandler:
        handler = get_rendezvous_handler(make_params(*args, **kwargs))
        assert type(handler) is ConsulRendezvousHandler, type(handler)
        self.made.append(handler)
        return handler

    def leave_all(self, timeout: float = 3.0) -> None:
        threads = [threading.Thread(target=h.rendezvous.leave, kwargs={"timeout": timeout},
                                    daemon=True) for h in self.made]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout + 7)
