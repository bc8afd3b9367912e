"""Why one eager step costs the host more in one process than in another: an accelerated fovi
model's eager training step timed in one process, first alone, then after fovi's own path,
then after the compiled paths of the whole-model bench (its torch.compile'd model and grid
network), then with Python's garbage collector's objects frozen (gc.freeze: the collector no
longer walks what compilation left alive), beside the grid ResNet-18's eager step each time.

    python scripts/eager_host_drift.py OUT.json [MODEL [BATCH]]
"""

from __future__ import annotations

import gc
import json
import sys

import torch

from knnconv.ops.timing import device_description, time_calls
from knnconv.tools.fovi_models import PathModels

WARMUP, REPEATS = 3, 30


def main() -> int:
    out = sys.argv[1]
    name = sys.argv[2] if len(sys.argv) > 2 else "resnet18"
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    device = torch.device("cuda")
    models = PathModels(name, 64, device)
    steps = {path: models.eager_step(path, batch, device)
             for path in ("accelerated", "grid", "fovi", "accelerated+compile", "grid+compile")}

    def eager_ms() -> dict[str, float]:
        return {path: time_calls(steps[path], device, warmup=WARMUP, repeats=REPEATS)[0]
                for path in ("accelerated", "grid")}

    stages = {"alone": eager_ms()}
    stages["fovi"] = time_calls(steps["fovi"], device, warmup=WARMUP, repeats=REPEATS)[0]
    stages["after fovi's path ran"] = eager_ms()
    for path in ("accelerated+compile", "grid+compile"):
        stages[f"{path} (after eager)"] = time_calls(steps[path], device, warmup=WARMUP,
                                                     repeats=REPEATS)[0]
    stages["after the compiled paths ran"] = eager_ms()
    stages["gc objects"] = len(gc.get_objects())
    gc.freeze()
    stages["after gc.freeze()"] = eager_ms()
    print(json.dumps(stages, indent=1), flush=True)
    with open(out, "w") as handle:
        json.dump({"device": device_description(device), "torch": torch.__version__,
                   "model": name, "batch": batch, "repeats": REPEATS, "stages": stages},
                  handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
