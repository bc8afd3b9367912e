"""Launches of the per-channel neighbourhood kernels (kernels/knn_neighbourhood.cu): KNN
pooling and depthwise KNN convolution, forward and backward.

Every gradient with respect to x is a gather over the reversed graph (atomic-free,
deterministic); the depthwise weight gradient sums per block in shared memory and adds with
fp32 atomics. Tensors are [B, C, N] on one CUDA device, contiguous (pooling also takes
channels-last storage: the transposed view of a contiguous [B, N, C] buffer); tables are
int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import MAX_POOL_MODES, empty_in_storage, in_storage, is_channels_last
from .build import get_kernel, kernel_target, neighbourhood_name
from .launch import data_pointer, launch_kernel
from .launch_plan import MAX_GRID_YZ
from .relayout import ReverseTables, reverse_tables

# The kernels' PoolMode of each pooling mode; the backward of max_relu is max's (its forward
# leaves no tie where ReLU's gradient is 0).
POOL_MODE_CODES = {"max": 0, "avg": 1, "sum": 2, "max_relu": 3}
NATIVE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What pool_forward records a max window's choice in (its ties tensor): a byte per output,
# the slot of the only neighbour holding the max, or a flag plus the count of tied slots
# (choice_code in knn_neighbourhood.cu). Slot and count must fit under the flag: max mode
# serves windows of at most MAX_TIED_NEIGHBOURS neighbours.
TIES_DTYPE = torch.uint8
CHOICE_TIED = 0x80
MAX_TIED_NEIGHBOURS = 0xFF - CHOICE_TIED
# knn_depthwise_grad_weight sums a block's contributions per kernel cell in 48 KiB of shared
# memory (one float per cell).
MAX_NATIVE_CELLS = 48 * 1024 // 4
THREADS = 256
# The batch elements one thread of the depthwise gathers sums (kDepthwiseRows in
# knn_neighbourhood.cu), which sizes their grid; the kernels' grid-stride loop covers every
# row whatever the grid.
DEPTHWISE_ROWS = 4
# The batch elements one thread of the channels-last pooling kernels serves (their kBatch),
# which sizes their grid; scripts/bench_fovi_pools.py measures every one of POOL_BATCHES.
# On fovi's pooling layers (H200, fp16) one was fastest or within 10% of two, and four up to
# 1.5x slower: the kernels are bound by issue more than by memory latency.
POOL_BATCHES = (1, 2, 4)
POOL_BATCH = 1
# knn_depthwise_grad_weight's nodes per block: a warp's worth, so that a warp reads one slot
# of consecutive nodes.
DEPTHWISE_GRAD_WEIGHT_NODES = 32


@dataclass
class NativeTables:
    """A neighbourhood plan's tables as the kernels read them, on one device."""

    knn: torch.Tensor  # int32 [K, Nout]
    cells: torch.Tensor | None  # int32 [K, Nout]: each slot's kernel cell (depthwise)
    reverse: ReverseTables  # pooling: each pair's cell is its slot k, what a max's choice names
    scale: torch.Tensor  # float32 [Nout]: 1 / the number of real neighbours (at least 1)


def native_tables(knn_indices: torch.Tensor, slot_cells: torch.Tensor | None,
                  nin: int) -> NativeTables:
    """The NativeTables of a neighbour table (int64 [K, Nout]) and a depthwise layer's slot
    cells (int64 [K, Nout], or None for a pooling)."""
    cells = slot_cells if slot_cells is not None else torch.arange(
        len(knn_indices), device=knn_indices.device)[:, None].expand_as(knn_indices)
    real = (knn_indices != nin).sum(dim=0).clamp_min(1)
    return NativeTables(
        knn=knn_indices.to(torch.int32).contiguous(),
        cells=None if slot_cells is None else slot_cells.to(torch.int32).contiguous(),
        reverse=reverse_tables(knn_indices, cells.t(), nin),
        scale=(1.0 / real.to(torch.float32)).contiguous())


