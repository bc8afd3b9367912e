"""The native pooling and depthwise kernels against the float64 torch-ops path (marker: gpu).

The float64 path is itself checked against explicit-loop oracles on the CPU (test_pool.py,
test_depthwise.py); here both run on the same rounded inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import random_geometry, rel_err, with_all_padding_node
from knnconv import KNNConv, KNNDepthwiseConv, KNNDepthwiseSeparableConv, KNNPool, knn_pool
from knnconv.ops import get_ops
from knnconv.ops.cuda import neighbourhood
from knnconv.ops.registry import MAX_POOL_MODES

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

DEVICE = torch.device("cuda")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SIZES = ((1, 3), (17, 5), (129, 2))


# Output nodes: many, the last with no real neighbour; or one (a grid of one CTA column, the
# reversed graph of one node), with real neighbours.
NODES = (25, 1)


def table_with_all_padding_node(seed: int, *, nout: int, **knobs):
    """A random geometry and its table, whose last node has no real neighbour where there
    are several nodes."""
    geometry = random_geometry(torch.Generator().manual_seed(seed), nout=nout, **knobs)
    return geometry, with_all_padding_node(geometry) if nout > 1 else geometry.knn_indices


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["max", "avg", "sum", "max_relu"])
@pytest.mark.parametrize("batch,channels", SIZES)
@pytest.mark.parametrize("nout", NODES)
def test_pool_matches_float64(dtype, mode, batch, channels, nout):
    _, knn = table_with_all_padding_node(batch * 7 + channels, nin=60, nout=nout, k=7,
                                         padding=0.2)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, channels, 60, generator=generator).to(dtype)
    grad_y = torch.randn(batch, channels, nout, generator=generator).to(dtype)
    pool = KNNPool(knn, nin=60, mode=mode, backend="cuda").to(DEVICE)
    native_x = x.to(DEVICE).requires_grad_()
    y = pool(native_x)
    y.backward(grad_y.to(DEVICE))
    assert pool.last_backend == "cuda" and y.dtype == dtype
    x64 = x.double().requires_grad_()
    y64 = knn_pool(x64, knn, 60, mode, backend="torch_compact")
    y64.backward(grad_y.double())
    assert rel_err(y.cpu(), y64) < TOLERANCE[dtype]
    assert rel_err(native_x.grad.cpu(), x64.grad) < TOLERANCE[dtype]
    if nout > 1:
        assert torch.equal(y[:, :, -1].cpu(), torch.zeros(batch, channels, dtype=dtype))


def test_pool_ties_share_the_gradient_and_nan_propagates_like_torch():
    knn = torch.tensor([[0, 1], [1, 2], [2, 3]])  # K = 3, Nout = 2, Nin = 4
    x = torch.tensor([[[1.0, 3.0, 3.0, float("nan")]]])
    native_x = x.to(DEVICE).requires_grad_()
    y = knn_pool(native_x, knn, 4, "max", backend="cuda")
    y.backward(torch.ones_like(y))
    expected = knn_pool(x, knn, 4, "max", backend="torch_compact")
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(expected))
    assert y[0, 0, 0].item() == 3.0
    # the tied maxima share node 0's gradient; the NaN node sends none
    assert torch.equal(native_x.grad.cpu()[0, 0], torch.tensor([0.0, 0.5, 0.5, 0.0]))


# The pooling kernels called directly, in both storages a [B, C, N] tensor reaches them in.
STORAGES = ("channels_last", "contiguous")
POOL_MODES = ("max", "avg", "sum", "max_relu")
# 1 and 3: one-channel runs; 8 and 64: whole 16-byte runs in 2-byte dtypes; 70: two-channel runs.
POOL_CHANNELS = (1, 3, 8, 64, 70)
# Per element: max outputs are exact (one of the inputs); sums and gradients are accumulated
# in fp32 and rounded once to the dtype.
POOL_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
POOL_ATOL = 1e-5
POOL_NIN = 60


def in_storage(t: torch.Tensor, storage: str) -> torch.Tensor:
    """t [B, C, N] as the transposed view of a contiguous [B, N, C] buffer, or contiguous."""
    if storage == "channels_last":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous()


def assert_storage(t: torch.Tensor, storage: str) -> None:
    assert (t.transpose(1, 2).is_contiguous() if storage == "channels_last"
            else t.is_contiguous()), (storage, t.stride())


def kernel_tables(knn: torch.Tensor, nin: int):
    """(knn int32, scale, reversed graph) on the device, as the pooling kernels read them."""
    tables = neighbourhood.native_tables(knn.to(DEVICE), None, nin)
    return tables.knn, tables.scale, tables.reverse


def pool_inputs(seed: int, batch: int, channels: int, knn: torch.Tensor, mode: str,
                dtype: torch.dtype):
    """x [B, C, Nin] with one NaN on a real neighbour, and grad_y, rounded to dtype. For max, x
    holds halves from a narrow range, so many windows have tied maxima."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, POOL_NIN, generator=generator)
    if mode in MAX_POOL_MODES:
        x = (x * 2).round() / 2
    x[0, -1, knn[knn != POOL_NIN][0]] = float("nan")  # the last channel: inside a vector run
    grad_y = torch.randn(batch, channels, knn.shape[1], generator=generator)
    return x.to(dtype), grad_y.to(dtype)


