"""The Consul test harness of this repository: real agents and clusters, and failures to inject.

Not part of the installed package (the wheel ships ``consul_rdzv`` only): what it does is for
tests, the benchmark (``bench/``) and the fault campaign (``verify/``), and some of it needs
root. Run them from the repository's root (``python -m pytest``, ``python -m bench.run``,
``python -m verify.run``), which puts this package on ``sys.path``.

* :class:`ConsulAgent` (``agent.py``): ``consul agent -dev`` on 127.0.0.1 with free ports, with
  ``acl=True`` / ``tls=True`` / ``verify_incoming=True`` variants and ``kill``, ``restart``,
  ``freeze``, ``thaw``. It extends :class:`consul_rdzv.testing.ConsulAgent`, the plain dev
  agent the CLI runs.
* :class:`ConsulCluster` and :class:`ClusterMember` (``cluster.py``): servers and client agents,
  each on its own ``127.X.Y.Z``, with network partitions (root and ``ip rule``).

Nothing here is a fake: every agent is a real ``consul`` process, found or built by
:func:`consul_rdzv.testing.consul_binary`.
"""

from consul_rdzv.testing import CONSUL_VERSION, consul_binary, free_port, free_ports

from .agent import ConsulAgent
from .cluster import (
    FAST_TIMING_HCL,
    SERF_STATUS,
    ClusterMember,
    ConsulCluster,
    PartitionUnsupported,
    pick_loopback_block,
)

__all__ = [
    "CONSUL_VERSION",
    "FAST_TIMING_HCL",
    "SERF_STATUS",
    "ClusterMember",
    "ConsulAgent",
    "ConsulCluster",
    "PartitionUnsupported",
    "consul_binary",
    "free_port",
    "free_ports",
    "pick_loopback_block",
]
