"""Half-precision calls at the gradient magnitudes of real training, every CPU backend:
float32 parameters under autocast, grad_y from 1e-8 (unscaled fp16 losses) to 1e4 (a
GradScaler's early scales), each output within a few roundings of its dtype of float64 on
the same rounded operands (tests/strategies.py: magnitude_failures)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CPU_BACKENDS
from strategies import (
    GRAD_SCALES,
    LayerCase,
    failures,
    layer_cases,
    magnitude_failures,
    neighbourhood_outputs,
)

HALF_DTYPES = (torch.float16, torch.bfloat16)
# CPU_BACKENDS holds the reference backend too: the float64 oracle, but its half-precision
# path is code of its own.


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# A layer like the published ones: bins that collide, padding, several channels.
LAYER = LayerCase(nin=60, nout=30, k=9, v=9, cin=8, cout=40, batch=5, padding=0.1,
                  repeats=True, bias=True, dtype="float16", seed=7)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("grad_scale", GRAD_SCALES)
def test_every_output_is_as_accurate_as_its_dtype_at_every_gradient_scale(backend, dtype,
                                                                         grad_scale):
    case = dataclasses.replace(LAYER, dtype=dtype)
    assert not magnitude_failures(case, backend, grad_scale)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(layer=layer_cases(HALF_DTYPES), exponent=st.integers(-8, 4))
def test_random_layers_at_random_gradient_scales(backend, layer, exponent):
    assert not magnitude_failures(layer, backend, 10.0**exponent)


def test_the_check_fails_a_gradient_that_lost_its_tiny_values(monkeypatch):
    """magnitude_failures must catch what half-precision products did: round each node's
    products to fp16 before summing, which flushes unscaled gradients to zero."""
    from knnconv.ops import torch_compact

    def rounding_matmul(a, b, acc):
        return torch.matmul(a, b).to(acc)

    monkeypatch.setattr(torch_compact, "matmul_accumulating", rounding_matmul)
    failures = magnitude_failures(LAYER, "torch_compact", 1e-7)
    assert {"grad_x", "grad_weight"} <= set(failures)


@pytest.mark.parametrize("layer", ["max", "avg", "sum", "depthwise"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("grad_scale", GRAD_SCALES)
def test_pooling_and_depthwise_torch_paths_at_every_gradient_scale(layer, dtype, grad_scale):
    assert not failures(neighbourhood_outputs(layer, "torch_compact", dtype, grad_scale))
