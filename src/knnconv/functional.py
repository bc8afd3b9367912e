"""knn_conv: input validation, backend choice, autocast, and the one autograd Function."""

from __future__ import annotations

import torch

from . import context
from ._checks import check_tensor
from .ops.dispatch import resolve_backend
from .ops.execute import backward_impl, compute_dtype, forward_impl
from .ops.registry import KNNConvOps
from .plan import KNNConvPlan
from .torch_ops import knn_conv_op


def validate_call(x, weight, bias, plan) -> None:
    """Raise TypeError/ValueError naming the offending argument before any compute."""
    if not isinstance(plan, KNNConvPlan):
        raise TypeError(
            f"plan must be a KNNConvPlan (see knnconv.make_plan), got {type(plan).__name__}"
        )
    check_tensor("x", x)
    check_tensor("weight", weight)
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D [B, Cin, Nin], got shape {tuple(x.shape)}")
    if x.shape[1] != plan.cin or x.shape[2] != plan.nin:
        raise ValueError(
            f"x must have shape [B, Cin={plan.cin}, Nin={plan.nin}] to match the plan, "
            f"got {tuple(x.shape)}"
        )
    if tuple(weight.shape) != (plan.cout, plan.q):
        raise ValueError(
            f"weight must have shape [Cout, Cin*V] = [{plan.cout}, {plan.q}], "
            f"got {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if bias is not None:
        check_tensor("bias", bias)
        if tuple(bias.shape) != (plan.cout,):
            raise ValueError(
                f"bias must have shape [Cout] = [{plan.cout}], got {tuple(bias.shape)}"
            )
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")


class KNNConvFunction(torch.autograd.Function):
    """Differentiable KNN convolution over any registered backend (the eager path; under
    torch.compile the same two impls run inside the knnconv custom ops, see torch_ops).

    The backend sees tensors in the compute dtype; its float32 gradients are cast straight to
    the dtypes of x, weight and bias, never through the (narrower) compute dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, plan: KNNConvPlan, ops: KNNConvOps, dtype: torch.dtype):
        need_x, need_w = ctx.needs_input_grad[:2]
        keep = need_w and context.settings().keep_input_relayout
        y, saved_x = forward_impl(plan, ops, x, weight, bias, dtype, keep_for_backward=keep)
        if isinstance(saved_x, torch.Tensor):
            ctx.save_for_backward(saved_x if need_w else None, weight if need_x else None)
            ctx.saved_input = None
        else:  # a backend's own re-layout of x; it holds no autograd history
            ctx.save_for_backward(None, weight if need_x else None)
            ctx.saved_input = saved_x
        ctx.plan, ctx.ops, ctx.compute_dtype = plan, ops, dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        saved_x, weight = ctx.saved_tensors
        if ctx.saved_input is not None:
            saved_x = ctx.saved_input
        grads = backward_impl(ctx.plan, ctx.ops, grad_y, saved_x, weight,
                              ctx.needs_input_grad[:3], ctx.dtypes, ctx.compute_dtype)
        return (*grads, None, None, None)


def knn_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: KNNConvPlan,
             backend: str = "auto") -> torch.Tensor:
    """KNN convolution: y[b, o, n] = bias[o] + sum_{c,k} x[b, c, knn[k, n]] * W[o, c*V + rf[n, k]].

    x: [B, Cin, Nin]; weight: [Cout, Cin*V]; bias: [Cout] or None; returns [B, Cout, Nout]
    (a transposed view of a [B, Nout, Cout] buffer). Differentiable in x, weight and bias.
    """
    return knn_conv_with_backend(x, weight, bias, plan, backend)[0]


def knn_conv_with_backend(x, weight, bias, plan, backend="auto") -> tuple[torch.Tensor, str]:
    """Like :func:`knn_conv`, also returning the name of the backend that ran."""
    validate_call(x, weight, bias, plan)
    device_type = x.device.type
    autocasting = device_type != "meta" and torch.is_autocast_enabled(device_type)
    dtype = compute_dtype(x, weight, bias, autocasting)
    backward = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    ops = resolve_backend(backend, plan, x.device, dtype, batch=x.shape[0], backward=backward)
    if torch.compiler.is_compiling():
        keep = context.settings().keep_input_relayout
        return knn_conv_op(x, weight, bias, plan, ops.name, dtype, keep), ops.name
    if not autocasting:
        return _eager(plan, ops, x, weight, bias, dtype, backward), ops.name
    with torch.autocast(device_type, enabled=False):  # the backend must not recast inside
        return _eager(plan, ops, x, weight, bias, dtype, backward), ops.name


def _eager(plan, ops, x, weight, bias, dtype: torch.dtype, backward: bool) -> torch.Tensor:
    """y through the autograd Function where a gradient will be computed; without one there
    is no node to record, and the impl runs without the Function's cost."""
    if not backward:
        return forward_impl(plan, ops, x, weight, bias, dtype, False)[0]
    return KNNConvFunction.apply(x, weight, bias, plan, ops, dtype)
