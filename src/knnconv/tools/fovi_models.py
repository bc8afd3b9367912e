"""Whole-model training-step benchmark of fovi's own networks: fovi 2.4.0's KNNResNet-18 and
KNNAlexNet at their published settings, and with the same sensor its KNNResNet-50, its
depthwise-separable KNNResNet-18 and its ConvNeXtV2 (femto), run as fovi runs them, after
``knnconv.integrations.fovi.accelerate``, and accelerated under ``torch.compile``; each eager
and (CUDA) replayed as a whole-step CUDA graph; beside them torchvision's resnet18 on a square
image of as many pixels as the fovi sensor has samples. Writes ``<name>_fovi_models.json`` and
a PNG, prints a table with the speedups and, on CUDA, a GPU-time breakdown per kernel category.

``knnconv bench --fovi-model resnet18,alexnet`` or ``python3 -m knnconv.tools.fovi_models``.

fovi's own forward of its depthwise layers raises in 2.4.0 (an einops pattern), so on the
depthwise-separable ResNet and ConvNeXtV2 the fovi path is recorded as an error and the
accelerated paths are the only ones that run.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import context
from ..ops.timing import device_description, graph_replay_ms, release_memory, time_calls
from .options import comma_list, default_name, int_at_least

try:
    from ..integrations.fovi import accelerate
except ImportError as error:  # fovi is optional: the rest of knnconv bench runs without it
    accelerate, FOVI_MISSING = None, str(error)
else:
    FOVI_MISSING = None

FOVI_MODELS = ("resnet18", "alexnet", "resnet50", "resnet18_dwsep", "convnextv2")
PATHS = ("fovi", "accelerated", "accelerated+compile", "grid", "grid+compile")
N_CLASSES = 1000  # both fovi models and torchvision's resnet18 offer an ImageNet head
DEFAULTS = {
    "cuda": {"batches": [128, 512, 2048], "warmup": 3, "repeats": 15},
    "cpu": {"batches": [2], "warmup": 1, "repeats": 3},
}
DDP_BATCH_PER_GPU = 512  # --ddp's default batch per rank on GPUs
# Where the step is long, fewer repeats keep the whole run within minutes; the median of five
# steps of a second or more is as steady as fifteen of a shorter step.
LARGE_BATCH, LARGE_BATCH_REPEATS = 2048, 5
PROFILE_STEPS = 3
# An fp16 step replayed as a CUDA graph cannot use GradScaler (its overflow check reads a value
# on the host, which capture forbids), so it scales the loss by this constant and the SGD step
# divides it out through the learning rate: the same arithmetic without the check.
STATIC_LOSS_SCALE = 2.0**10
LEARNING_RATE = 1e-3
CATEGORIES = ("knn_conv", "knn_pool", "normalisation", "relayout_copy", "other")
TOP_KERNELS = 15  # kernels listed by name in a breakdown


def add_fovi_arguments(parser: argparse.ArgumentParser) -> None:
    """This benchmark's own options, which ``knnconv bench`` adds to its."""
    parser.add_argument("--fovi-model", type=comma_list(str, FOVI_MODELS), metavar="NAMES",
                        help="time fovi's own networks' training step (comma-separated: "
                             f"{', '.join(FOVI_MODELS)}): as fovi runs them, accelerated, "
                             "accelerated "
                             "under torch.compile, and a torchvision grid resnet18 of as many "
                             "pixels, also under torch.compile (batches default 128,512,2048 "
                             "on a GPU, 2 on a CPU)")
    parser.add_argument("--paths", type=comma_list(str, PATHS), default=list(PATHS),
                        metavar="PATHS",
                        help="with --fovi-model: the paths timed, comma-separated (default: "
                             f"all of {', '.join(PATHS)}); fewer make a shorter run")
    parser.add_argument("--in-res", type=int_at_least(4), default=64,
                        help="with --fovi-model: the fovi sensor's in_res (default 64, the "
                             "published setting; smaller for a CPU smoke run)")
    parser.add_argument("--ddp", action="store_true",
                        help="with --fovi-model, under torchrun: time the training step of each "
                             "rank's DistributedDataParallel replica (fovi's path, accelerated, "
                             "grid) at --batches per rank (default 512 on GPUs, 2 on a CPU); "
                             "scripts/ddp_scaling.py runs it at every world size")
    parser.add_argument("--profile-batches", type=comma_list(int_at_least(1)),
                        metavar="BATCHES",
                        help="with --fovi-model on CUDA: the batches of the GPU-time "
                             "breakdown, comma-separated (default: every batch a path ran "
                             "eagerly, so each batch's comparison has its breakdown)")


