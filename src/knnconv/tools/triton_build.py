"""What the ``triton`` backend's kernels compile to on a GPU architecture, found on any
machine (no GPU, no CUDA driver): per tile, the registers, spills and shared memory of each
kernel, the box buffers of its software pipeline and how many of its programs one SM holds.

``python -m knnconv.tools.triton_build [--arch sm_90] [--families forward,grad_input]
[--configs 128,128,64,8,6 ...] [--json OUT.json]`` compiles every tile of tiles.json's rules
(or the given ``block_m,block_n,block_k,warps,stages`` tiles) through the backend's own
launch functions, on small CPU tensors shaped so that the tile is not fitted down: the
kernels, constexprs and specialisations are those a call of that tile launches. Triton's
driver is replaced for the run by one that only names the target, and each launch only
compiles (``JITFunction.warmup``). Run it with ``TRITON_INTERPRET`` unset or 0: the
interpreter's kernels do not compile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

from knnconv.ops.triton import configs as tile_configs
from knnconv.ops.triton import launch, launcher, tables
from knnconv.ops.triton.configs import FAMILIES, TileConfig

# per architecture the triton backend serves (sm_90 up): registers and the largest shared
# memory one block may take (bytes), the shared memory of an SM and the warps an SM holds
# (CUDA programming guide, compute capabilities table)
ARCHITECTURES = {
    "sm_90": {"capability": 90, "registers": 65536, "block_shared": 232448,
              "sm_shared": 233472, "warps": 64},
    "sm_100": {"capability": 100, "registers": 65536, "block_shared": 232448,
               "sm_shared": 233472, "warps": 64},
}
RESERVED_SHARED = 1024  # the shared memory the driver reserves per block
MAX_BLOCKS_PER_SM = 32
REGISTER_UNIT = 8  # registers per thread are allocated in multiples of this (256 a warp)
# a multi-buffered shared-memory allocation of the pipeliner, buffers x rows x columns
_BUFFERED = re.compile(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x(?:f16|bf16)")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass
class CompiledTile:
    """One kernel of one tile as compiled: ``buffers`` is the depth of its pipeline's
    shared-memory ring (0: no operand is multi-buffered)."""

    family: str
    kernel: str
    tile: tuple[int, int, int, int, int]
    arch: str
    registers: int
    spilled_bytes: int
    shared_bytes: int
    buffers: int
    programs_per_sm: int
    limited_by: str


class _CompileOnlyDriver:
    """Triton's active driver for a compile-only run: a device 0, stream 0 and the target."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


# Triton keeps each kernel's target per device once it has seen it, so a process compiles
# for one architecture
_process_arch: list[str] = []


