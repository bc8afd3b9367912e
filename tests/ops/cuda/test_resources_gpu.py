"""Long-running resource checks of the cuda backend (marker: gpu): memory and caches stay
flat over many steps with varying batch sizes, nothing stale is reused, and threads that
first-use a kernel together compile it once."""

from __future__ import annotations

import threading

import pytest
import torch

import knnconv
from conftest import random_geometry, rel_err

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

from knnconv.ops.cuda import build  # noqa: E402

DEVICE = torch.device("cuda")
BATCHES = (1, 17, 33, 64, 129)


def two_layers_on_one_input(generator):
    geometry = random_geometry(generator, nin=80, nout=30, k=9, padding=0.05)
    return [knnconv.KNNConv(8, cout, geometry.knn_indices, geometry.rf_index, nin=80, v=9,
                            backend="cuda").to(DEVICE, torch.float16) for cout in (16, 24)]


def test_ten_thousand_steps_do_not_grow_memory_or_caches():
    layers = two_layers_on_one_input(torch.Generator().manual_seed(21))
    optimizer = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=1e-4)

    def step(batch):
        x = torch.randn(batch, 8, 80, device=DEVICE, dtype=torch.float16, requires_grad=True)
        loss = sum(layer(x).float().square().mean() for layer in layers)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(200):
        step(BATCHES[i % len(BATCHES)])
    torch.cuda.synchronize()
    memory, kernels = torch.cuda.memory_allocated(), build.compiled_kernel_count()
    launches = [len(layer.plan.on(DEVICE).derived["cuda.launches"]._plans) for layer in layers]
    for i in range(10_000):
        step(BATCHES[i % len(BATCHES)])
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= memory + 2**20
    assert build.compiled_kernel_count() == kernels
    assert [len(layer.plan.on(DEVICE).derived["cuda.launches"]._plans)
            for layer in layers] == launches


def test_freed_input_memory_reused_by_another_tensor_gives_its_own_result():
    # Each input is a new tensor over the same memory, as when the caching allocator hands a
    # freed block back (which it does not promise to do): equal address, a fresh version
    # counter and, once the old one is deleted, possibly the same Python id.
    layer = two_layers_on_one_input(torch.Generator().manual_seed(22))[0]
    reference = knnconv.get_ops("reference")
    memory = torch.empty(33 * 8 * 80, device=DEVICE, dtype=torch.float16).untyped_storage()
    for seed in range(3):
        values = torch.randn(33, 8, 80, device=DEVICE, generator=torch.Generator(DEVICE)
                             .manual_seed(seed)).half()
        x = torch.empty(0, device=DEVICE, dtype=torch.float16).set_(memory, 0, (33, 8, 80))
        x.copy_(values)
        expected = reference.forward(layer.plan, values.double(), layer.weight.double(),
                                     layer.bias.double())
        assert rel_err(layer(x), expected) < 2e-3
        del x


def counting_module_builds(monkeypatch) -> list[str]:
    """The kernel names handed to CuPy's RawModule from now on, one entry per module built."""
    built = []
    cupy = build.import_cupy()
    build_module = cupy.RawModule

    def counting(*args, **kwargs):
        built.extend(kwargs["name_expressions"])
        return build_module(*args, **kwargs)

    monkeypatch.setattr(cupy, "RawModule", counting)
    return built


def test_threads_asking_for_one_kernel_build_it_once(monkeypatch):
    # Straight at build.get_kernel: through a layer, its launch-plan lock would serialise the
    # threads before they reach the compile lock this checks.
    knnconv.ops.cuda.clear_kernel_cache()
    built = counting_module_builds(monkeypatch)
    name = build.transpose_name(torch.float16, torch.float32)
    kernels, barrier = [None, None], threading.Barrier(2)

    def run(slot):
        barrier.wait()
        kernels[slot] = build.get_kernel(name, 0, **build.kernel_target("transpose"))

    threads = [threading.Thread(target=run, args=(slot,)) for slot in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert built == [name]
    assert kernels[0] is kernels[1]


def test_threads_first_using_one_layer_both_get_its_result(monkeypatch):
    # The layer's launch-plan lock already serialises these threads, so this cannot catch a
    # broken compile lock; test_threads_asking_for_one_kernel_build_it_once does.
    layer = two_layers_on_one_input(torch.Generator().manual_seed(23))[1]
    knnconv.ops.cuda.clear_kernel_cache()
    compiled = counting_module_builds(monkeypatch)
    x = torch.randn(250, 8, 80, device=DEVICE, dtype=torch.float16)  # a batch not used before
    expected = knnconv.get_ops("reference").forward(layer.plan, x.double(),
                                                    layer.weight.double(), layer.bias.double())
    results, barrier = [None, None], threading.Barrier(2)

    def run(slot):
        barrier.wait()
        with torch.no_grad():
            results[slot] = layer(x)
        torch.cuda.synchronize()

    threads = [threading.Thread(target=run, args=(slot,)) for slot in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert any("knn_forward" in name for name in compiled)
    assert sorted(compiled) == sorted(set(compiled)), "a kernel was compiled twice"
    assert build.compiled_kernel_count() == len(compiled)
    for result in results:
        assert rel_err(result, expected) < 2e-3


def test_without_the_input_relayout_a_forward_holds_no_copy_of_its_inputs():
    generator = torch.Generator().manual_seed(23)
    geometry = random_geometry(generator, nin=500, nout=200, k=9, padding=0.05)
    layers = [knnconv.KNNConv(32, 32, geometry.knn_indices, geometry.rf_index, nin=500, v=9,
                              backend="cuda", bias=False).to(DEVICE, torch.float16)
              for _ in range(3)]
    inputs = [torch.randn(64, 32, 500, generator=generator).to(DEVICE, torch.float16)
              for _ in layers]
    grads = [torch.randn(64, 32, 200, generator=generator).to(DEVICE, torch.float16)
             for _ in layers]
    held, gradients = {}, {}
    for keep in (True, False, True):  # the first step compiles and verifies the kernels
        with knnconv.keep_input_relayout(keep):
            leaves = [x.clone().requires_grad_() for x in inputs]
            for layer in layers:
                layer.weight.grad = None
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            outputs = [layer(x) for layer, x in zip(layers, leaves, strict=True)]
            held[keep] = torch.cuda.memory_allocated() - before
            torch.autograd.backward(outputs, grads)
        gradients[keep] = [x.grad for x in leaves] + [layer.weight.grad for layer in layers]
    input_bytes = sum(x.numel() * x.element_size() for x in inputs)
    assert held[True] - held[False] >= input_bytes  # one re-layout (>= x, padded) per layer
    for got, expected in zip(gradients[False], gradients[True], strict=True):
        assert rel_err(got, expected) < 1e-3  # the same kernels, atomics in another order
