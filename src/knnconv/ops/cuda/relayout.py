"""Operand re-layouts: x, grad_y and the weight laid out as the re-laying-out kernels read
them, dx restored from its staging, and the reversed graph.

Every re-layout is one :class:`~.launch.Transpose` launch (transpose, dtype conversion and zero
padding fused: transpose_pad, or transpose_pairs where strides allow two-element accesses); a
channels-last x's re-layout also takes a memset of xt's zero row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .build import SCALAR_TYPES
from .launch import Transpose, memset_zero
from .launch_plan import MAX_GRID_YZ, round_up


class WeightLayout:
    """The weight W [Cout, Q] re-laid out by one :class:`~.launch.Transpose` shape into the
    compute dtype, cast in the same kernel from the dtype it comes in (float32 parameters
    under autocast): no torch cast before it, and no cast copy for the backward to keep. A
    Transpose per source dtype, the compute dtype's built (and its extents checked) at once,
    any other on its first call; a float64 weight, which no kernel reads, is cast by torch
    first. ``source_strides`` maps W's (row, column) strides to the Transpose's source
    strides."""

    def __init__(self, dtype: torch.dtype, device_index: int, src_extents, dst_extents,
                 dst_strides, source_strides: Callable[[int, int], tuple[int, int, int]]):
        self.dtype, self.source_strides = dtype, source_strides
        self._shape = (device_index, src_extents, dst_extents, dst_strides)
        self._by_source = {dtype: Transpose(dtype, dtype, *self._shape)}

    def __call__(self, weight: torch.Tensor, dst: int) -> None:
        """Lays ``weight`` out at device address ``dst``."""
        if weight.dtype not in SCALAR_TYPES:
            weight = weight.to(self.dtype)
        transpose = self._by_source.get(weight.dtype)
        if transpose is None:
            transpose = self._by_source[weight.dtype] = Transpose(weight.dtype, self.dtype,
                                                                  *self._shape)
        transpose(weight, dst, self.source_strides(*weight.stride()))


def weight_transposed(cout: int, q: int, cpad: int, dtype, device_index: int) -> WeightLayout:
    """W [Cout, Q] -> wt [Q, cpad]: output channels contiguous, zero columns past Cout."""
    return WeightLayout(dtype, device_index, (1, cout, q), (1, cpad, q), (0, cpad),
                        lambda row, column: (0, row, column))


def weight_by_cell(cout: int, cin: int, v: int, gpad: int, cinpad: int, dtype,
                   device_index: int) -> WeightLayout:
    """W [Cout, Cin*V] -> wr [V, gpad, cinpad], wr[v, o, c] = W[o, c*V + v], zero past Cout
    and Cin."""
    return WeightLayout(dtype, device_index, (cout, cin, v), (gpad, cinpad, v),
                        (cinpad, gpad * cinpad), lambda row, column: (row, v * column, column))


def weight_by_cell_transposed(cout: int, cin: int, v: int, cpad: int, dtype,
                              device_index: int) -> WeightLayout:
    """W [Cout, Cin*V] -> wc [V, Cin, cpad], wc[v, c, o] = W[o, c*V + v], zero past Cout.

    A CTA layer per input channel c reads the V adjacent columns of c in every row: each
    source element once, in runs along the rows. (A layer per cell reads elements V apart,
    every sector of the weight once per cell: V times the weight, which a float32 weight of
    the large layers, 38 MB at Cin = Cout = 512 and V = 36, no longer serves from the L2
    cache.) With one cell, W itself is transposed."""
    if v == 1:
        return weight_transposed(cout, cin, cpad, dtype, device_index)
    return WeightLayout(dtype, device_index, (cin, cout, v), (cin, cpad, v), (cpad, cin * cpad),
                        lambda row, column: (v * column, row, column))


def grad_y_transposed(batch: int, cout: int, nout: int, bpad: int, gpad: int, dtype,
                      device_index: int, *, sums_bias: bool) -> Transpose:
    """grad_y [B, Cout, Nout] -> gt [Nout, gpad, bpad], read channel by channel; with
    ``sums_bias`` a call also sums each channel into the bias gradient (its z_sums)."""
    return Transpose(dtype, dtype, device_index, (cout, batch, nout), (gpad, bpad, nout),
                     (bpad, gpad * bpad), sums_z=sums_bias)


def grad_y_by_node(batch: int, cout: int, nout: int, bpad: int, gpad: int, dtype,
                   device_index: int) -> Transpose | None:
    """grad_y in channels-last storage (as y is returned) -> gt, node by node, read along its
    channels (None where the grid has too few CTA layers for the nodes, or Cout is 1).

    Transposing it channel by channel, as :func:`grad_y_transposed` does, reads elements Cout
    apart (conv1's grad_y at B = 2048 took ~3 ms). Its bias gradient is then a sum of its own,
    since the per-node transpose sums per node.
    """
    if nout <= MAX_GRID_YZ and cout > 1:
        return Transpose(dtype, dtype, device_index, (nout, batch, cout), (nout, bpad, gpad),
                         (gpad * bpad, bpad))
    return None


def dx_restore_geometry(gathered: bool, channels_last: bool, batch: int, cin: int, nin: int,
                        bpad: int):
    """(extents, dst strides, staging strides) of the transpose (see :class:`Transpose`) that
    restores dx [B, Cin, Nin], contiguous or in channels-last storage, from its staging:
    [B, Nin, Cin] where gathered, [Cin*Nin, bpad] (batch fastest) where scattered."""
    rows = cin * nin
    if gathered and channels_last:  # the staging is laid out as dx: one flat row per batch row
        return (batch, rows, 1), (rows, 0), (rows, 1, 0)
    if gathered:
        return (batch, nin, cin), (rows, nin), (rows, cin, 1)
    if not channels_last:
        return (1, rows, batch), (0, rows), (0, bpad, 1)
    if nin <= MAX_GRID_YZ:  # a CTA layer per node: read along the batch, written along channels
        return (nin, cin, batch), (cin, rows), (bpad, nin * bpad, 1)
    # more nodes than the grid has layers: a layer per batch row, read along nodes
    return (batch, cin, nin), (rows, cin), (1, nin * bpad, bpad)


@dataclass
class TransposedInput:
    """x re-laid out for the kernels: xt [Cin*Nin + 1, bpad], batch contiguous, a zero last row.

    The forward returns it so the backward reuses it instead of re-laying out x again.
    """

    xt: torch.Tensor
    batch: int
    cin: int
    nin: int

    @property
    def bpad(self) -> int:
        return self.xt.shape[1]

    def original(self) -> torch.Tensor:
        """x [B, Cin, Nin] as a (strided) view of xt."""
        return self.xt[:-1, : self.batch].t().reshape(self.batch, self.cin, self.nin)


class InputLayout:
    """x [B, Cin, Nin] -> TransposedInput with a given padded batch and dtype.

    x whose channel and node axes are contiguous takes one transpose of its [B, Cin*Nin]
    rows. x with channels fastest (channels-last storage, as a KNN convolution returns y)
    takes one transpose per input node, read along its channels, and a memset of the zero
    row, where x's storage can differ from contiguous storage (Cin > 1, Nin > 1) and the
    grid holds a CTA layer per node; any other x is made contiguous first.

    ``spare_bytes``: extra room allocated behind xt (256-byte aligned) for a caller's
    temporary, so the call allocates once; its address is ``spare_address(xt)``.
    """

    def __init__(self, batch: int, cin: int, nin: int, bpad: int, src_dtype, dtype,
                 device_index: int, spare_bytes: int = 0) -> None:
        rows = cin * nin
        self.shape, self.dtype = (rows + 1, bpad), dtype
        self.batch, self.cin, self.nin = batch, cin, nin
        self.device_index = device_index
        item = dtype.itemsize
        self.spare_offset = round_up((rows + 1) * bpad * item, 256)
        self.storage_rows = (-(-(self.spare_offset + spare_bytes) // (bpad * item))
                             if spare_bytes else 0)
        self.transpose = Transpose(src_dtype, dtype, device_index, (1, batch, rows),
                                   (1, bpad, rows + 1), (0, bpad))
        # xt[c*Nin + m, b] = x[b, c, m] as dst[m, c, b] = src[m, b, c]: rows c*Nin + m only,
        # so the zero row is written apart
        self.by_node = (Transpose(src_dtype, dtype, device_index, (nin, batch, cin),
                                  (nin, bpad, cin), (bpad, nin * bpad))
                        if cin > 1 and 1 < nin <= MAX_GRID_YZ else None)
        self.zero_row_offset, self.zero_row_bytes = rows * bpad * item, bpad * item

    def write(self, x, address: int) -> None:
        """Re-lay out x (a tensor or another TransposedInput) into ``address``."""
        if isinstance(x, TransposedInput):
            x = x.original()
        batch_stride, channel_stride, node_stride = x.stride()
        if channel_stride == 1 and self.by_node is not None:
            self.by_node(x, address, (node_stride, batch_stride, channel_stride))
            memset_zero(address + self.zero_row_offset, self.zero_row_bytes, self.device_index)
            return
        if node_stride != 1 or channel_stride != x.shape[2]:
            x = x.contiguous()
        self.transpose(x, address, (0, x.stride(0), 1))

    def __call__(self, x) -> TransposedInput:
        if isinstance(x, TransposedInput) and x.xt.shape == self.shape and (
                x.xt.dtype == self.dtype):
            return x
        if self.storage_rows:
            xt = torch.empty((self.storage_rows, self.shape[1]), dtype=self.dtype,
                             device=x.device)[: self.shape[0]]
        else:
            xt = torch.empty(self.shape, dtype=self.dtype, device=x.device)
        self.write(x, xt.data_ptr())
        return TransposedInput(xt, self.batch, self.cin, self.nin)

    def spare_address(self, xt: torch.Tensor) -> int:
        return xt.data_ptr() + self.spare_offset


def transposed_input(x: torch.Tensor, bpad: int, dtype: torch.dtype) -> TransposedInput:
    batch, cin, nin = x.shape
    return InputLayout(batch, cin, nin, bpad, x.dtype, dtype, x.device.index)(x)


@dataclass
class ReverseTables:
    """The reversed graph: input node m is read by the (output node, cell) pairs
    pair_start[m] <= j < pair_start[m + 1]; padding neighbours are left out."""

    pair_start: torch.Tensor  # int32 [Nin + 1]
    pair_node: torch.Tensor  # int32 [pairs]
    pair_cell: torch.Tensor  # int32 [pairs]


def reverse_tables(knn_indices: torch.Tensor, rf_index: torch.Tensor, nin: int) -> ReverseTables:
    k, nout = knn_indices.shape
    neighbour = knn_indices.t().reshape(-1).long()  # pair order (n, k)
    real = neighbour != nin
    neighbour = neighbour[real]
    node = torch.arange(nout, device=knn_indices.device).repeat_interleave(k)[real]
    cell = rf_index.reshape(-1).long()[real]
    order = torch.sort(neighbour, stable=True).indices
    counts = torch.bincount(neighbour, minlength=nin)
    start = torch.zeros(nin + 1, dtype=torch.int64, device=knn_indices.device)
    start[1:] = torch.cumsum(counts, 0)
    return ReverseTables(start.int(), node[order].int().contiguous(),
                         cell[order].int().contiguous())
