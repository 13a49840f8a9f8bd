"""The torch adapter: ``torchrun --rdzv-backend consul``. The only module that imports torch.

torch loads ``handler_factory`` through the ``torchrun.handlers`` entry point, calls it with no
arguments and registers what it returns as the creator of ``consul`` handlers.

Trainer store: every node reserves a listening socket before it joins a round and advertises it
in its member value. The sealed round names rank 0's endpoint; rank 0 starts a fresh TCPStore
server on that very socket (``master_listen_fd``), everyone else closes its reservation and
connects as a client. So every member of a round gets the same, live endpoint, without an extra
Consul round trip, whichever node becomes rank 0 — and no endpoint is ever reused across rounds.

``shutdown()`` closes the run, as torch's own c10d handler does: torch's launcher calls it only
when this agent is finished for good (success after the exit barrier, or failure after
``--max-restarts``), never when the agent is stopped by a signal. It then leaves cleanly.
If this node's last ``next_rendezvous()`` failed because Consul was unreachable or refused it,
the close and the leave get at most ``SHUTDOWN_AFTER_CONSUL_FAILURE`` seconds together instead of
``close_timeout`` each: the launcher is already failing, and riding out the same outage again
would only delay torchrun's exit (by 30 s or more with the defaults).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from . import errors
from .client import ConsulClient
from .config import ConsulConfig
from .rendezvous import ConsulRendezvous, RoundResult
from .settings import settings_from_conf

logger = logging.getLogger(__name__)

BACKEND = "consul"
#: Retry budget of the registration attempted when the handler is created.
EAGER_REGISTER_TIMEOUT = 1.0
#: How long a node waits to connect to rank 0's trainer store before it gives up on the round
#: (rank 0 died between the seal and its store) and joins the next one.
STORE_CONNECT_TIMEOUT = 60.0
#: How long ``shutdown()`` may take (close, then leave) after Consul failed this node.
SHUTDOWN_AFTER_CONSUL_FAILURE = 3.0

_ERRORS: tuple[tuple[type[Exception], type[Exception]], ...] = (
    (errors.RendezvousClosedError, torch_api.RendezvousClosedError),
    (errors.RendezvousTimeoutError, torch_api.RendezvousTimeoutError),
    (errors.RendezvousConnectionError, torch_api.RendezvousConnectionError),
    (errors.RendezvousStateError, torch_api.RendezvousStateError),
    (errors.ConsulError, torch_api.RendezvousConnectionError),
)


class _StoreUnreachable(Exception):
    """Rank 0's trainer store of the round could not be reached."""


def _to_torch(exc: Exception) -> Exception:
    for ours, theirs in _ERRORS:
        if isinstance(exc, ours):
            return theirs(str(exc))
    return exc


class ConsulRendezvousInfo(RendezvousInfo):
    """A ``RendezvousInfo`` that also unpacks as ``store, rank, world_size`` (old tutorials)."""

    def __init__(self, store: Store, rank: int, world_size: int,
                 bootstrap_store_info: RendezvousStoreInfo, result: RoundResult) -> None:
        super().__init__(store, rank, world_size, bootstrap_store_info)
        self.result = result

    def _as_tuple(self) -> tuple:
        return (self.store, self.rank, self.world_size)

    def __iter__(self):
        return iter(self._as_tuple())

    def __getitem__(self, index):
        return self._as_tuple()[index]

    def __len__(self) -> int:
        return 3


