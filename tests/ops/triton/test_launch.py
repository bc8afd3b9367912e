"""knnconv.ops.triton.launch.run_kernel, the one way the triton backend launches a kernel: a
launch of a known key goes to the compiled kernel with every parameter in signature order;
any argument that may change Triton's specialisation gives a new key (so a kernel compiled
for one is never launched with the other); a call whose constexprs are out of order is refused.
Stand-in kernels record the calls, so no GPU or compiler is needed."""

from __future__ import annotations

import pytest
import torch

from knnconv.ops.triton import backend

if backend.launch is None:
    pytest.skip(f"triton backend unavailable: {backend.MISSING}", allow_module_level=True)

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from knnconv.ops.triton import launch  # noqa: E402


class StandInKernel:
    """A JIT function's launch surface: kernel[grid](...) compiles (here: records) and
    returns the compiled kernel, whose [grid](...) launches with every parameter in order."""

    def __init__(self, *arg_names: str) -> None:
        self.arg_names = list(arg_names)
        self.fn = self
        self.__name__ = "stand_in_kernel"
        self.compiles: list[tuple] = []
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        def jit_launch(*args, **kwargs):
            self.compiles.append((grid, args, kwargs))
            return Compiled(self)
        return jit_launch


class Compiled:
    def __init__(self, kernel: StandInKernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args: self.kernel.launches.append((grid, args))


@pytest.fixture
def compiled_path(monkeypatch):
    """run_kernel as on a GPU: no interpreter, an empty cache, device 0."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_a_known_key_launches_the_compiled_kernel_with_every_parameter_in_order(
        compiled_path):
    kernel = StandInKernel("x_ptr", "n", "BM", "BN")
    x = torch.zeros(64, dtype=torch.float16)
    launch.run_kernel(kernel, (3, 1, 1), (x, 32), {"BM": 64, "BN": 16}, warps=4, stages=2)
    launch.run_kernel(kernel, (5, 2, 1), (x, 48), {"BM": 64, "BN": 16}, warps=4, stages=2)
    assert kernel.compiles == [((3, 1, 1), (x, 32),
                                {"BM": 64, "BN": 16, "num_warps": 4, "num_stages": 2})]
    assert kernel.launches == [((5, 2, 1), (x, 48, 64, 16))]


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block)


@pytest.mark.parametrize("changed", [
    "int_one", "int_multiple_of_16", "int_size", "dtype", "pointer_alignment", "descriptor_block",
    "descriptor_shape", "descriptor_dtype", "constexpr", "warps", "stages"])
def test_anything_triton_specialises_on_gives_a_new_key(compiled_path, changed):
    kernel = StandInKernel("t_ptr", "d", "n", "BM")
    buffer = torch.zeros(4096, dtype=torch.float16)
    base = dict(t=buffer[:64], d=_descriptor(buffer.view(64, 64), [16, 16]), n=48, BM=64,
                warps=4, stages=2)
    other = dict(base)
    other.update({
        "int_one": {"n": 1}, "int_multiple_of_16": {"n": 40}, "int_size": {"n": 48 + 2**32},
        "dtype": {"t": torch.zeros(64, dtype=torch.bfloat16)},
        "pointer_alignment": {"t": buffer[1:65]},
        "descriptor_block": {"d": _descriptor(buffer.view(64, 64), [32, 16])},
        "descriptor_shape": {"d": _descriptor(buffer[:40 * 64].view(40, 64), [16, 16])},
        "descriptor_dtype": {"d": _descriptor(buffer.view(torch.bfloat16).view(64, 64),
                                              [16, 16])},
        "constexpr": {"BM": 128}, "warps": {"warps": 8}, "stages": {"stages": 3},
    }[changed])
    for call in (base, other):
        launch.run_kernel(kernel, (1,), (call["t"], call["d"], call["n"]), {"BM": call["BM"]},
                          warps=call["warps"], stages=call["stages"])
    assert len(kernel.compiles) == 2 and not kernel.launches


def test_new_storage_of_the_same_class_reuses_the_compiled_kernel(compiled_path):
    kernel = StandInKernel("t_ptr", "d", "BM")
    for _ in range(3):
        t = torch.zeros(4096, dtype=torch.float16)
        launch.run_kernel(kernel, (1,), (t, _descriptor(t.view(64, 64), [16, 16])), {"BM": 16},
                          warps=4)
    assert len(kernel.compiles) == 1 and len(kernel.launches) == 2


def test_constexprs_out_of_signature_order_are_refused(compiled_path):
    kernel = StandInKernel("x_ptr", "BM", "BN")
    with pytest.raises(TypeError, match=r"constexprs \['BM', 'BN'\] in signature order"):
        launch.run_kernel(kernel, (1,), (torch.zeros(4),), {"BN": 16, "BM": 64}, warps=4)


def test_an_argument_of_no_known_class_is_refused(compiled_path):
    with pytest.raises(TypeError, match="no launch class for a str"):
        launch.run_kernel(StandInKernel("s", "BM"), (1,), ("text",), {"BM": 16}, warps=4)
