"""The Triton kernel of the ``triton`` backend's bias gradient, grad_bias[c] = sum over the
batch and the output nodes of grad_y[b, c, n], in float32.

torch's ``grad_y.sum(dim=(0, 2))`` reads a channels-last grad_y at a tenth of the memory
bandwidth on Hopper (bench/NOTES.md, 2026-12-07: 119 us for 31 MB), longer than the layer's
forward. Here grad_y is read as rows (b, n) of channels: a program sums a fixed range of rows
for one tile of channels into a float32 partial, and the partials are added in a fixed order
after, so the bias gradient is the same from run to run. Any strides are taken; channels-last
storage makes every row one contiguous run of channels.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grad_bias_partials_kernel(gy_ptr, partial_ptr, rows, nout, channels, rows_per_program,
                              batch_stride, node_stride, channel_stride,
                              BR: tl.constexpr, BC: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    first = program * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    for r0 in range(first, last, BR):
        row = r0 + tl.arange(0, BR)  # row b * nout + n
        b = row // nout
        offsets = (b.to(tl.int64) * batch_stride + (row - b * nout).to(tl.int64) * node_stride)
        g = tl.load(gy_ptr + offsets[:, None] + cols[None, :].to(tl.int64) * channel_stride,
                    mask=(row[:, None] < last) & (cols[None, :] < channels), other=0.0)
        acc += g.to(tl.float32)
    tl.store(partial_ptr + program.to(tl.int64) * channels + cols, tl.sum(acc, axis=0),
             mask=cols < channels)
