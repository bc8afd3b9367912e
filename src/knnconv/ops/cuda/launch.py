"""Raw kernel launches: how one kernel is issued, and how its operands are handed to it.

Kernel arguments go to cuLaunchKernel (through CuPy's driver binding) as raw device pointers
and integers, skipping DLPack export and CuPy's argument handling, so torch dtypes CuPy lacks
(bfloat16) pass untouched. Everything runs on PyTorch's current stream of the tensors' device.

- :func:`launch_kernel`, :func:`memset_zero`: one launch, one memset;
- :class:`Gemm`: one gathered-GEMM kernel of a plan (:class:`~.launch_plan.GemmPlan`);
- :class:`Transpose`: the re-layout kernels (transpose_pad, transpose_pairs: transpose, dtype
  conversion and zero padding fused), their tiles and grids;
- :func:`device_limits`: what the planners need to know of a device;
- operands as the kernels read them: :func:`data_pointer`, :func:`readable` (in place), the
  bias (:func:`bias_as_read`), NaN-poisoned outputs.
"""

from __future__ import annotations

import math
import threading
from functools import cache

import numpy as np
import torch

from ..registry import channels_fastest
from .build import CompiledKernel, get_kernel, import_cupy, kernel_target, transpose_name
from .launch_plan import MAX_GRID_YZ, DeviceLimits, GemmPlan, kernel_name

# kLogTransposeElements, kTransposeThreads in knn_common.cuh
LOG_TRANSPOSE_ELEMENTS, TRANSPOSE_THREADS = 10, 256
# A summing transpose runs about this many CTAs per SM (enough to fill it), each looping over
# a tiles, so each z_sums address takes as few atomics as that allows.
SUMMING_CTAS_PER_SM = 16
PAIRS_TILE = 64  # kPairsTile in knn_common.cuh
# transpose_pad's square tile is 2^5 a side; extents narrower than that get narrow tiles,
# and only problems wide in both extents (the square tile) take transpose_pairs.
SQUARE_TILE_LOG2 = 5
MAX_KERNEL_ARGS = 20  # the parameter slots of one launch (see _ThreadLaunchState)
VECTOR_BYTES = 16  # every staged run is whole 16-byte chunks


class _ThreadLaunchState(threading.local):
    """One thread's launch state: the kernel-parameter buffer (8-byte value slots, and the
    array of pointers to them that cuLaunchKernel reads; it copies the values at launch, so
    slots are reusable) and the devices whose primary context is bound to the thread."""

    def __init__(self) -> None:
        self.values = np.zeros(MAX_KERNEL_ARGS, dtype=np.uint64)
        self.pointers = self.values.ctypes.data + 8 * np.arange(MAX_KERNEL_ARGS, dtype=np.uint64)
        self.parameters = self.pointers.ctypes.data
        self.bound_devices: set[int] = set()


_thread_state = _ThreadLaunchState()


def launch_kernel(kernel: CompiledKernel, device_index: int, grid: tuple, block: tuple,
                  shared: int, args: tuple[int, ...]) -> None:
    """cuLaunchKernel on torch's current stream of the device.

    Every argument is a non-negative int in its own 8-byte little-endian slot: device pointers
    and int64 use all of it, int32 parameters read its first 4 bytes.
    """
    state = _thread_state
    state.values[: len(args)] = args
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    _on_device(device_index, kernel.launch, grid, block, shared, stream, state.parameters)


def memset_zero(pointer: int, nbytes: int, device_index: int) -> None:
    """cudaMemsetAsync(0) on torch's current stream of the device (capturable in a graph)."""
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    _on_device(device_index, import_cupy().cuda.runtime.memsetAsync, pointer, 0, nbytes, stream)


def _on_device(device_index: int, issue, *args) -> None:
    """issue(*args) with the device current and its primary context bound to this thread.

    A training step of a small layer is ~10 launches and host-bound, so the common case (the
    device already current, its context bound) costs two lookups before the driver call.
    """
    if torch._C._cuda_getDevice() == device_index:  # torch.cuda.current_device() minus a layer
        if device_index not in _thread_state.bound_devices:
            _bind_context(device_index)
        issue(*args)
    else:
        with torch.cuda.device(device_index):
            _bind_context(device_index)
            issue(*args)


