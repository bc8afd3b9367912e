"""fovi's depthwise and depthwise-separable KNN layers, accelerated, on the GPU (marker gpu):
the routed layers run knnconv's native depthwise kernels under float16 autocast, with a
channel multiplier of 1 (ConvNeXt's) and of 2, and their outputs and gradients match fovi's
formulation computed in float64 on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:torch.meshgrid")]

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")
fovi_knn = pytest.importorskip("fovi.arch.knn")

from test_fovi import coords, depthwise_reference  # noqa: E402, F401  (a fixture)

from knnconv.integrations.fovi import accelerate  # noqa: E402

DEVICE = torch.device("cuda")
TOLERANCE = 1e-2  # float16 operands and outputs, float32 accumulation
LAYERS = {
    "depthwise_multiplier1": lambda c: fovi_knn.KNNDepthwiseConvLayer(
        16, 16, 9, *c, device="cpu", bias=True),
    "depthwise_multiplier2": lambda c: fovi_knn.KNNDepthwiseConvLayer(
        16, 32, 9, *c, device="cpu", bias=True),
    "depthwise_separable": lambda c: fovi_knn.KNNDepthwiseSeparableConvLayer(
        16, 32, 9, *c, device="cpu", bias=True),
}


def outputs_and_grads(layer, x, forward, grad_y):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = forward(x)
    y.backward(grad_y.to(y.device, y.dtype))
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("kind", list(LAYERS))
def test_routed_depthwise_layers_run_the_native_kernels_under_autocast(kind, coords):  # noqa: F811
    torch.manual_seed(0)
    layer = LAYERS[kind](coords)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter)
    x = torch.randn(33, 16, len(coords[0]))
    reference = copy.deepcopy(layer).double()
    grad_y = torch.randn(33, layer.out_channels, len(coords[1]), dtype=torch.float64)
    expected = outputs_and_grads(reference, x.double(),
                                 lambda t: depthwise_reference(reference, t), grad_y)

    routed = accelerate(layer).to(DEVICE)
    with torch.autocast("cuda", dtype=torch.float16):
        got = outputs_and_grads(routed, x.to(DEVICE), routed, grad_y)
    assert routed.last_backend == "cuda"
    assert len(got) == len(expected)
    for actual, want in zip(got, expected, strict=True):
        # the separable layer's own weight and bias take no part, as in fovi: no gradient
        assert (actual is None) == (want is None)
        if want is not None:
            assert rel_err(actual.float(), want) < TOLERANCE
