"""The first-use check's rule (knnconv.ops.first_use), on the CPU: a correctly rounded
result passes at every magnitude, a broken one fails, and the user's non-finite data is never
reported as a kernel failure."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_geometry
from knnconv import get_ops
from knnconv.ops.cuda import CudaOps
from knnconv.ops.first_use import disagreement

SCALES = (1e-8, 1e-6, 1e-3, 1.0, 1e3)


def layer(seed: int = 0, dtype=torch.float16, scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    plan = random_geometry(generator, nin=40, nout=20, k=9, padding=0.1).plan(cin=6, cout=24)
    x = torch.randn(5, 6, 40, generator=generator).to(dtype)
    weight = (torch.randn(24, plan.q, generator=generator) * 0.2).to(dtype)
    grad_y = (torch.randn(5, 24, 20, generator=generator, dtype=torch.float64)
              * scale).to(dtype)
    return plan, x, weight, grad_y


def exact(plan, x, weight, grad_y):
    """y, dx, dW in float64 from the same rounded operands: a perfect kernel's results before
    its rounding to the output dtype."""
    ops = get_ops("reference")
    x64, w64, g64 = x.double(), weight.double(), grad_y.double()
    dx, dw = ops.backward_combined(plan, g64, x64, w64)
    return ops.forward(plan, x64, w64, None), dx, dw


def check(ops: CudaOps, key, value, plan, role, x, weight, grad_y):
    oracle = get_ops("torch_compact")
    if role == "forward":
        ops._check(key, value, lambda *a: oracle.forward(plan, *a), x, weight, None)
    elif role == "grad_input":
        ops._check(key, value, lambda g, w: oracle.grad_input(plan, g, w), grad_y, weight)
    else:
        ops._check(key, value, lambda g, xs: oracle.grad_weight(plan, g, xs), grad_y, x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES)
def test_a_correctly_rounded_result_passes_at_every_gradient_scale(dtype, scale):
    plan, x, weight, grad_y = layer(dtype=dtype, scale=scale)
    y, dx, dw = exact(plan, x, weight, grad_y)
    ops = CudaOps()
    for role, value in (("forward", y.to(dtype)), ("grad_input", dx.to(dtype)),
                        ("grad_input", dx.float()), ("grad_weight", dw.float())):
        key = (role, dtype, value.dtype)
        check(ops, key, value, plan, role, x, weight, grad_y)
        assert key in ops._verified


def test_sums_that_cancel_and_values_that_overflow_pass():
    plan, x, weight, grad_y = layer(seed=3)
    # every term cancels against another: the exact results are (close to) zero
    x = torch.cat([x, -x], dim=1)[:, :6]
    x[:, 3:] = -x[:, :3]
    y, dx, _ = exact(plan, x, weight, grad_y)
    ops = CudaOps()
    check(ops, ("forward", 1), y.half(), plan, "forward", x, weight, grad_y)
    # x near the fp16 limit: sums beyond 65504 round to inf of their sign
    big = (x.double().sign() * 6.0e4).half()
    y_big = exact(plan, big, weight * 4, grad_y)[0]
    assert torch.isinf(y_big.half()).any(), "the case must overflow somewhere"
    check(ops, ("forward", 2), y_big.half(), plan, "forward", big, weight * 4, grad_y)
    assert {("forward", 1), ("forward", 2)} <= ops._verified


def broken(kind: str, value: torch.Tensor) -> torch.Tensor:
    value = value.contiguous().clone()
    flat = value.view(-1)
    if kind == "ten_percent":
        value *= 1.1
    elif kind == "nan_poison":  # an element the kernel never wrote
        flat[flat.numel() // 2] = math.nan
    elif kind == "spurious_inf":
        flat[3] = math.inf
    elif kind == "one_entry":
        flat[7] += 0.25 * flat.abs().max()
    return value


@pytest.mark.parametrize("kind", ["ten_percent", "nan_poison", "spurious_inf", "one_entry"])
@pytest.mark.parametrize("role", ["forward", "grad_input", "grad_weight"])
def test_a_broken_result_fails_and_stays_unverified(kind, role):
    plan, x, weight, grad_y = layer(seed=1, scale=1e-7)  # unscaled fp16 gradient magnitudes
    y, dx, dw = exact(plan, x, weight, grad_y)
    value = {"forward": y.half(), "grad_input": dx.half(), "grad_weight": dw.float()}[role]
    ops = CudaOps()
    with pytest.raises(RuntimeError, match="first-use check"):
        check(ops, (role,), broken(kind, value), plan, role, x, weight, grad_y)
    assert not ops._verified


def test_the_users_nan_or_inf_is_not_judged_and_a_later_call_is():
    plan, x, weight, grad_y = layer(seed=2)
    x[1, 2, 5] = math.inf
    ops = CudaOps()
    garbage = torch.full((5, 24, 20), math.nan, dtype=torch.float16)
    check(ops, ("forward",), garbage, plan, "forward", x, weight, grad_y)  # no raise
    assert not ops._verified
    x[1, 2, 5] = 0.0
    check(ops, ("forward",), exact(plan, x, weight, grad_y)[0].half(), plan, "forward", x,
          weight, grad_y)
    assert ("forward",) in ops._verified


def test_disagreement_is_a_ratio_to_the_allowance():
    reference = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    magnitude = reference.abs()
    assert disagreement(reference.half(), reference, magnitude) == 0.0
    assert disagreement((reference * 1.5).half(), reference, magnitude) > 1.0
    assert math.isnan(disagreement(torch.tensor([1.0, math.nan, 4.0]).half(), reference,
                                   magnitude))
