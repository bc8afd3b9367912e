"""Hostile inputs: each call either works or fails before any compute with an error naming the
problem. (make_plan's own rejections are in test_plan.py, knn_conv's in test_functional.py.)"""

import sys
import types

import numpy as np
import pytest
import torch

import knnconv
from conftest import CPU_BACKENDS, oracle_knn_conv, random_geometry, random_inputs, rel_err
from knnconv import compact_tables, knn_conv, make_plan
from knnconv.ops import cuda as knn_cuda
from knnconv.ops.cuda import backend as cuda_backend
from knnconv.ops.cuda.configs import KernelConfig, check_config, shared_memory_bytes
from knnconv.plan import INT32_MAX

CUDA_DEVICE = torch.device("cuda", 0)


@pytest.fixture
def geometry(rng):
    return random_geometry(rng, nin=13, nout=7, k=4, v=5, padding=0.2)


@pytest.fixture
def plan(geometry):
    return geometry.plan(cin=3, cout=5)


def with_last_entry(table, value):
    table = table.clone()
    table[-1, -1] = value
    return table


BAD_TABLES = {
    "float_knn": ("knn_indices", lambda t: t.float(), TypeError,
                  "knn_indices must have an integer dtype, got torch.float32"),
    "float_rf": ("rf_index", lambda t: t.half(), TypeError,
                 "rf_index must have an integer dtype, got torch.float16"),
    "knn_3d": ("knn_indices", lambda t: t[None], ValueError, "knn_indices must be 2-D"),
    "rf_short": ("rf_index", lambda t: t[:-1], ValueError,
                 r"rf_index must have shape \[Nout, K\] = \[7, 4\]"),
    "knn_past_padding": ("knn_indices", lambda t: with_last_entry(t, 14), ValueError,
                         r"knn_indices entries must lie in \[0, nin\] = \[0, 13\]"),
    "rf_negative": ("rf_index", lambda t: with_last_entry(t, -1), ValueError,
                    r"rf_index entries must lie in \[0, v\) = \[0, 5\)"),
}


@pytest.mark.parametrize(("name", "transform", "error", "match"), BAD_TABLES.values(),
                         ids=list(BAD_TABLES))
def test_compact_tables_rejects(geometry, name, transform, error, match):
    tables = {"knn_indices": geometry.knn_indices, "rf_index": geometry.rf_index}
    tables[name] = transform(tables[name])

    with pytest.raises(error, match=match):
        compact_tables(tables["knn_indices"], tables["rf_index"], 3, geometry.nin, geometry.v)


@pytest.mark.parametrize("table", ["knn_indices", "rf_index"])
def test_tables_without_values_are_rejected_by_name(geometry, table):
    tables = {"knn_indices": geometry.knn_indices, "rf_index": geometry.rf_index}
    tables[table] = tables[table].to("meta")

    with pytest.raises(ValueError, match=f"{table}.*meta"):
        make_plan(**tables, nin=geometry.nin, v=geometry.v, cin=3, cout=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for the tables")
def test_tables_on_cuda_build_the_same_plan(geometry, plan):
    on_cuda = make_plan(geometry.knn_indices.cuda(), geometry.rf_index.cuda(), nin=geometry.nin,
                        v=geometry.v, cin=3, cout=5)
    input_linear, weight_linear = compact_tables(geometry.knn_indices.cuda(), geometry.rf_index,
                                                 3, geometry.nin, geometry.v)

    assert torch.equal(on_cuda.on("cpu").input_linear, plan.on("cpu").input_linear)
    assert torch.equal(on_cuda.on("cpu").weight_linear, plan.on("cpu").weight_linear)
    assert input_linear.device.type == weight_linear.device.type == "cuda"
    assert torch.equal(input_linear.cpu(), plan.on("cpu").input_linear)


def test_non_contiguous_tables_build_the_same_plan(geometry, plan):
    knn = geometry.knn_indices.t().contiguous().t()  # column-major view
    rf = torch.stack([geometry.rf_index, torch.zeros_like(geometry.rf_index)], dim=2)[..., 0]
    knn_reversed = np.ascontiguousarray(geometry.knn_indices.numpy()[::-1])[::-1]  # stride < 0
    assert not knn.is_contiguous() and not rf.is_contiguous()
    assert knn_reversed.strides[0] < 0

    for knn_table, rf_table in ((knn, rf), (knn_reversed, rf.numpy())):
        strided = make_plan(knn_table, rf_table, nin=geometry.nin, v=geometry.v, cin=3, cout=5)
        for name in ("knn_indices", "rf_index", "input_linear", "weight_linear"):
            assert torch.equal(getattr(strided.on("cpu"), name), getattr(plan.on("cpu"), name))


OVERFLOWING_SIZES = {  # tiny tables, sizes whose linear indices leave int32
    "cin_nin": {"nin": 2**30, "cin": 2, "v": 1},
    "cin_nin_plus_padding": {"nin": INT32_MAX, "cin": 1, "v": 1},
    "cin_v": {"nin": 1, "cin": 2, "v": 2**30},
}


BUILDERS = {
    "make_plan": lambda knn, rf, sizes: make_plan(knn, rf, **sizes, cout=1),
    "compact_tables": lambda knn, rf, sizes: compact_tables(knn, rf, sizes["cin"], sizes["nin"],
                                                            sizes["v"]),
}


@pytest.mark.parametrize("sizes", OVERFLOWING_SIZES.values(), ids=list(OVERFLOWING_SIZES))
@pytest.mark.parametrize("build", BUILDERS.values(), ids=list(BUILDERS))
def test_int32_overflow_is_rejected(sizes, build):
    knn, rf = torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64)

    with pytest.raises(ValueError, match="must fit in int32"):
        build(knn, rf, sizes)


