"""Data-parallel training of a small KNN network with DistributedDataParallel.

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py   # GPUs (NCCL) if present
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --device cpu   # gloo
    python examples/ddp_train.py                                     # 1 process

Every run sees the same global batches (each rank its slice), so a data-parallel run follows
the single-process loss trajectory at the same global batch; rank 0 writes the losses.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import knnconv
from knnconv.geometry import foveated_stack, knn_geometry


def build_model(backend: str) -> torch.nn.Module:
    sensor, middle, top = foveated_stack(resolution=24, a=0.5, levels=3)
    knn1, rf1, v1 = knn_geometry(sensor, middle, k=9)
    knn2, rf2, v2 = knn_geometry(middle, top, k=9)
    torch.manual_seed(0)
    return torch.nn.Sequential(
        knnconv.KNNConv(3, 16, knn1, rf1, nin=len(sensor), v=v1, backend=backend),
        torch.nn.ReLU(),
        knnconv.KNNConv(16, 16, knn2, rf2, nin=len(middle), v=v2, backend=backend),
        torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16 * len(top), 4))


def global_batches(steps: int, batch: int, nin: int):
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(batch, 3, nin, generator=generator)
        yield x, (x[:, 0].sum(1) > x[:, 1].sum(1)).long() + 2 * (x[:, 2].mean(1) > 0).long()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        help="default: cuda where a GPU is present, else cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--out", default="ddp.json")
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible; leave --device out to run on "
                         "the CPU")
    distributed = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must split evenly over {world} "
                         "processes to follow the one-process trajectory")
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
              if args.device == "cuda" else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    losses, backend_ran = train(args, rank, world, device, distributed)
    if rank == 0:
        with open(args.out, "w") as handle:
            json.dump({"world_size": world, "backend_ran": backend_ran, "losses": losses}, handle)
        print(f"world {world}: backend {backend_ran}, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if distributed:
        # A rank that destroyed the DDP wrapper after destroy_process_group could hang at
        # exit, so train() has released it while the group is up; every rank meets here
        # before any tears the group down.
        dist.barrier()
        dist.destroy_process_group()


def train(args, rank: int, world: int, device: torch.device,
          distributed: bool) -> tuple[list[float], str]:
    model = build_model(args.backend).to(device)
    layer = model[0]
    if distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.index is not None
                                        else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    share = args.global_batch // world
    losses = []
    for x, labels in global_batches(args.steps, args.global_batch, layer.plan.nin):
        mine = slice(rank * share, (rank + 1) * share)
        with torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda"
                            else torch.bfloat16, enabled=device.type == "cuda"):
            loss = torch.nn.functional.cross_entropy(model(x[mine].to(device)),
                                                     labels[mine].to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        if distributed:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses, layer.last_backend


if __name__ == "__main__":
    main()
