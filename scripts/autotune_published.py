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

from knnconv import knn_conv_with_backend
from knnconv.ops import autotune
from knnconv.tools.bench import load_geometry_dir, random_inputs

DEVICE = torch.device("cuda")
BATCHES = (128, 512, 2048)


def main(argv: list[str]) -> None:
    geometry, out = Path(argv[0]), Path(argv[1])
    with tempfile.TemporaryDirectory() as cache:
        os.environ[autotune.CACHE_DIRECTORY] = cache
        autotune.forget()
        autotune.enable()
        ran_per_cell = {}
        for layer in load_geometry_dir(geometry):
            plan = layer.plan()
            for batch in BATCHES:
                inputs = random_inputs(plan, batch, torch.float16, DEVICE)
                y, ran = knn_conv_with_backend(inputs.x, inputs.weight, inputs.bias, plan,
                                               "auto")
                y.backward(inputs.grad_y)
                ran_per_cell[autotune.cell_key(plan, batch, DEVICE, torch.float16)] = ran
                print(f"{layer.name:60} B={batch:5} auto -> {ran}", flush=True)
                del inputs, y
                torch.cuda.empty_cache()
        path = autotune.cache_path()
        choices = json.loads(path.read_text()) if path.exists() else {}
    # autotune stores only choices made with every candidate measured (a candidate that ran
    # out of memory leaves its cell out): those cells are listed with what ran there.
    unstored = {key: ran for key, ran in ran_per_cell.items() if key not in choices}
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "choices": choices,
                               "not_stored": unstored}, indent=1))
    picked = collections.Counter(record["backend"] for record in choices.values())
    print(f"{len(choices)} cells: " + ", ".join(f"{n} {name}" for name, n in picked.items())
          + f"; {len(unstored)} not stored (a candidate failed)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
