"""knnconv's native CUDA backend: gather-GEMM kernels compiled at run time through NVRTC.

The module-level API, also importable as :mod:`knnconv.cuda`: :func:`forward`,
:func:`grad_input`, :func:`grad_weight`, :func:`backward_combined`, :class:`CudaOps`,
:class:`KernelConfig`, the ``default_*`` heuristics and :func:`clear_kernel_cache`.
The kernels compute in float16/bfloat16 with fp32 accumulation; float32 calls are served by
the ``torch_compact`` backend when ``backend="auto"`` (and refused by ``backend="cuda"``).

One job per module (kernels/ holds the CUDA sources):

================  ===============================================================================
backend           CudaOps, the registry ops: which calls it serves, the launch plans it keeps
launch_plan       every launch decision: the path a call takes, the kernel, tiles, grids, workspace
configs           KernelConfig, its validation, the default tiles (tiles.json)
gemm              knn_forward, knn_grad_input(_scatter), knn_grad_weight on re-laid-out operands,
                  and the functional API (forward, grad_input, grad_weight, backward...)
channels_last     knn_gather_cl(_wgmma), knn_grad_weight_cl on channels-last x and grad_y
neighbourhood     the pooling and depthwise kernels (knn_neighbourhood.cu)
relayout          the re-layouts of x, grad_y, the weight and dx; the reversed graph
launch            raw launches: cuLaunchKernel, memsets, the transpose kernels, device limits
build             NVRTC compilation and the module cache
================  ===============================================================================
"""

from __future__ import annotations

from .backend import CudaOps
from .build import clear_kernel_cache
from .configs import (
    KernelConfig,
    default_config,
    default_grad_input_algorithm,
    default_grad_input_config,
    default_grad_input_scatter_config,
    default_grad_weight_config,
    default_grad_weight_ksplit,
)
from .gemm import backward, backward_combined, forward, grad_input, grad_weight
from .relayout import ReverseTables, TransposedInput, reverse_tables

__all__ = [
    "CudaOps", "KernelConfig", "ReverseTables", "TransposedInput", "backward",
    "backward_combined", "clear_kernel_cache", "default_config", "default_grad_input_algorithm",
    "default_grad_input_config", "default_grad_input_scatter_config",
    "default_grad_weight_config", "default_grad_weight_ksplit", "forward", "grad_input",
    "grad_weight", "reverse_tables",
]
