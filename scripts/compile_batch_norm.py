"""Which batch norm a fovi model compiled in torch.compile's default mode should run, judged on
whole models: the compiled training step of accelerated fovi models with every training batch
norm the opaque cuDNN op (knnconv.torch_ops.batch_norm_train_op) and with inductor's lowering
of torch's (knnconv.integrations.fovi._opaque_batch_norm decides; as shipped, inductor's unless
the step is replayed as a CUDA graph), beside the same model's eager step and the grid
ResNet-18's eager and compiled steps, in one process and in interleaved rounds (so that drift
of the host or the GPU falls on every variant alike). Each variant compiles its own copy of the
model (static shapes, as the fovi-model bench compiles).

    python scripts/compile_batch_norm.py OUT.json [MODELS [BATCHES]]

MODELS: comma-separated fovi-model bench names (resnet18 by default); BATCHES: comma-separated
(512,2048 by default).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys

import torch

from knnconv.integrations import fovi as fovi_integration
from knnconv.ops.timing import device_description, time_calls
from knnconv.tools.fovi_models import (
    COMPILE_OPTIONS,
    PathModels,
    script_arguments,
    training_step,
)

# compiled variant: its rule for whether a training batch norm is the opaque op (one function
# object each: torch.compile guards on the rule it traced)
VARIANTS = {"compiled, opaque cuDNN batch norm": lambda: True,
            "compiled, inductor's batch norm": lambda: False}
ROUNDS = 3
WARMUP, REPEATS = 3, 15


def main() -> int:
    out, names, batches = script_arguments(sys.argv, "resnet18")
    device = torch.device("cuda")
    shipped = fovi_integration._opaque_batch_norm
    rows = []
    for name in names:
        models = PathModels(name, 64, device)
        for batch in batches:
            steps = {path: (None, models.eager_step(path, batch, device))
                     for path in ("accelerated", "grid", "grid+compile")}
            x, labels = models.inputs("accelerated", batch, device)
            for variant, rule in VARIANTS.items():
                # its own model and compiled graph, traced (on its first step) under its rule
                module = copy.deepcopy(models.accelerated).train()
                compiled = torch.compile(module, **COMPILE_OPTIONS)
                steps[variant] = (rule, training_step(module, compiled, x, labels, device,
                                                      graph=False))
            times: dict[str, list[float]] = {}
            try:
                for _ in range(ROUNDS):
                    for key, (rule, step) in steps.items():
                        fovi_integration._opaque_batch_norm = rule or shipped
                        ms, _ = time_calls(step, device, warmup=WARMUP, repeats=REPEATS)
                        times.setdefault(key, []).append(ms)
            finally:
                fovi_integration._opaque_batch_norm = shipped
            row = {"model": name, "batch": batch,
                   "median_ms": {key: statistics.median(v) for key, v in times.items()},
                   "rounds_ms": times}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("model", "batch", "median_ms")}), flush=True)
            del steps
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        del models
    result = {"device": device_description(device), "torch": torch.__version__,
              "variants": list(VARIANTS), "rounds": ROUNDS, "repeats": REPEATS, "rows": rows}
    with open(out, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
