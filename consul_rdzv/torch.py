"""The torch adapter: ``torchrun --rdzv-backend consul``. The only module that imports torch.

torch loads ``handler_factory`` through the ``torchrun.handlers`` entry point, calls it with no
arguments and registers what it returns as the creator of ``consul`` handlers.

**Trainer store.** Every node reserves a listening socket before it joins a round and advertises
it in its member value. The sealed round names rank 0's endpoint; rank 0 starts a fresh TCPStore
server on that very socket (``master_listen_fd``), everyone else closes its reservation and
connects as a client. Then every member **checks in** at that store and waits until all have:
while it connects and waits, a member that is gone (its key vanished: dead within the check TTL)
or that asks for a new round sends everyone to the next round at once, and ``read_timeout``
bounds the whole meeting. So ``next_rendezvous()`` returns only when every member of the round
reached the same live store, and torch's own rank assignment on it cannot hang on a dead peer.

**Ending.** torch's launcher (torch 2.13 ``launch_agent``) calls ``shutdown()`` from its
``finally`` whenever the agent did not die of a ``SignalException``: after success, after a
failure past ``--max-restarts``, but also after a rendezvous error or a Ctrl-C before the
workers first started (a plain ``KeyboardInterrupt``). ``shutdown()`` therefore closes the run
only when the job ended for good *and* this node is a member of the run's current round: no
exception (workers succeeded) or ``ChildFailedError`` (workers failed past ``--max-restarts``).
In every other case (Ctrl-C, a rendezvous timeout of a spare node, any error) it only leaves.
A node stopped by a signal leaves too: before the workers start, SIGTERM (and the other signals
torch handles, where their disposition is the default) raises torch's ``SignalException``
instead of killing the process outright, and an ``atexit`` hook leaves (bounded) whenever the
agent exits without ``shutdown()``: survivors restart at once instead of after the check TTL.
"""

from __future__ import annotations


def handler_factory():
    """The ``torchrun.handlers`` entry point: torch calls it with no arguments.

    Defined before torch is imported: importing torch's rendezvous package loads its registry,
    which loads this entry point, so ``import consul_rdzv.torch`` before torch's registry finds
    this function already defined (and the handler creator resolved when first called).
    """
    return _create_handler


def _create_handler(params):
    return create_handler(params)


import atexit
import contextlib
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import cast

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
from .config import ConsulConfig, round_env
from .rendezvous import (
    OUTCOME_CLOSED,
    OUTCOME_FAILED,
    OUTCOME_FINISHED,
    ConsulRendezvous,
    RoundResult,
)
from .service import DEFAULT_KEY_PREFIX
from .settings import RendezvousSettings, conf_bool, settings_from_conf

logger = logging.getLogger(__name__)

BACKEND = "consul"
#: Retry budget of the registration attempted when the handler is created.
EAGER_REGISTER_TIMEOUT = 1.0
#: How long ``shutdown()`` may take (close, then leave) after Consul failed this node.
SHUTDOWN_AFTER_CONSUL_FAILURE = 3.0
#: How long the leave of an agent that exits without ``shutdown()`` (a signal) may take.
LEAVE_AT_EXIT = 3.0
#: The prefix of a round's keys in its trainer store: ``torchelastic/<run_id>/<round>`` (whatever
#: the key_prefix setting, which names the Consul KV prefix).
STORE_PREFIX = DEFAULT_KEY_PREFIX
#: Keys of the check-in under the round's store prefix: ``<CHECKIN>/<rank>`` per member (its
#: node id), and ``CHECKIN_DONE``, set by rank 0 once every member's key is there.
CHECKIN = "consul-rdzv/checkin"
CHECKIN_DONE = f"{CHECKIN}/done"

_ERRORS: tuple[tuple[type[Exception], type[Exception]], ...] = (
    (errors.RendezvousClosedError, torch_api.RendezvousClosedError),
    (errors.RendezvousTimeoutError, torch_api.RendezvousTimeoutError),
    (errors.RendezvousConnectionError, torch_api.RendezvousConnectionError),
    (errors.RendezvousStateError, torch_api.RendezvousStateError),
    (errors.ConsulError, torch_api.RendezvousConnectionError),
)


class _RoundAbandoned(Exception):
    """A member of the round is gone or asks for a new round: meet in the next one."""


