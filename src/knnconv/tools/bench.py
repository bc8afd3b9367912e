"""Benchmark the backends on real layer geometries, against a roofline floor and fovi's kernels.

``knnconv bench`` (also ``python -m knnconv.bench``) times every layer x batch x dtype x
backend x mode (forward, train, and for the native backends train_graph and, for cuda,
opt-in train_compiled; see MODES) cell as a user sees it, host overhead included; puts each
time against a roofline floor built from ceilings measured in the same run, and against
fovi's kernels (fovi 2.4.0's knn_cuda, as measured in bench/fovi_kernel_times.json); and
writes <name>.json, <name>.csv and <name>.png.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import context, models
from ..functional import knn_conv_with_backend
from ..geometry import foveated_stack, knn_geometry
from ..ops import available_backends
from ..ops.timing import (
    CellInputs,
    device_description,
    graph_replay_ms,
    random_inputs,
    release_memory,
    time_calls,
    unsupported_reason,
)
from ..plan import KNNConvPlan, make_plan
from . import fovi_ddp, fovi_models
from .options import comma_list, default_name, int_at_least

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
MODES = ("forward", "train", "train_graph", "train_compiled", "train_no_dx",
         "train_graph_no_dx")
# train_graph: the training step captured once as a CUDA graph and replayed, i.e. the GPU
# time without the host path. train_compiled: the training step of the layer under
# torch.compile(mode="reduce-overhead"), which replays its forward and its backward as CUDA
# graphs (PyTorch's CUDA-graph trees): what a user who compiles gets, host path included.
# Both: CUDA devices only; train_graph for the native backends (cuda, triton and auto's
# choice of them), train_compiled for cuda and opt-in (each cell compiles).
# train_no_dx, train_graph_no_dx (opt-in): train and train_graph with an input that needs no
# gradient, the image layer's step as a network trains it.
GRAPH_MODES = ("train_graph", "train_compiled", "train_graph_no_dx")
NATIVE_BACKENDS = ("cuda", "triton", "auto")
GRAPHED_BACKENDS = {"train_graph": NATIVE_BACKENDS, "train_compiled": ("cuda",),
                    "train_graph_no_dx": NATIVE_BACKENDS}
NO_DX_MODES = ("train_no_dx", "train_graph_no_dx")
DEFAULT_MODES = ("forward", "train", "train_graph")
# The fovi figure a mode's time compares with: a compiled step is what a user who compiles
# runs instead of fovi's eager step; a graph replay (GPU time only) compares with none.
FOVI_MODE = {"forward": "forward", "train": "train", "train_compiled": "train"}
# Defaults sized to the device: the published batches on a GPU; on a CPU, batches and repeats
# that finish the built-in layers in minutes, in float32 (the CPU's fast dtype).
DEVICE_DEFAULTS = {
    "cuda": {"batches": [128, 512, 2048], "dtypes": ["float16"], "warmup": 3, "repeats": 20},
    "cpu": {"batches": [2, 8], "dtypes": ["float32"], "warmup": 1, "repeats": 5},
}
DEFAULT_OUT = Path("out") / "bench"
# Present only in a source checkout (src/knnconv/tools/bench.py ->
# <repo>/bench/fovi_kernel_times.json).
REPO_FOVI_TIMES = Path(__file__).resolve().parents[3] / "bench" / "fovi_kernel_times.json"
# fovi's kernels were measured in fp16: their times only compare with fp16 cells.
FOVI_DTYPE = "float16"

# Roofline: operands count 2 bytes per element whatever the dtype, as fovi's table's floor did,
# so floors compare across dtypes and with that table.
FLOOR_ELEMENT_BYTES = 2
TABLE_ELEMENT_BYTES = 4  # input_linear and weight_linear are int32 [Nout, P64]
TRAIN_FLOOR_FACTOR = 3  # forward + grad-input + grad-weight, each at least a forward's cost
COPY_CEILING_BYTES = 2 * 2**30
MATMUL_CEILING_N = 8192
CEILING_WARMUP, CEILING_REPEATS = 3, 10

# (name, input level, output level, K, Cin, Cout) on foveated_stack(levels=6): an AlexNet-like
# and a ResNet-18-like stack with the channel counts and kernel sizes of the published models.
BUILTIN_LAYERS = (
    ("builtin-alexnet:layers.0.conv", 0, 1, 121, 3, 96),
    ("builtin-alexnet:layers.1.conv", 2, 2, 25, 96, 256),
    ("builtin-alexnet:layers.2.conv", 3, 3, 9, 256, 384),
    ("builtin-alexnet:layers.3.conv", 3, 3, 9, 384, 384),
    ("builtin-alexnet:layers.4.conv", 3, 3, 9, 384, 256),
    ("builtin-resnet:conv1", 0, 1, 49, 3, 64),
    ("builtin-resnet:layer1.0.conv1", 2, 2, 9, 64, 64),
    ("builtin-resnet:layer2.0.conv1", 2, 3, 9, 64, 128),
    ("builtin-resnet:layer3.0.conv1", 3, 4, 9, 128, 256),
    ("builtin-resnet:layer4.0.conv1", 4, 5, 9, 256, 512),
)
BUILTIN_LEVELS = 6

ROW_FIELDS = (
    "layer", "batch", "dtype", "backend", "mode", "status", "backend_ran", "median_ms",
    "floor_ms", "pct_of_floor", "fovi_ms", "speedup_vs_fovi", "rel_err", "cin", "cout", "k",
    "v", "nin", "nout", "p64", "padding_fraction", "note",
)


@dataclass(frozen=True)
class BenchLayer:
    """One convolution layer to time: its name, raw neighbour tables and channel counts."""

    name: str
    knn_indices: torch.Tensor  # integer [K, Nout]; Nin marks the padding neighbour
    rf_index: torch.Tensor  # integer [Nout, K]
    nin: int
    v: int
    cin: int
    cout: int

    def plan(self) -> KNNConvPlan:
        return make_plan(self.knn_indices, self.rf_index, nin=self.nin, v=self.v, cin=self.cin,
                         cout=self.cout)


def layer_name(model: str, layer: str) -> str:
    """``model:layer`` without the ``backbone.`` wrapper prefix, as fovi's times table names it.

    Only ``backbone.`` goes: that table keeps ``embeddings.patch_embeddings`` whole.
    """
    return f"{model}:{layer.removeprefix('backbone.')}"


def _selected(name: str, filters: list[str] | None) -> bool:
    return not filters or any(part in name for part in filters)


def load_geometry_dir(directory: Path, filters: list[str] | None = None, *,
                      repeats: bool = False) -> list[BenchLayer]:
    """The conv layers of a geometry set (index.json + one npz per distinct table pair), in
    index order.

    Pooling entries and entries without tables are skipped; ``filters`` keeps the layers whose
    name contains any of its substrings. Unless ``repeats``, a kept entry that repeats an
    earlier one's tables and channel counts is skipped too: it would time the same (fovi's
    times table lists only the first of each); a whole network needs them all.
    """
    index = json.loads((directory / "index.json").read_text())
    layers = []
    seen = set()
    for entry in index["layers"]:
        if entry.get("kind") != "conv" or not entry.get("npz"):
            continue
        name = layer_name(entry["model"], entry["layer"])
        cell = (entry["npz"], entry["Cin"], entry["Cout"])
        if not _selected(name, filters) or (cell in seen and not repeats):
            continue
        seen.add(cell)
        with np.load(directory / entry["npz"]) as tables:
            knn_indices = torch.from_numpy(tables["knn_indices_pad_token"])
            rf_index = torch.from_numpy(tables["rf_index"])
            nin, v = int(tables["nin"]), int(tables["v"])
        found = (*knn_indices.shape, nin, v)
        listed = (entry["K"], entry["Nout"], entry["Nin"], entry["V"])
        if found != listed:
            raise ValueError(f"{name}: index.json lists (K, Nout, Nin, V) = {listed} but "
                             f"{entry['npz']} holds {found}")
        layers.append(BenchLayer(name, knn_indices, rf_index, nin, v, entry["Cin"],
                                 entry["Cout"]))
    return layers


def builtin_layers(filters: list[str] | None = None) -> list[BenchLayer]:
    """The built-in AlexNet-like and ResNet-like layers on a synthetic foveated stack."""
    chosen = [spec for spec in BUILTIN_LAYERS if _selected(spec[0], filters)]
    if not chosen:
        return []
    stack = foveated_stack(levels=BUILTIN_LEVELS)
    layers = []
    for name, level_in, level_out, k, cin, cout in chosen:
        knn_indices, rf_index, v = knn_geometry(stack[level_in], stack[level_out], k)
        layers.append(BenchLayer(name, knn_indices, rf_index, len(stack[level_in]), v, cin, cout))
    return layers


# Three-channel stems with thousands of nodes, a class the published geometry sets lack: a
# stride-1 image layer (K = 49 over a 14 x 14 kernel grid, Cout 64) on foveated sensors of
# 3,321 and 4,241 samples (images of 64 and 72 pixels a side), as in the low-resolution fovi
# ResNet-18 stems. (name, sensor resolution)
GENERATED_STEMS = (("generated:stem-res64-k49", 64), ("generated:stem-res72-k49", 72))
STEM_K, STEM_GRID, STEM_CHANNELS = 49, 14, (3, 64)


def generated_stems(filters: list[str] | None = None) -> list[BenchLayer]:
    """GENERATED_STEMS' layers, built by knnconv.geometry (those ``filters`` keep)."""
    layers = []
    for name, resolution in GENERATED_STEMS:
        if not _selected(name, filters):
            continue
        [sensor] = foveated_stack(resolution=resolution, levels=1)
        knn_indices, rf_index, v = knn_geometry(sensor, sensor, STEM_K, ref_side=STEM_GRID)
        layers.append(BenchLayer(name, knn_indices, rf_index, len(sensor), v, *STEM_CHANNELS))
    return layers


