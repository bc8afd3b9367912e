"""Every fovi KNN model family, built with fovi's own classes and accelerated by knnconv, on the
CPU: KNNResNet-18 and -50, the depthwise-separable KNNResNet, KNNAlexNet, KNNConvNeXtV2,
KNNViT, the DINOv3 wrapper with each of its three patch embeddings, LoRA-wrapped layers and
the gaussian pooling of fovi's GaussianKNNGridSampler.

Each family: accelerate routes every fovi KNN layer of it and leaves none, the accelerated
model's forward runs every layer it reports routed, its logits and its gradients (input and
every parameter) are fovi's own in float64, and it compiles with fullgraph=True to what it
computes eagerly. fovi 2.4.0's own forward of its depthwise layers raises (its
_apply_local_rf returns [B, N, C*V], which their einsum reads as [B, C, V, N]); for the
families built on them (KNNConvNeXtV2, the depthwise-separable KNNResNet) the reference is
fovi's model with those layers computing the float64 formulation their einsums spell out.

Then the trap of fovi's DINOv3 wrapper: its forward is a closure over the forward of the model
it was built on, so a copy.deepcopy calls the original's layers; accelerate rebinds such a
forward to the copy, or refuses it.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.abc
import importlib.machinery
import json
import sys
import types

import pytest
import torch
from torch import nn

fovi_knn = pytest.importorskip("fovi.arch.knn")
knnresnet = pytest.importorskip("fovi.models.knnresnet")
knnalexnet = pytest.importorskip("fovi.models.knnalexnet")
knnvit = pytest.importorskip("fovi.models.knnvit")  # fovi's model dependencies (transformers)
dinov3 = pytest.importorskip("fovi.models.dinov3")
lora = pytest.importorskip("fovi.utils.lora")
omegaconf = pytest.importorskip("omegaconf")
transformers = pytest.importorskip("transformers")

from conftest import rel_err  # noqa: E402
from knnconv.integrations.fovi import accelerate_with_report  # noqa: E402

# fovi's constructors call torch.meshgrid without an indexing argument and torch.tensor on a
# tensor, and its ConvNeXt imports timm.models.layers; none of it is this package's to fix.
pytestmark = [pytest.mark.filterwarnings("ignore:torch.meshgrid"),
              pytest.mark.filterwarnings("ignore:To copy construct from a tensor"),
              pytest.mark.filterwarnings("ignore:Importing from timm.models.layers")]

# float64, ours against fovi's: rounding differences, amplified by the batch norms of the last
# stages, which normalise (in training) over two samples of one node
TOLERANCE = 1e-8
COMPILED_TOLERANCE = 1e-5  # float32, compiled against eager


class _Absent:
    """A name of torchvision's: calling it raises; its attributes are absent names too, and a
    class deriving from it (timm's transforms do at import) derives from object."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self._name}.{name}")

    def __mro_entries__(self, bases):
        return (object,)


class _AbsentTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and its submodules as stand-ins whose names are _Absent."""

    class Module(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Absent(f"{self.__name__}.{name}")

    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return self.Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def import_fovi_module(name: str):
    """fovi's module ``name``, also where torchvision is missing (as in CI: knnconv's fovi
    extra does not install it). fovi's ConvNeXt module imports timm, whose layers import
    torchvision's FrozenBatchNorm2d, and its samplers module imports torchvision's
    transforms, all at import time; neither model calls any of it. Without torchvision, the
    import runs with stand-ins for it, which are gone from sys.modules afterwards."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != "torchvision":
            raise
    finder = _AbsentTorchvision()
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)
        for module in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[module]


def on_the_cpu_by_default(monkeypatch, function) -> None:
    """Make the default device of one of fovi's constructors, 'cuda', 'cpu' for this test."""
    defaults = tuple("cpu" if value == "cuda" else value for value in function.__defaults__)
    assert defaults != function.__defaults__
    monkeypatch.setattr(function, "__defaults__", defaults)


# The families: each builder returns fovi's model and an input for it (seeded).

