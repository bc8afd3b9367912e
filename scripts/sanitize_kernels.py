"""Run every kernel family (the convolution's and depthwise convolution's of the cuda and
triton backends, and the cuda backend's pooling) once per edge shape, for compute-sanitizer
(memcheck, racecheck, initcheck, synccheck). Exits non-zero if any result disagrees with the
float64 reference.

    compute-sanitizer --tool memcheck python scripts/sanitize_kernels.py
"""

from __future__ import annotations

import copy
import sys

import torch

import knnconv
from knnconv.ops import cuda as knn_cuda
from knnconv.tools.bench import relative_error
from knnconv.tools.cli import worst

EDGE_SHAPES = [  # (batch, cin, cout, nin, nout, k, v, padding)
    (1, 3, 1, 10, 1, 1, 1, 0.0),
    (17, 5, 63, 40, 7, 9, 36, 0.3),
    (129, 64, 65, 30, 3, 9, 9, 0.8),
    (33, 3, 130, 4, 5, 8, 9, 0.0),  # K > Nin: padding slots
    (64, 8, 34, 200, 96, 9, 9, 0.2),  # even strides, wide extents: transpose_pairs
    (17, 16, 32, 40, 9, 9, 9, 0.3),  # channels multiples of 16: the channels-last kernels
    (65, 64, 48, 30, 1, 7, 25, 0.5),
    (33, 3, 72, 40, 11, 25, 16, 0.2),  # an image layer: dW reads channels-last grad_y
    (129, 96, 64, 30, 5, 9, 9, 0.3),  # on Hopper, the warpgroup-MMA gather both ways
    (33, 3, 64, 300, 40, 49, 196, 0.1),  # stems: triton's few-channel kernels, one row block
    (17, 3, 96, 200, 9, 121, 121, 0.05),  # and K * 4 channel slots over two row blocks
]


def random_tables(nin, nout, k, v, padding, generator):
    """knn [K, Nout] with the given padding fraction (and every slot past Nin padded), and
    rf [Nout, K]."""
    knn = torch.randint(0, nin, (k, nout), generator=generator)
    knn[torch.rand(k, nout, generator=generator) < padding] = nin
    knn[min(k, nin):] = nin
    return knn, torch.randint(0, v, (nout, k), generator=generator)


def run_case(batch, cin, cout, nin, nout, k, v, padding, dtype, generator) -> float:
    knn, rf = random_tables(nin, nout, k, v, padding, generator)
    plan = knnconv.make_plan(knn, rf, nin=nin, v=v, cin=cin, cout=cout)
    tables = plan.on("cuda")
    x = torch.randn(batch, cin, nin, generator=generator).to("cuda", dtype)
    weight = torch.randn(cout, plan.q, generator=generator).to("cuda", dtype)
    grad_y = torch.randn(batch, cout, nout, generator=generator).to("cuda", dtype)
    il, wl = tables.input_linear, tables.weight_linear
    reverse = knn_cuda.reverse_tables(tables.knn_indices, tables.rf_index, nin)
    y, saved = knn_cuda.forward(x, weight, None, il, wl, poison_output=True,
                                return_transposed=True)
    dx, dw = knn_cuda.backward(grad_y, saved, weight, il, wl, reverse, cin, nin, plan.q,
                               input_algorithm="gather")
    dx_scattered = knn_cuda.grad_input(grad_y, weight, il, wl, cin, nin)
    # Through autograd dx has the compute dtype, which a gathered dx (the shapes with 16 or
    # more input channels; the others scatter) is staged in.
    leaf = x.clone().requires_grad_()
    knnconv.knn_conv(leaf, weight, None, plan, "cuda").backward(grad_y)
    # x and grad_y in channels-last storage, as KNN layers pass them on: the channels-last
    # kernels where the channel counts allow
    leaf_cl = x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    weight_cl = weight.clone().requires_grad_()
    grad_y_cl = grad_y.transpose(1, 2).contiguous().transpose(1, 2)
    knnconv.knn_conv(leaf_cl, weight_cl, None, plan, "cuda").backward(grad_y_cl)
    # the same on Hopper's warpgroup-MMA gather, where its tiles fit (elsewhere as above)
    leaf_wgmma = leaf_cl.detach().clone().requires_grad_()
    with knnconv.context.using(warpgroup_mma=True):
        y_wgmma = knnconv.knn_conv(leaf_wgmma, weight, None, plan, "cuda")
        y_wgmma.backward(grad_y_cl)
    # x without a gradient (an image): dW alone, reading channels-last grad_y where it can
    weight_image = weight.clone().requires_grad_()
    knnconv.knn_conv(x, weight_image, None, plan, "cuda").backward(grad_y_cl)
    reference = knnconv.get_ops("reference")
    y_ref = reference.forward(plan, x.double(), weight.double(), None)
    dx_ref, dw_ref = reference.backward_combined(plan, grad_y.double(), x.double(),
                                                 weight.double())
    return worst([relative_error(a, b) for a, b in
                  ((y, y_ref), (y_wgmma.detach(), y_ref), (leaf_wgmma.grad, dx_ref),
                   (dx, dx_ref), (dx_scattered, dx_ref), (leaf.grad, dx_ref),
                   (dw, dw_ref), (leaf_cl.grad, dx_ref), (weight_cl.grad, dw_ref),
                   (weight_image.grad, dw_ref))])