class _StoreUnreachable(Exception):
    """The connection to rank 0's store failed (the cause is ``args[0]``)."""


def _to_torch(exc: Exception) -> Exception:
    for ours, theirs in _ERRORS:
        if isinstance(exc, ours):
            return theirs(str(exc))
    return exc


def _interrupted(exc: BaseException | None) -> bool:
    """Ctrl-C, exit or a signal: the agent is being stopped, its job has not ended."""
    # Imported here: torch's agent modules load the rendezvous registry, which imports us.
    from torch.distributed.elastic.multiprocessing import SignalException

    return isinstance(exc, SignalException) or (
        exc is not None and not isinstance(exc, Exception))


def _failed_for_good(exc: BaseException | None) -> bool:
    """torch's launcher raises ChildFailedError when the workers failed past --max-restarts."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    return isinstance(exc, ChildFailedError)


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
    """A listening socket reserved for the trainer store this node would host as rank 0.

    ``ports`` (``store_port``): the first free port of that range, in order; None: a port the
    kernel chooses from its ephemeral range.
    """

    def __init__(self, advertise: str, bind: str, ports: tuple[int, int] | None = None, *,
                 node_id: str = "") -> None:
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        candidates = [0] if ports is None else range(ports[0], ports[1] + 1)
        last: OSError | None = None
        for port in candidates:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((bind, port))
                sock.listen(2048)
            except OSError as exc:
                sock.close()
                if ports is None:
                    raise
                last = exc
                continue
            self.sock = sock
            break
        else:
            assert ports is not None
            span = f"{ports[0]}" if ports[0] == ports[1] else f"{ports[0]}-{ports[1]}"
            count = ports[1] - ports[0] + 1
            raise errors.RendezvousStateError(
                f"Node {node_id} found no free port for its trainer store in store_port={span} "
                f"on {bind or 'all interfaces'}: all {count} are in use ({last}). A torchrun "
                "agent holds one port of the range while it joins a round, and rank 0 one more "
                "while the previous round's store is still open (torchrun keeps it until the "
                "next round forms): give the range at least two ports per torchrun agent on "
                "this host, clear of other programs (e.g. store_port=29400-29415 for eight)."
            )
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

    def __init__(self, settings: RendezvousSettings, client: ConsulClient, *,
                 node_id: str | None = None, local_addr: str | None = None,
                 use_libuv: bool | None = None, token_file: str | None = None) -> None:
        #: Handed to the workers (its path, never the token), for consul_rdzv.still_current().
        self._token_file = token_file
        self._bind_addr = local_addr or ""
        #: The trainer store's backend (torch's default when None).
        self._store_kwargs = {} if use_libuv is None else {"use_libuv": use_libuv}
        self._advertise = local_addr or socket.getfqdn()
        self._rdzv = ConsulRendezvous(settings, client, node_id=node_id,
                                      address=self._advertise,
                                      endpoint_provider=self._reserve_endpoint)
        self._reserved: _StoreEndpoint | None = None
        self._server: TCPStore | None = None
        self._consul_failure: Exception | None = None
        self._in_round: RoundResult | None = None  # set while this node is in a live round
        self._interrupted = False
        _LIVE.add(self)

    @property
    def rendezvous(self) -> ConsulRendezvous:
        return self._rdzv

    def _reserve_endpoint(self) -> dict:
        if self._reserved is not None:
            self._reserved.close()
        self._reserved = None
        self._reserved = _StoreEndpoint(self._advertise, self._bind_addr,
                                        self._rdzv.settings.store_port,
                                        node_id=self._rdzv.node_id)
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
        metrics = self._rdzv.metrics
        # The node's rendezvous duration runs from this call to its return (the meeting at
        # the trainer store included), however many rounds it takes.
        with metrics.rendezvous() if metrics is not None else contextlib.nullcontext():
            return self._next_rendezvous()

    def _next_rendezvous(self) -> ConsulRendezvousInfo:
        self._server = None  # the previous round's store server goes away with its round
        self._in_round = None
        _leave_on_signals()
        settings = self._rdzv.settings
        deadline = time.monotonic() + settings.join_timeout
        try:
            while True:
                result = self._next_round()
                try:
                    info = self._meet(result, time.monotonic() + settings.read_timeout)
                except _RoundAbandoned as exc:
                    self._server = None
                    self._rdzv.abandoned = True  # not a failure of this host (quarantine)
                    if time.monotonic() >= deadline:
                        raise torch_api.RendezvousTimeoutError(
                            f"Node {self._rdzv.node_id} of run {result.run_id} gave up after "
                            f"join_timeout ({settings.join_timeout:g}s): the members of round "
                            f"{result.round} did not all meet ({exc})."
                        ) from exc
                    logger.warning("Node %s leaves round %d of run %s before training: %s; "
                                   "joining the next round.", self._rdzv.node_id, result.round,
                                   result.run_id, exc)
                    continue
                self._in_round = result
                self._hand_to_workers(result)
                return info
        except BaseException as exc:
            self._server = None
            self._release_reservation()
            if _interrupted(exc):
                self._interrupted = True
            raise

    def _hand_to_workers(self, result: RoundResult) -> None:
        """Put the round in this agent's environment, which the workers torchrun starts next
        inherit (torch 2.13 spawns them with a copy of ``os.environ`` plus its own variables):
        ``consul_rdzv.epoch()`` and ``still_current()`` read it (:mod:`consul_rdzv.worker`)."""
        rdzv = self._rdzv
        os.environ.update(round_env(
            run_id=result.run_id, prefix=rdzv.settings.prefix, node_id=rdzv.node_id,
            round_no=result.round, epoch=result.round_index, seal_id=result.seal_id,
            config=rdzv.client.config, token_file=self._token_file))

    def _next_round(self) -> RoundResult:
        try:
            result = self._rdzv.next_round()
        except errors.RendezvousError as exc:
            if isinstance(exc, errors.RendezvousConnectionError):
                self._consul_failure = exc
            # torch prints the traceback: our message says it all, no doubled chain
            raise _to_torch(exc) from None
        self._consul_failure = None
        return result

    def _meet(self, result: RoundResult, until: float) -> ConsulRendezvousInfo:
        """Reach rank 0's trainer store and wait there until every member checked in."""
        endpoint = result.store
        if not endpoint or "host" not in endpoint or "port" not in endpoint:
            raise torch_api.RendezvousStateError(
                f"Round {result.round} of run {result.run_id} names no trainer store endpoint "
                f"for rank 0 ({result.participants[0]}); is every node running consul-rdzv's "
                "torch handler?"
            )
        host, port = str(endpoint["host"]), int(endpoint["port"])
        timeout = datetime.timedelta(seconds=self._rdzv.settings.read_timeout)
        if result.rank == 0:
            fd = self._reserved.detach() if self._reserved else -1
            self._reserved = None
            if fd < 0:
                raise torch_api.RendezvousStateError(
                    "This node is rank 0 but holds no reserved trainer-store socket."
                )
            try:
                tcp = TCPStore(host, port, None, True, timeout, wait_for_workers=False,
                               master_listen_fd=fd, **self._store_kwargs)
            except (RuntimeError, OSError) as exc:
                raise torch_api.RendezvousConnectionError(
                    f"Node {self._rdzv.node_id} could not start the trainer store of round "
                    f"{result.round} at {host}:{port}: {exc}"
                ) from exc
            self._server = tcp
        else:
            self._release_reservation()
            tcp = None
        box: dict = {}
        node_id = self._rdzv.node_id
        rank, world = result.rank, result.world_size

        def meet() -> Store:
            """In one helper thread: reach rank 0's store (one attempt with the whole budget:
            a connection burst against rank 0 can take seconds, slow reverse DNS on its side,
            a full backlog), check in, wait until every member has.

            One round trip besides the connect: a member's check-in is a ``set`` of its own
            key, which the store does not answer, then one event-driven ``wait``. Rank 0 (the
            store's host) waits for every member's key and then sets ``done``; the others
            wait for ``done``. This connection is the store handed to torch: nobody connects
            twice."""
            client = tcp
            if client is None:
                try:
                    client = TCPStore(host, port, None, False, _seconds(until),
                                      **self._store_kwargs)
                except (RuntimeError, OSError) as exc:
                    raise _StoreUnreachable(exc) from exc
                client.set_timeout(timeout)
            result.timings["store_connected"] = time.time()
            store = box["store"] = PrefixStore(
                f"{STORE_PREFIX}/{result.run_id}/{result.round}", client)
            if world > 1:
                store.set(f"{CHECKIN}/{rank}", node_id)
                if rank == 0:
                    store.wait([f"{CHECKIN}/{other}" for other in range(1, world)],
                               _seconds(until))
                    store.set(CHECKIN_DONE, "1")
                else:
                    store.wait([CHECKIN_DONE], _seconds(until))
            result.timings["met"] = time.time()
            return store

        try:
            store = cast(Store, self._unless_broken(meet, until, "meeting"))
        except (_StoreUnreachable, RuntimeError, OSError) as exc:
            error = exc.args[0] if isinstance(exc, _StoreUnreachable) else exc
            # Rank 0 refused us, or the store failed, because a member died: Consul says so
            # within the check TTL, well within the meeting's budget.
            reason = self._rdzv.wait_round_broken(max(0.0, until - time.monotonic()))
            if reason:
                raise _RoundAbandoned(reason) from error
            if isinstance(exc, _StoreUnreachable):
                raise self._unreachable(result, host, port, error) from error
            raise self._not_everyone(result, box.get("store"), error) from error
        return ConsulRendezvousInfo(store, result.rank, result.world_size,
                                    RendezvousStoreInfo(host, port), result)

    def _unreachable(self, result: RoundResult, host: str, port: int,
                     error: BaseException) -> Exception:
        rdzv = self._rdzv
        return torch_api.RendezvousConnectionError(
            f"Node {rdzv.node_id} could not reach the trainer store of round "
            f"{result.round} of run {result.run_id} at {host}:{port} (hosted by rank 0, "
            f"{result.participants[0]}) within read_timeout ({rdzv.settings.read_timeout:g}s), "
            f"although rank 0 is alive in Consul: {error}. Check that {host} resolves and that "
            "the port is reachable from this host (--local-addr of rank 0, firewalls)."
        )

    def _not_everyone(self, result: RoundResult, store: Store | None,
                      error: BaseException) -> Exception:
        rdzv = self._rdzv
        missing = ", ".join(_missing(store, result)) if store is not None else ""
        return torch_api.RendezvousTimeoutError(
            f"Node {rdzv.node_id}: not every member of round {result.round} of run "
            f"{result.run_id} reached its trainer store within read_timeout "
            f"({rdzv.settings.read_timeout:g}s); missing: {missing or 'unknown'}. They are "
            f"alive in Consul but did not check in: hung, or unable to reach rank 0's store "
            f"({error})."
        )

    def _unless_broken(self, call: Callable[[], object], until: float, what: str) -> object:
        """``call()`` (a blocking store operation bounded by ``until``) in a thread; raises
        _RoundAbandoned as soon as the round breaks (the watch wakes us: no polling). An
        abandoned call ends by its own timeout."""
        rdzv = self._rdzv
        outcome: dict = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["value"] = call()
            except BaseException as exc:  # handed to the caller's thread
                outcome["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, daemon=True,
                         name=f"consul-rdzv-store-{what}-{rdzv.node_id}").start()
        # The call ends by its own timeout at `until`; the margin only guards against a hang.
        # (A broken round sets `done` too: look at the outcome, not at the event.)
        reason = rdzv.wait_round_broken_or(done, max(0.0, until - time.monotonic()) + 5.0)
        if not outcome:
            if reason:
                raise _RoundAbandoned(reason)
            raise RuntimeError(f"the trainer store's {what} did not end by its own timeout")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    def _release_reservation(self) -> None:
        reserved, self._reserved = self._reserved, None
        if reserved is not None:
            reserved.close()

    def is_closed(self) -> bool:
        """See base class."""
        try:
            return self._rdzv.is_closed()
        except errors.RendezvousError as exc:
            # torch prints the traceback: our message says it all, no doubled chain
            raise _to_torch(exc) from None

    def set_closed(self) -> None:
        """See base class."""
        try:
            self._rdzv.close("set_closed() called by the torch agent")
        except errors.RendezvousError as exc:
            # torch prints the traceback: our message says it all, no doubled chain
            raise _to_torch(exc) from None

    def num_nodes_waiting(self) -> int:
        """See base class."""
        return self._rdzv.num_nodes_waiting()

    def get_run_id(self) -> str:
        """See base class."""
        return self._rdzv.run_id

    def shutdown(self) -> bool:
        """See base class, and the module docstring: close only when the job ended for good
        and this node is in the current round; leave in any case."""
        exc = sys.exc_info()[1]  # torch calls us from launch_agent's `finally`
        rdzv = self._rdzv
        reason = None
        outcome = OUTCOME_CLOSED
        if self._interrupted or _interrupted(exc):
            why = "it was interrupted (Ctrl-C or a signal): the job goes on without it"
        elif self._in_round is None:
            why = "it is not in a round (its last rendezvous failed or never completed)"
        elif exc is None:
            why, reason = "", "the job finished: the workers of this node succeeded"
            outcome = OUTCOME_FINISHED
        elif _failed_for_good(exc):
            why, reason = "", "the job failed: workers failed past --max-restarts"
            outcome = OUTCOME_FAILED
        else:
            why = f"its agent failed ({type(exc).__name__}), which does not end the job"
        if reason is None:
            logger.info("Node %s leaves run %s without closing it: %s.", rdzv.node_id,
                        rdzv.run_id, why)
        if self._consul_failure is None:
            return self._finish(reason, outcome, rdzv.settings.close_timeout)
        budget = min(rdzv.settings.close_timeout, SHUTDOWN_AFTER_CONSUL_FAILURE)
        logger.warning("Node %s shuts down after a Consul failure; leaving run %s gets at most "
                       "%gs.", rdzv.node_id, rdzv.run_id, budget)
        done = _bounded(lambda: self._finish(reason, outcome, budget / 2), budget,
                        f"consul-rdzv-shutdown-{rdzv.node_id}")
        if done is None:
            logger.warning("Node %s gave up leaving run %s after %gs: Consul does not answer.",
                           rdzv.node_id, rdzv.run_id, budget)
            self._release_reservation()
            self._server = None
            return False
        return done

    def _finish(self, close_reason: str | None, outcome: str, timeout: float) -> bool:
        ok = True
        if close_reason is not None and self._in_round is not None:
            try:
                self._rdzv.close_if_current(self._in_round, close_reason, outcome=outcome,
                                            timeout=timeout)
            except errors.RendezvousError as exc:
                logger.warning("Node %s could not close run %s at shutdown: %s",
                               self._rdzv.node_id, self._rdzv.run_id, exc)
                ok = False
        ok = self._rdzv.leave(timeout=timeout) and ok
        self._release_reservation()
        self._server = None
        return ok


