"""Every KNN pooling layer of fovi's published models against the copy-bandwidth floor: the
forward and the backward of knnconv's KNNPool, each timed alone (CUDA events, median), over
the bytes the pool must move (forward: x read, y written; backward: grad_y read, dx written)
at the device-copy bandwidth measured in the same run. Each is timed as a user calls it
(``forward_ms``, host time included); the forward also as GPU time (``forward_gpu_ms``:
CALLS calls captured as one CUDA graph, a replay's median over CALLS), which is what the
floor bounds. (The backward's capture fails: the autograd engine makes the legacy stream
wait on it.)

    python scripts/bench_fovi_pools.py OUT.json [--models resnet18,alexnet]
        [--batches 512,2048] [--pool-batches 1]
    python scripts/bench_fovi_pools.py --plot OUT.png LABEL=RESULT.json [LABEL=RESULT.json ...]

--models: names of the fovi-model bench; --pool-batches: the batch elements per thread of
the channels-last kernels (POOL_BATCH; any of POOL_BATCHES), each timed in turn. x is fp16 in
channels-last storage, as knnconv's layers pass it. Needs fovi and, for timings, a CUDA
device (on a CPU it lists the layers and times nothing). A run writes OUT.json and OUT.png;
--plot draws several runs' rows at POOL_BATCH side by side (say, before and after a change).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from knnconv import KNNPool
from knnconv.ops.cuda import neighbourhood
from knnconv.tools.bench import measure_ceilings, replayed_ms_per_call, time_calls, write_rows
from knnconv.tools.fovi_models import build_fovi, sensor_samples

DTYPE = torch.float16
WARMUP, REPEATS = 3, 30
CALLS = 10


def pooling_layers(name: str, device: torch.device) -> list[dict]:
    """The model's max and avg KNN pooling layers: name, table, mode, Nin, Nout and the
    channels each pools (read off one forward of fovi's model)."""
    from fovi.arch.knn import KNNPoolingLayer

    model = build_fovi(name, 64, device).eval()
    layers, channels = [], {}

    def record_channels(path: str):
        def hook(module, inputs, output) -> None:  # None: the output stays the layer's
            channels[path] = inputs[0].shape[1]
        return hook

    for path, module in model.named_modules():
        if isinstance(module, KNNPoolingLayer) and module.mode in ("max", "avg"):
            layers.append((path, module))
            module.register_forward_hook(record_channels(path))
    with torch.no_grad():
        model(torch.randn(2, 3, sensor_samples(model), device=device))
    found = []
    for path, module in layers:
        table = module.knn_indices_pad_token.detach().cpu()
        found.append({"model": name, "layer": path, "mode": module.mode, "table": table,
                      "nin": int(module.knn_pad_token_val), "nout": table.shape[1],
                      "k": table.shape[0], "channels": channels[path]})
    return found


def time_pool(layer: dict, batch: int, device: torch.device) -> dict[str, float]:
    """Median ms of the forward (no grad), as called and as GPU time, and of the backward
    alone as called."""
    pool = KNNPool(layer["table"], nin=layer["nin"], mode=layer["mode"]).to(device)
    x = torch.randn(batch, layer["nin"], layer["channels"], device=device, dtype=DTYPE)
    x = x.transpose(1, 2).requires_grad_()  # channels-last storage
    with torch.no_grad():
        times = {"forward_ms": time_calls(lambda: pool(x), device, warmup=WARMUP,
                                          repeats=REPEATS)[0],
                 "forward_gpu_ms": replayed_ms_per_call(
                     lambda: pool(x), device, calls=CALLS, warmup=WARMUP, repeats=REPEATS)}
    y = pool(x)
    grad_y = torch.randn_like(y)

    def backward():
        return torch.autograd.grad(y, x, grad_y, retain_graph=True)

    times["backward_ms"] = time_calls(backward, device, warmup=WARMUP, repeats=REPEATS)[0]
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--models", default="resnet18,alexnet")
    parser.add_argument("--batches", default="512,2048")
    parser.add_argument("--pool-batches", default=str(neighbourhood.POOL_BATCH))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    pool_batches = [int(b) for b in args.pool_batches.split(",")]
    if not set(pool_batches) <= set(neighbourhood.POOL_BATCHES):
        parser.error(f"--pool-batches: each one of {neighbourhood.POOL_BATCHES}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ceilings = measure_ceilings(device)
    copy_gbps = ceilings["copy_gbps"]
    rows = []
    for name in args.models.split(","):
        for layer, batch, pool_batch in ((layer, batch, pool_batch)
                                         for layer in pooling_layers(name, device)
                                         for batch in batches for pool_batch in pool_batches):
            row = {key: layer[key] for key in
                   ("model", "layer", "mode", "nin", "nout", "k", "channels")}
            row.update(batch=batch, pool_batch=pool_batch)
            elements = batch * layer["channels"]
            moved = elements * (layer["nin"] + layer["nout"]) * DTYPE.itemsize
            row["floor_ms"] = moved / copy_gbps / 1e6 if copy_gbps else None
            if device.type == "cuda":
                neighbourhood.POOL_BATCH = pool_batch
                row.update(time_pool(layer, batch, device))
                for timing in ("forward", "forward_gpu", "backward"):
                    row[f"{timing}_pct_of_floor"] = 100 * row["floor_ms"] / row[f"{timing}_ms"]
            rows.append(row)
            timed = (f"forward {row['forward_ms']:.3f} ms ({row['forward_pct_of_floor']:.0f}%), "
                     f"GPU {row['forward_gpu_ms']:.3f} ({row['forward_gpu_pct_of_floor']:.0f}%), "
                     f"backward {row['backward_ms']:.3f} ms "
                     f"({row['backward_pct_of_floor']:.0f}%)" if "forward_ms" in row
                     else "not timed (no CUDA device)")
            print(f"{name} {layer['layer']} {layer['mode']} C={layer['channels']} "
                  f"{layer['nin']}->{layer['nout']} B={batch} batch/thread {pool_batch}: "
                  f"{timed}", flush=True)
    write_rows(args.out, rows, device, ceilings=ceilings)
    plot({"this run": rows}, args.out.removesuffix(".json") + ".png")
    return 0


def plot(runs: dict[str, list[dict]], path: str) -> None:
    """Each pooling layer's forward (its GPU time, where a run timed it) and backward as %
    of the copy floor, per batch, one bar per run (rows at POOL_BATCH elements per
    thread)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def cell(row: dict) -> tuple:
        return row["model"], row["layer"], row["batch"]

    chosen = {label: {cell(r): r for r in rows if "forward_ms" in r
                      and r.get("pool_batch", 1) == neighbourhood.POOL_BATCH}
              for label, rows in runs.items()}
    cells = sorted({key for found in chosen.values() for key in found})
    if not cells:
        return
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    width = 0.8 / len(chosen)
    for axis, direction in zip(axes, ("forward", "backward"), strict=True):
        for index, (label, found) in enumerate(chosen.items()):
            axis.bar([i + index * width for i in range(len(cells))],
                     [found[c].get(f"{direction}_gpu_pct_of_floor",
                                   found[c][f"{direction}_pct_of_floor"]) if c in found else 0
                      for c in cells], width, label=label)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))],
                        [f"{m} {layer}\nB={b}" for m, layer, b in cells], fontsize=7,
                        rotation=30, ha="right")
        axis.set_title(f"{direction}")
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("% of the copy-bandwidth floor")
    axes[0].legend(loc="upper left", fontsize=8)
    figure.suptitle("fovi's KNN pooling layers, fp16 channels-last, "
                    f"{neighbourhood.POOL_BATCH} batch element(s) per thread")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--plot":
        runs = {}
        for argument in sys.argv[3:]:
            label, _, result = argument.partition("=")
            with open(result) as source:
                runs[label] = json.load(source)["rows"]
        plot(runs, sys.argv[2])
    else:
        raise SystemExit(main())