def reference_pool(x: torch.Tensor, knn: torch.Tensor, nin: int, mode: str) -> torch.Tensor:
    """y [B, C, Nout] from the pooling's definition, in x's dtype, differentiable (amax shares
    the gradient between tied maxima)."""
    real = knn != nin
    neighbours = x[:, :, knn.clamp_max(nin - 1)]  # [B, C, K, Nout]
    if mode in MAX_POOL_MODES:
        pooled = neighbours.masked_fill(~real, -torch.inf).amax(dim=2)
        pooled = torch.where(real.any(dim=0), pooled, 0.0)
        return torch.relu(pooled) if mode == "max_relu" else pooled
    total = neighbours.masked_fill(~real, 0.0).sum(dim=2)
    return total / real.sum(dim=0).clamp_min(1) if mode == "avg" else total


def reference_pool_results(x: torch.Tensor, grad_y: torch.Tensor, knn: torch.Tensor, nin: int,
                           mode: str):
    """(y, ties, dx) in float64 on the rounded inputs; ties, for max, the choice codes: the
    slot of a window's only maximum, else CHOICE_TIED plus the count of tied slots (0: no
    gradient). A max window holding a NaN gives NaN and sends no gradient, where amax's
    backward would send NaN: its dx is taken on x with the NaN zeroed and no gradient from the
    NaN windows, which are the only ones reading the NaN."""
    x64 = x.double()
    y64 = reference_pool(x64, knn, nin, mode)
    grad64 = grad_y.double()
    ties = None
    if mode in MAX_POOL_MODES:
        grad64 = grad64.masked_fill(y64.isnan(), 0.0)
        tied = (x64[:, :, knn.clamp_max(nin - 1)] == y64[:, :, None, :]) & (knn != nin)
        if mode == "max_relu":  # no ties where ReLU's gradient is 0
            tied &= y64[:, :, None, :] > 0
        count = tied.sum(dim=2)  # a NaN equals nothing, an all-padding node has no real slot
        only = tied.long().argmax(dim=2)  # the slot of an only maximum
        ties = torch.where(count == 1, only, neighbourhood.CHOICE_TIED + count)
    clean = x64.nan_to_num(0.0).requires_grad_()
    reference_pool(clean, knn, nin, mode).backward(grad64)
    return y64, ties, clean.grad


def run_pool_kernels(x: torch.Tensor, grad_y: torch.Tensor, knn: torch.Tensor, nin: int,
                     mode: str, **backward_options):
    """(y, ties, dx) of pool_forward and pool_backward on the device tensors x and grad_y."""
    knn32, scale, reverse = kernel_tables(knn, nin)
    y, ties = neighbourhood.pool_forward(x, knn32, nin, mode)
    saved = (x, y, ties) if mode in MAX_POOL_MODES else (None, None, None)
    dx = neighbourhood.pool_backward(grad_y, *saved, scale, reverse, mode, nin,
                                     **backward_options)
    return y, ties, dx


