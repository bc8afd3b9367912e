"""Depthwise and depthwise-separable KNN convolution, in torch ops or native CUDA kernels.

Depthwise: every channel has its own kernel over the V reference-grid cells,

    y[b, c, n] = bias[c] + sum_k x[b, c, knn[k, n]] * W[c, rf[n, k]]      (W: [C, V])

Depthwise-separable: that, then a pointwise (1x1) mixing of channels with a [Cout, Cin] weight.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._checks import check_positive
from .functional import knn_depthwise_conv_with_backend
from .geometry import knn_geometry
from .ops.registry import check_backend
from .plan import NeighbourhoodPlan


class KNNDepthwiseConv(nn.Module):
    """Per-channel KNN convolution; x [B, C, Nin] -> [B, C, Nout] (contiguous), weight [C, V].

    Padding neighbours (``knn[k, n] == nin``) contribute exactly 0: they read a zero input and
    a zero weight cell, so neither a NaN in x nor a non-finite weight can leak into a padding
    slot. The compute dtype follows KNNConv's rule (autocast's where active). The tables live
    in the layer's plan, out of the state_dict; ``last_backend`` names the backend that
    computed the last forward.
    """

    def __init__(self, channels: int, knn_indices, rf_index, *, nin: int, v: int,
                 bias: bool = True, backend: str = "auto") -> None:
        super().__init__()
        self.channels = check_positive("channels", channels)
        self.plan = NeighbourhoodPlan(knn_indices, nin=nin, rf_index=rf_index, v=v)
        self.nin, self.v = self.plan.nin, self.plan.v
        self.backend = check_backend(backend)
        self.last_backend: str | None = None
        self.weight = nn.Parameter(torch.empty(self.channels, self.v))
        self.bias = nn.Parameter(torch.empty(self.channels)) if bias else None
        self.reset_parameters()

    @property
    def knn_indices(self) -> torch.Tensor:
        """The neighbour table, int64 [K, Nout] (host copy)."""
        return self.plan.knn_indices

    @property
    def slot_cells(self) -> torch.Tensor:
        """The kernel cell each slot reads, int64 [K, Nout]; V for a padding slot."""
        return self.plan.slot_cells

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
        nn.init.normal_(self.weight, 0.0, math.sqrt(2.0 / self.plan.k))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.last_backend = knn_depthwise_conv_with_backend(x, self.weight, self.bias,
                                                               self.plan, self.backend)
        return y

    def extra_repr(self) -> str:
        return (f"{self.channels}, nin={self.nin}, nout={self.plan.nout}, k={self.plan.k}, "
                f"v={self.v}, bias={self.bias is not None}, backend={self.backend!r}, "
                f"last_backend={self.last_backend!r}")


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