def _seconds(until: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.1, until - time.monotonic()))


def _missing(store: Store, result: RoundResult) -> list[str]:
    missing = []
    for rank, node in enumerate(result.participants):
        with contextlib.suppress(RuntimeError, OSError):
            if not store.check([f"{CHECKIN}/{rank}"]):
                missing.append(f"rank {rank} ({node})")
    return missing


def _bounded(call: Callable[[], bool], budget: float, name: str) -> bool | None:
    """``call()`` in a daemon thread; its result, or None if it took longer than ``budget``
    (a frozen Consul answers no request before the client's read timeout)."""
    outcome: list[bool] = []
    worker = threading.Thread(target=lambda: outcome.append(call()), name=name, daemon=True)
    worker.start()
    worker.join(budget)
    return outcome[0] if outcome else None


#: Handlers whose node may still have to leave when the process exits.
_LIVE: weakref.WeakSet[ConsulRendezvousHandler] = weakref.WeakSet()


@atexit.register
def _leave_at_exit() -> None:
    """An agent that exits without ``shutdown()`` (a signal) leaves: every node of the process
    at once, LEAVE_AT_EXIT seconds in all."""
    nodes = [h._rdzv for h in list(_LIVE) if not h._rdzv.left]
    threads = [threading.Thread(target=rdzv.leave, kwargs={"timeout": LEAVE_AT_EXIT},
                                name=f"consul-rdzv-exit-{rdzv.node_id}", daemon=True)
               for rdzv in nodes]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + LEAVE_AT_EXIT
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


