"""knnconv.integrations.fovi against fovi's own layers, in float64 on the CPU."""

from __future__ import annotations

import copy
import io
import re
import warnings

import pytest
import torch
from torch import nn

fovi_knn = pytest.importorskip("fovi.arch.knn")
fovi_norm = pytest.importorskip("fovi.arch.norm")

from torch._dynamo.testing import AotEagerAndRecordGraphs  # noqa: E402

from conftest import rel_err  # noqa: E402
from knnconv import context  # noqa: E402
from knnconv.integrations.fovi import (  # noqa: E402
    accelerate,
    accelerate_with_report,
)
from knnconv.ops import registry  # noqa: E402
from knnconv.ops.registry import KNNConvOps  # noqa: E402

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
AUTO_DEPTHWISE_ON_CPU = "torch_compact"  # the torch backends' one neighbourhood implementation


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
    check_routed(layer, x, reference, AUTO_DEPTHWISE_ON_CPU if depthwise else AUTO_ON_CPU)


class ConvolutionOnlyOps(KNNConvOps):
    """A registered backend of convolution kernels alone (as a user may register)."""

    name = "convolution_only_test"


def test_depthwise_layers_asked_for_a_backend_without_depthwise_kernels_say_they_run_auto(
        coords, monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, ConvolutionOnlyOps.name, ConvolutionOnlyOps())
    layer = fovi_knn.KNNDepthwiseConvLayer(3, 3, 9, *coords, device="cpu", bias=True)
    _, report = accelerate_with_report(layer, backend=ConvolutionOnlyOps.name)
    assert "backend='auto'" in report.routed[0].detail
    layer(torch.randn(2, 3, len(coords[0])))
    assert layer.last_backend == AUTO_DEPTHWISE_ON_CPU


@pytest.mark.parametrize("mode", ["max", "avg", "sum"])
def test_pooling_matches_fovi(mode, coords):
    layer = fovi_knn.KNNPoolingLayer(9, *coords, mode=mode, device="cpu")
    x = torch.randn(2, 4, len(coords[0]), generator=torch.Generator().manual_seed(0))
    check_routed(layer, x, layer, "torch_compact")  # float64 on the CPU


def test_gaussian_pooling_matches_fovi(coords):
    # fovi's GaussianKNNGridSampler pools with this mode; sigma 0.5 makes the weights of one
    # node differ widely (sigma is relative to the node's range of neighbour distances)
    layer = fovi_knn.KNNPoolingLayer(9, *coords, mode="gaussian", gauss_sigma=0.5, device="cpu")
    assert not layer._knn_all_outputs_valid  # padded neighbourhoods and all-padding nodes
    x = torch.randn(2, 4, len(coords[0]), generator=torch.Generator().manual_seed(0))
    check_routed(layer, x, layer, "torch_compact")  # float64 on the CPU
    weights = layer.knnconv_gaussian_weights
    assert "knnconv_gaussian_weights" not in layer.state_dict()
    assert weights.dtype == layer.gaussian_weights.dtype  # fovi's arithmetic, in float32
    # fovi's weights, renormalised over each node's real neighbours, in cell n*K + k
    k, nout = layer.knn_indices_pad_token.shape
    real = layer.knn_indices_pad_token != layer.knn_pad_token_val
    per_node = weights.reshape(nout, k).t()
    assert torch.equal(per_node == 0, ~real | (layer.gaussian_weights == 0))
    sums = per_node.sum(dim=0)
    assert torch.allclose(sums[real.any(dim=0)], torch.ones((), dtype=sums.dtype))
    # a pooling keeps x's dtype under autocast, as fovi's does
    layer.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pooled = layer(x)
    assert pooled.dtype == torch.float32
    assert rel_err(pooled, type(layer).forward(layer, x)) < 1e-6


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

    with pytest.warns(UserWarning, match="left 4 as they are") as caught:
        assert accelerate(model) is model

    report = accelerate_with_report(model)[1]
    assert [entry.name for entry in report.routed] == ["0", "1"]  # "1": the gaussian pooling
    reasons = {entry.name: entry.detail for entry in report.left}
    assert reasons.keys() == {"2", "3", "4", "5"}
    assert "KNNGetterLayer returns the neighbourhoods themselves" in reasons["2"]
    assert "OwnForward overrides forward" in reasons["3"]
    assert "forward of its own" in reasons["4"]
    assert "local_rf" in reasons["5"]
    assert all(reason in str(caught[0].message) for reason in reasons.values())
    assert "forward" not in vars(model[2]) and vars(model[4])["forward"] is own_forward


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