def assert_pool_matches(results, expected, dtype: torch.dtype, mode: str) -> None:
    """Every element of y, ties and dx against the float64 results (uninitialised outputs
    fail: the kernels' outputs are torch.empty)."""
    (y, ties, dx), (y64, ties64, dx64) = results, expected
    assert y.dtype == dx.dtype == dtype
    exact = mode in MAX_POOL_MODES
    torch.testing.assert_close(y.cpu().double(), y64, rtol=0 if exact else POOL_RTOL[dtype],
                               atol=0 if exact else POOL_ATOL, equal_nan=True)
    if mode in MAX_POOL_MODES:
        assert ties.dtype == neighbourhood.TIES_DTYPE
        assert torch.equal(ties.cpu().long(), ties64)
    else:
        assert ties is None
    torch.testing.assert_close(dx.cpu().double(), dx64, rtol=POOL_RTOL[dtype], atol=POOL_ATOL)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", POOL_MODES)
@pytest.mark.parametrize("batch", (1, 17))
@pytest.mark.parametrize("channels", POOL_CHANNELS)
def test_pool_kernels_match_float64_in_either_storage(storage, dtype, mode, batch, channels):
    # padding, a last node with no real neighbour, tied maxima and a NaN; grad_y in y's storage
    _, knn = table_with_all_padding_node(batch * 7 + channels, nin=POOL_NIN, nout=25, k=7,
                                         padding=0.2)
    x, grad_y = pool_inputs(batch + 3 * channels, batch, channels, knn, mode, dtype)
    expected = reference_pool_results(x, grad_y, knn, POOL_NIN, mode)
    y64, ties64, _ = expected
    assert y64.isnan().any() and torch.equal(y64[:, :, -1], torch.zeros(batch, channels).double())
    if mode in MAX_POOL_MODES:  # the cases are not vacuous: ties share gradients, slots differ
        assert (ties64 > neighbourhood.CHOICE_TIED + 1).any()
        assert ((ties64 > 0) & (ties64 < neighbourhood.CHOICE_TIED)).any()
    results = run_pool_kernels(in_storage(x.to(DEVICE), storage), in_storage(
        grad_y.to(DEVICE), storage), knn, POOL_NIN, mode)
    for output in results:
        if output is not None:
            assert_storage(output, storage)
    assert_pool_matches(results, expected, dtype, mode)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", POOL_MODES)
@pytest.mark.parametrize("channels", (64, 70))
def test_pool_backward_takes_grad_y_in_the_other_storage(storage, dtype, mode, channels):
    _, knn = table_with_all_padding_node(channels, nin=POOL_NIN, nout=25, k=7, padding=0.2)
    x, grad_y = pool_inputs(channels + 1, 17, channels, knn, mode, dtype)
    other = STORAGES[1 - STORAGES.index(storage)]
    native_x = in_storage(x.to(DEVICE), storage)
    native_grad_y = in_storage(grad_y.to(DEVICE), other)
    results = run_pool_kernels(native_x, native_grad_y, knn, POOL_NIN, mode,
                               channels_last=storage == "channels_last")
    assert_storage(results[2], storage)
    assert_pool_matches(results, reference_pool_results(x, grad_y, knn, POOL_NIN, mode), dtype,
                        mode)
    # Without channels_last, dx comes in the storage the kernels ran in: y's for max,
    # grad_y's otherwise (no x is saved there), where the other kernels run.
    y, ties, dx = results
    _, scale, reverse = kernel_tables(knn, POOL_NIN)
    saved = (native_x, y, ties) if mode in MAX_POOL_MODES else (None, None, None)
    default = neighbourhood.pool_backward(native_grad_y, *saved, scale, reverse, mode, POOL_NIN)
    assert_storage(default, storage if mode in MAX_POOL_MODES else other)
    torch.testing.assert_close(default, dx, rtol=POOL_RTOL[dtype], atol=POOL_ATOL)


