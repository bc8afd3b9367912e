"""Launches of compiled Triton kernels without Triton's per-call dispatch.

``kernel[grid](*args)`` binds the arguments, specialises each one, builds its cache key (the
compile options' ``str()`` among it) and checks the kernel's globals at every call, and each
host tensor descriptor is a dataclass validated as it is built: more host time than the
launch itself (bench/NOTES.md, 2026-12-07). A :class:`KernelLauncher` keys the compiled
specialisations by what Triton specialises on, or more finely:

- a tensor: its dtype and whether its address is a multiple of 16 bytes;
- an integer: whether it is 1, whether it is a multiple of 16, and its width (32 or 64 bits,
  signed or not);
- a :class:`Box` (a tensor descriptor): its dtype and block, and for each size and stride
  whether it is 1 and whether it is a multiple of 16;
- a float: its type (Triton does not specialise on it); any other argument (a bool, None):
  its type and value;
- the constexprs by name and value, the launch options and the current device.

The first call of a key goes through Triton's dispatch, which compiles the kernel or finds it
in its caches; later calls launch the compiled kernel through its launcher
(``CompiledKernel[grid]``, which still calls the launch hooks of Triton's knobs, as
profilers need). A box's tensor descriptor is built once per address, shape, strides and
block, and holds the address, not the tensor, so no cached descriptor keeps memory alive.
Under Triton's CPU interpreter every call is the interpreter's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

# cached descriptors of boxes: cleared when they grow past this many (a model's layers use a
# few per layer and batch size)
MAX_DESCRIPTORS = 4096
# where the key's device comes from: the device Triton's dispatch compiles and launches for
current_device = torch.cuda.current_device
INT32_RANGE = range(-2**31, 2**31)
INT64_RANGE = range(-2**63, 2**63)
# the keywords of a launch that are options, not parameters of the kernel
LAUNCH_OPTIONS = ("num_warps", "num_stages")


class Box(NamedTuple):
    """A TMA-boxed operand: ``tensor`` read as the 2-D view ``shape`` (row-major, ``strides``
    in elements, the last 1) in boxes of ``block``."""

    tensor: torch.Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block: tuple[int, ...]

    def descriptor(self) -> TensorDescriptor:
        return TensorDescriptor(self.tensor, list(self.shape), list(self.strides),
                                list(self.block))


class _Address:
    """Where a cached descriptor's rows start: what Triton's launcher reads of a descriptor's
    base (its address and element type), without a reference to the tensor."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


def _integer_key(value: int) -> tuple[bool, bool, bool, bool]:
    return value == 1, value % 16 == 0, value in INT32_RANGE, value in INT64_RANGE


_descriptors: dict[tuple, tuple[TensorDescriptor, tuple]] = {}


def _cached_descriptor(box: Box) -> tuple[TensorDescriptor, tuple]:
    """(descriptor, specialisation key) of ``box``, built on its first use."""
    tensor = box.tensor
    key = (tensor.data_ptr(), tensor.dtype, box.shape, box.strides, box.block)
    entry = _descriptors.get(key)
    if entry is None:
        if len(_descriptors) >= MAX_DESCRIPTORS:
            _descriptors.clear()
        descriptor = TensorDescriptor(_Address(key[0], tensor.dtype), list(box.shape),
                                      list(box.strides), list(box.block))
        spec = (tensor.dtype, box.block, tuple(
            (size == 1, size % 16 == 0) for size in box.shape + box.strides))
        entry = _descriptors[key] = (descriptor, spec)
    return entry


class KernelLauncher:
    """``launcher[grid](*args, num_warps=..., num_stages=..., **constexprs)`` launches
    ``kernel`` as ``kernel[grid](...)`` would, with Box arguments for its tensor
    descriptors; every parameter of the kernel is passed, the constexprs by name."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._names = tuple(kernel.arg_names) if isinstance(kernel, JITFunction) else None
        self._compiled: dict[tuple, object] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if self._names is None:  # the interpreter
            self.kernel[grid](*(arg.descriptor() if type(arg) is Box else arg for arg in args),
                              **kwargs)
            return
        values, spec = [], [current_device(), tuple(kwargs.items())]
        for arg in args:
            kind = type(arg)
            if kind is int:
                values.append(arg)
                spec.append(_integer_key(arg))
            elif kind is Box:
                descriptor, box_spec = _cached_descriptor(arg)
                values.append(descriptor)
                spec.append(box_spec)
            elif isinstance(arg, torch.Tensor):
                values.append(arg)
                spec.append((arg.dtype, arg.data_ptr() % 16 == 0))
            else:
                values.append(arg)
                spec.append((kind,) if kind is float else (kind, arg))
        key = tuple(spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            passed = len(args) + sum(name not in LAUNCH_OPTIONS for name in kwargs)
            if passed != len(self._names):
                raise TypeError(f"{self.kernel.__name__}: pass every parameter "
                                f"({', '.join(self._names)}), got {passed}")
            compiled = self.kernel[grid](
                *(arg.descriptor() if type(arg) is Box else arg for arg in args), **kwargs)
            if getattr(compiled, "function", None) is not None:
                self._compiled[key] = compiled
            return
        values.extend(kwargs[name] for name in self._names[len(args):])
        compiled[grid + (1,) * (3 - len(grid))](*values)
