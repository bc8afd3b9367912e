"""The triton backend's TMA kernels on a GPU (marker: gpu; compute capability 9.0+): every
output against the float64 oracle on fresh random inputs, outputs NaN-poisoned before the
kernels run, in float16 and bfloat16, at odd sizes (B = 1, 17, 129; Cout not a multiple of
64; Nout = 1), with padding, bin collisions and all-padding nodes, and image stems (three
input channels: the few-channel kernels); bit-identical weight
gradients from run to run; the training path under autocast and deterministic algorithms;
the depthwise convolution's kernels against float64.
"""

from __future__ import annotations

import pytest
import torch

import knnconv
from conftest import oracle_knn_conv, random_geometry, rel_err, with_all_padding_node
from knnconv.functional import knn_depthwise_conv_with_backend
from knnconv.ops import get_ops
from knnconv.ops.triton import backend
from knnconv.plan import NeighbourhoodPlan
from test_depthwise import oracle_depthwise

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if backend.launch is None:
    pytest.skip(f"triton backend unavailable: {backend.MISSING}", allow_module_level=True)
if torch.cuda.get_device_capability() < backend.MIN_COMPUTE_CAPABILITY:
    pytest.skip("the TMA kernels need compute capability 9.0+", allow_module_level=True)

from knnconv.ops.triton import launch  # noqa: E402

DEVICE = torch.device("cuda")
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
CASES = {  # name: (batch, cin, cout, geometry knobs)
    "b1": (1, 16, 16, {"nin": 40, "nout": 20, "k": 9, "padding": 0.2}),
    "b17_cout80": (17, 32, 80, {"nin": 60, "nout": 30, "k": 7, "padding": 0.3}),
    "b129_cout144": (129, 64, 144, {"nin": 50, "nout": 25, "k": 9, "v": 12,
                                    "collisions": True, "padding": 0.1}),
    "b129_cin96": (129, 96, 48, {"nin": 70, "nout": 33, "k": 5, "v": 25}),
    "b17_nout1": (17, 16, 32, {"nout": 1, "k": 5}),
    "b300_wide": (300, 256, 256, {"nin": 90, "nout": 40, "k": 9, "padding": 0.2}),
}


def make_case(seed, batch, cin, cout, dtype, **knobs):
    generator = torch.Generator().manual_seed(seed)
    geometry = random_geometry(generator, **knobs)
    if geometry.nout > 1:
        knn = with_all_padding_node(geometry)
        geometry = type(geometry)(knn, geometry.rf_index, geometry.nin, geometry.v)
    plan = geometry.plan(cin, cout)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    x, w, b, gy = (normal(batch, cin, plan.nin), normal(cout, plan.q), normal(cout),
                   normal(batch, cout, plan.nout))
    return geometry, plan, [t.to(dtype) for t in (x, w, b, gy)]


def channels_last(t):
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_every_output_against_float64_with_poisoned_outputs(name, dtype):
    batch, cin, cout, knobs = CASES[name]
    geometry, plan, (x, w, b, gy) = make_case(len(name) + batch, batch, cin, cout, dtype,
                                              **knobs)
    xg, gyg = channels_last(x.to(DEVICE)), channels_last(gy.to(DEVICE))
    wg, bg = w.to(DEVICE), b.to(DEVICE)
    tables = get_ops("triton").tables(plan, DEVICE)
    y = launch.forward(xg, wg, bg, tables, nout=plan.nout, v=plan.v,
                       tile=launch.forward_tile(batch, cin, cout, plan.nout), poison=True)
    dx = launch.grad_input(gyg, wg, tables, nin=plan.nin, v=plan.v,
                           tile=launch.grad_input_tile(batch, cin, cout, plan.nin), dtype=dtype,
                           poison=True)
    tile_w = launch.grad_weight_tile(batch, cin, cout)
    dw = launch.grad_weight(gyg, xg, tables, get_ops("triton").share_starts(plan, DEVICE, 3),
                            v=plan.v, tile=tile_w, windows=launch.Windows(3, 2), poison=True)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    y64 = oracle_knn_conv(x64, w64, b64, geometry)
    y64.backward(gy.double())
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (x64, w64)]
    for label, got, want in (("y", y, y64), ("dx", dx, grads[0]), ("dw", dw, grads[1])):
        assert not torch.isnan(got).any(), f"{label}: an output was never written"
        assert rel_err(got, want) < TOLERANCE[dtype], label


