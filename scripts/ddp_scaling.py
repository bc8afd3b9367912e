"""DDP scaling of fovi's models: ``knnconv bench --fovi-model NAMES --ddp`` under torchrun at
every world size the machine allows (1, 2, 4, 8 GPUs, or --world-sizes), then one table and
plot of images per second and scaling efficiency (images per second over N times one GPU's)
for fovi's own path, the accelerated model and the grid ResNet-18.

    python scripts/ddp_scaling.py OUT_DIR [--models resnet18,alexnet] [--world-sizes 1,2]
        [-- extra knnconv bench options, e.g. --batches 512 --repeats 10]

Writes OUT_DIR/ddp_n<N>_ddp.json per world size, OUT_DIR/ddp_scaling.json and
OUT_DIR/ddp_scaling.png. On a machine without GPUs the ranks run on the CPU (gloo).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from knnconv.tools.fovi_ddp import read_results, scaling


def world_sizes(available: int) -> list[int]:
    return [n for n in (1, 2, 4, 8) if n <= max(1, available)]


def plot(table: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({row["model"] for row in table})
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for axis, model in zip(axes[0], models, strict=True):
        for path_name in ("fovi", "accelerated", "grid"):
            rows = [r for r in table if r["model"] == model and r["path"] == path_name
                    and r["scaling_efficiency"] is not None]
            if rows:
                axis.plot([r["world_size"] for r in rows],
                          [100 * r["scaling_efficiency"] for r in rows], marker="o",
                          label=path_name)
        axis.set_xlabel("GPUs (DDP ranks)")
        axis.set_ylabel("scaling efficiency (%)")
        axis.set_title(model)
        axis.set_xscale("log", base=2)
        sizes = sorted({r["world_size"] for r in table})
        axis.set_xticks(sizes, [str(n) for n in sizes])
        axis.legend()
    figure.suptitle("fovi models under DDP: images/s over N x one rank's")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", default="resnet18,alexnet")
    parser.add_argument("--world-sizes", help="comma-separated (default: 1, 2, 4, 8 up to the "
                                              "GPUs present; 1 and 2 on a CPU)")
    args, extra = parser.parse_known_args()
    extra = [option for option in extra if option != "--"]
    sizes = ([int(n) for n in args.world_sizes.split(",")] if args.world_sizes
             else world_sizes(torch.cuda.device_count() or 2))
    args.out.mkdir(parents=True, exist_ok=True)
    files = []
    for size in sizes:
        name = f"ddp_n{size}"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={size}", "-m", "knnconv", "bench", "--fovi-model",
                   args.models, "--ddp", "--out", str(args.out), "--name", name, *extra]
        print(" ".join(command), flush=True)
        if subprocess.run(command).returncode != 0:
            print(f"the run on {size} ranks failed", file=sys.stderr)
            return 1
        files.append(args.out / f"{name}_ddp.json")
    table = scaling(read_results(files))
    (args.out / "ddp_scaling.json").write_text(json.dumps(
        {"world_sizes": sizes, "runs": [str(f.name) for f in files], "rows": table}, indent=1))
    for row in table:
        efficiency = row["scaling_efficiency"]
        print(f"{row['model']:9} {row['path']:12} {row['world_size']} ranks "
              f"B={row['batch_per_rank']}/rank {row['images_per_s']:10.0f} images/s"
              + ("" if efficiency is None else f"  efficiency {100 * efficiency:.1f}%"))
    plot(table, args.out / "ddp_scaling.png")
    print(f"wrote {args.out / 'ddp_scaling.json'} and {args.out / 'ddp_scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
