"""Running a backend on one call: the dtype it computes in, and the forward and backward as
every path runs them (the eager autograd Function, the custom ops under torch.compile and the
autotuner's timed steps)."""

from __future__ import annotations

import torch

from ..plan import KNNConvPlan
from .registry import KNNConvOps


def compute_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  autocasting: bool) -> torch.dtype:
    """The dtype the backend computes in: autocast's when active, except for a float64 x,
    which autocast leaves alone as PyTorch's own ops do; else the (common) input dtype."""
    if autocasting and x.dtype != torch.float64:
        return torch.get_autocast_dtype(x.device.type)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but x has {x.dtype}; cast them to one dtype "
                "or run under torch.autocast"
            )
    return x.dtype


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor.to(dtype) without the dispatcher round trip when it already is (most calls)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def forward_impl(plan: KNNConvPlan, ops: KNNConvOps, x, weight, bias, dtype: torch.dtype,
                 keep_for_backward: bool):
    """y in the compute dtype, and what the weight gradient needs of x (x in the compute dtype,
    or the backend's own re-layout of it, see KNNConvOps.forward_saving)."""
    xc, wc = _in_dtype(x, dtype), _in_dtype(weight, dtype)
    keep_bias = bias is None or (ops.float32_bias and bias.dtype == torch.float32)
    bc = bias if keep_bias else _in_dtype(bias, dtype)
    if x.shape[0] == 0:  # an empty batch is legal; no backend needs to handle it
        return xc.new_empty(0, plan.nout, plan.cout).transpose(1, 2), xc
    if keep_for_backward:
        return ops.forward_saving(plan, xc, wc, bc)
    return ops.forward(plan, xc, wc, bc), xc


def backward_impl(plan: KNNConvPlan, ops: KNNConvOps, grad_y, saved_x, weight, needs, dtypes,
                  dtype: torch.dtype):
    """(grad_x, grad_weight, grad_bias), None where not needed, each in the dtype of the tensor
    it belongs to (``dtypes``), accumulated in at least float32."""
    grad_y = _in_dtype(grad_y, dtype)
    wc = _in_dtype(weight, dtype) if needs[0] else None
    if grad_y.shape[0] == 0:
        grad_x = grad_y.new_zeros(0, plan.cin, plan.nin, dtype=dtypes[0]) if needs[0] else None
        grad_w = grad_y.new_zeros(plan.cout, plan.q, dtype=dtypes[1]) if needs[1] else None
        grad_b = grad_y.new_zeros(plan.cout, dtype=dtypes[2]) if needs[2] else None
        return grad_x, grad_w, grad_b
    return ops.gradients(plan, grad_y, saved_x, wc, needs, dtypes)