def _bind_context(device_index: int) -> None:
    """Make the device's primary context current on this thread, once per thread and device.

    cuLaunchKernel needs a current context; PyTorch never sets one on a thread whose current
    device it did not have to change (a new thread using device 0), so the first launch from
    such a thread would fail with CUDA_ERROR_INVALID_CONTEXT. cudaSetDevice of the device
    already current binds its primary context without changing anything else.
    """
    bound = _thread_state.bound_devices
    if device_index not in bound:
        import_cupy().cuda.runtime.setDevice(device_index)
        bound.add(device_index)


def data_pointer(tensor: torch.Tensor | None) -> int:
    """The tensor's device address, 0 (a null pointer argument) for None."""
    return 0 if tensor is None else tensor.data_ptr()


@cache
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@cache
def shared_memory_limit(device_index: int) -> int:
    """Dynamic shared memory one block may opt in to on this device."""
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


@cache
def capability(device_index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device_index))


def device_limits(device_index: int) -> DeviceLimits:
    """What the launch planners need to know of a device."""
    return DeviceLimits(multiprocessors(device_index), shared_memory_limit(device_index),
                        capability(device_index))


class Gemm:
    """One gathered-GEMM launch of a plan, its kernel built for the compute ``dtype`` (and the
    ``out_dtype`` it stores, where the family takes one)."""

    def __init__(self, plan: GemmPlan, dtype, device_index: int,
                 out_dtype: torch.dtype | None = None) -> None:
        self.kernel = get_kernel(kernel_name(plan.family, dtype, plan.cfg, out_dtype,
                                             grad_in_place=plan.grad_in_place), device_index,
                                 **kernel_target(plan.family))
        self.kernel.allow_shared_memory(plan.shared_bytes)
        self.shared = plan.shared_bytes
        self.device_index, self.grid, self.block = device_index, plan.grid, plan.block

    def __call__(self, *args: int) -> None:
        launch_kernel(self.kernel, self.device_index, self.grid, self.block, self.shared, args)


def transpose_tile_log2(dst_a: int, dst_c: int) -> tuple[int, int]:
    """log2 of transpose_pad's tile extents (a, c): 32 x 32, or as narrow as a small extent
    (a few nodes, cells or batch rows) and correspondingly long, so no thread idles."""
    narrow = SQUARE_TILE_LOG2
    if dst_c < 2**narrow:
        log_c = (dst_c - 1).bit_length()
        return LOG_TRANSPOSE_ELEMENTS - log_c, log_c
    if dst_a < 2**narrow:
        log_a = (dst_a - 1).bit_length()
        return log_a, LOG_TRANSPOSE_ELEMENTS - log_a
    return narrow, LOG_TRANSPOSE_ELEMENTS - narrow


