"""The host path: operand re-layouts, tile padding, grids, and raw-pointer launches.

Everything runs on PyTorch's current stream of the tensors' device. Kernel arguments go to
cuLaunchKernel (through CuPy's driver binding) as raw device pointers and integers, skipping
DLPack export and CuPy's argument handling, so torch dtypes CuPy lacks (bfloat16) pass
untouched. Re-layouts are one transpose_pad
launch each (transpose, dtype conversion and zero padding fused).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .build import get_kernel, import_cupy, kernel_name, transpose_name
from .configs import (
    KernelConfig,
    check_config,
    default_config,
    default_grad_input_algorithm,
    default_grad_input_config,
    default_grad_input_scatter_config,
    default_grad_weight_config,
    default_grad_weight_ksplit,
    shared_memory_bytes,
)

COMPUTE_DTYPES = (torch.float16, torch.bfloat16)
TRANSPOSE_TILE, TRANSPOSE_ROWS = 32, 8  # kTransposeTile, kTransposeRows in knn_common.cuh

MAX_KERNEL_ARGS = 16
_thread_state = threading.local()


def _argument_slots() -> tuple[np.ndarray, int]:
    """This thread's launch-parameter buffer: 8-byte value slots and the array of pointers to
    them that cuLaunchKernel reads (it copies the values at launch, so slots are reusable)."""
    slots = getattr(_thread_state, "slots", None)
    if slots is None:
        values = np.zeros(MAX_KERNEL_ARGS, dtype=np.uint64)
        pointers = values.ctypes.data + 8 * np.arange(MAX_KERNEL_ARGS, dtype=np.uint64)
        slots = _thread_state.slots = (values, pointers, pointers.ctypes.data)
    return slots[0], slots[2]


def _launch(name: str, device: torch.device, grid: tuple, block: tuple, shared: int,
            args: tuple[int, ...]) -> None:
    """cuLaunchKernel on torch's current stream of ``device``.

    Every argument is a non-negative int in its own 8-byte little-endian slot: device pointers
    and int64 use all of it, int32 parameters read its first 4 bytes. This skips CuPy's
    per-call argument inspection, the dominant host cost of a small layer.
    """
    index = device.index
    function = get_kernel(name, index)
    function.allow_shared_memory(shared)
    values, parameters = _argument_slots()
    values[: len(args)] = args
    stream = torch._C._cuda_getCurrentRawStream(index)
    driver = import_cupy().cuda.driver
    if torch.cuda.current_device() == index:
        driver.launchKernel(function.ptr, *grid, *block, shared, stream, parameters, 0)
    else:
        with torch.cuda.device(index):
            driver.launchKernel(function.ptr, *grid, *block, shared, stream, parameters, 0)


def _pointer(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _transpose(src: torch.Tensor, dst: torch.Tensor, *, src_extents, src_strides, dst_extents,
               dst_strides) -> torch.Tensor:
    """dst[z, c, a] = src[z, a, c], zero wherever (z, a, c) lies past ``src_extents``.

    Extents are (z, a, c); src_strides are the source's (z, a, c) strides and dst_strides the
    destination's (z, c) strides, in elements (dst's a stride is 1).
    """
    dst_z, dst_a, dst_c = dst_extents
    grid = (-(-dst_c // TRANSPOSE_TILE), -(-dst_a // TRANSPOSE_TILE), dst_z)
    _launch(transpose_name(src.dtype, dst.dtype), src.device, grid,
            (TRANSPOSE_TILE, TRANSPOSE_ROWS, 1), 0, (
                _pointer(src), _pointer(dst), *src_extents, *src_strides, dst_a, dst_c,
                *dst_strides,
            ))
    return dst


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


def transposed_input(x: torch.Tensor, bpad: int, dtype: torch.dtype) -> TransposedInput:
    batch, cin, nin = x.shape
    rows = cin * nin
    xt = torch.empty(rows + 1, bpad, dtype=dtype, device=x.device)
    _transpose(x, xt, src_extents=(1, batch, rows), src_strides=(0, x.stride(0), 1),
               dst_extents=(1, bpad, rows + 1), dst_strides=(0, bpad))
    return TransposedInput(xt, batch, cin, nin)


def _as_transposed(x, bpad: int, dtype: torch.dtype) -> TransposedInput:
    if isinstance(x, TransposedInput):
        if x.bpad == bpad and x.xt.dtype == dtype:
            return x
        x = x.original()
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return transposed_input(x, bpad, dtype)


def transposed_weight(weight: torch.Tensor, cpad: int, dtype: torch.dtype) -> torch.Tensor:
    """wt [Cin*V, cpad]: output channels contiguous, zero columns past Cout."""
    cout, q = weight.shape
    wt = torch.empty(q, cpad, dtype=dtype, device=weight.device)
    return _transpose(weight, wt, src_extents=(1, cout, q),
                      src_strides=(0, weight.stride(0), weight.stride(1)),
                      dst_extents=(1, cpad, q), dst_strides=(0, cpad))


def weight_by_cell(weight: torch.Tensor, cin: int, gpad: int, cinpad: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """wr [V, gpad, cinpad] with wr[v, o, c] = W[o, c*V + v], zero past Cout and Cin."""
    cout, q = weight.shape
    v = q // cin
    wr = torch.empty(v, gpad, cinpad, dtype=dtype, device=weight.device)
    return _transpose(weight, wr, src_extents=(cout, cin, v),
                      src_strides=(weight.stride(0), v * weight.stride(1), weight.stride(1)),
                      dst_extents=(gpad, cinpad, v), dst_strides=(cinpad, gpad * cinpad))


def transposed_grad(grad_y: torch.Tensor, gpad: int, bpad: int) -> torch.Tensor:
    """gt [Nout, gpad, bpad]: the batch contiguous, zero past Cout and B (any grad_y strides)."""
    batch, cout, nout = grad_y.shape
    gt = torch.empty(nout, gpad, bpad, dtype=grad_y.dtype, device=grad_y.device)
    sb, so, sn = grad_y.stride()
    return _transpose(grad_y, gt, src_extents=(cout, batch, nout), src_strides=(so, sb, sn),
                      dst_extents=(gpad, bpad, nout), dst_strides=(bpad, gpad * bpad))


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


def _check_operands(name: str, *tensors: torch.Tensor) -> None:
    dtype, device = tensors[0].dtype, tensors[0].device
    if dtype not in COMPUTE_DTYPES:
        raise TypeError(f"{name}: the CUDA kernels take float16 or bfloat16, got {dtype}")
    if device.type != "cuda":
        raise ValueError(f"{name}: tensors must be on a CUDA device, got {device}")
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"{name}: all tensors must be on {device}, got one on {t.device}")


def _check_tables(input_linear: torch.Tensor, weight_linear: torch.Tensor,
                  device: torch.device) -> None:
    for name, table in (("input_linear", input_linear), ("weight_linear", weight_linear)):
        if table.dtype != torch.int32 or table.dim() != 2 or not table.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 [Nout, P64] tensor")
        if table.device != device:
            raise ValueError(f"{name} is on {table.device}, expected {device}")
        if table.shape[1] % 64:
            raise ValueError(f"{name}: P64 = {table.shape[1]} must be a multiple of 64")
    if input_linear.shape != weight_linear.shape:
        raise ValueError("input_linear and weight_linear must have the same shape")


def _uncached(kind: tuple, build):
    return build()


def padded_batch(batch: int, *configs: tuple[str, KernelConfig], reuse=None) -> int:
    """The batch padded so every given (family, config)'s batch tile divides it; a saved
    TransposedInput's padding (``reuse``) is kept when it qualifies, so it need not be rebuilt."""
    tile = math.lcm(*(cfg.bk if family == "grad_weight" else cfg.tile_m for family, cfg in configs))
    if isinstance(reuse, TransposedInput) and reuse.bpad % tile == 0:
        return reuse.bpad
    return _round_up(batch, tile)


