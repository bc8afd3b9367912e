"""The ``triton`` backend's kernels for layers of few input channels (image stems: Cin = 3).

A stem's rows per neighbour are 6 bytes in channels-last storage, too narrow for a box, and
padding its channels to 16 (what the gather-GEMMs would need) multiplies its work by 16/3.
These kernels instead read x batch-innermost, xt[Nin, Cin, B], and put several neighbours in
one contraction step: step row j is channel j % S of slot k0 + j // S (S, the channel slots,
the power of two at least Cin; rows of channels >= Cin, of padding neighbours and of slots
past K load zeros). Each row is a contiguous run of batch elements, so every load is
coalesced; contraction rows are wasted only where Cin < S (3 of 4 used for an image) and in
the last step's slots past K.

- ``knn_stem_forward_kernel``: y[b, n, :] = bias + sum over steps of
  xt[rows of n's slots, b-tile]^T @ W[rows' (cell, channel), :], the weight laid out by cell
  [V*Cin, Cout].
- ``knn_stem_grad_weight_kernel``: per output node n, its partial P_n[(k, c), o] = sum over
  the batch of xt[knn[k, n], c, b] * grad_y[b, n, o], written once; the partials are then
  summed per kernel cell in a fixed order (``knn_stem_entry_sum_kernel``), so dW is
  deterministic.
- dx in two passes, so that grad_y is read once, not once per neighbour slot (K times, as the
  reversed-graph gather-GEMM reads it, over channels zero-padded to 16):
  ``knn_stem_slot_grad_kernel`` gives each output node n its slots' gradients
  Q_n[(k, c), b] = sum over o of W[o, c*V + cell[n, k]] * grad_y[b, n, o] (float32, batch
  innermost); ``knn_stem_entry_sum_kernel`` then sums, for each input node m, the rows of the
  (n, k) pairs that read m, in a fixed order: dx[b, m, c], deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _node_slots(neighbour_ptr, cell_ptr, node, rows, per_slot, k, nin):
    """A node's contraction rows: row r is channel r % per_slot of slot r // per_slot. Returns
    (channel, in_table, neighbour, cell); a slot past K reads as padding (Nin, cell 0)."""
    slot = rows // per_slot
    in_table = slot < k
    neighbour = tl.load(neighbour_ptr + node * k + slot, mask=in_table, other=nin)
    cell = tl.load(cell_ptr + node * k + slot, mask=in_table, other=0)
    return rows % per_slot, in_table, neighbour, cell


@triton.jit
def knn_stem_forward_kernel(xt_ptr, w_ptr, y_ptr, bias_ptr, neighbour_ptr, cell_ptr,
                            batch, nin, nout, cin, cout, k,
                            HAS_BIAS: tl.constexpr, SLOTS: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr):
    node = tl.program_id(0)
    b0 = tl.program_id(1) * BM
    o0 = tl.program_id(2) * BN
    rows = b0 + tl.arange(0, BM)
    cols = o0 + tl.arange(0, BN)
    step_rows = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k, BK // SLOTS):
        channel, _, neighbour, cell = _node_slots(neighbour_ptr, cell_ptr, node,
                                                  k0 * SLOTS + step_rows, SLOTS, k, nin)
        real = (neighbour < nin) & (channel < cin)
        xt_rows = (neighbour * cin + channel).to(tl.int64) * batch
        a = tl.load(xt_ptr + xt_rows[:, None] + rows[None, :],
                    mask=real[:, None] & (rows[None, :] < batch), other=0.0)
        w = tl.load(w_ptr + (cell * cin + channel)[:, None] * cout + cols[None, :],
                    mask=real[:, None] & (cols[None, :] < cout), other=0.0)
        acc = tl.dot(tl.trans(a), w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < cout, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None].to(tl.int64) * (nout * cout) + node * cout + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < batch) & (cols[None, :] < cout))


@triton.jit
def knn_stem_grad_weight_kernel(xt_ptr, gy_desc, partial_ptr, neighbour_ptr, cell_ptr,
                                batch, nin, cin, cout, k,
                                SLOTS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                BB: tl.constexpr):
    node = tl.program_id(0)
    r0 = tl.program_id(1) * BM
    o0 = tl.program_id(2) * BN
    slot_rows = r0 + tl.arange(0, BM)
    channel, in_table, neighbour, _ = _node_slots(neighbour_ptr, cell_ptr, node, slot_rows,
                                                  SLOTS, k, nin)
    real = (neighbour < nin) & (channel < cin)
    xt_rows = (neighbour * cin + channel).to(tl.int64) * batch
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for b0 in range(0, batch, BB):
        batch_rows = b0 + tl.arange(0, BB)
        a = tl.load(xt_ptr + xt_rows[:, None] + batch_rows[None, :],
                    mask=real[:, None] & (batch_rows[None, :] < batch), other=0.0)
        g = gy_desc.load([b0, node * cout + o0])
        acc = tl.dot(a, g, acc)
    cols = o0 + tl.arange(0, BN)
    out = partial_ptr + (node * k * SLOTS + slot_rows[:, None]).to(tl.int64) * cout \
        + cols[None, :]
    tl.store(out, acc, mask=in_table[:, None] & (cols[None, :] < cout))


@triton.jit
def knn_stem_slot_grad_kernel(gy_desc, w_ptr, q_ptr, neighbour_ptr, cell_ptr,
                              batch_start, chunk, nin, cin, cout, k,
                              BR: tl.constexpr, BB: tl.constexpr, BO: tl.constexpr):
    # Q[n, r, b - batch_start] for the node's slot rows r = k*Cin + c and one batch tile of the
    # chunk: W's rows of the node's slots [BR, BO] @ grad_y's box of the node [BB, BO]^T, over
    # output-channel chunks (BO divides Cout, so a box never reads the next node's columns)
    node = tl.program_id(0)
    r0 = tl.program_id(1) * BR
    b0 = tl.program_id(2) * BB
    rows = r0 + tl.arange(0, BR)
    channel, in_table, neighbour, cell = _node_slots(neighbour_ptr, cell_ptr, node, rows, cin,
                                                     k, nin)
    real = neighbour < nin
    acc = tl.zeros((BR, BB), dtype=tl.float32)
    for o0 in range(0, cout, BO):
        cols = o0 + tl.arange(0, BO)
        w = tl.load(w_ptr + (cell * cin + channel)[:, None] * cout + cols[None, :],
                    mask=real[:, None], other=0.0)
        g = gy_desc.load([batch_start + b0, node * cout + o0])
        acc = tl.dot(w, tl.trans(g), acc)
    batch_cols = b0 + tl.arange(0, BB)
    out = q_ptr + (node * k * cin + rows[:, None]).to(tl.int64) * chunk + batch_cols[None, :]
    tl.store(out, acc, mask=in_table[:, None] & (batch_cols[None, :] < chunk))


@triton.jit
def knn_stem_entry_sum_kernel(source_ptr, out_ptr, start_ptr, entry_ptr,
                              source_columns, columns, channels, entry_rows,
                              out_group_stride, out_channel_stride, out_column_stride,
                              out_column_start,
                              SLOTS: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr):
    # out[group, c, column] = sum over the group's entries e, in table order, of
    # source[entry[e] * entry_rows + c, column]: a kernel cell's (node, slot) entries over the
    # dW partials (entry_rows = SLOTS), or an input node's pairs over dx's slot gradients
    # (entry_rows = Cin). One program per (group, column tile), every channel at once. BE
    # entries are loaded per step (a group has hundreds to thousands, one load each would leave
    # the loop waiting on memory) into BE running sums, added up in a fixed order at the end:
    # deterministic.
    group = tl.program_id(0)
    c0 = tl.program_id(1) * BN
    rows = tl.arange(0, BE * SLOTS)  # entry rows // SLOTS of a step, channel rows % SLOTS
    channel = rows % SLOTS
    cols = c0 + tl.arange(0, BN)
    in_columns = cols < columns
    first = tl.load(start_ptr + group)
    last = tl.load(start_ptr + group + 1)
    acc = tl.zeros((BE * SLOTS, BN), dtype=tl.float32)
    for e0 in range(first, last, BE):
        entry = e0 + rows // SLOTS
        live = (entry < last) & (channel < channels)
        row = (tl.load(entry_ptr + entry, mask=live, other=0) * entry_rows + channel).to(tl.int64)
        acc += tl.load(source_ptr + row[:, None] * source_columns + cols[None, :],
                       mask=live[:, None] & in_columns[None, :], other=0.0)
    total = tl.sum(tl.reshape(acc, (BE, SLOTS, BN)), axis=0)
    out_channels = tl.arange(0, SLOTS)
    out = out_ptr + group.to(tl.int64) * out_group_stride \
        + out_channels[:, None] * out_channel_stride \
        + (out_column_start + cols[None, :]).to(tl.int64) * out_column_stride
    tl.store(out, total.to(out_ptr.dtype.element_ty),
             mask=(out_channels[:, None] < channels) & in_columns[None, :])
