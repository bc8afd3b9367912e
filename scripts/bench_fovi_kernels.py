"""fovi's kernels measured in the same run as knnconv's native backends: fovi 2.4.0's native-CUDA
KNN convolution (`fovi.arch.knn_cuda` through its `KNNConvFunction`) against
`knnconv.knn_conv(..., backend)` for the cuda, triton and auto backends on the same layers and
host, each on random operands in the storage its own network passes between layers (fovi's
contiguous, knnconv's channels-last past the image layer), and triton and auto also on x
contiguous as fovi passes it ("triton/contiguous", "auto/contiguous"), timed as `knnconv bench`
times (median of CUDA-event-bracketed calls after warm-up).

Two ways of calling: with the same x and grad_y every call and the weight unchanged (how
`knnconv bench` and fovi's published times table time), and with what a training step sees, a
new x and grad_y each call and a weight the optimizer changed (`*_fresh_ms`): fovi's path keys
its x and grad_y re-layouts on tensor identity, so the first way lets it skip both. Also the
peak memory (torch.cuda.max_memory_allocated) of a training step with fresh operands, per layer
and, first, through every KNN layer of the fovi AlexNet and ResNet-18 of
knnconv.bench_networks, each counted from before the backend's first call (fovi's
caches emptied), so its tables and what it keeps between calls count too; the networks also
with knnconv keeping its input re-layouts (knnconv.set_keep_input_relayout(True)).

    python scripts/bench_fovi_kernels.py GEOMETRY_DIR OUT.json [--batches 128,512,2048] [--stems]

Needs a GPU, CuPy and fovi 2.4.0 (see scripts/gpu_suite.sh for installing it offline).
Writes OUT.json and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from knnconv.context import keep_input_relayout
from knnconv.functional import knn_conv_with_backend
from knnconv.tools.bench import (
    comma_list,
    generated_stems,
    geomean,
    int_at_least,
    load_geometry_dir,
    random_inputs,
    reads_image,
    release_memory,
    time_calls,
)
from knnconv.tools.bench_networks import NETWORKS

DEVICE = torch.device("cuda")
MIB = 2**20
# fovi's kernels, then knnconv's backends; "/contiguous": x as fovi passes it, not as
# knnconv's layers do
BACKENDS = ("fovi", "cuda", "triton", "auto", "triton/contiguous", "auto/contiguous")
KNNCONV_BACKENDS = BACKENDS[1:]
# h200_fovi_kernels.json networks field -> (backend, knnconv.keep_input_relayout setting)
NETWORK_MODES = {"fovi_peak_mib": ("fovi", False), "cuda_peak_mib": ("cuda", False),
                 "cuda_keeping_relayouts_peak_mib": ("cuda", True),
                 "auto_peak_mib": ("auto", False)}


def fovi_meta(plan):
    """fovi's TrainingMeta from the plan's tables (the same int32 tables, by the seed's
    definition), with the reverse CSR its torch ops use for their first-use canaries."""
    from fovi.arch.knn_autograd import TrainingMeta

    tables = plan.on(DEVICE)
    knn = tables.knn_indices.reshape(-1)  # flat slot j = k * Nout + n
    real = knn < plan.nin
    slots = torch.nonzero(real).squeeze(1)
    rows = knn[real]
    rev_col = slots[torch.argsort(rows, stable=True)].to(torch.int32)
    rev_rowptr = torch.zeros(plan.nin + 1, dtype=torch.int64, device=DEVICE)
    torch.cumsum(torch.bincount(rows, minlength=plan.nin), 0, out=rev_rowptr[1:])
    return TrainingMeta(
        cin=plan.cin, cout=plan.cout, nin=plan.nin, nout=plan.nout, k=plan.k, v=plan.v,
        p=plan.p, p64=plan.p64, q=plan.q, input_linear=tables.input_linear,
        weight_linear=tables.weight_linear,
        input_linear_flat=tables.input_linear.reshape(-1).long(),
        weight_linear_flat=tables.weight_linear.reshape(-1).long(),
        rev_rowptr=rev_rowptr.to(torch.int32), rev_col=rev_col, device=DEVICE)


def fresh_operands(inputs):
    """A reset giving the next call what a training step gives it: a new x and grad_y (not
    the tensors of the last call, which identity-keyed caches would recognise), a weight the
    optimizer changed (its version bumped) and no gradients."""
    def reset():
        # Cleared before x is replaced: fovi's cache keeps the last x, whose gradient
        # would otherwise stay allocated and count in its peak.
        inputs.clear_grads()
        inputs.x = inputs.x.detach().clone().requires_grad_()
        inputs.grad_y = inputs.grad_y.clone()
        with torch.no_grad():
            inputs.weight.add_(0.0)
    return reset


def peak_mib(step, reset, before: int, warm_steps: int = 3) -> float:
    """Peak MiB allocated during a step (after ``warm_steps`` warm ones) above ``before``,
    what was allocated before the backend's first call: what it keeps between calls counts,
    the one-off allocations of its first calls do not."""
    for _ in range(warm_steps):
        reset()
        step()
    reset()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MIB


def layer_forward(backend: str, plan, inputs):
    """One backend's forward of one layer, reading the operands at call time. fovi's
    tables are built here, so a memory count begun before this call includes them, as it
    includes the tables knnconv derives at its first call."""
    if backend != "fovi":
        name = backend.split("/")[0]
        return lambda: knn_conv_with_backend(inputs.x, inputs.weight, inputs.bias, plan,
                                             name)[0]
    import fovi.arch.knn_cuda  # noqa: F401  (registers fovi's "cuda" ops)
    from fovi.arch.knn_autograd import KNNConvFunction

    meta = fovi_meta(plan)
    return lambda: KNNConvFunction.apply(inputs.x, inputs.weight, inputs.bias, meta, "cuda")


def memory_baseline(backend: str) -> int:
    """Bytes allocated before a backend's first call on new layers, after dropping what the
    fovi's path keeps between calls (its staging caches hold the last call's operands and
    re-layouts; clearing them also drops its compiled kernels, which CuPy reloads from its
    disk cache)."""
    if backend == "fovi":
        import fovi.arch.knn_cuda as fovi_module

        fovi_module.clear_kernel_cache()
    release_memory(DEVICE)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def operands_as_passed(layer, batch: int, backend: str):
    """Random operands in the storage each backend's own network passes between its layers:
    fovi's layers take and return contiguous [B, C, N]; knnconv's return channels-last
    storage, which the next layer reads as it is (the image layer reads a contiguous x)."""
    channels_last = backend in ("cuda", "triton", "auto") and not reads_image(layer.cin)
    return random_inputs(layer.plan(), batch, torch.float16, DEVICE,
                         channels_last=channels_last)


def measure_cell(layer, batch: int, timing: dict) -> list[dict]:
    rows = []
    for backend in BACKENDS:
        inputs = operands_as_passed(layer, batch, backend)
        fresh = fresh_operands(inputs)
        before = memory_baseline(backend)
        forward = layer_forward(backend, layer.plan(), inputs)  # a plan of its own

        def train_step(forward=forward, inputs=inputs):
            forward().backward(inputs.grad_y)

        def forward_step(forward=forward):
            with torch.no_grad():
                return forward()

        row = {"layer": layer.name, "batch": batch, "dtype": "float16", "backend": backend}
        try:
            row["peak_train_mib"] = peak_mib(train_step, fresh, before)
            row["train_fresh_ms"] = time_calls(train_step, DEVICE, reset=fresh, **timing)[0]
            row["forward_fresh_ms"] = time_calls(forward_step, DEVICE, reset=fresh,
                                                 **timing)[0]
            row["train_ms"] = time_calls(train_step, DEVICE, reset=inputs.clear_grads,
                                         **timing)[0]
            row["forward_ms"] = time_calls(forward_step, DEVICE, **timing)[0]
            row["status"] = "ok"
        except torch.cuda.OutOfMemoryError:
            row["status"] = "oom"
        except ValueError as exc:  # a named backend that cannot serve the layer says why
            row["status"], row["note"] = "unsupported", str(exc)
        rows.append(row)
        release_memory(DEVICE)
    return rows


def network_peak_mib(directory: Path, model: str, batch: int, backend: str) -> float:
    """Peak MiB allocated by one training step through every KNN layer of ``model`` (each
    layer on its own random input, all outputs live until one backward), above what was
    allocated before the backend's first call: its tables and what it keeps between calls
    count, the one-off allocations of its first step (first-use checks) do not. As in a
    network, the three-channel first layer's input needs no gradient and each input's
    gradient is dropped once computed (the layer before would consume it)."""
    layers = load_geometry_dir(directory, [f"{model}:"], repeats=True)
    operands = [operands_as_passed(layer, batch, backend) for layer in layers]
    for layer, inputs in zip(layers, operands, strict=True):
        needs_grad = not reads_image(layer.cin)
        inputs.x.requires_grad_(needs_grad)
        if needs_grad:
            inputs.x.register_post_accumulate_grad_hook(lambda x: setattr(x, "grad", None))
    before = memory_baseline(backend)
    forwards = [layer_forward(backend, layer.plan(), inputs)
                for layer, inputs in zip(layers, operands, strict=True)]

    def step():
        outputs = [forward() for forward in forwards]
        torch.autograd.backward(outputs, [inputs.grad_y for inputs in operands])

    def clear_grads():
        for inputs in operands:
            inputs.clear_grads()

    return peak_mib(step, clear_grads, before, warm_steps=1)


def paired_cells(rows: list[dict], backend: str) -> dict[tuple, dict]:
    """(layer, batch) -> {"fovi": row, backend: row} for the cells where both ran."""
    cells: dict[tuple, dict] = {}
    for row in rows:
        if row["status"] == "ok" and row["backend"] in ("fovi", backend):
            cells.setdefault((row["layer"], row["batch"]), {})[row["backend"]] = row
    return {cell: both for cell, both in cells.items() if len(both) == 2}


def summarize(rows: list[dict]) -> dict:
    """Per knnconv backend, its speedups over fovi's kernels (geomean, cells slower) and its
    peak memory against theirs, over the cells both ran."""
    summary = {}
    for backend in KNNCONV_BACKENDS:
        pairs = [(both[backend], both["fovi"])
                 for both in paired_cells(rows, backend).values()]
        if not pairs:
            continue
        entry = summary[backend] = {"cells": len(pairs)}
        for mode in ("train", "forward", "train_fresh", "forward_fresh"):
            ratios = [a[f"{mode}_ms"] / c[f"{mode}_ms"] for c, a in pairs]
            entry[f"{mode}_speedup_geomean"] = geomean(ratios)
            entry[f"{mode}_cells_slower"] = sum(r < 1 for r in ratios)
        # a tiny layer's step may allocate nothing beyond what was held before it (a peak of
        # 0 MiB): it has no memory ratio
        memory = [c["peak_train_mib"] / a["peak_train_mib"] for c, a in pairs
                  if c["peak_train_mib"] > 0 and a["peak_train_mib"] > 0]
        entry["peak_train_memory_ratio_geomean"] = geomean(memory)
        entry["peak_train_memory_ratio_range"] = [min(memory), max(memory)]
        entry["cells_with_more_peak_memory"] = sum(m > 1 for m in memory)
    return summary


PLOTTED = "auto"


def plot(rows: list[dict], path: Path) -> None:
    """Per cell (one row each, grouped by model), fovi's time over knnconv's and knnconv's
    peak training memory over fovi's, side by side on log axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    by_cell = paired_cells(rows, PLOTTED)
    cells = list(by_cell)
    figure = Figure(figsize=(12.0, 2.0 + 0.16 * len(cells)), layout="constrained")
    FigureCanvasAgg(figure)
    speed, memory = figure.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    positions = range(len(cells))
    for number, (mode, marker, label) in enumerate((
            ("train", "s", "training step, same operands"),
            ("train_fresh", "D", "training step, fresh operands"),
            ("forward", "o", "forward, same operands"),
            ("forward_fresh", "^", "forward, fresh operands"))):
        shift = 0.6 * ((number + 0.5) / 4 - 0.5)  # each series a little off the cell's line
        speed.scatter([by_cell[c]["fovi"][f"{mode}_ms"] / by_cell[c][PLOTTED][f"{mode}_ms"]
                       for c in cells], [p + shift for p in positions], s=12, marker=marker,
                      label=label)
    memory.scatter([by_cell[c][PLOTTED]["peak_train_mib"] / by_cell[c]["fovi"]["peak_train_mib"]
                    for c in cells], positions, s=12, marker="s", color="C4")
    speed.set_xlabel(f"fovi 2.4.0 kernels' time / knnconv {PLOTTED}'s\n(above 1: knnconv "
                     "is faster)")
    memory.set_xlabel("peak memory of a training step\n(fresh operands), knnconv / fovi")
    models = [layer.partition(":")[0] for layer, _ in cells]
    for axis in (speed, memory):
        axis.axvline(1.0, color="gray", linewidth=0.8)
        axis.set_xscale("log")
        axis.xaxis.set_major_formatter(lambda value, _: f"{value:g}")
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.grid(True, which="both", axis="x", alpha=0.3)
        axis.tick_params(axis="x", labelsize=8)
        # every other model's cells on a grey band
        for i, model in enumerate(models):
            if list(dict.fromkeys(models)).index(model) % 2:
                axis.axhspan(i - 0.5, i + 0.5, color="0.93", zorder=0)
    speed.set_xticks([0.25, 0.5, 1, 2, 4, 8])
    speed.set_yticks(list(positions), [f"{layer} B={batch}" for layer, batch in cells],
                     fontsize=7)
    speed.set_ylim(len(cells) - 0.5, -0.5)  # the first cell at the top
    speed.legend(fontsize=8, loc="lower right")
    figure.suptitle(f"knnconv ({PLOTTED}) against fovi 2.4.0's kernels per layer, fp16, "
                    "timed in the same run on one GPU")
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("geometry", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--batches", default=[128, 512, 2048],
                        type=comma_list(int_at_least(1)))
    parser.add_argument("--repeats", type=int_at_least(1), default=10)
    parser.add_argument("--warmup", type=int_at_least(0), default=2)
    parser.add_argument("--stems", action="store_true",
                        help="also knnconv.tools.bench's generated three-channel stems")
    args = parser.parse_args()
    timing = {"warmup": args.warmup, "repeats": args.repeats}
    networks = []  # first, before any cell leaves caches behind
    for model, batch in NETWORKS.items():
        row = {"model": model, "batch": batch}
        for field, (backend, keep) in NETWORK_MODES.items():
            # Measured twice, the second kept: whatever a process allocates once is then in
            # place for every mode, so their order does not count.
            with keep_input_relayout(keep):
                for _ in range(2):
                    row[field] = network_peak_mib(args.geometry, model, batch, backend)
                    release_memory(DEVICE)
        networks.append(row)
        print(f"{model} B={batch}: peak memory of a training step through its KNN layers: "
              f"fovi {row['fovi_peak_mib']:.0f} MiB, knnconv cuda "
              f"{row['cuda_peak_mib']:.0f} MiB ({row['cuda_keeping_relayouts_peak_mib']:.0f} MiB "
              f"keeping the input re-layouts), knnconv auto {row['auto_peak_mib']:.0f} MiB")
    rows = []
    layers = load_geometry_dir(args.geometry) + (generated_stems() if args.stems else [])
    for layer in layers:
        for batch in args.batches:
            for row in measure_cell(layer, batch, timing):
                rows.append(row)
                if row["status"] == "ok":
                    print(f"{layer.name:60} {batch:5} {row['backend']:7} train "
                          f"{row['train_ms']:7.3f} / fresh {row['train_fresh_ms']:7.3f} ms  "
                          f"forward {row['forward_ms']:6.3f} / fresh "
                          f"{row['forward_fresh_ms']:6.3f} ms  peak "
                          f"{row['peak_train_mib']:7.1f} MiB")
                else:
                    print(f"{layer.name:60} {batch:5} {row['backend']:7} {row['status']}")
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(DEVICE),
                                    "summary": summary, "networks": networks, "rows": rows},
                                   indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
