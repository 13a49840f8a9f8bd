"""One node of the fault campaign (verify/campaign.py): a process joining rounds back to back.

    python -m verify.campaign_node --run-id R --key-prefix P --node-id N --serial S \
        --min 2 --max 5 [--heartbeat 2] [--last-call 0.3] [--join-timeout 30] \
        [--consul-timeout 10] [--train-min 0.3] [--train-max 2.0] [--seed 0]

Protocol level, no torch. Consul is found through ``CONSUL_HTTP_ADDR`` (the node's client agent).
The loop: ``next_round()``; "train" for a random time, ended early when the round breaks (a
participant is gone or asks for a new round: what torchrun's monitor does with
``num_nodes_waiting()``); ask for the next round; forever, until SIGKILL or SIGTERM. Every
outcome is one JSON line on stdout, stamped with the wall-clock time ``t``:

* ``{"event": "start", "node_id", "serial", "pid", "endpoint", "incarnation"}``
* ``{"event": "join"}`` when ``next_round()`` is called;
* ``{"event": "round", <every RoundResult field>}``;
* ``{"event": "error", "type", "message"}``: the node goes on with the next round, except after
  a ``RendezvousReplacedError`` (a newer process took its node id over: it exits 3, as the
  protocol asks of a replaced process);
* ``{"event": "broken", "round", "reason"}`` when a round it trains in breaks.

The trainer-store endpoint it advertises names its node id *and* its serial (one per process,
given by the campaign), so the campaign can tell which incarnation's endpoint a round carries.
Logs go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import signal
import sys
import time
import traceback
import zlib

from consul_rdzv.errors import RendezvousError, RendezvousReplacedError
from consul_rdzv.rendezvous import ConsulRendezvous
from consul_rdzv.settings import RendezvousSettings

#: Exit status of a process that stopped because a newer process took its node id over.
EXIT_REPLACED = 3


def endpoint_for(node_id: str, serial: int) -> dict:
    """The trainer-store endpoint process ``serial`` of ``node_id`` advertises (nothing serves
    it: the campaign only checks that a round carries its rank 0's endpoint)."""
    tag = f"{node_id}.p{serial}"
    return {"host": f"{tag}.store.test", "port": 20000 + zlib.crc32(tag.encode()) % 10000}


def emit(event: dict) -> None:
    """One JSON line on stdout, with the wall-clock time."""
    event.setdefault("t", time.time())
    sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
    sys.stdout.flush()


def run(node: ConsulRendezvous, rng: random.Random, train_min: float, train_max: float) -> int:
    """Join rounds back to back until killed; the exit status if the node has to stop."""
    while True:
        emit({"event": "join", "node_id": node.node_id})
        try:
            result = node.next_round()
        except Exception as exc:
            emit({"event": "error", "node_id": node.node_id, "type": type(exc).__name__,
                  "typed": isinstance(exc, RendezvousError), "message": str(exc)[:2000],
                  **({} if isinstance(exc, RendezvousError)
                     else {"traceback": traceback.format_exc()[-4000:]})})
            if isinstance(exc, RendezvousReplacedError):  # docs/protocol.md: it stops
                return EXIT_REPLACED
            time.sleep(rng.uniform(0.05, 0.3))  # as torchrun's agent would, then try again
            continue
        emit({"event": "round", "node_id": node.node_id, **dataclasses.asdict(result)})
        reason = node.wait_round_broken(rng.uniform(train_min, train_max))
        if reason is not None:
            emit({"event": "broken", "node_id": node.node_id, "round": result.round,
                  "reason": reason[:500]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--key-prefix", required=True)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--serial", type=int, required=True,
                        help="the campaign's number for this process (one per process)")
    parser.add_argument("--min", type=int, required=True, dest="min_nodes")
    parser.add_argument("--max", type=int, required=True, dest="max_nodes")
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--last-call", type=float, default=0.3)
    parser.add_argument("--join-timeout", type=float, default=30.0)
    parser.add_argument("--consul-timeout", type=float, default=10.0)
    parser.add_argument("--train-min", type=float, default=0.3)
    parser.add_argument("--train-max", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0, help="seeds the training times")
    parser.add_argument("--log-level", default="INFO",
                        help="of consul_rdzv's loggers (DEBUG shows retries and the "
                             "coordinator's decisions); other libraries log at INFO")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.node_id}/p{args.serial} %(threadName)s "
                               "%(name)s %(levelname)s %(message)s")
    logging.getLogger("consul_rdzv").setLevel(args.log_level.upper())
    settings = RendezvousSettings(
        run_id=args.run_id, key_prefix=args.key_prefix, min_nodes=args.min_nodes,
        max_nodes=args.max_nodes, heartbeat_timeout=args.heartbeat,
        last_call_timeout=args.last_call, join_timeout=args.join_timeout,
        consul_timeout=args.consul_timeout, close_timeout=5.0,
    )
    endpoint = endpoint_for(args.node_id, args.serial)
    # host = node id: a process restarted under the same node id is "on the same host", so it
    # takes over from its predecessor (docs/protocol.md, "One node id, one process").
    node = ConsulRendezvous(settings, node_id=args.node_id, host=args.node_id,
                            endpoint_provider=lambda: endpoint)

    def leave(signum: int, frame: object) -> None:
        node.leave()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)
    emit({"event": "start", "node_id": args.node_id, "serial": args.serial,
          "pid": os.getpid(), "endpoint": endpoint,
          "incarnation": node.incarnation.id})
    return run(node, random.Random(args.seed), args.train_min, args.train_max)


if __name__ == "__main__":
    raise SystemExit(main())
