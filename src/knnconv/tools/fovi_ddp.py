"""fovi's models trained with DistributedDataParallel: one rank's part of ``knnconv bench
--fovi-model NAMES --ddp``, launched with torchrun, and the scaling table over several such
runs.

Each rank builds the model, wraps it in DDP (NCCL on CUDA, one GPU a rank; gloo on the CPU)
and times an eager training step (fp16 autocast and GradScaler on CUDA, as the single-GPU
bench) at the per-rank batch, for fovi's own path, the accelerated model and the grid
ResNet-18. A step's time is the slowest rank's median; images per second count every rank's
batch. Rank 0 writes ``<name>_ddp.json``. ``scripts/ddp_scaling.py`` launches the world sizes
a machine allows and :func:`scaling` puts their files side by side: the scaling efficiency of
N ranks is their images per second over N times one rank's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..ops.timing import device_description, release_memory, time_calls
from .fovi_models import PathModels, fovi_ready, training_step

PATHS = ("fovi", "accelerated", "grid")


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _rank_device(device: torch.device) -> torch.device:
    """This rank's device: its own GPU (LOCAL_RANK) where the bench runs on CUDA."""
    if device.type != "cuda":
        return device
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _slowest(ms: float, device: torch.device) -> float:
    """The largest of every rank's ``ms``: a step ends when its slowest rank does."""
    value = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def time_path(models: PathModels, path: str, batch: int, args: argparse.Namespace,
              device: torch.device) -> dict[str, Any]:
    """One row: the slowest rank's median ms of a DDP training step, and images per second."""
    world = dist.get_world_size()
    row: dict[str, Any] = {"model": args.current_model, "path": path, "world_size": world,
                           "batch_per_rank": batch, "status": "ok", "median_ms": None,
                           "images_per_s": None, "error": None}
    module = getattr(models, path)
    if module is None:
        return {**row, "status": "skipped", "error": models.grid_skip}
    # every rank starts from rank 0's weights, as DDP's constructor makes sure
    replica = copy.deepcopy(module)
    parallel = torch.nn.parallel.DistributedDataParallel(
        replica, device_ids=[device.index] if device.type == "cuda" else None)
    try:
        x, labels = models.inputs(path, batch, device)
        step = training_step(parallel, parallel, x, labels, device, graph=False)
        ms = time_calls(step, device, warmup=args.warmup, repeats=args.repeats)[0]
        slowest = _slowest(ms, device)
        row.update(median_ms=slowest, images_per_s=world * batch / slowest * 1e3)
    except Exception as error:  # a failing path is a result; the other paths still run
        row.update(status="error", error=f"{type(error).__name__}: {error}"[:500])
    finally:
        del parallel, replica
        release_memory(device)
    return row


def run(args: argparse.Namespace, device: torch.device) -> int:
    """This rank's part of the DDP benchmark (under torchrun); rank 0 writes the JSON."""
    if not fovi_ready(args, device):
        return 2
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        print(f"--ddp runs under torchrun (torchrun --nproc_per_node N -m knnconv bench "
              f"--fovi-model ... --ddp); not set: {', '.join(missing)}", file=sys.stderr)
        return 2
    device = _rank_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        rank = dist.get_rank()
        rows = []
        for name in args.fovi_model:
            args.current_model = name
            models = PathModels(name, args.in_res, device)
            for batch in args.batches:
                for path in PATHS:
                    row = time_path(models, path, batch, args, device)
                    rows.append(row)
                    if rank == 0:
                        shown = (f"{row['median_ms']:.2f} ms, {row['images_per_s']:.0f} images/s"
                                 if row["status"] == "ok" else f"{row['status']}: {row['error']}")
                        print(f"{name} {path:12} {dist.get_world_size()} ranks, B={batch}/rank: "
                              f"{shown}", flush=True)
        if rank == 0:
            result = {"device": device_description(device), "torch": torch.__version__,
                      "command": " ".join(sys.argv), "world_size": dist.get_world_size(),
                      "settings": {"fovi_models": args.fovi_model, "in_res": args.in_res,
                                   "batches_per_rank": args.batches, "warmup": args.warmup,
                                   "repeats": args.repeats},
                      "rows": rows}
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"{args.name or 'fovi'}_ddp.json"
            path.write_text(json.dumps(result, indent=1))
            print(f"wrote {path}")
        failed = [row for row in rows if row["status"] == "error" and row["path"] != "fovi"]
        return 1 if failed else 0
    finally:
        dist.destroy_process_group()


def scaling(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of several runs' DDP files side by side, each with its scaling efficiency: images
    per second over world_size times those of the one-rank run of the same model, path and
    per-rank batch (None where there is no one-rank run)."""
    rows = [row for result in results for row in result["rows"] if row["status"] == "ok"]
    single = {(row["model"], row["path"], row["batch_per_rank"]): row["images_per_s"]
              for row in rows if row["world_size"] == 1}
    table = []
    for row in sorted(rows, key=lambda r: (r["model"], r["path"], r["batch_per_rank"],
                                           r["world_size"])):
        one = single.get((row["model"], row["path"], row["batch_per_rank"]))
        efficiency = None if one is None else row["images_per_s"] / (row["world_size"] * one)
        table.append({**row, "scaling_efficiency": efficiency})
    return table


def read_results(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in paths]
