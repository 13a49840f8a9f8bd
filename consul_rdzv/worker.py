"""Fencing for the workers of a round: which round they belong to, and whether it is still the
run's current one. No torch here (a worker imports this without the adapter).

torchrun's agent joins a round, then starts its workers; consul-rdzv's torch adapter puts the
round in ``CONSUL_RDZV_*`` environment variables first, which the workers inherit
(:class:`consul_rdzv.config.WorkerRound`). A worker that was frozen (a stopped VM, a process
paused by a debugger or the kernel) can wake up after the job went on without it, still believing
in its old round: before it writes anything the job shares (a checkpoint), it asks
:func:`still_current`, and it tags what it writes with :func:`epoch`, which grows with every round
of the run (the round key's Consul ``ModifyIndex`` as sealed), so a newer checkpoint is never
overwritten by an older round's.

    import consul_rdzv

    if consul_rdzv.still_current():
        save(model, f"ckpt-{consul_rdzv.epoch()}.pt")

The epoch is Consul's Raft index: it keeps growing while the Consul cluster keeps its state (a
dev agent restarted with its data lost starts again from low indexes).
"""

from __future__ import annotations

import functools
import time

from .client import ConsulClient
from .config import WorkerRound
from .errors import ConsulError, RendezvousConnectionError
from .layout import Keys, Round
from .runs import OUTCOME_FINISHED

#: still_current()'s default budget for reaching Consul (retries included).
STILL_CURRENT_TIMEOUT = 10.0


@functools.lru_cache(maxsize=1)
def _this_round() -> WorkerRound:
    return WorkerRound.from_env()


def current_round() -> WorkerRound:
    """This worker's round, from the environment its torchrun agent gave it (a
    :class:`~consul_rdzv.errors.ConsulConfigError` outside such a worker)."""
    return _this_round()


def epoch() -> int:
    """This worker's round's epoch: the round key's Consul ``ModifyIndex`` as sealed. Every later
    round of the run has a larger one."""
    return _this_round().epoch


def still_current(*, timeout: float = STILL_CURRENT_TIMEOUT,
                  worker: WorkerRound | None = None) -> bool:
    """Whether this worker's round is still the run's current one: a consistent read of the
    round key (the Consul leader answers, so no older state can say yes).

    True while the round key holds this round (same seal id) and the run was not closed, or was
    closed as finished in this very round (the job is done: its workers finish their work). False
    once any other round was sealed, the run was closed otherwise, or its keys are gone. Consul
    unreachable within ``timeout``: :class:`~consul_rdzv.errors.RendezvousConnectionError` (do
    not write then: nobody can say that the round still holds).
    """
    mine = worker or _this_round()
    client = ConsulClient(mine.config, retry_timeout=timeout, timeout=timeout, pool_size=1)
    try:
        entry = client.kv_get(Keys(mine.prefix).round, consistent=True,
                              deadline=time.monotonic() + timeout).data
    except ConsulError as exc:
        raise RendezvousConnectionError(
            f"Could not ask Consul at {mine.config.url} whether round {mine.round} of run "
            f"{mine.run_id} is still current: {exc}"
        ) from exc
    finally:
        client.close()
    if entry is None:
        return False
    current = Round.decode(entry)
    if current.seal_id != mine.seal_id:
        return False
    return not current.closed or current.closed.get("outcome") == OUTCOME_FINISHED