# fovi's KNNBatchNorm, routed to keep knnconv's channels-last storage

BATCH, CHANNELS, NODES = 3, 6, 41


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """t [B, C, N] stored as a contiguous [B, N, C], as knnconv's convolutions return it."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def is_stored_channels_last(t: torch.Tensor) -> bool:
    return t.stride() == (t.shape[1] * t.shape[2], 1, t.shape[1])


STORAGES = {"channels_last": channels_last, "contiguous": torch.Tensor.contiguous}

BATCH_NORM_OPTIONS = {
    "default": {},
    "cumulative_average": {"momentum": None},
    "no_affine": {"affine": False},
    "no_running_stats": {"track_running_stats": False},
    "large_eps": {"eps": 0.5, "momentum": 0.7},
}


def knn_batch_norm(**options) -> nn.Module:
    """A KNNBatchNorm with BatchNorm1d's ``options`` (fovi's constructor takes none of them),
    its parameters and running statistics away from their initial values."""
    layer = fovi_norm.KNNBatchNorm(NODES, CHANNELS, device="cpu")
    nn.BatchNorm1d.__init__(layer, CHANNELS, **options)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        if layer.running_mean is not None:
            layer.running_mean.normal_(generator=generator)
            layer.running_var.uniform_(0.5, 2.0, generator=generator)
    return layer


def batch_norm_step(layer: nn.Module, x: torch.Tensor, grad_y: torch.Tensor) -> list:
    """layer(x), then the gradients of x and of each parameter under grad_y."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = layer(x)
    y.backward(grad_y.to(y.dtype))
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def routed_batch_norm(layer: nn.Module) -> nn.Module:
    model, report = accelerate_with_report(layer)
    assert model is layer and [entry.name for entry in report.batch_norms] == [""]
    assert not (report.routed or report.left or report.batch_norms_left)
    return layer


def assert_same_state(layer: nn.Module, reference: nn.Module, tolerance: float) -> None:
    state, expected = layer.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    for name, value in state.items():
        if value.is_floating_point():
            assert rel_err(value, expected[name]) <= tolerance, name
        else:  # num_batches_tracked
            assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("options", list(BATCH_NORM_OPTIONS.values()), ids=list(BATCH_NORM_OPTIONS))
def test_batch_norm_matches_batchnorm1d(options, storage, training):
    layer = knn_batch_norm(**options).double().train(training)
    reference = copy.deepcopy(layer)
    routed_batch_norm(layer)
    assert_same_state(layer, reference, 0.0)  # routing changes no state

    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # later steps normalise with, and update, what earlier ones tracked
        x = STORAGES[storage](torch.randn(BATCH, CHANNELS, NODES, dtype=torch.float64,
                                          generator=generator))
        # knnconv's convolutions hand back contiguous gradients
        grad_y = torch.randn(x.shape, dtype=torch.float64, generator=generator)
        got = batch_norm_step(layer, x, grad_y)
        assert_close(got, batch_norm_step(reference, x, grad_y))
        assert_same_state(layer, reference, TOLERANCE)
        if storage == "channels_last":
            assert layer.last_backend == "channels_last"
            assert is_stored_channels_last(got[0])
        else:
            assert layer.last_backend == "batch_norm1d"
            assert got[0].is_contiguous()