class _StoreEndpoint:
    """A listening socket reserved for the trainer store this node would host as rank 0."""

    def __init__(self, advertise: str, bind: str) -> None:
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, 0))
        self.sock.listen(2048)
        self.host = advertise
        self.port = self.sock.getsockname()[1]

    def as_dict(self) -> dict:
        return {"host": self.host, "port": self.port}

    def detach(self) -> int:
        return self.sock.detach()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class ConsulRendezvousHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` on top of :class:`ConsulRendezvous`."""

    def __init__(self, rdzv: ConsulRendezvous, *, local_addr: str | None = None,
                 store_timeout: float | None = None) -> None:
        self._rdzv = rdzv
        self._local_addr = local_addr
        self._bind_addr = local_addr or ""
        self._advertise = local_addr or socket.getfqdn()
        self._store_timeout = datetime.timedelta(
            seconds=store_timeout or rdzv.settings.join_timeout)
        self._reserved: _StoreEndpoint | None = None
        self._server: TCPStore | None = None
        self._consul_failure: Exception | None = None
        rdzv._endpoint_provider = self._reserve_endpoint

    @property
    def rendezvous(self) -> ConsulRendezvous:
        return self._rdzv

    def _reserve_endpoint(self) -> dict:
        if self._reserved is not None:
            self._reserved.close()
        self._reserved = _StoreEndpoint(self._advertise, self._bind_addr)
        return self._reserved.as_dict()

    def get_backend(self) -> str:
        """See base class."""
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """See base class."""
        return True

    def next_rendezvous(self) -> ConsulRendezvousInfo:
        """See base class."""
        self._server = None  # the previous round's store server goes away with its round
        deadline = time.monotonic() + self._rdzv.settings.join_timeout
        while True:
            result = self._next_round()
            try:
                return self._connect(result, deadline)
            except _StoreUnreachable as exc:
                if time.monotonic() >= deadline:
                    raise torch_api.RendezvousConnectionError(str(exc)) from exc
                logger.warning("%s; joining the next round instead.", exc)

    def _next_round(self) -> RoundResult:
        try:
            result = self._rdzv.next_round()
        except Exception as exc:
            self._release_reservation()
            if isinstance(exc, errors.RendezvousConnectionError | errors.ConsulError):
                self._consul_failure = exc
            raise _to_torch(exc) from exc
        self._consul_failure = None
        return result

    def _connect(self, result: RoundResult, deadline: float) -> ConsulRendezvousInfo:
        endpoint = result.store
        if not endpoint or "host" not in endpoint or "port" not in endpoint:
            self._release_reservation()
            raise torch_api.RendezvousStateError(
                f"Round {result.round} of run {result.run_id} names no trainer store endpoint "
                f"for rank 0 ({result.participants[0]}); is every node running consul-rdzv's "
                "torch handler?"
            )
        host, port = str(endpoint["host"]), int(endpoint["port"])
        if result.rank == 0:
            fd = self._reserved.detach() if self._reserved else -1
            self._reserved = None
            if fd < 0:
                raise torch_api.RendezvousStateError(
                    "This node is rank 0 but holds no reserved trainer-store socket."
                )
            try:
                tcp = TCPStore(host, port, None, True, self._store_timeout,
                               wait_for_workers=False, master_listen_fd=fd)
            except (RuntimeError, OSError) as exc:
                raise torch_api.RendezvousConnectionError(
                    f"Node {self._rdzv.node_id} could not start the trainer store of round "
                    f"{result.round} at {host}:{port}: {exc}"
                ) from exc
            self._server = tcp
        else:
            self._release_reservation()
            connect = max(1.0, min(STORE_CONNECT_TIMEOUT, deadline - time.monotonic()))
            try:
                tcp = TCPStore(host, port, None, False, datetime.timedelta(seconds=connect))
            except (RuntimeError, OSError) as exc:
                raise _StoreUnreachable(
                    f"Node {self._rdzv.node_id} could not reach the trainer store of round "
                    f"{result.round} of run {result.run_id} at {host}:{port} (rank 0 is "
                    f"{result.participants[0]}) within {connect:g}s: {exc}"
                ) from exc
            tcp.set_timeout(self._store_timeout)
        store = PrefixStore(f"torchelastic/{result.run_id}/{result.round}", tcp)
        return ConsulRendezvousInfo(store, result.rank, result.world_size,
                                    RendezvousStoreInfo(host, port), result)

    def _release_reservation(self) -> None:
        reserved, self._reserved = self._reserved, None
        if reserved is not None:
            reserved.close()

    def is_closed(self) -> bool:
        """See base class."""
        try:
            return self._rdzv.is_closed()
        except Exception as exc:
            raise _to_torch(exc) from exc

    def set_closed(self) -> None:
        """See base class."""
        try:
            self._rdzv.close("set_closed() called by the torch agent")
        except Exception as exc:
            raise _to_torch(exc) from exc

    def num_nodes_waiting(self) -> int:
        """See base class."""
        return self._rdzv.num_nodes_waiting()

    def get_run_id(self) -> str:
        """See base class."""
        return self._rdzv.run_id

    def shutdown(self) -> bool:
        """See base class (and the module docstring: closes the run, then leaves)."""
        if self._consul_failure is None:
            return self._close_and_leave()
        rdzv = self._rdzv
        budget = min(rdzv.settings.close_timeout, SHUTDOWN_AFTER_CONSUL_FAILURE)
        logger.warning("Node %s shuts down after a Consul failure; closing run %s and leaving "
                       "get at most %gs.", rdzv.node_id, rdzv.run_id, budget)
        # Retries stop by themselves within the budget; the thread also bounds requests that
        # hang (a frozen Consul answers no request before the client's read timeout).
        rdzv.settings = rdzv.settings.with_(close_timeout=budget / 2)
        outcome: list[bool] = []
        worker = threading.Thread(target=lambda: outcome.append(self._close_and_leave()),
                                  name=f"consul-rdzv-shutdown-{rdzv.node_id}", daemon=True)
        worker.start()
        worker.join(budget)
        if worker.is_alive():
            logger.warning("Node %s gave up closing run %s and leaving after %gs: Consul does not "
                           "answer.", rdzv.node_id, rdzv.run_id, budget)
            self._release_reservation()
            self._server = None
            return False
        return outcome[0]

    def _close_and_leave(self) -> bool:
        ok = True
        try:
            self._rdzv.close("shutdown() by the torch launcher")
        except errors.RendezvousError as exc:
            logger.warning("Node %s could not close run %s at shutdown: %s",
                           self._rdzv.node_id, self._rdzv.run_id, exc)
            ok = False
        ok = self._rdzv.leave() and ok
        self._release_reservation()
        self._server = None
        return ok


def _consul_config(endpoint: str, conf: dict) -> ConsulConfig:
    ssl = conf.get("ssl")
    use_ssl = None
    if ssl not in (None, ""):
        use_ssl = str(ssl).strip().lower() in ("1", "true", "yes", "on", "t", "y")
    return ConsulConfig.resolve(
        address=endpoint or None,
        token_file=conf.get("token_file") or None,
        datacenter=conf.get("datacenter") or None,
        use_ssl=use_ssl,
        ca_file=conf.get("ca_file") or None,
        ca_path=conf.get("ca_path") or None,
        client_cert=conf.get("client_cert") or None,
        client_key=conf.get("client_key") or None,
        tls_server_name=conf.get("tls_server_name") or None,
    )


def create_handler(params: RendezvousParameters) -> ConsulRendezvousHandler:
    """Build a handler from torchrun's parameters. Bad values raise ValueError naming the key."""
    conf = {k: v for k, v in params.config.items()}
    settings = settings_from_conf(params.run_id, params.min_nodes, params.max_nodes, conf)
    config = _consul_config((params.endpoint or "").strip(), conf)
    client = ConsulClient(config, retry_timeout=settings.consul_timeout)
    local_addr = params.local_addr or conf.get("local_addr") or None
    rdzv = ConsulRendezvous(settings, client, node_id=conf.get("node_id") or None)
    try:
        # torchrun creates the handler when the agent starts: show up in Consul right away.
        # Best effort and short: next_rendezvous() registers (and reports errors) otherwise.
        rdzv.register(timeout=EAGER_REGISTER_TIMEOUT)
    except errors.RendezvousError as exc:
        logger.debug("Node %s could not register at handler creation (%s); next_rendezvous() "
                     "will.", rdzv.node_id, exc)
    logger.info("Created consul rendezvous handler for run %s (node %s, Consul %s).",
                settings.run_id, rdzv.node_id, config.url)
    return ConsulRendezvousHandler(rdzv, local_addr=local_addr)


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it with no arguments."""
    return create_handler
