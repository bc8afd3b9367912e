"""The host path: launches of planned kernels, operand re-layouts and raw-pointer launches.

A launch (:class:`ForwardLaunch`, :class:`BackwardLaunch`) takes its plan from
:mod:`.launch_plan` (tiles, padding, grids: everything that depends only on sizes and the
device), builds the kernels, re-layouts and workspace it names once, and running it allocates
the buffers and issues the launches. The registry ops cache plans
per layer and batch, so a call costs little more than its launches. Kernel arguments go to
cuLaunchKernel (through CuPy's driver binding) as raw device pointers and integers, skipping
DLPack export and CuPy's argument handling, so torch dtypes CuPy lacks (bfloat16) pass
untouched. Every re-layout is one launch (transpose, dtype conversion and zero padding fused:
transpose_pad, or transpose_pairs where strides allow two-element accesses); a channels-last
x's re-layout also takes a memset of xt's zero row. Everything runs on PyTorch's current
stream of the tensors' device.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import cache, partial

import numpy as np
import torch

from ...plan import SLOT_ALIGN
from ..registry import channels_fastest
from .build import (
    CompiledKernel,
    get_kernel,
    import_cupy,
    kernel_name,
    kernel_target,
    transpose_name,
)
from .configs import KernelConfig
from .launch_plan import (
    MAX_GRID_YZ,
    DeviceLimits,
    GemmPlan,
    plan_backward,
    plan_forward,
    round_up,
)

COMPUTE_DTYPES = (torch.float16, torch.bfloat16)
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


def _launch(kernel: CompiledKernel, device_index: int, grid: tuple, block: tuple, shared: int,
            args: tuple[int, ...]) -> None:
    """cuLaunchKernel on torch's current stream of the device.

    Every argument is a non-negative int in its own 8-byte little-endian slot: device pointers
    and int64 use all of it, int32 parameters read its first 4 bytes.
    """
    state = _thread_state
    state.values[: len(args)] = args
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    _on_device(device_index, kernel.launch, grid, block, shared, stream, state.parameters)


def _zero(pointer: int, nbytes: int, device_index: int) -> None:
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


def _pointer(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


@cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@cache
def _shared_memory_limit(device_index: int) -> int:
    """Dynamic shared memory one block may opt in to on this device."""
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


@cache
def _capability(device_index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device_index))


def device_limits(device_index: int) -> DeviceLimits:
    """What the launch planners need to know of a device."""
    return DeviceLimits(_multiprocessors(device_index), _shared_memory_limit(device_index),
                        _capability(device_index))


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


class _Transpose:
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
        self.kernel = get_kernel(transpose_name(src_dtype, dst_dtype), device_index)
        self.device_index = device_index
        log_a, log_c = transpose_tile_log2(dst_a, dst_c)
        self.grid = self._grid(1 << log_a, 1 << log_c, dst_extents, sums_z)
        self.static = (*src_extents, dst_a, dst_c, *dst_strides)
        self.log_tile_a, self.log_tile_c = log_a, log_c
        self.pairs_kernel = None
        square = (SQUARE_TILE_LOG2, SQUARE_TILE_LOG2)
        if (log_a, log_c) == square and all(stride % 2 == 0 for stride in dst_strides):
            self.pairs_kernel = get_kernel(transpose_name(src_dtype, dst_dtype, pairs=True),
                                           device_index)
            self.pairs_grid = self._grid(PAIRS_TILE, PAIRS_TILE, dst_extents, sums_z)
            self.pair_bytes = (2 * src_dtype.itemsize, 2 * dst_dtype.itemsize)

    def _grid(self, tile_a: int, tile_c: int, dst_extents, sums_z: bool) -> tuple:
        dst_z, dst_a, dst_c = dst_extents
        c_tiles, a_tiles = -(-dst_c // tile_c), -(-dst_a // tile_a)
        if sums_z:
            wanted = SUMMING_CTAS_PER_SM * _multiprocessors(self.device_index)
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
            _launch(self.pairs_kernel, self.device_index, self.pairs_grid,
                    (TRANSPOSE_THREADS, 1, 1), 0, (src, dst, z, a, c, src_strides[0],
                                                   src_strides[1], dst_a, dst_c, dst_sz, dst_sc,
                                                   z_sums))
            return
        _launch(self.kernel, self.device_index, self.grid, (TRANSPOSE_THREADS, 1, 1), 0,
                (src, dst, z, a, c, *src_strides, dst_a, dst_c, dst_sz, dst_sc, z_sums,
                 self.log_tile_c))


def _weight_transposed(cout: int, q: int, cpad: int, src_dtype, dtype, device_index: int):
    """W [Cout, Q] -> wt [Q, cpad]: output channels contiguous, zero columns past Cout."""
    return _Transpose(src_dtype, dtype, device_index, (1, cout, q), (1, cpad, q), (0, cpad))


def _weight_by_cell(cout: int, cin: int, v: int, gpad: int, cinpad: int, src_dtype, dtype,
                    device_index: int):
    """W [Cout, Cin*V] -> wr [V, gpad, cinpad], wr[v, o, c] = W[o, c*V + v], zero past Cout
    and Cin. Source strides per call: (W.stride(0), V * W.stride(1), W.stride(1))."""
    return _Transpose(src_dtype, dtype, device_index, (cout, cin, v), (gpad, cinpad, v),
                      (cinpad, gpad * cinpad))


class _Gemm:
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
        _launch(self.kernel, self.device_index, self.grid, self.block, self.shared, args)


@dataclass
class TransposedInput:
    """x re-laid out for the kernels: xt [Cin*Nin + 1, bpad], batch contiguous, a zero last row.

    The forward returns it so the backward reuses it instead of re-laying out x again.
    """

    xt: torch.Tensor
    batch: int
    cin: int
    nin: int

    @property
    def bpad(self) -> int:
        return self.xt.shape[1]

    def original(self) -> torch.Tensor:
        """x [B, Cin, Nin] as a (strided) view of xt."""
        return self.xt[:-1, : self.batch].t().reshape(self.batch, self.cin, self.nin)


class _InputLayout:
    """x [B, Cin, Nin] -> TransposedInput with a given padded batch and dtype.

    x whose channel and node axes are contiguous takes one transpose of its [B, Cin*Nin]
    rows. x with channels fastest (channels-last storage, as a KNN convolution returns y)
    takes one transpose per input node, read along its channels, and a memset of the zero
    row, where x's storage can differ from contiguous storage (Cin > 1, Nin > 1) and the
    grid holds a CTA layer per node; any other x is made contiguous first.

    ``spare_bytes``: extra room allocated behind xt (256-byte aligned) for a caller's
    temporary, so the call allocates once; its address is ``spare_address(xt)``.
    """

    def __init__(self, batch: int, cin: int, nin: int, bpad: int, src_dtype, dtype,
                 device_index: int, spare_bytes: int = 0) -> None:
        rows = cin * nin
        self.shape, self.dtype = (rows + 1, bpad), dtype
        self.batch, self.cin, self.nin = batch, cin, nin
        self.device_index = device_index
        item = dtype.itemsize
        self.spare_offset = round_up((rows + 1) * bpad * item, 256)
        self.storage_rows = (-(-(self.spare_offset + spare_bytes) // (bpad * item))
                             if spare_bytes else 0)
        self.transpose = _Transpose(src_dtype, dtype, device_index, (1, batch, rows),
                                    (1, bpad, rows + 1), (0, bpad))
        # xt[c*Nin + m, b] = x[b, c, m] as dst[m, c, b] = src[m, b, c]: rows c*Nin + m only,
        # so the zero row is written apart
        self.by_node = (_Transpose(src_dtype, dtype, device_index, (nin, batch, cin),
                                   (nin, bpad, cin), (bpad, nin * bpad))
                        if cin > 1 and 1 < nin <= MAX_GRID_YZ else None)
        self.zero_row_offset, self.zero_row_bytes = rows * bpad * item, bpad * item

    def write(self, x, address: int) -> None:
        """Re-lay out x (a tensor or another TransposedInput) into ``address``."""
        if isinstance(x, TransposedInput):
            x = x.original()
        batch_stride, channel_stride, node_stride = x.stride()
        if channel_stride == 1 and self.by_node is not None:
            self.by_node(x, address, (node_stride, batch_stride, channel_stride))
            _zero(address + self.zero_row_offset, self.zero_row_bytes, self.device_index)
            return
        if node_stride != 1 or channel_stride != x.shape[2]:
            x = x.contiguous()
        self.transpose(x, address, (0, x.stride(0), 1))

    def __call__(self, x) -> TransposedInput:
        if isinstance(x, TransposedInput) and x.xt.shape == self.shape and (
                x.xt.dtype == self.dtype):
            return x
        if self.storage_rows:
            xt = torch.empty((self.storage_rows, self.shape[1]), dtype=self.dtype,
                             device=x.device)[: self.shape[0]]
        else:
            xt = torch.empty(self.shape, dtype=self.dtype, device=x.device)
        self.write(x, xt.data_ptr())
        return TransposedInput(xt, self.batch, self.cin, self.nin)

    def spare_address(self, xt: torch.Tensor) -> int:
        return xt.data_ptr() + self.spare_offset


def transposed_input(x: torch.Tensor, bpad: int, dtype: torch.dtype) -> TransposedInput:
    batch, cin, nin = x.shape
    return _InputLayout(batch, cin, nin, bpad, x.dtype, dtype, x.device.index)(x)


@dataclass
class ReverseTables:
    """The reversed graph: input node m is read by the (output node, cell) pairs
    pair_start[m] <= j < pair_start[m + 1]; padding neighbours are left out."""

    pair_start: torch.Tensor  # int32 [Nin + 1]
    pair_node: torch.Tensor  # int32 [pairs]
    pair_cell: torch.Tensor  # int32 [pairs]


def reverse_tables(knn_indices: torch.Tensor, rf_index: torch.Tensor, nin: int) -> ReverseTables:
    k, nout = knn_indices.shape
    neighbour = knn_indices.t().reshape(-1).long()  # pair order (n, k)
    real = neighbour != nin
    neighbour = neighbour[real]
    node = torch.arange(nout, device=knn_indices.device).repeat_interleave(k)[real]
    cell = rf_index.reshape(-1).long()[real]
    order = torch.sort(neighbour, stable=True).indices
    counts = torch.bincount(neighbour, minlength=nin)
    start = torch.zeros(nin + 1, dtype=torch.int64, device=knn_indices.device)
    start[1:] = torch.cumsum(counts, 0)
    return ReverseTables(start.int(), node[order].int().contiguous(),
                         cell[order].int().contiguous())


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


class ForwardLaunch:
    """The forward of one (layer sizes, batch, dtype, device): x and W re-layouts + gathered
    GEMM. wt lives in spare room allocated behind xt: one allocation besides y.

    Its plan (launch_plan.plan_forward): the padded batch also fits the default backward
    tiles, so the backward reuses xt; each node runs ``slots`` (its Cin*K real slots; default
    all P64) rounded up to the K tile.
    """

    def __init__(self, *, batch: int, cin: int, nin: int, cout: int, nout: int, q: int,
                 p64: int, dtype: torch.dtype, device: torch.device,
                 config: KernelConfig | None = None, nodes_per_cta: int | None = None,
                 slots: int | None = None) -> None:
        self.plan = plan = plan_forward(
            batch=batch, cin=cin, nin=nin, cout=cout, nout=nout, p64=p64,
            device=device_limits(device.index), config=config, nodes_per_cta=nodes_per_cta,
            slots=slots)
        self.cfg, self.slots = plan.gemm.cfg, plan.slots
        self.nodes_per_cta = plan.gemm.nodes_per_cta
        self.batch, self.bpad, self.cpad = batch, plan.bpad, plan.cpad
        self.cout, self.nout, self.p64, self.dtype = cout, nout, p64, dtype
        self.y_shape = (batch, cout, nout)
        self.weight_layout = _weight_transposed(cout, q, self.cpad, dtype, dtype, device.index)
        wt_bytes = q * self.cpad * dtype.itemsize
        self.input_layout = _InputLayout(batch, cin, nin, plan.bpad, dtype, dtype,
                                         device.index, spare_bytes=wt_bytes)
        self.gemm = _Gemm(plan.gemm, dtype, device.index)
        # What names the kernel a call runs, but for how it reads the bias (see kernel_key): the
        # paths it takes at run time, walking nodes or not, a column pair per store (even
        # Cout) or element stores. CudaOps verifies each on its first use.
        self._kernel_key = ("forward", dtype, self.cfg, device, self.nodes_per_cta > 1,
                            cout % 2 == 0)

    def kernel_key(self, bias: torch.Tensor | None) -> tuple:
        """The kernel a call with ``bias`` runs: the bias read as fp32, as x's dtype, or absent
        are paths of their own."""
        return biased_kernel_key(self._kernel_key, bias, self.dtype)

    def run(self, x, weight, bias, input_linear, weight_linear, *, poison_output=False):
        """bias: None or any float dtype (see bias_as_read)."""
        dtype = self.dtype
        saved = self.input_layout(x)
        wt = self.input_layout.spare_address(saved.xt)
        if weight.dtype != dtype:
            weight = weight.to(dtype)
        self.weight_layout(weight, wt, (0, weight.stride(0), weight.stride(1)))
        y = poisoned_or_empty_output(self.y_shape, dtype, x.device, poison_output)
        bias = bias_as_read(bias, dtype)
        self.gemm(saved.xt.data_ptr(), wt, input_linear.data_ptr(), weight_linear.data_ptr(),
                  _pointer(bias), int(bias is not None and bias.dtype == torch.float32),
                  y.data_ptr(), self.batch, self.bpad, self.cout, self.cpad, self.nout, self.p64,
                  self.slots, self.nodes_per_cta)
        return y, saved


def _dx_restore_geometry(gathered: bool, channels_last: bool, batch: int, cin: int, nin: int,
                         bpad: int):
    """(extents, dst strides, staging strides) of the transpose (see :class:`_Transpose`) that
    restores dx [B, Cin, Nin], contiguous or in channels-last storage, from its staging:
    [B, Nin, Cin] where gathered, [Cin*Nin, bpad] (batch fastest) where scattered."""
    rows = cin * nin
    if gathered and channels_last:  # the staging is laid out as dx: one flat row per batch row
        return (batch, rows, 1), (rows, 0), (rows, 1, 0)
    if gathered:
        return (batch, nin, cin), (rows, nin), (rows, cin, 1)
    if not channels_last:
        return (1, rows, batch), (0, rows), (0, bpad, 1)
    if nin <= MAX_GRID_YZ:  # a CTA layer per node: read along the batch, written along channels
        return (nin, cin, batch), (cin, rows), (bpad, nin * bpad, 1)
    # more nodes than the grid has layers: a layer per batch row, read along nodes
    return (batch, cin, nin), (rows, cin), (1, nin * bpad, bpad)


class BackwardLaunch:
    """The backward of one (layer sizes, batch, dtypes, device, needed gradients).

    dx comes from the forward kernel run over the reversed graph (algorithm 'gather': no
    atomics, each element written once) or, for few input channels, from slot gradients
    scattered with fp32 atomics ('scatter'); dW from the slot-tiled kernel with fp32 atomics,
    the batch split over gridDim.y (ksplit); the bias gradient from grad_y's re-layout (fp32
    atomics, one per transpose block). All accumulate in fp32 and are converted to
    grad_dtypes = (dx, dW, dbias dtypes) by the launches that restore their layouts (gathered
    dx by its kernel's store when dx has the compute dtype: ``staging_dtype``). Every
    temporary lives in one workspace allocation whose accumulators are zeroed by one memset.
    dx is contiguous, or with ``dx_channels_last`` the [B, Cin, Nin] view of a contiguous
    [B, Nin, Cin] buffer (as a channels-last x is stored), written so by the same restore.
    With ``grad_y_in_place`` (dW and the bias gradient only, Cout a multiple of 8), dW reads
    channels-last grad_y itself (:func:`readable`) instead of a re-layout of it, and the bias
    gradient is an fp32 sum of it.
    """

    def __init__(self, *, batch: int, cin: int, nin: int, cout: int, nout: int, q: int,
                 p64: int, dtype: torch.dtype, device: torch.device, need_input: bool = True,
                 need_weight: bool = True, need_bias: bool = False, algorithm: str | None = None,
                 input_config: KernelConfig | None = None,
                 weight_config: KernelConfig | None = None, ksplit: int | None = None,
                 nodes_per_cta: int | None = None,
                 grad_dtypes=(torch.float32, torch.float32, torch.float32),
                 batch_padding: int | None = None, dx_channels_last: bool = False,
                 grad_y_in_place: bool = False) -> None:
        """batch_padding: the padded batch to use where the tiles allow it (that of a
        forward's kept re-layout of x, so the backward reuses it), else the smallest."""
        self.grad_y_in_place = grad_y_in_place
        index = device.index
        self.plan = plan = plan_backward(
            batch=batch, cin=cin, nin=nin, cout=cout, nout=nout, q=q, p64=p64,
            element_bytes=dtype.itemsize, device=device_limits(index), need_input=need_input,
            need_weight=need_weight, need_bias=need_bias,
            dx_in_compute_dtype=grad_dtypes[0] == dtype, algorithm=algorithm,
            input_config=input_config, weight_config=weight_config, ksplit=ksplit,
            nodes_per_cta=nodes_per_cta, batch_padding=batch_padding,
            grad_y_in_place=grad_y_in_place)
        self.workspace = plan.workspace
        self.bpad, self.gpad = bpad, gpad = plan.bpad, plan.gpad
        self.algorithm, self.need_input, self.need_weight = plan.algorithm, need_input, need_weight
        self.need_bias = need_bias
        self.batch, self.cin, self.nin, self.cout, self.q, self.p64 = batch, cin, nin, cout, q, p64
        self.dtype, self.grad_dtypes, self.device = dtype, grad_dtypes, device
        rows = cin * nin
        if need_weight:  # x's re-layout, unless a forward's kept one is reused
            self.input_layout = _InputLayout(batch, cin, nin, bpad, dtype, dtype, index)
        self.to_gt = _Transpose(dtype, dtype, index, (cout, batch, nout), (gpad, bpad, nout),
                                (bpad, gpad * bpad), sums_z=need_bias)
        # grad_y in channels-last storage (as y is returned) is transposed node by node, read
        # along its channels: transposing it channel by channel, as to_gt does, reads elements
        # Cout apart (conv1's grad_y at B = 2048 took ~3 ms). Its bias gradient is then a sum
        # of its own, since the per-node transpose sums per node.
        self.to_gt_by_node = (_Transpose(dtype, dtype, index, (nout, batch, cout),
                                         (nout, bpad, gpad), (gpad * bpad, bpad))
                              if nout <= MAX_GRID_YZ and cout > 1 else None)
        gathered = need_input and plan.algorithm == "gather"
        self.staging_dtype = dtype if plan.dx_staged_in_compute_dtype else torch.float32
        if gathered:
            self.cinpad = plan.cinpad
            self.weight_layout = _weight_by_cell(cout, cin, q // cin, gpad, self.cinpad, dtype,
                                                 dtype, index)
            self.input_gemm = _Gemm(plan.input, dtype, index, out_dtype=self.staging_dtype)
        elif need_input:
            self.weight_layout = _weight_transposed(cout, q, gpad, dtype, dtype, index)
            self.nodes_per_cta = plan.input.nodes_per_cta
            self.input_gemm = _Gemm(plan.input, dtype, index)
        if need_input:
            channels_last = dx_channels_last and cin > 1  # one channel: the storages coincide
            self.dx_strides = (rows, 1, cin) if channels_last else (rows, nin, 1)
            extents, dst_strides, self.restore_dx_strides = _dx_restore_geometry(
                gathered, channels_last, batch, cin, nin, bpad)
            self.restore_dx = _Transpose(self.staging_dtype, grad_dtypes[0], index, extents,
                                         extents, dst_strides)
        # Per needed gradient, what names the kernel computing it (family, dtypes read and
        # stored, tile config; the bias gradient is summed by grad_y's re-layout) on this
        # device, and, as ForwardLaunch's key does, the path the dx kernel takes at run time:
        # the gather's 16-byte stores (Cin % 8 == 0) or element stores, the scatter walking
        # nodes or not. CudaOps verifies each on its first use.
        self.kernel_keys = {}
        if need_input:
            path = cin % 8 == 0 if gathered else plan.input.nodes_per_cta > 1
            self.kernel_keys["input"] = (plan.input.family, dtype, plan.input.cfg, device, path,
                                         self.staging_dtype)
        if need_weight:
            self.kernel_keys["weight"] = ("grad_weight", dtype, plan.weight.cfg, device,
                                          torch.float32, grad_y_in_place)
            self.per_split, self.p_tiles = plan.per_split, plan.p_tiles
            self.weight_gemm = _Gemm(plan.weight, dtype, index)
            self.restore_dw = _Transpose(torch.float32, grad_dtypes[1], index, (1, q, cout),
                                         (1, q, cout), (0, q))
        if need_bias:
            self.kernel_keys["bias"] = ("grad_bias", dtype, None, device, grad_dtypes[2])
            self.restore_db = _Transpose(torch.float32, grad_dtypes[2], index, (1, 1, cout),
                                         (1, 1, cout), (0, 1))

    def run(self, grad_y, x, weight, input_linear, weight_linear, reverse: ReverseTables | None,
            *, poison: bool = False):
        """(dx, dW, dbias), None for a gradient not needed. x: [B, Cin, Nin] or the forward's
        TransposedInput; reverse: the reversed graph (gather only). poison: NaN-fill the
        outputs and every workspace byte a kernel must write before another reads it, so an
        element left unwritten shows as NaN."""
        device, index = grad_y.device, self.device.index
        batch, bpad, gpad, cin, nin = self.batch, self.bpad, self.gpad, self.cin, self.nin
        at = self.workspace
        workspace = torch.empty(at.size, dtype=torch.uint8, device=device)
        if poison:
            workspace[: at.zero_from].fill_(0xFF)  # all-ones bytes: NaN in every float type
        new = partial(torch.full, fill_value=math.nan) if poison else torch.empty
        base = workspace.data_ptr()
        if at.zero_bytes:
            _zero(base + at.zero_from, at.zero_bytes, index)
        sb, so, sn = grad_y.stride()
        # grad_y as dW reads it (itself, or gt), and whether its bias gradient is summed apart
        # (the channel-by-channel transpose sums it on the way)
        if self.grad_y_in_place:
            if not readable(grad_y):
                raise ValueError("grad_y_in_place needs grad_y in channels-last storage with "
                                 "16-byte aligned node rows")
            gt, sum_bias = grad_y.data_ptr(), True
        elif self.to_gt_by_node is not None and so == 1 and sn == self.cout:
            gt, sum_bias = base + at.gt, True
            self.to_gt_by_node(grad_y, gt, (sn, sb, so))
        else:
            gt, sum_bias = base + at.gt, False
            self.to_gt(grad_y, gt, (so, sb, sn), base + at.db if self.need_bias else 0)
        if sum_bias and self.need_bias:
            torch.sum(grad_y, dim=(0, 2), dtype=torch.float32,
                      out=workspace[at.db:at.db + 4 * self.cout].view(torch.float32))
        dx = dw = db = None
        if self.need_input:
            if weight.dtype != self.dtype:
                weight = weight.to(self.dtype)
            w_relaid, staging = base + at.weight, base + at.dx
            if self.algorithm == "gather":
                s_out, s_in = weight.stride()
                self.weight_layout(weight, w_relaid, (s_out, (self.q // cin) * s_in, s_in))
                self.input_gemm(gt, w_relaid, reverse.pair_node.data_ptr(),
                                reverse.pair_cell.data_ptr(), reverse.pair_start.data_ptr(),
                                staging, batch, bpad, cin, self.cinpad, nin, gpad)
            else:
                self.weight_layout(weight, w_relaid, (0, weight.stride(0), weight.stride(1)))
                self.input_gemm(gt, w_relaid, input_linear.data_ptr(), weight_linear.data_ptr(),
                                staging, batch, bpad, gpad, gpad, self.p64, cin * nin,
                                input_linear.shape[0], self.nodes_per_cta)
            dx = torch.empty_strided((batch, cin, nin), self.dx_strides,
                                     dtype=self.grad_dtypes[0], device=device)
            if poison:
                dx.fill_(math.nan)
            self.restore_dx.launch_raw(staging, dx.data_ptr(), self.restore_dx_strides)
        if self.need_weight:
            if at.xt is None:  # the forward's kept re-layout (see batch_padding)
                xt = x.xt.data_ptr()
            else:
                xt = base + at.xt
                self.input_layout.write(x, xt)
            dwt = base + at.dw
            self.weight_gemm(xt, gt, input_linear.data_ptr(),
                             weight_linear.data_ptr(), dwt, bpad, gpad, self.p64, cin * nin,
                             self.p_tiles, self.per_split, sb, self.cout, batch)
            dw = new((self.cout, self.q), dtype=self.grad_dtypes[1], device=device)
            self.restore_dw.launch_raw(dwt, dw.data_ptr(), (0, gpad, 1))
        if self.need_bias:
            db = new((self.cout,), dtype=self.grad_dtypes[2], device=device)
            self.restore_db.launch_raw(base + at.db, db.data_ptr(), (0, 0, 1))
        return dx, dw, db


def _check_operands(name: str, *tensors: torch.Tensor) -> None:
    dtype, device = tensors[0].dtype, tensors[0].device
    if dtype not in COMPUTE_DTYPES:
        raise TypeError(f"{name}: the CUDA kernels take float16 or bfloat16, got {dtype}")
    if device.type != "cuda":
        raise ValueError(f"{name}: tensors must be on a CUDA device, got {device}")
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"{name}: all tensors must be on {device}, got one on {t.device}")


def _check_kernel_tables(input_linear: torch.Tensor, weight_linear: torch.Tensor,
                  device: torch.device) -> None:
    for name, table in (("input_linear", input_linear), ("weight_linear", weight_linear)):
        if table.dtype != torch.int32 or table.dim() != 2 or not table.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 [Nout, P64] tensor")
        if table.device != device:
            raise ValueError(f"{name} is on {table.device}, expected {device}")
        if table.shape[1] % SLOT_ALIGN:
            raise ValueError(f"{name}: P64 = {table.shape[1]} must be a multiple of {SLOT_ALIGN}")
    if input_linear.shape != weight_linear.shape:
        raise ValueError("input_linear and weight_linear must have the same shape")


def forward(x, weight, bias, input_linear, weight_linear, config=None, *, poison_output=False,
            return_transposed=False, nodes_per_cta=None):
    """y [B, Cout, Nout] (a view of a contiguous [B, Nout, Cout] buffer) in x's dtype.

    x: [B, Cin, Nin] float16/bfloat16; weight: [Cout, Cin*V] (converted to x's dtype); bias:
    [Cout] or None, added in fp32; input_linear / weight_linear: int32 [Nout, P64], entries
    equal to Cin*Nin select the zero row. poison_output fills y with NaN first, so an element
    the kernel fails to write shows. return_transposed: also return the TransposedInput, for
    the backward. nodes_per_cta: how many nodes one CTA walks (None: heuristic).
    """
    _check_operands("forward", x, weight, *(() if bias is None else (bias,)))
    _check_kernel_tables(input_linear, weight_linear, x.device)
    batch, cin, nin = x.shape
    nout, p64 = input_linear.shape
    launch = ForwardLaunch(batch=batch, cin=cin, nin=nin, cout=weight.shape[0], nout=nout,
                           q=weight.shape[1], p64=p64, dtype=x.dtype, device=x.device,
                           config=config, nodes_per_cta=nodes_per_cta)
    y, saved = launch.run(x, weight, bias, input_linear, weight_linear,
                          poison_output=poison_output)
    return (y, saved) if return_transposed else y


def backward(grad_y, x, weight, input_linear, weight_linear, reverse, cin, nin, q, *,
             need_input=True, need_weight=True, input_algorithm=None, input_config=None,
             weight_config=None, ksplit=None, nodes_per_cta=None, poison_outputs=False,
             dx_channels_last=False):
    """(dx, dW) in float32, either None when not needed, from one grad_y re-layout (see
    :class:`BackwardLaunch`). x: [B, Cin, Nin] or the forward's TransposedInput.
    nodes_per_cta: how many nodes one CTA of the scatter kernel walks (None: heuristic).
    poison_outputs: NaN-fill outputs and staging first (see BackwardLaunch.run).
    dx_channels_last: dx in channels-last storage (see BackwardLaunch)."""
    _check_operands("backward", *((grad_y, weight) if need_input else (grad_y,)))
    _check_kernel_tables(input_linear, weight_linear, grad_y.device)
    batch, cout, nout = grad_y.shape
    if need_weight:  # x is re-laid out as grad_y's dtype, byte for byte
        xt = x.xt if isinstance(x, TransposedInput) else x
        sizes = (x.batch, x.cin, x.nin) if isinstance(x, TransposedInput) else tuple(x.shape)
        if xt.dtype != grad_y.dtype:
            raise TypeError(f"backward: x has dtype {xt.dtype}, grad_y {grad_y.dtype}")
        _check_operands("backward", grad_y, xt)
        if sizes != (batch, cin, nin):
            raise ValueError(f"backward: x has sizes {sizes}, expected [B, Cin, Nin] = "
                             f"{(batch, cin, nin)}")
    q = weight.shape[1] if need_input else q
    launch = BackwardLaunch(batch=batch, cin=cin, nin=nin, cout=cout, nout=nout, q=q,
                            p64=input_linear.shape[1], dtype=grad_y.dtype, device=grad_y.device,
                            need_input=need_input, need_weight=need_weight,
                            algorithm=input_algorithm, input_config=input_config,
                            weight_config=weight_config, ksplit=ksplit,
                            nodes_per_cta=nodes_per_cta,
                            batch_padding=x.bpad if isinstance(x, TransposedInput) else None,
                            dx_channels_last=dx_channels_last)
    if launch.algorithm == "gather" and need_input and reverse is None:
        raise ValueError("the gather algorithm needs reverse=reverse_tables(...)")
    return launch.run(grad_y, x, weight, input_linear, weight_linear, reverse,
                      poison=poison_outputs)[:2]


def grad_input(grad_y, weight, input_linear, weight_linear, cin, nin, config=None, *,
               reverse=None):
    """dx [B, Cin, Nin] float32 (see :class:`BackwardLaunch`). Without ``reverse`` (from
    :func:`reverse_tables`) the slot gradients are scattered with atomics; with it, each input
    node gathers them (atomic-free)."""
    return backward(grad_y, None, weight, input_linear, weight_linear, reverse, cin, nin, 0,
                    need_weight=False,
                    input_algorithm="scatter" if reverse is None else "gather",
                    input_config=config)[0]


def grad_weight(grad_y, x, input_linear, weight_linear, q, config=None, ksplit=None):
    """dW [Cout, Q] float32: A_n^T @ grad_y[:, :, n] accumulated with fp32 atomics into the
    weight columns weight_linear names. ksplit splits the batch contraction (None: heuristic).
    x: [B, Cin, Nin] or the forward's TransposedInput."""
    cin, nin = (x.cin, x.nin) if isinstance(x, TransposedInput) else x.shape[1:]
    return backward(grad_y, x, None, input_linear, weight_linear, None, cin, nin, q,
                    need_input=False, weight_config=config, ksplit=ksplit)[1]


def backward_combined(grad_y, x, weight, input_linear, weight_linear, cin, nin, q,
                      input_config=None, weight_config=None, ksplit=None, *, reverse=None):
    """(dx, dW) in float32 from one grad_y re-layout (dx scattered without ``reverse``, as in
    :func:`grad_input`, gathered with it)."""
    return backward(grad_y, x, weight, input_linear, weight_linear, reverse, cin, nin, q,
                    input_algorithm="scatter" if reverse is None else "gather",
                    input_config=input_config, weight_config=weight_config, ksplit=ksplit)
