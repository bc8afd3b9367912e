"""Time each kernel family over candidate tile configs (and, for the forward and the dx
scatter, nodes per CTA) on real layer geometries (GPU).

    python scripts/tune_tiles.py GEOMETRY_DIR OUT.json LAYER_SUBSTR:BATCH [...]

KNNCONV_TUNE_FAMILIES=forward,grad_weight (comma-separated) limits the families tuned.

Median GPU time of the family's entry point replayed as a CUDA graph (the backward ones
include the grad_y re-layout, the same for every config), so a tile's own time shows on
layers whose eager calls are bound by the host; every timing is written, and the fastest
config per (family, cell) printed, for tiles.json.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch

from knnconv.ops import cuda as knn_cuda
from knnconv.ops.cuda import launch_plan, relayout
from knnconv.ops.cuda.configs import WALKING_MAX_THREADS, KernelConfig, check_config
from knnconv.tools.bench import graph_replay_ms, load_geometry_dir

# (bm, bn, rb, wm, wn): CTA tile (bm*rb) x bn over wm x wn warps. The small tiles give layers
# with few nodes (and small batches) more CTAs than the GPU has SMs.
TILES = [(64, 128, 2, 2, 4), (64, 64, 2, 4, 2), (64, 128, 1, 2, 4), (64, 256, 2, 4, 4),
         (64, 32, 2, 4, 1), (64, 64, 3, 4, 2), (64, 64, 1, 2, 2), (32, 64, 1, 2, 2),
         (32, 32, 1, 2, 1), (16, 64, 1, 1, 4), (16, 32, 1, 1, 2)]
WALKS = (1, 2, 4, 8)  # nodes per CTA, for the families whose CTAs walk nodes
FAMILIES_TO_TUNE = os.environ.get("KNNCONV_TUNE_FAMILIES",
                                  "forward,grad_input,grad_input_scatter,grad_weight").split(",")
DEPTHS = [(32, 2), (32, 3), (64, 3)]  # (bk, stages)


def candidates(family: str, p64: int):
    for (bm, bn, rb, wm, wn), (bk, stages) in itertools.product(TILES, DEPTHS):
        try:
            yield check_config(family, KernelConfig(bm, bn, bk, rb, wm, wn, stages, True, 8),
                               p64=p64)
        except ValueError:
            continue


def tune_cell(layer, batch: int) -> list[dict]:
    plan = layer.plan()
    device = torch.device("cuda")
    tables = plan.on(device)
    reverse = knn_cuda.reverse_tables(tables.knn_indices, tables.rf_index, plan.nin)
    x = torch.randn(batch, plan.cin, plan.nin, device=device, dtype=torch.float16)
    weight = torch.randn(plan.cout, plan.q, device=device, dtype=torch.float16)
    grad_y = torch.randn(batch, plan.cout, plan.nout, device=device, dtype=torch.float16)
    rows = []
    for family in FAMILIES_TO_TUNE:
        walks = WALKS if family in ("forward", "grad_input_scatter") else (None,)
        for cfg, nodes in itertools.product(candidates(family, plan.p64), walks):
            if nodes is not None and nodes > 1 and cfg.threads > WALKING_MAX_THREADS:
                continue
            if family == "forward":
                def call(cfg=cfg, nodes=nodes):
                    return knn_cuda.forward(x, weight, None, tables.input_linear,
                                            tables.weight_linear, cfg, nodes_per_cta=nodes)
            else:
                need_input = family != "grad_weight"
                saved = relayout.transposed_input(
                    x, launch_plan.padded_batch(batch, ("grad_weight", cfg)), torch.float16)

                def call(cfg=cfg, need_input=need_input, saved=saved, family=family,
                         nodes=nodes):
                    return knn_cuda.backward(
                        grad_y, saved if not need_input else x, weight, tables.input_linear,
                        tables.weight_linear, reverse, plan.cin, plan.nin, plan.q,
                        need_input=need_input, need_weight=not need_input,
                        input_algorithm="scatter" if family == "grad_input_scatter" else None,
                        nodes_per_cta=nodes,
                        **({"input_config": cfg} if need_input else {"weight_config": cfg}))
            try:
                ms = graph_replay_ms(call, torch.device("cuda"), warmup=2, repeats=15)[0]
            except Exception as exc:  # a config the device cannot launch: record and go on
                print(f"{family} {tuple(cfg)} failed: {exc}")
                continue
            rows.append({"layer": layer.name, "batch": batch, "family": family,
                         "config": list(cfg), "nodes_per_cta": nodes, "ms": ms})
        best = min((r for r in rows if r["family"] == family), key=lambda r: r["ms"])
        print(f"{layer.name} B={batch} {family}: best {best['config']} nodes "
              f"{best['nodes_per_cta']} {best['ms']:.3f} ms")
    return rows


def main(argv: list[str], tune=tune_cell) -> None:
    """GEOMETRY_DIR OUT.json LAYER_SUBSTR:BATCH ...: tune(layer, batch) for each cell, every
    row written to OUT.json as the cells finish."""
    layers = load_geometry_dir(Path(argv[0]))
    rows = []
    for spec in argv[2:]:
        name, batch = spec.rsplit(":", 1)
        rows += tune(next(layer for layer in layers if name in layer.name), int(batch))
        Path(argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
