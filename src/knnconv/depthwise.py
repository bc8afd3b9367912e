"""Depthwise and depthwise-separable KNN convolution, in torch ops or native CUDA kernels.

Depthwise: every channel has its own kernel over the V reference-grid cells,

    y[b, c, n] = bias[c] + sum_k x[b, c, knn[k, n]] * W[c, rf[n, k]]      (W: [C, V])

Depthwise-separable: that, then a pointwise (1x1) mixing of channels with a [Cout, Cin] weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import as_index_tensor, check_positive, check_tables
from .geometry import knn_geometry
from .neighbours import (
    NativeTableCache,
    check_backend,
    check_features,
    gather_neighbours,
    resolve_neighbourhood_backend,
)
from .ops.cuda import neighbourhood
from .ops.registry import accumulation_dtype


class KNNDepthwiseConv(nn.Module):
    """Per-channel KNN convolution; x [B, C, Nin] -> [B, C, Nout], weight [C, V].

    Padding neighbours (``knn[k, n] == nin``) contribute exactly 0: they read an appended zero
    input column and an appended zero weight column, so neither a NaN in x nor a non-finite
    weight can leak into a padding slot.
    """

    knn_indices: torch.Tensor
    slot_cells: torch.Tensor

    def __init__(self, channels: int, knn_indices, rf_index, *, nin: int, v: int,
                 bias: bool = True, backend: str = "auto") -> None:
        super().__init__()
        self.channels = check_positive("channels", channels)
        self.backend = check_backend(backend)
        self.last_backend: str | None = None  # which backend ran the last forward
        self._native_tables = NativeTableCache()
        self.nin = check_positive("nin", nin)
        self.v = check_positive("v", v)
        knn_indices = as_index_tensor("knn_indices", knn_indices).cpu().to(torch.int64)
        rf_index = as_index_tensor("rf_index", rf_index).cpu().to(torch.int64)
        check_tables(knn_indices, rf_index, self.nin, self.v)
        # The kernel cell each slot reads, [K, Nout] like knn_indices; padding slots read the
        # zero column V that forward appends to the weight.
        slot_cells = torch.where(knn_indices == self.nin, self.v, rf_index.t())
        # Non-persistent: the geometry follows .to(device) but stays out of the state_dict.
        self.register_buffer("knn_indices", knn_indices, persistent=False)
        self.register_buffer("slot_cells", slot_cells.contiguous(), persistent=False)
        self.weight = nn.Parameter(torch.empty(self.channels, self.v))
        self.bias = nn.Parameter(torch.empty(self.channels)) if bias else None
        self.reset_parameters()

    @classmethod
    def from_coords(cls, channels: int, in_coords, out_coords, k: int, *,
                    ref_side: int | None = None, bias: bool = True,
                    backend: str = "auto") -> KNNDepthwiseConv:
        """Build the layer from 2-D input and output coordinates (see knnconv.geometry)."""
        knn_indices, rf_index, v = knn_geometry(in_coords, out_coords, k, ref_side=ref_side)
        return cls(channels, knn_indices, rf_index, nin=len(in_coords), v=v, bias=bias,
                   backend=backend)

    def reset_parameters(self) -> None:
        # Kaiming-normal over the real fan-in: each output reads K inputs of its channel, not V.
        nn.init.normal_(self.weight, 0.0, math.sqrt(2.0 / self.knn_indices.shape[0]))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_features(x, self.nin, self.channels)
        dtype = promoted_dtype(x, self.weight, self.bias)
        # only the weight gradient accumulates with atomics (dx is a gather, dbias a torch sum)
        atomics = torch.is_grad_enabled() and self.weight.requires_grad
        self.last_backend = resolve_neighbourhood_backend(self.backend, x, atomics=atomics,
                                                          cells=self.v, dtype=dtype)
        if self.last_backend == "cuda":
            tables = self._native_tables.get(self.knn_indices, self.nin, self.slot_cells)
            return _NativeDepthwise.apply(x, self.weight, self.bias, tables, self.nin, dtype)
        # In half precision every product and sum, forward and backward, would round and
        # flush tiny gradients to zero; float32 holds them, and the result is rounded once.
        wide = accumulation_dtype(dtype)
        neighbours = gather_neighbours(x.to(wide), self.knn_indices, fill=0.0)  # [B, C, K, N]
        slot_weights = F.pad(self.weight.to(wide), (0, 1))[:, self.slot_cells]  # [C, K, Nout]
        y = (neighbours * slot_weights).sum(dim=2)
        if self.bias is not None:
            y = y + self.bias.to(wide)[:, None]
        return y.to(dtype)

    def extra_repr(self) -> str:
        k, nout = self.knn_indices.shape
        return (f"{self.channels}, nin={self.nin}, nout={nout}, k={k}, v={self.v}, "
                f"bias={self.bias is not None}, backend={self.backend!r}")


def promoted_dtype(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.dtype:
    """The dtype torch's own ops compute the depthwise convolution in."""
    dtype = torch.result_type(x, weight)
    return dtype if bias is None else torch.promote_types(dtype, bias.dtype)


