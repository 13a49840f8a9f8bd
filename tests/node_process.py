"""One rendezvous node as a real child process, for tests/test_rendezvous.py.

    python tests/node_process.py --run-id R --key-prefix P --node-id N --min 2 --max 3 \
        [--heartbeat 2] [--last-call 0.3] [--join-timeout 60] [--consul-timeout 10] [--host H]
        [--node-rank R]

Consul is found through ``CONSUL_HTTP_ADDR`` (and the other ``CONSUL_*`` variables) of the
environment. The node joins one round at start and prints one JSON line per outcome on stdout:

* ``{"event": "round", "node_id": ..., <every RoundResult field>}``
* ``{"event": "error", "node_id": ..., "type": "RendezvousTimeoutError", "message": ...}``

Then it reads commands from stdin, one per line, while its heartbeat thread keeps its Consul
check passing (so a test can SIGKILL it at any time):

* ``next``: join the next round (prints one more line);
* ``waiting``: print ``{"event": "waiting", "value": num_nodes_waiting()}``;
* ``leave`` or end of input: leave cleanly and exit 0.

Logs go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import zlib

from consul_rdzv.errors import RendezvousError
from consul_rdzv.rendezvous import ConsulRendezvous
from consul_rdzv.settings import RendezvousSettings


def endpoint_for(node_id: str) -> dict:
    """The trainer-store endpoint a test node advertises (same rule in test_rendezvous.py)."""
    return {"host": f"{node_id}.store.test", "port": 20000 + zlib.crc32(node_id.encode()) % 10000}


def emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
    sys.stdout.flush()


def join(node: ConsulRendezvous) -> None:
    try:
        result = node.next_round()
    except RendezvousError as exc:
        emit({"event": "error", "node_id": node.node_id, "type": type(exc).__name__,
              "message": str(exc)})
        return
    emit({"event": "round", "node_id": node.node_id, **dataclasses.asdict(result)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--key-prefix", required=True)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--host", default=None)
    parser.add_argument("--min", type=int, required=True, dest="min_nodes")
    parser.add_argument("--max", type=int, required=True, dest="max_nodes")
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--last-call", type=float, default=0.3)
    parser.add_argument("--join-timeout", type=float, default=60.0)
    parser.add_argument("--consul-timeout", type=float, default=10.0)
    parser.add_argument("--node-rank", type=int, default=None,
                        help="ask for this rank (rank_policy explicit)")
    parser.add_argument("--store-port", type=int, default=None,
                        help="advertise 127.0.0.1:PORT as this node's trainer store (a port "
                             "nothing serves: the node never hosts one)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.node_id} %(name)s %(levelname)s %(message)s")
    settings = RendezvousSettings(
        run_id=args.run_id, key_prefix=args.key_prefix, min_nodes=args.min_nodes,
        max_nodes=args.max_nodes, heartbeat_timeout=args.heartbeat,
        last_call_timeout=args.last_call, join_timeout=args.join_timeout,
        consul_timeout=args.consul_timeout, close_timeout=5.0,
        rank_policy="explicit" if args.node_rank is not None else "stable",
        node_rank=args.node_rank,
    )
    endpoint = (endpoint_for(args.node_id) if args.store_port is None
                else {"host": "127.0.0.1", "port": args.store_port})
    node = ConsulRendezvous(settings, node_id=args.node_id, host=args.host or args.node_id,
                            endpoint_provider=lambda: endpoint)
    join(node)
    for line in sys.stdin:
        command = line.strip()
        if command == "next":
            join(node)
        elif command == "waiting":
            emit({"event": "waiting", "node_id": node.node_id, "value": node.num_nodes_waiting()})
        elif command == "leave":
            break
        elif command:
            emit({"event": "error", "node_id": node.node_id, "type": "UsageError",
                  "message": f"unknown command {command!r}"})
    node.leave()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