def offset_channels_last(x: torch.Tensor, offset: int) -> torch.Tensor:
    """x in channels-last storage starting ``offset`` elements into its buffer."""
    batch, channels, nodes = x.shape
    buffer = torch.empty(offset + x.numel(), dtype=x.dtype, device=x.device)
    view = buffer[offset:].view(batch, nodes, channels).transpose(1, 2)
    return view.copy_(x)


SCALAR_TYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}


# vector: the channel run of the loads of x (and, in max mode, of every backward load, which
# reads the saved x); aligned: the run of the backward of avg and sum, whose operands are all
# freshly allocated.
@pytest.mark.parametrize("dtype,channels,offset,vector,aligned", [
    (torch.float16, 64, 0, 8, 8),
    (torch.bfloat16, 8, 0, 8, 8),
    (torch.bfloat16, 12, 0, 4, 4),
    (torch.float32, 64, 0, 4, 4),
    (torch.float32, 70, 0, 2, 2),
    (torch.float16, 70, 0, 2, 2),
    (torch.float16, 3, 0, 1, 1),
    (torch.float16, 64, 2, 2, 8),  # x 4 bytes off a 16-byte boundary
    (torch.float32, 64, 1, 1, 4),
])
@pytest.mark.parametrize("mode", POOL_MODES)
def test_channels_last_pool_loads_the_widest_aligned_channel_run(dtype, channels, offset,
                                                                  vector, aligned, mode,
                                                                  monkeypatch):
    launched = []
    get_kernel = neighbourhood.get_kernel
    monkeypatch.setattr(neighbourhood, "get_kernel", lambda name, index, **target: (
        launched.append(name), get_kernel(name, index, **target))[1])
    _, knn = table_with_all_padding_node(channels + offset, nin=POOL_NIN, nout=25, k=7,
                                         padding=0.2)
    x, grad_y = pool_inputs(channels, 17, channels, knn, mode, dtype)
    native_x = offset_channels_last(x.to(DEVICE), offset)
    results = run_pool_kernels(native_x, in_storage(grad_y.to(DEVICE), "channels_last"), knn,
                               POOL_NIN, mode)
    codes, scalar = neighbourhood.POOL_MODE_CODES, SCALAR_TYPES[dtype]
    # max_relu's backward is max's
    backward_code = codes["max" if mode in MAX_POOL_MODES else mode]
    backward = vector if mode in MAX_POOL_MODES else aligned
    assert launched == [
        f"knnconv::knn_pool_forward_channels_last<{scalar}, {codes[mode]}, {vector}, "
        f"{neighbourhood.POOL_BATCH}>",
        f"knnconv::knn_pool_backward_channels_last<{scalar}, {backward_code}, {backward}, "
        f"{neighbourhood.POOL_BATCH}>"]
    for output in results:
        if output is not None:
            assert_storage(output, "channels_last")
    assert_pool_matches(results, reference_pool_results(x, grad_y, knn, POOL_NIN, mode), dtype,
                        mode)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", POOL_MODES)
@pytest.mark.parametrize("pool_batch", neighbourhood.POOL_BATCHES)
def test_channels_last_pool_gradient_of_many_pairs_per_input_node(dtype, mode, pool_batch,
                                                                   monkeypatch):
    # about 36 pairs read each input node (its gradient a long sum over them); 5 batch
    # elements leave a partial batch group for 2 and 4 per thread
    monkeypatch.setattr(neighbourhood, "POOL_BATCH", pool_batch)
    _, knn = table_with_all_padding_node(11, nin=POOL_NIN, nout=300, k=9, padding=0.2)
    x, grad_y = pool_inputs(64, 5, 64, knn, mode, dtype)
    results = run_pool_kernels(in_storage(x.to(DEVICE), "channels_last"),
                               in_storage(grad_y.to(DEVICE), "channels_last"), knn, POOL_NIN,
                               mode)
    for output in results:
        if output is not None:
            assert_storage(output, "channels_last")
    assert_pool_matches(results, reference_pool_results(x, grad_y, knn, POOL_NIN, mode), dtype,
                        mode)


