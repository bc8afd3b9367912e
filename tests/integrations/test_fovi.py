"""knnconv.integrations.fovi against fovi's own layers, in float64 on the CPU."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

fovi_knn = pytest.importorskip("fovi.arch.knn")

from conftest import rel_err  # noqa: E402
from knnconv.integrations.fovi import (  # noqa: E402
    accelerate,
    accelerate_with_report,
)

# fovi's constructors call torch.meshgrid without an indexing argument and torch.tensor on a
# tensor; neither is this package's to fix.
pytestmark = [pytest.mark.filterwarnings("ignore:torch.meshgrid"),
              pytest.mark.filterwarnings("ignore:To copy construct from a tensor")]

TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def coords():
    """A small foveated layout (356 inputs, 83 outputs) with some samples masked out.

    fovi marks samples outside the field of view in ``valid_mask`` and turns them into padding
    neighbours; masking some here gives padded neighbourhoods and output nodes with no real
    neighbour at all, whose outputs fovi sets to 0.
    """
    in_coords, out_coords, _ = fovi_knn.get_in_out_coords(
        16, 16, 0.5, 2, device="cpu", auto_match_cart_resources=0)
    in_coords.valid_mask = in_coords.valid_mask.clone()
    in_coords.valid_mask[::5] = False
    out_coords.valid_mask = out_coords.valid_mask.clone()
    out_coords.valid_mask[::7] = False
    return in_coords, out_coords


def depthwise_reference(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """fovi's depthwise forward, with the features of _apply_local_rf read as [B, N, C, V].

    fovi 2.4.0's own forward of its depthwise layers raises: _apply_local_rf returns
    [B, N, C*V], which their einsum expects as [B, C, V, N]. Every step here is fovi's.
    """
    features = layer._apply_local_rf(layer._pad_and_gather_knns(x))
    batch, nout, _ = features.shape
    features = features.reshape(batch, nout, layer.in_channels, -1)
    separable = isinstance(layer, fovi_knn.KNNDepthwiseSeparableConvLayer)
    kernel = layer.dw_conv if separable else layer.weight
    y = torch.einsum("bndv,dvg->bndg", features, kernel).reshape(batch, nout, -1)
    y = layer.p_conv(y).transpose(1, 2) if separable else y.transpose(1, 2) + layer.bias[:, None]
    return layer._mask_invalid_outputs(y)


def outputs_and_grads(layer: nn.Module, x: torch.Tensor, forward) -> list[torch.Tensor | None]:
    """forward(x), then the gradients of x and of each parameter under a fixed random grad_y."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = forward(x)
    grad_y = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    y.backward(grad_y)
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def assert_close(actual: list, expected: list) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.shape == want.shape
            assert rel_err(got, want) < TOLERANCE


# What auto takes for these tests' small CPU batches (knnconv.ops.dispatch.torch_policy).
AUTO_ON_CPU = "torch_binned"


def check_routed(layer: nn.Module, x: torch.Tensor, reference, backend: str) -> None:
    """Accelerate ``layer`` and compare it with ``reference``: outputs, gradients, parameters."""
    layer.double()
    x = x.double()
    expected = outputs_and_grads(layer, x, reference)
    parameters = dict(layer.named_parameters())
    state = {name: value.clone() for name, value in layer.state_dict().items()}

    model, report = accelerate_with_report(layer)

    assert model is layer
    assert [entry.name for entry in report.routed] == [""] and not report.left
    assert_close(outputs_and_grads(layer, x, layer), expected)
    assert layer.last_backend == backend
    now = dict(layer.named_parameters())
    assert now.keys() == parameters.keys()
    assert all(now[name] is parameters[name] for name in parameters)
    assert layer.state_dict().keys() == state.keys()
    assert all(torch.equal(layer.state_dict()[name], state[name]) for name in state)
    layer.load_state_dict(state)


CONV_LAYERS = {
    "conv": lambda c: fovi_knn.KNNConvLayer(3, 5, 9, *c, device="cpu", bias=True),
    "conv_no_bias_fine_grid": lambda c: fovi_knn.KNNConvLayer(
        3, 4, 9, *c, device="cpu", bias=False, ref_frame_side_length=5),
    "depthwise": lambda c: fovi_knn.KNNDepthwiseConvLayer(3, 6, 9, *c, device="cpu", bias=True),
    "depthwise_separable": lambda c: fovi_knn.KNNDepthwiseSeparableConvLayer(
        3, 6, 9, *c, device="cpu", bias=True),
}


@pytest.mark.parametrize("kind", list(CONV_LAYERS))
def test_conv_layers_match_fovi(kind, coords):
    torch.manual_seed(0)
    layer = CONV_LAYERS[kind](coords)
    assert not layer._knn_all_outputs_valid  # the masked outputs are exercised
    for parameter in layer.parameters():  # fovi starts biases at 0
        nn.init.normal_(parameter)
    depthwise = isinstance(layer, (fovi_knn.KNNDepthwiseConvLayer,
                                   fovi_knn.KNNDepthwiseSeparableConvLayer))
    reference = (lambda x: depthwise_reference(layer, x)) if depthwise else layer
    x = torch.randn(2, 3, len(coords[0]))
    check_routed(layer, x, reference, AUTO_ON_CPU)


