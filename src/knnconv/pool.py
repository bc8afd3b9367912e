"""KNN pooling: every output node reduces its K nearest inputs, channel by channel.

y[b, c, n] = reduce over the real neighbours k of n of x[b, c, knn[k, n]], where ``knn[k, n]
== Nin`` marks a padding neighbour that takes no part: ``max`` is the largest real value,
``avg`` the sum over the real neighbours divided by their count, ``sum`` their sum, and
``max_relu`` the max of ReLU(x), which is ReLU of the max: a ReLU followed by a max pooling in
one pass, without the ReLU's own read and write of x (and of its gradient). A node whose
neighbours are all padding gives 0 in every mode. Gradients flow like ``torch.amax`` (shared
equally between tied maxima) in the max modes; in ``max_relu`` an output of at most 0 sends
none, as ReLU's gradient there is 0.

The output keeps the input's storage: pooling a convolution's channels-last output gives a
channels-last result, which the next convolution reads without a copy.
"""

from __future__ import annotations

import torch
from torch import nn

from ._checks import check_positive
from .functional import POOL_MODES, check_mode, knn_pool_with_backend
from .geometry import knn_geometry
from .ops.registry import check_backend
from .plan import NeighbourhoodPlan

__all__ = ["POOL_MODES", "KNNPool", "knn_pool"]


def knn_pool(x: torch.Tensor, knn_indices, nin: int, mode: str = "max",
             backend: str = "auto") -> torch.Tensor:
    """Pool x [B, C, Nin] over each output node's neighbours; returns [B, C, Nout].

    knn_indices: integer [K, Nout], entries in [0, nin] (nin = padding neighbour). backend:
    'auto' (the native kernels where they serve: float16/bfloat16/float32 on an sm_80+ GPU
    with CuPy), or any registered backend ('cuda', 'torch_compact', ...), which never falls
    back. The KNNPool layer builds its tables once; this function builds them per call.
    """
    plan = NeighbourhoodPlan(knn_indices, nin=nin)
    return knn_pool_with_backend(x, plan, mode, backend)[0]


class KNNPool(nn.Module):
    """KNN pooling layer (see :func:`knn_pool`); x [B, C, Nin] -> [B, C, Nout].

    The neighbour table lives in the layer's plan (``self.plan``): copied to each device it
    is used on, and out of the state_dict, like the KNNConv geometry. After each forward,
    ``last_backend`` names the backend that computed it.
    """

    def __init__(self, knn_indices, *, nin: int, mode: str = "max",
                 backend: str = "auto") -> None:
        super().__init__()
        self.plan = NeighbourhoodPlan(knn_indices, nin=check_positive("nin", nin))
        self.nin = self.plan.nin
        self.mode = check_mode(mode)
        self.backend = check_backend(backend)
        self.last_backend: str | None = None

    @property
    def knn_indices(self) -> torch.Tensor:
        """The neighbour table, int64 [K, Nout] (host copy)."""
        return self.plan.knn_indices

    @classmethod
    def from_coords(cls, in_coords, out_coords, k: int, *, mode: str = "max",
                    backend: str = "auto") -> KNNPool:
        """Pool each output point over its ``k`` nearest input points (see knnconv.geometry)."""
        knn_indices, _, _ = knn_geometry(in_coords, out_coords, k)
        return cls(knn_indices, nin=len(in_coords), mode=mode, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.last_backend = knn_pool_with_backend(x, self.plan, self.mode, self.backend)
        return y

    def extra_repr(self) -> str:
        return (f"nin={self.nin}, nout={self.plan.nout}, k={self.plan.k}, mode={self.mode!r}, "
                f"backend={self.backend!r}, last_backend={self.last_backend!r}")
