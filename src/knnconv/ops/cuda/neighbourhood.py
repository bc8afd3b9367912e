"""Launches of the per-channel neighbourhood kernels (kernels/knn_neighbourhood.cuh): KNN
pooling and depthwise KNN convolution, forward and backward.

Every gradient with respect to x is a gather over the reversed graph (atomic-free,
deterministic); the depthwise weight gradient sums per block in shared memory and adds with
fp32 atomics. Tensors are contiguous [B, C, N] on one CUDA device; tables are int32.
"""

from __future__ import annotations

import torch

from .build import get_kernel, neighbourhood_name
from .launch import MAX_GRID_YZ, ReverseTables, _launch, _pointer

POOL_MODE_CODES = {"max": 0, "avg": 1, "sum": 2}
NATIVE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
THREADS = 256


def _run(name: str, device: torch.device, extent: int, rows: int, args: tuple, *,
         shared: int = 0, grid=None) -> None:
    if rows == 0 or extent == 0:
        return
    grid = grid or (-(-extent // THREADS), min(rows, MAX_GRID_YZ), 1)
    _launch(get_kernel(name, device.index), device.index, grid, (THREADS, 1, 1), shared, args)


def pool_forward(x: torch.Tensor, knn: torch.Tensor, nin: int, mode: str):
    """(y [B, C, Nout] in x's dtype, ties [B, C, Nout] int32 for max, else None)."""
    batch, channels, _ = x.shape
    k, nout = knn.shape
    y = torch.empty(batch, channels, nout, dtype=x.dtype, device=x.device)
    ties = (torch.empty(batch, channels, nout, dtype=torch.int32, device=x.device)
            if mode == "max" else None)
    name = neighbourhood_name("knn_pool_forward", x.dtype, mode=POOL_MODE_CODES[mode])
    _run(name, x.device, nout, batch * channels,
         (x.data_ptr(), knn.data_ptr(), y.data_ptr(), _pointer(ties), batch * channels, nin,
          nout, k))
    return y, ties


def pool_backward(grad_y: torch.Tensor, x: torch.Tensor | None, y: torch.Tensor | None,
                  ties: torch.Tensor | None, scale: torch.Tensor, reverse: ReverseTables,
                  mode: str, nin: int) -> torch.Tensor:
    """dx [B, C, Nin] in grad_y's dtype (the dtype of x). x, y and ties: max mode only.
    scale: float32 [Nout], 1/(real neighbours), read in avg mode."""
    batch, channels, nout = grad_y.shape
    dx = torch.empty(batch, channels, nin, dtype=grad_y.dtype, device=grad_y.device)
    name = neighbourhood_name("knn_pool_backward", grad_y.dtype, mode=POOL_MODE_CODES[mode])
    _run(name, grad_y.device, nin, batch * channels,
         (grad_y.data_ptr(), _pointer(x), _pointer(y), _pointer(ties), scale.data_ptr(),
          reverse.pair_start.data_ptr(), reverse.pair_node.data_ptr(), dx.data_ptr(),
          batch * channels, nin, nout))
    return dx


def depthwise_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      knn: torch.Tensor, cells: torch.Tensor, nin: int) -> torch.Tensor:
    """y [B, C, Nout] in x's dtype; weight [C, V] and bias [C] in x's dtype."""
    batch, channels, _ = x.shape
    k, nout = knn.shape
    y = torch.empty(batch, channels, nout, dtype=x.dtype, device=x.device)
    _run(neighbourhood_name("knn_depthwise_forward", x.dtype), x.device, nout,
         batch * channels,
         (x.data_ptr(), weight.data_ptr(), _pointer(bias), knn.data_ptr(), cells.data_ptr(),
          y.data_ptr(), batch * channels, channels, nin, nout, k, weight.shape[1]))
    return y


def depthwise_grad_input(grad_y: torch.Tensor, weight: torch.Tensor, reverse: ReverseTables,
                         nin: int, grad_dtype: torch.dtype) -> torch.Tensor:
    batch, channels, nout = grad_y.shape
    dx = torch.empty(batch, channels, nin, dtype=grad_dtype, device=grad_y.device)
    _run(neighbourhood_name("knn_depthwise_grad_input", grad_y.dtype, grad_dtype),
         grad_y.device, nin, batch * channels,
         (grad_y.data_ptr(), weight.data_ptr(), reverse.pair_start.data_ptr(),
          reverse.pair_node.data_ptr(), reverse.pair_cell.data_ptr(), dx.data_ptr(),
          batch * channels, channels, nin, nout, weight.shape[1]))
    return dx


def depthwise_grad_weight(x: torch.Tensor, grad_y: torch.Tensor, knn: torch.Tensor,
                          cells: torch.Tensor, v: int) -> torch.Tensor:
    """dW [C, V] float32."""
    batch, channels, nin = x.shape
    k, nout = knn.shape
    dw = torch.zeros(channels, v, dtype=torch.float32, device=x.device)
    nodes_per_block = max(1, THREADS // k)  # one thread per (node, slot)
    grid = (-(-nout // nodes_per_block), channels, 1)
    _run(neighbourhood_name("knn_depthwise_grad_weight", x.dtype), x.device, nout,
         batch * channels,
         (x.data_ptr(), grad_y.data_ptr(), knn.data_ptr(), cells.data_ptr(), dw.data_ptr(),
          batch, channels, nin, nout, k, v, nodes_per_block),
         shared=4 * v, grid=grid)
    return dw
