"""Where auto's eager rule should hand a convolution to the triton backend, judged on whole
models: the eager training step of accelerated fovi models with auto's forward-work threshold
(knnconv.ops.dispatch.TRITON_MIN_FORWARD_FLOP) set to each of THRESHOLDS, beside the grid
ResNet-18's eager step, in one process and in interleaved rounds (so that drift of the host or
the GPU falls on every threshold alike).

A layer's own eager crossover (the per-layer bench) counts its host time in full; inside a
model whose step is GPU-bound the host runs ahead and hides it, so the whole step, not the
layer, decides.

    python scripts/eager_crossover.py OUT.json [MODELS [BATCHES]]

MODELS: comma-separated fovi-model bench names (resnet18,alexnet by default); BATCHES:
comma-separated (512,2048 by default).
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from knnconv.ops import dispatch
from knnconv.ops.timing import device_description, time_calls
from knnconv.tools.fovi_models import PathModels, script_arguments

THRESHOLDS = (100e9, 30e9, 10e9, 0.0)
ROUNDS = 3
WARMUP, REPEATS = 3, 15


def triton_layers(model: torch.nn.Module) -> int:
    """How many of the model's convolutions ran on the triton backend in its last call."""
    return sum(getattr(module, "last_backend", None) == "triton" for module in model.modules())


def main() -> int:
    out, names, batches = script_arguments(sys.argv, "resnet18,alexnet")
    device = torch.device("cuda")
    default = dispatch.TRITON_MIN_FORWARD_FLOP
    rows = []
    for name in names:
        models = PathModels(name, 64, device)
        for batch in batches:
            steps = {path: models.eager_step(path, batch, device)
                     for path in ("accelerated", "grid")}
            times: dict[str, list[float]] = {}
            on_triton: dict[str, int] = {}
            for _ in range(ROUNDS):
                for threshold in THRESHOLDS:
                    dispatch.TRITON_MIN_FORWARD_FLOP = threshold
                    ms, _ = time_calls(steps["accelerated"], device, warmup=WARMUP,
                                       repeats=REPEATS)
                    times.setdefault(f"{threshold:g}", []).append(ms)
                    on_triton[f"{threshold:g}"] = triton_layers(models.accelerated)
                dispatch.TRITON_MIN_FORWARD_FLOP = default
                ms, _ = time_calls(steps["grid"], device, warmup=WARMUP, repeats=REPEATS)
                times.setdefault("grid", []).append(ms)
            row = {"model": name, "batch": batch,
                   "median_ms": {key: statistics.median(v) for key, v in times.items()},
                   "rounds_ms": times, "triton_layers": on_triton}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("model", "batch", "median_ms",
                                                  "triton_layers")}), flush=True)
            del steps
            torch.cuda.empty_cache()
        del models
    result = {"device": device_description(device), "torch": torch.__version__,
              "thresholds": list(THRESHOLDS), "rounds": ROUNDS, "repeats": REPEATS,
              "rows": rows}
    with open(out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
