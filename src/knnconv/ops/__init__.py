"""Backends behind one interface (:mod:`knnconv.ops.registry`), the dispatcher that picks one
per call (:mod:`knnconv.ops.dispatch`) and the autotuner it consults (:mod:`knnconv.ops.autotune`).

Tiers, each importing only those above it: registry (the interface) -> the backends
(reference, torch_compact, torch_binned, cuda, triton) -> execute (running one on a call) and
timing -> autotune -> dispatch.
"""

from .cuda import CudaOps
from .dispatch import resolve_backend
from .reference import ReferenceOps
from .registry import (
    KNNConvOps,
    available_backends,
    get_ops,
    register_ops,
)
from .torch_binned import TorchBinnedOps
from .torch_compact import TorchCompactOps
from .triton import TritonOps

register_ops(ReferenceOps())
register_ops(TorchCompactOps())
register_ops(TorchBinnedOps())
register_ops(CudaOps())
register_ops(TritonOps())

__all__ = [
    "CudaOps", "KNNConvOps", "ReferenceOps", "TorchBinnedOps", "TorchCompactOps", "TritonOps",
    "available_backends", "get_ops", "register_ops", "resolve_backend",
]
