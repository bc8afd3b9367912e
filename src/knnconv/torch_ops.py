"""The knnconv custom ops (torch.library), so torch.compile sees KNN convolution as opaque
nodes with shape functions and a registered backward, and compiles a network of KNNConv
layers without graph breaks.

Eager calls take KNNConvFunction (cheaper per call); traced calls take these ops. Both run
knnconv.ops.execute's forward_impl / backward_impl, so the two paths compute the same thing.
A plan travels through the op schema as its handle, a string (KNNConvPlan.handle).
"""

from __future__ import annotations

import torch

from .ops.execute import backward_impl, forward_impl
from .ops.registry import get_ops
from .plan import KNNConvPlan


def _plan(handle: str) -> KNNConvPlan:
    return KNNConvPlan.from_handle(handle)


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
    layout = get_ops(backend).saved_layout(layer, x.shape[0], dtype) if keeps_layout else None
    return y, x.new_empty(layout or (0,), dtype=dtype)


@torch.library.custom_op("knnconv::backward", mutates_args=())
def backward_op(grad_y: torch.Tensor, x: torch.Tensor, saved: torch.Tensor,
                weight: torch.Tensor, plan: str, backend: str, dtype: torch.dtype,
                need_x: bool, need_w: bool, bias_dtype: torch.dtype | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) in the dtypes of x, weight and the bias (bias_dtype;
    None when its gradient is not needed); empty where not needed."""
    layer, ops = _plan(plan), get_ops(backend)
    saved_x = None
    if need_w:
        saved_x = (x.to(dtype) if saved.numel() == 0
                   else ops.saved_input(saved, layer, x.shape[0]))
    need_b = bias_dtype is not None
    grad_x, grad_w, grad_b = backward_impl(layer, ops, grad_y, saved_x, weight,
                                           (need_x, need_w, need_b),
                                           (x.dtype, weight.dtype, bias_dtype), dtype)
    return (grad_x.contiguous() if need_x else x.new_empty(0),
            grad_w.contiguous() if need_w else weight.new_empty(0),
            grad_b if need_b else weight.new_empty(0))


@backward_op.register_fake
def _(grad_y, x, saved, weight, plan, backend, dtype, need_x, need_w, bias_dtype):
    return (x.new_empty(x.shape) if need_x else x.new_empty(0),
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


def _backward(ctx, grad_y, _grad_saved):
    x, weight, saved = ctx.saved_tensors
    if x is None:  # backward_op reads only the metadata of x then: one element, expanded
        shape, dtype = ctx.input_meta
        x = saved.new_empty(1, dtype=dtype).expand(shape)
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x, grad_w, grad_b = backward_op(grad_y, x, saved, weight, ctx.plan, ctx.backend,
                                         ctx.dtype, need_x, need_w,
                                         ctx.bias_dtype if need_b else None)
    return (grad_x if need_x else None, grad_w if need_w else None,
            grad_b if need_b else None, None, None, None, None)


forward_op.register_autograd(_backward, setup_context=_setup_context)


def knn_conv_op(x, weight, bias, plan: KNNConvPlan, backend: str, dtype: torch.dtype,
                keep_relayout: bool):
    """knn_conv through the custom ops (the traced path of functional.knn_conv).
    keep_relayout: knnconv.context's keep_input_relayout."""
    keep = keep_relayout and weight.requires_grad and torch.is_grad_enabled()
    return forward_op(x, weight, bias, plan.handle, backend, dtype, keep)[0]
