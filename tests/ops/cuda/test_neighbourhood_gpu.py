"""The native pooling and depthwise kernels against the float64 torch-ops path (marker: gpu).

The float64 path is itself checked against explicit-loop oracles on the CPU (test_pool.py,
test_depthwise.py); here both run on the same rounded inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import random_geometry, rel_err, with_all_padding_node
from knnconv import KNNDepthwiseConv, KNNDepthwiseSeparableConv, KNNPool, knn_pool

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

DEVICE = torch.device("cuda")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SIZES = ((1, 3), (17, 5), (129, 2))


# Output nodes: many, the last with no real neighbour; or one (a grid of one CTA column, the
# reversed graph of one node), with real neighbours.
NODES = (25, 1)


def table_with_all_padding_node(seed: int, *, nout: int, **knobs):
    """A random geometry and its table, whose last node has no real neighbour where there
    are several nodes."""
    geometry = random_geometry(torch.Generator().manual_seed(seed), nout=nout, **knobs)
    return geometry, with_all_padding_node(geometry) if nout > 1 else geometry.knn_indices


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["max", "avg", "sum"])
@pytest.mark.parametrize("batch,channels", SIZES)
@pytest.mark.parametrize("nout", NODES)
def test_pool_matches_float64(dtype, mode, batch, channels, nout):
    _, knn = table_with_all_padding_node(batch * 7 + channels, nin=60, nout=nout, k=7,
                                         padding=0.2)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, channels, 60, generator=generator).to(dtype)
    grad_y = torch.randn(batch, channels, nout, generator=generator).to(dtype)
    pool = KNNPool(knn, nin=60, mode=mode, backend="cuda").to(DEVICE)
    native_x = x.to(DEVICE).requires_grad_()
    y = pool(native_x)
    y.backward(grad_y.to(DEVICE))
    assert pool.last_backend == "cuda" and y.dtype == dtype
    x64 = x.double().requires_grad_()
    y64 = knn_pool(x64, knn, 60, mode, backend="torch")
    y64.backward(grad_y.double())
    assert rel_err(y.cpu(), y64) < TOLERANCE[dtype]
    assert rel_err(native_x.grad.cpu(), x64.grad) < TOLERANCE[dtype]
    if nout > 1:
        assert torch.equal(y[:, :, -1].cpu(), torch.zeros(batch, channels, dtype=dtype))


def test_pool_ties_share_the_gradient_and_nan_propagates_like_torch():
    knn = torch.tensor([[0, 1], [1, 2], [2, 3]])  # K = 3, Nout = 2, Nin = 4
    x = torch.tensor([[[1.0, 3.0, 3.0, float("nan")]]])
    native_x = x.to(DEVICE).requires_grad_()
    y = knn_pool(native_x, knn, 4, "max", backend="cuda")
    y.backward(torch.ones_like(y))
    expected = knn_pool(x, knn, 4, "max", backend="torch")
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(expected))
    assert y[0, 0, 0].item() == 3.0
    # the tied maxima share node 0's gradient; the NaN node sends none
    assert torch.equal(native_x.grad.cpu()[0, 0], torch.tensor([0.0, 0.5, 0.5, 0.0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,channels", SIZES)
@pytest.mark.parametrize("collisions", [False, True])
@pytest.mark.parametrize("nout", NODES)
def test_depthwise_matches_float64(dtype, batch, channels, collisions, nout):
    generator = torch.Generator().manual_seed(batch + channels)
    geometry, knn = table_with_all_padding_node(
        batch + 3 * channels, nin=60, nout=nout, k=7, v=9, padding=0.2, collisions=collisions)
    layer = KNNDepthwiseConv(channels, knn, geometry.rf_index, nin=60, v=9, backend="cuda")
    nn.init.normal_(layer.bias)
    reference = copy.deepcopy(layer).double()
    reference.backend = "torch"
    layer.to(DEVICE, dtype)
    x = torch.randn(batch, channels, 60, generator=generator).to(dtype)
    grad_y = torch.randn(batch, channels, nout, generator=generator).to(dtype)
    native_x = x.to(DEVICE).requires_grad_()
    y = layer(native_x)
    y.backward(grad_y.to(DEVICE))
    assert layer.last_backend == "cuda" and y.dtype == dtype
    x64 = x.double().requires_grad_()
    reference.weight.data.copy_(layer.weight.detach().double())
    reference.bias.data.copy_(layer.bias.detach().double())
    reference(x64).backward(grad_y.double())
    y64 = reference(x64.detach())
    tolerance = TOLERANCE[dtype]
    assert rel_err(y.cpu(), y64) < tolerance
    for got, expected in ((native_x.grad, x64.grad), (layer.weight.grad, reference.weight.grad),
                          (layer.bias.grad, reference.bias.grad)):
        assert got.dtype == dtype
        assert rel_err(got.cpu(), expected) < tolerance


@pytest.mark.parametrize("frozen", ["x", "weight"])
def test_depthwise_computes_only_the_needed_gradients(frozen, monkeypatch):
    from knnconv.ops.cuda import neighbourhood

    launched = []
    for name in ("depthwise_grad_input", "depthwise_grad_weight"):
        kernel = getattr(neighbourhood, name)
        monkeypatch.setattr(neighbourhood, name, lambda *args, kernel=kernel, name=name, **kw: (
            launched.append(name), kernel(*args, **kw))[1])
    geometry = random_geometry(torch.Generator().manual_seed(11), nin=40, nout=12, k=5)
    layer = KNNDepthwiseConv(4, geometry.knn_indices, geometry.rf_index, nin=40, v=geometry.v,
                             backend="cuda").to(DEVICE)
    reference = copy.deepcopy(layer).double()
    reference.backend = "torch"
    x = torch.randn(9, 4, 40, device=DEVICE)
    grad_y = torch.randn(9, 4, 12, device=DEVICE)
    native_x, x64 = x.clone(), x.double()
    if frozen == "weight":
        for module in (layer, reference):
            module.weight.requires_grad_(False)
        native_x.requires_grad_(), x64.requires_grad_()
    layer(native_x).backward(grad_y)
    reference(x64).backward(grad_y.double())
    if frozen == "x":
        assert native_x.grad is None
        assert rel_err(layer.weight.grad, reference.weight.grad) < 1e-5
        assert launched == ["depthwise_grad_weight"]
    else:
        assert layer.weight.grad is None
        assert rel_err(native_x.grad, x64.grad) < 1e-5
        assert launched == ["depthwise_grad_input"]


def test_depthwise_under_autocast_promotes_like_torch_ops():
    geometry = random_geometry(torch.Generator().manual_seed(5), nin=40, nout=12, k=5)
    layer = KNNDepthwiseSeparableConv(4, 6, geometry.knn_indices, geometry.rf_index, nin=40,
                                      v=geometry.v).to(DEVICE)
    x = torch.randn(9, 4, 40, device=DEVICE, dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        native, native_depthwise = layer(x), layer.depthwise(x)
        native_backend = layer.depthwise.last_backend
        layer.depthwise.backend = "torch"
        expected, expected_depthwise = layer(x), layer.depthwise(x)
    assert native_backend == "cuda" and native.dtype == expected.dtype
    # The separable layer's Linear returns fp16 under autocast whatever the depthwise part
    # computed in: the depthwise output itself must match torch ops' dtype.
    assert native_depthwise.dtype == expected_depthwise.dtype
    assert rel_err(native, expected) < 2e-3


def test_depthwise_auto_serves_dtypes_it_promotes_to_with_torch_ops():
    # A float32 input into a float64 layer computes in float64, which the kernels lack:
    # auto takes torch ops (deciding on x's dtype alone sent it to the kernels, which failed).
    geometry = random_geometry(torch.Generator().manual_seed(12), nin=40, nout=12, k=5)
    layer = KNNDepthwiseConv(4, geometry.knn_indices, geometry.rf_index, nin=40,
                             v=geometry.v).to(DEVICE, torch.float64)
    y = layer(torch.randn(3, 4, 40, device=DEVICE))
    assert layer.last_backend == "torch" and y.dtype == torch.float64


def test_determinism_rules():
    geometry = random_geometry(torch.Generator().manual_seed(6), nin=40, nout=12, k=5)
    x = torch.randn(33, 8, 40, device=DEVICE, requires_grad=True)
    pool = KNNPool(geometry.knn_indices, nin=40, mode="avg").to(DEVICE)
    grads = []
    for _ in range(2):
        x.grad = None
        pool(x).square().sum().backward()
        grads.append(x.grad.clone())
    assert pool.last_backend == "cuda" and torch.equal(*grads)  # a gather: no atomics
    layer = KNNDepthwiseConv(8, geometry.knn_indices, geometry.rf_index, nin=40, v=geometry.v,
                             backend="cuda").to(DEVICE)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(ValueError, match="backend='torch'"):
            layer(x)
        with torch.no_grad():  # no weight gradient, no atomics: the native kernels serve it
            layer(x)
        assert layer.last_backend == "cuda"
        layer.weight.requires_grad_(False)  # a trainable bias alone: a torch sum, no atomics
        layer(x).sum().backward()
        assert layer.last_backend == "cuda" and layer.bias.grad is not None
        layer.weight.requires_grad_(True)
        layer.backend = "auto"
        layer(x)
        assert layer.last_backend == "torch"
    finally:
        torch.use_deterministic_algorithms(previous)


def test_empty_batch():
    geometry = random_geometry(torch.Generator().manual_seed(7), nin=40, nout=12, k=5)
    pool = KNNPool(geometry.knn_indices, nin=40).to(DEVICE)
    layer = KNNDepthwiseConv(3, geometry.knn_indices, geometry.rf_index, nin=40,
                             v=geometry.v).to(DEVICE)
    x = torch.randn(0, 3, 40, device=DEVICE, requires_grad=True)
    assert pool(x).shape == (0, 3, 12) and pool.last_backend == "cuda"
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 3, 12) and torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))