def inputs(model: nn.Module, batch: int = 4) -> torch.Tensor:
    """x [batch, 3, Nin] for the model's first KNN layer. Four samples, not two: the deepest
    batch norms of a ResNet at in_res 32 normalise over two samples of a few nodes, which
    amplifies rounding about a millionfold (a 1e-15 relative change of x moved fovi's own
    float64 gradients by 6e-10), so the comparison would measure the order of summation."""
    first = next(m for m in model.modules() if isinstance(m, fovi_knn.KNNBaseLayer))
    return torch.randn(batch, 3, len(first.in_coords), generator=torch.Generator().manual_seed(1))


def resnet18():
    """fovi's KNNResNet-18 (basic blocks, [2, 2, 2, 2]) at in_res 32 (21 KNN layers)."""
    model = knnresnet.KNNResNet(layers=[2, 2, 2, 2], in_res=32, fov=16, cmf_a=0.5,
                                num_classes=4, device="cpu")
    return model, inputs(model)


def resnet50():
    """fovi's KNNResNet-50 blocks (bottlenecks, a 3x3 KNN conv between 1x1 ones), one per
    stage at in_res 32: the full [3, 4, 6, 3] costs the CPU seconds and tests nothing more."""
    model = knnresnet.KNNResNet(block=knnresnet.KNNResNetBottleneck, layers=[1, 1, 1, 1],
                                in_res=32, fov=16, cmf_a=0.5, num_classes=4, device="cpu")
    return model, inputs(model)


def resnet_dwsep():
    """fovi's depthwise-separable KNNResNet (fovi_resnet9_dwsep: every block conv a
    KNNDepthwiseSeparableConvLayer), without a classifier, as fovi's registry builds it."""
    model = knnresnet.KNNResNet(layers=[1, 1, 1, 1], in_res=32, fov=16, cmf_a=0.5,
                                conv_layer=fovi_knn.KNNDepthwiseSeparableConvLayer,
                                num_classes=None, device="cpu")
    return model, inputs(model)


def alexnet_lora():
    """fovi's KNNAlexNet with LoRA (fovi.utils.lora.apply_lora) on two of its convs, its B
    factor drawn (apply_lora starts it at 0, which would make the adapter a no-op)."""
    model = knnalexnet.KNNAlexNet(
        in_res=16, in_channels=3, features_per_layer=[8, 16, 16], stride_per_layer=[1, 2, 1],
        pool_after=[0], k_per_layer=[9, 9, 9], n_classes=4, device="cpu", fov=16, cmf_a=0.5)
    for name in ("layers.0.conv", "layers.2.conv"):
        adapter = lora.apply_lora(model.get_submodule(name), r=2, alpha=2.0, device="cpu")
        nn.init.normal_(adapter.B, std=0.1)
    return model, inputs(model)


def convnext(monkeypatch):
    """fovi's KNNConvNeXtV2 (stem and downsampling KNN convs, a KNNDepthwiseConvLayer of
    k=49 in every block), one narrow block per stage at in_res 32.

    fovi 2.4.0's constructor cannot build it on a machine without CUDA: its Block builds the
    depthwise conv without passing ``device`` (the layer's default is 'cuda'), and its last
    line passes SamplingCoords a device both by position and by keyword (a TypeError
    anywhere). The test builds it with the first default set to 'cpu' and the second call's
    positional device dropped.
    """
    module = import_fovi_module("fovi.models.knnconvnextv2")
    on_the_cpu_by_default(monkeypatch, fovi_knn.KNNDepthwiseConvLayer.__init__)
    sampling_coords = module.SamplingCoords
    monkeypatch.setattr(module, "SamplingCoords", lambda fov, cmf_a, res, _device, **kwargs:
                        sampling_coords(fov, cmf_a, res, **kwargs))
    model = module.ConvNeXtV2(in_res=32, fov=16, cmf_a=0.5, style="isotropic",
                              auto_match_cart_resources=0, device="cpu", num_classes=4,
                              first_stride=2, depths=[1, 1, 1, 1], dims=[8, 16, 16, 16])
    return model, inputs(model)


def vit(monkeypatch):
    """fovi's KNNViT: a KNNPatchEmbedding tokenizer, one narrow transformer layer. fovi's
    VisionTransformer builds its positional encoding without passing ``device`` (whose
    default is 'cuda'): the test builds it with that default set to 'cpu'."""
    vit_module = importlib.import_module("fovi.models.vit")
    on_the_cpu_by_default(monkeypatch, vit_module.PositionalEncoding.__init__)
    model = knnvit.KNNViT(fov=16, cmf_a=0.5, style="isotropic", img_size=32, patch_size=8,
                          embed_dim=16, num_heads=2, num_layers=1, num_outputs=4,
                          device="cpu", sample_cortex=True, attn_backend="standard")
    return model, inputs(model)


