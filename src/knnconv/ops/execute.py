"""Running a backend on one call: the dtype it computes in, and the forward and backward of
the convolution and the depthwise convolution as every path runs them (the eager autograd
Functions, the custom ops under torch.compile and the autotuner's timed steps). Pooling
computes in x's dtype and needs no casts: its paths call the backend directly."""

from __future__ import annotations

import torch

from ..plan import KNNConvPlan, NeighbourhoodPlan
from .registry import KNNConvOps, in_storage


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


def cast_operands(ops: KNNConvOps, x, weight, bias, dtype: torch.dtype, *,
                  weight_cast_by_backend: bool = False):
    """x, weight and bias as the backend takes them: in the compute dtype, but a float32 bias
    kept where the backend adds it in float32 (KNNConvOps.float32_bias), and the weight in its
    own dtype when ``weight_cast_by_backend`` (KNNConvOps.casts_weight)."""
    keep_bias = bias is None or (ops.float32_bias and bias.dtype == torch.float32)
    return (_in_dtype(x, dtype), weight if weight_cast_by_backend else _in_dtype(weight, dtype),
            bias if keep_bias else _in_dtype(bias, dtype))


def forward_impl(plan: KNNConvPlan, ops: KNNConvOps, x, weight, bias, dtype: torch.dtype,
                 keep_for_backward: bool):
    """y in the compute dtype, and what the weight gradient needs of x (x in the compute dtype,
    or the backend's own re-layout of it, see KNNConvOps.forward_saving)."""
    xc, wc, bc = cast_operands(ops, x, weight, bias, dtype,
                               weight_cast_by_backend=ops.casts_weight)
    if x.shape[0] == 0:  # an empty batch is legal; no backend needs to handle it
        return xc.new_empty(0, plan.nout, plan.cout).transpose(1, 2), xc
    if keep_for_backward:
        return ops.forward_saving(plan, xc, wc, bc)
    return ops.forward(plan, xc, wc, bc), xc


def backward_impl(plan: KNNConvPlan, ops: KNNConvOps, grad_y, saved_x, weight, needs, dtypes,
                  dtype: torch.dtype, dx_channels_last: bool = False):
    """(grad_x, grad_weight, grad_bias), None where not needed, each in the dtype of the tensor
    it belongs to (``dtypes``), accumulated in at least float32; grad_x in channels-last
    storage when ``dx_channels_last`` (the forward's x was), else contiguous."""
    grad_y = _in_dtype(grad_y, dtype)
    wc = None if not needs[0] else weight if ops.casts_weight else _in_dtype(weight, dtype)
    if grad_y.shape[0] == 0:
        grad_x = grad_y.new_zeros(0, plan.cin, plan.nin, dtype=dtypes[0]) if needs[0] else None
        grad_w = grad_y.new_zeros(plan.cout, plan.q, dtype=dtypes[1]) if needs[1] else None
        grad_b = grad_y.new_zeros(plan.cout, dtype=dtypes[2]) if needs[2] else None
    else:
        grad_x, grad_w, grad_b = ops.gradients(plan, grad_y, saved_x, wc, needs, dtypes,
                                               dx_channels_last=dx_channels_last)
    # the storage promised to torch.compile's fake implementations, whatever the backend did
    return (None if grad_x is None else in_storage(grad_x, dx_channels_last)), grad_w, grad_b


def depthwise_forward_impl(plan: NeighbourhoodPlan, ops: KNNConvOps, x, weight, bias,
                           dtype: torch.dtype) -> torch.Tensor:
    """The depthwise convolution's y, contiguous, in the compute dtype."""
    return ops.depthwise_forward(plan, *cast_operands(ops, x, weight, bias, dtype)).contiguous()


def depthwise_backward_impl(plan: NeighbourhoodPlan, ops: KNNConvOps, grad_y, x, weight, needs,
                            dtypes, dtype: torch.dtype):
    """(grad_x, grad_weight, grad_bias) of the depthwise convolution, None where not needed,
    each in the dtype of the tensor it belongs to (``dtypes``); x is read only for the weight
    gradient, weight only for dx."""
    xc = _in_dtype(x, dtype) if needs[1] else None
    wc = _in_dtype(weight, dtype) if needs[0] else None
    return ops.depthwise_gradients(plan, _in_dtype(grad_y, dtype), xc, wc, needs, dtypes)
