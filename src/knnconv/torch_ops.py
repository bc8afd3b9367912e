"""The knnconv custom ops (torch.library), so torch.compile sees every KNN op (convolution,
pooling, depthwise convolution) as an opaque node with a shape function and a registered
backward, and compiles a network of knnconv layers without graph breaks.

Eager calls take the autograd Functions of knnconv.functional (cheaper per call); traced calls
take these ops. Both run the same backend calls (knnconv.ops.execute's impls), so the two paths
compute the same thing. A plan travels through the op schema as its handle, a string
(GeometryPlan.handle).

Also a training batch norm (the router of fovi's KNNBatchNorm calls it while compiling under
the graph_replay setting), so that inductor keeps the kernels an eager call takes instead of
its own reductions.
"""

from __future__ import annotations

import torch

from .ops.execute import (
    backward_impl,
    depthwise_backward_impl,
    depthwise_forward_impl,
    forward_impl,
)
from .ops.registry import MAX_POOL_MODES, empty_in_storage, get_ops, in_storage, is_channels_last
from .plan import GeometryPlan


def _plan(handle: str) -> GeometryPlan:
    return GeometryPlan.from_handle(handle)


# Inductor lays out a compiled graph's buffers from the fake implementations and asserts that
# the real outputs have those strides, so each real output is put in the layout its fake
# promises: y node-major (a transposed view of [B, Nout, Cout], as the built-in backends
# return it; a registered backend may not), gradients contiguous. A no-op where they are.
def _node_major(y: torch.Tensor) -> torch.Tensor:
    if y.transpose(1, 2).is_contiguous():
        return y
    return y.transpose(1, 2).contiguous().transpose(1, 2)


@torch.library.custom_op("knnconv::forward", mutates_args=())
def forward_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: str,
               backend: str, dtype: torch.dtype, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, saved): y [B, Cout, Nout] in ``dtype``; saved, the backend's re-layout of x for the
    backward (empty when the backward uses x itself)."""
    ops = get_ops(backend)
    y, saved_x = forward_impl(_plan(plan), ops, x, weight, bias, dtype, keep)
    # x itself is not returned: the backward takes it from its inputs
    saved = x.new_empty(0) if isinstance(saved_x, torch.Tensor) else ops.saved_tensor(saved_x)
    return _node_major(y), saved


@forward_op.register_fake
def _(x, weight, bias, plan, backend, dtype, keep):
    layer = _plan(plan)
    y = x.new_empty(x.shape[0], layer.nout, layer.cout, dtype=dtype).transpose(1, 2)
    # forward_impl serves an empty batch with x itself, whatever the backend
    keeps_layout = keep and x.shape[0] != 0
    # the strides forward_impl's cast gives x, which decide a backend's path
    layout = get_ops(backend).saved_layout(layer, x.to(dtype), dtype) if keeps_layout else None
    return y, x.new_empty(layout or (0,), dtype=dtype)


@torch.library.custom_op("knnconv::backward", mutates_args=())
def backward_op(grad_y: torch.Tensor, x: torch.Tensor, saved: torch.Tensor,
                weight: torch.Tensor, plan: str, backend: str, dtype: torch.dtype,
                need_x: bool, need_w: bool, bias_dtype: torch.dtype | None,
                dx_channels_last: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) in the dtypes of x, weight and the bias (bias_dtype;
    None when its gradient is not needed); empty where not needed. grad_x in channels-last
    storage when ``dx_channels_last``, else contiguous."""
    layer, ops = _plan(plan), get_ops(backend)
    saved_x = None
    if need_w:
        saved_x = (x.to(dtype) if saved.numel() == 0
                   else ops.saved_input(saved, layer, x.shape[0]))
    need_b = bias_dtype is not None
    grad_x, grad_w, grad_b = backward_impl(layer, ops, grad_y, saved_x, weight,
                                           (need_x, need_w, need_b),
                                           (x.dtype, weight.dtype, bias_dtype), dtype,
                                           dx_channels_last)
    return (grad_x if need_x else x.new_empty(0),
            grad_w.contiguous() if need_w else weight.new_empty(0),
            grad_b if need_b else weight.new_empty(0))