@pytest.fixture(scope="module")
def dinov3_checkpoint(tmp_path_factory):
    """A local 'pretrained' path for fovi's DINOv3 builder: a one-layer DINOv3 config and an
    image processor config (fovi's builder loads both; no weights, nothing downloaded). The
    processor is ViT's, whose PIL form needs no torchvision; fovi does not use it."""
    path = tmp_path_factory.mktemp("dinov3")
    transformers.DINOv3ViTConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        patch_size=8, image_size=32, num_register_tokens=1).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "ViTImageProcessor"}))
    return str(path)


DINOV3_PATCHES = {  # cfg.model.vit.partitioning_patches: the patch embedding it builds
    "dinov3_knn_patches": False,  # KNNPatchEmbedding
    "dinov3_partitioning": True,  # PartitioningPatchEmbedding
    "dinov3_knn_partitioning_lora": "KNN",  # KNNPartitioningPatchEmbedding, LoRA-wrapped
}


def dinov3_config(path: str, partitioning, lora_layers=None):
    return omegaconf.OmegaConf.create({
        "saccades": {"cmf_a": 0.5, "mode": "isotropic", "resize_size": 32, "fov": 16,
                     "sample_cortex": True, "field_geometry": "planar"},
        "model": {"output_mode": "pooled", "vit": {
            "position_coordinate_space": None, "partitioning_patches": partitioning,
            "patch_size": 8, "patch_overlap_factor": 1, "new_parameterization": False,
            "force_patches_less_than_matched": True}},
        "pretrained_model": {
            "path": path, "load_weights": False, "use_patch_weights": False, "patch_size": 8,
            "freeze_backbone": False, "unfreeze_layers": None, "unfreeze_all_norms": False,
            "lora": None if lora_layers is None else {
                "layers": lora_layers, "r": 2, "alpha": 2.0, "sublayers": []}},
    })


def dinov3_model(path: str, family: str):
    """fovi's foveated DINOv3 (fovi.models.dinov3.build_fovi_dinov3) with the family's patch
    embedding; the LoRA family has fovi's LoRA on it (lora.layers = [-1]), B drawn."""
    partitioning = DINOV3_PATCHES[family]
    lora_layers = [-1] if family.endswith("lora") else None
    model = dinov3.build_fovi_dinov3(dinov3_config(path, partitioning, lora_layers),
                                     device="cpu")
    if lora_layers:
        parametrization = model.embeddings.patch_embeddings.parametrizations.weight[0]
        nn.init.normal_(parametrization.B, std=0.1)
    return model


def gaussian_sampler():
    """fovi's GaussianKNNGridSampler: an image sampled at photoreceptors, pooled by a
    KNNPoolingLayer(mode='gaussian') into the ganglion-cell layout, in float64."""
    samplers = import_fovi_module("fovi.sensing.samplers")
    model = samplers.GaussianKNNGridSampler(16, 0.5, 16, gauss_sigma=0.5, dtype=torch.float64,
                                            device="cpu")
    image = torch.rand(2, 3, 24, 24, generator=torch.Generator().manual_seed(1))
    return model, image


def call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """model(x); a sampler (or its compiled form) fixates the image's centre."""
    if type(getattr(model, "_orig_mod", model)).__name__ == "GaussianKNNGridSampler":
        return model(x, fix_loc=[0.5, 0.5], fixation_size=[24.0, 24.0])
    return model(x)


FAMILIES = ["resnet18", "resnet50", "resnet_dwsep", "alexnet_lora", "convnext", "vit",
            *DINOV3_PATCHES, "gaussian_sampler"]
# fovi's own forward raises on these (their depthwise layers)
FOVI_RAISES = {"resnet_dwsep", "convnext"}


@pytest.fixture
def build(request, monkeypatch):
    """build(family) -> (fovi's model, its input), seeded."""
    def builder(family: str):
        torch.manual_seed(0)
        if family in DINOV3_PATCHES:
            model = dinov3_model(request.getfixturevalue("dinov3_checkpoint"), family)
            return model, inputs(model)
        if family in ("convnext", "vit"):
            return globals()[family](monkeypatch)
        return globals()[family]()
    return builder


