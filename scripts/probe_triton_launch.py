"""What one launch of the triton backend's forward kernel costs the host, piece by piece, and
what a fovi ResNet-18's eager step costs with every convolution layer on the triton kernels
against auto's choice.

    python scripts/probe_triton_launch.py GEOMETRY_DIR OUT.json [--layer NAME] [--batch B]
        [--model-batch B]

Part 1, on one layer (default: resnet18 rfmult-2 `layer4.0.conv2` at B = 128, fp16, x
channels-last; GPU-light, so host time is what is timed): host time per call (median of 15
rounds of 200 calls, the GPU synchronised between rounds) of launch.forward whole; of its
pieces (the weight's re-layout by cell, building a host tensor descriptor, the output's
allocation); of the kernel's launch through Triton's JIT dispatch with the descriptors built
beforehand, as knnconv launched it before knnconv.ops.triton.launcher; of the same compiled
kernel through its launcher (CompiledKernel[grid]: no binding, specialisation or cache key)
with those descriptors; and of knnconv's KernelLauncher from boxes (its key, its cached
descriptors, that launcher). Both direct launches' outputs are checked to equal the
dispatched launch's.

Part 2: the accelerated ResNet-18's eager training step (the fovi-model bench's step) at
--model-batch, in alternating rounds with auto's eager threshold as shipped and at 0 (every
layer of 16 or more input channels on triton), and cProfile's top functions by own time of
each (printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import triton
from bench_host import host_us  # scripts/, the directory Python runs this from
from profile_fovi_host import print_python_profile
from triton.tools.tensor_descriptor import TensorDescriptor

from knnconv.ops import dispatch
from knnconv.ops.triton import launch
from knnconv.ops.triton.backend import TritonOps
from knnconv.ops.triton.kernels import knn_conv_forward_kernel
from knnconv.ops.triton.launcher import KernelLauncher
from knnconv.tools.bench import load_geometry_dir, random_inputs
from knnconv.tools.fovi_models import PathModels, training_step

DEVICE = torch.device("cuda")
LAYER, BATCH = "fovi-resnet18_a-0.5_res-64_rfmult-2:layer4.0.conv2", 128


def launch_anatomy(geometry: Path, layer_name: str, batch: int) -> dict[str, float]:
    [layer] = [entry for entry in load_geometry_dir(geometry, [layer_name])
               if entry.name == layer_name]
    plan = layer.plan()
    inputs = random_inputs(plan, batch, torch.float16, DEVICE, channels_last=True)
    x, weight = inputs.x.detach(), inputs.weight.detach()
    tables = TritonOps.tables(plan, DEVICE)
    cin, cout, nout, v = plan.cin, plan.cout, plan.nout, plan.v
    tile = launch.forward_tile(batch, cin, cout, nout)
    cells = launch.weight_by_cell(weight, cin, v, x.dtype, reverse=False)
    x_box = launch.rows_box(x, (tile.block_m, tile.block_k))
    w_box = launch.matrix_box(cells, (tile.block_k, tile.block_n))
    x_desc, w_desc = x_box.descriptor(), w_box.descriptor()
    y = torch.empty(batch, nout, cout, dtype=x.dtype, device=DEVICE)
    grid = (nout, triton.cdiv(batch, tile.block_m), triton.cdiv(cout, tile.block_n))
    args = (x_desc, w_desc, y, y, tables.count, tables.entry_x, tables.entry_w, batch, nout,
            cout, tables.entry_x.shape[1])
    constexprs = dict(HAS_BIAS=False, CHUNKS=cin // tile.block_k, BM=tile.block_m,
                      BN=tile.block_n, BK=tile.block_k)

    def dispatched():
        return knn_conv_forward_kernel[grid](*args, **constexprs, num_warps=tile.warps,
                                             num_stages=tile.stages)

    compiled = dispatched()
    all_args = args + tuple(constexprs.values())

    def direct():
        compiled[grid](*all_args)

    boxed_args = (x_box, w_box) + args[2:]
    knnconv_launcher = KernelLauncher(knn_conv_forward_kernel)

    def through_launcher():
        knnconv_launcher[grid](*boxed_args, **constexprs, num_warps=tile.warps,
                               num_stages=tile.stages)

    dispatched()
    expected = y.clone()
    for launch_directly in (direct, through_launcher, through_launcher):
        y.fill_(float("nan"))
        launch_directly()
        torch.cuda.synchronize()
        assert torch.equal(y, expected), f"{launch_directly.__name__}: output differs"
    return {
        "launch.forward (whole)": host_us(lambda: launch.forward(
            x, weight, None, tables, nout=nout, v=v, tile=tile)),
        "weight_by_cell": host_us(lambda: launch.weight_by_cell(weight, cin, v, x.dtype,
                                                                reverse=False)),
        "TensorDescriptor (x rows)": host_us(lambda: TensorDescriptor(
            x, list(x_box.shape), list(x_box.strides), list(x_box.block))),
        "output torch.empty": host_us(lambda: torch.empty(batch, nout, cout, dtype=x.dtype,
                                                          device=DEVICE)),
        "kernel[grid] (JIT dispatch, descriptors built)": host_us(dispatched),
        "CompiledKernel[grid] (launcher only, descriptors built)": host_us(direct),
        "KernelLauncher from boxes (knnconv's launch)": host_us(through_launcher),
        "torch.cuda.current_stream().cuda_stream": host_us(
            lambda: torch.cuda.current_stream().cuda_stream),
    }


def model_steps(batch: int, rounds: int = 3, steps: int = 20) -> dict:
    models = PathModels("resnet18", 64, DEVICE)
    x, labels = models.inputs("accelerated", batch, DEVICE)
    step = training_step(models.accelerated, models.accelerated, x, labels, DEVICE, graph=False)
    shipped = dispatch.TRITON_MIN_FORWARD_FLOP
    thresholds = {"auto as shipped": shipped, "triton on every layer (threshold 0)": 0.0}
    times = {label: [] for label in thresholds}
    try:
        for _ in range(rounds):
            for label, threshold in thresholds.items():
                dispatch.TRITON_MIN_FORWARD_FLOP = threshold
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                torch.cuda.synchronize()
                times[label].append((time.perf_counter() - start) / steps * 1e3)
        for label, threshold in thresholds.items():
            dispatch.TRITON_MIN_FORWARD_FLOP = threshold
            step()
            print_python_profile(step, f"resnet18 accelerated B={batch}, {label}")
    finally:
        dispatch.TRITON_MIN_FORWARD_FLOP = shipped
    return {"batch": batch, "eager_step_ms": {label: statistics.median(values)
                                              for label, values in times.items()},
            "eager_step_ms_rounds": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("geometry", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layer", default=LAYER)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--model-batch", type=int, default=512)
    args = parser.parse_args()
    anatomy = launch_anatomy(args.geometry, args.layer, args.batch)
    for name, value in anatomy.items():
        print(f"{name:58s} {value:8.1f} us")
    model = model_steps(args.model_batch)
    for label, value in model["eager_step_ms"].items():
        print(f"resnet18 accelerated eager B={args.model_batch}, {label}: {value:.2f} ms")
    args.out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "layer": args.layer, "batch": args.batch,
        "dtype": "float16", "launch_host_us": anatomy, "model": model}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