class Transpose:
    """dst[z, c, a] = src[z, a, c] for every (z, a, c) of ``dst_extents``, zero wherever it
    lies past ``src_extents``. Extents are (z, a, c); dst_strides are dst's (z, c) strides
    (its a stride is 1); the source strides are given per call.

    Two kernels: transpose_pad with a tile shaped to the extents, and, where both extents are
    wide and a call's strides and addresses allow two-element accesses, transpose_pairs.
    """

    def __init__(self, src_dtype, dst_dtype, device_index: int, src_extents, dst_extents,
                 dst_strides, *, sums_z: bool = False) -> None:
        """sums_z: the calls pass z_sums; few CTAs along a then share each z's atomics."""
        dst_z, dst_a, dst_c = dst_extents
        if dst_z > MAX_GRID_YZ:  # one z per CTA layer; the kernels loop over a, not z
            raise ValueError(f"a re-layout of {dst_z} matrices exceeds CUDA's grid limit "
                             f"({MAX_GRID_YZ}); split the batch")
        self.kernel = get_kernel(transpose_name(src_dtype, dst_dtype), device_index,
                                 **kernel_target("transpose"))
        self.device_index = device_index
        log_a, log_c = transpose_tile_log2(dst_a, dst_c)
        self.grid = self._grid(1 << log_a, 1 << log_c, dst_extents, sums_z)
        self.static = (*src_extents, dst_a, dst_c, *dst_strides)
        self.log_tile_a, self.log_tile_c = log_a, log_c
        self.pairs_kernel = None
        square = (SQUARE_TILE_LOG2, SQUARE_TILE_LOG2)
        if (log_a, log_c) == square and all(stride % 2 == 0 for stride in dst_strides):
            self.pairs_kernel = get_kernel(transpose_name(src_dtype, dst_dtype, pairs=True),
                                           device_index, **kernel_target("transpose"))
            self.pairs_grid = self._grid(PAIRS_TILE, PAIRS_TILE, dst_extents, sums_z)
            self.pair_bytes = (2 * src_dtype.itemsize, 2 * dst_dtype.itemsize)

    def _grid(self, tile_a: int, tile_c: int, dst_extents, sums_z: bool) -> tuple:
        dst_z, dst_a, dst_c = dst_extents
        c_tiles, a_tiles = -(-dst_c // tile_c), -(-dst_a // tile_a)
        if sums_z:
            wanted = SUMMING_CTAS_PER_SM * multiprocessors(self.device_index)
            a_tiles = min(a_tiles, -(-wanted // (c_tiles * dst_z)))
        return c_tiles, min(a_tiles, MAX_GRID_YZ), dst_z  # CTAs loop over a with gridDim.y

    def __call__(self, src: torch.Tensor, dst: int, src_strides, z_sums: int = 0) -> None:
        """dst and z_sums are device addresses (z_sums: float32 [z], 0 for none)."""
        self.launch_raw(src.data_ptr(), dst, src_strides, z_sums)

    def uses_pairs(self, src: int, dst: int, src_strides) -> bool:
        """Whether a call with these addresses and source strides takes transpose_pairs."""
        stride_z, stride_a, stride_c = src_strides
        return (self.pairs_kernel is not None and stride_c == 1 and stride_a % 2 == 0
                and stride_z % 2 == 0 and src % self.pair_bytes[0] == 0
                and dst % self.pair_bytes[1] == 0)

    def kernel_and_tile(self, src: int, dst: int, src_strides) -> tuple[str, tuple[int, int]]:
        """The kernel a call with these addresses and strides runs, and its (a, c) tile."""
        if self.uses_pairs(src, dst, src_strides):
            return "transpose_pairs", (PAIRS_TILE, PAIRS_TILE)
        return "transpose_pad", (1 << self.log_tile_a, 1 << self.log_tile_c)

    def launch_raw(self, src: int, dst: int, src_strides, z_sums: int = 0) -> None:
        z, a, c, dst_a, dst_c, dst_sz, dst_sc = self.static
        if self.uses_pairs(src, dst, src_strides):
            launch_kernel(self.pairs_kernel, self.device_index, self.pairs_grid,
                          (TRANSPOSE_THREADS, 1, 1), 0, (src, dst, z, a, c, src_strides[0],
                                                         src_strides[1], dst_a, dst_c, dst_sz,
                                                         dst_sc, z_sums))
            return
        launch_kernel(self.kernel, self.device_index, self.grid, (TRANSPOSE_THREADS, 1, 1), 0,
                      (src, dst, z, a, c, *src_strides, dst_a, dst_c, dst_sz, dst_sc, z_sums,
                       self.log_tile_c))


def readable(t: torch.Tensor) -> bool:
    """Whether the kernels read [B, C, N] t in place: channels-last storage (any batch stride)
    whose every node row starts on a 16-byte boundary (the address, the batch stride and the
    channel count allow it)."""
    per_vector = VECTOR_BYTES // t.element_size()
    return (channels_fastest(t) and t.data_ptr() % VECTOR_BYTES == 0
            and t.shape[1] % per_vector == 0
            and (t.shape[0] == 1 or t.stride(0) % per_vector == 0))


def bias_read_dtype(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a forward kernel of compute ``dtype`` reads ``bias`` in: its own if fp32 or
    the compute dtype (both added in fp32), else fp32."""
    if bias is None:
        return None
    return bias.dtype if bias.dtype in (dtype, torch.float32) else torch.float32


def bias_as_read(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``bias`` as the kernel reads bias[o]: contiguous, converted only where it must be."""
    if bias is None:
        return None
    read = bias_read_dtype(bias, dtype)
    return bias if bias.dtype == read and bias.is_contiguous() else bias.to(read).contiguous()


def biased_kernel_key(key: tuple, bias: torch.Tensor | None, dtype: torch.dtype) -> tuple:
    """A forward kernel's key with how it reads the bias (fp32, the compute dtype, absent)."""
    read = bias_read_dtype(bias, dtype)
    return (*key, None if read is None else read == torch.float32)


def poisoned_or_empty_output(shape: tuple, dtype: torch.dtype, device: torch.device,
                             poison: bool) -> torch.Tensor:
    """y [B, Cout, Nout] as the view of a contiguous [B, Nout, Cout] buffer (the storage the
    kernels write), NaN-filled when ``poison``."""
    batch, cout, nout = shape
    y = torch.empty(batch, nout, cout, dtype=dtype, device=device).transpose(1, 2)
    return y.fill_(math.nan) if poison else y
