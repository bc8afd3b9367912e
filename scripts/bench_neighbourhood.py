"""Time KNN pooling and depthwise KNN convolution, torch ops against the native kernels (the
cuda backend's; the triton backend's depthwise ones too), on a foveated layer of the built-in
stack (GPU). Medians of CUDA-event-timed calls as a user sees
them, with x contiguous and channels-last; writes OUT.json and a bar chart OUT.png (x
contiguous).

    python scripts/bench_neighbourhood.py OUT.json
    python scripts/bench_neighbourhood.py --plot OUT.json   # redraw OUT.png from OUT.json
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from knnconv import KNNDepthwiseConv, KNNPool
from knnconv.geometry import foveated_stack, knn_geometry
from knnconv.tools.bench import time_calls

CHANNELS = 64
BATCHES = (128, 512)
STORAGES = ("contiguous", "channels_last")
BACKENDS = ("torch_compact", "cuda", "triton")
K = 9


def layers(backend: str, knn, rf, nin: int, v: int) -> dict:
    """The layers ``backend`` serves (the triton backend: the depthwise convolution alone)."""
    pools = {} if backend == "triton" else {
        "pool_max": KNNPool(knn, nin=nin, mode="max", backend=backend),
        "pool_avg": KNNPool(knn, nin=nin, mode="avg", backend=backend),
    }
    return {**pools,
            "depthwise": KNNDepthwiseConv(CHANNELS, knn, rf, nin=nin, v=v, backend=backend)}


def inputs(batch: int, nin: int, storage: str, device: torch.device) -> torch.Tensor:
    """x [B, C, N] fp16: contiguous, or the [B, C, N] view of a contiguous [B, N, C] buffer
    (channels-last, the storage knnconv's layers pass between them)."""
    if storage == "channels_last":
        x = torch.randn(batch, nin, CHANNELS, device=device, dtype=torch.float16).transpose(1, 2)
    else:
        x = torch.randn(batch, CHANNELS, nin, device=device, dtype=torch.float16)
    return x.requires_grad_()


def time_layer(layer, x: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Median ms of the forward (no grad) and of forward + backward (x, weight, bias)."""
    with torch.no_grad():
        grad = torch.randn_like(layer(x))

    def forward():
        with torch.no_grad():
            return layer(x)

    def train():
        layer(x).backward(grad)

    def reset():
        x.grad = None
        layer.zero_grad(set_to_none=True)

    return {"forward": time_calls(forward, device, warmup=3, repeats=20)[0],
            "train": time_calls(train, device, warmup=3, repeats=20, reset=reset)[0]}


def main(out: str) -> None:
    device = torch.device("cuda")
    sensor, middle = foveated_stack()[:2]
    knn, rf, v = knn_geometry(sensor, middle, K)
    rows = []
    for batch, storage, backend in itertools.product(BATCHES, STORAGES, BACKENDS):
        x = inputs(batch, len(sensor), storage, device)
        for name, layer in layers(backend, knn, rf, len(sensor), v).items():
            layer = layer.to(device, torch.float16)
            for mode, ms in time_layer(layer, x, device).items():
                rows.append({"op": name, "batch": batch, "storage": storage,
                             "backend": layer.last_backend, "mode": mode, "median_ms": ms,
                             "channels": CHANNELS, "nin": len(sensor), "nout": len(middle),
                             "k": K, "v": v, "dtype": "float16"})
                print(f"{name:<10} B={batch:<4} {storage:<13} {layer.last_backend:<13} "
                      f"{mode:<7} {ms:8.3f} ms", flush=True)
    result = {"device": torch.cuda.get_device_name(device), "rows": rows}
    with open(out, "w") as handle:
        json.dump(result, handle, indent=1)
    plot(result, out.removesuffix(".json") + ".png")


def plot(result: dict, path: str) -> None:
    """Speedup of the cuda backend's kernels over torch ops, per op, batch and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = {(r["op"], r["batch"], r["mode"], r["backend"]): r["median_ms"]
             for r in result["rows"] if r.get("storage", "contiguous") == "contiguous"}
    cells = sorted({key[:3] for key in times})
    speedups = [times[(*cell, "torch_compact")] / times[(*cell, "cuda")] for cell in cells]
    figure, axis = plt.subplots(figsize=(12, 4))
    axis.bar(range(len(cells)), speedups, color=["C0" if c[2] == "forward" else "C1"
                                                 for c in cells])
    axis.set_xticks(range(len(cells)), [f"{op}\nB={b} {mode}" for op, b, mode in cells],
                    fontsize=7)
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_ylabel("torch ops time / native time")
    axis.set_title(f"KNN pooling and depthwise conv, fp16, x contiguous, {result['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    if sys.argv[1] == "--plot":
        with open(sys.argv[2]) as source:
            plot(json.load(source), sys.argv[2].removesuffix(".json") + ".png")
    else:
        main(sys.argv[1])