def load_fovi_times(path: Path) -> dict[tuple[str, int, str], float]:
    """fovi's kernels' fp16 times by (layer, batch, mode), from a bench/fovi_kernel_times.json
    list."""
    times = {}
    for entry in json.loads(path.read_text()):
        for mode, key in (("forward", "fovi_fwd_ms"), ("train", "fovi_train_ms")):
            times[(entry["layer"], int(entry["batch"]), mode)] = float(entry[key])
    return times


COMPILED_WARMUP = 3


@contextlib.contextmanager
def reduce_overhead(function: Callable, **options):
    """``function`` under torch.compile(mode="reduce-overhead", dynamic=False), compiled
    afresh (Dynamo keeps a handful of compilations per code object: a benchmark compiling
    many shapes would otherwise fall back to eager) and its recorded graphs and their memory
    pool freed after the block; under the graph_replay setting, as its replayed steps want."""
    torch.compiler.reset()
    try:
        with context.using(graph_replay=True):
            yield torch.compile(function, mode="reduce-overhead", dynamic=False, **options)
    finally:
        torch.compiler.reset()


def compiled_train_ms(plan: KNNConvPlan, inputs: CellInputs, backend: str,
                      device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median ms of a training step (forward, then the gradients of x, weight and bias) of
    the layer compiled with torch.compile(mode="reduce-overhead"), timed as a user sees it."""
    def layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return knn_conv_with_backend(x, weight, bias, plan, backend)[0]

    with reduce_overhead(layer, fullgraph=True) as compiled:
        def step() -> None:
            torch.compiler.cudagraph_mark_step_begin()
            compiled(inputs.x, inputs.weight, inputs.bias).backward(inputs.grad_y)

        return time_calls(step, device, warmup=max(COMPILED_WARMUP, warmup), repeats=repeats,
                          reset=inputs.clear_grads)[0]


def replayed_ms_per_call(call: Callable[[], Any], device: torch.device, *, calls: int = 20,
                         warmup: int = 2, repeats: int = 5) -> float:
    """GPU ms of one ``call``: ``calls`` of them captured as one CUDA graph, the median of
    ``repeats`` replays divided by ``calls`` (a replay issues no host launches, so a short
    kernel is not timed at the launch rate)."""
    return graph_replay_ms(lambda: [call() for _ in range(calls)], device, warmup=warmup,
                           repeats=repeats)[0] / calls


def write_rows(path: str | Path, rows: list[dict[str, Any]], device: torch.device,
               **meta: Any) -> None:
    """A benchmark script's results as JSON: the device's name, ``meta`` and the rows."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    Path(path).write_text(json.dumps({"device": name, **meta, "rows": rows}, indent=1))
    print(f"wrote {path}")


def _copy_ms(device: torch.device) -> float:
    src = torch.randn(COPY_CEILING_BYTES // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    return time_calls(lambda: dst.copy_(src), device, warmup=CEILING_WARMUP,
                      repeats=CEILING_REPEATS)[0]


def _matmul_ms(device: torch.device) -> float:
    n = MATMUL_CEILING_N
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    product = torch.empty_like(a)
    return time_calls(lambda: torch.matmul(a, b, out=product), device, warmup=CEILING_WARMUP,
                      repeats=CEILING_REPEATS)[0]


def measure_ceilings(device: torch.device) -> dict[str, Any]:
    """Device-copy bandwidth (GB/s, read + write) and dense bf16 matmul rate (TFLOP/s).

    Measured only on CUDA; elsewhere both are None and so are the floors built on them.
    """
    if device.type != "cuda":
        return {"copy_gbps": None, "matmul_tflops": None}
    copy_ms = _copy_ms(device)
    matmul_ms = _matmul_ms(device)
    release_memory(device)  # hand the ceiling buffers back before the cells allocate
    return {
        "copy_gbps": 2 * COPY_CEILING_BYTES / copy_ms / 1e6,
        "matmul_tflops": 2 * MATMUL_CEILING_N**3 / matmul_ms / 1e9,
        "copy_bytes": COPY_CEILING_BYTES,
        "matmul_n": MATMUL_CEILING_N,
    }


def forward_floor_ms(plan, batch: int, ceilings: dict[str, Any]) -> float | None:
    """max(FLOPs / matmul ceiling, minimum bytes / copy ceiling) of one forward, in ms.

    ``plan`` needs cin, cout, k, v, nin, nout and p64. The FLOPs contract over Cin*K slots (not
    the P64 alignment slack); the minimum bytes are x, weight and y once each plus the two int32
    tables.
    """
    if ceilings["matmul_tflops"] is None:
        return None
    flops = 2 * batch * plan.nout * plan.cin * plan.k * plan.cout
    elements = batch * plan.cin * plan.nin + plan.cout * plan.cin * plan.v
    elements += batch * plan.cout * plan.nout
    nbytes = FLOOR_ELEMENT_BYTES * elements + 2 * TABLE_ELEMENT_BYTES * plan.nout * plan.p64
    return max(flops / ceilings["matmul_tflops"] / 1e9, nbytes / ceilings["copy_gbps"] / 1e6)


def train_floor_ms(plan, batch: int, ceilings: dict[str, Any], *,
                   grad_input: bool = True) -> float | None:
    """The training step's floor: the forward's (see :func:`forward_floor_ms`) once for the
    forward, once for the weight gradient and, where x needs one, once for grad-input."""
    forward = forward_floor_ms(plan, batch, ceilings)
    if forward is None:
        return None
    return forward * (TRAIN_FLOOR_FACTOR if grad_input else TRAIN_FLOOR_FACTOR - 1)


def mode_floor_ms(plan, batch: int, mode: str, ceilings: dict[str, Any]) -> float | None:
    """The floor of a mode's cell: the forward's, or the training step's (without its
    grad-input pass in the no-dx modes)."""
    if mode == "forward":
        return forward_floor_ms(plan, batch, ceilings)
    return train_floor_ms(plan, batch, ceilings, grad_input=mode not in NO_DX_MODES)


def reads_image(in_channels: int) -> bool:
    """Whether a network layer is its first, reading the RGB image: nothing needs that
    input's gradient, so its training step computes none."""
    return in_channels <= 3


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (NaN anywhere gives NaN, never a pass;
    the absolute error when expected is all zeros)."""
    expected = expected.double()
    error = (actual.double() - expected).norm().item()
    scale = expected.norm().item()
    return error / scale if scale > 0 else error


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(value) for value in values))


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class Benchmark:
    """Runs the cells of a set of layers and collects one row per cell."""

    def __init__(self, args: argparse.Namespace, device: torch.device, backends: list[str],
                 ceilings: dict[str, Any], fovi_times: dict[tuple[str, int, str], float],
                 name_width: int) -> None:
        self.args, self.device, self.backends = args, device, backends
        self.ceilings, self.fovi_times = ceilings, fovi_times
        self.name_width = name_width
        self.rows: list[dict[str, Any]] = []
        self._reported_skips: set[tuple[str, str]] = set()

    def print_header(self) -> None:
        print(f"{'layer':<{self.name_width}} {'B':>5} {'dtype':<8} {'backend':<13} "
              f"{'mode':<7} {'median_ms':>10} {'floor_ms':>9} {'%floor':>7} {'vs fovi':>9}")

    def run(self, layers: list[BenchLayer]) -> None:
        for layer in layers:
            plan = layer.plan()
            for batch in self.args.batches:
                for dtype_name in self.args.dtypes:
                    self._run_group(layer.name, plan, batch, dtype_name)
                    release_memory(self.device)

    def _modes(self, backend: str) -> list[str]:
        """The requested modes that apply to ``backend`` (GRAPHED_BACKENDS, on a GPU)."""
        return [mode for mode in self.args.modes if mode not in GRAPH_MODES or (
            self.device.type == "cuda" and backend in GRAPHED_BACKENDS[mode])]

    def _run_group(self, name: str, plan: KNNConvPlan, batch: int, dtype_name: str) -> None:
        """All backends and modes of one (layer, batch, dtype), on one set of inputs."""
        dtype = DTYPES[dtype_name]
        cell = (name, plan, batch, dtype_name)
        try:
            # past the image layer, x and grad_y come in the storage KNN layers pass on
            inputs = random_inputs(plan, batch, dtype, self.device,
                                   channels_last=not reads_image(plan.cin))
        except torch.cuda.OutOfMemoryError:
            for backend in self.backends:
                for mode in self._modes(backend):
                    self._record(*cell, backend, mode, "oom", note="allocating the inputs")
            return
        reference, check_note = self._reference_output(plan, inputs)
        for backend in self.backends:
            reason = unsupported_reason(backend, plan, self.device, dtype)
            if reason is not None:
                self._report_skip(backend, reason)
                for mode in self._modes(backend):
                    self._record(*cell, backend, mode, "unsupported", note=reason)
                continue
            for mode in self._modes(backend):
                checked = reference if mode == "forward" else None
                try:
                    median_ms, ran, rel_err = self._time_cell(plan, inputs, backend, mode,
                                                              checked)
                except torch.cuda.OutOfMemoryError:
                    self._record(*cell, backend, mode, "oom")
                except RuntimeError as exc:  # e.g. a failed first-use check; later cells still run
                    self._record(*cell, backend, mode, "error", note=f"{type(exc).__name__}: {exc}")
                else:
                    note = check_note if mode == "forward" else None
                    self._record(*cell, backend, mode, "ok", median_ms=median_ms, backend_ran=ran,
                                 rel_err=rel_err, note=note)
                inputs.clear_grads()
                release_memory(self.device)

    def _reference_output(self, plan: KNNConvPlan,
                          inputs: CellInputs) -> tuple[torch.Tensor | None, str | None]:
        """The float64 reference forward on the same device, when --check asks and it fits."""
        if not self.args.check or "forward" not in self.args.modes:
            return None, None
        batch = inputs.x.shape[0]
        # The reference's largest temporary is its float64 binned tensor [B, Nout, Cin*V].
        needed_gb = batch * plan.nout * plan.q * 8 / 1e9
        if needed_gb > self.args.max_ref_gb:
            return None, (f"check skipped: the float64 reference needs {needed_gb:.1f} GB "
                          f"> --max-ref-gb {self.args.max_ref_gb:g}")
        try:
            with torch.no_grad():
                return knn_conv_with_backend(inputs.x.double(), inputs.weight.double(),
                                             inputs.bias.double(), plan, "reference")[0], None
        except torch.cuda.OutOfMemoryError:
            return None, "check skipped: the float64 reference ran out of memory"

    def _time_cell(self, plan: KNNConvPlan, inputs: CellInputs, backend: str, mode: str,
                   reference: torch.Tensor | None) -> tuple[float, str, float | None]:
        """(median ms, backend that ran, forward rel_err against ``reference`` or None)."""
        x, weight, bias = inputs.x, inputs.weight, inputs.bias
        timing = {"warmup": self.args.warmup, "repeats": self.args.repeats}
        trained_x = x.detach() if mode in NO_DX_MODES else x

        def train_step() -> str:
            y, ran = knn_conv_with_backend(trained_x, weight, bias, plan, backend)
            y.backward(inputs.grad_y)
            return ran

        if mode in ("train", "train_no_dx"):
            median_ms, ran = time_calls(train_step, self.device, reset=inputs.clear_grads,
                                        **timing)
            return median_ms, ran, None
        if mode in ("train_graph", "train_graph_no_dx"):  # auto chooses as for replays
            with context.using(graph_replay=True):
                return (*graph_replay_ms(train_step, self.device, reset=inputs.clear_grads,
                                         **timing), None)
        if mode == "train_compiled":  # a named backend (cuda) serves or raises, never another
            return compiled_train_ms(plan, inputs, backend, self.device, **timing), backend, None

        def forward_step() -> tuple[torch.Tensor, str]:
            with torch.no_grad():
                return knn_conv_with_backend(x, weight, bias, plan, backend)

        median_ms, (y, ran) = time_calls(forward_step, self.device, **timing)
        return median_ms, ran, None if reference is None else relative_error(y, reference)

    def _report_skip(self, backend: str, reason: str) -> None:
        if (backend, reason) not in self._reported_skips:
            self._reported_skips.add((backend, reason))
            print(f"skipping backend {backend!r} where it cannot serve: {reason}")

    def _record(self, name: str, plan: KNNConvPlan, batch: int, dtype_name: str, backend: str,
                mode: str, status: str, *, median_ms: float | None = None,
                backend_ran: str | None = None, rel_err: float | None = None,
                note: str | None = None) -> None:
        floor_ms = mode_floor_ms(plan, batch, mode, self.ceilings)
        fovi_ms = (self.fovi_times.get((name, batch, FOVI_MODE.get(mode)))
                     if dtype_name == FOVI_DTYPE else None)
        measured = median_ms is not None
        row = {
            "layer": name, "batch": batch, "dtype": dtype_name, "backend": backend, "mode": mode,
            "status": status, "backend_ran": backend_ran, "median_ms": median_ms,
            "floor_ms": floor_ms,
            "pct_of_floor": 100 * floor_ms / median_ms if measured and floor_ms else None,
            "fovi_ms": fovi_ms,
            "speedup_vs_fovi": fovi_ms / median_ms if measured and fovi_ms else None,
            "rel_err": rel_err, "cin": plan.cin, "cout": plan.cout, "k": plan.k, "v": plan.v,
            "nin": plan.nin, "nout": plan.nout, "p64": plan.p64,
            "padding_fraction": plan.padding_fraction, "note": note,
        }
        self.rows.append(row)
        measured_text = _fmt(median_ms, ".3f") if measured else status
        line = (f"{name:<{self.name_width}} {batch:>5} {dtype_name:<8} {backend:<13} {mode:<7} "
                f"{measured_text:>10} {_fmt(floor_ms, '.3f'):>9} "
                f"{_fmt(row['pct_of_floor'], '.3g'):>7} {_fmt(row['speedup_vs_fovi'], '.3g'):>9}")
        if rel_err is not None:
            line += f"  rel_err {rel_err:.1e}"
        if note is not None and status != "unsupported":  # unsupported reasons print once
            line += f"  ({note})"
        print(line, flush=True)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Geometric means per dtype: % of floor per backend/mode, and the speedup of each
    training-step mode with a fovi figure (eager, compiled) over fovi's training step
    per backend, each over the cells every backend completed, so backends are compared on
    one set."""
    ok = [row for row in rows if row["status"] == "ok"]
    done = defaultdict(set)  # (dtype, mode, layer, batch) -> the backends that completed it
    for row in ok:
        done[(row["dtype"], row["mode"], row["layer"], row["batch"])].add(row["backend"])
    backends = defaultdict(set)
    for (dtype, mode, _, _), names in done.items():
        backends[(dtype, mode)] |= names

    def common(row: dict[str, Any]) -> bool:
        key = (row["dtype"], row["mode"])
        return done[(*key, row["layer"], row["batch"])] == backends[key]

    pct = defaultdict(list)
    speedup = defaultdict(list)
    times = defaultdict(list)
    for row in filter(common, ok):
        times[(row["dtype"], row["backend"], row["mode"])].append(row["median_ms"])
        if row["pct_of_floor"] is not None:
            pct[(row["dtype"], row["backend"], row["mode"])].append(row["pct_of_floor"])
        if row["mode"] != "forward" and row["speedup_vs_fovi"] is not None:
            speedup[(row["dtype"], row["backend"], row["mode"])].append(row["speedup_vs_fovi"])
    statuses = defaultdict(int)
    for row in rows:
        statuses[row["status"]] += 1
    return {
        "statuses": dict(statuses),
        "median_ms_geomean": [
            {"dtype": dtype, "backend": backend, "mode": mode, "geomean": geomean(values),
             "cells": len(values)}
            for (dtype, backend, mode), values in times.items()
        ],
        "pct_of_floor_geomean": [
            {"dtype": dtype, "backend": backend, "mode": mode, "geomean": geomean(values),
             "cells": len(values)}
            for (dtype, backend, mode), values in pct.items()
        ],
        "train_speedup_vs_fovi_geomean": [
            {"dtype": dtype, "backend": backend, "mode": mode, "geomean": geomean(values),
             "cells": len(values)}
            for (dtype, backend, mode), values in speedup.items()
        ],
    }


def print_summary(summary: dict[str, Any]) -> None:
    print("\ncells by status: " + ", ".join(f"{n} {s}" for s, n in summary["statuses"].items()))
    print("(geometric means over the cells every backend completed, per dtype and mode)")
    for entry in summary["median_ms_geomean"]:
        print(f"geomean time        {entry['dtype']:<9} {entry['backend']:<13} "
              f"{entry['mode']:<11} {entry['geomean']:8.3f} ms ({entry['cells']} cells)")
    for entry in summary["pct_of_floor_geomean"]:
        print(f"geomean % of floor  {entry['dtype']:<9} {entry['backend']:<13} "
              f"{entry['mode']:<11} {entry['geomean']:7.2f}%  ({entry['cells']} cells)")
    for entry in summary["train_speedup_vs_fovi_geomean"]:
        print(f"geomean speedup vs fovi's train    {entry['dtype']:<9} {entry['backend']:<13} "
              f"{entry['mode']:<14} {entry['geomean']:6.3g}x  ({entry['cells']} cells)")


def plot_rows(rows: list[dict[str, Any]], path: Path, *, device: str | None = None) -> bool:
    """% of floor (and speedup vs fovi's kernels, when known) per cell and backend/mode, one row of
    panels per model (the part of the layer name before ':'); False if matplotlib is missing,
    so a long GPU run still writes its json and csv.

    Cells run down the y axis, so their names read horizontally at a legible size however
    many there are; the figure grows with them."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import NullFormatter
    except ImportError:
        return False
    cells = list(dict.fromkeys((r["layer"], r["batch"], r["dtype"]) for r in rows))
    dtypes = list(dict.fromkeys(dtype for _, _, dtype in cells))
    by_model = defaultdict(list)  # model -> its cells, in the order they ran
    for cell in cells:
        by_model[cell[0].partition(":")[0]].append(cell)

    def cell_label(cell: tuple[str, int, str]) -> str:
        layer, batch, dtype = cell
        # The panel's title names the model and the figure's the dtype, where there is one.
        label = f"{layer.partition(':')[2] or layer} B={batch}"
        return label if len(dtypes) == 1 else f"{label} {dtype}"

    # without ceilings (they are measured on CUDA only) there is no floor: plot the times
    has_floor = any(r["pct_of_floor"] is not None for r in rows)
    panels = [("pct_of_floor", "% of roofline floor") if has_floor
              else ("median_ms", "median time per call (ms)")]
    if any(r["speedup_vs_fovi"] is not None for r in rows):
        panels.append(("speedup_vs_fovi", "speedup vs fovi's kernels (x)"))
    # Series of measured rows only, so a backend that served nothing takes no colour.
    series = list(dict.fromkeys((r["backend"], r["mode"]) for r in rows
                                if any(r[field] is not None for field, _ in panels)))
    backends = list(dict.fromkeys(backend for backend, _ in series))
    modes = list(dict.fromkeys(mode for _, mode in series))

    # Inches: 0.17 a cell fits its 8 pt label; each row of panels adds its title and x axis.
    label_width = 0.065 * max(len(cell_label(cell)) for cell in cells)
    figure = Figure(figsize=(max(8.0, 1.0 + label_width + 4.5 * len(panels)),
                             1.4 + sum(0.9 + 0.17 * len(model_cells)
                                       for model_cells in by_model.values())),
                    layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(by_model), len(panels), squeeze=False, sharex="col",
                           sharey="row", gridspec_kw={"height_ratios": [
                               len(model_cells) + 5 for model_cells in by_model.values()]})
    legend = {}  # label -> handle, over every panel (not each shows every series)
    for row_axes, (model, model_cells) in zip(axes, by_model.items(), strict=True):
        position = {cell: i for i, cell in enumerate(model_cells)}
        layers = list(dict.fromkeys(layer for layer, _, _ in model_cells))
        for axis, (field, label) in zip(row_axes, panels, strict=True):
            # Every other layer's cells on a grey band, so its batch sizes read as one group.
            for cell, i in position.items():
                if layers.index(cell[0]) % 2:
                    axis.axhspan(i - 0.5, i + 0.5, color="0.93", zorder=0)
            plotted = False
            for number, (backend, mode) in enumerate(series):
                # Each series sits slightly off the cell's line so equal values stay visible.
                shift = 0.6 * ((number + 0.5) / len(series) - 0.5)
                points = [(r[field], position[(r["layer"], r["batch"], r["dtype"])] + shift)
                          for r in rows if r["layer"].partition(":")[0] == model
                          and (r["backend"], r["mode"]) == (backend, mode)
                          and r[field] is not None]
                if points:
                    xs, ys = zip(*points, strict=True)
                    legend.setdefault(f"{backend} {mode}", axis.scatter(
                        xs, ys, s=14, marker="os^Dv<>"[modes.index(mode) % 7],
                        color=f"C{backends.index(backend)}"))
                    plotted = True
            if plotted:
                axis.set_xscale("log")
            else:
                axis.text(0.5, 0.5, "nothing measured", ha="center", va="center",
                          transform=axis.transAxes)
            if field == "speedup_vs_fovi":
                axis.axvline(1.0, color="gray", linewidth=0.8)
            axis.set_title(model, fontsize=9, loc="left")
            axis.set_xlabel(label, fontsize=8)
            # Shared columns hide the inner panels' values; each panel keeps its own.
            axis.tick_params(labelbottom=True, labelsize=8)
            axis.grid(True, which="both", axis="x", alpha=0.3)
        row_axes[0].set_yticks(range(len(model_cells)),
                               [cell_label(cell) for cell in model_cells], fontsize=8)
        row_axes[0].set_ylim(len(model_cells) - 0.5, -0.5)  # the first cell at the top
        row_axes[0].set_ylabel("layer, batch size", fontsize=8)
    # Ticks last: a shared column's log scale, set by a later panel, resets them on every
    # panel. A log axis spanning few decades labels its minor ticks too, which collide.
    for axis, (field, _) in zip(axes.flat, panels * len(by_model), strict=True):
        if field == "speedup_vs_fovi":
            axis.set_xticks(SPEEDUP_TICKS, [f"{tick:g}" for tick in SPEEDUP_TICKS])
        axis.xaxis.set_minor_formatter(NullFormatter())
    if legend:
        figure.legend(legend.values(), legend.keys(), loc="outside lower center",
                      ncols=min(len(legend), 4), fontsize=8)
    figure.suptitle(f"knnconv per layer{f' on {device}' if device else ''}, "
                    f"{', '.join(dtypes)}\n{' and '.join(label for _, label in panels)}")
    figure.savefig(path, dpi=120)
    return True


SPEEDUP_TICKS = (0.125, 0.25, 0.5, 1, 2, 4, 8)  # the speedup panels' labelled ticks


def write_outputs(out_dir: Path, name: str, meta: dict[str, Any],
                  rows: list[dict[str, Any]]) -> list[Path]:
    """<name>.json (meta + rows), <name>.csv (rows) and <name>.png; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path, png_path = (out_dir / f"{name}.{ext}" for ext in ("json", "csv", "png"))
    json_path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=ROW_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    written = [json_path, csv_path]
    if plot_rows(rows, png_path, device=meta.get("device")):
        written.append(png_path)
    else:
        print(f"matplotlib is not installed: {png_path} not written")
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", type=Path, metavar="DIR",
                        help="geometry set (DIR/index.json + npz tables); default: built-in "
                             "AlexNet-like and ResNet-like layers")
    parser.add_argument("--layers", action="append", metavar="SUBSTR",
                        help="keep layers whose name contains SUBSTR (repeatable)")
    parser.add_argument("--stems", action="store_true",
                        help="also the generated three-channel stems with thousands of nodes "
                             "(GENERATED_STEMS: Cin 3, K 49, V 196, 3,321 and 4,241 nodes)")
    parser.add_argument("--batches", type=comma_list(int_at_least(1)),
                        help="comma-separated batch sizes (default: 128,512,2048 on a GPU, "
                             "2,8 on a CPU)")
    parser.add_argument("--dtypes", type=comma_list(str, DTYPES),
                        help="comma-separated: float16, bfloat16, float32 (default: float16 "
                             "on a GPU, float32 on a CPU)")
    parser.add_argument("--backends", type=comma_list(str),
                        help="comma-separated backends, 'auto' allowed (default: every "
                             "available backend, each where it can serve)")
    parser.add_argument("--modes", type=comma_list(str, MODES), default=list(DEFAULT_MODES),
                        help="comma-separated: forward, train, train_graph (the training "
                             "step replayed as a CUDA graph), train_compiled (the training "
                             "step under torch.compile(mode='reduce-overhead')), "
                             "train_no_dx and train_graph_no_dx (train and train_graph "
                             "without the input's gradient, as a network trains its image "
                             "layer); the graph and compiled modes on a GPU only, "
                             "train_compiled for cuda, the others for cuda, triton and auto "
                             "(default: forward, train, train_graph)")
    parser.add_argument("--warmup", type=int_at_least(0),
                        help="untimed calls per cell (default 3 on a GPU, 1 on a CPU)")
    parser.add_argument("--repeats", type=int_at_least(1),
                        help="timed calls per cell; the median is reported (default 20 on a "
                             "GPU, 5 on a CPU)")
    parser.add_argument("--check", action="store_true",
                        help="store each forward's relative error against the float64 reference")
    parser.add_argument("--max-ref-gb", type=float, default=16.0,
                        help="skip --check where the float64 reference's binned tensor "
                             "(B*Nout*Cin*V*8 bytes) exceeds this (default 16)")
    parser.add_argument("--fovi-times", type=Path, metavar="FILE",
                        help="fovi's published kernel times (default: the checkout's "
                             "bench/fovi_kernel_times.json, if any)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--name", help="output file stem (default: from the GPU model, or 'cpu')")
    parser.add_argument("--model", choices=["alexnet", "resnet18"],
                        help="time a whole example network's training step (images/s) per "
                             "backend instead of single layers (reference is skipped)")
    parser.add_argument("--resolution", type=int_at_least(1), default=64,
                        help="sensor resolution of the --model network")
    parser.add_argument("--compile", action="store_true",
                        help="with --model: also time each backend's network under "
                             "torch.compile(mode='reduce-overhead') (CUDA graphs on a GPU)")
    fovi_models.add_fovi_arguments(parser)


