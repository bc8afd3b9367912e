"""What an eager call costs the host, piece by piece: how much of a small layer's eager
forward and training step, as a user times them, is host time, and how much of that no
implementation of the op in Python can avoid.

    python scripts/bench_host.py GEOMETRY_DIR OUT.json

On the smallest published layer (resnet18 rfmult-2 `layer4.0.conv2`, Nout 2) at B = 128, fp16,
it times per call, on the host (perf_counter, the median of 15 rounds of 200 calls, the GPU
synchronised between rounds so its queue never fills):
- the cuda backend's eager forward (no_grad) and training step (forward + backward; gradients
  cleared before each, ~1 us), and the same as a user times them (CUDA events around each
  call, as `knnconv bench` does);
- the parts that no implementation of the op in Python can avoid: an autograd.Function whose
  forward and backward only allocate their outputs (the engine's own cost per step), torch's
  dispatch of one small kernel (`add_`), one `torch.empty`, and one knnconv launch through
  its driver fast path (a 1-block re-layout);
- where the training step's host time goes: the inclusive time per step of each stage of the
  call (the autograd Function's forward and backward, the backend op, the launch plan's run,
  the launches, memsets and allocations), each wrapped in a timer (~0.2 us a wrapper).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

import knnconv
import knnconv.functional
import knnconv.ops.cuda
import knnconv.ops.cuda.gemm
import knnconv.ops.cuda.launch
import knnconv.ops.cuda.relayout
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
STAGES = (
    (knnconv.functional.KNNConvFunction, "forward", "Function.forward"),
    (knnconv.functional.KNNConvFunction, "backward", "Function.backward"),
    (knnconv.ops.cuda.CudaOps, "forward_saving", "CudaOps.forward_saving"),
    (knnconv.ops.cuda.CudaOps, "gradients", "CudaOps.gradients"),
    (knnconv.ops.cuda.gemm.ForwardLaunch, "run", "ForwardLaunch.run"),
    (knnconv.ops.cuda.gemm.BackwardLaunch, "run", "BackwardLaunch.run"),
    (knnconv.ops.cuda.launch, "launch_kernel", "kernel launches"),
    # a memset is issued by the module that calls it: x's re-layout, the backward's workspace
    (knnconv.ops.cuda.relayout, "memset_zero", "memsets"),
    (knnconv.ops.cuda.gemm, "memset_zero", "memsets"),
    (knnconv.ops.cuda.gemm.torch, "empty", "torch.empty (any Python caller)"),
    (knnconv.ops.cuda.gemm.torch, "empty_strided", "torch.empty_strided (any caller)"),
)


def stage_breakdown(call, calls: int = 2000) -> dict[str, dict[str, float]]:
    """{label: {"us_per_call", "count_per_call"}} of each stage of STAGES during ``call``."""
    totals = {label: [0, 0] for *_, label in STAGES}
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

    for owner, name, label in STAGES:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        originals.append((owner, name, original))
        wrapped = timed(original.__func__ if isinstance(original, staticmethod) else original,
                        label)
        setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod)
                else wrapped)
    try:
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        for entry in totals.values():
            entry[:] = [0, 0]
        for index in range(calls):
            call()
            if index % 100 == 99:  # the GPU queue never fills
                torch.cuda.synchronize()
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return {label: {"us_per_call": ns / calls / 1e3, "count_per_call": count / calls}
            for label, (ns, count) in totals.items() if count}


def main(argv: list[str]) -> None:
    geometry, out = Path(argv[0]), Path(argv[1])
    [layer] = [entry for entry in load_geometry_dir(geometry, [LAYER]) if entry.name == LAYER]
    plan = layer.plan()
    inputs = random_inputs(plan, BATCH, torch.float16, DEVICE, channels_last=True)  # as passed on
    x, weight, bias, grad_y = inputs.x, inputs.weight, inputs.bias, inputs.grad_y
    y_shape = (BATCH, plan.cout, plan.nout)

    def forward():
        with torch.no_grad():
            knnconv.knn_conv(x, weight, bias, plan, "cuda")

    # Gradients are cleared first (as the bench's reset does), so no call accumulates into them.
    def train():
        inputs.clear_grads()
        knnconv.knn_conv(x, weight, bias, plan, "cuda").backward(grad_y)

    def empty_step():
        inputs.clear_grads()
        AllocateOnly.apply(x, weight, bias, y_shape).backward(grad_y)

    def empty_forward():
        with torch.no_grad():
            AllocateOnly.apply(x, weight, bias, y_shape)

    small = torch.zeros(1024, device=DEVICE)
    buffer = torch.empty(2 * 64 * 64, dtype=torch.float16, device=DEVICE)  # source | target
    relayout = Transpose(torch.float16, torch.float16, DEVICE.index or 0, (1, 64, 64),
                         (1, 64, 64), (0, 64))
    source = buffer.data_ptr()

    def launch():
        relayout.launch_raw(source, source + 64 * 64 * 2, (0, 64, 1))

    rows = {
        "cuda forward (no_grad)": host_us(forward),
        "cuda training step": host_us(train),
        "autograd.Function step, outputs allocated only": host_us(empty_step),
        "autograd.Function forward (no_grad), output allocated only": host_us(empty_forward),
        "torch add_ on 1024 floats (one torch kernel launch)": host_us(lambda: small.add_(1)),
        "torch.empty(1024) on the GPU": host_us(lambda: torch.empty(1024, device=DEVICE)),
        "knnconv launch (64x64 re-layout, driver fast path)": host_us(launch),
    }
    as_timed = {
        "cuda forward (no_grad), CUDA events per call": time_calls(forward, DEVICE, warmup=20,
                                                                   repeats=200)[0] * 1e3,
        "cuda training step, CUDA events per call": time_calls(train, DEVICE, warmup=20,
                                                               repeats=200)[0] * 1e3,
    }
    for name, value in {**rows, **as_timed}.items():
        print(f"{name:62s} {value:8.1f} us")
    stages = {"training step": stage_breakdown(train),
              "forward (no_grad)": stage_breakdown(forward)}
    for call, breakdown in stages.items():
        print(f"{call}, inclusive host time per call of each stage:")
        for label, entry in breakdown.items():
            print(f"  {label:40s} {entry['us_per_call']:8.1f} us  ({entry['count_per_call']:.0f}x)")
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "layer": LAYER, "batch": BATCH, "dtype": "float16",
                               "host_us": rows, "as_timed_us": as_timed,
                               "stages_us": stages}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
