"""The functional API of every KNN op (knn_conv, knn_pool, knn_depthwise_conv): input
validation, the backend choice of the one dispatcher, the dtype rule, and each op's autograd
Function (eager) or custom op (under torch.compile)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from . import context
from ._checks import check_features, check_tensor
from .ops.dispatch import resolve_backend
from .ops.execute import (
    backward_impl,
    cast_operands,
    compute_dtype,
    depthwise_backward_impl,
    depthwise_forward_impl,
    forward_impl,
)
from .ops.registry import MAX_POOL_MODES, POOL_MODES, KNNConvOps, is_channels_last
from .plan import KNNConvPlan, NeighbourhoodPlan
from .torch_ops import knn_conv_op, knn_depthwise_op, knn_pool_op


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
        # the operands in the compute dtype, cast once: dx reads the same cast weight (or the
        # weight itself, where the backend casts it as it lays it out)
        xc, wc, bc = cast_operands(ops, x, weight, bias, dtype,
                                   weight_cast_by_backend=ops.casts_weight)
        y, saved_x = forward_impl(plan, ops, xc, wc, bc, dtype, keep_for_backward=keep)
        if isinstance(saved_x, torch.Tensor):
            ctx.save_for_backward(saved_x if need_w else None, wc if need_x else None)
            ctx.saved_input = None
        else:  # a backend's own re-layout of x; it holds no autograd history
            ctx.save_for_backward(None, wc if need_x else None)
            ctx.saved_input = saved_x
        ctx.plan, ctx.ops, ctx.compute_dtype = plan, ops, dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.channels_last = is_channels_last(x)  # dx comes in x's storage
        return y

    @staticmethod
    def backward(ctx, grad_y):
        saved_x, weight = ctx.saved_tensors
        if ctx.saved_input is not None:
            saved_x = ctx.saved_input
        grads = backward_impl(ctx.plan, ctx.ops, grad_y, saved_x, weight,
                              ctx.needs_input_grad[:3], ctx.dtypes, ctx.compute_dtype,
                              ctx.channels_last)
        return (*grads, None, None, None)


def knn_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: KNNConvPlan,
             backend: str = "auto") -> torch.Tensor:
    """KNN convolution: y[b, o, n] = bias[o] + sum_{c,k} x[b, c, knn[k, n]] * W[o, c*V + rf[n, k]].

    x: [B, Cin, Nin]; weight: [Cout, Cin*V]; bias: [Cout] or None; returns [B, Cout, Nout]
    (a transposed view of a [B, Nout, Cout] buffer: channels-last storage, which the next
    KNN layer reads without a copy). Differentiable in x, weight and bias; dx comes in x's
    storage.
    """
    return knn_conv_with_backend(x, weight, bias, plan, backend)[0]


def _autocasting(x: torch.Tensor) -> bool:
    device_type = x.device.type
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


class _AutocastOff:
    """Autocast off for one device type, then on again: what torch.autocast(enabled=False)
    does inside an enabled region, without its per-entry checks (14 us a call against 2 on
    a CPU host). Only entered where autocast is on."""

    __slots__ = ("device_type",)

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def __enter__(self) -> None:
        torch.set_autocast_enabled(self.device_type, False)

    def __exit__(self, *exc_info) -> None:
        torch.set_autocast_enabled(self.device_type, True)


def _without_autocast(x: torch.Tensor, autocasting: bool):
    """The eager paths run the backend with autocast off: it must not recast inside."""
    return _AutocastOff(x.device.type) if autocasting else nullcontext()


def knn_conv_with_backend(x, weight, bias, plan, backend="auto") -> tuple[torch.Tensor, str]:
    """Like :func:`knn_conv`, also returning the name of the backend that ran."""
    validate_call(x, weight, bias, plan)
    autocasting = _autocasting(x)
    dtype = compute_dtype(x, weight, bias, autocasting)
    backward = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    ops = resolve_backend(backend, plan, x.device, dtype, batch=x.shape[0], backward=backward)
    if torch.compiler.is_compiling():
        keep = context.settings().keep_input_relayout
        return knn_conv_op(x, weight, bias, plan, ops.name, dtype, keep), ops.name
    with _without_autocast(x, autocasting):
        return _eager(plan, ops, x, weight, bias, dtype, backward), ops.name


def _eager(plan, ops, x, weight, bias, dtype: torch.dtype, backward: bool) -> torch.Tensor:
    """y through the autograd Function where a gradient will be computed; without one there
    is no node to record, and the impl runs without the Function's cost."""
    if not backward:
        return forward_impl(plan, ops, x, weight, bias, dtype, False)[0]
    return KNNConvFunction.apply(x, weight, bias, plan, ops, dtype)


def check_mode(mode) -> str:
    if mode not in POOL_MODES:
        raise ValueError(f"mode must be one of {POOL_MODES}, got {mode!r}")
    return mode