def build_fovi(name: str, in_res: int, device: torch.device) -> torch.nn.Module:
    """fovi's model at its published settings (the ResNet-18's sensor for the families fovi
    publishes no geometry of). Built on ``device``, since fovi keeps its neighbour tables as
    plain attributes that ``.to()`` does not move, and then moved there, since fovi builds
    some parameters on the CPU whatever ``device`` says."""
    torch.manual_seed(0)
    sensor = {"in_res": in_res, "fov": 16, "cmf_a": 0.5, "field_geometry": "legacy",
              "device": str(device)}
    if name.startswith("resnet"):
        from fovi.arch.knn import KNNDepthwiseSeparableConvLayer
        from fovi.models.knnresnet import KNNResNet, KNNResNetBottleneck
        family = {"resnet18": {}, "resnet50": {"block": KNNResNetBottleneck,
                                               "layers": [3, 4, 6, 3]},
                  "resnet18_dwsep": {"conv_layer": KNNDepthwiseSeparableConvLayer}}[name]
        model = KNNResNet(ref_frame_mult=2, num_classes=N_CLASSES, **sensor, **family)
    elif name == "convnextv2":
        model = build_convnextv2(sensor)
    else:
        from fovi.models.knnalexnet import KNNAlexNet
        model = KNNAlexNet(in_res=in_res, in_channels=3,
                           features_per_layer=[96, 256, 384, 384, 256],
                           stride_per_layer=[2, 1, 1, 1, 1], pool_after=[0, 1, 4],
                           k_per_layer=[121, 25, 9, 9, 9], n_classes=N_CLASSES, fov=16,
                           cmf_a=0.5, ref_frame_mult=2, field_geometry="legacy",
                           device=str(device))
    return model.to(device)


def build_convnextv2(sensor: dict) -> torch.nn.Module:
    """fovi's knnconvnextv2_femto (depths 2, 2, 6, 2; 48-384 channels, every count a multiple
    of 16) with ``first_stride=2``. fovi 2.4.0's ConvNeXtV2 divides the sensor's radius by
    ``first_stride`` at the stem and again at each of the three downsamplings, so its default
    of 4 leaves the last stage no nodes (64 / 4**4 < 1: fovi raises "Out radii decreased to
    less than 1"); at 2 the four stages have radii 32, 16, 8 and 4, halving between stages as
    ConvNeXt's do. fovi 2.4.0's ConvNeXtV2 also passes SamplingCoords its device both by
    position and by keyword, a TypeError on any machine: the constructor runs with that
    call's positional device dropped (the keyword carries the same device)."""
    import fovi.models.knnconvnextv2 as module
    sampling_coords = module.SamplingCoords

    def single_device(fov, cmf_a, res, _device, **kwargs):
        return sampling_coords(fov, cmf_a, res, **kwargs)

    module.SamplingCoords = single_device
    try:
        return module.knnconvnextv2_femto(style="isotropic", num_classes=N_CLASSES,
                                          auto_match_cart_resources=0, first_stride=2,
                                          **sensor)
    finally:
        module.SamplingCoords = sampling_coords