_SIGNALS_INSTALLED = False


def _leave_on_signals() -> None:
    """Before the workers start, make torch's signals raise ``SignalException``.

    torch installs its own handlers (SIGTERM, SIGINT, SIGHUP, SIGQUIT by default:
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``) only when it starts the workers; until then SIGTERM
    kills the agent with no Python cleanup, leaving its node in the run until the check TTL
    expires. Only default dispositions are replaced (a user's handler stays), only from the
    main thread, and torch's handlers replace ours when the workers start.
    """
    global _SIGNALS_INSTALLED
    if _SIGNALS_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    _SIGNALS_INSTALLED = True
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals) and signal.getsignal(sig) == signal.SIG_DFL:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, _raise_signal_exception)


def _raise_signal_exception(signum: int, frame) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException

    sig = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def _consul_config(endpoint: str, conf: dict) -> ConsulConfig:
    return ConsulConfig.resolve(
        address=endpoint or None,
        token_file=conf.get("token_file") or None,
        datacenter=conf.get("datacenter") or None,
        use_ssl=conf_bool(conf, "ssl"),
        verify=conf_bool(conf, "verify"),
        ca_file=conf.get("ca_file") or None,
        ca_path=conf.get("ca_path") or None,
        client_cert=conf.get("client_cert") or None,
        client_key=conf.get("client_key") or None,
        tls_server_name=conf.get("tls_server_name") or None,
    )


