"""What the per-channel neighbourhood layers (KNNPool, KNNDepthwiseConv) share: input checks,
the torch-ops neighbour gathering, and the choice between torch ops and the native kernels.

KNNPool and KNNDepthwiseConv both read, for every output node, the K input features its
``knn_indices`` column names, with ``Nin`` marking a padding neighbour. Appending one extra
input column holding a fill value lets them gather without masking: a padding slot reads the
fill (0 for sums, -inf for a max) and never a real feature, so a NaN in x can only reach the
nodes that have it as a real neighbour.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._checks import check_tensor
from .ops.cuda.launch import reverse_tables
from .ops.cuda.neighbourhood import NATIVE_DTYPES
from .ops.registry import get_ops
from .persistent import build_persistent


def check_features(x, nin: int, channels: int | None = None) -> None:
    """Raise TypeError/ValueError naming ``x`` unless it is a floating [B, channels, nin] tensor
    (any channel count when ``channels`` is None)."""
    check_tensor("x", x)
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


# Backends of the per-channel layers (KNNPool, KNNDepthwiseConv): plain torch ops on any
# device and dtype, or the native kernels of knnconv.ops.cuda.neighbourhood.
NEIGHBOURHOOD_BACKENDS = ("auto", "torch", "cuda")


def check_backend(backend) -> str:
    if backend not in NEIGHBOURHOOD_BACKENDS:
        raise ValueError(f"backend must be one of {NEIGHBOURHOOD_BACKENDS}, got {backend!r}")
    return backend


# knn_depthwise_grad_weight sums a block's contributions per kernel cell in 48 KiB of shared
# memory (one float per cell).
MAX_NATIVE_CELLS = 48 * 1024 // 4


def _native_unsupported(x: torch.Tensor, dtype: torch.dtype, atomics: bool,
                        cells: int | None) -> str | None:
    if cells is not None and cells > MAX_NATIVE_CELLS:
        return (f"has V = {cells} kernel cells; its weight gradient holds at most "
                f"{MAX_NATIVE_CELLS} in shared memory")
    # first: tracing reaches neither the native kernels nor the cuda backend's first build
    if torch.compiler.is_compiling():
        return "is not traceable by torch.compile (backend='auto' uses torch ops there)"
    if x.device.type == "cuda":
        if dtype not in NATIVE_DTYPES:
            return f"computes in float16/bfloat16/float32, got {dtype}"
    return get_ops("cuda").call_reason(x.device, atomics=atomics, alternative="torch")


def resolve_neighbourhood_backend(backend: str, x: torch.Tensor, *, atomics: bool,
                                  cells: int | None = None,
                                  dtype: torch.dtype | None = None) -> str:
    """'torch' or 'cuda' for this call: 'auto' takes the native kernels wherever they serve;
    an explicit 'cuda' that cannot serve raises (never a silent fallback). ``atomics``: the
    backward accumulates with atomics (refused under deterministic algorithms); ``cells``:
    the depthwise kernel's V; ``dtype``: what the kernels would compute in (x's if None)."""
    if backend == "torch":
        return "torch"
    reason = _native_unsupported(x, x.dtype if dtype is None else dtype, atomics, cells)
    if backend == "cuda" and reason is not None:
        raise ValueError(f"backend 'cuda' cannot run this call: {reason}")
    return "cuda" if reason is None else "torch"


@dataclass
class NativeTables:
    """A neighbour table as the native kernels read it, on one device."""

    knn: torch.Tensor  # int32 [K, Nout]
    cells: torch.Tensor | None  # int32 [K, Nout]: each slot's kernel cell (depthwise)
    reverse: object  # knnconv.ops.cuda.launch.ReverseTables
    scale: torch.Tensor  # float32 [Nout]: 1 / the number of real neighbours (at least 1)


def native_tables(knn_indices: torch.Tensor, nin: int,
                  slot_cells: torch.Tensor | None = None) -> NativeTables:
    """The NativeTables of a neighbour table (and a depthwise layer's slot cells)."""
    cells = slot_cells if slot_cells is not None else torch.zeros_like(knn_indices)
    real = (knn_indices != nin).sum(dim=0).clamp_min(1)
    return NativeTables(
        knn=knn_indices.to(torch.int32).contiguous(),
        cells=None if slot_cells is None else slot_cells.to(torch.int32).contiguous(),
        reverse=reverse_tables(knn_indices, cells.t(), nin),
        scale=(1.0 / real.to(torch.float32)).contiguous())


class NativeTableCache:
    """A layer's NativeTables for its current table tensors: rebuilt when they change.

    Keyed by the tensors' identity (weak references) and version counters, never by address:
    a buffer moved away and back (``layer.cpu()``, edited, ``layer.cuda()``) may land at the
    address of the one the tables were built from, with the same version.
    """

    def __init__(self) -> None:
        # (weak refs to the sources and their versions, the tables), replaced as one
        self._entry: tuple[tuple, NativeTables] | None = None

    def __getstate__(self) -> dict:
        return {}  # weak references do not pickle; the tables are rebuilt on first use

    def __setstate__(self, state: dict) -> None:
        self._entry = None

    @staticmethod
    def _identify(*tensors: torch.Tensor | None) -> tuple:
        return tuple(None if t is None else (weakref.ref(t), t._version) for t in tensors)

    @staticmethod
    def _same(source: tuple, *tensors: torch.Tensor | None) -> bool:
        return all((t is None) == (held is None) and (
            t is None or (held[0]() is t and held[1] == t._version))
            for t, held in zip(tensors, source, strict=True))

    def get(self, knn_indices: torch.Tensor, nin: int,
            slot_cells: torch.Tensor | None = None) -> NativeTables:
        entry = self._entry
        tables = entry[1] if entry is not None and self._same(
            entry[0], knn_indices, slot_cells) else None
        if tables is None:  # kept for the layer's life: built out of any graph's pool
            tables = build_persistent(knn_indices.device,
                                      lambda: native_tables(knn_indices, nin, slot_cells))
            # one device at a time; a move replaces it
            self._entry = (self._identify(knn_indices, slot_cells), tables)
        return tables
