"""Variants of the triton kernels' step loops against the shipped kernels (GPU): dW loading
each step's box coordinates one step ahead, and the forward and dW loops warp-specialised.

    python scripts/probe_triton_steps.py GEOMETRY_DIR OUT.json LAYER_SUBSTR:BATCH [...]

The shipped kernels read a step's coordinates from their tables and then issue its two box
loads, so every step waits on a dependent load first: "ahead" carries the next step's
coordinates in registers across the loop. "specialised" asks Triton to split each loop into
producer warps issuing the box loads and consumer warps issuing the MMAs
(``tl.range(..., warp_specialize=True)``). All run with the rules' tiles on the same
channels-last fp16 operands, replayed as CUDA graphs (median of 20); outputs must agree bit
for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from knnconv.ops import get_ops
from knnconv.ops.triton import launch
from knnconv.tools.bench import graph_replay_ms, load_geometry_dir

DEVICE = torch.device("cuda")


@triton.jit
def forward_specialised_kernel(x_desc, w_desc, y_ptr, count_ptr, entry_x_ptr, entry_w_ptr,
                               batch, nout, cout, k_max, CHUNKS: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    node = tl.program_id(0)
    b0 = tl.program_id(1) * BM
    o0 = tl.program_id(2) * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    steps = tl.load(count_ptr + node) * CHUNKS
    for step in tl.range(steps, warp_specialize=True):
        entry = node * k_max + step // CHUNKS
        c0 = (step % CHUNKS) * BK
        a = x_desc.load([b0, tl.load(entry_x_ptr + entry) + c0])
        w = w_desc.load([tl.load(entry_w_ptr + entry) + c0, o0])
        acc = tl.dot(a, w, acc)
    cols = o0 + tl.arange(0, BN)
    rows = b0 + tl.arange(0, BM)
    out = y_ptr + rows[:, None].to(tl.int64) * (nout * cout) + node * cout + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < batch) & (cols[None, :] < cout))


@triton.jit
def grad_weight_specialised_kernel(x_desc, gy_desc, partial_ptr, start_ptr, pair_x_ptr,
                                   pair_gy_ptr, batch, cin, cout, cells, splits, batch_chunks,
                                   BM: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr):
    cell = tl.program_id(0) % cells
    split = tl.program_id(0) // cells
    c0 = tl.program_id(1) * BM
    o0 = tl.program_id(2) * BN
    first = tl.load(start_ptr + cell)
    pairs = tl.load(start_ptr + cell + 1) - first
    steps = pairs * batch_chunks
    lo = (steps * split) // splits
    hi = (steps * (split + 1)) // splits
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for step in tl.range(lo, hi, warp_specialize=True):
        pair = first + step % pairs
        b0 = (step // pairs) * BB
        a = x_desc.load([b0, tl.load(pair_x_ptr + pair) + c0])
        g = gy_desc.load([b0, tl.load(pair_gy_ptr + pair) + o0])
        acc = tl.dot(tl.trans(a), g, acc)
    rows = c0 + tl.arange(0, BM)
    cols = o0 + tl.arange(0, BN)
    out = partial_ptr + ((split * cells + cell) * cin + rows[:, None]) * cout + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < cin) & (cols[None, :] < cout))


@triton.jit
def grad_weight_ahead_kernel(x_desc, gy_desc, partial_ptr, start_ptr, pair_x_ptr, pair_gy_ptr,
                             batch, cin, cout, cells, splits, batch_chunks,
                             BM: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr):
    cell = tl.program_id(0) % cells
    split = tl.program_id(0) // cells
    c0 = tl.program_id(1) * BM
    o0 = tl.program_id(2) * BN
    first = tl.load(start_ptr + cell)
    pairs = tl.load(start_ptr + cell + 1) - first
    period = tl.maximum(pairs, 1)
    steps = pairs * batch_chunks
    lo = (steps * split) // splits
    hi = (steps * (split + 1)) // splits
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    pair = first + lo % period
    x_at = tl.load(pair_x_ptr + pair, mask=pairs > 0, other=0)
    gy_at = tl.load(pair_gy_ptr + pair, mask=pairs > 0, other=0)
    for step in range(lo, hi):
        following = first + (step + 1) % period
        x_next = tl.load(pair_x_ptr + following)
        gy_next = tl.load(pair_gy_ptr + following)
        b0 = (step // period) * BB
        a = x_desc.load([b0, x_at + c0])
        g = gy_desc.load([b0, gy_at + o0])
        acc = tl.dot(tl.trans(a), g, acc)
        x_at = x_next
        gy_at = gy_next
    rows = c0 + tl.arange(0, BM)
    cols = o0 + tl.arange(0, BN)
    out = partial_ptr + ((split * cells + cell) * cin + rows[:, None]) * cout + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < cin) & (cols[None, :] < cout))


def forward_variant(kernel, x, weight, tables, *, nout, v, tile):
    batch, cin, _ = x.shape
    cout = weight.shape[0]
    cells = launch.weight_by_cell(weight, cin, v, reverse=False)
    y = torch.empty((batch, nout, cout), dtype=x.dtype, device=x.device)
    grid = (nout, triton.cdiv(batch, tile.block_m), triton.cdiv(cout, tile.block_n))
    kernel[grid](
        launch.rows_descriptor(x, (tile.block_m, tile.block_k)),
        launch.TensorDescriptor.from_tensor(cells, [tile.block_k, tile.block_n]),
        y, tables.count, tables.entry_x, tables.entry_w, batch, nout, cout,
        tables.entry_x.shape[1], CHUNKS=cin // tile.block_k, BM=tile.block_m,
        BN=tile.block_n, BK=tile.block_k, num_warps=tile.warps, num_stages=tile.stages)
    return y.transpose(1, 2)


def grad_weight_variant(kernel, grad_y, x, tables, *, v, tile, splits):
    batch, cin, _ = x.shape
    cout = grad_y.shape[1]
    partial = torch.empty((splits, v, cin, cout), dtype=torch.float32, device=x.device)
    grid = (v * splits, triton.cdiv(cin, tile.block_m), triton.cdiv(cout, tile.block_n))
    kernel[grid](
        launch.rows_descriptor(x, (tile.block_k, tile.block_m)),
        launch.rows_descriptor(grad_y, (tile.block_k, tile.block_n)),
        partial, tables.cell_start, tables.cell_x, tables.cell_gy, batch, cin, cout, v,
        splits, triton.cdiv(batch, tile.block_k), BM=tile.block_m,
        BN=tile.block_n, BB=tile.block_k, num_warps=tile.warps, num_stages=tile.stages)
    return partial.permute(0, 3, 2, 1).sum(dim=0).view(cout, cin * v)


def probe_cell(layer, batch: int) -> list[dict]:
    plan = layer.plan()

    def channels_last(*shape):
        return torch.randn(shape[0], shape[2], shape[1], device=DEVICE,
                           dtype=torch.float16).transpose(1, 2)

    x = channels_last(batch, plan.cin, plan.nin)
    weight = torch.randn(plan.cout, plan.q, device=DEVICE, dtype=torch.float16)
    grad_y = channels_last(batch, plan.cout, plan.nout)
    tables = get_ops("triton").tables(plan, DEVICE)
    flop = 2 * batch * plan.entry_count * plan.cin * plan.cout
    forward_tile = launch.forward_tile(batch, plan.cin, plan.cout, plan.nout)
    weight_tile = launch.grad_weight_tile(batch, plan.cin, plan.cout)
    splits = launch.grad_weight_splits(
        weight_tile, batch=batch, cin=plan.cin, cout=plan.cout, v=plan.v,
        entries=plan.entry_count,
        processors=torch.cuda.get_device_properties(DEVICE).multi_processor_count)
    calls = {
        ("forward", "shipped"): lambda: launch.forward(x, weight, None, tables, nout=plan.nout,
                                                       v=plan.v, tile=forward_tile),
        ("forward", "specialised"): lambda: forward_variant(
            forward_specialised_kernel, x, weight, tables, nout=plan.nout, v=plan.v,
            tile=forward_tile),
        ("grad_weight", "shipped"): lambda: launch.grad_weight(grad_y, x, tables, v=plan.v,
                                                               tile=weight_tile, splits=splits),
        ("grad_weight", "ahead"): lambda: grad_weight_variant(
            grad_weight_ahead_kernel, grad_y, x, tables, v=plan.v, tile=weight_tile,
            splits=splits),
        ("grad_weight", "specialised"): lambda: grad_weight_variant(
            grad_weight_specialised_kernel, grad_y, x, tables, v=plan.v, tile=weight_tile,
            splits=splits),
    }
    rows = []
    for (family, variant), call in calls.items():
        if variant == "shipped":
            shipped = call()
            shipped_ms = graph_replay_ms(call, DEVICE, warmup=3, repeats=20)[0]
            continue
        row = {"layer": layer.name, "batch": batch, "family": family, "variant": variant,
               "tile": (forward_tile if family == "forward" else weight_tile).__dict__,
               "shipped_ms": shipped_ms, "shipped_tflops": flop / shipped_ms / 1e9}
        try:
            row["bit_identical"] = bool(torch.equal(shipped, call()))
            ms = graph_replay_ms(call, DEVICE, warmup=3, repeats=20)[0]
        except Exception as exc:  # a variant the compiler rejects (shared memory, ...)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"{layer.name[-40:]:40} B={batch:5} {family:11} {variant}: {row['error']}")
        else:
            row.update(ms=ms, tflops=flop / ms / 1e9)
            print(f"{layer.name[-40:]:40} B={batch:5} {family:11} shipped {shipped_ms:.3f} ms"
                  f"  {variant} {ms:.3f} ms ({shipped_ms / ms:.2f}x)"
                  f"  identical {row['bit_identical']}", flush=True)
        rows.append(row)
    return rows


def main() -> int:
    geometry, out, cells = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    rows = []
    for cell in cells:
        substring, batch = cell.rsplit(":", 1)
        for layer in load_geometry_dir(geometry, [substring])[:1]:
            rows += probe_cell(layer, int(batch))
            out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
