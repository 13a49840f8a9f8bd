"""A small DDP training job on gloo (CPU) for torchrun, used by the demo and the end-to-end tests.

Every rank trains the same tiny model on the same deterministic data for --steps steps and prints
one JSON line: rank, world size, restart count, and a checksum of the final parameters. DDP keeps
the parameters identical on every rank, so all ranks of a finished job print the same checksum.

It ships inside the package and is run by torchrun, never imported by consul-rdzv: by path
(``consul-rdzv demo`` finds the file with ``importlib.resources``) or as a module, from any
directory where consul-rdzv is installed:

    torchrun --rdzv-backend consul --rdzv-endpoint 127.0.0.1:8500 --nnodes 3 \
        --nproc-per-node 1 --rdzv-id demo -m consul_rdzv.examples.train --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="seconds to sleep per step (stretches the job for failure tests)")
    parser.add_argument("--out", default="", help="directory for a result JSON file per rank")
    parser.add_argument("--fail-once", default="",
                        help="RANK:STEP: that rank exits 1 at that step, once "
                             "(marker file in --out)")
    parser.add_argument("--progress-file", default="",
                        help="append one JSON line per event (start, each step) to this file, so "
                             "that a test can tell when and in which world training runs")
    parser.add_argument("--sigterm-delay", type=float, default=None,
                        help="on SIGTERM, go on for this many seconds before exiting, as a worker "
                             "that writes a checkpoint first would (default: exit at once)")
    parser.add_argument("--final-work", default="",
                        help="RANK:SECONDS: after training, that rank works this long on its "
                             "own (a final evaluation, a checkpoint upload) before it exits")
    args = parser.parse_args()
    if args.sigterm_delay is not None:
        delay = args.sigterm_delay

        def slow_exit(signum, frame) -> None:
            print(f"rank {os.environ.get('RANK')}: SIGTERM, exiting in {delay:g}s",
                  file=sys.stderr, flush=True)
            time.sleep(delay)
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, slow_exit)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    group_rank = int(os.environ.get("GROUP_RANK", "0"))

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1234 + rank)
    fail_rank, fail_step = (int(x) for x in args.fail_once.split(":")) if args.fail_once \
        else (-1, -1)
    marker = Path(args.out or ".") / "failed-once"

    def progress(event: str, **fields) -> None:
        if not args.progress_file:
            return
        line = json.dumps({"event": event, "time": time.time(), "rank": rank,
                           "world_size": world, "group_rank": group_rank, "restarts": restarts,
                           "pid": os.getpid(), "agent_pid": os.getppid(), **fields})
        with open(args.progress_file, "a", encoding="utf-8") as fh:  # one short O_APPEND write
            fh.write(line + "\n")

    progress("start")  # after DDP's initial broadcast: every rank of this world is connected
    for step in range(args.steps):
        if rank == fail_rank and step == fail_step and not marker.exists():
            marker.write_text(f"rank {rank} failed at step {step}\n")
            print(f"rank {rank}: injected failure at step {step}", file=sys.stderr, flush=True)
            return 1
        x = torch.randn(32, 16, generator=gen)
        y = x[:, :4].sin()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        progress("step", step=step)
        if args.step_time:
            time.sleep(args.step_time)

    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    final_loss = float(loss.detach())
    result = {"rank": rank, "world_size": world, "group_rank": group_rank,
              "restarts": restarts, "checksum": round(checksum, 10), "loss": final_loss,
              "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"}
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out, f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    if args.final_work:
        final_rank, seconds = args.final_work.split(":")
        if rank == int(final_rank):
            progress("final-work", seconds=float(seconds))
            time.sleep(float(seconds))
            progress("final-done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