def step_against_float64(geometry, plan, xg, wg, bg, gy):
    """A training step of leaves xg, wg, bg on the triton backend and the same on the float64
    oracle: (label, triton's, float64's) for y and each gradient."""
    y, ran = knnconv.knn_conv_with_backend(xg, wg, bg, plan, "triton")
    y.backward(gy.to(DEVICE))
    assert ran == "triton"
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (xg, wg, bg))
    y64 = oracle_knn_conv(x64, w64, b64, geometry)
    y64.backward(gy.double().to(DEVICE))
    return [("y", y, y64), ("dx", xg.grad, x64.grad), ("dw", wg.grad, w64.grad),
            ("db", bg.grad, b64.grad)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 129])
def test_an_image_stem_against_float64_on_the_few_channel_kernels(batch, dtype):
    geometry, plan, (x, w, b, gy) = make_case(batch, batch, 3, 64, dtype, nin=300, nout=120,
                                              k=25, v=49, collisions=True, padding=0.1)
    xg = x.to(DEVICE).requires_grad_()
    wg, bg = w.to(DEVICE).requires_grad_(), b.to(DEVICE).requires_grad_()
    get_ops("triton")._verified.clear()  # the first-use checks run, outputs poisoned
    for label, got, want in step_against_float64(geometry, plan, xg, wg, bg, gy):
        assert got.shape == want.shape, label
        assert rel_err(got, want) < TOLERANCE[dtype], label


