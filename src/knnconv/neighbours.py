"""Per-node neighbour gathering shared by the layers that reduce over the K neighbours in torch.

KNNPool and KNNDepthwiseConv both read, for every output node, the K input features its
``knn_indices`` column names, with ``Nin`` marking a padding neighbour. Appending one extra
input column holding a fill value lets them gather without masking: a padding slot reads the
fill (0 for sums, -inf for a max) and never a real feature, so a NaN in x can only reach the
nodes that have it as a real neighbour.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .functional import _check_tensor


def check_features(x, nin: int, channels: int | None = None) -> None:
    """Raise TypeError/ValueError naming ``x`` unless it is a floating [B, channels, nin] tensor
    (any channel count when ``channels`` is None)."""
    _check_tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D [B, C, Nin], got shape {tuple(x.shape)}")
    if x.shape[2] != nin or (channels is not None and x.shape[1] != channels):
        expected = "C" if channels is None else f"C={channels}"
        raise ValueError(f"x must have shape [B, {expected}, Nin={nin}], got {tuple(x.shape)}")


def gather_neighbours(x: torch.Tensor, knn_indices: torch.Tensor, fill: float) -> torch.Tensor:
    """The neighbour features [B, C, K, Nout] of x [B, C, Nin]; padding slots read ``fill``.

    knn_indices: int64 [K, Nout] on x's device, entries in [0, Nin] (validated by the caller).
    """
    batch, channels, _ = x.shape
    k, nout = knn_indices.shape
    padded = F.pad(x, (0, 1), value=fill)
    # index_select on the flattened table is one gather; its backward is one index_add.
    return padded.index_select(2, knn_indices.reshape(-1)).view(batch, channels, k, nout)
