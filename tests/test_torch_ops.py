"""The custom ops: opcheck, and torch.compile(fullgraph=True) of KNNConv networks against eager."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import knnconv
import knnconv.torch_ops  # noqa: F401  (registers the ops this module checks)
from conftest import CPU_BACKENDS, CopyKeepingOps, random_geometry, rel_err
from knnconv.pool import POOL_MODES


def small_network(backend: str, generator: torch.Generator) -> torch.nn.Module:
    first = random_geometry(generator, nin=30, nout=12, k=5, v=9, padding=0.1)
    second = random_geometry(generator, nin=12, nout=5, k=4, v=4)
    return torch.nn.Sequential(
        knnconv.KNNConv(3, 6, first.knn_indices, first.rf_index, nin=30, v=9, backend=backend),
        torch.nn.ReLU(),
        knnconv.KNNConv(6, 4, second.knn_indices, second.rf_index, nin=12, v=4, bias=False,
                        backend=backend),
    ).double()


def gradients(model, x):
    x = x.clone().requires_grad_()
    model.zero_grad()
    y = model(x)
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).cos()).sum().backward()
    return [y.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compiled_network_matches_eager_without_graph_breaks(backend, rng):
    model = small_network(backend, rng)
    x = torch.randn(5, 3, 30, generator=rng, dtype=torch.float64)
    eager = gradients(model, x)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for got, expected in zip(gradients(compiled, x), eager, strict=True):
        assert rel_err(got, expected) < 1e-12
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_inductor_compiled_network_matches_eager(backend, rng):
    # Inductor, unlike aot_eager, lays out buffers from the fake implementations and asserts
    # the real ops' strides match them; the second layer's input is the first's transposed
    # output, as in any KNN network.
    model = small_network(backend, rng)
    x = torch.randn(5, 3, 30, generator=rng, dtype=torch.float64)
    eager = gradients(model, x)
    torch.compiler.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    for got, expected in zip(gradients(compiled, x), eager, strict=True):
        assert rel_err(got, expected) < 1e-12


def test_inductor_takes_a_registered_backends_channel_major_output(rng, monkeypatch):
    # a backend may return y contiguous as [B, Cout, Nout]; the op hands inductor the layout
    # its fake promises
    from knnconv.ops.torch_compact import TorchCompactOps

    class ChannelMajorOps(TorchCompactOps):
        name = "channel_major"

        def forward(self, plan, x, weight, bias):
            return super().forward(plan, x, weight, bias).contiguous()

    ops = ChannelMajorOps()
    monkeypatch.setitem(knnconv.ops.registry._REGISTRY, ops.name, ops)
    model = small_network(ops.name, rng)
    x = torch.randn(5, 3, 30, generator=rng, dtype=torch.float64)
    eager = gradients(model, x)
    assert model[0](x).is_contiguous()  # eager hands the backend's layout on
    torch.compiler.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    for got, expected in zip(gradients(compiled, x), eager, strict=True):
        assert rel_err(got, expected) < 1e-12


def test_dynamic_batch_recompiles_at_most_once(rng):
    model = small_network("torch_compact", rng)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for batch in (2, 3, 5, 8):
        x = torch.randn(batch, 3, 30, generator=rng, dtype=torch.float64)
        assert rel_err(compiled(x), model(x)) < 1e-12
    assert counter.frame_count <= 2


def test_one_compiled_function_serves_many_plans(rng):
    # One piece of code called with ever new plans: dynamo makes an int that changes between
    # calls symbolic, and a plan that travelled as an int was lost there; its handle, a
    # string, stays a constant (one graph per plan).
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(knnconv.knn_conv, fullgraph=True, backend=counter)
    for _ in range(4):
        plan = random_geometry(rng, nin=30, nout=12, k=5, v=9).plan(cin=3, cout=4)
        x = torch.randn(2, 3, 30, generator=rng, dtype=torch.float64)
        weight = torch.randn(4, plan.q, generator=rng, dtype=torch.float64)
        expected = knnconv.knn_conv(x, weight, None, plan)
        assert rel_err(compiled(x, weight, None, plan), expected) < 1e-12
    assert counter.frame_count == 4


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_opcheck(backend, rng):
    geometry = random_geometry(rng, nin=20, nout=7, k=5, v=9, padding=0.2)
    plan = geometry.plan(cin=3, cout=4)
    contiguous = torch.randn(2, 3, 20, generator=rng)
    weight = torch.randn(4, plan.q, generator=rng)
    bias = torch.randn(4, generator=rng)
    transposed = contiguous.transpose(1, 2).contiguous().transpose(1, 2)
    for x in (contiguous, transposed):
        forward_args = (x, weight, bias, plan.handle, backend, torch.float32, True)
        torch.library.opcheck(torch.ops.knnconv.forward.default, forward_args)
        y, saved = torch.ops.knnconv.forward(*forward_args)
        for bias_dtype in (torch.float32, None):  # with and without the bias gradient
            for dx_channels_last in (True, False):
                torch.library.opcheck(torch.ops.knnconv.backward.default,
                                      (torch.randn_like(y), x, saved, weight, plan.handle,
                                       backend, torch.float32, True, True, bias_dtype,
                                       dx_channels_last))


@pytest.mark.parametrize("batch", [0, 17])
def test_fake_forward_gives_a_cuda_re_layout_shape(batch, rng):
    # The real cuda op returns x's re-layout [Cin*Nin + 1, padded batch] for the backward, or
    # an empty placeholder for an empty batch (served with x itself); the fake gives that form
    # (it is not compared with a real call here: that needs a GPU).
    from torch._subclasses.fake_tensor import FakeTensorMode

    geometry = random_geometry(rng, nin=30, nout=12, k=5, v=9)
    plan = knnconv.make_plan(geometry.knn_indices, geometry.rf_index, nin=30, v=9, cin=3,
                             cout=6)
    with FakeTensorMode():
        x = torch.empty(batch, 3, 30, dtype=torch.float16)
        weight = torch.empty(6, 27, dtype=torch.float16)
        _, saved = torch.ops.knnconv.forward(x, weight, None, plan.handle, "cuda",
                                             torch.float16, True)
    if batch == 0:
        assert saved.shape == (0,)
    else:
        assert saved.shape[0] == 3 * 30 + 1 and saved.shape[1] >= batch
        assert saved.shape[1] % 16 == 0


@pytest.mark.parametrize("keep", [True, False])
def test_a_compiled_layer_keeping_its_relayout_does_not_also_save_its_input(rng, monkeypatch,
                                                                            keep):
    ops = CopyKeepingOps()
    monkeypatch.setitem(knnconv.ops.registry._REGISTRY, ops.name, ops)
    layer = small_network(ops.name, rng)[0]
    x = torch.randn(5, 3, 30, generator=rng, dtype=torch.float64)
    eager = gradients(layer, x)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with knnconv.keep_input_relayout(keep):
        for got, expected in zip(gradients(compiled, x), eager, strict=True):
            assert rel_err(got, expected) < 1e-12
        saved, leaf = [], x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.data_ptr()) or t, lambda t: t):
            compiled(leaf)
    # the copy replaces x among what the backward keeps; without it, x itself is kept
    assert (leaf.data_ptr() in saved) is not keep


def neighbourhood_network(backend: str, generator: torch.Generator,
                          mode: str) -> torch.nn.Module:
    """KNNConv -> KNNPool -> KNNDepthwiseConv: the pooling reads the convolution's
    channels-last output, the depthwise layer the pooling's."""
    first = random_geometry(generator, nin=30, nout=14, k=5, v=9, padding=0.1)
    pooling = random_geometry(generator, nin=14, nout=8, k=4, padding=0.2)
    depthwise = random_geometry(generator, nin=8, nout=5, k=3, v=4)
    return torch.nn.Sequential(
        knnconv.KNNConv(3, 6, first.knn_indices, first.rf_index, nin=30, v=9, backend=backend),
        knnconv.KNNPool(pooling.knn_indices, nin=14, mode=mode, backend=backend),
        knnconv.KNNDepthwiseConv(6, depthwise.knn_indices, depthwise.rf_index, nin=8, v=4,
                                 backend=backend),
    ).double()


