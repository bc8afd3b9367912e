"""fovi's KNNBatchNorm routed by knnconv on the GPU (marker gpu): on the channels-last storage
knnconv's convolutions return, it copies nothing in its forward or its backward (BatchNorm1d's
own forward copies its input to contiguous), keeps that storage, and computes what
BatchNorm1d does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
fovi_norm = pytest.importorskip("fovi.arch.norm")

from conftest import rel_err  # noqa: E402
from knnconv.integrations.fovi import accelerate_with_report  # noqa: E402

BATCH, CHANNELS, NODES = 16, 64, 356


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """t [B, C, N] stored as a contiguous [B, N, C], as knnconv's convolutions return it."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def counting_copies(step, *args):
    """step(*args)'s result and how many tensor copies it made, counted by the profiler."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        result = step(*args)
        torch.cuda.synchronize()
    return result, sum(event.name == "aten::copy_" for event in profiler.events())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_norm_copies_nothing_on_channels_last_storage(dtype):
    """In float32, and on the float16 input a convolution returns under autocast (float32
    parameters)."""
    torch.manual_seed(0)
    reference = fovi_norm.KNNBatchNorm(NODES, CHANNELS, device="cuda")
    layer = copy.deepcopy(reference)
    report = accelerate_with_report(layer)[1]
    assert [entry.name for entry in report.batch_norms] == [""]
    x = channels_last(torch.randn(BATCH, CHANNELS, NODES, device="cuda", dtype=dtype))
    # the gradient as a layer after it that keeps the storage hands it back
    grad_y = channels_last(torch.randn(x.shape, device="cuda", dtype=dtype))

    results, copies = {}, {}
    for name, norm in (("routed", layer), ("own", reference)):
        inputs = x.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.float16, enabled=dtype == torch.float16):
            y, forward_copies = counting_copies(norm, inputs)
        _, backward_copies = counting_copies(y.backward, grad_y)
        results[name] = [y.detach(), inputs.grad, norm.weight.grad, norm.bias.grad]
        copies[name] = (forward_copies, backward_copies)

    assert copies["routed"] == (0, 0), copies
    assert copies["own"][0] > 0, copies  # what the route spares: BatchNorm1d's input copy
    assert layer.last_backend == "channels_last"
    y = results["routed"][0]
    assert y.dtype == dtype and y.stride() == (NODES * CHANNELS, 1, CHANNELS)
    tolerance = 2 * torch.finfo(torch.float16).eps if dtype == torch.float16 else 1e-5
    for got, expected in zip(results["routed"], results["own"], strict=True):
        assert rel_err(got, expected) < tolerance
    for name in ("running_mean", "running_var"):
        assert rel_err(getattr(layer, name), getattr(reference, name)) < 1e-5
    assert torch.equal(layer.num_batches_tracked, reference.num_batches_tracked)
