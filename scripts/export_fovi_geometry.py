"""Write the KNN convolution layers of a model the fovi-model bench builds
(knnconv.tools.fovi_models) as a geometry set: index.json and one npz per layer, the format
``knnconv bench --geometry`` and scripts/tune_triton.py read. Tiles can then be tuned on the
layers a whole-model step runs, which are not all in the published geometry sets.

    python scripts/export_fovi_geometry.py MODEL OUT_DIR [--in-res 64]

Runs on the CPU (fovi builds its tables there); needs fovi installed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from knnconv.integrations.fovi import accelerate
from knnconv.plan import KNNConvPlan
from knnconv.tools.fovi_models import FOVI_MODELS, build_fovi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=FOVI_MODELS)
    parser.add_argument("out", type=Path)
    parser.add_argument("--in-res", type=int, default=64)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # accelerate() builds each routed convolution's plan from fovi's tables, checked
    model = accelerate(build_fovi(args.model, args.in_res, torch.device("cpu")))
    source = f"model-{args.model}_res-{args.in_res}"
    layers = []
    for name, module in model.named_modules():
        plan = getattr(module.__dict__.get("forward"), "plan", None)
        if not isinstance(plan, KNNConvPlan):
            continue
        npz = f"{source}__{name}.npz"
        np.savez(args.out / npz, knn_indices_pad_token=plan.knn_indices.numpy(),
                 rf_index=plan.rf_index.numpy(), nin=plan.nin, v=plan.v)
        layers.append({"model": source, "layer": name, "kind": "conv", "npz": npz,
                       "Cin": plan.cin, "Cout": plan.cout, "K": plan.k, "Nout": plan.nout,
                       "Nin": plan.nin, "V": plan.v})
        print(f"{name}: {plan}")
    (args.out / "index.json").write_text(json.dumps({"layers": layers}, indent=1))
    print(f"wrote {len(layers)} layers to {args.out}")


if __name__ == "__main__":
    main()