@pytest.mark.parametrize("mode", POOL_MODES)
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_pooling_and_depthwise_match_eager_without_graph_breaks(mode, compiler, rng):
    model = neighbourhood_network("torch_compact", rng, mode)
    x = torch.randn(5, 3, 30, generator=rng, dtype=torch.float64)
    eager = gradients(model, x)
    torch.compiler.reset()
    counter = CompileCounterWithBackend(compiler)
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for got, expected in zip(gradients(compiled, x), eager, strict=True):
        assert rel_err(got, expected) < 1e-12
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_pooling_and_depthwise_opcheck(backend, rng):
    geometry = random_geometry(rng, nin=20, nout=7, k=5, v=9, padding=0.2)
    pooling = knnconv.plan.NeighbourhoodPlan(geometry.knn_indices, nin=20)
    depthwise = knnconv.plan.NeighbourhoodPlan(geometry.knn_indices, nin=20,
                                               rf_index=geometry.rf_index, v=9)
    contiguous = torch.randn(2, 3, 20, generator=rng)
    channels_last = contiguous.transpose(1, 2).contiguous().transpose(1, 2)
    weight, bias = torch.randn(3, 9, generator=rng), torch.randn(3, generator=rng)
    for x in (contiguous, channels_last):
        for mode in POOL_MODES:
            args = (x, pooling.handle, backend, mode)
            torch.library.opcheck(torch.ops.knnconv.pool_forward.default, args)
            y, ties = torch.ops.knnconv.pool_forward(*args)
            assert knnconv.ops.registry.is_channels_last(y) == (x is channels_last)
            for layout in (True, False):
                torch.library.opcheck(torch.ops.knnconv.pool_backward.default,
                                      (torch.randn_like(y), x, y, ties, pooling.handle,
                                       backend, mode, layout))
        args = (x, weight, bias, depthwise.handle, backend, torch.float32)
        torch.library.opcheck(torch.ops.knnconv.depthwise_forward.default, args)
        y = torch.ops.knnconv.depthwise_forward(*args)
        for bias_dtype in (torch.float32, None):
            torch.library.opcheck(torch.ops.knnconv.depthwise_backward.default,
                                  (torch.randn_like(y), x, weight, depthwise.handle, backend,
                                   torch.float32, True, True, bias_dtype))


