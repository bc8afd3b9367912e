"""Where one layer's training step spends its time: per-kernel GPU time (torch.profiler)
and the host wall time per call, for a few geometry cells.

    python scripts/profile_cells.py GEOMETRY_DIR LAYER_SUBSTR:BATCH [...]

With KNNCONV_CPROFILE=1 it also prints the host-side Python profile of the training step.
KNNCONV_PROFILE_BACKEND names the backend profiled (default cuda).
With KNNCONV_NCU=1 it only runs a few training steps (a target for Nsight Compute, whose
counters cannot share the GPU with torch.profiler).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import knnconv
from knnconv.tools.bench import load_geometry_dir, random_inputs, reads_image

BACKEND = os.environ.get("KNNCONV_PROFILE_BACKEND", "cuda")


def profile_cell(layer, batch: int) -> None:
    device = torch.device("cuda")
    plan = layer.plan()
    # the storage a network of KNN layers passes on, as knnconv bench times them
    inputs = random_inputs(plan, batch, torch.float16, device,
                           channels_last=not reads_image(plan.cin))
    x, weight, bias, grad = inputs.x, inputs.weight, inputs.bias, inputs.grad_y

    def step():  # gradients cleared first, as a training step's zero_grad does
        inputs.clear_grads()
        y = knnconv.knn_conv(x, weight, bias, plan, BACKEND)
        y.backward(grad)

    def forward():
        with torch.no_grad():
            knnconv.knn_conv(x, weight, bias, plan, BACKEND)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if os.environ.get("KNNCONV_NCU"):
        return
    for name, call in (("forward", forward), ("train", step)):
        start = time.perf_counter()
        for _ in range(20):
            call()
        host = (time.perf_counter() - start) / 20 * 1e3
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 20 * 1e3
        print(f"{layer.name} B={batch} {name}: host {host:.3f} ms/call, wall {wall:.3f} ms/call")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    if os.environ.get("KNNCONV_CPROFILE"):
        host = cProfile.Profile()
        host.enable()
        for _ in range(100):
            step()
        host.disable()
        torch.cuda.synchronize()
        pstats.Stats(host).sort_stats("tottime").print_stats(22)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                      max_name_column_width=70)
    print(table)


def main(argv: list[str]) -> None:
    layers = load_geometry_dir(Path(argv[0]))
    for spec in argv[1:]:
        name, batch = spec.rsplit(":", 1)
        layer = next(entry for entry in layers if name in entry.name)
        profile_cell(layer, int(batch))


if __name__ == "__main__":
    main(sys.argv[1:])