@pytest.mark.parametrize("mode", POOL_MODES)
def test_pool_of_any_other_strides_takes_the_row_kernels_on_a_copy(mode):
    _, knn = table_with_all_padding_node(4, nin=POOL_NIN, nout=25, k=7, padding=0.2)
    x, grad_y = pool_inputs(5, 3, 8, knn, mode, torch.float32)
    strided = torch.empty(3, 8, 2 * POOL_NIN, device=DEVICE)[:, :, ::2].copy_(x.to(DEVICE))
    results = run_pool_kernels(strided, grad_y.to(DEVICE), knn, POOL_NIN, mode)
    for output in results:
        if output is not None:
            assert_storage(output, "contiguous")
    assert_pool_matches(results, reference_pool_results(x, grad_y, knn, POOL_NIN, mode),
                        torch.float32, mode)


@pytest.mark.parametrize("storage", STORAGES)
def test_max_pool_counts_ties_up_to_their_dtype_and_refuses_wider_windows(storage):
    limit = neighbourhood.MAX_TIED_NEIGHBOURS
    assert limit == 127
    knn = torch.arange(limit + 1)[:, None]  # one node reading every input, no padding
    x = in_storage(torch.ones(2, 8, limit + 1, dtype=torch.float16, device=DEVICE), storage)
    with pytest.raises(ValueError, match=f"at most K = {limit} neighbours, got K = {limit + 1}"):
        neighbourhood.pool_forward(x, knn.to(DEVICE, torch.int32), limit + 1, "max")
    # K = 127 equal maxima: the largest count, each input gets 1/127 of the gradient
    knn = knn[:limit]
    grad_y = in_storage(torch.full((2, 8, 1), 3.0, dtype=torch.float16, device=DEVICE), storage)
    y, ties, dx = run_pool_kernels(x, grad_y, knn, limit + 1, "max")
    assert torch.equal(y, torch.ones_like(y))
    assert torch.equal(ties, torch.full_like(ties, neighbourhood.CHOICE_TIED + limit))
    share = torch.tensor(3.0, device=DEVICE) / limit  # the kernel's fp32 quotient, then rounded
    expected = torch.full_like(dx, share.item())
    expected[:, :, limit] = 0.0  # read by no node
    assert torch.equal(dx, expected)
    # avg and sum count no ties: any K
    y, ties, _ = run_pool_kernels(x, grad_y, torch.arange(limit + 1)[:, None], limit + 1, "sum")
    assert ties is None and torch.equal(y, torch.full_like(y, limit + 1.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,channels", SIZES)
@pytest.mark.parametrize("collisions", [False, True])
@pytest.mark.parametrize("nout", NODES)
def test_depthwise_matches_float64(dtype, batch, channels, collisions, nout):
    check_depthwise_against_float64(dtype, batch, channels, collisions, nout)


@pytest.mark.parametrize("batch,channels", SIZES)
def test_depthwise_walks_more_row_groups_than_the_grid_has(batch, channels, monkeypatch):
    # each thread sums four batch elements of a channel; a grid of two CTA layers makes every
    # layer walk several such row groups (and the batch's last, partial group) by its stride
    monkeypatch.setattr(neighbourhood, "MAX_GRID_YZ", 2)
    check_depthwise_against_float64(torch.float16, batch, channels, True, NODES[0])


def check_depthwise_against_float64(dtype, batch, channels, collisions, nout):
    """KNNDepthwiseConv on the cuda kernels against torch ops in float64: y, dx, dW, d bias."""
    generator = torch.Generator().manual_seed(batch + channels)
    geometry, knn = table_with_all_padding_node(
        batch + 3 * channels, nin=60, nout=nout, k=7, v=9, padding=0.2, collisions=collisions)
    layer = KNNDepthwiseConv(channels, knn, geometry.rf_index, nin=60, v=9, backend="cuda")
    nn.init.normal_(layer.bias)
    reference = copy.deepcopy(layer).double()
    reference.backend = "torch_compact"
    layer.to(DEVICE, dtype)
    x = torch.randn(batch, channels, 60, generator=generator).to(dtype)
    grad_y = torch.randn(batch, channels, nout, generator=generator).to(dtype)
    native_x = x.to(DEVICE).requires_grad_()
    y = layer(native_x)
    y.backward(grad_y.to(DEVICE))
    assert layer.last_backend == "cuda" and y.dtype == dtype
    x64 = x.double().requires_grad_()
    reference.weight.data.copy_(layer.weight.detach().double())
    reference.bias.data.copy_(layer.bias.detach().double())
    reference(x64).backward(grad_y.double())
    y64 = reference(x64.detach())
    tolerance = TOLERANCE[dtype]
    assert rel_err(y.cpu(), y64) < tolerance
    for got, expected in ((native_x.grad, x64.grad), (layer.weight.grad, reference.weight.grad),
                          (layer.bias.grad, reference.bias.grad)):
        assert got.dtype == dtype
        assert rel_err(got.cpu(), expected) < tolerance


@pytest.mark.parametrize("frozen", ["x", "weight"])
def test_depthwise_computes_only_the_needed_gradients(frozen, monkeypatch):
    launched = []
    for name in ("depthwise_grad_input", "depthwise_grad_weight"):
        kernel = getattr(neighbourhood, name)
        monkeypatch.setattr(neighbourhood, name, lambda *args, kernel=kernel, name=name, **kw: (
            launched.append(name), kernel(*args, **kw))[1])
    geometry = random_geometry(torch.Generator().manual_seed(11), nin=40, nout=12, k=5)
    layer = KNNDepthwiseConv(4, geometry.knn_indices, geometry.rf_index, nin=40, v=geometry.v,
                             backend="cuda").to(DEVICE)
    reference = copy.deepcopy(layer).double()
    reference.backend = "torch_compact"
    x = torch.randn(9, 4, 40, device=DEVICE)
    grad_y = torch.randn(9, 4, 12, device=DEVICE)
    native_x, x64 = x.clone(), x.double()
    if frozen == "weight":
        for module in (layer, reference):
            module.weight.requires_grad_(False)
        native_x.requires_grad_(), x64.requires_grad_()
    layer(native_x).backward(grad_y)
    reference(x64).backward(grad_y.double())
    if frozen == "x":
        assert native_x.grad is None
        assert rel_err(layer.weight.grad, reference.weight.grad) < 1e-5
        assert launched == ["depthwise_grad_weight"]
    else:
        assert layer.weight.grad is None
        assert rel_err(native_x.grad, x64.grad) < 1e-5
        assert launched == ["depthwise_grad_input"]


def test_depthwise_under_autocast_promotes_like_torch_ops():
    geometry = random_geometry(torch.Generator().manual_seed(5), nin=40, nout=12, k=5)
    layer = KNNDepthwiseSeparableConv(4, 6, geometry.knn_indices, geometry.rf_index, nin=40,
                                      v=geometry.v).to(DEVICE)
    x = torch.randn(9, 4, 40, device=DEVICE, dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        native, native_depthwise = layer(x), layer.depthwise(x)
        native_backend = layer.depthwise.last_backend
        layer.depthwise.backend = "torch_compact"
        expected, expected_depthwise = layer(x), layer.depthwise(x)
    assert native_backend == "cuda" and native.dtype == expected.dtype
    # The separable layer's Linear returns fp16 under autocast whatever the depthwise part
    # computed in: the depthwise output itself must match torch ops' dtype.
    assert native_depthwise.dtype == expected_depthwise.dtype
    assert rel_err(native, expected) < 2e-3


def test_depthwise_auto_serves_float64_with_torch_ops():
    # float64, which the kernels lack: auto takes torch ops, and an explicit cuda refuses
    geometry = random_geometry(torch.Generator().manual_seed(12), nin=40, nout=12, k=5)
    layer = KNNDepthwiseConv(4, geometry.knn_indices, geometry.rf_index, nin=40,
                             v=geometry.v).to(DEVICE, torch.float64)
    y = layer(torch.randn(3, 4, 40, device=DEVICE, dtype=torch.float64))
    assert layer.last_backend == "torch_compact" and y.dtype == torch.float64
    layer.backend = "cuda"
    with pytest.raises(ValueError, match="float16/bfloat16/float32, got torch.float64"):
        layer(torch.randn(3, 4, 40, device=DEVICE, dtype=torch.float64))


def test_determinism_rules():
    geometry = random_geometry(torch.Generator().manual_seed(6), nin=40, nout=12, k=5)
    x = torch.randn(33, 8, 40, device=DEVICE, requires_grad=True)
    pool = KNNPool(geometry.knn_indices, nin=40, mode="avg").to(DEVICE)
    grads = []
    for _ in range(2):
        x.grad = None
        pool(x).square().sum().backward()
        grads.append(x.grad.clone())
    assert pool.last_backend == "cuda" and torch.equal(*grads)  # a gather: no atomics
    layer = KNNDepthwiseConv(8, geometry.knn_indices, geometry.rf_index, nin=40, v=geometry.v,
                             backend="cuda").to(DEVICE)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(ValueError, match="backend='torch_compact'"):
            layer(x)
        with torch.no_grad():  # no weight gradient, no atomics: the native kernels serve it
            layer(x)
        assert layer.last_backend == "cuda"
        layer.weight.requires_grad_(False)  # a trainable bias alone: a torch sum, no atomics
        layer(x).sum().backward()
        assert layer.last_backend == "cuda" and layer.bias.grad is not None
        layer.weight.requires_grad_(True)
        layer.backend = "auto"
        layer(x)
        assert layer.last_backend == "torch_compact"
    finally:
        torch.use_deterministic_algorithms(previous)


def test_empty_batch():
    geometry = random_geometry(torch.Generator().manual_seed(7), nin=40, nout=12, k=5)
    pool = KNNPool(geometry.knn_indices, nin=40).to(DEVICE)
    layer = KNNDepthwiseConv(3, geometry.knn_indices, geometry.rf_index, nin=40,
                             v=geometry.v).to(DEVICE)
    x = torch.randn(0, 3, 40, device=DEVICE, requires_grad=True)
    assert pool(x).shape == (0, 3, 12) and pool.last_backend == "cuda"
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 3, 12) and torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))