def _gemm(family: str, cfg: KernelConfig, dtype: torch.dtype, device: torch.device,
          grid: tuple, args: tuple) -> None:
    _launch(kernel_name(family, dtype, cfg), device, grid, (cfg.threads, 1, 1),
            shared_memory_bytes(family, cfg), args)


def forward(x, weight, bias, input_linear, weight_linear, config=None, *, poison_output=False,
            return_transposed=False, cached=_uncached):
    """y [B, Cout, Nout] (a view of a contiguous [B, Nout, Cout] buffer) in x's dtype.

    x: [B, Cin, Nin] float16/bfloat16; weight: [Cout, Cin*V] (converted to x's dtype); bias:
    [Cout] or None, added in fp32; input_linear / weight_linear: int32 [Nout, P64], entries
    equal to Cin*Nin select the zero row. poison_output fills y with NaN first, so an element
    the kernel fails to write shows. return_transposed: also return the TransposedInput, for
    the backward. cached(kind, build): where the caller keeps weight re-layouts.
    """
    _check_operands("forward", x, weight, *(() if bias is None else (bias,)))
    _check_tables(input_linear, weight_linear, x.device)
    batch, cin, _ = x.shape
    cout = weight.shape[0]
    nout, p64 = input_linear.shape
    cfg = check_config("forward", config or default_config(batch, cout, p64, x.dtype, nout),
                       p64=p64)
    bpad = padded_batch(batch, ("forward", cfg), *_default_backward_tiles(batch, cin, cout, p64))
    cpad = _round_up(cout, cfg.bn)
    saved = _as_transposed(x, bpad, x.dtype)
    wt = cached(("wt", cpad, x.dtype), lambda: transposed_weight(weight, cpad, x.dtype))
    y = (torch.full((batch, nout, cout), math.nan, dtype=x.dtype, device=x.device)
         if poison_output else torch.empty(batch, nout, cout, dtype=x.dtype, device=x.device))
    bias32 = None if bias is None else bias.to(torch.float32)
    _gemm("forward", cfg, x.dtype, x.device, (nout, cpad // cfg.bn, bpad // cfg.tile_m), (
        _pointer(saved.xt), _pointer(wt), _pointer(input_linear), _pointer(weight_linear),
        0, _pointer(bias32), _pointer(y), batch, bpad, cout, cpad, nout, p64, 0,
    ))
    y = y.transpose(1, 2)
    return (y, saved) if return_transposed else y