def depthwise_formulation(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """fovi's depthwise layers as their einsums spell them out: the neighbours binned into the
    V kernel cells by local_rf, [B, C, V, N] (what fovi's 'b d v n -> b n d v' expects), the
    per-channel kernel [C, V, G], then the bias or the pointwise p_conv. Written from fovi's
    tables, apart from its _apply_local_rf, whose [B, N, C*V] makes fovi's forward raise."""
    padded = torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], 1)], dim=2)
    gathered = padded[:, :, layer.knn_indices_pad_token]  # [B, C, K, N]
    binned = torch.einsum("bckn,nkv->bcvn", gathered, layer.local_rf.to(x.dtype))
    separable = isinstance(layer, fovi_knn.KNNDepthwiseSeparableConvLayer)
    kernel = layer.dw_conv if separable else layer.weight
    y = torch.einsum("bcvn,cvg->bncg", binned, kernel).flatten(2)  # channel c*G + g
    y = layer.p_conv(y).transpose(1, 2) if separable else y.transpose(1, 2) + layer.bias[:, None]
    return layer._mask_invalid_outputs(y)


def with_formulation(model: nn.Module) -> list[nn.Module]:
    """Set the formulation as the forward of the model's depthwise layers; returns them."""
    layers = [layer for layer in model.modules()
              if isinstance(layer, (fovi_knn.KNNDepthwiseConvLayer,
                                    fovi_knn.KNNDepthwiseSeparableConvLayer))]
    for layer in layers:
        layer.forward = functools.partial(depthwise_formulation, layer)
    return layers


def outputs_and_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logits, then the gradients of x and of every parameter under a fixed grad_y."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = call(model, x)
    grad_y = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(2))
    y.backward(grad_y)
    module = getattr(model, "_orig_mod", model)  # a compiled model's parameters are its module's
    grads = {f"grad {name}": p.grad for name, p in module.named_parameters()
             if p.requires_grad}
    return {"logits": y.detach(), "grad x": x.grad, **grads}


def assert_close(got: dict, expected: dict, tolerance: float) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert (got[key] is None) == (value is None), key
        if value is not None:
            assert got[key].shape == value.shape, key
            assert rel_err(got[key], value) < tolerance, (key, rel_err(got[key], value))


def knn_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, fovi_knn.KNNBaseLayer)}


def accelerate_all(model: nn.Module):
    """Accelerate: every fovi KNN layer routed, none left, no forward rebound."""
    layers = knn_layers(model)
    assert layers
    accelerated, report = accelerate_with_report(model)
    assert accelerated is model
    assert [entry.name for entry in report.routed] == list(layers)
    assert not report.left and not report.forwards_rebound
    # the one batch norm that fovi flattens with view (a KNNResNet with a classifier)
    assert len(report.batch_norms_left) <= 1
    return layers, report


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_fovi_in_float64(build, family):
    model, x = build(family)
    model.double()
    x = x.double()
    if family in FOVI_RAISES:
        with pytest.raises(Exception, match="b d v n -> b n d v"):
            call(model, x)
    # fovi's model computes the reference (no copy: a copy of fovi's DINOv3 wrapper would call
    # the original), then is accelerated; its batch norms, in training, normalise by the batch
    patched = with_formulation(model)
    expected = outputs_and_grads(model, x)
    for layer in patched:
        del layer.forward

    layers, _ = accelerate_all(model)
    got = outputs_and_grads(model, x)

    assert_close(got, expected, TOLERANCE)
    # the model's forward ran every layer the report calls routed
    assert all(layer.last_backend is not None for layer in layers.values())


# the ReLUs whose only reader is a max pooling, fused into it (mode max_relu)
FUSED_RELUS = {"resnet18": {"relu": "maxpool"}, "alexnet_lora": {"layers.0.activation":
                                                                  "layers.0.pool"}}