@pytest.mark.parametrize("mode", ["max", "avg"])
def test_native_pooling_and_depthwise_compile_without_graph_breaks(mode):
    # the native kernels run inside the custom ops: compiled steps match eager ones
    generator = torch.Generator().manual_seed(21)
    first = random_geometry(generator, nin=60, nout=30, k=7)
    pooling = random_geometry(generator, nin=30, nout=12, k=5)
    depthwise = random_geometry(generator, nin=12, nout=8, k=4)
    model = torch.nn.Sequential(
        KNNConv(3, 16, first.knn_indices, first.rf_index, nin=60, v=first.v),
        KNNPool(pooling.knn_indices, nin=30, mode=mode, backend="cuda"),
        KNNDepthwiseConv(16, depthwise.knn_indices, depthwise.rf_index, nin=12, v=depthwise.v,
                         backend="cuda"),
    ).to(DEVICE)
    x = torch.randn(9, 3, 60, device=DEVICE)

    def step(module):
        module.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            y = module(x)
        y.float().square().sum().backward()
        return [y.detach().float(), *(p.grad.clone() for p in module.parameters())]

    eager = step(model)
    torch.compiler.reset()
    # as in a process whose first call is compiled: the device probe must not break the graph
    get_ops("cuda")._device_reasons.clear()
    compiled = torch.compile(model, fullgraph=True)
    for got, expected in zip(step(compiled), eager, strict=True):
        assert rel_err(got, expected) < 1e-2
    assert model[1].last_backend == "cuda" and model[2].last_backend == "cuda"
