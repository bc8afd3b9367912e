"""The two plain-PyTorch backends, torch_compact and torch_binned, against the reference."""

import pytest
import torch

from conftest import all_outputs, assert_close_to_reference, random_geometry, random_inputs, rel_err
from knnconv import make_plan
from knnconv.ops import TorchBinnedOps, TorchCompactOps

BACKENDS = pytest.mark.parametrize("ops_class", [TorchCompactOps, TorchBinnedOps],
                                   ids=lambda cls: cls.name)


@BACKENDS
@pytest.mark.parametrize("batch", [1, 17, 129])
@pytest.mark.parametrize("cout", [1, 63, 65])
def test_matches_reference_float64(ops_class, edge_geometry, rng, batch, cout):
    plan = edge_geometry.plan(cin=3, cout=cout)
    inputs = random_inputs(rng, plan, batch)

    actual = all_outputs(ops_class(), plan, *inputs)

    assert_close_to_reference(actual, plan, inputs, 1e-12)
    for key in ("grad_input", "grad_weight", "combined_grad_input", "combined_grad_weight"):
        assert actual[key].dtype == torch.float64, key


@BACKENDS
def test_tiny_memory_budget_gives_the_same_results(ops_class, rng):
    geometry = random_geometry(rng, nin=30, nout=23, k=6, v=9, padding=0.2, collisions=True)
    plan = geometry.plan(cin=4, cout=7)
    inputs = random_inputs(rng, plan, batch=5)
    one_node_per_chunk = ops_class(memory_budget=1)
    assert len(list(one_node_per_chunk._node_chunks(plan, 5, 8))) == plan.nout

    chunked = all_outputs(one_node_per_chunk, plan, *inputs)
    whole = all_outputs(ops_class(), plan, *inputs)

    # Not bitwise: matmul picks different kernels for 1 and for 23 nodes (worst seen over 20
    # seeds: 6e-17 torch_compact, 5e-16 torch_binned).
    tolerance = {TorchCompactOps: 1e-15, TorchBinnedOps: 1e-14}[ops_class]
    for key, value in whole.items():
        assert rel_err(chunked[key], value) < tolerance, key
    # Chunks of 5 nodes, the last holding the 3 left over: the budget that buys two nodes
    # (found by bisection on the backend's own per-node estimate), times 5 / 2.
    def chunks(budget):
        return list(ops_class(memory_budget=budget)._node_chunks(plan, 5, 8))
    low, high = 1, 2**40
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if len(chunks(middle)) == plan.nout else (low, middle)
    uneven = ops_class(memory_budget=low // 2 * 5)
    assert [stop - start for start, stop in uneven._node_chunks(plan, 5, 8)] == [5] * 4 + [3]
    assert_close_to_reference(all_outputs(uneven, plan, *inputs), plan, inputs, 1e-12)


@BACKENDS
@pytest.mark.parametrize(("dtype", "tolerance"),
                         [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)],
                         ids=["float32", "float16", "bfloat16"])
def test_low_precision_close_to_float64_reference(ops_class, rng, dtype, tolerance):
    geometry = random_geometry(rng, nin=40, nout=19, k=9, v=16, padding=0.1, collisions=True)
    plan = geometry.plan(cin=8, cout=33)
    inputs = random_inputs(rng, plan, batch=6, dtype=dtype)

    actual = all_outputs(ops_class(), plan, *inputs)

    assert actual["forward"].dtype == dtype
    for key in ("grad_input", "grad_weight", "combined_grad_input", "combined_grad_weight"):
        assert actual[key].dtype == torch.float32, key
    assert_close_to_reference(actual, plan, inputs, tolerance)


@BACKENDS
def test_weight_gradient_sums_every_row_in_float32(ops_class):
    # 256 x 300 products of ones per weight: 76800 overflows fp16 (max 65504) unless the sum
    # over all B*Nout rows is kept in float32.
    knn = torch.zeros(1, 300, dtype=torch.int64)
    plan = make_plan(knn, torch.zeros(300, 1, dtype=torch.int64), nin=1, v=1, cin=1, cout=1)
    ones = torch.ones(256, 1, 1, dtype=torch.float16)
    grad_weight = ops_class().grad_weight(plan, torch.ones(256, 1, 300, dtype=torch.float16),
                                          ones)
    assert grad_weight.dtype == torch.float32 and grad_weight.item() == 76800