def run_triton_case(batch, cin, cout, nin, nout, k, v, padding, dtype, generator) -> float:
    """The triton backend's TMA kernels (forward, dx, dW) on one shape, where they serve, with
    x in channels-last storage and contiguous; 0 where they do not."""
    knn, rf = random_tables(nin, nout, k, v, padding, generator)
    plan = knnconv.make_plan(knn, rf, nin=nin, v=v, cin=cin, cout=cout)
    if knnconv.get_ops("triton").unsupported_reason(plan, torch.device("cuda"), dtype):
        return 0.0
    x = torch.randn(batch, cin, nin, generator=generator).to("cuda", dtype)
    weight = torch.randn(cout, plan.q, generator=generator).to("cuda", dtype)
    grad_y = torch.randn(batch, cout, nout, generator=generator).to("cuda", dtype)
    reference = knnconv.get_ops("reference")
    y_ref = reference.forward(plan, x.double(), weight.double(), None)
    dx_ref, dw_ref = reference.backward_combined(plan, grad_y.double(), x.double(),
                                                 weight.double())
    errors = []
    for leaf in (x.clone(), x.transpose(1, 2).contiguous().transpose(1, 2)):
        leaf.requires_grad_()
        w = weight.clone().requires_grad_()
        y = knnconv.knn_conv(leaf, w, None, plan, "triton")
        y.backward(grad_y)
        errors += [relative_error(a, b) for a, b in ((y.detach(), y_ref), (leaf.grad, dx_ref),
                                                      (w.grad, dw_ref))]
    return worst(errors)


def run_neighbourhood_case(batch, cin, cout, nin, nout, k, v, padding, dtype,
                           generator) -> float:
    """The pooling (every mode) and depthwise kernels (the cuda backend's, and the triton
    backend's where it serves), forward and backward, on one shape."""
    knn, rf = random_tables(nin, nout, k, v, padding, generator)
    x = torch.randn(batch, cin, nin, generator=generator).to(dtype)
    grad_y = torch.randn(batch, cin, nout, generator=generator).to(dtype)
    errors = []
    cases = [(knnconv.KNNPool(knn, nin=nin, mode=mode), "cuda") for mode in ("max", "avg", "sum")]
    depthwise = knnconv.KNNDepthwiseConv(cin, knn, rf, nin=nin, v=v)
    cases.append((depthwise, "cuda"))
    if not knnconv.get_ops("triton").unsupported_reason(depthwise.plan, torch.device("cuda"),
                                                        dtype):
        cases.append((copy.deepcopy(depthwise), "triton"))
    for layer, backend in cases:
        native = layer.to("cuda", dtype)
        native.backend = backend
        reference = copy.deepcopy(native).to("cpu", torch.float64)  # the rounded weights
        reference.backend = "torch_compact"
        results = []
        for module, inputs, grad in ((native, x.cuda(), grad_y.cuda()),
                                     (reference, x.double(), grad_y.double())):
            inputs = inputs.requires_grad_()
            module(inputs).backward(grad)
            results.append([module(inputs.detach()).detach(), inputs.grad,
                            *(p.grad for p in module.parameters())])
        errors += [relative_error(a.cpu(), b) for a, b in zip(*results, strict=True)]
    return worst(errors)


def main() -> int:
    generator = torch.Generator().manual_seed(0)
    errors = []
    for dtype in (torch.float16, torch.bfloat16):
        for shape in EDGE_SHAPES:
            errors.append(worst([run_case(*shape, dtype, generator),
                                 run_triton_case(*shape, dtype, generator),
                                 run_neighbourhood_case(*shape, dtype, generator)]))
            print(f"{str(dtype):15} {shape}: max relative error {errors[-1]:.2e}")
    torch.cuda.synchronize()
    print(f"worst relative error {worst(errors):.2e}")
    return 0 if worst(errors) <= 1e-2 else 1  # a NaN fails


if __name__ == "__main__":
    sys.exit(main())
