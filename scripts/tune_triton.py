"""Time the triton backend's kernels over candidate tiles on real layer geometries (GPU).

    python scripts/tune_triton.py GEOMETRY_DIR OUT.json LAYER_SUBSTR:BATCH [...]

KNNCONV_TUNE_FAMILIES (comma-separated, default all) names the families tuned; a layer of
few input channels (a stem) tunes the few-channel families, any other the gather-GEMMs.
KNNCONV_TUNE_L2_FRACTIONS, KNNCONV_TUNE_PROGRAMS_PER_SM and KNNCONV_TUNE_CHAIN_LINKS
(comma-separated) replace grad_weight's window sizes, its programs per SM
(launch.PROGRAMS_PER_SM: how many windows are added where the GPU would not fill) and its
longest chain of windows per sum (launch.CHAIN_LINKS).

Each (layer, batch) times the forward, dx and dW launches (knnconv.ops.triton.launch, the
weight's re-layout included: the same for every tile) for every candidate tile of their
family, replayed as CUDA graphs, median of 15, on channels-last fp16 operands. Every timing
is written with its achieved TFLOP/s (2 * B * entries * Cin * Cout / time); grad_weight's
candidates are also timed at several window sizes (launch.grad_weight_windows: the fraction
of L2 a window's rows may take; 0: windows that only fill the GPU, whatever their rows).
The current rule's choice and the fastest candidate per family are printed, for tiles.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from knnconv.ops import get_ops
from knnconv.ops.triton import configs, launch
from knnconv.tools.bench import graph_replay_ms, load_geometry_dir

DEVICE = torch.device("cuda")
# (block_m, block_n, block_k, warps, stages) candidates per family, before fitting; eight
# warps (two warpgroups) where a tile holds 128 x 128 accumulators or more. The gather-GEMMs'
# boxes get about half the stages as buffers (tiles.json's "about"): 5 and 6 stages are
# three buffers, which on sm_90 keep the programs per SM of 4 stages' two for 128 x 128
# (registers bound it) and cost one of 64 x 128's four (python -m knnconv.tools.triton_build)
GEMM_TILES = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
              (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3),
              (128, 128, 32, 8, 5), (64, 64, 64, 4, 4), (128, 128, 64, 8, 5),
              (128, 256, 64, 8, 5), (64, 128, 64, 4, 6), (64, 64, 64, 4, 6)]
SPACE = {"forward": GEMM_TILES, "grad_input": GEMM_TILES,
         "grad_weight": [(128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4),
                         (128, 64, 64, 4, 4), (64, 64, 128, 4, 4), (128, 256, 64, 8, 3),
                         (256, 128, 64, 8, 3), (64, 64, 256, 4, 3), (64, 128, 128, 4, 3),
                         (128, 256, 128, 8, 2), (128, 128, 256, 8, 2), (128, 128, 64, 8, 5),
                         (64, 128, 64, 4, 6), (64, 64, 128, 4, 6)],
         # few-channel stems: batch rows, output columns, contraction rows (several
         # neighbours' channel slots)
         "stem_forward": [(128, 64, 32, 4, 3), (128, 64, 64, 4, 3), (64, 64, 64, 4, 3),
                          (128, 64, 128, 8, 3), (256, 64, 64, 8, 3), (64, 64, 32, 4, 4),
                          (128, 128, 64, 8, 3), (256, 64, 32, 8, 4)],
         # a node's partial rows (its slots' channels), output columns, batch rows
         "stem_grad_weight": [(64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (128, 64, 64, 8, 3),
                              (256, 64, 64, 8, 3), (256, 64, 32, 8, 4), (256, 64, 128, 8, 2),
                              (128, 64, 128, 8, 3), (64, 64, 128, 4, 3), (256, 128, 64, 8, 2)],
         # dx's slot gradients: slot rows, batch columns, output-channel chunk
         "stem_grad_input": [(256, 64, 64, 8, 2), (256, 128, 64, 8, 2), (128, 64, 64, 4, 2),
                             (128, 128, 64, 8, 2), (256, 32, 64, 8, 2), (256, 64, 32, 8, 3),
                             (64, 64, 64, 4, 2)]}
STEM_FAMILIES = ("stem_forward", "stem_grad_weight", "stem_grad_input")
# grad_weight's window sizes per candidate tile, as the fraction of L2 a window's rows may
# take (0: no bound); launch.WINDOW_L2_FRACTION, the default, must be one of them
WINDOW_L2_FRACTIONS = (0, 3, 5, 8, 12)


def _integers(variable: str, default: tuple[int, ...]) -> tuple[int, ...]:
    value = os.environ.get(variable)
    return default if not value else tuple(int(part) for part in value.split(","))


def fitted(family: str, plan, batch: int, raw: tuple) -> configs.TileConfig | None:
    """A candidate fitted to the layer as the rules' tiles are (configs.fit), or None where
    its contraction chunk does not divide the contracted channels."""
    tile = configs.TileConfig(*raw)
    if family == "stem_grad_input":
        return configs.fit(tile, batch, plan.cout, None)
    if family in STEM_FAMILIES:
        return configs.fit(tile, plan.cout, None, None)
    n = plan.cin if family == "grad_input" else plan.cout
    if family == "grad_weight":
        return configs.fit(tile, n, None, plan.cin)
    contracted = plan.cin if family == "forward" else plan.cout
    return None if contracted % tile.block_k else configs.fit(tile, n, contracted, None)


def launcher(family: str, plan, batch: int, tile, operands, l2_fraction: int,
             programs_per_sm: int, chain_links: int):
    x, weight, grad_y, tables = operands
    if family == "stem_forward":
        return lambda: launch.stem_forward(x, weight, None, tables, nin=plan.nin,
                                           nout=plan.nout, v=plan.v, tile=tile)
    if family == "stem_grad_weight":
        return lambda: launch.stem_grad_weight(grad_y, x, tables, nin=plan.nin, v=plan.v,
                                               tile=tile)
    if family == "stem_grad_input":
        return lambda: launch.stem_grad_input(grad_y, weight, tables, nin=plan.nin, v=plan.v,
                                              tile=tile, dtype=torch.float16)
    if family == "forward":
        return lambda: launch.forward(x, weight, None, tables, nout=plan.nout, v=plan.v,
                                      tile=tile)
    if family == "grad_input":
        return lambda: launch.grad_input(grad_y, weight, tables, nin=plan.nin, v=plan.v,
                                         tile=tile, dtype=torch.float16)
    properties = torch.cuda.get_device_properties(DEVICE)
    windows = launch.grad_weight_windows(
        tile, batch=batch, cin=plan.cin, cout=plan.cout, nin=plan.nin, nout=plan.nout,
        v=plan.v, entries=plan.entry_count, processors=properties.multi_processor_count,
        l2_bytes=properties.L2_cache_size if l2_fraction else None,
        l2_fraction=l2_fraction or launch.WINDOW_L2_FRACTION, programs_per_sm=programs_per_sm,
        chain_links=chain_links)
    starts = get_ops("triton").share_starts(plan, DEVICE, windows.shares)
    return lambda: launch.grad_weight(grad_y, x, tables, starts, v=plan.v, tile=tile,
                                      windows=windows)


def tune_cell(layer, batch: int, families: list[str]) -> list[dict]:
    plan = layer.plan()

    def channels_last(*shape):
        return torch.randn(shape[0], shape[2], shape[1], device=DEVICE,
                           dtype=torch.float16).transpose(1, 2)

    stem = configs.few_channels(plan.cin)
    operands = (channels_last(batch, plan.cin, plan.nin),
                torch.randn(plan.cout, plan.q, device=DEVICE, dtype=torch.float16),
                channels_last(batch, plan.cout, plan.nout),
                (get_ops("triton").stem_tables if stem else get_ops("triton").tables)(plan,
                                                                                      DEVICE))
    flop = 2 * batch * plan.entry_count * plan.cin * plan.cout
    rows = []
    for family in [f for f in families if (f in STEM_FAMILIES) == stem]:
        space = SPACE[family]
        chosen = {"forward": lambda: launch.forward_tile(batch, plan.cin, plan.cout, plan.nout),
                  "grad_input": lambda: launch.grad_input_tile(batch, plan.cin, plan.cout,
                                                               plan.nin),
                  "grad_weight": lambda: launch.grad_weight_tile(batch, plan.cin, plan.cout),
                  "stem_forward": lambda: launch.stem_forward_tile(batch, plan.cout),
                  "stem_grad_weight": lambda: launch.stem_grad_weight_tile(batch,
                                                                           plan.cout),
                  "stem_grad_input": lambda: launch.stem_grad_input_tile(batch, plan.cout),
                  }[family]()
        tiles = {chosen} | {t for raw in space if (t := fitted(family, plan, batch, raw))}
        # (L2 fraction, programs per SM, chain links) of each timing; the rules' own always
        # among them
        shipped = (launch.WINDOW_L2_FRACTION, launch.PROGRAMS_PER_SM, launch.CHAIN_LINKS)
        spreads = [shipped]
        if family == "grad_weight":
            spreads = sorted(set(spreads) | {
                (fraction, programs, links)
                for fraction in _integers("KNNCONV_TUNE_L2_FRACTIONS", WINDOW_L2_FRACTIONS)
                for programs in _integers("KNNCONV_TUNE_PROGRAMS_PER_SM",
                                          (launch.PROGRAMS_PER_SM,))
                for links in _integers("KNNCONV_TUNE_CHAIN_LINKS", (launch.CHAIN_LINKS,))})
        for tile in sorted(tiles, key=str):
            for l2_fraction, programs_per_sm, chain_links in spreads:
                try:
                    ms = graph_replay_ms(launcher(family, plan, batch, tile, operands,
                                                  l2_fraction, programs_per_sm, chain_links),
                                         DEVICE, warmup=2, repeats=15)[0]
                except Exception as exc:  # a tile the compiler rejects (shared memory)
                    print(f"  {family} {tile}: {type(exc).__name__}: {str(exc)[:120]}")
                    break
                rows.append({"layer": layer.name, "batch": batch, "family": family,
                             "tile": tile.__dict__, "l2_fraction": l2_fraction,
                             "programs_per_sm": programs_per_sm, "chain_links": chain_links,
                             "chosen": (tile == chosen and (l2_fraction, programs_per_sm,
                                                            chain_links) == shipped),
                             "ms": ms, "tflops": flop / ms / 1e9})
        timed = [r for r in rows if r["family"] == family]
        best = min(timed, key=lambda r: r["ms"])
        current = next(r for r in timed if r["chosen"])
        print(f"{layer.name[-40:]:40} B={batch:5} {family:11} rule {current['ms']:.3f} ms "
              f"({current['tflops']:.0f} TFLOP/s)  best {best['ms']:.3f} ms "
              f"({best['tflops']:.0f} TFLOP/s) {best['tile']} "
              f"L2 fraction {best['l2_fraction']}, {best['programs_per_sm']} programs per SM, "
              f"chains of {best['chain_links']}",
              flush=True)
    return rows


def main() -> int:
    geometry, out, cells = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    families = os.environ.get("KNNCONV_TUNE_FAMILIES", ",".join(SPACE)).split(",")
    rows = []
    for cell in cells:
        substring, batch = cell.rsplit(":", 1)
        for layer in load_geometry_dir(geometry, [substring])[:1]:
            rows += tune_cell(layer, int(batch), families)
            out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
