"""Launches of the ``triton`` backend's kernels (knnconv.ops.triton.kernels): the tiles, the
boxed operands, the grids and the outputs of one call. Operands arrive in the storage the
kernels read (see :func:`boxable`), with a multiple of MIN_BLOCK input channels (see
:func:`padded_channels`); the weight is laid out by cell here, once per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
import triton

from .bias_kernels import grad_bias_partials_kernel
from .configs import MIN_BLOCK, TileConfig, tile_config
from .depthwise_kernels import (
    knn_depthwise_forward_kernel,
    knn_depthwise_grad_input_kernel,
    knn_depthwise_grad_weight_kernel,
)
from .kernels import (
    knn_conv_forward_kernel,
    knn_conv_grad_input_kernel,
    knn_conv_grad_weight_kernel,
)
from .launcher import Box, KernelLauncher
from .stem_kernels import (
    knn_stem_entry_sum_kernel,
    knn_stem_forward_kernel,
    knn_stem_grad_weight_kernel,
    knn_stem_slot_grad_kernel,
)
from .tables import DepthwiseTables, StemTables, TritonTables

# Each kernel is launched through its compiled specialisation's launcher
# (knnconv.ops.triton.launcher): Triton's dispatch of a call cost the host more than the launch
conv_forward_kernel = KernelLauncher(knn_conv_forward_kernel)
grad_bias_kernel = KernelLauncher(grad_bias_partials_kernel)
conv_grad_input_kernel = KernelLauncher(knn_conv_grad_input_kernel)
conv_grad_weight_kernel = KernelLauncher(knn_conv_grad_weight_kernel)
depthwise_forward_kernel = KernelLauncher(knn_depthwise_forward_kernel)
depthwise_grad_input_kernel = KernelLauncher(knn_depthwise_grad_input_kernel)
depthwise_grad_weight_kernel = KernelLauncher(knn_depthwise_grad_weight_kernel)
stem_forward_kernel = KernelLauncher(knn_stem_forward_kernel)
stem_grad_weight_kernel = KernelLauncher(knn_stem_grad_weight_kernel)
stem_entry_sum_kernel = KernelLauncher(knn_stem_entry_sum_kernel)
stem_slot_grad_kernel = KernelLauncher(knn_stem_slot_grad_kernel)

TMA_ALIGNMENT = 16  # bytes: a tensor map's base address and row strides
# The dW kernels split each cell's steps (batch chunks x pairs) until the grid holds this many
# programs per SM, or a split would get fewer than MIN_STEPS_PER_SPLIT steps (on average);
# measured (bench/NOTES.md, 2026-12-03): more programs hide the latency of each step's loads
PROGRAMS_PER_SM = 8
MIN_STEPS_PER_SPLIT = 16
# The convolution's dW walks windows (node shares x batch-chunk groups) whose x and grad_y rows
# take at most this fraction of the L2 cache, so that the rows the programs of all cells read
# at once stay there (bench/NOTES.md, 2026-12-05)
WINDOW_L2_FRACTION = 5
# Each dW tile's windows add into float32 sums, one chain of turns per sum: as many sums as
# keep every chain within CHAIN_LINKS windows, in at most SUMS_BYTES of sums. A link (waiting
# for the turn, adding the tile, passing the turn on) costs microseconds, which layers of many
# short windows (few nodes, few cells) would otherwise pay once per window
CHAIN_LINKS = 16
SUMS_BYTES = 32 * 2**20
# the bias gradient's programs sum at least this many row blocks each (fewer programs where
# the rows are few), up to PROGRAMS_PER_SM programs per SM
GRAD_BIAS_MIN_STEPS = 4
# the few-channel kernels' sums (dW per cell, dx per input node) load this many table
# entries per step
SUM_ENTRIES = 32
# the few-channel dx's slot gradients Q (float32 [Nout, K*Cin, batch chunk]) take at most this
# many bytes: the batch is walked in chunks of Q's size
STEM_SLOT_GRAD_BYTES = 512 * 2**20
# the batch columns one program of the few-channel dx's per-input-node sum writes
PAIR_SUM_BATCH = 64


def boxable(t: torch.Tensor) -> bool:
    """Whether [B, C, N] t can be read as the 2-D view [B, N*C] of tensor maps: channels-last
    storage (any batch stride) with a 16-byte aligned base and batch stride."""
    batch, channels, nodes = t.shape
    element = t.element_size()
    return ((channels == 1 or t.stride(1) == 1) and (nodes == 1 or t.stride(2) == channels)
            and t.data_ptr() % TMA_ALIGNMENT == 0
            and (batch == 1 or t.stride(0) * element % TMA_ALIGNMENT == 0))


def channel_slots(cin: int) -> int:
    """The contraction rows a neighbour takes in the few-channel kernels: a power of two."""
    return 1 << (cin - 1).bit_length()


def padded_channels(cin: int) -> int:
    """The input channels the kernels take for a layer of ``cin``: a multiple of MIN_BLOCK (a
    contraction chunk, and a box row of at least 16 bytes). An image stem's three channels
    become sixteen, the extra ones zeros: its neighbours' rows are then boxes too, at the
    price of contracting zeros."""
    return -(-cin // MIN_BLOCK) * MIN_BLOCK


def with_padded_channels(x: torch.Tensor, channels: int) -> torch.Tensor:
    """x [B, Cin, Nin] as [B, channels, Nin] (channels >= Cin, the extra ones zero), the view
    of a contiguous [B, Nin, channels] buffer: :func:`boxable`."""
    batch, cin, nin = x.shape
    padded = x.new_zeros(batch, nin, channels)
    padded[:, :, :cin] = x.transpose(1, 2)
    return padded.transpose(1, 2)


def weight_with_padded_channels(weight: torch.Tensor, channels: int, v: int) -> torch.Tensor:
    """weight [Cout, Cin*V] as [Cout, channels*V], zero for the extra channels (column
    c*V + v belongs to channel c, so they are the last columns)."""
    return torch.nn.functional.pad(weight, (0, channels * v - weight.shape[1]))


def rows_box(t: torch.Tensor, block: tuple[int, int]) -> Box:
    """[B, C, N] channels-last t as the 2-D view [B, N*C], in boxes of ``block``."""
    batch, channels, nodes = t.shape
    stride = t.stride(0) if batch > 1 else nodes * channels
    return Box(t, (batch, nodes * channels), (stride, 1), block)


def matrix_box(t: torch.Tensor, block: tuple[int, int]) -> Box:
    """Contiguous 2-D t in boxes of ``block``."""
    return Box(t, tuple(t.shape), (t.shape[1], 1), block)


def _poisoned_or_empty(shape, dtype, device, poison: bool) -> torch.Tensor:
    if poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# The tiles of a call depend on its sizes alone: worked out once per size (the host path of a
# small layer is as long as its kernels)
@cache
def forward_tile(batch: int, cin: int, cout: int, nout: int) -> TileConfig:
    return tile_config("forward", batch=batch, n=cout, nodes=nout, contracted_channels=cin)


@cache
def grad_input_tile(batch: int, cin: int, cout: int, nin: int) -> TileConfig:
    return tile_config("grad_input", batch=batch, n=cin, nodes=nin, contracted_channels=cout)


@cache
def grad_weight_tile(batch: int, cin: int, cout: int) -> TileConfig:
    return tile_config("grad_weight", batch=batch, n=cout, rows=cin)


@cache
def stem_forward_tile(batch: int, cout: int) -> TileConfig:
    return tile_config("stem_forward", batch=batch, n=cout)


@cache
def stem_grad_weight_tile(batch: int, cout: int) -> TileConfig:
    return tile_config("stem_grad_weight", batch=batch, n=cout)


@cache
def stem_grad_input_tile(batch: int, cout: int) -> TileConfig:
    return tile_config("stem_grad_input", batch=batch, n=batch, contracted_channels=cout)


@cache
def grad_bias_tile(channels: int) -> TileConfig:
    return tile_config("grad_bias", batch=1, n=channels)


@dataclass(frozen=True)
class Windows:
    """How the convolution's dW walks each cell's pairs: the output nodes in ``shares``
    equal shares, the batch chunks in ``groups`` equal groups; window w is share w % shares of
    group w // shares, and adds into float32 sum w % ``sums``."""

    shares: int
    groups: int
    sums: int = 1

    @property
    def count(self) -> int:
        return self.shares * self.groups


