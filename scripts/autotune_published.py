"""What knnconv.autotune picks for backend="auto" on every published fovi layer at B = 128,
512 and 2048 (fp16), and what it measured: one training step per cell through "auto" with
autotuning on and an empty choice file, which then is written to OUT.json.

    python scripts/autotune_published.py GEOMETRY_DIR OUT.json
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from knnconv import autotune, knn_conv_with_backend
from knnconv.bench import load_geometry_dir, random_inputs

DEVICE = torch.device("cuda")
BATCHES = (128, 512, 2048)


def main(argv: list[str]) -> None:
    geometry, out = Path(argv[0]), Path(argv[1])
    with tempfile.TemporaryDirectory() as cache:
        os.environ[autotune.CACHE_DIRECTORY] = cache
        autotune.forget()
        autotune.enable()
        for layer in load_geometry_dir(geometry):
            plan = layer.plan()
            for batch in BATCHES:
                inputs = random_inputs(plan, batch, torch.float16, DEVICE)
                y, ran = knn_conv_with_backend(inputs.x, inputs.weight, inputs.bias, plan,
                                               "auto")
                y.backward(inputs.grad_y)
                print(f"{layer.name:60} B={batch:5} auto -> {ran}", flush=True)
                del inputs, y
                torch.cuda.empty_cache()
        choices = json.loads(autotune.cache_path().read_text())
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "choices": choices},
                              indent=1))
    picked = collections.Counter(record["backend"] for record in choices.values())
    print(f"{len(choices)} cells: " + ", ".join(f"{n} {name}" for name, n in picked.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
