"""What an eager call costs the host, piece by piece: how much of a layer's eager forward and
training step, as a user times them, is host time, how much of that no implementation of the
op in Python can avoid, and what torch's own convolution costs the same host.

    python scripts/bench_host.py GEOMETRY_DIR OUT.json [--backend cuda|triton]
        [--layer NAME] [--batch B]

By default on the smallest published layer (resnet18 rfmult-2 `layer4.0.conv2`, Nout 2) at
B = 128, fp16, x in channels-last storage as a network of KNN layers passes it, it times per
call, on the host (perf_counter, the median of 15 rounds of 200 calls, the GPU synchronised
between rounds so its queue never fills):
- the backend's eager forward (no_grad) and training step (forward + backward; gradients
  cleared before each, ~1 us), and the same as a user times them (CUDA events around each
  call, as `knnconv bench` does);
- the same training step under autocast with float32 parameters, as a model calls it;
- torch's own layer in the same process: a 3x3 conv2d training step (channels_last, fp16,
  the layer's channel counts, 8 x 8 pixels), the yardstick of an eager step's host time;
- the parts that no implementation of the op in Python can avoid: an autograd.Function whose
  forward and backward only allocate their outputs (the engine's own cost per step), torch's
  dispatch of one small kernel (`add_`), one `torch.empty`, and for the cuda backend one
  knnconv launch through its driver fast path (a 1-block re-layout);
- the autocast training step under cProfile: its top Python functions by own time;
- where the training step's host time goes: the inclusive time per step of each stage of the
  backend's call (the autograd Function's forward and backward, the backend op, its launches
  and allocations), each wrapped in a timer (~0.2 us a wrapper).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
import triton.runtime.jit
from triton.tools.tensor_descriptor import TensorDescriptor

import knnconv
import knnconv.functional
import knnconv.ops.cuda
import knnconv.ops.cuda.gemm
import knnconv.ops.cuda.launch
import knnconv.ops.cuda.relayout
import knnconv.ops.first_use
import knnconv.ops.triton.backend
import knnconv.ops.triton.launch
import knnconv.ops.triton.launcher
from knnconv.ops.cuda.launch import Transpose
from knnconv.tools.bench import load_geometry_dir, random_inputs, time_calls

DEVICE = torch.device("cuda")
LAYER, BATCH = "fovi-resnet18_a-0.5_res-64_rfmult-2:layer4.0.conv2", 128


def host_us(call, calls: int = 200, rounds: int = 15) -> float:
    for _ in range(20):
        call()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


class AllocateOnly(torch.autograd.Function):
    """The autograd engine's floor: outputs allocated, nothing computed."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape):
        ctx.save_for_backward(x, weight)
        return x.new_empty(shape)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        return x.new_empty(x.shape), weight.new_empty(weight.shape), grad_y.new_empty(
            grad_y.shape[1]), None


