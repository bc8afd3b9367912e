import pytest
import torch

from conftest import random_geometry, random_inputs, rel_err
from knnconv import get_ops
from knnconv.ops import TorchCompactOps

REFERENCE = get_ops("reference")
COMPACT = get_ops("torch_compact")


def all_outputs(ops, plan, x, weight, bias, grad_y):
    """Every primitive of ``ops``: forward, grad_input, grad_weight, backward_combined."""
    return {
        "forward": ops.forward(plan, x, weight, bias),
        "grad_input": ops.grad_input(plan, grad_y, weight),
        "grad_weight": ops.grad_weight(plan, grad_y, x),
        **dict(zip(("combined_grad_input", "combined_grad_weight"),
                   ops.backward_combined(plan, grad_y, x, weight), strict=True)),
    }


def assert_close_to_reference(actual, plan, inputs, tolerance):
    expected = all_outputs(REFERENCE, plan, *(t if t is None else t.double() for t in inputs))
    for key, value in expected.items():
        assert actual[key].shape == value.shape, key
        error = rel_err(actual[key], value)
        assert error < tolerance, f"{key}: rel err {error:.2e} >= {tolerance:.0e}"


@pytest.mark.parametrize("batch", [1, 17])
@pytest.mark.parametrize("cout", [1, 63, 65])
def test_matches_reference_float64(edge_geometry, rng, batch, cout):
    plan = edge_geometry.plan(cin=3, cout=cout)
    inputs = random_inputs(rng, plan, batch)

    actual = all_outputs(COMPACT, plan, *inputs)

    assert_close_to_reference(actual, plan, inputs, 1e-12)
    for key in ("grad_input", "grad_weight", "combined_grad_input", "combined_grad_weight"):
        assert actual[key].dtype == torch.float64, key


def test_tiny_memory_budget_gives_the_same_results(rng):
    geometry = random_geometry(rng, nin=30, nout=23, k=6, v=9, padding=0.2)
    plan = geometry.plan(cin=4, cout=7)
    inputs = random_inputs(rng, plan, batch=5)
    one_node_per_chunk = TorchCompactOps(memory_budget=1)
    assert len(list(one_node_per_chunk._node_chunks(plan, 5, 8))) == plan.nout

    chunked = all_outputs(one_node_per_chunk, plan, *inputs)
    whole = all_outputs(TorchCompactOps(), plan, *inputs)

    # Not bitwise: bmm picks different kernels for 1 and for 23 nodes.
    for key, value in whole.items():
        assert rel_err(chunked[key], value) < 1e-15, key


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)],
                         ids=["float32", "bfloat16"])
def test_low_precision_close_to_float64_reference(rng, dtype, tolerance):
    geometry = random_geometry(rng, nin=40, nout=19, k=9, v=16, padding=0.1, collisions=True)
    plan = geometry.plan(cin=8, cout=33)
    inputs = random_inputs(rng, plan, batch=6, dtype=dtype)

    actual = all_outputs(COMPACT, plan, *inputs)

    assert actual["forward"].dtype == dtype
    for key in ("grad_input", "grad_weight", "combined_grad_input", "combined_grad_weight"):
        assert actual[key].dtype == torch.float32, key
    assert_close_to_reference(actual, plan, inputs, tolerance)
