"""A small DDP training job on gloo (CPU) for torchrun, used by the demo and the end-to-end tests.

Every rank trains the same tiny model on the same deterministic data for --steps steps and prints
one JSON line: rank, world size, restart count, and a checksum of the final parameters. DDP keeps
the parameters identical on every rank, so all ranks of a finished job print the same checksum.

With --checkpoint-dir, rank 0 writes a checkpoint every --checkpoint-every steps, fenced: only
while its round is still the run's current one (``consul_rdzv.still_current()``, a consistent
read in Consul), tagged with the round's epoch (``consul_rdzv.epoch()``), so that a worker of
an older round that wakes up late (frozen, paused) never overwrites a newer round's checkpoint.

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

import consul_rdzv


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
    parser.add_argument("--checkpoint-dir", default="",
                        help="rank 0 writes checkpoint.pt here (fenced by the round's epoch)")
    parser.add_argument("--checkpoint-every", type=int, default=10,
                        help="steps between checkpoints (with --checkpoint-dir)")
    parser.add_argument("--stop-self", default="",
                        help="RANK:STEP: that rank stops itself (SIGSTOP) right before its "
                             "checkpoint at that step, once (marker file in --out): a frozen "
                             "worker, for the fencing test")
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
    stop_rank, stop_step = (int(x) for x in args.stop_self.split(":")) if args.stop_self \
        else (-1, -1)

    def progress(event: str, **fields) -> None:
        if not args.progress_file:
            return
        line = json.dumps({"event": event, "time": time.time(), "rank": rank,
                           "world_size": world, "group_rank": group_rank, "restarts": restarts,
                           "pid": os.getpid(), "agent_pid": os.getppid(), **fields})
        with open(args.progress_file, "a", encoding="utf-8") as fh:  # one short O_APPEND write
            fh.write(line + "\n")

    def checkpoint(step: int) -> bool:
        """Write the checkpoint only while this round is the run's current one; False: the
        job went on without this worker (a newer round exists), so it must not write."""
        epoch = consul_rdzv.epoch()
        if not consul_rdzv.still_current():
            progress("checkpoint-refused", step=step, epoch=epoch)
            print(f"rank {rank}: round of epoch {epoch} is no longer current: checkpoint "
                  "refused, this worker stops", file=sys.stderr, flush=True)
            return False
        path = Path(args.checkpoint_dir)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".checkpoint.pt.{os.getpid()}"
        torch.save({"model": model.state_dict(), "step": step, "epoch": epoch}, tmp)
        os.replace(tmp, path / "checkpoint.pt")
        progress("checkpoint", step=step, epoch=epoch)
        return True

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
        stop_marker = Path(args.out or ".") / "stopped-once"
        if rank == stop_rank and step == stop_step and not stop_marker.exists():
            stop_marker.write_text(f"rank {rank} stopped itself at step {step}\n")
            progress("stopping", step=step, epoch=consul_rdzv.epoch())
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen here until someone sends SIGCONT
        if args.checkpoint_dir and rank == 0 and (step + 1) % args.checkpoint_every == 0 \
                and not checkpoint(step):
            return 3

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
    code = main()
    # Everything is done and flushed: leave without finalizing the interpreter. A gloo thread of
    # torch may still be dropping the last collective's work (its thread-local state holds
    # Python objects) while the interpreter finalizes; that thread cannot take the GIL then, is
    # unwound inside a C++ destructor, and the process aborts (SIGABRT, "terminate called
    # without an active exception", about one 2-node demo in 40 here; pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
