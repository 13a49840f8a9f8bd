"""``python tests/torchrun_launcher.py ARGS``: torchrun (``torch.distributed.run``) with the
agent's exit-barrier timeout taken from ``CONSUL_RDZV_TEST_EXIT_BARRIER`` (seconds), started
once the file ``CONSUL_RDZV_TEST_START_GATE`` names exists (if set).

torch's agent waits up to 300 s at its exit barrier for the other agents to finish; torchrun
has no option for it. A test of a node that finishes that long before the others lowers it
here instead of waiting five minutes. A test that needs a node to join at a given moment (a
late node during training) starts it gated: torch is imported by then, and the node joins as
soon as the test opens the gate, not seconds later. Nothing else changes.
"""

from __future__ import annotations

import os
import time

from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.run import main

_init = local_elastic_agent.LocalElasticAgent.__init__


def _init_with_barrier(self, *args, **kwargs):
    kwargs["exit_barrier_timeout"] = float(os.environ["CONSUL_RDZV_TEST_EXIT_BARRIER"])
    _init(self, *args, **kwargs)


if os.environ.get("CONSUL_RDZV_TEST_EXIT_BARRIER"):
    local_elastic_agent.LocalElasticAgent.__init__ = _init_with_barrier  # type: ignore[method-assign]

if __name__ == "__main__":
    gate = os.environ.get("CONSUL_RDZV_TEST_START_GATE")
    while gate and not os.path.exists(gate):
        time.sleep(0.01)
    main()