@pytest.mark.parametrize("family", list(FUSED_RELUS))
def test_relus_that_feed_max_poolings_are_fused_and_stay_so_when_accelerated_again(build,
                                                                                   family):
    model, x = build(family)
    model.double()
    x = x.double()
    expected = outputs_and_grads(model, x)
    modules = dict(model.named_modules())

    for _ in range(2):  # a second accelerate finds the ReLU fused and fuses its pooling again
        _, report = accelerate_all(model)
        fused = {entry.name: entry.detail for entry in report.relus_fused}
        assert fused == {relu: f"applied by {pool}"
                         for relu, pool in FUSED_RELUS[family].items()}
        for relu, pool in FUSED_RELUS[family].items():
            assert modules[pool].forward.pool.mode == "max_relu"
            assert "mode='max_relu'" in next(entry.detail for entry in report.routed
                                               if entry.name == pool)
            probe = torch.randn(5, dtype=torch.float64)
            assert torch.equal(modules[relu](probe), probe)  # the pooling applies it
        assert_close(outputs_and_grads(model, x), expected, TOLERANCE)
    # no other ReLU of the model changed
    others = [m for name, m in model.named_modules()
              if isinstance(m, nn.ReLU) and name not in FUSED_RELUS[family]]
    assert others and all("forward" not in vars(m) for m in others)


def test_a_relu_before_a_block_of_another_forward_is_left(build):
    model, x = build("alexnet_lora")
    block = model.layers[0]

    class OwnBlock(type(block)):
        def forward(self, x):  # the pooling no longer reads only the ReLU's output
            activated = self.activation(self.norm(self.conv(x)))
            return self.pool(activated) + 0 * activated.mean()

    block.__class__ = OwnBlock
    _, report = accelerate_all(model)

    assert not report.relus_fused
    assert block.pool.forward.pool.mode == "max"


@pytest.fixture
def fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


# Dynamo's backend for each family: aot_eager traces the graph's forward and backward through
# the fake implementations of knnconv's custom ops too; "eager" runs dynamo's graph (no break
# allowed, knnconv's custom ops and their autograd) at half the compile time, for the deep
# ResNets, whose layer kinds (KNN conv, pooling, batch norm) test_fovi_compile.py traces with
# aot_eager, and the depthwise-separable one, whose depthwise step is ConvNeXt's (knnconv's
# depthwise conv) followed by a torch Linear.
COMPILE_BACKENDS = {"resnet18": "eager", "resnet50": "eager", "resnet_dwsep": "eager"}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_compiles_fullgraph_as_eager(build, family, fresh_compiler):
    model, x = build(family)
    model.float()
    x = x.float()
    accelerate_all(model)
    expected = outputs_and_grads(model, x)
    # the compiled model shares the model's parameters (the names too); its batch norms, in
    # training, normalise by the batch whatever statistics the eager call left
    backend = COMPILE_BACKENDS.get(family, "aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # a graph break raises
    assert_close(outputs_and_grads(compiled, x), expected, COMPILED_TOLERANCE)


# What accelerate leaves: KNNGetterLayer, which compiles as it is.

def test_getter_is_left_with_its_reason_and_compiles_as_it_is(fresh_compiler):
    in_coords, out_coords, _ = fovi_knn.get_in_out_coords(16, 16, 0.5, 2, device="cpu",
                                                          auto_match_cart_resources=0)
    getter = fovi_knn.KNNGetterLayer(9, in_coords, out_coords, device="cpu")
    _, report = accelerate_with_report(nn.Sequential(getter))
    assert [entry.name for entry in report.left] == ["0"] and not report.routed
    assert "gather and no arithmetic" in report.left[0].detail
    x = torch.randn(2, 3, len(in_coords), generator=torch.Generator().manual_seed(0))
    expected = getter(x)
    got = torch.compile(getter, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got.isnan(), expected.isnan()) and expected.isnan().any()
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())


# fovi's DINOv3 wrapper: a forward bound to the model it was built on

def patch_embedding_calls(model: nn.Module) -> list[int]:
    """A list that grows by one at each call of the model's patch embedding."""
    calls = []
    model.embeddings.patch_embeddings.register_forward_hook(lambda *args: calls.append(1))
    return calls