def _default_backward_tiles(batch: int, cin: int, cout: int, p64: int):
    """The (family, config) pairs a default backward of this call would run."""
    if default_grad_input_algorithm(cin) == "scatter":
        grad_input_tiles = ("grad_input_scatter", default_grad_input_scatter_config(batch))
    else:
        grad_input_tiles = ("grad_input", default_grad_input_config(batch, cin))
    return grad_input_tiles, ("grad_weight", default_grad_weight_config(batch, cout, p64))


def _launch_grad_input(cfg, gt, wr, reverse: ReverseTables, batch, cin, nin, dtype):
    gpad, bpad = gt.shape[1], gt.shape[2]
    cinpad = wr.shape[2]
    out = torch.empty(batch, nin, cin, dtype=torch.float32, device=gt.device)
    _gemm("grad_input", cfg, gt.dtype, gt.device, (nin, cinpad // cfg.bn, bpad // cfg.tile_m), (
        _pointer(gt), _pointer(wr), _pointer(reverse.pair_node), _pointer(reverse.pair_cell),
        _pointer(reverse.pair_start), 0, _pointer(out), batch, bpad, cin, cinpad, nin, 0, gpad,
    ))
    dx = torch.empty(batch, cin, nin, dtype=dtype, device=gt.device)
    return _transpose(out, dx, src_extents=(batch, nin, cin), src_strides=(nin * cin, cin, 1),
                      dst_extents=(batch, nin, cin), dst_strides=(cin * nin, nin))


def _launch_grad_input_scatter(cfg, gt, wt, input_linear, weight_linear, batch, cin, nin, dtype):
    nout, p64 = input_linear.shape
    gpad, bpad = gt.shape[1], gt.shape[2]
    dxt = torch.zeros(cin * nin, bpad, dtype=torch.float32, device=gt.device)
    _gemm("grad_input_scatter", cfg, gt.dtype, gt.device,
          (nout, p64 // cfg.bn, bpad // cfg.tile_m), (
              _pointer(gt), _pointer(wt), _pointer(input_linear), _pointer(weight_linear),
              _pointer(dxt), batch, bpad, gpad, wt.shape[1], p64, cin * nin))
    dx = torch.empty(batch, cin, nin, dtype=dtype, device=gt.device)
    return _transpose(dxt, dx, src_extents=(1, cin * nin, batch), src_strides=(0, bpad, 1),
                      dst_extents=(1, cin * nin, batch), dst_strides=(0, cin * nin))