# (owner, attribute, label): the stages of an eager call whose inclusive host time is reported
COMMON_STAGES = (
    (knnconv.functional.KNNConvFunction, "forward", "Function.forward"),
    (knnconv.functional.KNNConvFunction, "backward", "Function.backward"),
)
STAGES = {
    "cuda": COMMON_STAGES + (
        (knnconv.ops.cuda.CudaOps, "forward_saving", "CudaOps.forward_saving"),
        (knnconv.ops.cuda.CudaOps, "gradients", "CudaOps.gradients"),
        (knnconv.ops.cuda.gemm.ForwardLaunch, "run", "ForwardLaunch.run"),
        (knnconv.ops.cuda.gemm.BackwardLaunch, "run", "BackwardLaunch.run"),
        (knnconv.ops.cuda.launch, "launch_kernel", "kernel launches"),
        # a memset is issued by the module that calls it: x's re-layout, the workspace
        (knnconv.ops.cuda.relayout, "memset_zero", "memsets"),
        (knnconv.ops.cuda.gemm, "memset_zero", "memsets"),
        (knnconv.ops.cuda.gemm.torch, "empty", "torch.empty (any Python caller)"),
        (knnconv.ops.cuda.gemm.torch, "empty_strided", "torch.empty_strided (any caller)"),
    ),
    "triton": COMMON_STAGES + (
        (knnconv.ops.triton.backend.TritonOps, "forward", "TritonOps.forward"),
        (knnconv.ops.triton.backend.TritonOps, "gradients", "TritonOps.gradients"),
        (knnconv.ops.triton.launch, "forward", "launch.forward"),
        (knnconv.ops.triton.launch, "grad_input", "launch.grad_input"),
        (knnconv.ops.triton.launch, "grad_weight", "launch.grad_weight"),
        (knnconv.ops.triton.launch, "weight_by_cell", "weight_by_cell (re-layouts)"),
        (knnconv.ops.triton.launch, "_poisoned_or_empty", "outputs allocated"),
        (knnconv.ops.triton.launcher.KernelLauncher, "launch", "KernelLauncher.launch"),
        (knnconv.ops.triton.launcher, "_cached_descriptor", "box descriptors (cached)"),
        (TensorDescriptor, "__init__", "TensorDescriptor built"),
        (triton.runtime.jit.JITFunction, "run", "Triton JITFunction.run (dispatched)"),
        (knnconv.ops.triton.backend.TritonOps, "tables", "TritonOps.tables"),
        (knnconv.ops.first_use.FirstUseChecks, "_first_use", "first-use lookups"),
        (knnconv.ops.first_use.FirstUseChecks, "_check_gradients", "first-use checks"),
        (knnconv.ops.triton.launch.torch, "empty", "torch.empty (any Python caller)"),
    ),
}


def warm_up(call, calls: int = 20) -> None:
    for _ in range(calls):
        call()
    torch.cuda.synchronize()


def run_calls(call, calls: int) -> None:
    """``calls`` calls of ``call``, synchronising every hundred: the GPU queue never fills."""
    for index in range(calls):
        call()
        if index % 100 == 99:
            torch.cuda.synchronize()


def stage_breakdown(call, stages, calls: int = 2000) -> dict[str, dict[str, float]]:
    """{label: {"us_per_call", "count_per_call"}} of each of ``stages`` during ``call``."""
    totals = {label: [0, 0] for *_, label in stages}
    originals = []

    def timed(function, label):
        def wrapper(*args, **kwargs):
            begin = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                entry = totals[label]
                entry[0] += time.perf_counter_ns() - begin
                entry[1] += 1
        return wrapper

    for owner, name, label in stages:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        originals.append((owner, name, original))
        wrapped = timed(original.__func__ if isinstance(original, staticmethod) else original,
                        label)
        setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod)
                else wrapped)
    try:
        warm_up(call)
        for entry in totals.values():
            entry[:] = [0, 0]
        run_calls(call, calls)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return {label: {"us_per_call": ns / calls / 1e3, "count_per_call": count / calls}
            for label, (ns, count) in totals.items() if count}


def function_profile(call, calls: int = 1000, top: int = 40) -> list[dict]:
    """cProfile's ``top`` functions by own time over ``calls`` calls of ``call``: own and
    inclusive microseconds and calls per call (cProfile's overhead inflates the times; the
    counts and the ranking are what it tells)."""
    warm_up(call)
    profiler = cProfile.Profile()
    profiler.enable()
    run_calls(call, calls)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = [{"function": f"{Path(file).name}:{line}({name})", "calls": count / calls,
             "own_us": own / calls * 1e6, "inclusive_us": inclusive / calls * 1e6}
            for (file, line, name), (_, count, own, inclusive, _) in stats.items()]
    return sorted(rows, key=lambda row: -row["own_us"])[:top]