class _TorchStyleFormatter(logging.Formatter):
    """torch's log line format: ``I1203 16:40:01.123000 4242 consul_rdzv/rendezvous.py:258] ...``
    (level letter, month and day, time, pid, file and line), so that our lines read like the
    torch lines around them under torchrun."""

    def format(self, record: logging.LogRecord) -> str:
        path = record.pathname.replace(os.sep, "/")
        cut = path.rfind("consul_rdzv/")
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(record.created))
        head = (f"{record.levelname[:1]}{stamp}.{int(record.msecs * 1000):06d} {record.process} "
                f"{path[cut:] if cut >= 0 else record.filename}:{record.lineno}] ")
        text = head + record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def _show_progress() -> None:
    """Under torchrun, show our progress lines (INFO) in torch's format on stderr.

    Only when nobody configured logging for us: no handler on our logger or the root logger
    (torchrun's agent process sets up handlers for torch's loggers only, so ours would
    otherwise print nothing below WARNING, unformatted). ``LOGLEVEL`` (torchrun's variable)
    sets the level; INFO by default, which stays quiet while a job is healthy: a line per
    round, one every 15 s while waiting, one when a round ends.
    """
    ours = logging.getLogger("consul_rdzv")
    if ours.handlers or logging.getLogger().handlers:
        return  # the user's own logging configuration decides
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_TorchStyleFormatter())
    ours.addHandler(handler)
    level = logging.getLevelName(os.environ.get("LOGLEVEL", "INFO").strip().upper())
    ours.setLevel(level if isinstance(level, int) else logging.INFO)
    ours.propagate = False


