import math

import pytest
import torch

from conftest import (
    CPU_BACKENDS,
    CopyKeepingOps,
    KeptCopy,
    oracle_knn_conv,
    random_geometry,
    random_inputs,
    rel_err,
)
from knnconv import (
    get_ops,
    keep_input_relayout,
    knn_conv,
    knn_conv_with_backend,
    set_keep_input_relayout,
)
from knnconv.ops import registry


def leaves(*tensors):
    """Fresh leaf copies that require grad (None stays None)."""
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def oracle_gradients(geometry, x, weight, bias, grad_y):
    x, weight, bias = leaves(x, weight, bias)
    oracle_knn_conv(x, weight, bias, geometry).backward(grad_y.double())
    return x.grad, weight.grad, None if bias is None else bias.grad


def test_reference_and_torch_backends_serve_cpu():
    assert {"reference", "torch_compact", "torch_binned"} <= set(CPU_BACKENDS)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_gradcheck(rng, backend, bias):
    geometry = random_geometry(rng, nin=7, nout=5, k=3, v=4, padding=0.2, collisions=True)
    plan = geometry.plan(cin=2, cout=3)
    x, weight, b, _ = random_inputs(rng, plan, batch=2, bias=bias)

    assert torch.autograd.gradcheck(
        lambda *args: knn_conv(*args, plan, backend=backend), tuple(leaves(x, weight, b))
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("wanted", ["x", "weight"])
def test_single_gradient_matches_oracle(rng, backend, wanted):
    geometry = random_geometry(rng, nin=11, nout=6, k=4, v=9, padding=0.2)
    plan = geometry.plan(cin=3, cout=4)
    x, weight, bias, grad_y = random_inputs(rng, plan, batch=3)
    grad_x, grad_w, _ = oracle_gradients(geometry, x, weight, bias, grad_y)
    expected = {"x": grad_x, "weight": grad_w}
    inputs = {"x": x, "weight": weight}
    inputs[wanted] = inputs[wanted].clone().requires_grad_()

    knn_conv(inputs["x"], inputs["weight"], bias, plan, backend=backend).backward(grad_y)

    assert rel_err(inputs[wanted].grad, expected[wanted]) < 1e-13


@pytest.mark.parametrize(("k", "v", "batch", "expected"), [
    (4, 4, 20, "torch_binned"),  # no more cells than neighbours: binned at any batch
    (4, 9, 8, "torch_binned"),  # more cells, small batch
    (4, 9, 9, "torch_compact"),  # more cells, a batch past BINNED_ANY_CELLS_MAX_BATCH
])
def test_auto_picks_the_faster_torch_backend_on_cpu(rng, k, v, batch, expected):
    geometry = random_geometry(rng, k=k, v=v)
    plan = geometry.plan(cin=2, cout=3)
    x, weight, bias, _ = random_inputs(rng, plan, batch=batch)

    y, name = knn_conv_with_backend(x, weight, bias, plan)

    assert name == expected
    assert rel_err(y, oracle_knn_conv(x, weight, bias, geometry)) < 1e-13


def test_autocast_bfloat16_on_cpu(rng, monkeypatch):
    geometry = random_geometry(rng, nin=40, nout=15, k=9, v=9, padding=0.1)
    plan = geometry.plan(cin=6, cout=10)
    x, weight, bias, grad_y = random_inputs(rng, plan, batch=4, dtype=torch.float32)
    compact = get_ops("torch_compact")
    compute_dtypes = []

    def recording_forward(plan, x, weight, bias):
        compute_dtypes.append((x.dtype, weight.dtype, bias.dtype))
        return type(compact).forward(compact, plan, x, weight, bias)

    monkeypatch.setattr(compact, "forward", recording_forward)
    x_leaf, weight_leaf, bias_leaf = leaves(x, weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = knn_conv(x_leaf, weight_leaf, bias_leaf, plan, "torch_compact")
    y.backward(grad_y.to(y.dtype))

    # the float32 bias is added unrounded, in the backend's float32 sums
    assert compute_dtypes == [(torch.bfloat16, torch.bfloat16, torch.float32)]
    assert y.dtype == torch.bfloat16
    assert rel_err(y, oracle_knn_conv(x, weight, bias, geometry)) < 2e-2
    expected = oracle_gradients(geometry, x, weight, bias, grad_y.bfloat16())
    for leaf, grad in zip((x_leaf, weight_leaf, bias_leaf), expected, strict=True):
        assert leaf.grad.dtype == torch.float32
        assert rel_err(leaf.grad, grad) < 2e-2
    # The bias gradient is a plain sum of the bf16 grad_y: summed in fp32 it is nearly exact.
    assert rel_err(bias_leaf.grad, expected[2]) < 1e-6


def test_the_backend_runs_with_autocast_off_and_autocast_is_back_after_it(rng, monkeypatch):
    geometry = random_geometry(rng, nin=20, nout=9, k=5, v=6)
    plan = geometry.plan(cin=3, cout=4)
    x, weight, bias, _ = random_inputs(rng, plan, batch=2, dtype=torch.float32)
    compact = get_ops("torch_compact")
    seen = []

    def failing_forward(plan, x, weight, bias):
        seen.append(torch.is_autocast_enabled("cpu"))
        raise RuntimeError("backend failed")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        knn_conv(x, weight, bias, plan, "torch_compact")
        assert torch.is_autocast_enabled("cpu")
        monkeypatch.setattr(compact, "forward", failing_forward)
        with pytest.raises(RuntimeError, match="backend failed"):
            knn_conv(x, weight, bias, plan, "torch_compact")
        assert seen == [False]
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_leaves_float64_alone_as_torch_ops_do(rng):
    geometry = random_geometry(rng, nin=20, nout=9, k=5, v=6, padding=0.1)
    plan = geometry.plan(cin=3, cout=4)
    x, weight, bias, _ = random_inputs(rng, plan, batch=3)  # float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = knn_conv(x, weight, bias, plan, "torch_compact")
        linear = torch.nn.functional.linear(x[:, :, 0], weight[:, :3])
    assert y.dtype == linear.dtype == torch.float64
    assert rel_err(y, oracle_knn_conv(x, weight, bias, geometry)) < 1e-13


def valid_call(generator):
    geometry = random_geometry(generator, nin=13, nout=7, k=4, v=4)
    plan = geometry.plan(cin=3, cout=5)
    x, weight, bias, _ = random_inputs(generator, plan, batch=2)
    return {"x": x, "weight": weight, "bias": bias, "plan": plan, "backend": "auto"}


X_SHAPE_MESSAGE = r"x must have shape \[B, Cin=3, Nin=13\] to match the plan"
BAD_CALLS = {
    "x_not_tensor": ("x", lambda x: x.tolist(), TypeError, "x must be a torch.Tensor"),
    "x_2d": ("x", lambda x: x[0], ValueError, "x must be 3-D"),
    "wrong_cin": ("x", lambda x: x[:, :2], ValueError, X_SHAPE_MESSAGE),
    "wrong_nin": ("x", lambda x: x[:, :, 1:], ValueError, X_SHAPE_MESSAGE),
    "integer_x": ("x", lambda x: x.long(), TypeError, "x must have a floating dtype"),
    "integer_weight": ("weight", lambda w: w.int(), TypeError, "weight must have a floating dtype"),
    "weight_shape": ("weight", lambda w: w[:, 1:], ValueError,
                     r"weight must have shape \[Cout, Cin\*V\] = \[5, 12\]"),
    "weight_transposed": ("weight", lambda w: w.t(), ValueError, "weight must have shape"),
    "weight_on_other_device": ("weight", lambda w: w.to("meta"), ValueError,
                               "weight is on meta but x is on cpu"),
    "bias_shape": ("bias", lambda b: b[1:], ValueError, r"bias must have shape \[Cout\] = \[5\]"),
    "bias_2d": ("bias", lambda b: b[None], ValueError, "bias must have shape"),
    "dtype_mismatch": ("weight", lambda w: w.float(), TypeError,
                       "weight has dtype torch.float32 but x has torch.float64"),
    "bias_dtype_mismatch": ("bias", lambda b: b.float(), TypeError, "bias has dtype torch.float32"),
    "unknown_backend": ("backend", lambda _: "nope", ValueError, "unknown backend 'nope'"),
    "backend_not_str": ("backend", lambda _: 3, TypeError, "backend must be a str"),
    "plan_not_plan": ("plan", lambda p: p.on("cpu"), TypeError, "plan must be a KNNConvPlan"),
}


@pytest.mark.parametrize(("name", "transform", "error", "match"), BAD_CALLS.values(),
                         ids=list(BAD_CALLS))
def test_knn_conv_rejects(rng, name, transform, error, match):
    call = valid_call(rng)
    call[name] = transform(call[name])

    with pytest.raises(error, match=match):
        knn_conv(**call)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_batch(rng, backend):
    call = valid_call(rng)
    plan = call["plan"]
    x, weight, bias = leaves(call["x"][:0], call["weight"], call["bias"])

    y = knn_conv(x, weight, bias, plan, backend=backend)
    y.sum().backward()

    assert y.shape == (0, plan.cout, plan.nout)
    assert x.grad.shape == x.shape
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    assert torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bad_value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_input_reaches_exactly_its_neighbours(rng, backend, bad_value):
    geometry = random_geometry(rng, nin=10, nout=12, k=4, v=4, padding=0.3)
    bad_input = geometry.nin - 1  # next to the padding index, to catch off-by-one reads
    geometry.knn_indices[0, 0] = bad_input
    geometry.knn_indices[:, 1] = torch.tensor([0, 1, geometry.nin, geometry.nin])
    plan = geometry.plan(cin=3, cout=5)
    x, weight, bias, _ = random_inputs(rng, plan, batch=3)
    bad_rows = torch.tensor([True, False, True])
    x[bad_rows, 1, bad_input] = bad_value

    y = knn_conv(x, weight, bias, plan, backend=backend)

    reads_bad_input = (geometry.knn_indices == bad_input).any(dim=0)
    expected = bad_rows[:, None, None] & reads_bad_input[None, None, :]
    assert reads_bad_input[0] and not reads_bad_input[1] and not reads_bad_input.all()
    non_finite = torch.isnan(y) if math.isnan(bad_value) else ~torch.isfinite(y)
    assert torch.equal(non_finite, expected.expand_as(y))
    assert torch.isfinite(y[~expected.expand_as(y)]).all()
    # and the very values the defining sum gives: +-inf stays +-inf, never inf * 0 = NaN
    oracle = oracle_knn_conv(x, weight, bias, geometry)
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(y), kind(oracle))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_contiguous_inputs(rng, backend):
    geometry = random_geometry(rng, nin=13, nout=7, k=4, v=9, padding=0.2)
    plan = geometry.plan(cin=3, cout=5)
    x_rows = torch.randn(2, 2 * plan.nin, plan.cin, generator=rng, dtype=torch.float64)
    x = x_rows.transpose(1, 2)[:, :, ::2]
    weight = torch.randn(plan.q, plan.cout, generator=rng, dtype=torch.float64).t()
    assert not x.is_contiguous() and not weight.is_contiguous()

    y = knn_conv(x, weight, None, plan, backend=backend)

    assert rel_err(y, oracle_knn_conv(x, weight, None, geometry)) < 1e-13


@pytest.mark.parametrize("keep", [True, False])
def test_keep_input_relayout_decides_what_the_backward_receives(rng, monkeypatch, keep):
    ops = CopyKeepingOps()
    monkeypatch.setitem(registry._REGISTRY, ops.name, ops)
    geometry = random_geometry(rng, nin=12, nout=6, k=4, v=5, padding=0.2)
    x, weight, bias, grad_y = random_inputs(rng, geometry.plan(cin=3, cout=4), batch=3)
    expected = oracle_gradients(geometry, x, weight, bias, grad_y)
    x, weight, bias = leaves(x, weight, bias)
    previous = set_keep_input_relayout(keep)
    try:
        assert set_keep_input_relayout(keep) == keep  # returns the setting it replaces
        knn_conv(x, weight, bias, geometry.plan(cin=3, cout=4), ops.name).backward(grad_y)
    finally:
        set_keep_input_relayout(previous)
    assert len(ops.received) == 1
    if keep:
        assert isinstance(ops.received[0], KeptCopy)
    else:
        received = ops.received[0]  # the input itself, no copy kept
        assert isinstance(received, torch.Tensor) and received.data_ptr() == x.data_ptr()
    for got, want in zip((x.grad, weight.grad, bias.grad), expected, strict=True):
        assert rel_err(got, want) < 1e-10


def test_keep_input_relayout_block_restores_the_setting_even_on_error():
    before = set_keep_input_relayout(False)
    try:
        with pytest.raises(RuntimeError), keep_input_relayout(True):
            assert set_keep_input_relayout(True) is True  # the block's setting
            raise RuntimeError
        assert set_keep_input_relayout(False) is False  # restored
    finally:
        set_keep_input_relayout(before)