def sensor_samples(model: torch.nn.Module) -> int:
    """N, the number of sensor samples: the input nodes of the model's first KNN layer."""
    from fovi.arch.knn import KNNBaseLayer
    first = next(layer for layer in model.modules() if isinstance(layer, KNNBaseLayer))
    return len(first.in_coords)


def amp_dtype(device: torch.device) -> torch.dtype | None:
    """fp16 autocast on CUDA; float32 (no autocast) on the CPU, its fast dtype for these ops."""
    return torch.float16 if device.type == "cuda" else None


def script_arguments(argv: list[str], models: str) -> tuple[str, list[str], list[int]]:
    """(OUT, MODELS, BATCHES) of a whole-model script called ``SCRIPT OUT.json [MODELS
    [BATCHES]]``: comma-separated, ``models`` and 512,2048 by default."""
    names = (argv[2] if len(argv) > 2 else models).split(",")
    batches = [int(b) for b in (argv[3] if len(argv) > 3 else "512,2048").split(",")]
    return argv[1], names, batches


def training_step(model: torch.nn.Module, forward: Callable, x: torch.Tensor,
                  labels: torch.Tensor, device: torch.device, *,
                  graph: bool) -> Callable[[], None]:
    """One SGD training step on static inputs: cross-entropy on ``labels``, backward, step."""
    dtype = amp_dtype(device)
    scaled = dtype == torch.float16
    static_scale = STATIC_LOSS_SCALE if scaled and graph else 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE / static_scale)
    scaler = torch.amp.GradScaler(device.type) if scaled and not graph else None

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(forward(x), labels)
        if scaler is None:
            (loss * static_scale).backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    return step


GRID_PATHS = ("grid", "grid+compile")
# torchvision's ResNet-18 per device, and its torch.compile'd forward: one for every fovi model
# of a run (they share the sensor, so the grid's pixels), compiled once
_grid_networks: dict[torch.device, tuple] = {}
# Compiled with static shapes, as a training run at one batch size is: each batch of the bench
# gets its own graph, where Dynamo would otherwise make the second batch size's graph dynamic,
# whose size arithmetic and guards cost host time a fixed-batch run does not pay.
COMPILE_OPTIONS = {"dynamic": False}


def grid_networks(device: torch.device) -> tuple[torch.nn.Module | None, Callable | None,
                                                  str | None]:
    """(the grid ResNet-18, its compiled forward, None), or (None, None, why not)."""
    if device not in _grid_networks:
        try:
            import torchvision
        except ImportError as error:
            _grid_networks[device] = (None, None,
                                      f"torchvision is not importable ({error})")
        else:
            torch.manual_seed(0)
            grid = torchvision.models.resnet18(num_classes=N_CLASSES).to(
                device, memory_format=torch.channels_last)
            _grid_networks[device] = (grid, torch.compile(grid, **COMPILE_OPTIONS), None)
    return _grid_networks[device]


