"""The host path: operand re-layouts, tile padding, grids, and raw-pointer launches.

Everything here runs on PyTorch's current stream of the tensors' device. Kernel arguments go
to CuPy as raw device pointers (numpy.uint64) and int32 scalars, skipping DLPack export, so
torch dtypes CuPy lacks (bfloat16) pass untouched.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .build import get_kernel, import_cupy
from .configs import (
    KernelConfig,
    check_config,
    default_config,
    default_grad_input_config,
    default_grad_weight_config,
    default_grad_weight_ksplit,
    shared_memory_bytes,
)

DEFAULT_SHARED_LIMIT = 48 * 1024
COMPUTE_DTYPES = (torch.float16, torch.bfloat16)

_external_streams: dict[tuple[int, int], object] = {}
_raised_shared_limits: set[int] = set()


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _pointer(tensor: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def _launch(family: str, cfg: KernelConfig, dtype: torch.dtype, device: torch.device,
            grid: tuple[int, int, int], args: tuple) -> None:
    cupy = import_cupy()
    index = device.index
    function = get_kernel(family, dtype, cfg, index)
    shared = shared_memory_bytes(family, cfg)
    if shared > DEFAULT_SHARED_LIMIT and id(function) not in _raised_shared_limits:
        function.max_dynamic_shared_size_bytes = shared
        _raised_shared_limits.add(id(function))
    handle = torch.cuda.current_stream(device).cuda_stream
    stream = _external_streams.get((index, handle))
    if stream is None:
        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        stream = (from_external(_StreamHandle(handle)) if from_external is not None
                  else cupy.cuda.ExternalStream(handle, index))
        _external_streams[(index, handle)] = stream
    with cupy.cuda.Device(index):
        function(grid, (cfg.threads, 1, 1), args, shared_mem=shared, stream=stream)


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


def transposed_input(x: torch.Tensor, bpad: int) -> torch.Tensor:
    """xt [Cin*Nin + 1, bpad]: x with the batch contiguous, plus the zero padding-neighbour row."""
    batch = x.shape[0]
    rows = x.shape[1] * x.shape[2]
    xt = x.new_empty(rows + 1, bpad)
    xt[:rows, :batch].copy_(x.reshape(batch, rows).t())
    xt[:rows, batch:].zero_()
    xt[rows].zero_()
    return xt


def transposed_weight(weight: torch.Tensor, cpad: int, dtype: torch.dtype) -> torch.Tensor:
    """wt [Cin*V, cpad]: the weight with output channels contiguous, zero columns past Cout."""
    cout, q = weight.shape
    wt = torch.empty(q, cpad, dtype=dtype, device=weight.device)
    wt[:, :cout].copy_(weight.t())
    wt[:, cout:].zero_()
    return wt


def transposed_grad(grad_y: torch.Tensor, cpad: int, bpad: int) -> torch.Tensor:
    """gt [Nout, cpad, bpad]: grad_y with the batch contiguous, zero past Cout and B."""
    batch, cout, _ = grad_y.shape
    gt = grad_y.new_empty(grad_y.shape[2], cpad, bpad)
    gt[:, :cout, :batch].copy_(grad_y.permute(2, 1, 0))
    gt[:, cout:].zero_()
    gt[:, :cout, batch:].zero_()
    return gt


def forward(x, weight, bias, input_linear, weight_linear, config=None, *, poison_output=False):
    """y [B, Cout, Nout] (a view of a contiguous [B, Nout, Cout] buffer) in x's dtype.

    x: [B, Cin, Nin] float16/bfloat16; weight: [Cout, Cin*V] (cast to x's dtype); bias: [Cout]
    or None, added in fp32; input_linear / weight_linear: int32 [Nout, P64], entries equal to
    Cin*Nin select the zero row. poison_output fills y with NaN first, so an element the
    kernel fails to write shows.
    """
    _check_operands("forward", x, weight, *(() if bias is None else (bias,)))
    _check_tables(input_linear, weight_linear, x.device)
    batch, _, _ = x.shape
    cout = weight.shape[0]
    nout, p64 = input_linear.shape
    cfg = check_config("forward", config or default_config(batch, cout, p64, x.dtype, nout),
                       p64=p64)
    bpad, cpad = _round_up(batch, cfg.tile_m), _round_up(cout, cfg.bn)
    xt = transposed_input(x.contiguous(), bpad)
    wt = transposed_weight(weight, cpad, x.dtype)
    y = (torch.full if poison_output else torch.empty)(
        (batch, nout, cout), *((math.nan,) if poison_output else ()), dtype=x.dtype, device=x.device
    )
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    _launch("forward", cfg, x.dtype, x.device, (nout, cpad // cfg.bn, bpad // cfg.tile_m), (
        _pointer(xt), _pointer(wt), _pointer(input_linear), _pointer(weight_linear),
        _pointer(bias32), _pointer(y), np.int32(batch), np.int32(bpad), np.int32(cout),
        np.int32(cpad), np.int32(nout), np.int32(p64),
    ))
    return y.transpose(1, 2)


def _launch_grad_input(cfg, gt, wt, input_linear, weight_linear, batch, cin, nin):
    nout, p64 = input_linear.shape
    cpad, bpad = gt.shape[1], gt.shape[2]
    dxt = torch.zeros(cin * nin, bpad, dtype=torch.float32, device=gt.device)
    _launch("grad_input", cfg, gt.dtype, gt.device, (nout, p64 // cfg.bn, bpad // cfg.tile_m), (
        _pointer(gt), _pointer(wt), _pointer(input_linear), _pointer(weight_linear),
        _pointer(dxt), np.int32(batch), np.int32(bpad), np.int32(cpad), np.int32(p64),
        np.int32(cin * nin),
    ))
    return dxt[:, :batch].t().reshape(batch, cin, nin)


def _launch_grad_weight(cfg, xt, gt, input_linear, weight_linear, q, cout, ksplit):
    nout, p64 = input_linear.shape
    cpad, bpad = gt.shape[1], gt.shape[2]
    dwt = torch.zeros(q, cpad, dtype=torch.float32, device=gt.device)
    p_tiles, k_tiles = p64 // cfg.tile_m, bpad // cfg.bk
    if ksplit is None:
        ksplit = default_grad_weight_ksplit(cfg, bpad, cpad, p64, nout, gt.device.index)
    per_split = -(-k_tiles // max(1, int(ksplit)))
    splits = -(-k_tiles // per_split)
    _launch("grad_weight", cfg, gt.dtype, gt.device, (nout, p_tiles * splits, cpad // cfg.bn), (
        _pointer(xt), _pointer(gt), _pointer(input_linear), _pointer(weight_linear),
        _pointer(dwt), np.int32(bpad), np.int32(cpad), np.int32(p64),
        np.int32(xt.shape[0] - 1), np.int32(p_tiles), np.int32(per_split),
    ))
    return dwt[:, :cout].t()


def grad_input(grad_y, weight, input_linear, weight_linear, cin, nin, config=None):
    """dx [B, Cin, Nin] float32: the slot gradients grad_y[:, :, n] @ W_n^T scattered with fp32
    atomics to the inputs that input_linear names (padding slots are dropped)."""
    _check_operands("grad_input", grad_y, weight)
    _check_tables(input_linear, weight_linear, grad_y.device)
    batch, cout, _ = grad_y.shape
    cfg = check_config("grad_input", config or default_grad_input_config(batch, cout),
                       p64=input_linear.shape[1])
    bpad, cpad = _round_up(batch, cfg.tile_m), _round_up(cout, cfg.bk)
    gt = transposed_grad(grad_y, cpad, bpad)
    wt = transposed_weight(weight, cpad, grad_y.dtype)
    return _launch_grad_input(cfg, gt, wt, input_linear, weight_linear, batch, cin, nin)


def grad_weight(grad_y, x, input_linear, weight_linear, q, config=None, ksplit=None):
    """dW [Cout, Q] float32: A_n^T @ grad_y[:, :, n] accumulated with fp32 atomics into the
    weight columns weight_linear names. ksplit splits the batch contraction (None: heuristic)."""
    _check_operands("grad_weight", grad_y, x)
    _check_tables(input_linear, weight_linear, grad_y.device)
    batch, cout, _ = grad_y.shape
    p64 = input_linear.shape[1]
    cfg = check_config("grad_weight", config or default_grad_weight_config(batch, cout, p64),
                       p64=p64)
    bpad, cpad = _round_up(batch, cfg.bk), _round_up(cout, cfg.bn)
    xt = transposed_input(x.to(grad_y.dtype).contiguous(), bpad)
    gt = transposed_grad(grad_y, cpad, bpad)
    return _launch_grad_weight(cfg, xt, gt, input_linear, weight_linear, q, cout, ksplit)


def backward_combined(grad_y, x, weight, input_linear, weight_linear, cin, nin, q,
                      input_config=None, weight_config=None, ksplit=None):
    """(dx, dW) as grad_input + grad_weight, sharing one gt re-layout and one padding choice."""
    _check_operands("backward_combined", grad_y, x, weight)
    _check_tables(input_linear, weight_linear, grad_y.device)
    batch, cout, _ = grad_y.shape
    p64 = input_linear.shape[1]
    gi = check_config("grad_input", input_config or default_grad_input_config(batch, cout), p64=p64)
    gw = check_config("grad_weight", weight_config or default_grad_weight_config(batch, cout, p64),
                      p64=p64)
    bpad = _round_up(batch, math.lcm(gi.tile_m, gw.bk))
    cpad = _round_up(cout, math.lcm(gi.bk, gw.bn))
    gt = transposed_grad(grad_y, cpad, bpad)
    wt = transposed_weight(weight, cpad, grad_y.dtype)
    xt = transposed_input(x.to(grad_y.dtype).contiguous(), bpad)
    dx = _launch_grad_input(gi, gt, wt, input_linear, weight_linear, batch, cin, nin)
    dw = _launch_grad_weight(gw, xt, gt, input_linear, weight_linear, q, cout, ksplit)
    return dx, dw


def clear_launch_caches() -> None:
    _external_streams.clear()
    _raised_shared_limits.clear()
