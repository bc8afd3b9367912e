"""Launch plans of the channels-last kernels: x and grad_y read where the layers keep them.

A KNN layer's activations live in channels-last storage (the [B, C, N] view of a contiguous
[B, N, C] buffer). The kernels of knn_gemm_channels_last.cu gather whole 16-byte runs
along the channels of each neighbour straight from that storage, so neither x nor grad_y is
re-laid out: the forward and dx are one gather-GEMM kernel (knn_gather_cl: over each output
node's real neighbours, or over each input node's (output node, cell) pairs), dW is
knn_grad_weight_cl, and only the weight, which is small, is re-laid out by cell. dx is written
in channels-last storage, in its own dtype, by the kernel itself.

They serve layers whose channel counts are multiples of
:func:`~.configs.channels_last_width_multiple` (every layer of the published fovi models past
the first); :func:`~.launch_plan.plan_forward_path` and :func:`~.launch_plan.plan_backward_path`
say whether a call takes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
from .launch_plan import plan_channels_last_backward, plan_gather
from .relayout import ReverseTables, weight_by_cell, weight_by_cell_transposed


@dataclass
class EntryTables:
    """Each output node's real neighbours, padding left out: node n reads input node row[e]
    through kernel cell cell[e] for start[n] <= e < start[n + 1]; node[e] is e's node."""

    start: torch.Tensor  # int32 [Nout + 1]
    row: torch.Tensor  # int32 [entries]
    cell: torch.Tensor  # int32 [entries]
    node: torch.Tensor  # int32 [entries]

    @property
    def count(self) -> int:
        return self.row.shape[0]


def entry_tables(knn_indices: torch.Tensor, rf_index: torch.Tensor, nin: int) -> EntryTables:
    """EntryTables of a layer (knn_indices [K, Nout], rf_index [Nout, K]), on their device."""
    k, nout = knn_indices.shape
    neighbours = knn_indices.t()
    real = neighbours != nin
    start = torch.zeros(nout + 1, dtype=torch.int64, device=knn_indices.device)
    start[1:] = torch.cumsum(real.sum(dim=1), 0)
    nodes = torch.arange(nout, device=knn_indices.device).unsqueeze(1).expand(nout, k)
    return EntryTables(start.int(), neighbours[real].int().contiguous(),
                       rf_index[real].int().contiguous(), nodes[real].int().contiguous())


