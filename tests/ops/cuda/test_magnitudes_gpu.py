"""The native kernels and their first-use checks at the gradient magnitudes of real training
(marker: gpu), as tests/test_magnitudes.py holds the CPU backends: every output within a few
roundings of its dtype of float64, and no first-use check failing a correct kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import (
    GRAD_SCALES,
    LayerCase,
    failures,
    layer_cases,
    magnitude_failures,
    neighbourhood_outputs,
)
from test_magnitudes import HALF_DTYPES, LAYER

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

import knnconv  # noqa: E402


@pytest.fixture
def every_call_a_first_use():
    """Forget which kernels were verified, so each call below runs its first-use check."""
    ops = knnconv.get_ops("cuda")
    ops._verified.clear()
    yield ops
    ops._verified.clear()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("grad_scale", GRAD_SCALES)
@pytest.mark.parametrize("batch", [1, 17, 129])
def test_cuda_outputs_and_first_use_checks_at_every_gradient_scale(every_call_a_first_use,
                                                                   dtype, grad_scale, batch):
    case = dataclasses.replace(LAYER, dtype=dtype, batch=batch, cout=70)
    assert not magnitude_failures(case, "cuda", grad_scale, "cuda")
    assert every_call_a_first_use._verified, "the first-use checks ran and passed"


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(layer=layer_cases(HALF_DTYPES), exponent=st.integers(-8, 4))
def test_random_layers_at_random_gradient_scales_on_cuda(layer: LayerCase, exponent):
    knnconv.get_ops("cuda")._verified.clear()
    assert not magnitude_failures(layer, "cuda", 10.0**exponent, "cuda")


@pytest.mark.parametrize("layer", ["max", "avg", "sum", "depthwise"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("grad_scale", GRAD_SCALES)
def test_native_pooling_and_depthwise_at_every_gradient_scale(layer, dtype, grad_scale):
    assert not failures(neighbourhood_outputs(layer, "cuda", dtype, grad_scale, "cuda"))
