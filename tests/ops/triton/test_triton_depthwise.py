"""The triton backend's depthwise KNN convolution (knnconv.ops.triton.depthwise_kernels) without
a GPU: its kernels in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1
where no GPU is seen), every output against float64 loops on fresh random inputs, with
padding, bin collisions, an all-padding node and Nout = 1, at batches 1, 17 and 70 and
channel counts past one tile, outputs NaN-poisoned before the kernels run, x in either
storage; dW the same however its steps are split; the bias gradient on its kernel where
grad_y is channels-last, on torch's reduction where not; the path through
knn_depthwise_conv_with_backend; pooling refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import random_geometry, rel_err, with_all_padding_node
from knnconv.functional import knn_depthwise_conv_with_backend
from knnconv.ops import get_ops
from knnconv.ops.triton import backend
from knnconv.plan import NeighbourhoodPlan
from test_depthwise import oracle_depthwise

if backend.launch is None:
    pytest.skip(f"triton backend unavailable: {backend.MISSING}", allow_module_level=True)
if torch.cuda.is_available():
    pytest.skip("the GPU runs the depthwise kernels in tests/integrations and tests/ops/cuda",
                allow_module_level=True)

from knnconv.ops.triton import launch  # noqa: E402

CPU = torch.device("cpu")
TOLERANCE = {torch.float16: 2e-3, torch.float32: 1e-5}
CASES = {  # name: (batch, channels, geometry knobs)
    "b1_c8": (1, 8, {"nin": 30, "nout": 12, "k": 5, "v": 9}),
    "b17_c80_padding_collisions": (17, 80, {"nin": 40, "nout": 18, "k": 7, "v": 9,
                                            "padding": 0.3, "collisions": True}),
    "b70_c24_v_gt_k": (70, 24, {"nin": 25, "nout": 10, "k": 4, "v": 25, "padding": 0.1}),
    "b5_nout1": (5, 16, {"nin": 9, "nout": 1, "k": 6, "v": 8}),
}


def make_case(name, dtype):
    batch, channels, knobs = CASES[name]
    generator = torch.Generator().manual_seed(len(name) + batch)
    geometry = random_geometry(generator, **knobs)
    if geometry.nout > 1:
        geometry = type(geometry)(with_all_padding_node(geometry), geometry.rf_index,
                                  geometry.nin, geometry.v)
    plan = NeighbourhoodPlan(geometry.knn_indices, nin=geometry.nin, rf_index=geometry.rf_index,
                             v=geometry.v)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    return geometry, plan, (normal(batch, channels, geometry.nin), normal(channels, geometry.v),
                            normal(channels), normal(batch, channels, geometry.nout))


def channels_last(t):
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def float64_step(x, w, b, gy, geometry):
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    y64 = oracle_depthwise(x64, w64, b64, geometry)
    y64.backward(gy.double())
    return y64, x64.grad, w64.grad, b64.grad


@pytest.mark.parametrize("storage", ["channels_last", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_every_output_against_float64_with_poisoned_outputs(name, dtype, storage):
    geometry, plan, (x, w, b, gy) = make_case(name, dtype)
    if storage == "channels_last":
        x, gy = channels_last(x), channels_last(gy)
    batch, channels, _ = x.shape
    tables = get_ops("triton").depthwise_tables(plan, CPU)
    tile = {family: launch.depthwise_tile(family, batch, channels) for family in
            ("depthwise_forward", "depthwise_grad_input", "depthwise_grad_weight")}
    y = launch.depthwise_forward(x, w, b, tables, nin=plan.nin,
                                 tile=tile["depthwise_forward"], poison=True)
    dx = launch.depthwise_grad_input(gy, w, tables, nin=plan.nin, dtype=dtype,
                                     tile=tile["depthwise_grad_input"], poison=True)
    dw = launch.depthwise_grad_weight(gy, x, tables, v=plan.v, splits=3,
                                      tile=tile["depthwise_grad_weight"], poison=True)
    y64, dx64, dw64, _ = float64_step(x, w, b, gy, geometry)
    for label, got, want in (("y", y, y64), ("dx", dx, dx64), ("dw", dw, dw64)):
        assert got.shape == want.shape, label
        assert not torch.isnan(got).any(), f"{label}: an output was never written"
        assert rel_err(got, want) < TOLERANCE[dtype], label


def test_the_weight_gradient_is_the_same_however_the_steps_are_split():
    _, plan, (x, _, _, gy) = make_case("b17_c80_padding_collisions", torch.float32)
    tables = get_ops("triton").depthwise_tables(plan, CPU)
    tile = launch.depthwise_tile("depthwise_grad_weight", 17, 80)
    results = [launch.depthwise_grad_weight(gy, x, tables, v=plan.v, tile=tile, splits=s,
                                            poison=True) for s in (1, 2, 5, 40)]
    for other in results[1:]:
        assert rel_err(other, results[0]) < 1e-6


@pytest.mark.parametrize("storage", ["channels_last", "contiguous"])
def test_training_through_knn_depthwise_conv(storage):
    geometry, plan, (x, w, b, gy) = make_case("b17_c80_padding_collisions", torch.float16)
    if storage == "channels_last":
        x = channels_last(x)
    get_ops("triton")._verified.clear()  # the first-use checks run, outputs poisoned
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y, ran = knn_depthwise_conv_with_backend(*leaves, plan, "triton")
    y.backward(gy)
    assert ran == "triton"
    assert y.is_contiguous()  # the depthwise ops' contract (dx: autograd lays it out as x)
    for label, got, want in zip(("y", "dx", "dw", "db"), (y, *(t.grad for t in leaves)),
                                float64_step(x, w, b, gy, geometry), strict=True):
        assert got.dtype == torch.float16, label
        assert rel_err(got, want) < TOLERANCE[torch.float16], label


@pytest.mark.parametrize("storage", ["channels_last", "contiguous"])
def test_the_bias_gradient_runs_the_kernel_on_channels_last_rows_only(storage, monkeypatch):
    # on contiguous grad_y with few nodes the kernel's rows are strided gathers, slower than
    # torch's reduction (bench/results/h100_grad_bias.json)
    geometry, plan, (x, w, b, gy) = make_case("b17_c80_padding_collisions", torch.float16)
    if storage == "channels_last":
        gy = channels_last(gy)
    kernel_calls, kernel = [], launch.grad_bias

    def counted(*args, **kwargs):
        kernel_calls.append(args[0].stride())
        return kernel(*args, **kwargs)

    monkeypatch.setattr(launch, "grad_bias", counted)
    _, _, db = get_ops("triton").depthwise_gradients(
        plan, gy, x, w, (False, False, True), (None, None, torch.float32))
    assert len(kernel_calls) == (storage == "channels_last")
    assert db.dtype == torch.float32
    assert rel_err(db, float64_step(x, w, b, gy, geometry)[3]) < 1e-6


def test_pooling_is_refused_by_name():
    generator = torch.Generator().manual_seed(1)
    geometry = random_geometry(generator, nin=10, nout=4, k=3, v=4)
    plan = NeighbourhoodPlan(geometry.knn_indices, nin=geometry.nin)
    reason = get_ops("triton").unsupported_reason(plan, CPU, torch.float16)
    assert reason == "has no pooling kernels (the cuda and torch backends pool)"