class PathModels:
    """The networks of one model name, built once and shared across batches and modes."""

    def __init__(self, name: str, in_res: int, device: torch.device) -> None:
        self.fovi = build_fovi(name, in_res, device)
        self.accelerated = accelerate(copy.deepcopy(self.fovi)).to(device)
        self.compiled = torch.compile(self.accelerated, **COMPILE_OPTIONS)
        self.samples = sensor_samples(self.fovi)
        self.side = round(math.sqrt(self.samples))
        self.grid, self.grid_compiled, self.grid_skip = grid_networks(device)

    def network(self, path: str) -> tuple[torch.nn.Module, Callable]:
        """The module whose parameters train, and the callable its forward runs through."""
        return {"fovi": (self.fovi, self.fovi),
                "accelerated": (self.accelerated, self.accelerated),
                "accelerated+compile": (self.accelerated, self.compiled),
                "grid": (self.grid, self.grid),
                "grid+compile": (self.grid, self.grid_compiled)}[path]

    def eager_step(self, path: str, batch: int, device: torch.device) -> Callable[[], None]:
        """A training step of ``path`` at ``batch`` run call by call (not captured), its
        module in training mode."""
        module, forward = self.network(path)
        module.train()
        x, labels = self.inputs(path, batch, device)
        return training_step(module, forward, x, labels, device, graph=False)

    def inputs(self, path: str, batch: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator(device=device).manual_seed(0)
        if path in GRID_PATHS:
            x = torch.randn(batch, 3, self.side, self.side, generator=generator, device=device)
            x = x.contiguous(memory_format=torch.channels_last)
        else:
            x = torch.randn(batch, 3, self.samples, generator=generator, device=device)
        labels = torch.randint(0, N_CLASSES, (batch,), generator=generator, device=device)
        return x, labels


def _repeats(args: argparse.Namespace, batch: int) -> int:
    if args.repeats_given or batch < LARGE_BATCH:
        return args.repeats
    return min(args.repeats, LARGE_BATCH_REPEATS)


def result_row(model: str, path: str | None, mode: str | None, batch: int | None, *,
               status: str = "ok", error: str | None = None) -> dict[str, Any]:
    """A row of the bench's results, its measurements not yet taken (see :func:`time_cell`)."""
    return {"model": model, "path": path, "mode": mode, "batch": batch, "status": status,
            "median_ms": None, "peak_mib": None, "footprint_mib": None, "error": error}


def time_cell(models: PathModels, path: str, mode: str, batch: int, args: argparse.Namespace,
              device: torch.device) -> dict[str, Any]:
    """One row: the median ms of a training step and its memory, or why it failed.

    ``peak_mib``: the most memory the timed steps allocated beyond what was allocated after
    the first step (its gradients and what the path keeps between steps are counted as
    already there). ``footprint_mib``: the same peak counted from before the first step, so
    that what the path keeps between steps (gradients, optimizer state, caches of re-laid
    out operands, tables built on first use) is counted too, but not the first step's
    one-off allocations."""
    row = result_row(args.current_model, path, mode, batch)
    module, forward = models.network(path)
    module.train()
    try:
        x, labels = models.inputs(path, batch, device)
        step = training_step(module, forward, x, labels, device, graph=mode == "graph")
        timer = graph_replay_ms if mode == "graph" else time_calls
        # a captured step's warm-up and capture choose backends as for replays
        with context.using(graph_replay=mode == "graph"):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                before_first = torch.cuda.memory_allocated(device)
            # one step first: its one-off allocations (first-use checks, tables built on
            # first use) are not the footprint of a training step
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            row["median_ms"] = timer(step, device, warmup=args.warmup,
                                     repeats=_repeats(args, batch))[0]
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            row["peak_mib"] = (peak - before) / 2**20
            row["footprint_mib"] = (peak - before_first) / 2**20
    except torch.cuda.OutOfMemoryError as error:
        row.update(status="oom", error=str(error).splitlines()[0])
    except Exception as error:  # a failing path is a result; the other paths still run
        row.update(status="error", error=f"{type(error).__name__}: {error}"[:500])
    finally:
        for parameter in module.parameters():
            parameter.grad = None
        release_memory(device)
    return row


def category(kernel: str) -> str:
    """The breakdown category of a CUDA kernel's name."""
    name = kernel.lower()
    # torch's own kernels (batch_norm_*, layer_norm_*) and cuDNN's (bn_*, batchnorm_*_nhwc_*)
    if any(word in name for word in ("batch_norm", "batchnorm", "bn_", "layer_norm")):
        return "normalisation"
    if "pool" in name:
        return "knn_pool"
    if "knn_" in name and any(word in name for word in ("conv", "grad", "gemm")):
        return "knn_conv"
    if any(word in name for word in ("transpose", "copy", "cat")):
        return "relayout_copy"
    return "other"


def profile_breakdown(models: PathModels, path: str, batch: int, args: argparse.Namespace,
                      device: torch.device) -> dict[str, Any]:
    """GPU ms per step and category over a few eager steps of one path at one batch."""
    from torch.profiler import ProfilerActivity, profile
    module, _ = models.network(path)
    try:
        step = models.eager_step(path, batch, device)
        step()  # compiles, tunes and allocates outside the profile
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            for _ in range(PROFILE_STEPS):
                step()
            torch.cuda.synchronize(device)
        totals = dict.fromkeys(CATEGORIES, 0.0)
        kernels = {}
        for event in profiler.key_averages():
            ms = event.self_device_time_total / 1e3 / PROFILE_STEPS
            totals[category(event.key)] += ms
            kernels[event.key] = ms
        # the heaviest kernels by name, so a category can be traced to what it holds
        heaviest = sorted(kernels.items(), key=lambda item: -item[1])[:TOP_KERNELS]
        return {"batch": batch, "status": "ok", "ms_per_step": totals,
                "top_kernels": [{"kernel": name[:160], "category": category(name), "ms": ms}
                                for name, ms in heaviest]}
    except Exception as error:  # a breakdown that fails leaves the timings standing
        return {"batch": batch, "status": "error", "error": f"{type(error).__name__}: {error}"}
    finally:
        for parameter in module.parameters():
            parameter.grad = None
        release_memory(device)


def model_rows(name: str, args: argparse.Namespace,
               device: torch.device) -> tuple[list[dict[str, Any]], dict[str, Any], dict]:
    """Every path, mode and batch of one fovi model; its breakdown; its sensor's sizes."""
    args.current_model = name
    try:
        models = PathModels(name, args.in_res, device)
    except Exception as error:  # a model fovi cannot build here is a result, not a crash
        message = f"{type(error).__name__}: {error}"[:500]
        print(f"{name}: not built, {message}")
        return ([result_row(name, None, None, None, status="error",
                            error=f"build: {message}")], {}, {})
    sizes = {"sensor_samples": models.samples, "grid_side": models.side}
    print(f"{name}: in_res {args.in_res}, {models.samples} sensor samples, grid "
          f"{models.side}x{models.side}")
    modes = ("eager", "graph") if device.type == "cuda" else ("eager",)
    rows: list[dict[str, Any]] = []
    for path in args.paths:
        if path in GRID_PATHS and models.grid is None:
            print(f"  {path}: skipped, {models.grid_skip}")
            rows.append(result_row(name, path, None, None, status="skipped",
                                   error=models.grid_skip))
            continue
        for batch in args.batches:
            for mode in modes:
                row = time_cell(models, path, mode, batch, args, device)
                rows.append(row)
                shown = (f"{row['median_ms']:.2f} ms" if row["status"] == "ok"
                         else f"{row['status']}: {row['error']}")
                if row["footprint_mib"] is not None:
                    shown += (f", peak {row['peak_mib']:.0f} MiB, footprint "
                              f"{row['footprint_mib']:.0f} MiB")
                print(f"  {path:20} {mode:5} B={batch:<5} {shown}")
    breakdown: dict[str, list[dict[str, Any]]] = {}
    if device.type != "cuda":
        print("  breakdown: skipped, the profile of GPU time needs CUDA")
    else:
        for path in args.paths:
            ran = [row["batch"] for row in rows if row["path"] == path and row["status"] == "ok"
                   and row["mode"] == "eager"]
            batches = args.profile_batches or ran
            if batches:
                breakdown[path] = [profile_breakdown(models, path, batch, args, device)
                                   for batch in batches]
    return rows, breakdown, sizes


def _lookup(rows: list[dict[str, Any]]) -> dict[tuple, float]:
    return {(row["model"], row["path"], row["mode"], row["batch"]): row["median_ms"]
            for row in rows if row["status"] == "ok"}


def speedup_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The table: each accelerated path's ms and its speedup over fovi and over the grid."""
    times = _lookup(rows)
    lines = [f"{'model':9} {'mode':5} {'batch':>5} {'fovi ms':>9} {'grid ms':>9} "
             f"{'path':20} {'ms':>9} {'vs fovi':>8} {'vs grid':>8} {'vs grid+compile':>16}"]

    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    def speedup(reference_ms: float | None, ms: float | None) -> str:
        return cell(reference_ms / ms if reference_ms and ms else None, ".2f")

    keys = sorted({(m, mode, b) for m, _, mode, b in times}, key=str)
    for model, mode, batch in keys:
        fovi = times.get((model, "fovi", mode, batch))
        grid = times.get((model, "grid", mode, batch))
        grid_compiled = times.get((model, "grid+compile", mode, batch))
        for path in ("accelerated", "accelerated+compile"):
            ms = times.get((model, path, mode, batch))
            lines.append(
                f"{model:9} {mode:5} {batch:>5} {cell(fovi, '.2f'):>9} {cell(grid, '.2f'):>9} "
                f"{path:20} {cell(ms, '.2f'):>9} "
                f"{speedup(fovi, ms):>8} {speedup(grid, ms):>8} "
                f"{speedup(grid_compiled, ms):>16}")
    return lines


def breakdown_lines(breakdowns: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    lines = []
    entries = [(model, path, entry) for model, per_path in breakdowns.items()
               for path, per_batch in per_path.items() for entry in per_batch]
    for model, path, entry in entries:
        if entry["status"] != "ok":
            lines.append(f"{model} {path} B={entry['batch']}: {entry['error']}")
            continue
        parts = ", ".join(f"{key} {value:.2f}" for key, value in entry["ms_per_step"].items())
        lines.append(f"{model} {path} B={entry['batch']} GPU ms/step: {parts}")
    return lines


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Bars of step time per path and mode, grouped by batch, one subplot per model; one
    colour per path and mode in every subplot, their legend below the subplots."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ok = [row for row in rows if row["status"] == "ok"]
    names = list(dict.fromkeys(row["model"] for row in rows))
    series = list(dict.fromkeys((row["path"], row["mode"]) for row in ok))
    colours = {key: f"C{index % 10}" for index, key in enumerate(series)}
    figure, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.8), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        mine = [row for row in ok if row["model"] == name]
        batches = sorted({row["batch"] for row in mine})
        shown = [key for key in series if any((row["path"], row["mode"]) == key
                                              for row in mine)]
        width = 0.8 / max(1, len(shown))
        for index, (path_name, mode) in enumerate(shown):
            heights = [next((row["median_ms"] for row in mine if row["path"] == path_name
                             and row["mode"] == mode and row["batch"] == batch), 0.0)
                       for batch in batches]
            axis.bar([b + index * width for b in range(len(batches))], heights, width,
                     color=colours[(path_name, mode)])
        axis.set_xticks([b + 0.4 - width / 2 for b in range(len(batches))],
                        [f"B={batch}" for batch in batches])
        axis.set_ylabel("training step (ms)")
        fovi_failed = any(row["model"] == name and row["path"] == "fovi"
                          and row["status"] == "error" for row in rows)
        axis.set_title(name + (" (fovi 2.4.0's own path raises)" if fovi_failed else ""))
        if mine:
            axis.set_yscale("log")
            # 1-2-5 ticks: a panel spanning less than a decade still reads off its values
            axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.yaxis.set_minor_formatter(NullFormatter())
    if series:
        handles = [plt.Rectangle((0, 0), 1, 1, color=colours[key]) for key in series]
        figure.legend(handles, [f"{path_name} {mode}" for path_name, mode in series],
                      loc="lower center", ncol=min(len(series), 6), fontsize="small")
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def fovi_ready(args: argparse.Namespace, device: torch.device) -> bool:
    """Whether fovi is importable (saying why not); fills the options left unset with the
    device's defaults (a DDP run's batch is per rank)."""
    if accelerate is None:
        print(f"--fovi-model needs fovi: {FOVI_MISSING}", file=sys.stderr)
        return False
    defaults = dict(DEFAULTS["cuda" if device.type == "cuda" else "cpu"])
    if args.ddp and device.type == "cuda":
        defaults["batches"] = [DDP_BATCH_PER_GPU]
    args.repeats_given = args.repeats is not None
    for option, value in defaults.items():
        if getattr(args, option) is None:
            setattr(args, option, value)
    return True


def run(args: argparse.Namespace, device: torch.device) -> int:
    """Time every path of every ``--fovi-model``; write the JSON and the PNG."""
    if not fovi_ready(args, device):
        return 2
    description = device_description(device)
    print(f"device: {description}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    rows: list[dict[str, Any]] = []
    breakdowns: dict[str, dict[str, Any]] = {}
    sizes: dict[str, dict[str, int]] = {}
    precision = ("float16 autocast, GradScaler (graph: static loss scale)"
                 if device.type == "cuda" else "float32")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{args.name or default_name(device)}_fovi_models"
    json_path, png_path = stem.with_suffix(".json"), stem.with_suffix(".png")
    for name in args.fovi_model:
        model_rows_, breakdowns[name], sizes[name] = model_rows(name, args, device)
        rows.extend(model_rows_)
        # written after every model, so a run cut short keeps the models it finished
        json_path.write_text(json.dumps({
            "device": description, "torch": torch.__version__, "cuda": torch.version.cuda,
            "command": " ".join(sys.argv),
            "settings": {"fovi_models": args.fovi_model, "paths": args.paths,
                         "in_res": args.in_res, "batches": args.batches, "warmup": args.warmup,
                         "repeats": args.repeats,
                         "large_batch_repeats": (None if args.repeats_given
                                                 else LARGE_BATCH_REPEATS),
                         "profile_batches": args.profile_batches, "precision": precision,
                         "optimizer": f"SGD lr {LEARNING_RATE}", "classes": N_CLASSES,
                         "sizes": sizes},
            "rows": rows, "breakdown": breakdowns}, indent=1))
    print("\n".join(speedup_lines(rows)))
    if breakdowns and any(breakdowns.values()):
        print("\n".join(breakdown_lines(breakdowns)))
    print(f"wrote {json_path}")
    if plot(rows, png_path, f"fovi models, training step: {description}, {precision}"):
        print(f"wrote {png_path}")
    else:
        print(f"matplotlib is not installed: {png_path} not written")
    # a graph capture that fails is a finding; an eager step of knnconv's that fails is a
    # broken path (fovi's own path failing is fovi's: its depthwise layers raise in 2.4.0)
    failed = [row for row in rows if row["status"] == "error" and row["mode"] == "eager"
              and row["path"] != "fovi"]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m knnconv.tools.fovi_models",
                                     description=__doc__.splitlines()[0])
    add_fovi_arguments(parser)
    parser.set_defaults(fovi_model=list(FOVI_MODELS))
    parser.add_argument("--batches", type=comma_list(int_at_least(1)),
                        help="comma-separated batch sizes (default: 128,512,2048 on a GPU, 2 "
                             "on a CPU)")
    parser.add_argument("--warmup", type=int_at_least(0),
                        help="untimed steps per cell (default 3 on a GPU, 1 on a CPU)")
    parser.add_argument("--repeats", type=int_at_least(1),
                        help="timed steps per cell, the median reported (default 15 on a GPU, "
                             f"{LARGE_BATCH_REPEATS} from batch {LARGE_BATCH}; 3 on a CPU)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--out", type=Path, default=Path("out") / "bench", metavar="DIR",
                        help="output folder (default out/bench)")
    parser.add_argument("--name", help="output file stem (default: from the GPU model, or 'cpu')")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return run(args, device)


if __name__ == "__main__":
    sys.exit(main())