def test_largest_int32_sizes_are_accepted():
    knn = torch.tensor([[0, INT32_MAX - 1]])  # the second node reads only padding
    plan = make_plan(knn, torch.zeros(2, 1, dtype=torch.int64), nin=INT32_MAX - 1, v=1, cin=1,
                     cout=1)

    assert plan.on("cpu").input_linear[:, 0].tolist() == [0, INT32_MAX - 1]


@pytest.mark.parametrize(("x_dtype", "mismatched", "other_dtype"), [
    (torch.float32, "weight", torch.bfloat16),
    (torch.bfloat16, "bias", torch.float16),
])
def test_mixed_dtypes_without_autocast_are_rejected(rng, plan, x_dtype, mismatched, other_dtype):
    call = dict(zip(("x", "weight", "bias"), random_inputs(rng, plan, 2, dtype=x_dtype)[:3],
                    strict=True))
    call[mismatched] = call[mismatched].to(other_dtype)

    with pytest.raises(TypeError, match=f"{mismatched} has dtype {other_dtype} but x has "
                       f"{x_dtype}; cast them to one dtype or run under torch.autocast"):
        knn_conv(**call, plan=plan)


def test_mixed_dtypes_under_autocast_are_accepted(rng, geometry, plan):
    x, weight, bias, _ = random_inputs(rng, plan, 2, dtype=torch.float32)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = knn_conv(x.bfloat16(), weight, bias.double(), plan)

    assert y.dtype == torch.bfloat16
    assert rel_err(y, oracle_knn_conv(x.bfloat16(), weight, bias, geometry)) < 3e-2


def test_x_on_another_device_than_weight_is_rejected(rng, plan):
    x, weight, bias, _ = random_inputs(rng, plan, 2)

    with pytest.raises(ValueError, match="weight is on cpu but x is on meta"):
        knn_conv(x.to("meta"), weight, bias, plan)


def test_bias_on_another_device_is_rejected(rng, plan):
    x, weight, bias, _ = random_inputs(rng, plan, 2)

    with pytest.raises(ValueError, match="bias is on meta but x is on cpu"):
        knn_conv(x, weight, bias.to("meta"), plan)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_meta_operands_give_a_meta_result_of_the_right_shape(rng, plan, backend):
    x, weight, bias, _ = (t.to("meta") for t in random_inputs(rng, plan, 2))

    y = knn_conv(x, weight, bias, plan, backend=backend)

    assert y.device.type == "meta" and y.shape == (2, plan.cout, plan.nout)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_broadcast_input_and_gradient_match_oracle(rng, geometry, plan, backend):
    x_row, weight, bias, _ = random_inputs(rng, plan, 1)
    x = x_row.expand(3, -1, -1).requires_grad_()  # stride 0 over the batch
    weight.requires_grad_()

    y = knn_conv(x, weight, bias, plan, backend=backend)
    y.sum().backward()  # the incoming gradient is an expanded scalar: every stride 0

    x_leaf, weight_leaf = x.detach().clone().requires_grad_(), weight.detach().requires_grad_()
    oracle_knn_conv(x_leaf, weight_leaf, bias, geometry).sum().backward()
    assert rel_err(y, oracle_knn_conv(x, weight, bias, geometry)) < 1e-13
    assert rel_err(x.grad, x_leaf.grad) < 1e-13
    assert rel_err(weight.grad, weight_leaf.grad) < 1e-13


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_inference_mode_matches_oracle(rng, geometry, plan, backend):
    x, weight, bias, _ = random_inputs(rng, plan, 3, dtype=torch.float32)

    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = knn_conv(x, weight, bias, plan, backend=backend)

    assert y.dtype == torch.bfloat16
    assert rel_err(y, oracle_knn_conv(x, weight, bias, geometry)) < 3e-2


