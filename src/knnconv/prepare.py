"""warm_up: one untimed, uncaptured training step, so that later steps (a CUDA-graph
capture above all) find every kernel compiled and verified and every table built."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def warm_up(module: nn.Module, *example_inputs: torch.Tensor,
            autocast_dtype: torch.dtype | None = None) -> None:
    """Run ``module`` forward and backward once on ``example_inputs`` (the shapes and, with
    ``autocast_dtype``, the autocast the real steps will use), leaving parameters, their
    gradients and the module's train/eval mode as they were."""
    if not example_inputs:
        raise ValueError("warm_up needs at least one example input")
    device_type = example_inputs[0].device.type
    grads = {p: p.grad for p in module.parameters()}
    for parameter in grads:  # the step's gradients go to fresh tensors, the old ones untouched
        parameter.grad = None
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    autocast = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in example_inputs]
    with autocast:
        output = module(*inputs)
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    differentiable = [y for y in outputs if isinstance(y, torch.Tensor) and y.requires_grad]
    if differentiable:
        torch.autograd.backward(differentiable, [torch.ones_like(y) for y in differentiable])
    with torch.no_grad():
        for parameter, grad in grads.items():
            parameter.grad = grad
        for name, buffer in module.named_buffers():
            buffer.copy_(buffers[name])