@backward_op.register_fake
def _(grad_y, x, saved, weight, plan, backend, dtype, need_x, need_w, bias_dtype,
      dx_channels_last):
    grad_x = empty_in_storage(tuple(x.shape), dx_channels_last, x.dtype, x.device)
    return (grad_x if need_x else x.new_empty(0),
            weight.new_empty(weight.shape) if need_w else weight.new_empty(0),
            weight.new_empty(_plan(plan).cout, dtype=bias_dtype) if bias_dtype is not None
            else weight.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, bias, plan, backend, dtype, keep = inputs
    saved = output[1]
    # Where the backend's re-layout of x is kept, the backward needs only x's shape and dtype;
    # saving x as well would hold both copies from forward to backward.
    relaid = saved.numel() != 0
    ctx.save_for_backward(None if relaid else x, weight, saved)
    ctx.input_meta = (x.shape, x.dtype) if relaid else None
    ctx.plan, ctx.backend, ctx.dtype = plan, backend, dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.channels_last = is_channels_last(x)


def _backward(ctx, grad_y, _grad_saved):
    x, weight, saved = ctx.saved_tensors
    if x is None:  # backward_op reads only the metadata of x then: one element, expanded
        shape, dtype = ctx.input_meta
        x = saved.new_empty(1, dtype=dtype).expand(shape)
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x, grad_w, grad_b = backward_op(grad_y, x, saved, weight, ctx.plan, ctx.backend,
                                         ctx.dtype, need_x, need_w,
                                         ctx.bias_dtype if need_b else None, ctx.channels_last)
    return (grad_x if need_x else None, grad_w if need_w else None,
            grad_b if need_b else None, None, None, None, None)


forward_op.register_autograd(_backward, setup_context=_setup_context)


def knn_conv_op(x, weight, bias, plan: GeometryPlan, backend: str, dtype: torch.dtype,
                keep_relayout: bool):
    """knn_conv through the custom ops (the traced path of functional.knn_conv).
    keep_relayout: knnconv.context's keep_input_relayout."""
    keep = keep_relayout and weight.requires_grad and torch.is_grad_enabled()
    return forward_op(x, weight, bias, plan.handle, backend, dtype, keep)[0]


@torch.library.custom_op("knnconv::pool_forward", mutates_args=())
def pool_forward_op(x: torch.Tensor, plan: str, backend: str,
                    mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, ties): y [B, C, Nout] in x's dtype and storage; ties as the backend returns them
    for the backward of a max (empty where it returns none)."""
    y, ties = get_ops(backend).pool_forward(_plan(plan), x, mode)
    return y, x.new_empty(0) if ties is None else ties


@pool_forward_op.register_fake
def _(x, plan, backend, mode):
    shape = (x.shape[0], x.shape[1], _plan(plan).nout)
    channels_last = is_channels_last(x)
    y = empty_in_storage(shape, channels_last, x.dtype, x.device)
    ties_dtype = get_ops(backend).pool_ties_dtype(mode)
    ties = x.new_empty(0) if ties_dtype is None else empty_in_storage(
        shape, channels_last, ties_dtype, x.device)
    return y, ties


@torch.library.custom_op("knnconv::pool_backward", mutates_args=())
def pool_backward_op(grad_y: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                     ties: torch.Tensor, plan: str, backend: str, mode: str,
                     channels_last: bool) -> torch.Tensor:
    """dx [B, C, Nin] in grad_y's dtype, channels-last storage when ``channels_last``; x, y and
    ties are read in the MAX_POOL_MODES only (empty otherwise)."""
    kept = ((x, y, ties if ties.numel() else None) if mode in MAX_POOL_MODES
            else (None, None, None))
    dx = get_ops(backend).pool_backward(_plan(plan), grad_y, *kept, mode, channels_last)
    return in_storage(dx, channels_last)


@pool_backward_op.register_fake
def _(grad_y, x, y, ties, plan, backend, mode, channels_last):
    shape = (grad_y.shape[0], grad_y.shape[1], _plan(plan).nin)
    return empty_in_storage(shape, channels_last, grad_y.dtype, grad_y.device)


def _pool_setup_context(ctx, inputs, output):
    x, plan, backend, mode = inputs
    y, ties = output
    if mode in MAX_POOL_MODES:
        ctx.save_for_backward(x, y, ties)
    ctx.plan, ctx.backend, ctx.mode, ctx.channels_last = plan, backend, mode, is_channels_last(x)


def _pool_backward(ctx, grad_y, _grad_ties):
    if ctx.mode in MAX_POOL_MODES:
        x, y, ties = ctx.saved_tensors
    else:
        x = y = ties = grad_y.new_empty(0)
    dx = pool_backward_op(grad_y, x, y, ties, ctx.plan, ctx.backend, ctx.mode,
                          ctx.channels_last)
    return dx, None, None, None


pool_forward_op.register_autograd(_pool_backward, setup_context=_pool_setup_context)


def knn_pool_op(x: torch.Tensor, plan: GeometryPlan, backend: str, mode: str) -> torch.Tensor:
    """knn_pool through the custom ops (the traced path of functional.knn_pool)."""
    return pool_forward_op(x, plan.handle, backend, mode)[0]


@torch.library.custom_op("knnconv::depthwise_forward", mutates_args=())
def depthwise_forward_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         plan: str, backend: str, dtype: torch.dtype) -> torch.Tensor:
    """y [B, C, Nout] contiguous, in ``dtype``."""
    return depthwise_forward_impl(_plan(plan), get_ops(backend), x, weight, bias, dtype)


@depthwise_forward_op.register_fake
def _(x, weight, bias, plan, backend, dtype):
    return x.new_empty(x.shape[0], x.shape[1], _plan(plan).nout, dtype=dtype)


@torch.library.custom_op("knnconv::depthwise_backward", mutates_args=())
def depthwise_backward_op(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          plan: str, backend: str, dtype: torch.dtype, need_x: bool,
                          need_w: bool, bias_dtype: torch.dtype | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) in the dtypes of x, weight and the bias (bias_dtype;
    None when its gradient is not needed); empty where not needed."""
    need_b = bias_dtype is not None
    grad_x, grad_w, grad_b = depthwise_backward_impl(
        _plan(plan), get_ops(backend), grad_y, x, weight, (need_x, need_w, need_b),
        (x.dtype, weight.dtype, bias_dtype), dtype)
    return (grad_x.contiguous() if need_x else x.new_empty(0),
            grad_w.contiguous() if need_w else weight.new_empty(0),
            grad_b if need_b else weight.new_empty(0))


@depthwise_backward_op.register_fake
def _(grad_y, x, weight, plan, backend, dtype, need_x, need_w, bias_dtype):
    return (x.new_empty(x.shape) if need_x else x.new_empty(0),
            weight.new_empty(weight.shape) if need_w else weight.new_empty(0),
            weight.new_empty(weight.shape[0], dtype=bias_dtype) if bias_dtype is not None
            else weight.new_empty(0))


def _depthwise_setup_context(ctx, inputs, output):
    x, weight, bias, plan, backend, dtype = inputs
    ctx.save_for_backward(x, weight)
    ctx.plan, ctx.backend, ctx.dtype = plan, backend, dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _depthwise_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x, grad_w, grad_b = depthwise_backward_op(grad_y, x, weight, ctx.plan, ctx.backend,
                                                   ctx.dtype, need_x, need_w,
                                                   ctx.bias_dtype if need_b else None)
    return (grad_x if need_x else None, grad_w if need_w else None,
            grad_b if need_b else None, None, None, None)


depthwise_forward_op.register_autograd(_depthwise_backward,
                                       setup_context=_depthwise_setup_context)


def knn_depthwise_op(x, weight, bias, plan: GeometryPlan, backend: str,
                     dtype: torch.dtype) -> torch.Tensor:
    """The depthwise convolution through the custom ops (the traced path of
    functional.knn_depthwise_conv)."""
    return depthwise_forward_op(x, weight, bias, plan.handle, backend, dtype)


# Batch norm in training, as the router of fovi's KNNBatchNorm runs it under torch.compile.
# Inductor decomposes torch's batch norm into reductions of its own: in a compiled fovi
# ResNet-18 step they took 2.0 ms at B = 512 and 7.2 ms at B = 2048 where the eager step's
# cuDNN NHWC kernels took 0.72 and 2.4 (bench/NOTES.md, 2026-12-03). As an opaque op the
# batch norm runs on the kernels an eager call takes (torch's _batch_norm_with_update and
# batch_norm_backward: cuDNN on CUDA where it serves, torch's own kernels elsewhere). An op
# with a registered backward may not mutate its inputs: it returns the updated running
# statistics, which the caller copies into its buffers.
@torch.library.custom_op("knnconv::batch_norm_train", mutates_args=())
def batch_norm_train_op(x: torch.Tensor, weight: torch.Tensor | None,
                        bias: torch.Tensor | None, running_mean: torch.Tensor,
                        running_var: torch.Tensor, momentum: float, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor, torch.Tensor]:
    """(y, save_mean, save_invstd, reserve, running_mean, running_var): the batch statistics'
    normalisation of x, y in x's storage, and the running statistics updated by
    ``momentum``."""
    running_mean, running_var = running_mean.clone(), running_var.clone()
    y, mean, invstd, reserve = torch.ops.aten._batch_norm_with_update(
        x, weight, bias, running_mean, running_var, momentum, eps)
    statistics = _statistics_dtype(x)
    return (_in_storage_of(y, x), mean.to(statistics), invstd.to(statistics), reserve,
            running_mean, running_var)


@batch_norm_train_op.register_fake
def _(x, weight, bias, running_mean, running_var, momentum, eps):
    # the reserve's size is cuDNN's, asked of the library by torch's own shape function
    _, _, _, reserve = torch.ops.aten._batch_norm_with_update(
        x, weight, bias, running_mean.clone(), running_var.clone(), momentum, eps)
    statistics = x.new_empty(x.shape[1], dtype=_statistics_dtype(x))
    return (torch.empty_like(x), statistics, torch.empty_like(statistics), reserve,
            torch.empty_like(running_mean), torch.empty_like(running_var))


def _statistics_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the saved batch statistics: float32, float64 for float64 input. (torch's
    kernels save them so; its shape function says the input's dtype for bfloat16 on the CPU.)"""
    return torch.promote_types(x.dtype, torch.float32)


@torch.library.custom_op("knnconv::batch_norm_train_backward", mutates_args=())
def batch_norm_train_backward_op(grad_y: torch.Tensor, x: torch.Tensor,
                                 weight: torch.Tensor | None, save_mean: torch.Tensor,
                                 save_invstd: torch.Tensor, reserve: torch.Tensor, eps: float,
                                 need_x: bool, need_w: bool, need_b: bool
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x in x's storage, grad_weight, grad_bias); empty where not needed."""
    grads = torch.ops.aten.batch_norm_backward(
        grad_y, x, weight, None, None, save_mean, save_invstd, True, eps,
        [need_x, need_w, need_b], reserve)
    return _batch_norm_grads(x, weight, grads, (need_x, need_w, need_b))


@batch_norm_train_backward_op.register_fake
def _(grad_y, x, weight, save_mean, save_invstd, reserve, eps, need_x, need_w, need_b):
    grads = (torch.empty_like(x), None if weight is None else torch.empty_like(weight),
             None if weight is None else torch.empty_like(weight))
    return _batch_norm_grads(x, weight, grads, (need_x, need_w, need_b))


def _in_storage_of(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t with the strides of ``like`` (dense): itself where it has them, else a copy."""
    return t if t.stride() == like.stride() else torch.empty_like(like).copy_(t)


def _batch_norm_grads(x, weight, grads, needs) -> tuple[torch.Tensor, ...]:
    grad_x, grad_w, grad_b = grads
    return (_in_storage_of(grad_x, x) if needs[0] else x.new_empty(0),
            grad_w if needs[1] and weight is not None else x.new_empty(0),
            grad_b if needs[2] and weight is not None else x.new_empty(0))


def _batch_norm_setup_context(ctx, inputs, output):
    x, weight, _, _, _, _, eps = inputs
    _, save_mean, save_invstd, reserve, _, _ = output
    ctx.save_for_backward(x, weight, save_mean, save_invstd, reserve)
    ctx.eps = eps


def _batch_norm_backward(ctx, grad_y, *_statistics_and_reserve):
    x, weight, save_mean, save_invstd, reserve = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x, grad_w, grad_b = batch_norm_train_backward_op(
        grad_y, x, weight, save_mean, save_invstd, reserve, ctx.eps, need_x, need_w, need_b)
    return (grad_x if need_x else None, grad_w if need_w else None,
            grad_b if need_b else None, None, None, None, None)


batch_norm_train_op.register_autograd(_batch_norm_backward,
                                      setup_context=_batch_norm_setup_context)
