"""Whole-network training steps: every KNN layer of a published fovi model, back to back.

``python -m knnconv.tools.bench_networks --geometry DIR`` builds each model's KNN convolutions from
a geometry set (index.json + npz, see knnconv.bench), runs one training step through all of
them (forward through every layer, then one backward through every layer, each layer on its
own random input, the weight gradients and every dx but the image's computed as a network's
step computes them), eagerly and replayed as a CUDA graph, and puts the time against the sum of
the layers' training floors (ceilings measured in the same run), with knnconv's default (x kept
between forward and backward) and keeping the cuda backend's input re-layouts instead
(knnconv.keep_input_relayout(True)).
Writes networks.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..context import keep_input_relayout
from ..layers import KNNConv
from .bench import (
    device_description,
    graph_replay_ms,
    int_at_least,
    load_geometry_dir,
    measure_ceilings,
    reads_image,
    time_calls,
    train_floor_ms,
)

# The published recipes' batches as the KNN layers see them (images x fixations).
NETWORKS = {"fovi-alexnet_a-0.5_res-64_rfmult-1": 512,
            "fovi-resnet18_a-0.5_res-64_rfmult-2": 2048}


def network_layers(directory: Path, model: str, device, dtype) -> list[KNNConv]:
    """Every conv layer of ``model`` in index order (repeated geometries included)."""
    return [KNNConv(layer.cin, layer.cout, layer.knn_indices, layer.rf_index, nin=layer.nin,
                    v=layer.v, backend="cuda", bias=False).to(device, dtype)
            for layer in load_geometry_dir(directory, [f"{model}:"], repeats=True)]


def time_network(layers, batch: int, repeats: int) -> dict:
    device = layers[0].weight.device
    inputs = [torch.randn(batch, layer.in_channels, layer.plan.nin, device=device,
                          dtype=layer.weight.dtype,
                          requires_grad=not reads_image(layer.in_channels))
              for layer in layers]
    grads = [torch.randn(batch, layer.out_channels, layer.plan.nout, device=device,
                         dtype=layer.weight.dtype) for layer in layers]

    # As in a network: each weight gradient written afresh (after zero_grad), each dx handed
    # on (returned, not accumulated into a leaf); the image needs none.
    wanted = [layer.weight for layer in layers] + [x for x in inputs if x.requires_grad]

    def step():
        outputs = [layer(x) for layer, x in zip(layers, inputs, strict=True)]
        return torch.autograd.grad(outputs, wanted, grads)

    # The replay's warm-up compiles and verifies the kernels and builds the tables.
    graph_ms = graph_replay_ms(step, device, warmup=3, repeats=repeats)[0]
    eager_ms = time_calls(step, device, warmup=1, repeats=repeats)[0]
    return {"eager_ms": eager_ms, "graph_ms": graph_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m knnconv.tools.bench_networks",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", type=Path, required=True, metavar="DIR")
    parser.add_argument("--out", type=Path, default=Path("out") / "bench", metavar="DIR")
    parser.add_argument("--repeats", type=int_at_least(1), default=20)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    rows = []
    for model, batch in NETWORKS.items():
        layers = network_layers(args.geometry, model, device, torch.float16)
        floor = sum(train_floor_ms(layer.plan, batch, ceilings,
                                   grad_input=not reads_image(layer.in_channels))
                    for layer in layers)
        for keep in (False, True):
            with keep_input_relayout(keep):
                times = time_network(layers, batch, args.repeats)
            row = {"model": model, "batch": batch, "layers": len(layers), "dtype": "float16",
                   "backend": "cuda", "keep_input_relayout": keep, "floor_sum_ms": floor,
                   **times, "eager_over_floor": times["eager_ms"] / floor,
                   "graph_over_floor": times["graph_ms"] / floor}
            rows.append(row)
            print(f"{model} B={batch} ({len(layers)} KNN layers, input re-layouts "
                  f"{'kept' if keep else 'not kept'}): eager {times['eager_ms']:.3f} ms, graph "
                  f"replay {times['graph_ms']:.3f} ms, sum of floors {floor:.3f} ms (graph "
                  f"{row['graph_over_floor']:.2f}x the floor)")
        del layers
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "networks.json"
    path.write_text(json.dumps({"device": device_description(device), "ceilings": ceilings,
                                "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
