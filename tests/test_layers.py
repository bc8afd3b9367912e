import math

import pytest
import torch
from torch import nn

from conftest import oracle_knn_conv, random_geometry, rel_err
from knnconv import KNNConv


def make_layer(geometry, cin, cout, **options):
    return KNNConv(cin, cout, geometry.knn_indices, geometry.rf_index, nin=geometry.nin,
                   v=geometry.v, **options)


def test_shapes_and_output(rng):
    geometry = random_geometry(rng, nin=13, nout=7, k=4, v=9, padding=0.2)
    layer = make_layer(geometry, 3, 5).double()
    nn.init.normal_(layer.bias)
    x = torch.randn(2, 3, 13, generator=rng, dtype=torch.float64)

    y = layer(x)

    assert layer.weight.shape == (5, 27)
    assert layer.bias.shape == (5,)
    assert y.shape == (2, 5, 7)
    assert rel_err(y, oracle_knn_conv(x, layer.weight, layer.bias, geometry)) < 1e-13


def test_no_bias(rng):
    layer = make_layer(random_geometry(rng), 2, 3, bias=False)

    assert layer.bias is None
    assert "bias" not in layer.state_dict()


def test_kaiming_init_uses_real_fan_in(rng):
    cin, k = 64, 9
    layer = make_layer(random_geometry(rng, nin=20, nout=4, k=k, v=25), cin, 128)

    # V = 25 cells but only K = 9 neighbours feed each output: fan-in is Cin*K.
    expected_std = math.sqrt(2.0 / (cin * k))
    assert layer.weight.std().item() == pytest.approx(expected_std, rel=0.02)
    assert abs(layer.weight.mean().item()) < 0.02 * expected_std
    assert torch.equal(layer.bias, torch.zeros(128))


def test_state_dict_round_trip(rng):
    geometry = random_geometry(rng, padding=0.1)
    trained = make_layer(geometry, 3, 4)
    nn.init.normal_(trained.bias)
    fresh = make_layer(geometry, 3, 4)
    x = torch.randn(2, 3, geometry.nin, generator=rng)
    assert not torch.equal(fresh(x), trained(x))

    fresh.load_state_dict(trained.state_dict())

    assert torch.equal(fresh(x), trained(x))


@pytest.mark.parametrize(("backend", "expected"), [("auto", "torch_binned"),  # CPU, B = 1
                                                   ("reference", "reference")])
def test_last_backend_and_repr(rng, backend, expected):
    geometry = random_geometry(rng, nin=13, nout=7, k=4, v=9)
    layer = make_layer(geometry, 3, 5, backend=backend)
    assert layer.last_backend is None

    layer(torch.randn(1, 3, 13, generator=rng))

    assert layer.last_backend == expected
    text = repr(layer)
    for part in ("3, 5", "nin=13", "nout=7", "k=4", "v=9", f"backend={backend!r}",
                 f"last_backend={expected!r}"):
        assert part in text


@pytest.mark.parametrize("conv_bias", [True, False])
def test_load_conv2d_weights_on_matching_grid(rng, conv_bias):
    layer = make_layer(random_geometry(rng, k=4, v=9), 3, 5)
    nn.init.normal_(layer.bias)
    conv = nn.Conv2d(3, 5, 3, bias=conv_bias)

    layer.load_conv2d_weights(conv)

    assert torch.equal(layer.weight, conv.weight.detach().reshape(5, 27))
    expected_bias = conv.bias if conv_bias else torch.zeros(5)
    assert torch.equal(layer.bias, expected_bias)


@pytest.mark.parametrize("conv", [nn.Conv2d(4, 5, 3), nn.Conv2d(3, 6, 3)], ids=["cin", "cout"])
def test_load_conv2d_weights_rejects_wrong_channels(rng, conv):
    layer = make_layer(random_geometry(rng, v=9), 3, 5)

    with pytest.raises(ValueError, match="conv2d has weight"):
        layer.load_conv2d_weights(conv)


@pytest.mark.parametrize("conv", [nn.Conv2d(6, 6, 3, groups=2), nn.Conv2d(3, 6, 3, dilation=2)],
                         ids=["grouped", "dilated"])
def test_load_conv2d_weights_refuses_grouped_and_dilated_convs(rng, conv):
    # a grouped conv's [6, 3, 3, 3] weight has the shape of a dense 3 -> 6 one
    layer = make_layer(random_geometry(rng, v=9), 3, 6)

    with pytest.raises(ValueError, match="dense, undilated"):
        layer.load_conv2d_weights(conv)


def test_an_unknown_backend_is_refused_when_the_layer_is_built(rng):
    with pytest.raises(ValueError, match="unknown backend"):
        make_layer(random_geometry(rng, v=9), 3, 5, backend="cdua")


def test_ref_side_needs_square_v(rng):
    layer = make_layer(random_geometry(rng, k=4, v=8), 3, 5)

    with pytest.raises(ValueError, match="V = 8 is not a square"):
        layer.load_conv2d_weights(nn.Conv2d(3, 5, 3))


def test_from_coords_on_a_grid_equals_conv2d(rng):
    """On a regular grid, a 3x3 KNN conv with Conv2d weights is that Conv2d (valid region)."""
    side = 5
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    in_coords = torch.stack([cols.flatten(), rows.flatten()], dim=1).double()  # (x, y)
    interior = (rows[1:-1, 1:-1].flatten() * side + cols[1:-1, 1:-1].flatten())
    conv = nn.Conv2d(2, 4, 3).double()
    layer = KNNConv.from_coords(2, 4, in_coords, in_coords[interior], k=9).double()
    image = torch.randn(3, 2, side, side, generator=rng, dtype=torch.float64)

    y = layer.load_conv2d_weights(conv)(image.flatten(2))

    assert layer.plan.v == 9
    expected = conv(image).flatten(2)
    assert rel_err(y, expected) < 1e-13
