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
  summed per kernel cell in a fixed order (``knn_stem_cell_sum_kernel``), so dW is
  deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
        slot = k0 + step_rows // SLOTS
        channel = step_rows % SLOTS
        in_table = slot < k
        neighbour = tl.load(neighbour_ptr + node * k + slot, mask=in_table, other=nin)
        cell = tl.load(cell_ptr + node * k + slot, mask=in_table, other=0)
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
def knn_stem_grad_weight_kernel(xt_ptr, gy_desc, partial_ptr, neighbour_ptr,
                                batch, nin, cin, cout, k, partial_rows,
                                SLOTS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                BB: tl.constexpr):
    node = tl.program_id(0)
    r0 = tl.program_id(1) * BM
    o0 = tl.program_id(2) * BN
    slot_rows = r0 + tl.arange(0, BM)
    slot = slot_rows // SLOTS
    channel = slot_rows % SLOTS
    in_table = slot < k
    neighbour = tl.load(neighbour_ptr + node * k + slot, mask=in_table, other=nin)
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
    out = partial_ptr + (node * partial_rows + slot_rows[:, None]).to(tl.int64) * cout \
        + cols[None, :]
    tl.store(out, acc, mask=(slot_rows[:, None] < partial_rows) & (cols[None, :] < cout))


@triton.jit
def knn_stem_cell_sum_kernel(partial_ptr, grad_ptr, start_ptr, slot_ptr,
                             cin, cout, v, k, partial_rows,
                             SLOTS: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr):
    # dW[o, c*V + cell] = sum over the cell's (node, slot) entries of P_node[slot*SLOTS + c, o]:
    # one program per (cell, column tile), every channel at once. BE entries are loaded per
    # step (a cell has hundreds to thousands, one load each would leave the loop waiting on
    # memory) into BE running sums, added up in a fixed order at the end: deterministic.
    cell = tl.program_id(0)
    o0 = tl.program_id(1) * BN
    rows = tl.arange(0, BE * SLOTS)  # entry rows // SLOTS of a step, channel rows % SLOTS
    channel = rows % SLOTS
    cols = o0 + tl.arange(0, BN)
    first = tl.load(start_ptr + cell)
    last = tl.load(start_ptr + cell + 1)
    acc = tl.zeros((BE * SLOTS, BN), dtype=tl.float32)
    for e0 in range(first, last, BE):
        entry = e0 + rows // SLOTS
        live = (entry < last) & (channel < cin)
        node_slot = tl.load(slot_ptr + entry, mask=live, other=0)  # node * K + slot
        row = ((node_slot // k) * partial_rows + (node_slot % k) * SLOTS + channel).to(tl.int64)
        acc += tl.load(partial_ptr + row[:, None] * cout + cols[None, :],
                       mask=live[:, None] & (cols[None, :] < cout), other=0.0)
    total = tl.sum(tl.reshape(acc, (BE, SLOTS, BN)), axis=0)
    channels = tl.arange(0, SLOTS)
    out = grad_ptr + cols[None, :] * (cin * v) + channels[:, None] * v + cell
    tl.store(out, total, mask=(channels[:, None] < cin) & (cols[None, :] < cout))
