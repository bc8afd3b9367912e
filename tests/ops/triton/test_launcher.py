"""knnconv.ops.triton.launcher without a GPU: which calls reuse a compiled specialisation and
which go back to Triton's dispatch, what the compiled kernel's launcher is passed, and that a
cached descriptor keeps no tensor alive. A stand-in kernel records both kinds of launch; the
real kernels' launches through it run in tests/ops/triton/test_triton_gpu.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from knnconv.ops.triton import launcher  # noqa: E402
from knnconv.ops.triton.launcher import Box, KernelLauncher  # noqa: E402


class Compiled:
    def __init__(self, log):
        self.function = object()
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class RecordingKernel(JITFunction):
    """A JITFunction's face (arg_names, [grid](...)) over a log, compiling nothing."""

    def __init__(self, names):
        self.arg_names = list(names)
        self.__name__ = "recording_kernel"
        self.log = []

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.log.append(("dispatched", grid, args, kwargs))
            return Compiled(self.log)
        return dispatch


@pytest.fixture(autouse=True)
def one_device(monkeypatch):
    monkeypatch.setattr(launcher, "current_device", lambda: 0)
    launcher._descriptors.clear()


def box(t: torch.Tensor, block=(16, 16)) -> Box:
    return Box(t, tuple(t.shape), (t.shape[1], 1), block)


def kinds(kernel) -> list[str]:
    return [entry[0] for entry in kernel.log]


def test_a_repeated_call_launches_the_compiled_kernel_with_every_parameter_in_order():
    kernel = RecordingKernel(["a_desc", "y_ptr", "n", "BLOCK", "FLAG"])
    launch = KernelLauncher(kernel)
    a = torch.zeros(32, 64, dtype=torch.float16)
    y = torch.zeros(64)
    for _ in range(2):
        launch[(5,)](box(a), y, 48, BLOCK=16, FLAG=True, num_warps=4, num_stages=3)
    assert kinds(kernel) == ["dispatched", "direct"]
    _, grid, dispatched_args, kwargs = kernel.log[0]
    assert isinstance(dispatched_args[0], TensorDescriptor)
    assert dispatched_args[0].base is a
    assert kwargs == dict(BLOCK=16, FLAG=True, num_warps=4, num_stages=3)
    _, grid, args = kernel.log[1]
    assert grid == (5, 1, 1)
    descriptor, *rest = args
    assert isinstance(descriptor, TensorDescriptor)
    assert descriptor.base.data_ptr() == a.data_ptr()
    assert list(descriptor.shape) == [32, 64] and list(descriptor.strides) == [64, 1]
    assert list(descriptor.block_shape) == [16, 16]
    assert rest == [y, 48, 16, True]


@pytest.mark.parametrize("change", [
    "integer_one", "integer_not_multiple_of_16", "integer_past_32_bits", "dtype",
    "misaligned_address", "box_block", "box_stride_not_multiple_of_16", "constexpr",
    "launch_option", "device", "bool_value"])
def test_a_call_triton_could_specialise_differently_goes_back_to_its_dispatch(change,
                                                                              monkeypatch):
    kernel = RecordingKernel(["a_desc", "y_ptr", "n", "flag", "BLOCK"])
    launch = KernelLauncher(kernel)
    storage = torch.zeros(32 * 80 + 8)
    y = storage[:64]

    def call(a_box=None, y=y, n=48, flag=False, block=16, warps=4):
        a_box = a_box or box(torch.zeros(32, 64, dtype=torch.float16))
        launch[(1, 2)](a_box, y, n, flag, BLOCK=block, num_warps=warps, num_stages=2)

    call()
    call(n=64)  # the same specialisation: 64 and 48 are both multiples of 16
    changed = {
        "integer_one": lambda: call(n=1),
        "integer_not_multiple_of_16": lambda: call(n=50),
        "integer_past_32_bits": lambda: call(n=2**32),
        "dtype": lambda: call(y=y.half()),
        "misaligned_address": lambda: call(y=storage[1:65]),
        "box_block": lambda: call(box(torch.zeros(32, 64, dtype=torch.float16), (32, 16))),
        "box_stride_not_multiple_of_16": lambda: call(
            Box(torch.zeros(32 * 72, dtype=torch.float16), (32, 64), (72, 1), (16, 16))),
        "constexpr": lambda: call(block=32),
        "launch_option": lambda: call(warps=8),
        "device": lambda: (monkeypatch.setattr(launcher, "current_device", lambda: 1),
                           call()),
        "bool_value": lambda: call(flag=True),
    }[change]
    changed()
    assert kinds(kernel) == ["dispatched", "direct", "dispatched"]
    changed()
    assert kinds(kernel) == ["dispatched", "direct", "dispatched", "direct"]


def test_a_call_missing_a_parameter_is_refused():
    launch = KernelLauncher(RecordingKernel(["y_ptr", "n", "BLOCK"]))
    with pytest.raises(TypeError, match="pass every parameter"):
        launch[(1,)](torch.zeros(4), 4, num_warps=4)


def test_a_cached_descriptor_keeps_no_tensor_alive():
    kernel = RecordingKernel(["a_desc", "BLOCK"])
    launch = KernelLauncher(kernel)
    a = torch.zeros(32, 64, dtype=torch.float16)
    alive = weakref.ref(a)
    for _ in range(2):
        launch[(1,)](box(a), BLOCK=16, num_warps=4)
    kernel.log.clear()
    del a
    gc.collect()
    assert alive() is None
    assert len(launcher._descriptors) == 1


def test_the_interpreter_gets_every_call_with_tensor_descriptors():
    calls = []

    class Interpreted:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    launch = KernelLauncher(Interpreted())
    a = torch.zeros(32, 64, dtype=torch.float16)
    for _ in range(2):
        launch[(3,)](box(a), 7, BLOCK=16, num_warps=4)
    assert len(calls) == 2
    for grid, (descriptor, n), kwargs in calls:
        assert grid == (3,) and n == 7 and descriptor.base is a
        assert kwargs == dict(BLOCK=16, num_warps=4)
