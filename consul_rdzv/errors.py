"""Every exception consul-rdzv raises, in one tree.

Two families. The Consul client raises ``ConsulError`` and its subclasses; the rendezvous protocol
turns those into ``RendezvousError`` subclasses (the cause stays chained), and the torch adapter
maps those onto torch's own rendezvous errors::

    ConsulError                      anything the Consul HTTP API said or failed to say
    ├── ConsulConfigError            bad address, unreadable token/cert file (also a ValueError)
    ├── ConsulUnavailableError       refused, reset, timed out, 5xx, "No cluster leader" (retried)
    ├── ConsulPermissionDenied       403, or a txn operation denied by ACLs (409): the message
    │                                names the ACL rule that is missing (or the unknown token)
    ├── ConsulNotFound               404 where the call needs the thing to exist
    ├── ConsulBadRequest             400/413: Consul's own text is in the message
    ├── ConsulSessionInvalid         the session used no longer exists (invalidated or destroyed)
    └── ConsulTxnConflict            409 from /v1/txn: ``.errors`` holds each failed operation

    RendezvousError                  the plain-Python protocol API
    ├── RendezvousClosedError        the run was closed; nobody joins it any more
    ├── RendezvousTimeoutError       join_timeout passed; says who was present and who was missing
    ├── RendezvousConnectionError    Consul unreachable or refusing us past the retry deadline
    └── RendezvousStateError         a value under the run's prefix is corrupt or foreign, or the
        │                            configuration of the nodes conflicts (e.g. two ask for rank 3)
        └── RendezvousReplacedError  a newer process took this node id over: this process stops

Torch's mapping (``consul_rdzv.torch``): each ``Rendezvous*Error`` becomes the torch class of the
same name (``RendezvousReplacedError`` torch's ``RendezvousStateError``);
``RendezvousConnectionError`` also covers ``ConsulPermissionDenied``.
"""

from __future__ import annotations

from dataclasses import dataclass


class ConsulError(Exception):
    """Base class of everything the Consul client raises."""

    retryable: bool = False

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ConsulConfigError(ConsulError, ValueError):
    """The client configuration is unusable (address, token file, TLS files)."""


class ConsulUnavailableError(ConsulError):
    """Consul could not be reached or could not answer now; retrying may help."""

    retryable = True


class ConsulPermissionDenied(ConsulError):
    """Consul's ACL system refused the request (HTTP 403)."""


class ConsulNotFound(ConsulError):
    """The thing the call needs does not exist (HTTP 404)."""


class ConsulBadRequest(ConsulError):
    """Consul rejected the request as malformed (HTTP 400 or 413)."""


class ConsulSessionInvalid(ConsulError):
    """The session the call used no longer exists."""


@dataclass(frozen=True)
class TxnOpError:
    """One failed operation of a rolled-back transaction."""

    op_index: int
    what: str
    op: dict | None = None

    def __str__(self) -> str:
        return f"op {self.op_index}: {self.what}"


class ConsulTxnConflict(ConsulError):
    """A transaction was rolled back (HTTP 409); ``errors`` lists every failed operation."""

    def __init__(self, errors: list[TxnOpError]) -> None:
        text = "; ".join(str(e) for e in errors) or "no details"
        super().__init__(f"Consul rolled back the transaction: {text}", status=409)
        self.errors = errors


class RendezvousError(Exception):
    """Base class of the rendezvous protocol's errors."""


class RendezvousClosedError(RendezvousError):
    """The run has been closed; no further rounds will be formed."""


class RendezvousTimeoutError(RendezvousError):
    """The rendezvous did not complete before its deadline."""


class RendezvousConnectionError(RendezvousError):
    """Consul could not be used (unreachable past the deadline, or access denied)."""


class RendezvousStateError(RendezvousError):
    """The state stored in Consul is unusable or the nodes' configuration conflicts."""


class RendezvousReplacedError(RendezvousStateError):
    """A newer process took this node id over (docs/protocol.md, "One node id, one process"):
    this process must stop, not rejoin."""