def test_the_batch_norms_view_is_torchs_channels_last():
    x = channels_last(torch.randn(BATCH, CHANNELS, NODES))
    assert x.unsqueeze(-1).is_contiguous(memory_format=torch.channels_last)
    # What the router hands torch, the strides torch.channels_last gives a fresh tensor: for
    # x.unsqueeze(-1), whose size-1 dim has stride 1, torch's CPU batch-norm backward
    # (torch 2.13) returns wrong gradients under a contiguous grad_y.
    nhwc = x.transpose(1, 2).unsqueeze(2).permute(0, 3, 1, 2)
    fresh = torch.empty(nhwc.shape).contiguous(memory_format=torch.channels_last)
    assert nhwc.stride() == fresh.stride() == (NODES * CHANNELS, 1, CHANNELS, CHANNELS)
    assert torch.equal(nhwc.squeeze(-1), x)


@pytest.mark.parametrize("storage", list(STORAGES))
def test_batch_norm_takes_a_gradient_in_either_storage(storage):
    layer = routed_batch_norm(knn_batch_norm().double())
    reference = knn_batch_norm().double()
    generator = torch.Generator().manual_seed(3)
    x = channels_last(torch.randn(BATCH, CHANNELS, NODES, dtype=torch.float64,
                                  generator=generator))
    grad_y = STORAGES[storage](torch.randn(x.shape, dtype=torch.float64, generator=generator))
    assert_close(batch_norm_step(layer, x, grad_y), batch_norm_step(reference, x, grad_y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_norm_in_float32_and_under_bfloat16_autocast(dtype):
    """In float32, and under CPU autocast on the bfloat16 input a convolution there returns,
    with float32 parameters and running statistics."""
    layer = routed_batch_norm(knn_batch_norm())
    reference = knn_batch_norm()
    generator = torch.Generator().manual_seed(4)
    for _ in range(2):
        x = channels_last(torch.randn(BATCH, CHANNELS, NODES, generator=generator).to(dtype))
        grad_y = torch.randn(x.shape, generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            got = batch_norm_step(layer, x, grad_y)
            expected = batch_norm_step(reference, x, grad_y)
        assert layer.last_backend == "channels_last" and is_stored_channels_last(got[0])
        assert [t.dtype for t in got] == [t.dtype for t in expected] == [dtype, dtype] + [
            torch.float32] * 2
        for got_tensor, expected_tensor in zip(got, expected, strict=True):
            # bfloat16 results may round the other way here and there: within one step
            bfloat16 = got_tensor.dtype == torch.bfloat16
            tolerance = torch.finfo(torch.bfloat16).eps if bfloat16 else 1e-5
            assert rel_err(got_tensor, expected_tensor) < tolerance
        assert_same_state(layer, reference, 1e-5)


@pytest.mark.parametrize("options", ["default", "no_affine", "large_eps", "no_running_stats"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_compiled_batch_norm_matches_eager_and_stays_one_op(options, training):
    """Compiled for replay (graph_replay), an affine training batch norm that tracks running
    statistics is knnconv's opaque batch_norm_train (inductor would lower torch's into its
    own reductions); other batch norms are torch's. Each matches BatchNorm1d's outputs,
    gradients and state."""
    with context.using(graph_replay=True):
        graphs = compiled_batch_norm_graphs(options, training)
    opaque = training and options in ("default", "large_eps")
    assert ("knnconv.batch_norm_train.default" in graphs) == opaque
    assert ("knnconv.batch_norm_train_backward.default" in graphs) == opaque
    assert bool(re.search(r"aten\.\w*batch_norm", graphs)) == (not opaque)


def test_a_batch_norm_compiled_to_run_call_by_call_is_torchs():
    # torch.compile's default mode: inductor's fused kernels cost less host time than the
    # opaque op's calls
    graphs = compiled_batch_norm_graphs("default", training=True)
    assert "knnconv.batch_norm_train" not in graphs
    assert re.search(r"aten\.\w*batch_norm", graphs)


def compiled_batch_norm_graphs(options: str, training: bool) -> str:
    """The forward and backward graphs of a routed batch norm compiled with fullgraph=True,
    after checking two compiled training steps, and two of the same under inductor, against
    BatchNorm1d's outputs, gradients and state."""
    torch._dynamo.reset()  # every case compiles the router's same code: no recompile limit
    layer = routed_batch_norm(knn_batch_norm(**BATCH_NORM_OPTIONS[options]).double())
    reference = copy.deepcopy(layer).train(training)
    layer.train(training)
    recorder = AotEagerAndRecordGraphs()
    compiled = torch.compile(layer, fullgraph=True, backend=recorder)
    inductor = torch.compile(copy.deepcopy(layer), fullgraph=True, backend="inductor")
    inductor_reference = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        x = channels_last(torch.randn(BATCH, CHANNELS, NODES, dtype=torch.float64,
                                      generator=generator))
        grad_y = torch.randn(x.shape, dtype=torch.float64, generator=generator)
        expected = batch_norm_step(reference, x, grad_y)
        got = batch_norm_step(compiled, x, grad_y)
        assert_close(got, expected)
        assert is_stored_channels_last(got[0])
        assert_same_state(layer, reference, TOLERANCE)
        assert_close(batch_norm_step(inductor, x, grad_y),
                     batch_norm_step(inductor_reference, x, grad_y))
    return "".join(graph.code for graph in recorder.fw_graphs + recorder.bw_graphs)


def test_batch_norm_gives_an_inplace_relu_no_view_to_rebuild():
    # on a view of the 4-D output, the in-place ReLU would make the backward rebuild the
    # gradient through the 4-D base (CopySlices), copying it
    layer = routed_batch_norm(knn_batch_norm())
    x = channels_last(torch.randn(BATCH, CHANNELS, NODES)).requires_grad_()
    y = torch.relu_(layer(x))
    assert type(y.grad_fn).__name__ == "ReluBackward0"
    assert is_stored_channels_last(y)


@pytest.fixture
def fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_batch_norm_compiles_without_graph_break(fresh_compiler):
    eager = nn.Sequential(routed_batch_norm(knn_batch_norm()), nn.ReLU(inplace=True))
    twin = copy.deepcopy(eager)
    x = channels_last(torch.randn(BATCH, CHANNELS, NODES))

    explanation = torch._dynamo.explain(copy.deepcopy(eager))(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1

    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    for batch in (BATCH, BATCH + 2):
        x = channels_last(torch.randn(batch, CHANNELS, NODES))
        got = outputs_and_grads(twin, x, compiled)
        expected = outputs_and_grads(eager, x, eager)
        for got_tensor, expected_tensor in zip(got, expected, strict=True):
            assert rel_err(got_tensor, expected_tensor) < 1e-6
        assert is_stored_channels_last(got[0])
        assert twin[0].last_backend == "channels_last"
        assert_same_state(twin, eager, 1e-6)


class OwnBatchNormForward(fovi_norm.KNNBatchNorm):
    def forward(self, x):
        return super().forward(x) * 2


def test_batch_norm_report_and_undo():
    routed = knn_batch_norm()
    own = OwnBatchNormForward(NODES, CHANNELS, device="cpu")
    plain = nn.BatchNorm1d(CHANNELS)
    model = nn.Sequential(routed, own, plain)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model with batch norms only warns of no KNN layer
        with pytest.warns(UserWarning, match="routed 0 fovi KNN layer"):
            accelerate(model)
        report = accelerate_with_report(model)[1]  # routing again replaces the route
    assert [entry.name for entry in report.batch_norms] == ["0"]
    assert [(entry.name, entry.detail) for entry in report.batch_norms_left] == [
        ("1", "OwnBatchNormForward overrides forward of fovi's KNNBatchNorm")]
    assert not report.left
    assert "1 batch norm(s) keep its channels-last storage, 1 left" in str(report)
    assert "forward" not in vars(own) and "forward" not in vars(plain)  # plain ones not routed

    x = channels_last(torch.randn(BATCH, CHANNELS, NODES))
    routed.eval()
    assert is_stored_channels_last(routed(x))
    twin = copy.deepcopy(routed)
    assert twin.forward.layer is twin and is_stored_channels_last(twin(x))
    del routed.forward  # BatchNorm1d's own forward again
    assert routed(x).is_contiguous()


@pytest.fixture(scope="module")
def knnresnet():
    return pytest.importorskip("fovi.models.knnresnet")


@pytest.mark.parametrize("out_res", [1, -1], ids=["pooled", "unpooled"])
def test_resnet_keeps_channels_last_storage_up_to_its_flattening_view(knnresnet, out_res):
    """fovi's KNNResNet: every batch norm but the one whose output fovi flattens with view
    keeps the storage, that one returns contiguous output, and the model computes what it
    does with BatchNorm1d's own forward."""
    torch.manual_seed(0)
    # in_res 64 leaves 2 nodes after the last stage, so its storages differ
    model = knnresnet.KNNResNet(layers=[1, 1, 1, 1], in_res=64, fov=16, cmf_a=0.5,
                                ref_frame_mult=2, field_geometry="legacy", num_classes=4,
                                out_res=out_res, device="cpu").double()
    norms = {name: layer for name, layer in model.named_modules()
             if isinstance(layer, fovi_norm.KNNBatchNorm)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerate(model)
    report = accelerate_with_report(model)[1]
    assert not report.batch_norms_left and not report.left
    assert {entry.name for entry in report.batch_norms} == norms.keys()
    flattened = next(entry for entry in report.batch_norms if entry.name == "layer4.0.norm2")
    assert "view" in flattened.detail and "contiguous" in flattened.detail

    outputs = {}

    def keep_first_call(name):
        def hook(layer, inputs, y):
            outputs.setdefault(name, (inputs[0], y))
        return hook

    for name, layer in norms.items():
        layer.register_forward_hook(keep_first_call(name))
    x = torch.randn(2, 3, len(model.conv1.in_coords), dtype=torch.float64)
    got = outputs_and_grads(model, x, model)
    for entry in report.batch_norms:
        norm_input, y = outputs[entry.name]
        if entry.name == "layer4.0.norm2":
            continue
        if not norm_input.is_contiguous():  # channels-last: what knnconv's convolutions give
            assert norms[entry.name].last_backend == "channels_last"
            assert is_stored_channels_last(y)
    last_stage = outputs["layer4.0.norm1"][1]
    assert last_stage.shape[2] > 1 and is_stored_channels_last(last_stage)
    assert outputs["layer4.0.norm2"][1].is_contiguous()  # what fovi's view needs

    for layer in report.batch_norms:
        del model.get_submodule(layer.name).forward
    assert_close(got, outputs_and_grads(model, x, model))


def test_resnet_flattening_its_last_stage_compiles_fullgraph(knnresnet):
    """Under torch.compile BatchNorm1d's output keeps the strides of channels-last input, so
    fovi's view of the last block's output (2 nodes at in_res 64) needs the contiguous output
    the routed batch norm gives it explicitly."""
    torch.manual_seed(0)
    model = knnresnet.KNNResNet(layers=[1, 1, 1, 1], in_res=64, fov=16, cmf_a=0.5,
                                ref_frame_mult=2, field_geometry="legacy", num_classes=4,
                                out_res=-1, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerate(model)
    model.eval()
    x = torch.randn(2, 3, len(model.conv1.in_coords))
    torch.compiler.reset()
    try:
        compiled = torch.compile(model, backend="eager", fullgraph=True)(x)
    finally:
        torch.compiler.reset()
    assert rel_err(compiled, model(x)) < 1e-6