def _launch_grad_weight(cfg, saved: TransposedInput, gt, input_linear, weight_linear, q, cout,
                        ksplit, dtype):
    nout, p64 = input_linear.shape
    gpad, bpad = gt.shape[1], gt.shape[2]
    dwt = torch.zeros(q, gpad, dtype=torch.float32, device=gt.device)
    p_tiles, k_tiles = p64 // cfg.tile_m, bpad // cfg.bk
    if ksplit is None:
        ksplit = default_grad_weight_ksplit(cfg, bpad, gpad, p64, nout, gt.device.index)
    per_split = -(-k_tiles // max(1, int(ksplit)))
    splits = -(-k_tiles // per_split)
    _gemm("grad_weight", cfg, gt.dtype, gt.device, (nout, p_tiles * splits, gpad // cfg.bn), (
        _pointer(saved.xt), _pointer(gt), _pointer(input_linear), _pointer(weight_linear),
        _pointer(dwt), bpad, gpad, p64, saved.xt.shape[0] - 1, p_tiles, per_split,
    ))
    dw = torch.empty(cout, q, dtype=dtype, device=gt.device)
    return _transpose(dwt, dw, src_extents=(1, q, cout), src_strides=(0, gpad, 1),
                      dst_extents=(1, q, cout), dst_strides=(0, q))


def backward(grad_y, x, weight, input_linear, weight_linear, reverse, cin, nin, q, *,
             need_input=True, need_weight=True, input_algorithm=None, input_config=None,
             weight_config=None, ksplit=None, grad_dtypes=(torch.float32, torch.float32),
             cached=_uncached):
    """(dx, dW), either None when not needed, from one grad_y re-layout.

    x: the input [B, Cin, Nin] or the forward's TransposedInput. dx comes from the forward
    kernel run over the reversed graph (input_algorithm 'gather': no atomics, each element
    written once) or, for few input channels, from slot gradients scattered with fp32 atomics
    ('scatter'; None picks by Cin). dW comes from the slot-tiled kernel with fp32 atomics, the
    batch split over gridDim.y (ksplit). Both accumulate in fp32 and are converted to
    grad_dtypes = (dx dtype, dW dtype). cached(kind, build): where weight re-layouts are kept.
    """
    _check_operands("backward", *((grad_y, weight) if need_input else (grad_y,)))
    _check_tables(input_linear, weight_linear, grad_y.device)
    batch, cout, _ = grad_y.shape
    p64 = input_linear.shape[1]
    algorithm = input_algorithm or default_grad_input_algorithm(cin)
    if algorithm not in ("gather", "scatter"):
        raise ValueError(f"input_algorithm must be 'gather' or 'scatter', got {algorithm!r}")
    input_family = "grad_input" if algorithm == "gather" else "grad_input_scatter"
    gi = check_config(input_family, input_config or (
        default_grad_input_config(batch, cin) if algorithm == "gather"
        else default_grad_input_scatter_config(batch)), p64=p64)
    gw = check_config("grad_weight", weight_config or default_grad_weight_config(batch, cout, p64),
                      p64=p64)
    needed = [pair for pair, wanted in (((input_family, gi), need_input),
                                        (("grad_weight", gw), need_weight)) if wanted]
    bpad = padded_batch(batch, *needed, reuse=x)
    gpad = _round_up(cout, math.lcm(*(cfg.bn if family == "grad_weight" else cfg.bk
                                      for family, cfg in needed)))
    gt = transposed_grad(grad_y, gpad, bpad)
    dx = dw = None
    dtype = grad_y.dtype
    if need_input and algorithm == "gather":
        cinpad = _round_up(cin, gi.bn)
        wr = cached(("wr", gpad, cinpad, dtype),
                    lambda: weight_by_cell(weight, cin, gpad, cinpad, dtype))
        dx = _launch_grad_input(gi, gt, wr, reverse, batch, cin, nin, grad_dtypes[0])
    elif need_input:
        wt = cached(("wt", gpad, dtype), lambda: transposed_weight(weight, gpad, dtype))
        dx = _launch_grad_input_scatter(gi, gt, wt, input_linear, weight_linear, batch, cin,
                                        nin, grad_dtypes[0])
    if need_weight:
        saved = _as_transposed(x, bpad, dtype)
        dw = _launch_grad_weight(gw, saved, gt, input_linear, weight_linear, q, cout, ksplit,
                                 grad_dtypes[1])
    return dx, dw


def grad_input(grad_y, weight, input_linear, weight_linear, cin, nin, config=None, *,
               reverse=None):
    """dx [B, Cin, Nin] float32 (see :func:`backward`). Without ``reverse`` (from
    :func:`reverse_tables`) the slot gradients are scattered with atomics, as in the seed
    design; with it, each input node gathers them (atomic-free)."""
    return backward(grad_y, None, weight, input_linear, weight_linear, reverse, cin, nin, 0,
                    need_weight=False, input_algorithm="scatter" if reverse is None else "gather",
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
    """(dx, dW) in float32 from one grad_y re-layout: :func:`backward` with both needed
    (dx by scatter without ``reverse``, as in :func:`grad_input`)."""
    return backward(grad_y, x, weight, input_linear, weight_linear, reverse, cin, nin, q,
                    input_algorithm="scatter" if reverse is None else "gather",
                    input_config=input_config, weight_config=weight_config, ksplit=ksplit)


def clear_launch_caches() -> None:
    _thread_state.__dict__.pop("slots", None)
