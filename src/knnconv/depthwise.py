"""Depthwise and depthwise-separable KNN convolution, in plain torch ops.

Depthwise: every channel has its own kernel over the V reference-grid cells,

    y[b, c, n] = bias[c] + sum_k x[b, c, knn[k, n]] * W[c, rf[n, k]]      (W: [C, V])

Depthwise-separable: that, then a pointwise (1x1) mixing of channels with a [Cout, Cin] weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .geometry import knn_geometry
from .neighbours import check_features, gather_neighbours
from .plan import _as_index_tensor, _check_positive, _check_tables


class KNNDepthwiseConv(nn.Module):
    """Per-channel KNN convolution; x [B, C, Nin] -> [B, C, Nout], weight [C, V].

    Padding neighbours (``knn[k, n] == nin``) contribute exactly 0: they read an appended zero
    input column and an appended zero weight column, so neither a NaN in x nor a non-finite
    weight can leak into a padding slot.
    """

    knn_indices: torch.Tensor
    slot_cells: torch.Tensor

    def __init__(self, channels: int, knn_indices, rf_index, *, nin: int, v: int,
                 bias: bool = True) -> None:
        super().__init__()
        self.channels = _check_positive("channels", channels)
        self.nin = _check_positive("nin", nin)
        self.v = _check_positive("v", v)
        knn_indices = _as_index_tensor("knn_indices", knn_indices).cpu().to(torch.int64)
        rf_index = _as_index_tensor("rf_index", rf_index).cpu().to(torch.int64)
        _check_tables(knn_indices, rf_index, self.nin, self.v)
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
                    ref_side: int | None = None, bias: bool = True) -> KNNDepthwiseConv:
        """Build the layer from 2-D input and output coordinates (see knnconv.geometry)."""
        knn_indices, rf_index, v = knn_geometry(in_coords, out_coords, k, ref_side=ref_side)
        return cls(channels, knn_indices, rf_index, nin=len(in_coords), v=v, bias=bias)

    def reset_parameters(self) -> None:
        # Kaiming-normal over the real fan-in: each output reads K inputs of its channel, not V.
        nn.init.normal_(self.weight, 0.0, math.sqrt(2.0 / self.knn_indices.shape[0]))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_features(x, self.nin, self.channels)
        neighbours = gather_neighbours(x, self.knn_indices, fill=0.0)  # [B, C, K, Nout]
        slot_weights = F.pad(self.weight, (0, 1))[:, self.slot_cells]  # [C, K, Nout]
        y = (neighbours * slot_weights).sum(dim=2)
        return y if self.bias is None else y + self.bias[:, None]

    def extra_repr(self) -> str:
        k, nout = self.knn_indices.shape
        return (f"{self.channels}, nin={self.nin}, nout={nout}, k={k}, v={self.v}, "
                f"bias={self.bias is not None}")


class KNNDepthwiseSeparableConv(nn.Module):
    """Depthwise KNN convolution then a pointwise channel mixing; [B, Cin, Nin] -> [B, Cout, Nout].

    ``depthwise.weight`` is [Cin, V] and ``pointwise.weight`` [Cout, Cin]. Only the pointwise
    step has a bias: a depthwise bias would pass through the linear pointwise step and add
    nothing that the pointwise bias cannot.
    """

    def __init__(self, in_channels: int, out_channels: int, knn_indices, rf_index, *, nin: int,
                 v: int, bias: bool = True) -> None:
        super().__init__()
        self.depthwise = KNNDepthwiseConv(in_channels, knn_indices, rf_index, nin=nin, v=v,
                                          bias=False)
        self.pointwise = nn.Linear(in_channels, _check_positive("out_channels", out_channels),
                                   bias=bias)

    @classmethod
    def from_coords(cls, in_channels: int, out_channels: int, in_coords, out_coords, k: int, *,
                    ref_side: int | None = None, bias: bool = True) -> KNNDepthwiseSeparableConv:
        """Build the layer from 2-D input and output coordinates (see knnconv.geometry)."""
        knn_indices, rf_index, v = knn_geometry(in_coords, out_coords, k, ref_side=ref_side)
        return cls(in_channels, out_channels, knn_indices, rf_index, nin=len(in_coords), v=v,
                   bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # nn.Linear mixes the last dimension, so channels go last and come back.
        return self.pointwise(self.depthwise(x).transpose(1, 2)).transpose(1, 2)