def test_dx_comes_in_the_storage_of_x_eager_and_compiled(rng):
    model = small_network("torch_compact", rng)
    contiguous = torch.randn(4, 3, 30, generator=rng, dtype=torch.float64)
    channels_last = contiguous.transpose(1, 2).contiguous().transpose(1, 2)
    torch.compiler.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    for module in (model, compiled):
        for source, expected in ((contiguous, False), (channels_last, True)):
            x = source.detach().requires_grad_()
            module(x).sum().backward()
            assert knnconv.ops.registry.is_channels_last(x.grad) == expected


def test_pooling_keeps_its_input_storage_on_every_path(rng):
    geometry = random_geometry(rng, nin=20, nout=7, k=5, padding=0.2)
    pool = knnconv.KNNPool(geometry.knn_indices, nin=20, mode="max").double()
    contiguous = torch.randn(2, 4, 20, generator=rng, dtype=torch.float64)
    channels_last = contiguous.transpose(1, 2).contiguous().transpose(1, 2)
    for x in (contiguous, channels_last):
        x = x.detach().requires_grad_()
        y = pool(x)
        y.backward(torch.randn_like(y))
        expected = knnconv.ops.registry.is_channels_last(x)
        assert knnconv.ops.registry.is_channels_last(y) == expected
        assert knnconv.ops.registry.is_channels_last(x.grad) == expected


def test_batch_norm_opcheck(rng):
    # x as the router hands it: [B, C, N, 1] in torch.channels_last; float32 and bfloat16 input
    # (float32 parameters and statistics, as under autocast)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 6, 11, 1, generator=rng).to(dtype).contiguous(
            memory_format=torch.channels_last)
        weight, bias = torch.randn(6, generator=rng), torch.randn(6, generator=rng)
        running_mean, running_var = torch.randn(6, generator=rng), torch.rand(6, generator=rng)
        forward_args = (x, weight, bias, running_mean, running_var, 0.1, 1e-5)
        torch.library.opcheck(torch.ops.knnconv.batch_norm_train.default, forward_args)
        y, mean, invstd, reserve, _, _ = torch.ops.knnconv.batch_norm_train(*forward_args)
        for needs in ((True, True, True), (True, False, False), (False, True, True)):
            torch.library.opcheck(torch.ops.knnconv.batch_norm_train_backward.default,
                                  (torch.randn_like(y), x, weight, mean, invstd, reserve, 1e-5,
                                   *needs))


def test_batch_norm_op_updates_no_input_and_matches_torch(rng):
    x = torch.randn(4, 5, 9, 1, generator=rng, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last).requires_grad_()
    weight = torch.randn(5, generator=rng, dtype=torch.float64).requires_grad_()
    bias = torch.randn(5, generator=rng, dtype=torch.float64).requires_grad_()
    running = [torch.randn(5, generator=rng, dtype=torch.float64),
               torch.rand(5, generator=rng, dtype=torch.float64)]
    before = [t.clone() for t in running]
    y, _, _, _, mean, var = torch.ops.knnconv.batch_norm_train(x, weight, bias, *running, 0.3,
                                                                1e-5)
    assert all(torch.equal(t, b) for t, b in zip(running, before, strict=True))
    expected_running = [t.clone() for t in before]
    expected = torch.nn.functional.batch_norm(x, *expected_running, weight, bias, True, 0.3,
                                              1e-5)
    assert y.stride() == x.stride()
    assert rel_err(y, expected) < 1e-12
    assert rel_err(mean, expected_running[0]) < 1e-12 and rel_err(var, expected_running[1]) < 1e-12
    grad_y = torch.randn(y.shape, generator=rng, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, weight, bias), grad_y)
    want = torch.autograd.grad(expected, (x, weight, bias), grad_y)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < 1e-12
