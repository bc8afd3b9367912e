"""KNN pooling: every output node reduces its K nearest inputs, channel by channel.

y[b, c, n] = reduce over the real neighbours k of n of x[b, c, knn[k, n]], where ``knn[k, n]
== Nin`` marks a padding neighbour that takes no part: ``max`` is the largest real value,
``avg`` the sum over the real neighbours divided by their count, ``sum`` their sum. A node
whose neighbours are all padding gives 0 in every mode.
"""

from __future__ import annotations

import torch
from torch import nn

from ._checks import as_index_tensor, check_knn_indices, check_positive
from .geometry import knn_geometry
from .neighbours import (
    NativeTableCache,
    check_backend,
    check_features,
    gather_neighbours,
    native_tables,
    resolve_neighbourhood_backend,
)
from .ops.cuda import neighbourhood
from .ops.registry import accumulation_dtype

POOL_MODES = ("max", "avg", "sum")


def knn_pool(x: torch.Tensor, knn_indices, nin: int, mode: str = "max",
             backend: str = "auto") -> torch.Tensor:
    """Pool x [B, C, Nin] over each output node's neighbours; returns [B, C, Nout].

    knn_indices: integer [K, Nout], entries in [0, nin] (nin = padding neighbour). Gradients
    flow like ``torch.amax`` (shared equally between tied maxima) in ``max`` mode. backend:
    'torch', 'cuda' (native kernels: float16/bfloat16/float32 on an sm_80+ GPU with CuPy) or
    'auto' (cuda where it serves). The KNNPool layer caches the native tables; this function
    builds them per call.
    """
    nin = check_positive("nin", nin)
    knn_indices = checked_knn_indices(knn_indices, nin)
    check_features(x, nin)
    mode = check_mode(mode)
    return _pool(x, knn_indices.to(x.device), nin, mode, check_backend(backend), None)[0]


def _pool(x, knn_indices, nin: int, mode: str, backend: str, cache: NativeTableCache | None):
    """(y, backend that ran) on validated arguments; native tables from ``cache``, or built
    for this call alone where there is none (the function's)."""
    if resolve_neighbourhood_backend(backend, x, atomics=False) == "torch":
        return pool_neighbours(x, knn_indices, nin, mode), "torch"
    tables = native_tables(knn_indices, nin) if cache is None else cache.get(knn_indices, nin)
    return _NativePool.apply(x, tables, nin, mode), "cuda"


class _NativePool(torch.autograd.Function):
    """Pooling on the native kernels; dx is a gather over the reversed graph (deterministic)."""

    @staticmethod
    def forward(ctx, x, tables, nin: int, mode: str):
        x = x.contiguous()
        y, ties = neighbourhood.pool_forward(x, tables.knn, nin, mode)
        ctx.tables, ctx.mode, ctx.nin, ctx.dtype = tables, mode, nin, x.dtype
        if mode == "max":  # the max and its tie count say which inputs get gradient
            ctx.save_for_backward(x, y, ties)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, y, ties = ctx.saved_tensors if ctx.mode == "max" else (None, None, None)
        grad_y = grad_y.to(ctx.dtype).contiguous()
        dx = neighbourhood.pool_backward(grad_y, x, y, ties, ctx.tables.scale,
                                         ctx.tables.reverse, ctx.mode, ctx.nin)
        return dx, None, None, None


def checked_knn_indices(knn_indices, nin: int) -> torch.Tensor:
    """knn_indices as int64 [K, Nout]; TypeError/ValueError naming it unless it is a valid table."""
    knn_indices = as_index_tensor("knn_indices", knn_indices)
    check_knn_indices(knn_indices, nin)
    return knn_indices.to(torch.int64)


def check_mode(mode) -> str:
    if mode not in POOL_MODES:
        raise ValueError(f"mode must be one of {POOL_MODES}, got {mode!r}")
    return mode


def pool_neighbours(x: torch.Tensor, knn_indices: torch.Tensor, nin: int,
                    mode: str) -> torch.Tensor:
    """The pooling itself, on already validated arguments (knn_indices int64 on x's device).

    Half-precision x is pooled in float32 and the result rounded once: a sum of K values, and
    dx, which sums the gradients of every node that reads an input, would otherwise round at
    every step and overflow where float32 does not."""
    real = knn_indices != nin  # [K, Nout]
    wide = x.to(accumulation_dtype(x.dtype))
    if mode == "max":
        # -inf padding never wins a max over a real value; nodes with no real neighbour would
        # give -inf, and are set to 0 by a where whose backward sends them no gradient.
        pooled = gather_neighbours(wide, knn_indices, fill=-torch.inf).amax(dim=2)
        return torch.where(real.any(dim=0), pooled, 0.0).to(x.dtype)
    pooled = gather_neighbours(wide, knn_indices, fill=0.0).sum(dim=2)
    if mode == "avg":
        # Clamping the count at 1 leaves an all-padding node at its sum, 0.
        pooled = pooled / real.sum(dim=0).clamp_min(1).to(pooled.dtype)
    return pooled.to(x.dtype)


class KNNPool(nn.Module):
    """KNN pooling layer (see :func:`knn_pool`); x [B, C, Nin] -> [B, C, Nout].

    The neighbour table is a non-persistent buffer: it follows ``.to(device)`` and stays out of
    the state_dict, like the KNNConv geometry.
    """

    knn_indices: torch.Tensor

    def __init__(self, knn_indices, *, nin: int, mode: str = "max",
                 backend: str = "auto") -> None:
        super().__init__()
        self.nin = check_positive("nin", nin)
        self.mode = check_mode(mode)
        self.backend = check_backend(backend)
        self.last_backend: str | None = None  # which backend ran the last forward
        self._native_tables = NativeTableCache()
        self.register_buffer("knn_indices", checked_knn_indices(knn_indices, self.nin),
                             persistent=False)

    @classmethod
    def from_coords(cls, in_coords, out_coords, k: int, *, mode: str = "max",
                    backend: str = "auto") -> KNNPool:
        """Pool each output point over its ``k`` nearest input points (see knnconv.geometry)."""
        knn_indices, _, _ = knn_geometry(in_coords, out_coords, k)
        return cls(knn_indices, nin=len(in_coords), mode=mode, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_features(x, self.nin)
        y, self.last_backend = _pool(x, self.knn_indices, self.nin, self.mode, self.backend,
                                     self._native_tables)
        return y

    def extra_repr(self) -> str:
        k, nout = self.knn_indices.shape
        return (f"nin={self.nin}, nout={nout}, k={k}, mode={self.mode!r}, "
                f"backend={self.backend!r}")
