import math

import numpy as np
import pytest
import torch

from conftest import random_geometry, with_all_padding_node
from knnconv import KNNPool, knn_pool
from knnconv.geometry import foveated_stack, knn_geometry

MODES = ["max", "avg", "sum", "max_relu"]


def oracle_pool(x, knn_indices, nin, mode):
    """The pooling formula in float64 with explicit loops over nodes and real neighbours."""
    x = x.double()
    batch, channels, _ = x.shape
    k, nout = knn_indices.shape
    y = torch.zeros(batch, channels, nout, dtype=torch.float64)
    for node in range(nout):
        real = [int(knn_indices[slot, node]) for slot in range(k)
                if int(knn_indices[slot, node]) != nin]
        if not real:
            continue
        values = x[:, :, real]  # [B, C, real neighbours]
        if mode == "max":
            y[:, :, node] = values.max(dim=2).values
        elif mode == "max_relu":
            y[:, :, node] = values.max(dim=2).values.clamp_min(0)
        elif mode == "sum":
            y[:, :, node] = values.sum(dim=2)
        else:
            y[:, :, node] = values.sum(dim=2) / len(real)
    return y


@pytest.mark.parametrize("mode", MODES)
def test_matches_oracle(edge_geometry, mode, rng):
    x = torch.randn(3, 4, edge_geometry.nin, generator=rng, dtype=torch.float64)

    expected = oracle_pool(x, edge_geometry.knn_indices, edge_geometry.nin, mode)
    functional = knn_pool(x, edge_geometry.knn_indices, edge_geometry.nin, mode)
    layer = KNNPool(edge_geometry.knn_indices, nin=edge_geometry.nin, mode=mode)

    torch.testing.assert_close(functional, expected, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(layer(x), expected, rtol=1e-14, atol=1e-14)
    assert functional.shape == (3, 4, edge_geometry.nout)


@pytest.mark.parametrize("mode", MODES)
def test_all_padding_node_gives_zero_and_no_gradient(rng, mode):
    geometry = random_geometry(rng, nin=9, nout=5, k=3, padding=0.3)
    knn_indices = with_all_padding_node(geometry)
    x = torch.randn(2, 3, 9, generator=rng, dtype=torch.float64, requires_grad=True)

    y = knn_pool(x, knn_indices, 9, mode)
    y[:, :, -1].sum().backward()

    assert torch.equal(y[:, :, -1], torch.zeros(2, 3, dtype=torch.float64))
    assert torch.equal(x.grad, torch.zeros_like(x))
    torch.testing.assert_close(y, oracle_pool(x, knn_indices, 9, mode), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck(rng, mode):
    geometry = random_geometry(rng, nin=10, nout=6, k=4, padding=0.3)
    knn_indices = with_all_padding_node(geometry)
    x = torch.randn(2, 3, 10, generator=rng, dtype=torch.float64, requires_grad=True)

    assert torch.autograd.gradcheck(lambda x: knn_pool(x, knn_indices, 10, mode), (x,))
    assert torch.autograd.gradgradcheck(lambda x: knn_pool(x, knn_indices, 10, mode), (x,))


def test_max_gradient_is_shared_between_ties_like_amax():
    knn_indices = torch.tensor([[0], [1], [2], [3]])  # one node over four inputs, slot 3 padding
    x = torch.tensor([[[5.0, 5.0, 1.0]]], requires_grad=True)

    knn_pool(x, knn_indices, 3, "max").sum().backward()

    assert torch.equal(x.grad, torch.tensor([[[0.5, 0.5, 0.0]]]))


def test_max_relu_is_relu_then_max_in_values_and_gradients(rng):
    geometry = random_geometry(rng, nin=30, nout=12, k=5, padding=0.2)
    knn_indices = with_all_padding_node(geometry)
    # halves from a narrow range: exact zeros, windows of no positive value, tied maxima
    x = (torch.randn(3, 4, 30, generator=rng, dtype=torch.float64) * 2).round() / 2
    grad_y = torch.randn(3, 4, 12, generator=rng, dtype=torch.float64)
    fused = x.clone().requires_grad_()
    unfused = x.clone().requires_grad_()

    y = knn_pool(fused, knn_indices, 30, "max_relu")
    expected = knn_pool(torch.relu(unfused), knn_indices, 30, "max")
    y.backward(grad_y)
    expected.backward(grad_y)

    assert torch.equal(y, expected)
    assert (expected == 0).any() and (x == 0).any()  # the case is not vacuous
    torch.testing.assert_close(fused.grad, unfused.grad, rtol=1e-14, atol=1e-14)


def test_max_ignores_padding_even_when_every_real_value_is_negative():
    knn_indices = torch.tensor([[0, 2], [2, 2]])  # node 1 is all padding
    x = torch.tensor([[[-7.0, 3.0]]])

    assert torch.equal(knn_pool(x, knn_indices, 2, "max"), torch.tensor([[[-7.0, 0.0]]]))
    assert torch.equal(knn_pool(x, knn_indices, 2, "avg"), torch.tensor([[[-7.0, 0.0]]]))


@pytest.mark.parametrize("mode", MODES)
def test_nan_reaches_exactly_the_nodes_that_read_it(rng, mode):
    geometry = random_geometry(rng, nin=12, nout=8, k=4, padding=0.25)
    x = torch.randn(1, 2, 12, generator=rng, dtype=torch.float64)
    x[0, 1, 5] = math.nan

    y = knn_pool(x, geometry.knn_indices, 12, mode)

    reads_nan = (geometry.knn_indices == 5).any(dim=0)
    assert torch.isfinite(y[0, 0]).all()
    assert torch.equal(torch.isnan(y[0, 1]), reads_nan)


def test_from_coords_uses_the_knn_table():
    in_coords, out_coords = foveated_stack(resolution=12, levels=2)
    layer = KNNPool.from_coords(in_coords, out_coords, 9, mode="avg")

    expected, _, _ = knn_geometry(in_coords, out_coords, 9)
    assert torch.equal(layer.knn_indices, expected)
    assert layer.nin == len(in_coords) and layer.mode == "avg"
    assert f"nin={len(in_coords)}, nout={len(out_coords)}, k=9, mode='avg'" in repr(layer)


def test_table_serves_every_device_but_stays_out_of_the_state_dict(rng):
    geometry = random_geometry(rng)
    layer = KNNPool(geometry.knn_indices.numpy().astype(np.int32), nin=geometry.nin)

    assert layer.knn_indices.dtype == torch.int64
    assert layer.state_dict() == {}
    x = torch.randn(2, 3, geometry.nin, generator=rng, dtype=torch.float16)
    assert layer(x).dtype == torch.float16
    y = layer.to("meta")(x.to("meta"))
    assert y.device.type == "meta" and y.shape == (2, 3, geometry.knn_indices.shape[1])


def test_empty_batch(rng):
    geometry = random_geometry(rng)
    x = torch.zeros(0, 3, geometry.nin, requires_grad=True)

    y = knn_pool(x, geometry.knn_indices, geometry.nin, "max")
    y.sum().backward()

    assert y.shape == (0, 3, geometry.nout)


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda x, knn: knn_pool(x, knn, 13, "median"), ValueError, "mode must be one of"),
    (lambda x, knn: knn_pool(x[0], knn, 13), ValueError, "x must be 3-D"),
    (lambda x, knn: knn_pool(x[:, :, :12], knn, 13), ValueError, r"x must have shape \[B, C, "),
    (lambda x, knn: knn_pool(x.long(), knn, 13), TypeError, "x must have a floating dtype"),
    (lambda x, knn: knn_pool(x.tolist(), knn, 13), TypeError, "x must be a torch.Tensor"),
    (lambda x, knn: knn_pool(x, knn + 1, 13), ValueError, "knn_indices entries must lie in"),
    (lambda x, knn: knn_pool(x, knn - 1, 13), ValueError, "knn_indices entries must lie in"),
    (lambda x, knn: knn_pool(x, knn.float(), 13), TypeError, "knn_indices must have an integer"),
    (lambda x, knn: knn_pool(x, knn[0], 13), ValueError, "knn_indices must be 2-D"),
    (lambda x, knn: knn_pool(x, knn, 0), ValueError, "nin must be >= 1"),
    (lambda x, knn: KNNPool(knn, nin=13, mode="min"), ValueError, "mode must be one of"),
    (lambda x, knn: KNNPool(knn, nin=13)(x[:, :, :3]), ValueError, "Nin=13"),
])
def test_invalid_arguments_are_named(rng, call, error, message):
    geometry = random_geometry(rng, nin=13)
    x = torch.randn(2, 3, 13, generator=rng)
    # The table reaches both ends of [0, nin], so that +1 and -1 leave the range.
    knn_indices = geometry.knn_indices.clone()
    knn_indices[0, 0], knn_indices[0, 1] = 0, 13

    with pytest.raises(error, match=message):
        call(x, knn_indices)


def test_backend_choice_is_visible_and_cuda_never_falls_back(rng):
    geometry = random_geometry(rng, nin=20, nout=6, k=4)
    pool = KNNPool(geometry.knn_indices, nin=20)
    pool(torch.randn(2, 3, 20))
    assert pool.last_backend == "torch_compact" and "backend='auto'" in repr(pool)
    with pytest.raises(ValueError, match="backend 'cuda' cannot run this call: needs CUDA"):
        knn_pool(torch.randn(2, 3, 20), geometry.knn_indices, 20, backend="cuda")
    with pytest.raises(ValueError, match="unknown backend 'native'"):
        KNNPool(geometry.knn_indices, nin=20, backend="native")
