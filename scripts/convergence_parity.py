"""Does a fovi model train the same through knnconv? fovi 2.4.0's own layers against the same
model after ``knnconv.integrations.fovi.accelerate``, from the same weights on the same data,
next to the seed-to-seed spread of each.

    python scripts/convergence_parity.py [--epochs 5] [--seeds 0,1] [--out out/convergence]

The model is a small fovi ``KNNAlexNet`` (a stride-2 k = 49 stem and k = 9 convs, max-pooling
after the first and the last, a linear head) reading scikit-learn's digits the way
``knnconv demo`` does: each digit upsampled to 32x32 and sampled at the model's input
coordinates. Per seed the model is built once and copied before ``accelerate``, so both paths
start from the same weights, and ``knnconv.tools.demo.train`` trains each (Adam, one-cycle schedule,
the batch order drawn from the seed; float16 autocast with a GradScaler on a GPU, float32 on
the CPU). The train/test split is the same for every seed.

Writes OUT/convergence_parity.json (per path and seed: each epoch's training loss and
accuracies, the backends that ran, the time; the device, versions and command line; the
summary) and OUT/convergence_parity.png (the loss and test-accuracy curves), and prints the
summary: each seed's final-epoch difference between the paths beside each path's spread over
the seeds.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

import knnconv
from knnconv.integrations.fovi import accelerate_with_report
from knnconv.ops.timing import device_description
from knnconv.tools import demo
from knnconv.tools.options import comma_list, int_at_least

PATHS = ("fovi", "accelerated")
METRICS = ("loss", "test_accuracy")
SPLIT_SEED = 0
DEFAULT_OUT = Path("out") / "convergence"
STEM_K, K = 49, 9


def build_model(in_res: int, features: list[int], seed: int, device: torch.device):
    """The fovi KNNAlexNet, its weights drawn from ``seed``. Built on ``device``, since fovi's
    own layers keep their neighbour tables as plain attributes, which ``.to()`` does not move,
    and then moved there, since its classifier is built on the CPU whatever ``device`` says."""
    from fovi.models.knnalexnet import KNNAlexNet

    torch.manual_seed(seed)
    depth = len(features)
    return KNNAlexNet(
        in_res=in_res, in_channels=1, features_per_layer=features,
        stride_per_layer=[2] + [1] * (depth - 1), pool_after=sorted({0, depth - 1}),
        k_per_layer=[STEM_K] + [K] * (depth - 1), n_classes=demo.CLASSES, fov=16, cmf_a=0.5,
        ref_frame_mult=2, field_geometry="legacy", device=str(device)).to(device)


def backend_that_ran(layer: torch.nn.Module) -> str | None:
    """knnconv's routed layers record ``last_backend``; fovi's own convs and pools record
    theirs under private names."""
    for attribute in ("last_backend", "_last_knn_backend", "_last_knn_pool_backend"):
        value = getattr(layer, attribute, None)
        if value is not None:
            return value
    return None


def record_backends(model: torch.nn.Module) -> dict[str, set[str]]:
    """Forward hooks collecting, per KNN layer, every backend that ran it."""
    from fovi.arch.knn import KNNBaseLayer

    def hook(ran: set[str]):
        return lambda module, inputs, output: ran.add(str(backend_that_ran(module)))

    seen: dict[str, set[str]] = {}
    for name, layer in model.named_modules():
        if isinstance(layer, KNNBaseLayer):
            seen[name] = set()
            layer.register_forward_hook(hook(seen[name]))
    return seen


def train_path(model, data, args, seed: int, device: torch.device) -> dict:
    backends = record_backends(model)
    start = time.perf_counter()
    history = demo.train(model, data, epochs=args.epochs, batch_size=args.batch_size, seed=seed,
                         device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"loss": history.loss, "train_accuracy": history.train_accuracy,
            "test_accuracy": history.test_accuracy,
            "seconds": round(time.perf_counter() - start, 2),
            "backends": {name: sorted(ran) for name, ran in backends.items()}}


def summarise(runs: dict[str, dict[str, dict]]) -> dict:
    """Final-epoch values; per seed, accelerated minus fovi; per path, the spread (max - min)
    over the seeds; and whether the largest path difference is within the largest spread."""
    final = {path: {seed: {metric: run[metric][-1] for metric in METRICS}
                    for seed, run in by_seed.items()} for path, by_seed in runs.items()}
    seeds = list(final["fovi"])
    path_difference = {seed: {metric: final["accelerated"][seed][metric]
                              - final["fovi"][seed][metric] for metric in METRICS}
                       for seed in seeds}
    seed_spread = {path: {metric: max(values[metric] for values in by_seed.values())
                          - min(values[metric] for values in by_seed.values())
                          for metric in METRICS} for path, by_seed in final.items()}
    within = {metric: max(abs(d[metric]) for d in path_difference.values())
              <= max(spread[metric] for spread in seed_spread.values()) for metric in METRICS}
    return {"final": final, "path_difference": path_difference, "seed_spread": seed_spread,
            "paths_within_seed_noise": within if len(seeds) > 1 else None}


def summary_lines(summary: dict) -> list[str]:
    lines = ["final epoch: accelerated - fovi per seed, and the spread over the seeds per path"]
    for seed, difference in summary["path_difference"].items():
        lines.append(f"  seed {seed}: loss {difference['loss']:+.3g}, "
                     f"test accuracy {difference['test_accuracy']:+.3g}")
    for path, spread in summary["seed_spread"].items():
        lines.append(f"  {path} over seeds: loss {spread['loss']:.3g}, "
                     f"test accuracy {spread['test_accuracy']:.3g}")
    within = summary["paths_within_seed_noise"]
    if within is None:
        lines.append("  one seed only: no seed-to-seed spread to compare with")
    else:
        lines.append("  paths within seed noise: " + ", ".join(
            f"{metric.replace('_', ' ')} {'yes' if agrees else 'no'}"
            for metric, agrees in within.items()))
    return lines


def plot(path: Path, runs: dict[str, dict[str, dict]], setting: str) -> None:
    backend_agg = demo.require("matplotlib.backends.backend_agg", "matplotlib")
    figure_module = demo.require("matplotlib.figure", "matplotlib")
    ticker = demo.require("matplotlib.ticker", "matplotlib")
    figure = figure_module.Figure(figsize=(11, 4.2), layout="constrained")
    backend_agg.FigureCanvasAgg(figure)
    axes = dict(zip(METRICS, figure.subplots(1, 2), strict=True))
    styles = {"fovi": {"linestyle": "-", "marker": "o"},
              "accelerated": {"linestyle": "--", "marker": "s", "fillstyle": "none"}}
    for colour, seed in enumerate(runs["fovi"]):
        for name in PATHS:
            run = runs[name][seed]
            epochs = range(1, len(run["loss"]) + 1)
            for metric, ax in axes.items():
                ax.plot(epochs, run[metric], color=f"C{colour}", label=f"{name}, seed {seed}",
                        **styles[name])
    for metric, ax in axes.items():
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        ax.set_title({"loss": "training loss", "test_accuracy": "test accuracy"}[metric])
    axes["loss"].legend()
    figure.suptitle(f"fovi KNNAlexNet on the digits: fovi's layers vs knnconv.accelerate\n"
                    f"{setting}")
    figure.savefig(path, dpi=110)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int_at_least(1), default=5)
    parser.add_argument("--seeds", type=comma_list(int), default=[0, 1],
                        help="comma list; the second and later measure the seed-to-seed spread")
    parser.add_argument("--batch-size", type=int_at_least(1), default=demo.DEFAULT_BATCH_SIZE)
    parser.add_argument("--limit", type=int_at_least(demo.MIN_DIGITS), metavar="N",
                        help="use only the first N digits (default: all 1797)")
    parser.add_argument("--in-res", type=int_at_least(4), default=demo.IMAGE_SIDE,
                        help="the model's input resolution (fovi's in_res)")
    parser.add_argument("--features", type=comma_list(int), default=[32, 64, 64],
                        help="channels of each KNN conv layer")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        raise SystemExit(f"--seeds repeats a seed: {args.seeds}")
    device = torch.device(args.device if args.device != "auto"
                          else "cuda" if torch.cuda.is_available() else "cpu")
    # fovi's coordinate code calls torch.meshgrid without indexing= and copy-constructs
    # tensors; the warnings would bury the log.
    warnings.filterwarnings("ignore", message="torch.meshgrid")
    warnings.filterwarnings("ignore", message="To copy construct from a tensor")

    runs: dict[str, dict[str, dict]] = {name: {} for name in PATHS}
    data = None
    for seed in args.seeds:
        fovi_model = build_model(args.in_res, args.features, seed, device)
        accelerated, report = accelerate_with_report(copy.deepcopy(fovi_model))
        if report.left or not report.routed:
            raise SystemExit(f"accelerate left layers of the model as they are:\n{report}")
        if data is None:
            sensor = fovi_model.layers[0].conv.in_coords.cartesian.detach().cpu().float()
            data = demo.load_sensor_digits(sensor, limit=args.limit, seed=SPLIT_SEED)
            print(f"{len(data.train)} training and {len(data.test)} test digits, "
                  f"{len(sensor)} sensor points, on {device_description(device)}")
        for name, model in (("fovi", fovi_model), ("accelerated", accelerated)):
            run = runs[name][str(seed)] = train_path(model, data, args, seed, device)
            ran = sorted(set().union(*run["backends"].values()))
            print(f"{name}, seed {seed}: loss {run['loss'][-1]:.4f}, test accuracy "
                  f"{run['test_accuracy'][-1]:.3f} ({run['seconds']} s; backends "
                  f"{', '.join(ran)})")

    summary = summarise(runs)
    lines = summary_lines(summary)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": [sys.executable, __file__, *argv],
        "device": device_description(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "fovi": importlib.metadata.version("fovi"),
        "knnconv": knnconv.__version__,
        "python": platform.python_version(),
        "model": {"class": "fovi.models.knnalexnet.KNNAlexNet", "in_res": args.in_res,
                  "features": args.features, "stem_k": STEM_K, "k": K,
                  "routed": [entry.name for entry in report.routed]},
        "training": {"epochs": args.epochs, "batch_size": args.batch_size, "seeds": args.seeds,
                     "split_seed": SPLIT_SEED, "train_digits": len(data.train),
                     "test_digits": len(data.test),
                     "precision": ("float16 autocast, GradScaler" if device.type == "cuda"
                                   else "float32")},
        "runs": runs,
        "summary": summary,
        "summary_text": lines,
    }
    json_path = args.out / "convergence_parity.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    png_path = args.out / "convergence_parity.png"
    plot(png_path, runs, f"{result['device']}, {result['training']['precision']}")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
