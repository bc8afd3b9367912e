import math

import pytest
import torch
from torch import nn

from conftest import random_geometry
from knnconv import KNNDepthwiseConv, KNNDepthwiseSeparableConv
from knnconv.geometry import foveated_stack, knn_geometry


def oracle_depthwise(x, weight, bias, geometry):
    """y[b, c, n] = bias[c] + sum over real slots k of x[b, c, knn[k, n]] * W[c, rf[n, k]], in
    float64 with explicit loops over nodes and slots."""
    x, weight = x.double(), weight.double()
    batch, channels, nin = x.shape
    columns = []
    for node in range(geometry.nout):
        column = x.new_zeros(batch, channels)
        for slot in range(geometry.k):
            neighbour = int(geometry.knn_indices[slot, node])
            if neighbour != nin:
                column = column + x[:, :, neighbour] * weight[:, int(geometry.rf_index[node, slot])]
        columns.append(column)
    y = torch.stack(columns, dim=2)
    return y if bias is None else y + bias.double()[None, :, None]


def depthwise_layer(geometry, channels, **options):
    layer = KNNDepthwiseConv(channels, geometry.knn_indices, geometry.rf_index, nin=geometry.nin,
                             v=geometry.v, **options).double()
    if layer.bias is not None:
        nn.init.normal_(layer.bias)
    return layer


def call_with(layer):
    """The layer as a function of its parameters, for gradcheck."""
    names = [name for name, _ in layer.named_parameters()]
    return lambda x, *values: torch.func.functional_call(layer, dict(zip(names, values,
                                                                         strict=True)), (x,))


@pytest.mark.parametrize("bias", [True, False])
def test_matches_oracle(edge_geometry, rng, bias):
    layer = depthwise_layer(edge_geometry, 3, bias=bias)
    x = torch.randn(2, 3, edge_geometry.nin, generator=rng, dtype=torch.float64)

    y = layer(x)

    assert layer.weight.shape == (3, edge_geometry.v)
    assert y.shape == (2, 3, edge_geometry.nout)
    torch.testing.assert_close(y, oracle_depthwise(x, layer.weight, layer.bias, edge_geometry),
                               rtol=1e-13, atol=1e-13)


def test_gradcheck(rng):
    geometry = random_geometry(rng, nin=11, nout=6, k=4, v=9, padding=0.3, collisions=True)
    layer = depthwise_layer(geometry, 3)
    x = torch.randn(2, 3, 11, generator=rng, dtype=torch.float64, requires_grad=True)

    assert torch.autograd.gradcheck(call_with(layer), (x, *layer.parameters()))


def test_padding_never_reads_a_nan():
    # Two nodes over inputs 0 and 1; their padding slots (index 3) point at cell 1, which no
    # real neighbour uses, and input 2 is read by no node.
    knn_indices = torch.tensor([[0, 1], [3, 3]])
    rf_index = torch.tensor([[0, 1], [0, 1]])
    layer = KNNDepthwiseConv(1, knn_indices, rf_index, nin=3, v=2, bias=False).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[2.0, math.nan]]))
    x = torch.tensor([[[3.0, 5.0, math.nan]]], dtype=torch.float64, requires_grad=True)

    y = layer(x)
    y.sum().backward()

    assert torch.equal(y, torch.tensor([[[6.0, 10.0]]], dtype=torch.float64))
    assert torch.equal(x.grad, torch.tensor([[[2.0, 2.0, 0.0]]], dtype=torch.float64))
    assert torch.equal(layer.weight.grad, torch.tensor([[8.0, 0.0]], dtype=torch.float64))


def test_nan_in_x_reaches_exactly_the_nodes_that_read_it(rng):
    geometry = random_geometry(rng, nin=12, nout=8, k=4, padding=0.25)
    layer = depthwise_layer(geometry, 2)
    x = torch.randn(1, 2, 12, generator=rng, dtype=torch.float64)
    x[0, 0, 7] = math.nan

    y = layer(x)

    assert torch.equal(torch.isnan(y[0, 0]), (geometry.knn_indices == 7).any(dim=0))
    assert torch.isfinite(y[0, 1]).all()


def test_separable_is_depthwise_then_pointwise(edge_geometry, rng):
    layer = KNNDepthwiseSeparableConv(3, 5, edge_geometry.knn_indices, edge_geometry.rf_index,
                                      nin=edge_geometry.nin, v=edge_geometry.v).double()
    x = torch.randn(2, 3, edge_geometry.nin, generator=rng, dtype=torch.float64)

    y = layer(x)

    depthwise = oracle_depthwise(x, layer.depthwise.weight, None, edge_geometry)
    expected = (torch.einsum("oc,bcn->bon", layer.pointwise.weight, depthwise)
                + layer.pointwise.bias[None, :, None])
    assert layer.depthwise.weight.shape == (3, edge_geometry.v)
    assert layer.depthwise.bias is None
    assert layer.pointwise.weight.shape == (5, 3)
    assert y.shape == (2, 5, edge_geometry.nout)
    torch.testing.assert_close(y, expected, rtol=1e-13, atol=1e-13)