def _check_neighbourhood_plan(plan, pooling: bool) -> None:
    if not isinstance(plan, NeighbourhoodPlan) or (plan.v is None) != pooling:
        wanted = "without rf_index (a pooling)" if pooling else "with rf_index and v"
        raise TypeError(f"plan must be a NeighbourhoodPlan built {wanted}, got {plan!r}")


class KNNPoolFunction(torch.autograd.Function):
    """Differentiable KNN pooling over any backend that serves it (the eager path; under
    torch.compile the same backend calls run inside the knnconv custom ops)."""

    @staticmethod
    def forward(ctx, x, plan: NeighbourhoodPlan, ops: KNNConvOps, mode: str):
        y, ties = ops.pool_forward(plan, x, mode)
        if mode in MAX_POOL_MODES:  # the max and its tie count say which inputs get gradient
            ctx.save_for_backward(x, y, ties)
        ctx.plan, ctx.ops, ctx.mode, ctx.channels_last = plan, ops, mode, is_channels_last(x)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, y, ties = ctx.saved_tensors if ctx.mode in MAX_POOL_MODES else (None, None, None)
        dx = ctx.ops.pool_backward(ctx.plan, grad_y, x, y, ties, ctx.mode, ctx.channels_last)
        return dx, None, None, None


def knn_pool_with_backend(x: torch.Tensor, plan: NeighbourhoodPlan, mode: str = "max",
                          backend: str = "auto") -> tuple[torch.Tensor, str]:
    """KNN pooling of x [B, C, Nin] over a pooling plan's neighbours, in x's dtype and storage
    (autocast does not change it, as for torch's own pooling), and the backend that ran."""
    _check_neighbourhood_plan(plan, pooling=True)
    check_features(x, plan.nin)
    check_mode(mode)
    ops = resolve_backend(backend, plan, x.device, x.dtype, batch=x.shape[0], backward=False)
    if torch.compiler.is_compiling():
        return knn_pool_op(x, plan, ops.name, mode), ops.name
    with _without_autocast(x, _autocasting(x)):
        if torch.is_grad_enabled() and x.requires_grad:
            return KNNPoolFunction.apply(x, plan, ops, mode), ops.name
        return ops.pool_forward(plan, x, mode)[0], ops.name


class KNNDepthwiseFunction(torch.autograd.Function):
    """Differentiable depthwise KNN convolution over any backend that serves it (the eager
    path; under torch.compile the same impls run inside the knnconv custom ops)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: NeighbourhoodPlan, ops: KNNConvOps,
                dtype: torch.dtype):
        need_x, need_w = ctx.needs_input_grad[:2]
        # dx reads only the weight and dW only x: keep what a needed gradient reads
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.plan, ctx.ops, ctx.compute_dtype = plan, ops, dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return depthwise_forward_impl(plan, ops, x, weight, bias, dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grads = depthwise_backward_impl(ctx.plan, ctx.ops, grad_y, x, weight,
                                        ctx.needs_input_grad[:3], ctx.dtypes, ctx.compute_dtype)
        return (*grads, None, None, None)


def validate_depthwise_call(x, weight, bias, plan) -> None:
    """Raise TypeError/ValueError naming the offending argument before any compute."""
    _check_neighbourhood_plan(plan, pooling=False)
    check_tensor("weight", weight)
    if weight.dim() != 2 or weight.shape[1] != plan.v:
        raise ValueError(f"weight must have shape [C, V={plan.v}], got {tuple(weight.shape)}")
    check_features(x, plan.nin, weight.shape[0])
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if bias is not None:
        check_tensor("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape [C] = [{weight.shape[0]}], "
                             f"got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")


def knn_depthwise_conv_with_backend(x, weight, bias, plan: NeighbourhoodPlan,
                                    backend: str = "auto") -> tuple[torch.Tensor, str]:
    """Depthwise KNN convolution, y[b, c, n] = bias[c] + sum_k x[b, c, knn[k, n]] W[c, rf[n, k]]
    (x [B, C, Nin], weight [C, V], bias [C] or None; y [B, C, Nout] contiguous), and the
    backend that ran. The compute dtype follows knn_conv's rule: autocast's where active, else
    x, weight and bias must share one dtype."""
    validate_depthwise_call(x, weight, bias, plan)
    autocasting = _autocasting(x)
    dtype = compute_dtype(x, weight, bias, autocasting)
    grad = torch.is_grad_enabled()
    # only the weight gradient accumulates with atomics (see KNNConvOps.unsupported_reason)
    ops = resolve_backend(backend, plan, x.device, dtype, batch=x.shape[0],
                          backward=grad and weight.requires_grad)
    if torch.compiler.is_compiling():
        return knn_depthwise_op(x, weight, bias, plan, ops.name, dtype), ops.name
    with _without_autocast(x, autocasting):
        if grad and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            return KNNDepthwiseFunction.apply(x, weight, bias, plan, ops, dtype), ops.name
        return depthwise_forward_impl(plan, ops, x, weight, bias, dtype), ops.name
