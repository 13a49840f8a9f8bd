"""consul-rdzv: a HashiCorp Consul rendezvous backend for torch.distributed.elastic.

Importing this package does not import torch; ``consul_rdzv.torch`` is the adapter torch loads
through the ``torchrun.handlers`` entry point.
"""

from .client import ConsulClient, KVEntry, QueryResult
from .config import ConsulConfig
from .errors import (
    ConsulBadRequest,
    ConsulConfigError,
    ConsulError,
    ConsulNotFound,
    ConsulPermissionDenied,
    ConsulSessionInvalid,
    ConsulTxnConflict,
    ConsulUnavailableError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousReplacedError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from .rendezvous import ConsulRendezvous, RoundResult
from .settings import RendezvousSettings, settings_from_conf
from .worker import current_round, epoch, still_current

__version__ = "0.1.0"

__all__ = [
    "ConsulBadRequest",
    "ConsulClient",
    "ConsulConfig",
    "ConsulConfigError",
    "ConsulError",
    "ConsulNotFound",
    "ConsulPermissionDenied",
    "ConsulRendezvous",
    "ConsulSessionInvalid",
    "ConsulTxnConflict",
    "ConsulUnavailableError",
    "KVEntry",
    "QueryResult",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousReplacedError",
    "RendezvousSettings",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "RoundResult",
    "__version__",
    "current_round",
    "epoch",
    "settings_from_conf",
    "still_current",
]
