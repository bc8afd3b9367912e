"""KNNConv: the nn.Module face of the KNN convolution."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .functional import knn_conv_with_backend
from .geometry import knn_geometry
from .ops.registry import check_backend
from .plan import make_plan


class KNNConv(nn.Module):
    """KNN convolution on an irregular layout, with fovi's parameter layout.

    ``weight`` is [Cout, Cin*V] (column c*V + v holds channel c's kernel cell v), so fovi
    KNNConvLayer state_dicts load unchanged. After each forward, ``last_backend`` names the
    backend that computed it.
    """

    def __init__(self, in_channels: int, out_channels: int, knn_indices, rf_index, *, nin: int,
                 v: int, bias: bool = True, backend: str = "auto") -> None:
        super().__init__()
        self.plan = make_plan(knn_indices, rf_index, nin=nin, v=v, cin=in_channels,
                              cout=out_channels)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.backend = check_backend(backend)
        self.last_backend: str | None = None
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels * v))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    @classmethod
    def from_coords(cls, in_channels: int, out_channels: int, in_coords, out_coords, k: int, *,
                    ref_side: int | None = None, bias: bool = True,
                    backend: str = "auto") -> KNNConv:
        """Build the layer from 2-D input and output coordinates (see knnconv.geometry)."""
        knn_indices, rf_index, v = knn_geometry(in_coords, out_coords, k, ref_side=ref_side)
        return cls(in_channels, out_channels, knn_indices, rf_index, nin=len(in_coords), v=v,
                   bias=bias, backend=backend)

    def reset_parameters(self) -> None:
        # Kaiming-normal over the real fan-in: each output reads Cin*K inputs, not Cin*V.
        fan_in = self.in_channels * self.plan.k
        nn.init.normal_(self.weight, 0.0, math.sqrt(2.0 / fan_in))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def ref_side(self) -> int:
        side = math.isqrt(self.plan.v)
        if side * side != self.plan.v:
            raise ValueError(f"V = {self.plan.v} is not a square reference grid")
        return side

    @torch.no_grad()
    def load_conv2d_weights(self, conv2d: nn.Conv2d) -> KNNConv:
        """Copy a Conv2d's kernel, resampled onto the side×side reference grid.

        Grid row i / column j covers the same fraction of the kernel's extent as the conv's
        rows and columns (cell-centre aligned); row index follows y, column follows x. The
        conv's stride and padding do not carry over (the KNN layout decides where outputs
        are); grouped or dilated convs are refused.
        """
        if conv2d.groups != 1 or tuple(conv2d.dilation) != (1, 1):
            raise ValueError(f"load_conv2d_weights takes a dense, undilated Conv2d; got groups="
                             f"{conv2d.groups}, dilation={tuple(conv2d.dilation)}")
        w = conv2d.weight
        if w.shape[0] != self.out_channels or w.shape[1] != self.in_channels:
            raise ValueError(
                f"conv2d has weight {tuple(w.shape)}; expected [{self.out_channels}, "
                f"{self.in_channels}, kh, kw] (groups=1)"
            )
        side = self.ref_side
        grid = F.interpolate(w.detach().double(), size=(side, side), mode="bilinear",
                             align_corners=False)
        self.weight.copy_(grid.reshape(self.out_channels, -1))
        if self.bias is not None:
            if conv2d.bias is None:
                self.bias.zero_()
            else:
                self.bias.copy_(conv2d.bias)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.last_backend = knn_conv_with_backend(x, self.weight, self.bias, self.plan,
                                                     self.backend)
        return y

    def extra_repr(self) -> str:
        p = self.plan
        return (f"{self.in_channels}, {self.out_channels}, nin={p.nin}, nout={p.nout}, k={p.k}, "
                f"v={p.v}, bias={self.bias is not None}, backend={self.backend!r}, "
                f"last_backend={self.last_backend!r}")
