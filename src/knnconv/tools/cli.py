"""Command line: ``knnconv check`` validates every backend, ``knnconv run`` (the default)
runs a foveated layer stack through every backend (``knnconv bench`` lives in bench.py,
``knnconv demo``, the README's main job, in demo.py).

Both compare each backend's forward and backward with the reference backend computed in
float64 on the same (rounded) inputs, so the reported error is the backend's own.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch

from .._version import __version__
from ..functional import knn_conv
from ..geometry import foveated_stack, knn_geometry
from ..ops import KNNConvOps, available_backends, get_ops
from ..plan import KNNConvPlan, make_plan
from . import bench, demo
from .options import int_at_least

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 3e-3,
              torch.bfloat16: 2e-2}

# (Nin, Nout, K, Cin, Cout, fraction of neighbours replaced by padding)
CHECK_GEOMETRIES = [
    (40, 17, 9, 3, 5, 0.2),
    (6, 5, 9, 4, 7, 0.0),  # K > Nin: the trailing slots are padding
    (120, 33, 25, 8, 65, 0.05),  # Cout just past a 64-wide tile
]

CHECK_HEADERS = ["backend", "dtype", "fwd err", "grad_x err", "grad_w err", "tolerance", "result",
                 "time ms"]
RUN_HEADERS = ["layer", "nin->nout", "k", "v", "cin->cout", "backend", "dtype", "fwd err",
               "grad_x err", "grad_w err", "tolerance", "result", "fwd ms", "bwd ms"]


@dataclass
class Inputs:
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    grad_y: torch.Tensor

    def to(self, dtype: torch.dtype) -> Inputs:
        return Inputs(*(t.to(dtype) for t in (self.x, self.weight, self.bias, self.grad_y)))


@dataclass
class Measurement:
    y: torch.Tensor
    grad_x: torch.Tensor
    grad_w: torch.Tensor
    forward_s: float
    backward_s: float

    def errors(self, expected: Measurement) -> tuple[float, float, float]:
        return tuple(bench.relative_error(got, want) for got, want in (
            (self.y, expected.y), (self.grad_x, expected.grad_x), (self.grad_w, expected.grad_w)))


def worst(errors: list[float]) -> float:
    """The largest error, NaN above all (a plain max() drops a NaN that is not first)."""
    return max(errors, key=lambda error: math.inf if math.isnan(error) else error)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("knnconv: --device cuda requested but CUDA is not available")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_inputs(generator: torch.Generator, plan: KNNConvPlan, batch: int,
                  device: torch.device) -> Inputs:
    """float64 inputs scaled so that outputs stay O(1) whatever the fan-in."""
    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(device)

    return Inputs(normal(batch, plan.cin, plan.nin), normal(plan.cout, plan.q,
                  scale=(plan.cin * plan.k) ** -0.5), normal(plan.cout, scale=0.1),
                  normal(batch, plan.cout, plan.nout))


def forward_backward(plan: KNNConvPlan, backend: str, inputs: Inputs,
                     repeats: int) -> Measurement:
    """Outputs of the last of ``repeats`` forward+backward passes and their median times."""
    device = inputs.x.device
    forward_times, backward_times = [], []
    for _ in range(repeats):
        x = inputs.x.detach().clone().requires_grad_()
        weight = inputs.weight.detach().clone().requires_grad_()
        bias = inputs.bias.detach().clone().requires_grad_()
        synchronize(device)
        start = time.perf_counter()
        y = knn_conv(x, weight, bias, plan, backend=backend)
        synchronize(device)
        middle = time.perf_counter()
        y.backward(inputs.grad_y)
        synchronize(device)
        forward_times.append(middle - start)
        backward_times.append(time.perf_counter() - middle)
    return Measurement(y.detach(), x.grad, weight.grad, statistics.median(forward_times),
                       statistics.median(backward_times))


def reference_measurement(plan: KNNConvPlan, inputs: Inputs) -> Measurement:
    return forward_backward(plan, "reference", inputs.to(torch.float64), repeats=1)


def load_backends() -> list[KNNConvOps]:
    """Every registered backend (whether one can serve a call is asked per call)."""
    return [get_ops(name) for name in available_backends()]


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    for line in [headers, ["-" * width for width in widths], *rows]:
        print("  ".join(str(cell).rjust(width) for cell, width in zip(line, widths, strict=True)))


def print_skips(unsupported: Counter, cases: int) -> None:
    for (name, reason), count in sorted(unsupported.items()):
        print(f"skipped {name} on {count} of {cases} cases: {reason}")


def random_geometry(generator: torch.Generator, nin: int, nout: int, k: int,
                    padding: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """KNN tables of random points, with a fraction of neighbours replaced by padding.

    Where ``k > nin`` the last ``k - nin`` slots are padding (index ``nin``, cell 0) on a
    kernel grid sized for ``k``: the tables knn_geometry builds then, appended here because
    knn_geometry warns about such a ``k`` as a likely mistake, and the check means it.
    """
    in_coords = torch.rand(nin, 2, generator=generator, dtype=torch.float64)
    out_coords = torch.rand(nout, 2, generator=generator, dtype=torch.float64)
    real = min(k, nin)
    knn_real, rf_real, v = knn_geometry(in_coords, out_coords, real,
                                        ref_side=math.isqrt(k - 1) + 1)
    knn_indices = torch.full((k, nout), nin, dtype=torch.int64)
    knn_indices[:real] = knn_real
    rf_index = torch.zeros((nout, k), dtype=torch.int64)
    rf_index[:, :real] = rf_real
    knn_indices[torch.rand(knn_indices.shape, generator=generator) < padding] = nin
    return knn_indices, rf_index, v


def measure(ops: KNNConvOps, plan: KNNConvPlan, inputs: Inputs, dtype: torch.dtype,
            device: torch.device, repeats: int, unsupported: Counter) -> Measurement | None:
    """ops' forward+backward on ``inputs`` in ``dtype``, or None (counted in ``unsupported``)
    where ops cannot serve the call."""
    reason = ops.unsupported_reason(plan, device, dtype)
    if reason is not None:
        unsupported[ops.name, reason] += 1
        return None
    return forward_backward(plan, ops.name, inputs.to(dtype), repeats)


def check(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    dtypes = selected_dtypes(args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    cases = []
    for nin, nout, k, cin, cout, padding in CHECK_GEOMETRIES:
        knn_indices, rf_index, v = random_geometry(generator, nin, nout, k, padding)
        plan = make_plan(knn_indices, rf_index, nin=nin, v=v, cin=cin, cout=cout)
        cases.append((plan, random_inputs(generator, plan, args.batch, device)))

    backends = load_backends()
    unsupported: Counter = Counter()
    rows, failed = [], False
    for dtype in dtypes:
        expected = [reference_measurement(plan, inputs.to(dtype)) for plan, inputs in cases]
        for ops in backends:
            errors, seconds = [], 0.0
            for (plan, inputs), reference in zip(cases, expected, strict=True):
                measured = measure(ops, plan, inputs, dtype, device, args.repeats, unsupported)
                if measured is None:
                    continue
                errors.append(measured.errors(reference))
                seconds += measured.forward_s + measured.backward_s
            if not errors:
                continue
            worst_errors = [worst(column) for column in zip(*errors, strict=True)]
            passed = all(error <= TOLERANCES[dtype] for error in worst_errors)
            failed |= not passed
            rows.append([ops.name, dtype_name(dtype), *(f"{e:.2e}" for e in worst_errors),
                         f"{TOLERANCES[dtype]:.0e}", "PASS" if passed else "FAIL",
                         f"{seconds * 1e3:.2f}"])

    print(f"knnconv {__version__} check on {device}, torch {torch.__version__}, "
          f"{len(cases)} geometries, batch {args.batch}")
    print_table(CHECK_HEADERS, rows)
    print_skips(unsupported, len(cases) * len(dtypes))
    print("FAIL" if failed else "all checks passed")
    return int(failed)


def foveated_layers(args: argparse.Namespace) -> list[KNNConvPlan]:
    """A conv with K=49 from the sensor to level 1, then K=9 convs doubling the channels."""
    levels = foveated_stack(args.resolution, args.a, args.levels)
    plans, cin, cout, k = [], 3, args.channels, 49
    for in_coords, out_coords in pairwise(levels):
        knn_indices, rf_index, v = knn_geometry(in_coords, out_coords, k)
        plans.append(make_plan(knn_indices, rf_index, nin=len(in_coords), v=v, cin=cin,
                               cout=cout))
        cin, cout, k = cout, 2 * cout, 9
    return plans


def run(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    dtypes = selected_dtypes(args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    backends = load_backends()
    unsupported: Counter = Counter()
    plans = foveated_layers(args)
    rows, disagreeing = [], set()
    for layer, plan in enumerate(plans):
        inputs = random_inputs(generator, plan, args.batch, device)
        shape = [str(layer), f"{plan.nin}->{plan.nout}", str(plan.k), str(plan.v),
                 f"{plan.cin}->{plan.cout}"]
        for dtype in dtypes:
            expected = reference_measurement(plan, inputs.to(dtype))
            for ops in backends:
                measured = measure(ops, plan, inputs, dtype, device, args.repeats, unsupported)
                if measured is None:
                    continue
                errors = measured.errors(expected)
                passed = all(error <= TOLERANCES[dtype] for error in errors)
                if not passed:
                    disagreeing.add(ops.name)
                rows.append([*shape, ops.name, dtype_name(dtype), *(f"{e:.2e}" for e in errors),
                             f"{TOLERANCES[dtype]:.0e}", "PASS" if passed else "FAIL",
                             f"{measured.forward_s * 1e3:.2f}",
                             f"{measured.backward_s * 1e3:.2f}"])

    print(f"knnconv {__version__} on {device}, torch {torch.__version__}: foveated stack "
          f"resolution {args.resolution}, a={args.a}, {len(plans)} layers, batch {args.batch}, "
          f"median of {args.repeats}")
    print_table(RUN_HEADERS, rows)
    print_skips(unsupported, len(plans) * len(dtypes))
    if disagreeing:
        print(f"backends disagreeing with the reference: {', '.join(sorted(disagreeing))}")
        return 1
    print("all backends agree with the reference")
    return 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def selected_dtypes(names: list[str]) -> list[torch.dtype]:
    return list(DTYPES.values()) if "all" in names else [DTYPES[name] for name in names]


def build_parser() -> argparse.ArgumentParser:
    positive_int = int_at_least(1)
    parser = argparse.ArgumentParser(
        prog="knnconv", description="KNN convolution: check every backend against the "
        "reference, or run a foveated layer stack through every backend (the default).")
    commands = parser.add_subparsers(dest="command")

    def add_command(name: str, help_text: str, *, dtypes: list[str], repeats: int, batch: int):
        command = commands.add_parser(name, help=help_text, description=help_text)
        command.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        command.add_argument("--dtype", nargs="+", choices=[*DTYPES, "all"], default=dtypes,
                             help=f"compute dtypes (default: {' '.join(dtypes)})")
        command.add_argument("--batch", type=positive_int, default=batch)
        command.add_argument("--repeats", type=positive_int, default=repeats,
                             help="timed passes per backend; the median is reported")
        command.add_argument("--seed", type=int, default=0)
        return command

    add_command("check", "compare every backend with the float64 reference on small geometries",
                dtypes=["all"], repeats=3, batch=3)
    run_command = add_command(
        "run", "forward+backward of a foveated layer stack with every backend (the default)",
        # The native CUDA kernels compute in half precision only: bfloat16 exercises them.
        dtypes=["float32", "bfloat16"], repeats=5, batch=8)
    run_command.add_argument("--resolution", type=positive_int, default=64,
                             help="side of the image the sensor replaces")
    run_command.add_argument("--a", type=float, default=0.5, help="foveal magnification offset")
    run_command.add_argument("--levels", type=int_at_least(2), default=5,
                             help="layouts in the stack (one layer between each two)")
    run_command.add_argument("--channels", type=positive_int, default=32,
                             help="output channels of the first layer; each next one doubles")
    bench_help = "time every backend against a roofline floor (JSON, CSV and PNG results)"
    bench.add_arguments(commands.add_parser("bench", help=bench_help, description=bench_help))
    demo_help = ("train a small foveated KNN network on scikit-learn's handwritten digits and "
                 "plot it (needs the demo extra: pip install 'knnconv[demo]')")
    demo_command = commands.add_parser("demo", help=demo_help, description=demo_help)
    demo_command.add_argument("--epochs", type=positive_int, default=demo.DEFAULT_EPOCHS)
    demo_command.add_argument("--batch-size", type=positive_int, default=demo.DEFAULT_BATCH_SIZE)
    demo_command.add_argument("--seed", type=int, default=0,
                              help="seeds the weights, the split and the shuffling")
    demo_command.add_argument("--out", type=Path, default=Path("out") / "demo.png",
                              metavar="PNG", help="where to write the figure (default "
                              "out/demo.png; its folder is made)")
    demo_command.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    demo_command.add_argument("--limit", type=int_at_least(demo.MIN_DIGITS), metavar="N",
                              help="use only the first N of the 1797 digits, for a quick run")
    return parser


def run_demo(args: argparse.Namespace) -> int:
    return demo.run(args, pick_device(args.device))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["run"])
    commands = {"check": check, "run": run, "bench": bench.run, "demo": run_demo}
    return commands[args.command](args)
