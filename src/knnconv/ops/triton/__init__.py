"""knnconv's ``triton`` backend: TMA-fed gather-GEMM kernels written in Triton, for Hopper and
newer GPUs (:class:`TritonOps`; kernels in :mod:`.kernels`, their launches in :mod:`.launch`,
tiles as data in tiles.json)."""

from .backend import TritonOps

__all__ = ["TritonOps"]
