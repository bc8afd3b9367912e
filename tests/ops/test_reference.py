import pytest
import torch

from conftest import Geometry, oracle_knn_conv, random_inputs, rel_err
from knnconv import get_ops

REFERENCE = get_ops("reference")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_forward_matches_oracle(edge_geometry, rng, bias):
    plan = edge_geometry.plan(cin=3, cout=5)
    x, weight, b, _ = random_inputs(rng, plan, batch=2, bias=bias)

    y = REFERENCE.forward(plan, x, weight, b)

    assert y.shape == (2, 5, edge_geometry.nout)
    assert y.dtype == torch.float64
    assert rel_err(y, oracle_knn_conv(x, weight, b, edge_geometry)) < 1e-13


def oracle_gradients(geometry, x, weight, grad_y):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    oracle_knn_conv(x, weight, None, geometry).backward(grad_y)
    return x.grad, weight.grad


def test_gradients_match_oracle(edge_geometry, rng):
    plan = edge_geometry.plan(cin=3, cout=4)
    x, weight, _, grad_y = random_inputs(rng, plan, batch=3, bias=False)
    expected_x, expected_w = oracle_gradients(edge_geometry, x, weight, grad_y)

    combined_x, combined_w = REFERENCE.backward_combined(plan, grad_y, x, weight)
    only_x = REFERENCE.grad_input(plan, grad_y, weight)
    only_w = REFERENCE.grad_weight(plan, grad_y, x)

    for grad_x in (combined_x, only_x):
        assert grad_x.shape == x.shape
        assert rel_err(grad_x, expected_x) < 1e-13
    for grad_w in (combined_w, only_w):
        assert grad_w.shape == weight.shape
        assert rel_err(grad_w, expected_w) < 1e-13


def test_padding_neighbour_reads_zero(rng):
    """A node whose every neighbour is padding outputs exactly its bias."""
    geometry = Geometry(torch.tensor([[4, 0], [4, 4]]), torch.tensor([[0, 1], [1, 0]]), nin=4, v=2)
    plan = geometry.plan(cin=2, cout=3)
    x, weight, b, _ = random_inputs(rng, plan, batch=2)

    y = REFERENCE.forward(plan, x, weight, b)

    assert torch.equal(y[:, :, 0], b.expand(2, 3))
    expected_node1 = x[:, :, 0] @ weight.view(3, 2, 2)[:, :, 1].t() + b
    assert rel_err(y[:, :, 1], expected_node1) < 1e-14