@cache
def grad_weight_windows(tile: TileConfig, *, batch: int, cin: int, cout: int, nin: int,
                        nout: int, v: int, entries: int, processors: int, l2_bytes: int | None,
                        programs_per_sm: int = PROGRAMS_PER_SM,
                        l2_fraction: int = WINDOW_L2_FRACTION,
                        chain_links: int = CHAIN_LINKS) -> Windows:
    """The windows of a dW call: each one's x and grad_y rows (2-byte elements) within
    ``l2_bytes / l2_fraction`` (``l2_bytes`` None: any size); then, where the programs of
    all cells' tiles would not give ``programs_per_sm`` programs per SM, more windows, but
    none of fewer than MIN_STEPS_PER_SPLIT steps (on average); and enough sums that each
    tile's chain has at most ``chain_links`` windows, within SUMS_BYTES."""
    chunks = max(1, math.ceil(batch / tile.block_k))
    tiles = v * math.ceil(cin / tile.block_m) * math.ceil(cout / tile.block_n)
    chunk_bytes = tile.block_k * 2 * (nout * cout + nin * cin)
    shares = groups = 1
    if l2_bytes:
        budget = max(1, l2_bytes // l2_fraction)
        shares = min(nout, math.ceil(chunk_bytes / budget))
        per_group = max(1, budget // math.ceil(chunk_bytes / shares))
        groups = math.ceil(chunks / min(chunks, per_group))
    target = max(shares * groups, _splits(tiles, entries * chunks // v, processors,
                                          programs_per_sm))
    groups = max(groups, min(chunks, math.ceil(target / shares)))
    shares = max(shares, min(nout, math.ceil(target / groups)))
    most_sums = max(1, SUMS_BYTES // (4 * v * cin * cout))
    sums = min(shares * groups, most_sums, math.ceil(shares * groups / chain_links))
    return Windows(shares, groups, sums)


def _splits(tiles: int, steps_per_tile: int, processors: int, programs_per_sm: int) -> int:
    """How many slices each of ``tiles`` splits its steps into: enough for
    ``programs_per_sm`` programs per SM, none of fewer than MIN_STEPS_PER_SPLIT steps."""
    wanted = math.ceil(programs_per_sm * processors / tiles)
    return max(1, min(wanted, steps_per_tile // MIN_STEPS_PER_SPLIT))


def depthwise_grad_weight_splits(tile: TileConfig, *, batch: int, channels: int, v: int,
                                 entries: int, processors: int) -> int:
    """:func:`_splits` for the depthwise dW: a tile is one cell's channel tile, a step one
    batch chunk of one of its slots."""
    tiles = v * math.ceil(channels / tile.block_n)
    steps = entries * math.ceil(batch / tile.block_m) // v
    return _splits(tiles, steps, processors, PROGRAMS_PER_SM)


def grad_bias(grad_y: torch.Tensor, *, tile: TileConfig, processors: int,
              poison: bool = False) -> torch.Tensor:
    """The bias gradient [C] in float32, grad_y [B, C, N] summed over the batch and the nodes
    (any strides): each program's rows into its partial, then the partials in a fixed
    order."""
    batch, channels, nout = grad_y.shape
    rows = batch * nout
    column_tiles = triton.cdiv(channels, tile.block_n)
    steps = triton.cdiv(rows, tile.block_m)
    programs = max(1, min(steps // GRAD_BIAS_MIN_STEPS,
                          PROGRAMS_PER_SM * processors // column_tiles))
    rows_per_program = triton.cdiv(steps, programs) * tile.block_m
    programs = triton.cdiv(rows, rows_per_program)
    partials = _poisoned_or_empty((programs, channels), torch.float32, grad_y.device, poison)
    grad_bias_kernel[(programs, column_tiles)](
        grad_y, partials, rows, nout, channels, rows_per_program, *_strides(grad_y),
        BR=tile.block_m, BC=tile.block_n, num_warps=tile.warps, num_stages=tile.stages)
    return partials[0] if programs == 1 else partials.sum(dim=0)


def weight_by_cell(weight: torch.Tensor, cin: int, v: int, dtype: torch.dtype, *,
                   reverse: bool) -> torch.Tensor:
    """weight [Cout, Cin*V] (any float dtype) laid out by cell in ``dtype``: [V*Cin, Cout]
    (wc[v*Cin + c, o] = W[o, c*V + v]) for the forward, or [V*Cout, Cin] (wr[v*Cout + o, c])
    for dx when ``reverse``. One copy kernel casts and permutes."""
    cout = weight.shape[0]
    cells = weight.view(cout, cin, v).permute(2, 0, 1) if reverse else weight.view(
        cout, cin, v).permute(2, 1, 0)
    laid_out = torch.empty(cells.shape, dtype=dtype, device=weight.device)
    return laid_out.copy_(cells).view(-1, cin if reverse else cout)


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            tables: TritonTables, *, nout: int, v: int, tile: TileConfig,
            poison: bool = False) -> torch.Tensor:
    """y [B, Cout, Nout] in x's dtype, the view of a contiguous [B, Nout, Cout] buffer; x
    [B, Cin, Nin] must be :func:`boxable`; bias (any float dtype) is added in float32."""
    batch, cin, _ = x.shape
    cout = weight.shape[0]
    cells = weight_by_cell(weight, cin, v, x.dtype, reverse=False)
    y = _poisoned_or_empty((batch, nout, cout), x.dtype, x.device, poison)
    grid = (nout, triton.cdiv(batch, tile.block_m), triton.cdiv(cout, tile.block_n))
    conv_forward_kernel[grid](
        rows_box(x, (tile.block_m, tile.block_k)),
        matrix_box(cells, (tile.block_k, tile.block_n)),
        y, y if bias is None else bias, tables.count, tables.entry_x, tables.entry_w,
        batch, nout, cout, tables.entry_x.shape[1],
        HAS_BIAS=bias is not None, CHUNKS=cin // tile.block_k, BM=tile.block_m,
        BN=tile.block_n, BK=tile.block_k, num_warps=tile.warps, num_stages=tile.stages)
    return y.transpose(1, 2)


def grad_input(grad_y: torch.Tensor, weight: torch.Tensor, tables: TritonTables, *, nin: int,
               v: int, tile: TileConfig, dtype: torch.dtype,
               poison: bool = False) -> torch.Tensor:
    """dx [B, Cin, Nin] in ``dtype``, the view of a contiguous [B, Nin, Cin] buffer; grad_y
    [B, Cout, Nout] must be :func:`boxable`."""
    batch, cout, _ = grad_y.shape
    cin = weight.shape[1] // v
    cells = weight_by_cell(weight, cin, v, grad_y.dtype, reverse=True)
    dx = _poisoned_or_empty((batch, nin, cin), dtype, grad_y.device, poison)
    grid = (nin, triton.cdiv(batch, tile.block_m), triton.cdiv(cin, tile.block_n))
    conv_grad_input_kernel[grid](
        rows_box(grad_y, (tile.block_m, tile.block_k)),
        matrix_box(cells, (tile.block_k, tile.block_n)),
        dx, tables.pair_start, tables.pair_gy, tables.pair_w, batch, nin, cin,
        CHUNKS=cout // tile.block_k, BM=tile.block_m, BN=tile.block_n, BK=tile.block_k,
        num_warps=tile.warps, num_stages=tile.stages)
    return dx.transpose(1, 2)


def grad_weight(grad_y: torch.Tensor, x: torch.Tensor, tables: TritonTables,
                share_starts: torch.Tensor, *, v: int, tile: TileConfig, windows: Windows,
                poison: bool = False) -> torch.Tensor:
    """dW [Cout, Cin*V] in float32, deterministic: window w adds its sums into sum w %
    ``windows.sums`` of each cell's tile, each sum's windows in window order, and the sums
    are added in a fixed order. ``share_starts``: tables.build_share_starts for
    ``windows.shares``. x [B, Cin, Nin] and grad_y [B, Cout, Nout] must be :func:`boxable`."""
    batch, cin, _ = x.shape
    cout = grad_y.shape[1]
    sums = _poisoned_or_empty((windows.sums, v, cin, cout), torch.float32, x.device, poison)
    tiles = triton.cdiv(cin, tile.block_m) * triton.cdiv(cout, tile.block_n)
    turns = torch.zeros(windows.sums * v * tiles, dtype=torch.int32, device=x.device)
    conv_grad_weight_kernel[(windows.count * v * tiles,)](
        rows_box(x, (tile.block_k, tile.block_m)),
        rows_box(grad_y, (tile.block_k, tile.block_n)),
        sums, turns, share_starts, tables.cell_x, tables.cell_gy, cin, cout, v,
        windows.shares, windows.groups, triton.cdiv(batch, tile.block_k), windows.sums,
        BM=tile.block_m, BN=tile.block_n, BB=tile.block_k, num_warps=tile.warps,
        num_stages=tile.stages)
    # [sums, V, Cin, Cout] -> [Cout, Cin, V], the sums added in one reduction (a fixed order)
    if windows.sums == 1:
        return sums[0].permute(2, 1, 0).reshape(cout, cin * v)
    grad = torch.empty((cout, cin, v), dtype=torch.float32, device=x.device)
    torch.sum(sums.permute(0, 3, 2, 1), dim=0, out=grad)
    return grad.view(cout, cin * v)


@cache
def depthwise_tile(family: str, batch: int, channels: int) -> TileConfig:
    return tile_config(family, batch=batch, n=channels)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, node, channel) element strides of [B, C, N] t."""
    return t.stride(0), t.stride(2), t.stride(1)


def depthwise_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      tables: DepthwiseTables, *, nin: int, tile: TileConfig,
                      poison: bool = False) -> torch.Tensor:
    """The depthwise y [B, C, Nout] in x's dtype, the view of a contiguous [B, Nout, C]
    buffer; x [B, C, Nin] in any storage (channels-last reads its rows whole)."""
    batch, channels, _ = x.shape
    nout = tables.neighbour.shape[1]
    y = _poisoned_or_empty((batch, nout, channels), x.dtype, x.device, poison).transpose(1, 2)
    grid = (nout, triton.cdiv(batch, tile.block_m), triton.cdiv(channels, tile.block_n))
    depthwise_forward_kernel[grid](
        x, weight.t().contiguous(), y if bias is None else bias, y, tables.neighbour,
        tables.cell, batch, channels, nin, nout, tables.neighbour.shape[0], *_strides(x),
        *_strides(y), HAS_BIAS=bias is not None, BB=tile.block_m, BC=tile.block_n,
        num_warps=tile.warps, num_stages=tile.stages)
    return y


def depthwise_grad_input(grad_y: torch.Tensor, weight: torch.Tensor, tables: DepthwiseTables,
                         *, nin: int, tile: TileConfig, dtype: torch.dtype,
                         poison: bool = False) -> torch.Tensor:
    """The depthwise dx [B, C, Nin] in ``dtype``, the view of a contiguous [B, Nin, C]
    buffer, each element written once; grad_y [B, C, Nout] in any storage."""
    batch, channels, _ = grad_y.shape
    dx = _poisoned_or_empty((batch, nin, channels), dtype, grad_y.device, poison).transpose(1, 2)
    grid = (nin, triton.cdiv(batch, tile.block_m), triton.cdiv(channels, tile.block_n))
    depthwise_grad_input_kernel[grid](
        grad_y, weight.t().contiguous(), dx, tables.pair_start, tables.pair_node,
        tables.pair_cell, batch, channels, *_strides(grad_y), *_strides(dx), BB=tile.block_m,
        BC=tile.block_n, num_warps=tile.warps, num_stages=tile.stages)
    return dx


def depthwise_grad_weight(grad_y: torch.Tensor, x: torch.Tensor, tables: DepthwiseTables, *,
                          v: int, tile: TileConfig, splits: int,
                          poison: bool = False) -> torch.Tensor:
    """The depthwise dW [C, V] in float32, deterministic: each split of each cell's steps
    writes its own partial row, and the partials are summed in a fixed order. x [B, C, Nin]
    and grad_y [B, C, Nout] in any storage."""
    batch, channels, _ = x.shape
    partial = _poisoned_or_empty((splits, v, channels), torch.float32, x.device, poison)
    grid = (v * splits, triton.cdiv(channels, tile.block_n))
    depthwise_grad_weight_kernel[grid](
        x, grad_y, partial, tables.cell_start, tables.cell_input, tables.cell_node, batch,
        channels, v, splits, triton.cdiv(batch, tile.block_m), *_strides(x),
        *_strides(grad_y), BB=tile.block_m, BC=tile.block_n, num_warps=tile.warps,
        num_stages=tile.stages)
    return partial.sum(dim=0).t().contiguous()


def batch_innermost(x: torch.Tensor) -> torch.Tensor:
    """x [B, C, N] as the few-channel kernels read it: xt [N, C, B], contiguous."""
    return x.permute(2, 1, 0).contiguous()


def stem_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 tables: StemTables, *, nin: int, nout: int, v: int, tile: TileConfig,
                 poison: bool = False) -> torch.Tensor:
    """The few-channel forward: y [B, Cout, Nout] in x's dtype, the view of a contiguous
    [B, Nout, Cout] buffer; x [B, Cin, Nin] in any storage."""
    batch, cin, _ = x.shape
    cout = weight.shape[0]
    slots = channel_slots(cin)
    if tile.block_k < slots:
        raise ValueError(f"stem_forward: block_k {tile.block_k} holds no neighbour's "
                         f"{slots} channel slots")
    cells = weight_by_cell(weight, cin, v, x.dtype, reverse=False)
    y = _poisoned_or_empty((batch, nout, cout), x.dtype, x.device, poison)
    grid = (nout, triton.cdiv(batch, tile.block_m), triton.cdiv(cout, tile.block_n))
    stem_forward_kernel[grid](
        batch_innermost(x), cells, y, y if bias is None else bias, tables.neighbour,
        tables.cell, batch, nin, nout, cin, cout, tables.neighbour.shape[1],
        HAS_BIAS=bias is not None, SLOTS=slots, BM=tile.block_m, BN=tile.block_n,
        BK=tile.block_k, num_warps=tile.warps, num_stages=tile.stages)
    return y.transpose(1, 2)


def stem_grad_weight(grad_y: torch.Tensor, x: torch.Tensor, tables: StemTables, *, nin: int,
                     v: int, tile: TileConfig, poison: bool = False) -> torch.Tensor:
    """The few-channel dW [Cout, Cin*V] in float32, deterministic: each output node's partial
    over the whole batch is written once, then summed per kernel cell in a fixed order.
    grad_y [B, Cout, Nout] must be :func:`boxable`; x [B, Cin, Nin] in any storage."""
    batch, cin, _ = x.shape
    cout, nout = grad_y.shape[1], grad_y.shape[2]
    k = tables.neighbour.shape[1]
    slots = channel_slots(cin)
    rows = k * slots
    partial = _poisoned_or_empty((nout, rows, cout), torch.float32, x.device, poison)
    grid = (nout, triton.cdiv(rows, tile.block_m), triton.cdiv(cout, tile.block_n))
    stem_grad_weight_kernel[grid](
        batch_innermost(x), rows_box(grad_y, (tile.block_k, tile.block_n)), partial,
        tables.neighbour, tables.cell, batch, nin, cin, cout, k, SLOTS=slots,
        BM=tile.block_m, BN=tile.block_n, BB=tile.block_k, num_warps=tile.warps,
        num_stages=tile.stages)
    grad = _poisoned_or_empty((cout, cin * v), torch.float32, x.device, poison)
    # grad[o, c*V + cell]: a cell's sum is group cell, channel stride V, column stride Cin*V
    stem_entry_sum_kernel[(v, triton.cdiv(cout, tile.block_n))](
        partial, grad, tables.cell_start, tables.cell_slot, cout, cout, cin, slots,
        1, v, cin * v, 0, SLOTS=slots, BE=SUM_ENTRIES, BN=tile.block_n, num_warps=4)
    return grad


def stem_grad_input(grad_y: torch.Tensor, weight: torch.Tensor, tables: StemTables, *,
                    nin: int, v: int, tile: TileConfig, dtype: torch.dtype,
                    poison: bool = False,
                    workspace_bytes: int = STEM_SLOT_GRAD_BYTES) -> torch.Tensor:
    """The few-channel dx [B, Cin, Nin] in ``dtype``, the view of a contiguous [Nin, Cin, B]
    buffer, deterministic; grad_y [B, Cout, Nout] must be :func:`boxable`. Per chunk of the
    batch, each output node's slot gradients are written once (float32, at most
    ``workspace_bytes`` unless one batch tile of them takes more), then summed per input node
    over the pairs that read it."""
    batch, cout, nout = grad_y.shape
    cin = weight.shape[1] // v
    k = tables.neighbour.shape[1]
    rows = k * cin
    cells = weight_by_cell(weight, cin, v, grad_y.dtype, reverse=False)
    dxt = _poisoned_or_empty((nin, cin, batch), dtype, grad_y.device, poison)
    chunk = max(tile.block_n, workspace_bytes // (4 * nout * rows) // tile.block_n
                * tile.block_n)
    chunk = min(chunk, triton.cdiv(batch, tile.block_n) * tile.block_n)
    slot_grads = torch.empty((nout, rows, chunk), dtype=torch.float32, device=grad_y.device)
    descriptor = rows_box(grad_y, (tile.block_n, tile.block_k))
    for start in range(0, batch, chunk):
        size = min(chunk, batch - start)
        stem_slot_grad_kernel[(nout, triton.cdiv(rows, tile.block_m),
                                   triton.cdiv(size, tile.block_n))](
            descriptor, cells, slot_grads, tables.neighbour, tables.cell, start, chunk, nin,
            cin, cout, k, BR=tile.block_m, BB=tile.block_n, BO=tile.block_k,
            num_warps=tile.warps, num_stages=tile.stages)
        # dxt[m, c, start + b]: an input node's sum is group m, channel stride B
        stem_entry_sum_kernel[(nin, triton.cdiv(size, PAIR_SUM_BATCH))](
            slot_grads, dxt, tables.pair_start, tables.pair_slot, chunk, size, cin, cin,
            cin * batch, batch, 1, start, SLOTS=channel_slots(cin), BE=SUM_ENTRIES,
            BN=PAIR_SUM_BATCH, num_warps=4)
    return dxt.permute(2, 1, 0)
