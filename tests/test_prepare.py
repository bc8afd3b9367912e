"""warm_up runs a step and leaves the module as it found it."""

from __future__ import annotations

import pytest
import torch

import knnconv
from conftest import random_geometry


def network(generator):
    geometry = random_geometry(generator, nin=30, nout=12, k=5, v=9, padding=0.1)
    return torch.nn.Sequential(
        knnconv.KNNConv(3, 6, geometry.knn_indices, geometry.rf_index, nin=30, v=9),
        torch.nn.BatchNorm1d(6), torch.nn.ReLU())


def test_warm_up_runs_the_layers_and_restores_state(rng):
    model = network(rng)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)
    knnconv.warm_up(model, torch.randn(4, 3, 30, generator=rng),
                    autocast_dtype=torch.bfloat16)
    assert model[0].last_backend == "torch_binned"  # auto on the CPU at B = 4
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    assert model[0].bias.grad is None
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_warm_up_needs_an_input(rng):
    with pytest.raises(ValueError, match="example input"):
        knnconv.warm_up(network(rng))