def test_separable_gradcheck(rng):
    geometry = random_geometry(rng, nin=9, nout=5, k=3, v=4, padding=0.2)
    layer = KNNDepthwiseSeparableConv(2, 3, geometry.knn_indices, geometry.rf_index, nin=9,
                                      v=4).double()
    x = torch.randn(2, 2, 9, generator=rng, dtype=torch.float64, requires_grad=True)

    assert torch.autograd.gradcheck(call_with(layer), (x, *layer.parameters()))


def test_from_coords_builds_the_tables_and_parameters():
    in_coords, out_coords = foveated_stack(resolution=12, levels=2)
    knn_indices, rf_index, v = knn_geometry(in_coords, out_coords, 9)

    layer = KNNDepthwiseConv.from_coords(4, in_coords, out_coords, 9)
    separable = KNNDepthwiseSeparableConv.from_coords(4, 6, in_coords, out_coords, 9, bias=False)

    assert torch.equal(layer.knn_indices, knn_indices)
    assert layer.v == v and layer.weight.shape == (4, v)
    assert separable.pointwise.bias is None
    assert set(layer.state_dict()) == {"weight", "bias"}
    assert separable(torch.randn(2, 4, len(in_coords))).shape == (2, 6, len(out_coords))


def test_kaiming_init_uses_the_neighbour_count(rng):
    geometry = random_geometry(rng, nin=30, nout=20, k=9, v=25)
    layer = KNNDepthwiseConv(400, geometry.knn_indices, geometry.rf_index, nin=30, v=25)

    assert layer.weight.std().item() == pytest.approx(math.sqrt(2 / 9), rel=0.05)
    assert torch.equal(layer.bias, torch.zeros(400))


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda g: KNNDepthwiseConv(0, g.knn_indices, g.rf_index, nin=g.nin, v=g.v), ValueError,
     "channels must be >= 1"),
    (lambda g: KNNDepthwiseConv(2, g.knn_indices, g.rf_index + g.v, nin=g.nin, v=g.v),
     ValueError, "rf_index entries must lie in"),
    (lambda g: KNNDepthwiseConv(2, g.knn_indices + 1, g.rf_index, nin=g.nin - 1, v=g.v),
     ValueError, "knn_indices entries must lie in"),
    (lambda g: KNNDepthwiseConv(2, g.knn_indices, g.rf_index.t(), nin=g.nin, v=g.v),
     ValueError, "one of them is transposed"),
    (lambda g: KNNDepthwiseConv(2, g.knn_indices, g.rf_index, nin=g.nin, v=g.v)(
        torch.randn(1, 3, g.nin)), ValueError, r"x must have shape \[B, C=2, Nin="),
    (lambda g: KNNDepthwiseSeparableConv(2, 0, g.knn_indices, g.rf_index, nin=g.nin, v=g.v),
     ValueError, "out_channels must be >= 1"),
])
def test_invalid_arguments_are_named(rng, call, error, message):
    geometry = random_geometry(rng, nin=8, nout=5, k=6)

    with pytest.raises(error, match=message):
        call(geometry)


def test_backend_choice_is_visible_and_cuda_never_falls_back(rng):
    geometry = random_geometry(rng, nin=20, nout=6, k=4)
    layer = KNNDepthwiseConv(3, geometry.knn_indices, geometry.rf_index, nin=20, v=geometry.v)
    layer(torch.randn(2, 3, 20))
    assert layer.last_backend == "torch_compact"
    explicit = KNNDepthwiseConv(3, geometry.knn_indices, geometry.rf_index, nin=20,
                                v=geometry.v, backend="cuda")
    with pytest.raises(ValueError, match="backend 'cuda' cannot run this call: needs CUDA"):
        explicit(torch.randn(2, 3, 20))
    with pytest.raises(ValueError, match="unknown backend 'native'"):
        KNNDepthwiseSeparableConv(3, 4, geometry.knn_indices, geometry.rf_index, nin=20,
                                  v=geometry.v, backend="native")


def test_more_kernel_cells_than_the_native_weight_gradient_holds_is_refused():
    knn_indices = torch.tensor([[0, 1]])
    rf_index = torch.tensor([[0], [13_000]])
    layer = KNNDepthwiseConv(2, knn_indices, rf_index, nin=2, v=13_001, backend="cuda")
    with pytest.raises(ValueError, match="13001 kernel cells"):
        layer(torch.randn(1, 2, 2))
    layer.backend = "auto"
    layer(torch.randn(1, 2, 2))
    assert layer.last_backend == "torch_compact"


def test_dtype_rule_is_knn_convs(rng):
    # autocast's dtype where active, else one common dtype, as for KNNConv
    geometry = random_geometry(rng, nin=20, nout=6, k=4)
    layer = KNNDepthwiseConv(3, geometry.knn_indices, geometry.rf_index, nin=20, v=geometry.v)
    x = torch.randn(2, 3, 20, generator=rng, dtype=torch.float64)
    with pytest.raises(TypeError, match="weight has dtype torch.float32 but x has torch.float64"):
        layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x.float().requires_grad_())
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32  # master weights get their own dtype
