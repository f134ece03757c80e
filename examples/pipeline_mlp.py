"""Train an MLP with pipeline parallelism across processes (and data parallelism).

Run with torchrun, one process per pipeline device (times replicas)::

    torchrun --nproc-per-node 2 examples/pipeline_mlp.py                 # 2-stage pipeline
    torchrun --nproc-per-node 4 examples/pipeline_mlp.py --replicas 2    # 2 stages x 2 replicas
    torchrun --nproc-per-node 2 examples/pipeline_mlp.py --schedule interleaved-1f1b --chunks 2

Every rank builds the model on the ``meta`` device (no memory), and the pipeline
materialises only the stages that rank runs. The first rank of each pipeline passes its
shard of the inputs, the last rank its shard of the targets; the first replica's last
rank prints its shard's loss, and rank 0 prints the gathered stats and writes the
measured timeline PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from batchgraph.cli import at_least
from batchgraph.pipeline import Pipeline, draw_timeline


def build(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--chunks", type=at_least(1), default=1)
    parser.add_argument("--replicas", type=at_least(1), default=1)
    parser.add_argument("--microbatches", type=at_least(1), default=8)
    parser.add_argument("--batch", type=at_least(1), default=256, help="global batch (all replicas)")
    parser.add_argument("--width", type=at_least(1), default=256)
    parser.add_argument("--depth", type=at_least(1), default=8)
    parser.add_argument("--steps", type=at_least(0), default=10)
    parser.add_argument("--png", default="out/pipeline_mlp_timeline.png")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one intra-op thread per rank: ranks share the cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.replicas:
        dist.destroy_process_group()
        parser.error(f"--replicas {args.replicas} does not divide the {world} processes: "
                     "run stages x replicas processes (torchrun --nproc-per-node)")
    stages = world // args.replicas
    replica, device = rank // stages, rank % stages
    first, last = device == 0, device == stages - 1

    with torch.device("meta"):  # nothing is allocated until a rank takes its stages
        net = build(args.width, args.depth)
    torch.manual_seed(0)  # same data on every rank; each replica takes its shard
    x = torch.randn(args.batch, args.width)
    y = x[:, :1].sin() + 0.1 * torch.randn(args.batch, 1)
    bounds = torch.linspace(0, args.batch, args.replicas + 1).long().tolist()
    shard = slice(bounds[replica], bounds[replica + 1])

    with Pipeline(
        net,
        stages=stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        chunks=args.chunks,
        loss_fn=nn.MSELoss(),
        backend="torch.distributed",
        timeout=120.0,
    ) as pipe:
        params = [p for m in pipe.stage_modules for p in m.parameters() if not p.is_meta]
        optimizer = torch.optim.SGD(params, lr=0.05)
        for step in range(args.steps):
            optimizer.zero_grad()
            loss = pipe.train_step(x[shard] if first else None, y[shard] if last else None)
            optimizer.step()
            if loss is not None and replica == 0:
                print(f"step {step:3d}  loss {loss.item():.5f}", flush=True)
        if rank == 0:
            print(f"\n{args.schedule}, {stages} stages x {args.replicas} replicas, "
                  f"m={args.microbatches}, devices below are global ranks:")  # fmt: skip
            print(pipe.stats.summary())
            path = draw_timeline(
                pipe.timeline,
                args.png,
                title=f"measured: {args.schedule}, p={stages}, m={args.microbatches}, ranks={world}",
                time_unit="seconds",
            )
            print(f"timeline: {os.path.abspath(path)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