class _NativeDepthwise(torch.autograd.Function):
    """The depthwise convolution on the native kernels, in ``dtype``, the one torch's own ops
    would promote x, weight and bias to; dx is a gather over the reversed graph, dW sums per
    block and adds with fp32 atomics, the bias gradient is a torch sum."""

    @staticmethod
    def forward(ctx, x, weight, bias, tables, nin: int, dtype: torch.dtype):
        xc, wc = x.to(dtype).contiguous(), weight.to(dtype).contiguous()
        bc = None if bias is None else bias.to(dtype).contiguous()
        y = neighbourhood.depthwise_forward(xc, wc, bc, tables.knn, tables.cells, nin)
        need_x, need_w = ctx.needs_input_grad[:2]
        # dx reads only the weight and dW only x: keep what a needed gradient reads.
        ctx.save_for_backward(xc if need_w else None, wc if need_x else None)
        ctx.tables, ctx.nin, ctx.cells, ctx.compute_dtype = tables, nin, weight.shape[1], dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xc, wc = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad_y = grad_y.to(ctx.compute_dtype).contiguous()
        tables = ctx.tables
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = neighbourhood.depthwise_grad_input(grad_y, wc, tables.reverse, ctx.nin,
                                                        x_dtype)
        if need_w:
            grad_w = neighbourhood.depthwise_grad_weight(xc, grad_y, tables.knn, tables.cells,
                                                         ctx.cells).to(w_dtype)
        if need_b:
            grad_b = grad_y.sum(dim=(0, 2), dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


class KNNDepthwiseSeparableConv(nn.Module):
    """Depthwise KNN convolution then a pointwise channel mixing; [B, Cin, Nin] -> [B, Cout, Nout].

    ``depthwise.weight`` is [Cin, V] and ``pointwise.weight`` [Cout, Cin]. Only the pointwise
    step has a bias: a depthwise bias would pass through the linear pointwise step and add
    nothing that the pointwise bias cannot.
    """

    def __init__(self, in_channels: int, out_channels: int, knn_indices, rf_index, *, nin: int,
                 v: int, bias: bool = True, backend: str = "auto") -> None:
        super().__init__()
        self.depthwise = KNNDepthwiseConv(in_channels, knn_indices, rf_index, nin=nin, v=v,
                                          bias=False, backend=backend)
        self.pointwise = nn.Linear(in_channels, check_positive("out_channels", out_channels),
                                   bias=bias)

    @classmethod
    def from_coords(cls, in_channels: int, out_channels: int, in_coords, out_coords, k: int, *,
                    ref_side: int | None = None, bias: bool = True,
                    backend: str = "auto") -> KNNDepthwiseSeparableConv:
        """Build the layer from 2-D input and output coordinates (see knnconv.geometry)."""
        knn_indices, rf_index, v = knn_geometry(in_coords, out_coords, k, ref_side=ref_side)
        return cls(in_channels, out_channels, knn_indices, rf_index, nin=len(in_coords), v=v,
                   bias=bias, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # nn.Linear mixes the last dimension, so channels go last and come back.
        return self.pointwise(self.depthwise(x).transpose(1, 2)).transpose(1, 2)