def torch_conv_step(cin: int, cout: int, batch: int):
    """A training step of torch's own 3x3 conv2d (channels_last, fp16, 8 x 8 pixels)."""
    x = torch.randn(batch, cin, 8, 8, device=DEVICE, dtype=torch.float16).to(
        memory_format=torch.channels_last).requires_grad_()
    conv = torch.nn.Conv2d(cin, cout, 3, padding=1, device=DEVICE, dtype=torch.float16).to(
        memory_format=torch.channels_last)
    grad = torch.randn(batch, cout, 8, 8, device=DEVICE, dtype=torch.float16).to(
        memory_format=torch.channels_last)

    def step():
        x.grad = conv.weight.grad = conv.bias.grad = None
        conv(x).backward(grad)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("geometry", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--backend", default="cuda", choices=sorted(STAGES))
    parser.add_argument("--layer", default=LAYER)
    parser.add_argument("--batch", type=int, default=BATCH)
    args = parser.parse_args()
    backend, batch = args.backend, args.batch
    [layer] = [entry for entry in load_geometry_dir(args.geometry, [args.layer])
               if entry.name == args.layer]
    plan = layer.plan()
    inputs = random_inputs(plan, batch, torch.float16, DEVICE, channels_last=True)
    x, weight, bias, grad_y = inputs.x, inputs.weight, inputs.bias, inputs.grad_y
    weight32 = weight.detach().float().requires_grad_()
    bias32 = bias.detach().float().requires_grad_()
    y_shape = (batch, plan.cout, plan.nout)

    def forward():
        with torch.no_grad():
            knnconv.knn_conv(x, weight, bias, plan, backend)

    # Gradients are cleared first (as the bench's reset does), so no call accumulates into them.
    def train():
        inputs.clear_grads()
        knnconv.knn_conv(x, weight, bias, plan, backend).backward(grad_y)

    def train_autocast():
        x.grad = weight32.grad = bias32.grad = None
        with torch.autocast("cuda", dtype=torch.float16):
            y = knnconv.knn_conv(x, weight32, bias32, plan, backend)
        y.backward(grad_y)

    def empty_step():
        inputs.clear_grads()
        AllocateOnly.apply(x, weight, bias, y_shape).backward(grad_y)

    def empty_forward():
        with torch.no_grad():
            AllocateOnly.apply(x, weight, bias, y_shape)

    small = torch.zeros(1024, device=DEVICE)
    rows = {
        f"{backend} forward (no_grad)": host_us(forward),
        f"{backend} training step": host_us(train),
        f"{backend} training step, float32 parameters under autocast": host_us(train_autocast),
        "torch conv2d training step (3x3, channels_last, same channels)": host_us(
            torch_conv_step(plan.cin, plan.cout, batch)),
        "autograd.Function step, outputs allocated only": host_us(empty_step),
        "autograd.Function forward (no_grad), output allocated only": host_us(empty_forward),
        "torch add_ on 1024 floats (one torch kernel launch)": host_us(lambda: small.add_(1)),
        "torch.empty(1024) on the GPU": host_us(lambda: torch.empty(1024, device=DEVICE)),
    }
    if backend == "cuda":
        buffer = torch.empty(2 * 64 * 64, dtype=torch.float16, device=DEVICE)  # source | target
        relayout = Transpose(torch.float16, torch.float16, DEVICE.index or 0, (1, 64, 64),
                             (1, 64, 64), (0, 64))
        source = buffer.data_ptr()
        rows["knnconv launch (64x64 re-layout, driver fast path)"] = host_us(
            lambda: relayout.launch_raw(source, source + 64 * 64 * 2, (0, 64, 1)))
    as_timed = {
        f"{backend} forward (no_grad), CUDA events per call": time_calls(
            forward, DEVICE, warmup=20, repeats=200)[0] * 1e3,
        f"{backend} training step, CUDA events per call": time_calls(
            train, DEVICE, warmup=20, repeats=200)[0] * 1e3,
    }
    for name, value in {**rows, **as_timed}.items():
        print(f"{name:66s} {value:8.1f} us")
    stages = {"training step": stage_breakdown(train, STAGES[backend]),
              "forward (no_grad)": stage_breakdown(forward, STAGES[backend])}
    functions = function_profile(train_autocast)
    print("training step, float32 parameters under autocast: cProfile's top functions by own "
          "time per call")
    for row in functions:
        print(f"  {row['function'][:60]:60s} {row['own_us']:7.1f} own {row['inclusive_us']:7.1f} "
              f"inclusive us ({row['calls']:.0f}x)")
    for call, breakdown in stages.items():
        print(f"{call}, inclusive host time per call of each stage:")
        for label, entry in breakdown.items():
            print(f"  {label:40s} {entry['us_per_call']:8.1f} us  ({entry['count_per_call']:.0f}x)")
    args.out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "backend": backend, "layer": args.layer, "batch": batch, "dtype": "float16",
        "host_us": rows, "as_timed_us": as_timed, "stages_us": stages,
        "autocast_step_functions": functions}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