def test_a_copied_dinov3_runs_its_original_until_accelerate_rebinds_it(dinov3_checkpoint):
    torch.manual_seed(0)
    original = dinov3_model(dinov3_checkpoint, "dinov3_knn_patches")
    x = inputs(original)
    expected = original(x)
    twin = copy.deepcopy(original)
    original_calls, twin_calls = patch_embedding_calls(original), patch_embedding_calls(twin)

    # the trap: the copy's forward is the original's closure, which calls the original
    twin(x)
    assert (len(original_calls), len(twin_calls)) == (1, 0)

    _, report = accelerate_with_report(twin)
    assert [entry.name for entry in report.routed] == ["embeddings.patch_embeddings"]
    assert [entry.name for entry in report.forwards_rebound] == [""]
    assert "rebound to the model" in report.forwards_rebound[0].detail
    assert "forward rebound: <model>" in str(report)
    layer = twin.embeddings.patch_embeddings
    assert layer.last_backend is None
    got = twin(x)
    assert (len(original_calls), len(twin_calls)) == (1, 1)  # the copy's own layers ran
    assert layer.last_backend is not None
    assert "forward" not in vars(original.embeddings.patch_embeddings)  # left as it was
    assert rel_err(got, expected) < COMPILED_TOLERANCE
    assert got.shape == expected.shape == (4, 1, 16)  # the wrapper's output mode still applies

    # accelerating again finds the forward the model's own: nothing to rebind
    assert not accelerate_with_report(twin)[1].forwards_rebound


class Wrapper(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x)


@pytest.fixture(scope="module")
def small_conv():
    in_coords, out_coords, _ = fovi_knn.get_in_out_coords(16, 16, 0.5, 2, device="cpu",
                                                          auto_match_cart_resources=0)
    return lambda: fovi_knn.KNNConvLayer(3, 4, 9, in_coords, out_coords, device="cpu")


# copy.deepcopy copies a bound method or a partial around the copied module, but not a
# function: the copy of a closure is the closure. Each forward here is set on the copy as a
# copy would hold it, bound to the original.
BINDINGS = {
    "bound_method": lambda original: original.forward,
    "partial": lambda original: functools.partial(Wrapper.forward, original),
    # a closure over a submodule, whose twin the model holds (found by its structure)
    "closure_over_body": lambda original: (lambda x, body=original.body: body(x) * 2),
}


@pytest.mark.parametrize("binding", list(BINDINGS))
def test_forwards_bound_to_a_twin_are_rebound(small_conv, binding):
    torch.manual_seed(0)
    original = Wrapper(nn.Sequential(small_conv(), nn.ReLU()))
    twin = copy.deepcopy(original)
    original.forward = twin.forward = BINDINGS[binding](original)
    x = inputs(original)
    expected = original(x)
    _, report = accelerate_with_report(twin)
    assert [entry.name for entry in report.forwards_rebound] == [""]
    got = twin(x)
    assert twin.body[0].last_backend is not None  # the copy's own layer ran
    assert got.shape == expected.shape and rel_err(got, expected) < COMPILED_TOLERANCE
    assert "forward" not in vars(original.body[0])  # the original is left as it was


def test_forwards_bound_to_other_models_are_refused(small_conv):
    torch.manual_seed(0)
    stranger = nn.Sequential(small_conv(), small_conv())  # no module of the model is its twin
    model = Wrapper(nn.Sequential(small_conv()))
    model.forward = lambda x: stranger(x)
    with pytest.raises(ValueError, match="twin of no module of the model"):
        accelerate_with_report(model)
    assert "forward" not in vars(model.body[0])  # nothing changed

    # a twin reached through a list, which accelerate does not rebuild
    original = Wrapper(nn.Sequential(small_conv()))
    twin = copy.deepcopy(original)
    twin.forward = functools.partial(lambda modules, x: modules[0](x), [original])
    with pytest.raises(ValueError, match="cannot rebuild"):
        accelerate_with_report(twin)
    assert "forward" not in vars(twin.body[0])

    # a forward that calls modules of the model itself, or modules with no fovi KNN layer, is
    # the model's business
    outside = nn.Linear(4, 4)
    model.forward = lambda x: outside(model.body(x).transpose(1, 2))
    _, report = accelerate_with_report(model)
    assert [entry.name for entry in report.routed] == ["body.0"]
    assert not report.forwards_rebound
    assert model(inputs(model)).shape[2] == 4 and model.body[0].last_backend is not None

    # nor is one that calls a model this one is part of, whose fovi layers are all this one's
    parent = Wrapper(nn.Sequential(small_conv()))
    parent.body.forward = lambda x: parent.body[0](x)
    _, report = accelerate_with_report(parent.body)
    assert [entry.name for entry in report.routed] == ["0"] and not report.forwards_rebound