def _run(name: str, device: torch.device, extent: int, rows: int, args: tuple, *,
         shared: int = 0, grid=None) -> None:
    if rows == 0 or extent == 0:
        return
    grid = grid or (-(-extent // THREADS), min(rows, MAX_GRID_YZ), 1)
    kernel = get_kernel(name, device.index, **kernel_target("neighbourhood"))
    launch_kernel(kernel, device.index, grid, (THREADS, 1, 1), shared, args)


# Each thread of the channels-last pooling kernels moves a run of channels in one load of at
# most 16 bytes: these runs, the longest first, are built for every dtype they fit.
CHANNEL_VECTORS = (8, 4, 2, 1)
MAX_VECTOR_BYTES = 16


def channel_vectors(dtype: torch.dtype) -> tuple[int, ...]:
    """The channel runs (kVector) the channels-last pooling kernels are built for in dtype."""
    return tuple(v for v in CHANNEL_VECTORS if v * dtype.itemsize <= MAX_VECTOR_BYTES)


def _channel_vector(channels: int, dtype: torch.dtype, *tensors: torch.Tensor) -> int:
    """The longest run that divides C and starts every tensor's address on a whole vector of
    its elements: every run then lies within one row of C channels and on a vector boundary.
    1 always does."""
    return next(v for v in channel_vectors(dtype) if channels % v == 0 and all(
        t.data_ptr() % (v * t.element_size()) == 0 for t in tensors))


def _channels_last_indexable(channels: int, nin: int, nout: int) -> bool:
    """Whether the channels-last kernels' thread index, (node, channel run) within one batch
    element, fits their int."""
    return max(nin, nout) * channels < 2**31


def pool_forward(x: torch.Tensor, knn: torch.Tensor, nin: int, mode: str):
    """(y [B, C, Nout] in x's dtype, ties [B, C, Nout] TIES_DTYPE in the MAX_POOL_MODES, else
    None): each max window's choice code (TIES_DTYPE's comment).

    A channels-last x (the [B, C, Nin] view of a contiguous [B, Nin, C] buffer) takes the
    channels-last kernels, whose y and ties take that storage; any other x the row kernels on
    x.contiguous(), whose y and ties are contiguous. ValueError for the max modes past
    MAX_TIED_NEIGHBOURS neighbours.
    """
    batch, channels, _ = x.shape
    k, nout = knn.shape
    if mode in MAX_POOL_MODES and k > MAX_TIED_NEIGHBOURS:
        raise ValueError(f"max pooling records each window's choice of neighbour in a byte: it "
                         f"serves at most K = {MAX_TIED_NEIGHBOURS} neighbours, got K = {k}")
    channels_last = is_channels_last(x) and _channels_last_indexable(channels, nin, nout)
    if not channels_last:
        x = x.contiguous()
    y = empty_in_storage((batch, channels, nout), channels_last, x.dtype, x.device)
    ties = (empty_in_storage((batch, channels, nout), channels_last, TIES_DTYPE, x.device)
            if mode in MAX_POOL_MODES else None)
    mode_code = POOL_MODE_CODES[mode]
    if channels_last:
        vector = _channel_vector(channels, x.dtype, *(t for t in (x, y, ties) if t is not None))
        name = neighbourhood_name("knn_pool_forward_channels_last", x.dtype, mode=mode_code,
                                  vector=vector, batch=POOL_BATCH)
        _run(name, x.device, nout * (channels // vector), -(-batch // POOL_BATCH),
             (x.data_ptr(), knn.data_ptr(), y.data_ptr(), data_pointer(ties), batch, channels,
              nin, nout, k))
    else:
        _run(neighbourhood_name("knn_pool_forward", x.dtype, mode=mode_code), x.device, nout,
             batch * channels,
             (x.data_ptr(), knn.data_ptr(), y.data_ptr(), data_pointer(ties), batch * channels,
              nin, nout, k))
    return y, ties


def pool_backward(grad_y: torch.Tensor, x: torch.Tensor | None, y: torch.Tensor | None,
                  ties: torch.Tensor | None, scale: torch.Tensor, reverse: ReverseTables,
                  mode: str, nin: int, *, channels_last: bool | None = None) -> torch.Tensor:
    """dx [B, C, Nin] in grad_y's dtype (the dtype of x). x, y and ties: the MAX_POOL_MODES
    only, y and ties as pool_forward returned them (x and y are read only where a window's
    maxima tie). scale: float32 [Nout], 1/(real neighbours), read in avg mode. reverse: the
    reversed graph of native_tables (each pair's slot).

    The kernels run in y's storage in the max modes (the one pool_forward chose), else in the one
    ``channels_last`` asks for, by default grad_y's (no x is saved there). Operands in the
    other storage (grad_y, or a saved x) are copied once into the kernels' storage: read
    through their strides, the threads of one node, channels fastest, would not coalesce. dx
    comes in the kernels' storage, or in the one ``channels_last`` asks for (channels-last when
    True, contiguous when False).
    """
    batch, channels, nout = grad_y.shape
    if mode in MAX_POOL_MODES:
        kernels_channels_last = is_channels_last(y)
    else:
        requested = is_channels_last(grad_y) if channels_last is None else channels_last
        kernels_channels_last = requested and _channels_last_indexable(channels, nin, nout)
    grad_y, x, y, ties = (None if t is None else in_storage(t, kernels_channels_last)
                          for t in (grad_y, x, y, ties))
    dx = empty_in_storage((batch, channels, nin), kernels_channels_last, grad_y.dtype,
                          grad_y.device)
    mode_code = POOL_MODE_CODES["max" if mode in MAX_POOL_MODES else mode]
    if kernels_channels_last:
        vector = _channel_vector(channels, grad_y.dtype,
                                 *(t for t in (grad_y, x, y, ties, dx) if t is not None))
        name = neighbourhood_name("knn_pool_backward_channels_last", grad_y.dtype,
                                  mode=mode_code, vector=vector, batch=POOL_BATCH)
        _run(name, grad_y.device, nin * (channels // vector), -(-batch // POOL_BATCH),
             (grad_y.data_ptr(), data_pointer(x), data_pointer(y), data_pointer(ties),
              scale.data_ptr(), reverse.pair_start.data_ptr(), reverse.pair_node.data_ptr(),
              reverse.pair_cell.data_ptr(), dx.data_ptr(), batch, channels, nin, nout))
    else:
        _run(neighbourhood_name("knn_pool_backward", grad_y.dtype, mode=mode_code),
             grad_y.device, nin, batch * channels,
             (grad_y.data_ptr(), data_pointer(x), data_pointer(y), data_pointer(ties),
              scale.data_ptr(), reverse.pair_start.data_ptr(), reverse.pair_node.data_ptr(),
              reverse.pair_cell.data_ptr(), dx.data_ptr(), batch * channels, nin, nout))
    return dx if channels_last is None else in_storage(dx, channels_last)


def depthwise_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      knn: torch.Tensor, cells: torch.Tensor, nin: int) -> torch.Tensor:
    """y [B, C, Nout] in x's dtype; weight [C, V] and bias [C] in x's dtype."""
    batch, channels, _ = x.shape
    k, nout = knn.shape
    y = torch.empty(batch, channels, nout, dtype=x.dtype, device=x.device)
    _run(neighbourhood_name("knn_depthwise_forward", x.dtype), x.device, nout,
         _depthwise_row_groups(batch, channels),
         (x.data_ptr(), weight.data_ptr(), data_pointer(bias), knn.data_ptr(), cells.data_ptr(),
          y.data_ptr(), batch, channels, nin, nout, k, weight.shape[1]))
    return y


def _depthwise_row_groups(batch: int, channels: int) -> int:
    """The depthwise gathers' row groups: DEPTHWISE_ROWS batch elements of one channel each."""
    return channels * -(-batch // DEPTHWISE_ROWS)


def depthwise_grad_input(grad_y: torch.Tensor, weight: torch.Tensor, reverse: ReverseTables,
                         nin: int, grad_dtype: torch.dtype) -> torch.Tensor:
    batch, channels, nout = grad_y.shape
    dx = torch.empty(batch, channels, nin, dtype=grad_dtype, device=grad_y.device)
    _run(neighbourhood_name("knn_depthwise_grad_input", grad_y.dtype, grad_dtype),
         grad_y.device, nin, _depthwise_row_groups(batch, channels),
         (grad_y.data_ptr(), weight.data_ptr(), reverse.pair_start.data_ptr(),
          reverse.pair_node.data_ptr(), reverse.pair_cell.data_ptr(), dx.data_ptr(),
          batch, channels, nin, nout, weight.shape[1]))
    return dx


def depthwise_grad_weight(x: torch.Tensor, grad_y: torch.Tensor, knn: torch.Tensor,
                          cells: torch.Tensor, v: int) -> torch.Tensor:
    """dW [C, V] float32."""
    batch, channels, nin = x.shape
    k, nout = knn.shape
    dw = torch.zeros(channels, v, dtype=torch.float32, device=x.device)
    nodes_per_block = DEPTHWISE_GRAD_WEIGHT_NODES  # a thread per (node, slot), a loop over them
    grid = (-(-nout // nodes_per_block), channels, 1)
    _run(neighbourhood_name("knn_depthwise_grad_weight", x.dtype), x.device, nout,
         batch * channels,
         (x.data_ptr(), grad_y.data_ptr(), knn.data_ptr(), cells.data_ptr(), dw.data_ptr(),
          batch, channels, nin, nout, k, v, nodes_per_block),
         shared=4 * v, grid=grid)
    return dw