def _model_step_row(args, device: torch.device, backend: str, batch: int,
                    compiled: bool) -> dict[str, Any]:
    build = {"alexnet": models.foveated_alexnet, "resnet18": models.foveated_resnet18}[args.model]
    torch.manual_seed(0)
    model = build(10, resolution=args.resolution, backend=backend).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 3, len(model.sensor_coords), device=device)
    labels = torch.randint(0, 10, (batch,), device=device)

    def step(forward):
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
            loss = torch.nn.functional.cross_entropy(forward(x), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    note = None
    try:
        with (reduce_overhead(model) if compiled else contextlib.nullcontext(model)) as forward:
            warmup = max(COMPILED_WARMUP, args.warmup) if compiled else args.warmup
            median_ms, status = time_calls(partial(step, forward), device, warmup=warmup,
                                           repeats=args.repeats)[0], "ok"
    except torch.cuda.OutOfMemoryError:
        median_ms, status = None, "oom"
    except ValueError as exc:  # a named backend that cannot serve this device or dtype
        median_ms, status, note = None, "unsupported", str(exc)
    ran = sorted({str(m.last_backend) for m in model.modules() if hasattr(m, "last_backend")})
    return {"model": args.model, "resolution": args.resolution, "batch": batch,
            "backend": backend, "compiled": compiled, "backend_ran": ",".join(ran),
            "status": status,
            "median_ms": median_ms, "note": note,
            "images_per_s": None if median_ms is None else batch / median_ms * 1e3}


def model_step_rows(args, device: torch.device, backends: list[str]) -> list[dict[str, Any]]:
    """Images per second of a whole example network's training step (forward, backward, SGD
    step; fp16 autocast on CUDA) per backend and batch, eager and (--compile) compiled."""
    rows = []
    for backend in backends:
        for batch in args.batches:
            for compiled in (False, True) if args.compile else (False,):
                row = _model_step_row(args, device, backend, batch, compiled)
                release_memory(device)
                rows.append(row)
                timing = (row["note"] or "-" if row["median_ms"] is None else
                          f"{row['median_ms']:.3f} ms, {row['images_per_s']:.0f} images/s")
                how = "compiled" if compiled else "eager"
                print(f"{args.model} B={batch} {backend:13} {how:8} {row['status']}: {timing}")
    return rows


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # events record on the current device's stream
    if args.fovi_model is not None:
        return (fovi_ddp.run if args.ddp else fovi_models.run)(args, device)
    defaults = DEVICE_DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    for option, value in defaults.items():
        if getattr(args, option) is None:
            setattr(args, option, value)
    known = available_backends()
    backends = args.backends or known
    unknown = [name for name in backends if name not in known and name != "auto"]
    if unknown:
        print(f"unknown backend(s) {unknown}; choose 'auto' or from {known}", file=sys.stderr)
        return 2
    if args.compile and args.model is None:
        print("--compile times whole networks: give --model too (single layers: "
              "--modes train_compiled)", file=sys.stderr)
        return 2
    if args.model is not None:
        rows = model_step_rows(args, device, [b for b in backends if b != "reference"])
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{args.name or default_name(device)}_{args.model}.json"
        path.write_text(json.dumps({"device": device_description(device),
                                    "torch": torch.__version__, "rows": rows}, indent=1))
        print(f"wrote {path}")
        return 0
    if args.geometry is not None:
        layers = load_geometry_dir(args.geometry, args.layers)
    else:
        layers = builtin_layers(args.layers)
    if args.stems:
        layers += generated_stems(args.layers)
    if not layers:
        print(f"no conv layer matches --layers {args.layers}", file=sys.stderr)
        return 2
    fovi_times_path = args.fovi_times
    if fovi_times_path is None and REPO_FOVI_TIMES.exists():
        fovi_times_path = REPO_FOVI_TIMES
    fovi_times = load_fovi_times(fovi_times_path) if fovi_times_path is not None else {}

    ceilings = measure_ceilings(device)
    print(f"device: {device_description(device)}; torch {torch.__version__}")
    print("ceilings: " + ", ".join(f"{key} {_fmt(value, '.4g')}"
                                   for key, value in ceilings.items()))
    print(f"fovi's kernel times: {fovi_times_path or 'none'}")
    bench = Benchmark(args, device, backends, ceilings, fovi_times,
                      name_width=max(len(layer.name) for layer in layers))
    bench.print_header()
    bench.run(layers)

    summary = summarize(bench.rows)
    print_summary(summary)
    meta = {
        "device": device_description(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "ceilings": ceilings,
        "settings": {"geometry": str(args.geometry) if args.geometry else "builtin",
                     "batches": args.batches, "dtypes": args.dtypes, "backends": backends,
                     "modes": args.modes, "warmup": args.warmup, "repeats": args.repeats,
                     "fovi_times": str(fovi_times_path) if fovi_times_path else None},
        "summary": summary,
    }
    for path in write_outputs(args.out, args.name or default_name(device), meta, bench.rows):
        print(f"wrote {path}")
    return 1 if summary["statuses"].get("error") else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="knnconv bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
