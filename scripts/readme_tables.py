"""The README's performance figures, generated from the committed result files.

Each block of README.md between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->`` is
this script's output for NAME; tests/test_readme.py checks that the README holds exactly it.

    python3 scripts/readme_tables.py            # print every block
    python3 scripts/readme_tables.py --write    # rewrite README.md's blocks in place
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from knnconv.ops.cuda.neighbourhood import POOL_BATCH

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
LARGE_FLOOR_MS = 0.1  # a cell whose training floor is at least this is a large one
MODELS = {"resnet18": "ResNet-18", "alexnet": "AlexNet", "resnet50": "ResNet-50",
          "resnet18_dwsep": "depthwise-separable ResNet-18", "convnextv2": "ConvNeXtV2 femto"}
MODES = {"eager": "eager", "graph": "CUDA graph"}
PATHS = ("fovi", "accelerated", "accelerated+compile", "grid", "grid+compile")
CATEGORIES = (("knn_conv", "KNN convolutions"), ("normalisation", "batch norm"),
              ("knn_pool", "KNN pooling"), ("relayout_copy", "re-layouts and copies"),
              ("other", "other"))


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def ms(value: float) -> str:
    """Three significant figures, at most one decimal past ten milliseconds."""
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def gpu_ms_per_step(result: dict, model: str, batch: int) -> dict[str, float]:
    """The accelerated path's GPU ms per step by category (torch.profiler) in a fovi-model run
    (runs that profiled one batch hold one entry, not a list)."""
    entries = result["breakdown"][model]["accelerated"]
    entries = entries if isinstance(entries, list) else [entries]
    return next(e for e in entries if e["batch"] == batch)["ms_per_step"]


def whole_models() -> str:
    result = load("h200_fovi_models.json")
    # the other families' run, where there is one (each file is one run of the bench)
    families = RESULTS / "h200_fovi_models_families.json"
    every_row = result["rows"] + (load(families.name)["rows"] if families.exists() else [])
    rows = {(r["model"], r["path"], r["mode"], r["batch"]): r for r in every_row
            if r["status"] == "ok"}
    failed = {(r["model"], r["path"], r["mode"], r["batch"]) for r in every_row
              if r["status"] == "error"}
    # the compiled grid network's column where the run timed it
    paths = [path for path in PATHS
             if path != "grid+compile" or any(key[1] == path for key in rows)]
    headers = {"fovi": "fovi's own path", "accelerated": "accelerated",
               "accelerated+compile": "accelerated + torch.compile", "grid": "grid ResNet-18",
               "grid+compile": "grid ResNet-18 + torch.compile"}
    lines = ["| model | B | mode | " + " | ".join(headers[path] for path in paths) + " |",
             "|---|---|---|" + "---|" * len(paths)]
    shown = [("resnet18", 512, "eager"), ("resnet18", 512, "graph"), ("resnet18", 2048, "eager"),
             ("resnet18", 2048, "graph"), ("alexnet", 512, "graph"), ("alexnet", 2048, "graph")]
    # the other families, where the file has them: every batch and mode measured
    shown += sorted({(model, batch, mode) for model, _, mode, batch in rows
                     if model not in ("resnet18", "alexnet")},
                    key=lambda key: (list(MODELS).index(key[0]), key[1], key[2]))
    for model, batch, mode in shown:
        fovi = rows.get((model, "fovi", mode, batch))
        cells = []
        for path in paths:
            # the grid network is a ResNet-18: shown beside the foveated ResNet-18 only
            row = None if path.startswith("grid") and model != "resnet18" else rows.get(
                (model, path, mode, batch))
            if row is None:
                failed_here = (model, path, mode, batch) in failed
                cells.append("raises in fovi 2.4.0" if failed_here and path == "fovi" else "")
            elif path in ("accelerated", "accelerated+compile") and fovi is not None:
                cells.append(f"{ms(row['median_ms'])} ms "
                             f"({fovi['median_ms'] / row['median_ms']:.2f}x)")
            else:
                cells.append(f"{ms(row['median_ms'])} ms")
        lines.append(f"| {MODELS[model]} | {batch} | {MODES[mode]} | " + " | ".join(cells) + " |")

    def against_grid(batch: int) -> str:
        return (f"{rows[('resnet18', 'accelerated', 'graph', batch)]['median_ms'] / rows[('resnet18', 'grid', 'graph', batch)]['median_ms']:.2f}x")  # noqa: E501

    def memory(model: str) -> str:
        ratios = [row["peak_mib"] / rows[(model, "fovi", mode, batch)]["peak_mib"]
                  for (name, path, mode, batch), row in rows.items()
                  if name == model and path == "accelerated" and row.get("peak_mib")
                  and (model, "fovi", mode, batch) in rows]
        return f"{min(ratios):.2f}-{max(ratios):.2f}x"

    batch = 2048
    resnet, alexnet = (gpu_ms_per_step(result, model, batch) for model in ("resnet18", "alexnet"))
    spent = ", ".join(f"{label} {resnet[key]:.1f} ms" for key, label in CATEGORIES)
    lines += ["", "Speedups are over fovi's own path in the same mode. Replayed as CUDA graphs "
              "(GPU time alone), the accelerated foveated ResNet-18 costs "
              f"{against_grid(2048)} the grid network of the same pixels at B = 2048 and "
              f"{against_grid(512)} at B = 512; its peak memory is {memory('resnet18')} fovi's, "
              f"AlexNet's {memory('alexnet')}, ResNet-50's {memory('resnet50')}. Where the "
              f"accelerated ResNet-18's GPU time goes at B = {batch} (torch.profiler): {spent}; "
              "AlexNet's is "
              f"{alexnet['knn_conv']:.0f} of {sum(alexnet.values()):.0f} ms in its KNN "
              "convolutions (the JSON lists the heaviest kernels by name)."]
    return wrap(lines)


def latest_models() -> str:
    """The newest dated whole-model run (GPU_fovi_models_DATE[_WHAT].json, on whichever GPU it
    ran: fovi's path, the accelerated one and the grid network, maybe the compiled paths):
    ResNet-18 against the grid network, AlexNet against fovi's path, their KNN pooling, and
    where it has them, the compiled ResNet-18 against the eager one."""
    path = max(RESULTS.glob("*_fovi_models_20*.json"),
               key=lambda p: (re.search(r"\d{4}-\d{2}-\d{2}", p.stem)[0], p.name))
    result = json.loads(path.read_text())
    rows = {(r["model"], r["path"], r["mode"], r["batch"]): r["median_ms"]
            for r in result["rows"] if r["status"] == "ok"}

    def graph(model: str, path_name: str, batch: int) -> float:
        return rows[(model, path_name, "graph", batch)]

    def pooling(model: str) -> float:
        return gpu_ms_per_step(result, model, 2048)["knn_pool"]

    grid = {batch: graph("resnet18", "accelerated", batch) / graph("resnet18", "grid", batch)
            for batch in (512, 2048)}
    alexnet = {batch: graph("alexnet", "fovi", batch) / graph("alexnet", "accelerated", batch)
               for batch in (512, 2048)}
    date = re.search(r"\d{4}-\d{2}-\d{2}", path.stem)[0]
    compiled = all(("resnet18", "accelerated+compile", "eager", b) in rows for b in (512, 2048))
    lines = [f"The newest run ({date}, one {result['device']}, [bench/results/{path.name}]"
             f"(bench/results/{path.name}){'' if compiled else ', without the compiled paths'}),"
             " replayed as CUDA graphs: the "
             f"accelerated ResNet-18 costs {grid[2048]:.2f}x the grid network at B = 2048 "
             f"({ms(graph('resnet18', 'accelerated', 2048))} against "
             f"{ms(graph('resnet18', 'grid', 2048))} ms) and {grid[512]:.2f}x at B = 512; "
             f"AlexNet's step is {alexnet[512]:.2f}x / {alexnet[2048]:.2f}x faster than "
             "fovi's path at B = 512 / 2048. KNN pooling takes "
             f"{pooling('resnet18'):.2f} ms of ResNet-18's GPU time per step at B = 2048 and "
             f"{pooling('alexnet'):.1f} ms of AlexNet's."]
    if compiled:
        eager = {b: rows[("resnet18", "accelerated", "eager", b)] for b in (512, 2048)}
        default = {b: rows[("resnet18", "accelerated+compile", "eager", b)] for b in (512, 2048)}
        lines[0] += (" Eager, the accelerated ResNet-18 takes "
                     f"{ms(eager[512])} / {ms(eager[2048])} ms at B = 512 / 2048 "
                     f"({eager[512] / rows[('resnet18', 'grid', 'eager', 512)]:.2f}x / "
                     f"{eager[2048] / rows[('resnet18', 'grid', 'eager', 2048)]:.2f}x the grid "
                     "network's eager step), and under torch.compile's default mode "
                     f"{ms(default[512])} / {ms(default[2048])} ms.")
    return wrap(lines)


def latest_layers() -> str:
    """The newest dated per-layer run (GPU_layers_DATE[_WHAT].json, on whichever GPU it ran):
    each backend's share of the roofline floor on the large cells whose input channels the
    triton kernels take as they are (a multiple of 16), replayed, eager and forward."""
    path = max(RESULTS.glob("*_layers_20*.json"),
               key=lambda p: (re.search(r"\d{4}-\d{2}-\d{2}", p.stem)[0], p.name))
    result = json.loads(path.read_text())
    cells = {(r["backend"], r["mode"], r["layer"], r["batch"]): r for r in result["rows"]
             if r["status"] == "ok" and r["dtype"] == "float16"}
    backends = list(dict.fromkeys(key[0] for key in cells))
    large = {(layer, batch) for (_, mode, layer, batch), r in cells.items()
             if mode == "train" and r["floor_ms"] >= LARGE_FLOOR_MS and r["cin"] % 16 == 0
             and all((b, m, layer, batch) in cells for b in backends
                     for m in ("forward", "train", "train_graph"))}
    date = re.search(r"\d{4}-\d{2}-\d{2}", path.stem)[0]
    lines = [f"The newest per-layer run ({date}, one {result['device']}, "
             f"[bench/results/{path.name}](bench/results/{path.name})), % of the roofline "
             f"floor on its {len(large)} large cells (training floor >= {LARGE_FLOOR_MS} ms, "
             "Cin a multiple of 16), geometric mean (range):", "",
             "| backend | training step, CUDA graph | training step, eager | forward, eager |",
             "|---|---|---|---|"]
    for backend in backends:
        shares = {mode: [cells[(backend, mode, *key)]["pct_of_floor"] for key in large]
                  for mode in ("train_graph", "train", "forward")}
        lines.append(f"| {BACKEND_LABELS[backend]} | " + " | ".join(
            f"{geomean(v):.1f}% ({min(v):.1f}-{max(v):.1f}%)" for v in shares.values()) + " |")
    # fovi's kernels against knnconv's, timed on the same card model that day, where run
    anchor = RESULTS / f"{path.stem.split('_layers_')[0]}_fovi_kernels_{date}.json"
    if anchor.exists():
        fovi = fovi_kernel_summaries(json.loads(anchor.read_text())["summary"])
        speedups = "; ".join(
            f"{BACKEND_LABELS[name]} {entry['train_fresh_speedup_geomean']:.2f}x training "
            f"({entry['train_fresh_cells_slower']} of {entry['cells']} cells slower), "
            f"{entry['forward_fresh_speedup_geomean']:.2f}x forward"
            for name, entry in fovi.items() if name in ("auto", "auto/contiguous"))
        lines += ["", f"Against fovi 2.4.0's kernels timed in one run on the same card "
                  f"([bench/results/{anchor.name}](bench/results/{anchor.name}), fresh "
                  f"operands, geometric mean): {speedups}."]
    return wrap(lines)


def fovi_kernel_summaries(summary: dict) -> dict[str, dict]:
    """bench_fovi_kernels.py's summary per knnconv backend (files written before it timed several
    backends hold one summary, the cuda backend's)."""
    return summary if "train_fresh_speedup_geomean" not in summary else {"cuda": summary}


BACKEND_LABELS = {"cuda": "`cuda`", "triton": "`triton`",
                  "triton/contiguous": "`triton`, x contiguous as fovi passes it",
                  "auto": "`auto` (what a user gets)",
                  "auto/contiguous": "`auto`, x contiguous as fovi passes it"}


# the triton backend's image stems run their input gradient over channels zero-padded to 16
# (auto leaves those layers' training steps to the cuda kernels)
PADDED_NOTE = {"triton": ", stems' input gradient on zero-padded channels",
               "triton/contiguous": ", stems' input gradient on zero-padded channels"}


def per_layer() -> str:
    fovi = fovi_kernel_summaries(load("h200_fovi_kernels.json")["summary"])
    bench = load("h200.json")
    lines = ["| per layer, geometric mean | training step | forward |", "|---|---|---|"]
    for backend, entry in fovi.items():
        lines.append(
            f"| {BACKEND_LABELS[backend]}: speedup over fovi 2.4.0's kernels timed in the same "
            f"run, fresh operands ({entry['cells']} cells{PADDED_NOTE.get(backend, '')}; "
            f"{entry['train_fresh_cells_slower']} "
            f"slower in training, {entry['forward_fresh_cells_slower']} in the forward) | "
            f"{entry['train_fresh_speedup_geomean']:.2f}x | "
            f"{entry['forward_fresh_speedup_geomean']:.2f}x |")
    cells = {(r["backend"], r["mode"], r["layer"], r["batch"]): r for r in bench["rows"]
             if r["status"] == "ok" and r["dtype"] == "float16"}

    def large(backend: str) -> set:
        return {(layer, batch) for (name, mode, layer, batch), r in cells.items()
                if name == backend and mode == "train" and r["floor_ms"] >= LARGE_FLOOR_MS
                and (name, "forward", layer, batch) in cells}

    # each backend over the large cells, and both over those whose input channels triton
    # takes as they are (a multiple of 16; it pads image stems'), so the two compare on the
    # same cells
    served = {key for key in large("triton") if cells[("triton", "train", *key)]["cin"] % 16 == 0}
    for backend, keys, scope in (("cuda", large("cuda"), ""),
                                 ("cuda", large("cuda") & served, ", Cin a multiple of 16"),
                                 ("triton", served, ", Cin a multiple of 16")):
        if not keys or (scope and not served):
            continue
        train = [cells[(backend, "train", *key)]["pct_of_floor"] for key in keys]
        forward = [cells[(backend, "forward", *key)]["pct_of_floor"] for key in keys]
        lines.append(f"| {BACKEND_LABELS[backend]}: % of the roofline floor, large layers "
                     f"(training floor >= {LARGE_FLOOR_MS} ms{scope}, {len(keys)} cells), eager "
                     f"| {geomean(train):.1f}% ({min(train):.1f}-{max(train):.1f}%) | "
                     f"{geomean(forward):.1f}% |")
    for backend, entry in fovi.items():
        if backend in ("cuda", "auto"):
            lines.append(f"| {BACKEND_LABELS[backend]}: peak memory of a training step / "
                         f"fovi's (same run) | {entry['peak_train_memory_ratio_geomean']:.2f}x | |")
    return "\n".join(lines)


def neighbourhood() -> str:
    rows = load("h200_neighbourhood.json")["rows"]
    times = {(r["backend"], r["op"], r["batch"], r["mode"], r.get("storage", "contiguous")):
             r["median_ms"] for r in rows}
    ratios = [times[("torch_compact", *key[1:])] / value for key, value in times.items()
              if key[0] == "cuda"]
    # the rows at the batch elements per thread the kernels take (the file sweeps them)
    pools_file = "h100_fovi_pools_choices.json"  # the kernels as they are: their latest run
    pools = [r for r in load(pools_file)["rows"]
             if r["mode"] == "max" and r["pool_batch"] == POOL_BATCH]

    def floor_range(direction: str) -> str:
        shares = [r[f"{direction}_pct_of_floor"] for r in pools]
        return f"{min(shares):.0f}-{max(shares):.0f}%"

    return wrap([f"KNN pooling and depthwise layers on the native kernels run "
                 f"{min(ratios):.1f}-{max(ratios):.1f}x faster than the same layers in torch "
                 "ops (`bench/results/h200_neighbourhood.json`). On fovi's max pooling layers "
                 "(fp16, channels-last, B = 512 and 2048, one H100) the forward moves its "
                 f"bytes at {floor_range('forward')} of the copy bandwidth, the backward at "
                 f"{floor_range('backward')} (`bench/results/{pools_file}`)."])


def wrap(lines: list[str], width: int = 92) -> str:
    """Table lines kept as they are; prose lines filled to ``width`` columns."""
    out = []
    for line in lines:
        if line.startswith("|") or not line:
            out.append(line)
            continue
        current = ""
        for word in line.split(" "):
            if current and len(current) + 1 + len(word) > width:
                out.append(current)
                current = word
            else:
                current = f"{current} {word}" if current else word
        out.append(current)
    return "\n".join(out)


BLOCKS = {"whole-models": whole_models, "latest-models": latest_models,
          "per-layer": per_layer, "latest-layers": latest_layers,
          "neighbourhood": neighbourhood}


def pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- generated: {name} -->\n)(.*?)(<!-- end: {name} -->)", re.S)


def rewrite(text: str) -> str:
    for name, block in BLOCKS.items():
        text, count = pattern(name).subn(lambda m, b=block: m[1] + b() + "\n" + m[3], text)
        if count != 1:
            raise SystemExit(f"README.md has {count} '{name}' blocks, expected 1")
    return text


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        README.write_text(rewrite(README.read_text()))
    else:
        for name, block in BLOCKS.items():
            print(f"<!-- generated: {name} -->\n{block()}\n<!-- end: {name} -->\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