def test_empty_batch_under_autocast_keeps_shapes_and_master_dtypes(geometry):
    conv = knnconv.KNNConv(3, 5, geometry.knn_indices, geometry.rf_index, nin=geometry.nin,
                           v=geometry.v)
    x = torch.randn(0, 3, geometry.nin, requires_grad=True)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv(x)
    y.sum().backward()

    assert y.shape == (0, 5, geometry.nout) and y.dtype == torch.bfloat16
    assert x.grad.shape == x.shape and x.grad.dtype == torch.float32
    assert conv.weight.grad.dtype == conv.bias.grad.dtype == torch.float32
    assert not conv.weight.grad.any() and not conv.bias.grad.any()


def test_empty_batch_with_frozen_weight(rng, plan):
    x, weight, bias, _ = random_inputs(rng, plan, 0)
    x.requires_grad_()

    y = knn_conv(x, weight, bias, plan)
    y.backward(torch.empty_like(y))

    assert y.shape == (0, plan.cout, plan.nout)
    assert x.grad.shape == x.shape and weight.grad is None


def test_explicit_cuda_backend_on_cpu_tensors_names_the_reason(rng, plan):
    x, weight, bias, _ = random_inputs(rng, plan, 2, dtype=torch.float16)

    with pytest.raises(ValueError, match="backend 'cuda' cannot run this call: needs CUDA "
                       "tensors, got cpu"):
        knn_conv(x, weight, bias, plan, backend="cuda")


@pytest.fixture
def gpu_without_device_queries(monkeypatch):
    """A CUDA device 0 of compute capability 9.0 as far as the cuda backend asks, on any host."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))


def test_missing_cupy_says_how_to_install(plan, monkeypatch, gpu_without_device_queries):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    ops = knn_cuda.CudaOps()  # a fresh one: the registered instance caches device verdicts

    reason = ops.unsupported_reason(plan, torch.device("cuda"), torch.float16)

    assert "needs CuPy: pip install 'knnconv[cuda13]' (CUDA 13) or 'knnconv[cuda12]'" in reason


def test_old_gpu_is_refused_with_its_capability(plan, monkeypatch, gpu_without_device_queries):
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr(cuda_backend, "nvrtc_mismatch", lambda cupy: None)
    monkeypatch.setattr(cuda_backend, "cuda_include_dir", lambda: "/usr/local/cuda/include")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))

    reason = knn_cuda.CudaOps().unsupported_reason(plan, CUDA_DEVICE, torch.bfloat16)

    assert reason == "needs compute capability >= (8, 0), device 0 has (7, 5)"


def test_cuda_backend_refuses_float32_and_points_to_autocast(plan):
    reason = knn_cuda.CudaOps().unsupported_reason(plan, CUDA_DEVICE, torch.float32)

    assert "computes in float16/bfloat16, got torch.float32 (use torch.autocast" in reason


def test_cuda_backend_refuses_deterministic_mode(plan):
    was_enabled = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        reason = knn_cuda.CudaOps().unsupported_reason(plan, CUDA_DEVICE, torch.float16)
    finally:
        torch.use_deterministic_algorithms(was_enabled)

    assert "not deterministic; use backend='torch_compact'" in reason


SM86_SHARED_BYTES = 99 * 1024  # the opt-in limit per block on sm_86 / sm_89


def test_config_over_the_device_shared_memory_is_rejected():
    deep = KernelConfig(128, 128, 64, 1, 2, 4, 4, True, 8)  # fits sm_90, not sm_86
    needed = shared_memory_bytes("forward", deep)
    assert SM86_SHARED_BYTES < needed <= 227 * 1024
    check_config("forward", deep)

    with pytest.raises(ValueError, match=rf"needs {needed} B of shared memory, over the "
                       rf"device's {SM86_SHARED_BYTES} B"):
        check_config("forward", deep, max_shared_bytes=SM86_SHARED_BYTES)


def test_config_over_every_device_shared_memory_is_rejected_by_default():
    huge = KernelConfig(128, 128, 64, 2, 2, 4, 6, True, 8)

    with pytest.raises(ValueError, match=r"invalid grad_input KernelConfig .*: needs \d+ B of "
                       r"shared memory, over the device's 232448 B"):
        check_config("grad_input", huge)