@contextmanager
def compile_only(arch: str):
    """Within it, every KernelLauncher launch compiles for ``arch`` and launches nothing; yields
    the list that collects (kernel name, CompiledKernel) in launch order."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("triton_build compiles kernels: unset TRITON_INTERPRET")
    if _process_arch and _process_arch[0] != arch:
        raise RuntimeError(f"this process compiled for {_process_arch[0]}; compile for {arch} "
                           "in another")
    _process_arch[:] = [arch]
    compiled: list[tuple[str, object]] = []

    def warmup(self, grid, args, kwargs):
        values = [arg.descriptor() if type(arg) is launcher.Box else arg for arg in args]
        compiled.append((self.kernel.__name__, self.kernel.warmup(*values, grid=grid,
                                                                   **kwargs)))

    # the driver set before (None: Triton's default, made when first asked for) comes back
    # after; reset_active would make the default now, which fails where no GPU is
    previous = driver._active
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", ARCHITECTURES[arch]["capability"],
                                                   32)))
    launch = launcher.KernelLauncher.launch
    launcher.KernelLauncher.launch = warmup
    try:
        yield compiled
    finally:
        launcher.KernelLauncher.launch = launch
        driver.set_active(previous)


# the sample layer every tile is compiled on: batch, nodes, neighbours and kernel cells
BATCH, NIN, NOUT, K, V = 2, 24, 12, 7, 5


def _channels_last(channels: int, nodes: int, dtype) -> torch.Tensor:
    return torch.randn(BATCH, nodes, channels, dtype=dtype).transpose(1, 2)


def launch_tile(family: str, tile, dtype=torch.float16) -> None:
    """One call of ``family``'s launch function with ``tile``, on a small random layer (with
    padding slots) whose channels the tile fits without change (two contraction chunks,
    columns of one block)."""
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    cin, cout = {"forward": (2 * bk, bn), "grad_input": (bn, 2 * bk), "grad_weight": (bm, bn),
                 "stem_forward": (3, bn), "stem_grad_weight": (3, bn),
                 "stem_grad_input": (3, 2 * bk)}.get(family, (bn, bn))
    generator = torch.Generator().manual_seed(0)
    knn = torch.randint(0, NIN + 1, (K, NOUT), generator=generator)
    rf = torch.randint(0, V, (NOUT, K), generator=generator)
    x, grad_y = _channels_last(cin, NIN, dtype), _channels_last(cout, NOUT, dtype)
    if family in ("forward", "grad_input", "grad_weight"):
        layer = tables.build_tables(knn, rf, nin=NIN, v=V, cin=cin, cout=cout)
        weight = torch.randn(cout, cin * V)
        if family == "forward":
            launch.forward(x, weight, torch.randn(cout), layer, nout=NOUT, v=V, tile=tile)
        elif family == "grad_input":
            launch.grad_input(grad_y, weight, layer, nin=NIN, v=V, tile=tile, dtype=dtype)
        else:
            # two shares, groups and sums: no size Triton specialises as 1
            windows = launch.Windows(shares=2, groups=2, sums=2)
            starts = tables.build_share_starts(layer, nout=NOUT, cout=cout, v=V, shares=2)
            launch.grad_weight(grad_y, x, layer, starts, v=V, tile=tile, windows=windows)
    elif family.startswith("stem_"):
        stem = tables.build_stem_tables(knn, rf, nin=NIN, v=V)
        weight = torch.randn(cout, cin * V)
        if family == "stem_forward":
            launch.stem_forward(x, weight, torch.randn(cout), stem, nin=NIN, nout=NOUT, v=V,
                                tile=tile)
        elif family == "stem_grad_weight":
            launch.stem_grad_weight(grad_y, x, stem, nin=NIN, v=V, tile=tile)
        else:
            launch.stem_grad_input(grad_y, weight, stem, nin=NIN, v=V, tile=tile, dtype=dtype)
    elif family == "grad_bias":
        # enough rows for several programs of several steps each
        grad_y = torch.randn(4 * bm, 64, bn, dtype=dtype).transpose(1, 2)
        launch.grad_bias(grad_y, tile=tile, processors=2)
    elif family.startswith("depthwise_"):
        slot_cells = torch.where(knn == NIN, V, rf.t())
        depthwise = tables.build_depthwise_tables(knn, slot_cells, nin=NIN, v=V)
        weight = torch.randn(cin, V)
        if family == "depthwise_forward":
            launch.depthwise_forward(x, weight, torch.randn(cin), depthwise, nin=NIN,
                                     tile=tile)
        elif family == "depthwise_grad_input":
            launch.depthwise_grad_input(grad_y, weight, depthwise, nin=NIN, tile=tile,
                                        dtype=dtype)
        else:
            launch.depthwise_grad_weight(grad_y, x, depthwise, v=V, tile=tile, splits=2)
    else:
        raise ValueError(f"unknown family {family!r}")


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, spilled bytes per thread) of a cubin's one kernel, read with the
    cuobjdump that ships with Triton."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run([str(tool), "--dump-resource-usage", file.name],
                                capture_output=True, text=True, check=True).stdout
    registers, stack, _, local = map(int, _USAGE.search(report).groups())
    return registers, stack + local


def programs_per_sm(arch: str, *, registers: int, shared_bytes: int,
                    warps: int) -> tuple[int, str]:
    """How many programs of a kernel one SM holds, and what limits it."""
    limits = ARCHITECTURES[arch]
    per_thread = -(-max(registers, 1) // REGISTER_UNIT) * REGISTER_UNIT
    bounds = {"registers": limits["registers"] // (per_thread * 32 * warps),
              "shared memory": limits["sm_shared"] // (shared_bytes + RESERVED_SHARED),
              "warps": limits["warps"] // warps, "blocks": MAX_BLOCKS_PER_SM}
    limit = min(bounds, key=bounds.get)
    return bounds[limit], limit


def compile_tiles(arch: str, families: list[str],
                  configs: list | None = None) -> list[CompiledTile]:
    """Every kernel the launches of each family's tiles (tiles.json's rules, or ``configs``)
    compile to on ``arch``, once per distinct kernel and tile."""
    reports, seen = [], set()
    for family in families:
        tiles = configs or [tile for _, tile in tile_configs.rules()[family]]
        for tile in tiles:
            with compile_only(arch) as compiled:
                launch_tile(family, tile)
            fields = (tile.block_m, tile.block_n, tile.block_k, tile.warps, tile.stages)
            for name, kernel in compiled:
                if (family, name, fields) in seen:
                    continue
                seen.add((family, name, fields))
                registers, spilled = _resource_usage(kernel.asm["cubin"])
                shared = kernel.metadata.shared
                buffers = max((int(b) for b in _BUFFERED.findall(kernel.asm["ttgir"])),
                              default=0)
                programs, limit = programs_per_sm(arch, registers=registers,
                                                  shared_bytes=shared,
                                                  warps=kernel.metadata.num_warps)
                reports.append(CompiledTile(family, name, fields, arch, registers, spilled,
                                            shared, buffers, programs, limit))
    return reports


def _tile(text: str):
    return TileConfig(*(int(part) for part in text.split(",")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m knnconv.tools.triton_build",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90", choices=sorted(ARCHITECTURES))
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help="comma-separated families (default: all)")
    parser.add_argument("--configs", nargs="*", type=_tile, default=None,
                        help="tiles block_m,block_n,block_k,warps,stages instead of the rules'")
    parser.add_argument("--json", type=Path, default=None, help="write the reports here")
    options = parser.parse_args(argv)
    reports = compile_tiles(options.arch, options.families.split(","), options.configs)
    print(f"{'family':22} {'kernel':34} {'tile':22} {'regs':>4} {'spill':>5} {'shared':>7} "
          f"{'bufs':>4} {'per SM':>6}  limit")
    for r in reports:
        print(f"{r.family:22} {r.kernel:34} {str(r.tile):22} {r.registers:4} "
              f"{r.spilled_bytes:5} {r.shared_bytes:7} {r.buffers:4} {r.programs_per_sm:6}  "
              f"{r.limited_by}")
    if options.json:
        options.json.write_text(json.dumps(
            {"triton": triton.__version__, "arch": options.arch,
             "reports": [asdict(r) for r in reports]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
