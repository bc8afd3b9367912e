"""The dispatcher's auto policy where the native kernels cannot run on a CUDA device."""

from __future__ import annotations

import warnings

import pytest
import torch

import knnconv
from conftest import random_geometry
from knnconv import get_ops
from knnconv.ops import dispatch

GPU = torch.device("cuda", 0)


@pytest.fixture
def plan(rng):
    return random_geometry(rng, nin=40, nout=12, k=5, v=8).plan(cin=8, cout=16)


@pytest.fixture
def device_reason(monkeypatch):
    """The cuda backend on a stand-in device 0 that it cannot serve, and no warnings given yet."""
    reasons = {0: "the 'cuda' backend needs CuPy"}
    monkeypatch.setattr(get_ops("cuda"), "device_reason", reasons.get)
    monkeypatch.setattr(dispatch, "_warned_devices", set())
    return reasons


def test_auto_warns_once_when_a_gpu_cannot_run_the_native_kernels(plan, device_reason):
    with pytest.warns(RuntimeWarning, match="cuda:0, where the native kernels cannot run: "
                                            "the 'cuda' backend needs CuPy"):
        ops = dispatch.resolve_backend("auto", plan, GPU, torch.float16, batch=4)
    assert ops.name == "torch_compact"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.resolve_backend("auto", plan, GPU, torch.float16, batch=4) is ops
    device_reason[0] = "needs compute capability >= (8, 0), device 0 has (7, 5)"
    with pytest.warns(RuntimeWarning, match="compute capability"):  # a new reason is new news
        dispatch.resolve_backend("auto", plan, GPU, torch.float16, batch=4)


def test_auto_stays_quiet_for_a_call_the_kernels_decline_on_a_capable_gpu(plan, device_reason):
    device_reason[0] = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops = dispatch.resolve_backend("auto", plan, GPU, torch.float32, batch=4)
    assert ops.name == "torch_compact"  # float32 operands: the documented torch path


def test_a_named_cuda_backend_raises_with_the_reason(plan, device_reason):
    with pytest.raises(ValueError, match="backend 'cuda' cannot run this call: the 'cuda' "
                                         "backend needs CuPy"):
        dispatch.resolve_backend("cuda", plan, GPU, torch.float16, batch=4)


def test_eager_auto_takes_the_triton_kernels_only_for_calls_of_enough_work():
    suits = dispatch.triton_suits
    plan = random_geometry(torch.Generator().manual_seed(2), nin=60, nout=30, k=9).plan(
        cin=64, cout=64)
    per_sample = 2 * plan.entry_count * plan.cin * plan.cout
    enough = -(-int(dispatch.TRITON_MIN_FORWARD_FLOP) // per_sample)
    assert suits(plan, enough) and not suits(plan, enough - 1)
    torch.use_deterministic_algorithms(True)
    try:  # the cuda backend refuses its atomics there: the deterministic kernels serve
        assert suits(plan, 1)
    finally:
        torch.use_deterministic_algorithms(False)


def test_replayed_auto_takes_the_triton_kernels_where_cells_have_pairs():
    suits = dispatch.triton_suits
    generator = torch.Generator().manual_seed(2)
    plan = random_geometry(generator, nin=60, nout=30, k=9).plan(cin=64, cout=64)
    # two nodes of two neighbours over 36 cells: the step is the weight's, cuda keeps it
    sparse = random_geometry(generator, nin=4, nout=2, k=2, v=36).plan(cin=64, cout=64)
    assert plan.nout * plan.k >= plan.v and sparse.nout * sparse.k < sparse.v
    with knnconv.context.using(graph_replay=True):
        assert suits(plan, 1) and suits(plan, None) and not suits(sparse, 2**20)
    # call by call again (eager, or compiled in torch.compile's default mode): by work
    assert not suits(plan, 1) and not suits(plan, None)


@pytest.mark.parametrize("batch_kind", ["static", "dynamic", "unbacked"])
def test_compiled_auto_compares_the_batches_it_can_guard_on(batch_kind):
    """Traced by Dynamo, the batch is an int, a symbol or an unbacked (data-dependent) symbol,
    each passed off as an int. The rule for steps run call by call compares the first two
    (Dynamo guards on the outcome and compiles again across the threshold) and keeps the cuda
    kernels for the third, on which no guard can be placed; under graph_replay the replayed
    rule, which reads no batch. No graph break in any case."""
    plan = random_geometry(torch.Generator().manual_seed(2), nin=60, nout=30, k=9).plan(
        cin=64, cout=64)
    enough = -(-int(dispatch.TRITON_MIN_FORWARD_FLOP)
               // (2 * plan.entry_count * plan.cin * plan.cout))

    def choice(x):
        return x.sum() + (1.0 if dispatch.triton_suits(plan, x.shape[0]) else -1.0)

    for replay in (False, True):
        torch._dynamo.reset()
        with knnconv.context.using(graph_replay=replay):
            compiled = torch.compile(choice, fullgraph=True, backend="eager",
                                     dynamic=batch_kind == "dynamic")
            for batch in (enough - 1, enough, 2 * enough):
                x = torch.zeros(batch)
                if batch_kind == "unbacked":
                    torch._dynamo.decorators.mark_unbacked(x, 0)
                comparable = batch_kind != "unbacked" and batch >= enough
                expected = 1.0 if replay or comparable else -1.0
                assert compiled(x).item() == expected, (replay, batch)


def test_auto_leaves_stems_to_the_cuda_kernels_but_for_large_narrow_replayed_forward_or_big_calls():
    suits = dispatch.triton_suits
    generator = torch.Generator().manual_seed(3)
    stem = random_geometry(generator, nin=60, nout=30, k=9).plan(cin=3, cout=64)
    wide = random_geometry(generator, nin=60, nout=30, k=9).plan(cin=3, cout=96)
    # 24 channels run the zero-padded gather-GEMM, not the few-channel forward
    padded = random_geometry(generator, nin=60, nout=30, k=9).plan(cin=24, cout=64)
    rows = -(-dispatch.FEW_CHANNEL_MIN_ROWS // stem.nout)
    with knnconv.context.using(graph_replay=True):  # a replayed step, with or without dx
        assert suits(stem, rows) and not suits(stem, rows - 1) and suits(stem, None)
        assert not suits(wide, 2**20)
    # eager: the triton calls cost the host more, paid back from enough forward work
    flop_per_image = 2 * stem.entry_count * stem.cin * stem.cout
    enough = -(-int(dispatch.FEW_CHANNEL_MIN_TRAIN_FLOP) // flop_per_image)
    assert enough > rows
    assert suits(stem, enough) and not suits(stem, enough - 1) and not suits(stem, rows)
    assert not suits(stem, None) and not suits(wide, 2**30)
    # forward only: the few-channel kernel, from enough output rows, up to 64 channels
    assert suits(stem, rows, backward=False) and not suits(stem, rows - 1, backward=False)
    assert suits(stem, None, backward=False) and not suits(wide, 2**20, backward=False)
    assert not suits(padded, 2**20, backward=False) and not suits(padded, None, backward=False)
    torch.use_deterministic_algorithms(True)
    try:  # deterministic: the triton kernels are the only native ones that serve it
        assert suits(stem, 1)
    finally:
        torch.use_deterministic_algorithms(False)
