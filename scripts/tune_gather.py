"""Time the channels-last gather (knn_gather_cl, and on Hopper knn_gather_cl_wgmma) over
candidate tiles on real layer geometries, as the forward and as dx (GPU).

    python scripts/tune_gather.py GEOMETRY_DIR OUT.json LAYER_SUBSTR:BATCH [...]

Each candidate is timed as the entry point a layer calls (ChannelsLastForward.run, or
ChannelsLastBackward.run for dx alone, weight re-layout included: the same for every tile),
replayed as a CUDA graph, median of 15. Every timing is written with its achieved TFLOP/s
(2 * B * entries * Cin * Cout / time); the default choice and the fastest candidate per
family are printed for each (layer, batch, direction), for tiles.json.
"""

from __future__ import annotations

import itertools
import sys

import torch
import tune_tiles  # scripts/, beside this one

from knnconv.ops import cuda as knn_cuda
from knnconv.ops.cuda import channels_last
from knnconv.ops.cuda.configs import (
    ARCHITECTURE_FAMILIES,
    WALKING_MAX_THREADS,
    KernelConfig,
    check_config,
    tile_rules,
)
from knnconv.tools.bench import graph_replay_ms

WGMMA = "gather_cl_wgmma"
# (bn, bk, warpgroups, stages) of the warpgroup-MMA gather: shallow K steps get more stages
WGMMA_SPACE = [(bn, bk, rb, stages) for bn in (64, 128, 256) for bk in (32, 64)
               for rb in (1, 2) for stages in ((4, 6) if bk == 32 else (3, 4))]
# mma.sync tiles beyond tiles.json's: 256 produced channels a CTA (16 warps of 64 x 32, as
# the best 128-channel tile's warps), which halves the gathered rows staged per product
GATHER_EXTRA = [KernelConfig(64, 256, 32, 2, 2, 8, stages, True, 8) for stages in (3, 4)]
WALKS = (None, 1, 4)  # nodes per CTA; None: the default


def candidates(width: int, capability) -> list[tuple[str, KernelConfig]]:
    found = {("gather_cl", KernelConfig(*rule["config"]))
             for rule in tile_rules()["gather_cl"]}
    found |= {("gather_cl", cfg) for cfg in GATHER_EXTRA}
    if tuple(capability) == ARCHITECTURE_FAMILIES[WGMMA]:
        found |= {(WGMMA, KernelConfig(64, bn, bk, rb, 4 * rb, 1, stages, True, 8))
                  for bn, bk, rb, stages in WGMMA_SPACE}
    usable = []
    for family, cfg in sorted(found, key=str):
        try:
            usable.append((family, check_config(family, cfg, width=width)))
        except ValueError:
            continue
    return usable


def as_channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def tune_cell(layer, batch: int) -> list[dict]:
    plan = layer.plan()
    device = torch.device("cuda")
    tables = plan.on(device)
    entries = channels_last.entry_tables(tables.knn_indices, tables.rf_index, plan.nin)
    reverse = knn_cuda.reverse_tables(tables.knn_indices, tables.rf_index, plan.nin)
    x = as_channels_last(torch.randn(batch, plan.cin, plan.nin, device=device,
                                     dtype=torch.float16))
    grad_y = as_channels_last(torch.randn(batch, plan.cout, plan.nout, device=device,
                                          dtype=torch.float16))
    weight = torch.randn(plan.cout, plan.q, device=device, dtype=torch.float16)
    sizes = dict(batch=batch, cin=plan.cin, nin=plan.nin, cout=plan.cout, nout=plan.nout,
                 v=plan.v, entries=plan.entry_count, dtype=torch.float16, device=device)
    flop = 2 * batch * plan.entry_count * plan.cin * plan.cout
    capability = torch.cuda.get_device_capability()
    rows = []
    for direction, width in (("forward", plan.cin), ("dx", plan.cout)):
        for (family, cfg), walk in itertools.product([(None, None)] + candidates(width,
                                                                                  capability),
                                                     WALKS):
            if family is None and walk is not None:
                continue
            if walk is not None and walk > 1 and cfg.threads > WALKING_MAX_THREADS:
                continue  # such tiles serve one node a CTA
            try:
                if direction == "forward":
                    launch = channels_last.ChannelsLastForward(**sizes, config=cfg, family=family,
                                                               nodes_per_cta=walk)
                    chosen = (launch.family, launch.cfg, launch.nodes_per_cta)

                    def call(launch=launch):
                        return launch.run(x, weight, None, entries)
                else:
                    launch = channels_last.ChannelsLastBackward(
                        **sizes, need_weight=False, input_config=cfg, input_family=family,
                        nodes_per_cta=walk)
                    key = launch.kernel_keys["input"]
                    chosen = (key[0], key[2], launch.nodes_per_cta)

                    def call(launch=launch):
                        return launch.run(grad_y, None, weight, None, reverse)
                ms = graph_replay_ms(call, device, warmup=2, repeats=15)[0]
            except Exception as exc:  # a tile the device cannot launch: record and go on
                print(f"{layer.name} {direction} {family} {cfg} walk {walk} failed: {exc}")
                continue
            rows.append({"layer": layer.name, "batch": batch, "direction": direction,
                         "default": family is None, "family": chosen[0],
                         "config": list(chosen[1]), "nodes_per_cta": chosen[2], "ms": ms,
                         "tflops": flop / ms / 1e9})
        cell = [r for r in rows if r["direction"] == direction]
        for label, pick in (("default", [r for r in cell if r["default"]]),
                            ("gather_cl", [r for r in cell if r["family"] == "gather_cl"]),
                            (WGMMA, [r for r in cell if r["family"] == WGMMA])):
            if pick:
                best = min(pick, key=lambda r: r["ms"])
                print(f"{layer.name} B={batch} {direction} {label:16}: {best['family']} "
                      f"{best['config']} walk {best['nodes_per_cta']} {best['ms']:.4f} ms "
                      f"{best['tflops']:.0f} TFLOP/s", flush=True)
    return rows


if __name__ == "__main__":
    tune_tiles.main(sys.argv[1:], tune_cell)
