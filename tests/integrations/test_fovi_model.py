"""A real fovi model, fovi.models.knnalexnet.KNNAlexNet, accelerated by knnconv and trained
under autocast: on the CPU (bfloat16, in CI) and on the GPU (float16 with GradScaler and the
cuda backend; marker gpu). The reference is fovi's own forward of the same model in float64
on the CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fovi.arch.knn")
knnalexnet = pytest.importorskip("fovi.models.knnalexnet")

from conftest import rel_err  # noqa: E402
from knnconv.integrations.fovi import accelerate_with_report  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:torch.meshgrid"),
              pytest.mark.filterwarnings("ignore:To copy construct from a tensor")]

ROUTED = ["layers.0.conv", "layers.0.pool", "layers.1.conv", "layers.2.conv"]


def fovi_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return knnalexnet.KNNAlexNet(
        in_res=16, in_channels=3, features_per_layer=[16, 32, 32], stride_per_layer=[1, 2, 1],
        pool_after=[0], k_per_layer=[9, 9, 9], n_classes=4, device="cpu", fov=16, cmf_a=0.5)


def data(model: torch.nn.Module, batch: int):
    nin = len(model.layers[0].conv.in_coords)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, nin, generator=generator)
    labels = (x[:, 0, : nin // 2].mean(1) > x[:, 1, nin // 2:].mean(1)).long() + 2 * (
        x[:, 2].mean(1) > 0).long()
    return x, labels


def step_gradients(model, x, labels, autocast_dtype=None, scaler=None):
    """Logits and the gradients of every parameter after one cross-entropy backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=autocast_dtype or torch.float32,
                        enabled=autocast_dtype is not None):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, labels)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    scale = scaler.get_scale() if scaler is not None else 1.0
    return logits.detach(), {name: p.grad / scale for name, p in model.named_parameters()}


def errors(logits, grads, expected_logits, expected_grads) -> tuple[float, float]:
    """Relative errors against float64: of the logits, and the worst over the gradients."""
    return (rel_err(logits.cpu(), expected_logits),
            max(rel_err(grad.cpu(), expected_grads[name]) for name, grad in grads.items()))


def check_accelerated_model(device: torch.device, autocast_dtype, backends: tuple[str, ...],
                            scaler=None):
    """Our errors against fovi's own float64 forward and gradients stay within twice those of
    fovi's own layers under the same autocast dtype (on the CPU), then the model trains."""
    reference = fovi_model().double()
    ours = fovi_model()  # seeded: the same weights as the reference
    model, report = accelerate_with_report(ours)
    assert model is ours and [entry.name for entry in report.routed] == ROUTED
    assert not report.left
    ours.to(device)
    x, labels = data(reference, batch=64)

    expected = step_gradients(reference, x.double(), labels)
    fovi_errors = errors(*step_gradients(fovi_model(), x, labels, autocast_dtype), *expected)
    logits, grads = step_gradients(ours, x.to(device), labels.to(device), autocast_dtype, scaler)
    assert all(ours.get_submodule(name).last_backend in backends
               for name in ROUTED if name.endswith("conv"))
    assert all(grad.dtype == torch.float32 for grad in grads.values())  # fp32 master weights
    our_errors = errors(logits, grads, *expected)
    assert our_errors[0] <= 2 * fovi_errors[0] + 1e-4
    assert our_errors[1] <= 2 * fovi_errors[1] + 1e-3

    optimizer = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(25):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast_dtype):
            loss = torch.nn.functional.cross_entropy(ours(x.to(device)), labels.to(device))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_fovi_alexnet_trains_under_bfloat16_autocast_on_the_cpu():
    # auto on the CPU: every KNN conv of this model has V = K
    check_accelerated_model(torch.device("cpu"), torch.bfloat16, ("torch_binned",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fovi_alexnet_trains_under_float16_amp_on_the_gpu():
    pytest.importorskip("cupy")
    check_accelerated_model(torch.device("cuda"), torch.float16, ("cuda", "triton"),
                            torch.amp.GradScaler("cuda"))