def create_handler(params: RendezvousParameters) -> ConsulRendezvousHandler:
    """Build a handler from torchrun's parameters. Bad values raise ValueError naming the key."""
    _show_progress()
    conf = dict(params.config.items())
    settings = settings_from_conf(params.run_id, params.min_nodes, params.max_nodes, conf)
    config = _consul_config((params.endpoint or "").strip(), conf)
    client = ConsulClient(config, retry_timeout=settings.consul_timeout)
    local_addr = params.local_addr or conf.get("local_addr") or None
    handler = ConsulRendezvousHandler(settings, client, node_id=conf.get("node_id") or None,
                                      local_addr=local_addr,
                                      use_libuv=conf_bool(conf, "use_libuv"),
                                      token_file=conf.get("token_file") or None)
    rdzv = handler.rendezvous
    try:
        # torchrun creates the handler when the agent starts: show up in Consul right away
        # (and take over from a predecessor with our node id). Best effort and short:
        # next_rendezvous() registers (and reports errors) otherwise.
        rdzv.register(timeout=EAGER_REGISTER_TIMEOUT)
    except errors.RendezvousError as exc:
        logger.debug("Node %s could not register at handler creation (%s); next_rendezvous() "
                     "will.", rdzv.node_id, exc)
    logger.debug("Created consul rendezvous handler for run %s (node %s, Consul %s).",
                 settings.run_id, rdzv.node_id, config.url)
    return handler