@pytest.mark.parametrize("mode", ["max", "avg", "sum"])
def test_pooling_matches_fovi(mode, coords):
    layer = fovi_knn.KNNPoolingLayer(9, *coords, mode=mode, device="cpu")
    x = torch.randn(2, 4, len(coords[0]), generator=torch.Generator().manual_seed(0))
    check_routed(layer, x, layer, "torch")  # float64 on the CPU


@pytest.fixture(scope="module")
def knnvit():
    # fovi's ViT module needs fovi's model dependencies (transformers and others).
    return pytest.importorskip("fovi.models.knnvit")


@pytest.mark.parametrize("name, options, four_d", [
    ("KNNPatchEmbedding", {"bias": True}, True),
    ("PartitioningPatchEmbedding", {"bias": True, "transposed": True}, False),
    ("KNNPartitioningPatchEmbedding", {}, False),
])
def test_patch_embeddings_match_fovi(knnvit, name, options, four_d):
    torch.manual_seed(0)
    layer = getattr(knnvit, name)(3, 8, in_res=32, fov=16, cmf_a=0.5, in_cart_res=32,
                                  cart_patch_size=8, device="cpu", sample_cortex=True, **options)
    nin = len(layer.in_coords)
    x = torch.randn(2, 3, 4, nin // 4) if four_d else torch.randn(2, 3, nin)
    check_routed(layer, x, layer, AUTO_ON_CPU)


def test_backend_choice(coords):
    layer = fovi_knn.KNNConvLayer(3, 5, 9, *coords, device="cpu", bias=True).double()
    x = torch.randn(2, 3, len(coords[0]), dtype=torch.float64)
    expected = layer(x)
    with pytest.raises(ValueError, match="unknown backend"):
        accelerate(layer, backend="no_such_backend")
    assert "forward" not in vars(layer)

    accelerate(layer, backend="reference")
    assert rel_err(layer(x), expected) < TOLERANCE
    assert layer.last_backend == "reference"
    accelerate(layer)  # routing again replaces the route
    layer(x)
    assert layer.last_backend == AUTO_ON_CPU
    del layer.forward  # fovi's own forward again
    assert torch.equal(layer(x), expected)


class OwnForward(fovi_knn.KNNConvLayer):
    def forward(self, x):
        return super().forward(x).relu()


def test_report_names_what_is_left(coords):
    def conv(cls=fovi_knn.KNNConvLayer):
        return cls(3, 3, 9, *coords, device="cpu")

    patched = conv()
    patched.forward = own_forward = lambda x: x
    soft = conv()
    soft.local_rf = soft.local_rf * 0.5  # half of each neighbour in its cell: not one-hot
    model = nn.Sequential(
        conv(),
        fovi_knn.KNNPoolingLayer(9, coords[1], coords[1], mode="gaussian", device="cpu"),
        fovi_knn.KNNGetterLayer(9, coords[1], coords[1], device="cpu"),
        conv(OwnForward),
        patched,
        soft,
        nn.ReLU(),
    )

    with pytest.warns(UserWarning, match="left 5 as they are") as caught:
        assert accelerate(model) is model

    report = accelerate_with_report(model)[1]
    assert [entry.name for entry in report.routed] == ["0"]
    reasons = {entry.name: entry.detail for entry in report.left}
    assert reasons.keys() == {"1", "2", "3", "4", "5"}
    assert "'gaussian' mode" in reasons["1"]
    assert "KNNGetterLayer" in reasons["2"]
    assert "OwnForward overrides forward" in reasons["3"]
    assert "forward of its own" in reasons["4"]
    assert "local_rf" in reasons["5"]
    assert all(reason in str(caught[0].message) for reason in reasons.values())
    assert "forward" not in vars(model[1]) and vars(model[4])["forward"] is own_forward


def test_model_without_fovi_layers_warns():
    with pytest.warns(UserWarning, match="routed 0 fovi KNN layer"):
        accelerate(nn.Linear(2, 2))


def test_copies_keep_their_route(coords):
    model = nn.Sequential(
        fovi_knn.KNNConvLayer(3, 4, 9, *coords, device="cpu", bias=True),
        fovi_knn.KNNPoolingLayer(9, coords[1], coords[1], mode="max", device="cpu"),
    ).double()
    accelerate(model)
    x = torch.randn(2, 3, len(coords[0]), dtype=torch.float64)
    expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert twin[0].forward.layer is twin[0]
        assert twin[0].weight is not model[0].weight
        assert torch.equal(twin(x), expected)
        assert twin[0].last_backend == AUTO_ON_CPU
