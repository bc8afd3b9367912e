"""The Triton kernels of the ``triton`` backend: gather-GEMMs whose operands are TMA boxes.

In channels-last storage the rows a neighbour m contributes to a batch tile are one strided
box of the 2-D view x[B, Nin*Cin] (rows b0:b0+BM, columns m*Cin + c0 : +BK): the gather index
varies along the GEMM's contraction, never along its batch rows. So every step of every kernel
here is two tensor-descriptor loads (TMA on Hopper, zero-filled out of bounds) and one
``tl.dot`` (warpgroup MMA on Hopper), and no thread computes an address per row:

- ``knn_conv_forward_kernel``: y[b, n, :] = bias + sum over n's real entries (m, v) and
  channel chunks of x[b, m, c-chunk] @ Wc[v, c-chunk, :], Wc the weight laid out by cell
  [V*Cin, Cout].
- ``knn_conv_grad_input_kernel``: dx over the reversed graph, dx[b, m, :] = sum over m's
  (n, v) pairs of grad_y[b, n, o-chunk] @ Wr[v, o-chunk, :], Wr the weight laid out
  [V*Cout, Cin].
- ``knn_conv_grad_weight_kernel``: per kernel cell v, dW_v[c, o] = sum over v's (m, n) pairs
  and batch chunks of x[b-chunk, m, c]^T @ grad_y[b-chunk, n, o], walked window by window: a
  window is a share of the output nodes by a group of batch chunks, and a program owns one
  window of one cell's tile. The programs of one window, one per cell, are launched together
  and read the same rows, so x and grad_y come from L2 once a window instead of once per pair
  from DRAM. Each tile's windows add into a few float32 sums, window w into sum w % sums,
  each sum's windows in window order (a program waits for the previous one's turn), and the
  sums are added in a fixed order, so dW is the same from run to run. Several sums keep each
  tile's chain of turns short where a layer has many short windows.

Entry tables hold element offsets (m*Cin, v*Cin, ...) so a step's box coordinates are loads,
not products. Accumulation is float32 in every kernel; outputs are stored through masked
pointers, so any batch and channel count past the contraction's chunking is served.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def knn_conv_forward_kernel(x_desc, w_desc, y_ptr, bias_ptr, count_ptr, entry_x_ptr, entry_w_ptr,
                       batch, nout, cout, k_max,
                       HAS_BIAS: tl.constexpr, CHUNKS: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    node = tl.program_id(0)
    b0 = tl.program_id(1) * BM
    o0 = tl.program_id(2) * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    steps = tl.load(count_ptr + node) * CHUNKS
    for step in range(steps):
        entry = node * k_max + step // CHUNKS
        c0 = (step % CHUNKS) * BK
        a = x_desc.load([b0, tl.load(entry_x_ptr + entry) + c0])
        w = w_desc.load([tl.load(entry_w_ptr + entry) + c0, o0])
        acc = tl.dot(a, w, acc)
    cols = o0 + tl.arange(0, BN)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < cout, other=0.0).to(tl.float32)[None, :]
    rows = b0 + tl.arange(0, BM)
    out = y_ptr + rows[:, None].to(tl.int64) * (nout * cout) + node * cout + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < batch) & (cols[None, :] < cout))


@triton.jit
def knn_conv_grad_input_kernel(gy_desc, w_desc, dx_ptr, start_ptr, pair_gy_ptr, pair_w_ptr,
                          batch, nin, cin,
                          CHUNKS: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    node = tl.program_id(0)
    b0 = tl.program_id(1) * BM
    c0 = tl.program_id(2) * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    first = tl.load(start_ptr + node)
    steps = (tl.load(start_ptr + node + 1) - first) * CHUNKS
    for step in range(steps):
        pair = first + step // CHUNKS
        o0 = (step % CHUNKS) * BK
        g = gy_desc.load([b0, tl.load(pair_gy_ptr + pair) + o0])
        w = w_desc.load([tl.load(pair_w_ptr + pair) + o0, c0])
        acc = tl.dot(g, w, acc)
    rows = b0 + tl.arange(0, BM)
    cols = c0 + tl.arange(0, BN)
    out = dx_ptr + rows[:, None].to(tl.int64) * (nin * cin) + node * cin + cols[None, :]
    tl.store(out, acc.to(dx_ptr.dtype.element_ty),
             mask=(rows[:, None] < batch) & (cols[None, :] < cin))


@triton.jit
def cell_split_steps(start_ptr, cells, splits, batch_chunks):
    """This program's kernel cell (program id 0 is split * cells + cell), its pairs
    [first, first + pairs) and its range [lo, hi) of the cell's steps: batch chunks x pairs,
    batch-major (step s is pair s % pairs of chunk s // pairs), split into equal contiguous
    ranges."""
    cell = tl.program_id(0) % cells
    split = tl.program_id(0) // cells
    first = tl.load(start_ptr + cell)
    pairs = tl.load(start_ptr + cell + 1) - first
    steps = pairs * batch_chunks
    return cell, first, pairs, (steps * split) // splits, (steps * (split + 1)) // splits


@triton.jit
def knn_conv_grad_weight_kernel(x_desc, gy_desc, grad_ptr, turn_ptr, share_start_ptr,
                                pair_x_ptr, pair_gy_ptr, cin, cout, cells, shares, groups,
                                batch_chunks, sums,
                                BM: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr):
    # program id (window * cells + cell) * tiles + tile: the programs of one window are
    # consecutive, so they run together; window = group * shares + share
    tiles_n = tl.cdiv(cout, BN)
    tiles = tl.cdiv(cin, BM) * tiles_n
    pid = tl.program_id(0)
    tile = pid % tiles
    cell = (pid // tiles) % cells
    window = pid // (tiles * cells)
    share = window % shares
    group = window // shares
    c0 = (tile // tiles_n) * BM
    o0 = (tile % tiles_n) * BN
    # the cell's pairs whose output node lies in the share, and the group's batch chunks
    starts = share_start_ptr + cell * (shares + 1) + share
    first = tl.load(starts)
    pairs = tl.load(starts + 1) - first
    chunk0 = group * batch_chunks // groups
    chunks = (group + 1) * batch_chunks // groups - chunk0
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for step in range(pairs * chunks):
        pair = first + step % pairs
        b0 = (chunk0 + step // pairs) * BB
        a = x_desc.load([b0, tl.load(pair_x_ptr + pair) + c0])
        g = gy_desc.load([b0, tl.load(pair_gy_ptr + pair) + o0])
        acc = tl.dot(tl.trans(a), g, acc)
    # window w adds into sum w % sums, the link w // sums of that sum's chain
    total = window % sums
    link = window // sums
    rows = c0 + tl.arange(0, BM)
    cols = o0 + tl.arange(0, BN)
    out = grad_ptr + ((total * cells + cell) * cin + rows[:, None]) * cout + cols[None, :]
    inside = (rows[:, None] < cin) & (cols[None, :] < cout)
    # the tile's turn counter in the sum says how many links have added: link l waits for
    # l (programs start in id order, so the window it waits for has started), then adds
    turn = turn_ptr + (total * cells + cell) * tiles + tile
    if link == 0:
        tl.store(out, acc, mask=inside)
    else:
        while tl.atomic_add(turn, 0, sem="acquire") < link:
            pass
        if pairs * chunks > 0:
            # alone on the tile while it holds the turn: the adds land in link order
            tl.atomic_add(out, acc, mask=inside, sem="relaxed")
    tl.debug_barrier()  # every thread's sum has landed before the turn passes on
    tl.atomic_xchg(turn, link + 1, sem="release")
