"""The Triton kernels of the ``triton`` backend's depthwise KNN convolution,
y[b, c, n] = bias[c] + sum over n's slots k of x[b, c, knn[k, n]] * W[c, cell[k, n]].

Each channel is its own convolution, so there is no contraction across channels to feed a
matrix unit: these are gathers. A program owns a tile of batch rows x channels at one node
and steps over that node's neighbours, each step one [batch rows, channels] block load. With
channels fastest in memory (channels-last storage, the [B, C, N] view of a contiguous
[B, N, C] buffer, as knnconv's layers pass activations on) every row of a block is one
contiguous run of channels; the kernels take any strides.

- ``knn_depthwise_forward_kernel``: y over node n's K slots (a padding slot, knn = Nin, is
  masked out), W laid out by cell [V, C] so a slot's weights are one contiguous row.
- ``knn_depthwise_grad_input_kernel``: dx over the reversed graph, dx[b, c, m] = sum over the
  (node n, cell u) pairs reading m of grad_y[b, c, n] * W[c, u]; every output written once.
- ``knn_depthwise_grad_weight_kernel``: dW[c, u] = sum over the real slots (n, k) in cell u
  and the batch of x[b, c, knn[k, n]] * grad_y[b, c, n]. A program owns one split of cell u's
  steps (batch chunks x slots) and a channel tile, summing in registers; it writes its own
  partial row, and the partials are summed in a fixed order after: no atomics, the same dW
  from run to run.

Accumulation is float32 in every kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import cell_split_steps


@triton.jit
def knn_depthwise_forward_kernel(x_ptr, wc_ptr, bias_ptr, y_ptr, knn_ptr, cell_ptr,
                                 batch, channels, nin, nout, k,
                                 x_batch_stride, x_node_stride, x_channel_stride,
                                 y_batch_stride, y_node_stride, y_channel_stride,
                                 HAS_BIAS: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr):
    node = tl.program_id(0)
    rows = tl.program_id(1) * BB + tl.arange(0, BB)
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    row_ok, col_ok = rows < batch, cols < channels
    x_rows = x_ptr + rows[:, None].to(tl.int64) * x_batch_stride + cols[None, :] * x_channel_stride
    acc = tl.zeros((BB, BC), dtype=tl.float32)
    for slot in range(k):
        m = tl.load(knn_ptr + slot * nout + node)
        # a padding slot (m = Nin) reads nothing: its columns masked, as a vector
        use = col_ok & (cols * 0 + m != nin)
        cell = tl.load(cell_ptr + slot * nout + node)
        weight = tl.load(wc_ptr + cell * channels + cols, mask=use, other=0.0)
        block = tl.load(x_rows + m.to(tl.int64) * x_node_stride,
                        mask=row_ok[:, None] & use[None, :], other=0.0)
        acc += block.to(tl.float32) * weight.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = (y_ptr + rows[:, None].to(tl.int64) * y_batch_stride + node * y_node_stride
           + cols[None, :] * y_channel_stride)
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def knn_depthwise_grad_input_kernel(gy_ptr, wc_ptr, dx_ptr, start_ptr, pair_node_ptr,
                                    pair_cell_ptr, batch, channels,
                                    gy_batch_stride, gy_node_stride, gy_channel_stride,
                                    dx_batch_stride, dx_node_stride, dx_channel_stride,
                                    BB: tl.constexpr, BC: tl.constexpr):
    node = tl.program_id(0)
    rows = tl.program_id(1) * BB + tl.arange(0, BB)
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    row_ok, col_ok = rows < batch, cols < channels
    mask = row_ok[:, None] & col_ok[None, :]
    gy_rows = (gy_ptr + rows[:, None].to(tl.int64) * gy_batch_stride
               + cols[None, :] * gy_channel_stride)
    acc = tl.zeros((BB, BC), dtype=tl.float32)
    first = tl.load(start_ptr + node)
    last = tl.load(start_ptr + node + 1)
    for pair in range(first, last):
        n = tl.load(pair_node_ptr + pair)
        weight = tl.load(wc_ptr + tl.load(pair_cell_ptr + pair) * channels + cols, mask=col_ok,
                         other=0.0)
        block = tl.load(gy_rows + n.to(tl.int64) * gy_node_stride, mask=mask, other=0.0)
        acc += block.to(tl.float32) * weight.to(tl.float32)[None, :]
    out = (dx_ptr + rows[:, None].to(tl.int64) * dx_batch_stride + node * dx_node_stride
           + cols[None, :] * dx_channel_stride)
    tl.store(out, acc.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def knn_depthwise_grad_weight_kernel(x_ptr, gy_ptr, partial_ptr, start_ptr, pair_input_ptr,
                                     pair_node_ptr, batch, channels, cells, splits,
                                     batch_chunks,
                                     x_batch_stride, x_node_stride, x_channel_stride,
                                     gy_batch_stride, gy_node_stride, gy_channel_stride,
                                     BB: tl.constexpr, BC: tl.constexpr):
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    col_ok = cols < channels
    cell, first, pairs, lo, hi = cell_split_steps(start_ptr, cells, splits, batch_chunks)
    acc = tl.zeros((BB, BC), dtype=tl.float32)
    for step in range(lo, hi):
        pair = first + step % pairs
        rows = (step // pairs) * BB + tl.arange(0, BB)
        mask = (rows < batch)[:, None] & col_ok[None, :]
        m = tl.load(pair_input_ptr + pair).to(tl.int64)
        n = tl.load(pair_node_ptr + pair).to(tl.int64)
        block = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_batch_stride + m * x_node_stride
                        + cols[None, :] * x_channel_stride, mask=mask, other=0.0)
        gy = tl.load(gy_ptr + rows[:, None].to(tl.int64) * gy_batch_stride + n * gy_node_stride
                     + cols[None, :] * gy_channel_stride, mask=mask, other=0.0)
        acc += block.to(tl.float32) * gy.to(tl.float32)
    out = partial_ptr + tl.program_id(0).to(tl.int64) * channels + cols
    tl.store(out, tl.sum(acc, axis=0), mask=col_ok)
