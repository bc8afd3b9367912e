"""knn_conv: input validation, backend choice, autocast, and the one autograd Function."""

from __future__ import annotations

import contextlib

import torch

from .ops.registry import KNNConvOps, resolve_backend
from .plan import KNNConvPlan


def _check_tensor(name: str, value, *, floating: bool = True) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {value.dtype}")
    return value


def validate_call(x, weight, bias, plan) -> None:
    """Raise TypeError/ValueError naming the offending argument before any compute."""
    if not isinstance(plan, KNNConvPlan):
        raise TypeError(
            f"plan must be a KNNConvPlan (see knnconv.make_plan), got {type(plan).__name__}"
        )
    _check_tensor("x", x)
    _check_tensor("weight", weight)
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
        _check_tensor("bias", bias)
        if tuple(bias.shape) != (plan.cout,):
            raise ValueError(
                f"bias must have shape [Cout] = [{plan.cout}], got {tuple(bias.shape)}"
            )
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")


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


_keep_input_relayout = False


def set_keep_input_relayout(enabled: bool) -> bool:
    """Whether a training forward keeps the backend's re-layout of x for the backward.

    False (the default): the forward keeps x itself and the cuda backend's backward re-lays
    it out again, so a layer holds no copy of its input between forward and backward. True:
    the cuda backend keeps its batch-contiguous copy of x from the forward and the backward
    skips that re-layout, a few percent faster for noticeably more peak memory (measured on
    whole networks: README "Memory or speed", bench/NOTES.md versions 24 and 29). The torch backends
    keep x either way. Returns the previous setting. Read at every call; a torch.compile'd
    graph keeps the setting it was traced with.
    """
    global _keep_input_relayout
    previous, _keep_input_relayout = _keep_input_relayout, bool(enabled)
    return previous


@contextlib.contextmanager
def keep_input_relayout(enabled: bool):
    """:func:`set_keep_input_relayout` (``enabled``) for a block, the previous setting after."""
    previous = set_keep_input_relayout(enabled)
    try:
        yield
    finally:
        set_keep_input_relayout(previous)


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


class KNNConvFunction(torch.autograd.Function):
    """Differentiable KNN convolution over any registered backend (the eager path; under
    torch.compile the same two impls run inside the knnconv custom ops, see torch_ops).

    The backend sees tensors in the compute dtype; its float32 gradients are cast straight to
    the dtypes of x, weight and bias, never through the (narrower) compute dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, plan: KNNConvPlan, ops: KNNConvOps, dtype: torch.dtype):
        need_x, need_w = ctx.needs_input_grad[:2]
        y, saved_x = forward_impl(plan, ops, x, weight, bias, dtype,
                                  keep_for_backward=need_w and _keep_input_relayout)
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
        from .torch_ops import knn_conv_op

        return knn_conv_op(x, weight, bias, plan, ops.name, dtype, _keep_input_relayout), ops.name
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
