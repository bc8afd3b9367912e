"""Numerics at the edges of fp16 (marker: gpu): outputs near the fp16 range overflow exactly
where the reference does, and a GradScaler sees the same inf/NaN steps with the cuda backend
as with the reference backend."""

from __future__ import annotations

import pytest
import torch

import knnconv
from conftest import random_geometry, rel_err

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

DEVICE = torch.device("cuda")
FP16_MAX = torch.finfo(torch.float16).max


def test_outputs_near_the_fp16_range_overflow_where_the_reference_does():
    generator = torch.Generator().manual_seed(31)
    geometry = random_geometry(generator, nin=70, nout=40, k=9, padding=0.1)
    plan = geometry.plan(cin=16, cout=48)
    x = (torch.randn(65, 16, 70, generator=generator) * 3000).half()
    weight = (torch.randn(48, plan.q, generator=generator) * 2).half()
    bias = (torch.randn(48, generator=generator) * 1000).half()
    expected = knnconv.knn_conv(x.double(), weight.double(), bias.double(), plan,
                                backend="reference")
    assert (expected.abs() > FP16_MAX).float().mean() > 0.1, "the case must overflow somewhere"
    got = knnconv.knn_conv(x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE), plan,
                           backend="cuda").cpu()
    assert not torch.isnan(got).any()
    clear = (expected.abs() - FP16_MAX).abs() > 0.01 * FP16_MAX  # not within rounding of the edge
    rounded = expected.half()
    assert torch.equal(torch.isinf(got)[clear], torch.isinf(rounded)[clear])
    assert torch.equal(torch.sign(got)[clear], torch.sign(rounded)[clear])
    finite = clear & torch.isfinite(rounded)
    assert rel_err(got[finite], expected[finite]) < 2e-3


def test_inf_and_nan_inputs_give_the_reference_pattern():
    generator = torch.Generator().manual_seed(32)
    geometry = random_geometry(generator, nin=50, nout=30, k=7)
    plan = geometry.plan(cin=8, cout=24)
    x = torch.randn(17, 8, 50, generator=generator).half()
    x[0, 1, 3], x[5, 2, 10], x[9, 0, 20] = float("inf"), float("-inf"), float("nan")
    weight = torch.randn(24, plan.q, generator=generator).half()
    expected = knnconv.knn_conv(x.double(), weight.double(), None, plan, backend="reference")
    got = knnconv.knn_conv(x.to(DEVICE), weight.to(DEVICE), None, plan, backend="cuda").cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert rel_err(got[finite], expected[finite]) < 2e-3


def scaler_history(backend: str, poisoned_steps: set[int]) -> list[tuple[float, bool]]:
    """(scale, step skipped) per step of a small AMP training run whose inputs hold an inf on
    the poisoned steps and whose initial scale overflows fp16 gradients at first."""
    generator = torch.Generator().manual_seed(33)
    first = random_geometry(generator, nin=120, nout=40, k=9, padding=0.05)
    second = random_geometry(generator, nin=40, nout=12, k=9)
    images = torch.randn(12, 32, 3, 120, generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        knnconv.KNNConv(3, 16, first.knn_indices, first.rf_index, nin=120, v=9, backend=backend),
        torch.nn.ReLU(),
        knnconv.KNNConv(16, 8, second.knn_indices, second.rf_index, nin=40, v=9,
                        backend=backend)).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**30, growth_interval=3)
    history = []
    for step, x in enumerate(images):
        x = x.clone()
        if step in poisoned_steps:
            x[3, 1, 17] = float("inf")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x.to(DEVICE)).float().square().mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        skipped = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        history.append((scaler.get_scale(), skipped))
    return history


def test_grad_scaler_skips_the_same_steps_as_with_the_reference_backend():
    poisoned = {6, 9}
    cuda, reference = scaler_history("cuda", poisoned), scaler_history("reference", poisoned)
    assert cuda == reference
    assert all(skipped for step, (_, skipped) in enumerate(cuda) if step in poisoned)
    assert cuda[0][1] and not all(skipped for _, skipped in cuda)
