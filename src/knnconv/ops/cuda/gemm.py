"""Launches of the gathered-GEMM kernels on re-laid-out operands (knn_forward, knn_grad_input,
knn_grad_input_scatter, knn_grad_weight), and the module-level functional API on them
(:func:`forward`, :func:`grad_input`, :func:`grad_weight`, :func:`backward`,
:func:`backward_combined`).

A launch (:class:`ForwardLaunch`, :class:`BackwardLaunch`) takes its plan from
:mod:`.launch_plan` (tiles, padding, grids: everything that depends only on sizes and the
device), builds the kernels, re-layouts (:mod:`.relayout`) and workspace it names once, and
running it allocates the buffers and issues the launches. The registry ops cache plans per
layer and batch, so a call costs little more than its launches.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from ...plan import SLOT_ALIGN
from .configs import KernelConfig
from .launch import (
    Gemm,
    Transpose,
    bias_as_read,
    biased_kernel_key,
    data_pointer,
    device_limits,
    memset_zero,
    poisoned_or_empty_output,
    readable,
)
from .launch_plan import plan_backward, plan_forward
from .relayout import (
    InputLayout,
    ReverseTables,
    TransposedInput,
    dx_restore_geometry,
    grad_y_by_node,
    grad_y_transposed,
    weight_by_cell,
    weight_transposed,
)

COMPUTE_DTYPES = (torch.float16, torch.bfloat16)


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
        self.weight_layout = weight_transposed(cout, q, self.cpad, dtype, device.index)
        wt_bytes = q * self.cpad * dtype.itemsize
        self.input_layout = InputLayout(batch, cin, nin, plan.bpad, dtype, dtype,
                                        device.index, spare_bytes=wt_bytes)
        self.gemm = Gemm(plan.gemm, dtype, device.index)
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
        self.weight_layout(weight, wt)
        y = poisoned_or_empty_output(self.y_shape, dtype, x.device, poison_output)
        bias = bias_as_read(bias, dtype)
        self.gemm(saved.xt.data_ptr(), wt, input_linear.data_ptr(), weight_linear.data_ptr(),
                  data_pointer(bias), int(bias is not None and bias.dtype == torch.float32),
                  y.data_ptr(), self.batch, self.bpad, self.cout, self.cpad, self.nout, self.p64,
                  self.slots, self.nodes_per_cta)
        return y, saved


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
            self.input_layout = InputLayout(batch, cin, nin, bpad, dtype, dtype, index)
        self.to_gt = grad_y_transposed(batch, cout, nout, bpad, gpad, dtype, index,
                                       sums_bias=need_bias)
        self.to_gt_by_node = grad_y_by_node(batch, cout, nout, bpad, gpad, dtype, index)
        gathered = need_input and plan.algorithm == "gather"
        self.staging_dtype = dtype if plan.dx_staged_in_compute_dtype else torch.float32
        if gathered:
            self.cinpad = plan.cinpad
            self.weight_layout = weight_by_cell(cout, cin, q // cin, gpad, self.cinpad, dtype,
                                                index)
            self.input_gemm = Gemm(plan.input, dtype, index, out_dtype=self.staging_dtype)
        elif need_input:
            self.weight_layout = weight_transposed(cout, q, gpad, dtype, index)
            self.nodes_per_cta = plan.input.nodes_per_cta
            self.input_gemm = Gemm(plan.input, dtype, index)
        if need_input:
            channels_last = dx_channels_last and cin > 1  # one channel: the storages coincide
            self.dx_strides = (rows, 1, cin) if channels_last else (rows, nin, 1)
            extents, dst_strides, self.restore_dx_strides = dx_restore_geometry(
                gathered, channels_last, batch, cin, nin, bpad)
            self.restore_dx = Transpose(self.staging_dtype, grad_dtypes[0], index, extents,
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
            self.weight_gemm = Gemm(plan.weight, dtype, index)
            self.restore_dw = Transpose(torch.float32, grad_dtypes[1], index, (1, q, cout),
                                        (1, q, cout), (0, q))
        if need_bias:
            self.kernel_keys["bias"] = ("grad_bias", dtype, None, device, grad_dtypes[2])
            self.restore_db = Transpose(torch.float32, grad_dtypes[2], index, (1, 1, cout),
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
            memset_zero(base + at.zero_from, at.zero_bytes, index)
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
            w_relaid, staging = base + at.weight, base + at.dx
            self.weight_layout(weight, w_relaid)
            if self.algorithm == "gather":
                self.input_gemm(gt, w_relaid, reverse.pair_node.data_ptr(),
                                reverse.pair_cell.data_ptr(), reverse.pair_start.data_ptr(),
                                staging, batch, bpad, cin, self.cinpad, nin, gpad)
            else:
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
