"""Backends behind one interface: see :mod:`knnconv.ops.registry`."""

from .reference import ReferenceOps
from .registry import (
    KNNConvOps,
    available_backends,
    get_ops,
    register_lazy_ops,
    register_ops,
    resolve_backend,
)
from .torch_binned import TorchBinnedOps
from .torch_compact import TorchCompactOps

register_ops(ReferenceOps())
register_ops(TorchCompactOps())
register_ops(TorchBinnedOps())


def _load_cuda_ops() -> KNNConvOps:
    from .cuda import CudaOps

    return CudaOps()


register_lazy_ops("cuda", _load_cuda_ops)

__all__ = [
    "KNNConvOps", "ReferenceOps", "TorchBinnedOps", "TorchCompactOps", "available_backends",
    "get_ops",
    "register_ops", "register_lazy_ops", "resolve_backend",
]
