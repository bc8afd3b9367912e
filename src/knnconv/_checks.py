"""Argument checks shared by every tier: each raises TypeError or ValueError naming the
argument at fault, before any compute."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch


def check_tensor(name: str, value, *, floating: bool = True) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {value.dtype}")
    return value


def as_index_tensor(name: str, table: Any) -> torch.Tensor:
    if isinstance(table, np.ndarray):
        table = torch.from_numpy(np.ascontiguousarray(table))
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(table).__name__}")
    if table.is_floating_point() or table.is_complex() or table.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {table.dtype}")
    if table.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: it has no values to build the tables from")
    return table


def as_index(value: Any) -> int | None:
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_positive(name: str, value: Any) -> int:
    """value as an int >= 1: any integer (numpy's, a 0-d integer tensor), not a bool."""
    as_int = None if isinstance(value, bool) else as_index(value)
    if as_int is None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if as_int < 1:
        raise ValueError(f"{name} must be >= 1, got {as_int}")
    return as_int


def check_knn_indices(knn_indices: torch.Tensor, nin: int) -> None:
    """ValueError naming knn_indices unless it is [K, Nout] with K, Nout >= 1 and entries in
    [0, nin]."""
    if knn_indices.dim() != 2:
        raise ValueError(f"knn_indices must be 2-D [K, Nout], got shape {tuple(knn_indices.shape)}")
    k, nout = knn_indices.shape
    if k < 1 or nout < 1:
        raise ValueError(f"knn_indices must have K >= 1 and Nout >= 1, got shape {(k, nout)}")
    kmin, kmax = int(knn_indices.min()), int(knn_indices.max())
    if kmin < 0 or kmax > nin:
        raise ValueError(
            f"knn_indices entries must lie in [0, nin] = [0, {nin}] (nin marks padding), "
            f"got range [{kmin}, {kmax}]"
        )


def check_tables(knn_indices: torch.Tensor, rf_index: torch.Tensor, nin: int, v: int) -> None:
    check_knn_indices(knn_indices, nin)
    k, nout = knn_indices.shape
    if tuple(rf_index.shape) == (k, nout) and k != nout:
        raise ValueError(
            f"knn_indices and rf_index are both {tuple(knn_indices.shape)}: one of them is "
            "transposed (knn_indices must be [K, Nout], rf_index [Nout, K])"
        )
    if tuple(rf_index.shape) != (nout, k):
        raise ValueError(
            f"rf_index must have shape [Nout, K] = [{nout}, {k}] to match knn_indices, "
            f"got {tuple(rf_index.shape)}"
        )
    rmin, rmax = int(rf_index.min()), int(rf_index.max())
    if rmin < 0 or rmax >= v:
        raise ValueError(
            f"rf_index entries must lie in [0, v) = [0, {v}), got range [{rmin}, {rmax}]"
        )




def check_features(x, nin: int, channels: int | None = None) -> None:
    """Raise TypeError/ValueError naming ``x`` unless it is a floating [B, channels, nin] tensor
    (any channel count when ``channels`` is None)."""
    check_tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D [B, C, Nin], got shape {tuple(x.shape)}")
    if x.shape[2] != nin or (channels is not None and x.shape[1] != channels):
        expected = "C" if channels is None else f"C={channels}"
        raise ValueError(f"x must have shape [B, {expected}, Nin={nin}], got {tuple(x.shape)}")