def _in_readable_storage(t: torch.Tensor) -> torch.Tensor:
    if readable(t):
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index ('cuda' means the current device)."""
    if device.index is None:
        return torch.device(device.type, torch.cuda.current_device())
    return device


class ChannelsLastForward:
    """The forward of one (layer sizes, batch, dtype, device) on channels-last x: the weight
    re-laid out by cell (wc [V, Cin, cpad], wc[v, c, o] = W[o, c*V + v]) and knn_gather_cl over
    each output node's real neighbours (or, with ``warpgroup_mma`` on Hopper, its
    warpgroup-MMA variant: see configs). y comes in channels-last storage. ``config`` and
    ``family`` pick the kernel and its tiles instead."""

    def __init__(self, *, batch: int, cin: int, nin: int, cout: int, nout: int, v: int,
                 entries: int, dtype: torch.dtype, device: torch.device,
                 config: KernelConfig | None = None, family: str | None = None,
                 nodes_per_cta: int | None = None, warpgroup_mma: bool = False) -> None:
        device = _indexed(device)
        index = device.index
        self.plan = plan = plan_gather(
            batch=batch, n=cout, width=cin, nodes=nout, entries=entries,
            device=device_limits(index), warpgroup_mma=warpgroup_mma, family=family,
            config=config, nodes_per_cta=nodes_per_cta)
        self.family, self.cfg = plan.gemm.family, plan.gemm.cfg
        self.batch, self.cin, self.cout, self.nout, self.v, self.dtype = (batch, cin, cout,
                                                                          nout, v, dtype)
        self.cpad = cpad = plan.npad
        self.nodes_per_cta = plan.gemm.nodes_per_cta
        self.weight_layout = weight_by_cell_transposed(cout, cin, v, cpad, dtype, index)
        self.gemm = Gemm(plan.gemm, dtype, index)
        self._kernel_key = (self.family, dtype, self.cfg, device, self.nodes_per_cta > 1,
                            cout % 2 == 0)  # column-pair stores (see ForwardLaunch)

    def kernel_key(self, bias: torch.Tensor | None) -> tuple:
        return biased_kernel_key(self._kernel_key, bias, self.dtype)

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            entries: EntryTables, *, poison_output: bool = False) -> torch.Tensor:
        """y [B, Cout, Nout], the view of a contiguous [B, Nout, Cout] buffer; x must be
        :func:`readable`."""
        dtype, cin, cout, nout = self.dtype, self.cin, self.cout, self.nout
        cells = torch.empty(self.v * cin * self.cpad, dtype=dtype, device=x.device)
        self.weight_layout(weight, cells.data_ptr())
        y = poisoned_or_empty_output((self.batch, cout, nout), dtype, x.device, poison_output)
        bias = bias_as_read(bias, dtype)
        self.gemm(x.data_ptr(), x.stride(0), cin, cells.data_ptr(), self.cpad,
                  entries.start.data_ptr(), entries.row.data_ptr(), entries.cell.data_ptr(),
                  data_pointer(bias), int(bias is not None and bias.dtype == torch.float32),
                  y.data_ptr(), self.batch, cout, nout, self.nodes_per_cta)
        return y


class ChannelsLastBackward:
    """The backward of one (layer sizes, batch, dtypes, device, needed gradients) on
    channels-last grad_y and x, with no re-layout of either.

    dx: knn_gather_cl over each input node's (output node, cell) pairs, reading grad_y and the
    weight by cell (wr [V, Cout, cinpad], wr[v, o, c] = W[o, c*V + v]); each element written
    once, in dx's dtype, channels-last. dW: knn_grad_weight_cl into an fp32 accumulator by cell
    [V, Cin, cpad] (fp32 atomics, the batch split in ``ksplit`` slices), restored to [Cout,
    Cin*V] in W's gradient dtype. The bias gradient: an fp32 sum of grad_y.
    """

    def __init__(self, *, batch: int, cin: int, nin: int, cout: int, nout: int, v: int,
                 entries: int, dtype: torch.dtype, device: torch.device,
                 need_input: bool = True, need_weight: bool = True, need_bias: bool = False,
                 grad_dtypes=(torch.float32, torch.float32, torch.float32),
                 input_config: KernelConfig | None = None, input_family: str | None = None,
                 weight_config: KernelConfig | None = None, ksplit: int | None = None,
                 nodes_per_cta: int | None = None, warpgroup_mma: bool = False) -> None:
        device = _indexed(device)
        index = device.index
        self.plan = plan = plan_channels_last_backward(
            batch=batch, cin=cin, nin=nin, cout=cout, v=v, entries=entries,
            element_bytes=dtype.itemsize, device=device_limits(index),
            warpgroup_mma=warpgroup_mma, need_input=need_input,
            need_weight=need_weight, input_family=input_family, input_config=input_config,
            weight_config=weight_config, ksplit=ksplit, nodes_per_cta=nodes_per_cta)
        self.workspace = plan.workspace
        self.batch, self.cin, self.nin, self.cout, self.nout, self.v = (batch, cin, nin, cout,
                                                                        nout, v)
        self.dtype, self.grad_dtypes, self.device = dtype, grad_dtypes, device
        self.need_input, self.need_weight, self.need_bias = need_input, need_weight, need_bias
        self.kernel_keys: dict[str, tuple] = {}
        if need_input:
            gather = plan.input.gemm
            self.cinpad, self.nodes_per_cta = plan.input.npad, gather.nodes_per_cta
            self.weight_layout = weight_by_cell(cout, cin, v, cout, self.cinpad, dtype, index)
            self.input_gemm = Gemm(gather, dtype, index, out_dtype=grad_dtypes[0])
            self.kernel_keys["input"] = (gather.family, dtype, gather.cfg, device,
                                         self.nodes_per_cta > 1, cin % 2 == 0, grad_dtypes[0])
        if need_weight:
            self.wpad, self.per_split = plan.weight.wpad, plan.weight.per_split
            self.weight_gemm = Gemm(plan.weight.gemm, dtype, index)
            self.has_entries = entries > 0
            # dw[o, c*V + v] = acc[v, c, o]: z = c, a = v (dw's fastest), c = o
            self.restore_dw = Transpose(torch.float32, grad_dtypes[1], index, (cin, v, cout),
                                        (cin, v, cout), (v, cin * v))
            self.kernel_keys["weight"] = ("grad_weight_cl", dtype, plan.weight.gemm.cfg, device,
                                          torch.float32)

    def run(self, grad_y: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor | None,
            entries: EntryTables | None, reverse: ReverseTables | None, *,
            poison: bool = False):
        """(dx, dW, dbias), None for a gradient not needed. grad_y: [B, Cout, Nout], copied to
        channels-last storage unless the kernels can read it in place; x: readable
        channels-last [B, Cin, Nin] (for dW); entries: the forward's tables (dW); reverse:
        the reversed graph (dx). poison: NaN-fill the outputs first."""
        device, index = grad_y.device, self.device.index
        batch, cin, nin, cout, v = self.batch, self.cin, self.nin, self.cout, self.v
        new = (lambda *a, **k: torch.full(*a, math.nan, **k)) if poison else torch.empty
        grad_y = _in_readable_storage(grad_y)
        at = self.workspace
        workspace = torch.empty(max(1, at.size), dtype=torch.uint8, device=device)
        base = workspace.data_ptr()
        if at.zero_bytes:
            memset_zero(base + at.zero_from, at.zero_bytes, index)
        dx = dw = db = None
        if self.need_input:
            cells = base + at.weight
            self.weight_layout(weight, cells)
            dx = new((batch, nin, cin), dtype=self.grad_dtypes[0], device=device).transpose(1, 2)
            self.input_gemm(grad_y.data_ptr(), grad_y.stride(0), cout, cells, self.cinpad,
                            reverse.pair_start.data_ptr(), reverse.pair_node.data_ptr(),
                            reverse.pair_cell.data_ptr(), 0, 0, dx.data_ptr(), batch, cin, nin,
                            self.nodes_per_cta)
        if self.need_weight:
            accumulator = base + at.dw
            if self.has_entries:
                self.weight_gemm(x.data_ptr(), x.stride(0), cin, grad_y.data_ptr(),
                                 grad_y.stride(0), cout, entries.node.data_ptr(),
                                 entries.row.data_ptr(), entries.cell.data_ptr(), accumulator,
                                 self.wpad, batch, self.per_split)
            dw = new((cout, cin * v), dtype=self.grad_dtypes[1], device=device)
            self.restore_dw.launch_raw(accumulator, dw.data_ptr(), (self.wpad, cin * self.wpad,
                                                                    1))
        if self.need_bias:
            db = grad_y.sum(dim=(0, 2), dtype=torch.float32).to(self.grad_dtypes[2])
        return dx, dw, db
