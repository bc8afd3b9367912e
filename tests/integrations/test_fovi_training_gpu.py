"""fovi's AlexNet in its published setting (at in_res 32), accelerated by knnconv, trains on the
GPU under float16 autocast without a GradScaler (marker gpu). Unscaled float16 gradients are
tiny, many below float16's normal range, and every native kernel's first-use check runs on
them: the check must accept them and training must go on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:torch.meshgrid"),
              pytest.mark.filterwarnings("ignore:To copy construct from a tensor")]

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")
fovi_knn = pytest.importorskip("fovi.arch.knn")
knnalexnet = pytest.importorskip("fovi.models.knnalexnet")

from knnconv.integrations.fovi import accelerate  # noqa: E402

DEVICE = torch.device("cuda")
BATCH, CLASSES, STEPS = 16, 10, 20


def published_alexnet() -> torch.nn.Module:
    """Five KNN convs (a k = 121 stem, V = 4K from ref_frame_mult 2) and three max-pools."""
    torch.manual_seed(0)
    return knnalexnet.KNNAlexNet(
        in_res=32, in_channels=3, features_per_layer=[96, 256, 384, 384, 256],
        stride_per_layer=[2, 1, 1, 1, 1], pool_after=[0, 1, 4], k_per_layer=[121, 25, 9, 9, 9],
        n_classes=CLASSES, fov=16, cmf_a=0.5, ref_frame_mult=2, field_geometry="legacy",
        device="cpu")


def test_published_alexnet_trains_under_float16_autocast_without_a_grad_scaler():
    model = accelerate(published_alexnet()).to(DEVICE)
    knn_layers = {name: layer for name, layer in model.named_modules()
                  if isinstance(layer, fovi_knn.KNNBaseLayer)}
    assert sum(isinstance(layer, fovi_knn.KNNConvLayer) for layer in knn_layers.values()) == 5
    assert sum(isinstance(layer, fovi_knn.KNNPoolingLayer) for layer in knn_layers.values()) == 3
    stem = model.layers[0].conv
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, stem.knn_pad_token_val, generator=generator).to(DEVICE)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator).to(DEVICE)
    stem_grads = []

    def keep_output_gradient(module, inputs, y):
        y.register_hook(stem_grads.append)

    stem.register_forward_hook(keep_output_gradient)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), labels)
        loss.backward()
        losses.append(loss.item())
        assert torch.isfinite(loss), f"step {step}: loss {losses[-1]}"
        for name, parameter in model.named_parameters():
            assert torch.isfinite(parameter.grad).all(), f"step {step}: {name}'s gradient"
        optimizer.step()

    # auto's native choice: the cuda kernels for the stem and the pools, and for the other
    # convolutions the triton kernels where they serve and the call is large enough
    for name, layer in knn_layers.items():
        native = ("cuda", "triton") if (isinstance(layer, fovi_knn.KNNConvLayer)
                                        and layer is not stem) else ("cuda",)
        assert layer.last_backend in native, name
    first = stem_grads[0]
    assert first.dtype == torch.float16
    # the regime under test: the stem's output gradient reaches below float16's normal range
    assert first[first != 0].abs().min() < torch.finfo(torch.float16).tiny
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    assert losses[-1] < losses[0], losses