def test_weight_gradients_are_bit_identical_from_run_to_run():
    _, plan, (x, w, b, gy) = make_case(5, 512, 64, 64, torch.float16, nin=400, nout=200, k=9,
                                       padding=0.1)
    xg, gyg = channels_last(x.to(DEVICE)), channels_last(gy.to(DEVICE))
    tables = get_ops("triton").tables(plan, DEVICE)
    tile = launch.grad_weight_tile(512, 64, 64)
    # many windows (8 shares by 4 batch-chunk groups), in one sum and in three: the turns
    # order every tile's adds
    starts = get_ops("triton").share_starts(plan, DEVICE, 8)
    for sums in (1, 3):
        runs = [launch.grad_weight(gyg, xg, tables, starts, v=plan.v, tile=tile,
                                   windows=launch.Windows(8, 4, sums))
                for _ in range(5)]
        for other in runs[1:]:
            assert torch.equal(other, runs[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("storage", ["channels_last", "contiguous"])
def test_the_bias_gradient_against_float64_and_bit_identical_from_run_to_run(storage, dtype):
    # a ResNet-18 layer's rows at B = 2048 (hundreds of partials) and 70 channels (a column
    # tile partly empty)
    generator = torch.Generator().manual_seed(7)
    grad_y = torch.randn(2048, 70, 61, generator=generator).to(dtype).to(DEVICE)
    if storage == "channels_last":
        grad_y = channels_last(grad_y)
    tile = launch.grad_bias_tile(70)
    processors = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    runs = [launch.grad_bias(grad_y, tile=tile, processors=processors, poison=True)
            for _ in range(5)]
    assert rel_err(runs[0], grad_y.double().sum(dim=(0, 2))) < 1e-6
    for other in runs[1:]:
        assert torch.equal(other, runs[0])


@pytest.mark.parametrize("cin", [32, 3], ids=["cin32", "stem_cin3_padded"])
@pytest.mark.parametrize("storage", ["channels_last", "contiguous"])
def test_a_layer_trains_on_it_under_autocast_and_deterministic_algorithms(storage, cin):
    geometry, plan, (x, w, b, gy) = make_case(9 + cin, 33, cin, 48, torch.float32, nin=80,
                                              nout=40, k=7, padding=0.2)
    xg = x.to(DEVICE) if storage == "contiguous" else channels_last(x.to(DEVICE))
    xg.requires_grad_()
    wg, bg = w.to(DEVICE).requires_grad_(), b.to(DEVICE).requires_grad_()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.autocast("cuda", dtype=torch.float16):
            y, ran = knnconv.knn_conv_with_backend(xg, wg, bg, plan, "auto")
        y.float().backward(gy.to(DEVICE))
    finally:
        torch.use_deterministic_algorithms(False)
    assert ran == "triton"
    assert wg.grad.dtype == torch.float32 and xg.grad.stride() == xg.stride()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (xg, wg, bg))
    y64 = oracle_knn_conv(x64.half().double(), w64.half().double(), b64, geometry)
    y64.backward(gy.double().to(DEVICE))
    assert rel_err(y, y64) < 2e-3
    assert rel_err(xg.grad, x64.grad) < 2e-3 and rel_err(wg.grad, w64.grad) < 2e-3
    assert rel_err(bg.grad, b64.grad) < 2e-3


@pytest.mark.parametrize("cin", [3, 64])
def test_repeated_calls_match_float64_whatever_triton_specialises_on(cin):
    """Calls of one layer after the first (checked) one, at batches that change what Triton
    specialises its compiled kernels on (1, 17, 32) and with a bias that is not 16-byte
    aligned every other call, each on fresh inputs, all against the float64 oracle."""
    for call, batch in enumerate((17, 32, 17, 1, 32)):
        geometry, plan, (x, w, b, gy) = make_case(call, batch, cin, 48, torch.float16,
                                                  nin=60, nout=30, k=9, v=12, padding=0.2)
        xg = channels_last(x.to(DEVICE)).requires_grad_()
        wg = w.to(DEVICE).requires_grad_()
        bias_storage = torch.empty(49, dtype=b.dtype, device=DEVICE)
        bias_storage[1:] = b.to(DEVICE)  # a 2-byte offset: not 16-byte aligned
        bg = bias_storage[1:].detach().requires_grad_() if call % 2 else b.to(
            DEVICE).requires_grad_()
        for label, got, want in step_against_float64(geometry, plan, xg, wg, bg, gy):
            assert rel_err(got, want) < TOLERANCE[torch.float16], (call, batch, label)


@pytest.mark.parametrize("storage", ["channels_last", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 129])
def test_the_depthwise_convolution_against_float64(batch, dtype, storage):
    """The depthwise kernels (first uses checked, outputs poisoned) through
    knn_depthwise_conv_with_backend, with padding, bin collisions and an all-padding node."""
    generator = torch.Generator().manual_seed(batch)
    geometry = random_geometry(generator, nin=90, nout=40, k=9, v=9, padding=0.2,
                               collisions=True)
    geometry = type(geometry)(with_all_padding_node(geometry), geometry.rf_index, geometry.nin,
                              geometry.v)
    plan = NeighbourhoodPlan(geometry.knn_indices, nin=geometry.nin, rf_index=geometry.rf_index,
                             v=geometry.v)
    x, w, b, gy = (torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)
                   for shape in ((batch, 80, plan.nin), (80, plan.v), (80,),
                                 (batch, 80, plan.nout)))
    x = channels_last(x) if storage == "channels_last" else x
    leaves = [t.to(DEVICE).requires_grad_() for t in (x, w, b)]
    get_ops("triton")._verified.clear()
    y, ran = knn_depthwise_conv_with_backend(*leaves, plan, "triton")
    y.backward(gy.to(DEVICE))
    assert ran == "triton"
    wide = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y64 = oracle_depthwise(*wide, geometry)
    y64.backward(gy.double())
    for label, got, want in (("y", y, y64), *zip(("dx", "dw", "db"),
                                                 (t.grad for t in leaves),
                                                 (t.grad for t in wide), strict=True)):
        assert rel_err(got.cpu(), want) < TOLERANCE[dtype], label
