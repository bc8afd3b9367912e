"""GPU time of the cuda backend's operand re-layouts (transpose_pad, transpose_pairs) on shapes of
the published layers at B = 2048, against torch copying the same bytes (a permuted
.contiguous() with the same dtype conversion, one copy_ kernel) in the same run: the
re-layouts' share of the copy ceiling.

    python scripts/bench_relayouts.py OUT.json

Each figure is the median over 5 replays of 20 calls captured as one CUDA graph, divided by
20, so host launch cost does not count. With KNNCONV_NCU=1 each
re-layout runs once (a target for Nsight Compute: `ncu -k regex:transpose -c 6`).
"""

from __future__ import annotations

import math
import os
import sys

import torch

from knnconv.ops.cuda import relayout
from knnconv.ops.cuda.launch import Transpose
from knnconv.tools.bench import replayed_ms_per_call, write_rows

DEVICE = torch.device("cuda")
B = 2048


ONCE = bool(os.environ.get("KNNCONV_NCU"))


def gpu_ms(call) -> float:
    """GPU ms per call, replayed (knnconv.tools.bench.replayed_ms_per_call); under Nsight
    Compute one call, untimed."""
    if ONCE:
        call()
        torch.cuda.synchronize()
        return math.nan
    return replayed_ms_per_call(call, DEVICE)


def case(name, src, src_strides, src_extents, dst_extents, dst_strides, dst_dtype, torch_copy,
         *, with_sums: bool = False) -> dict:
    """One re-layout (transpose_pad or transpose_pairs, whichever the call takes) against
    torch_copy() moving the same bytes."""
    index = DEVICE.index or 0
    relayout = Transpose(src.dtype, dst_dtype, index, src_extents, dst_extents, dst_strides,
                         sums_z=with_sums)
    dst_z, dst_c = dst_extents[0], dst_extents[2]
    dst = torch.empty(dst_z * dst_c * dst_extents[1], dtype=dst_dtype, device=DEVICE)
    sums = torch.zeros(src_extents[0], dtype=torch.float32, device=DEVICE)
    sums_at = sums.data_ptr() if with_sums else 0
    ms = gpu_ms(lambda: relayout(src, dst.data_ptr(), src_strides, sums_at))
    copy_ms = gpu_ms(torch_copy)
    kernel, tile = relayout.kernel_and_tile(src.data_ptr(), dst.data_ptr(), src_strides)
    return row_of(name, kernel, list(tile), src, dst, ms, copy_ms)


def row_of(name: str, kernel: str, tile, src, dst, ms: float, copy_ms: float) -> dict:
    """A result row (printed): the re-layout's time and rate against torch's copy."""
    moved = src.numel() * src.element_size() + dst.numel() * dst.element_size()
    row = {"relayout": name, "kernel": kernel, "tile": tile,
           "ms": ms, "torch_copy_ms": copy_ms, "gbps": moved / ms / 1e6,
           "torch_copy_gbps": moved / copy_ms / 1e6, "bytes": moved}
    print(f"{name:30} {kernel:15} {tile!s:10} {ms * 1e3:8.1f} us "
          f"{row['gbps']:7.0f} GB/s   torch copy {copy_ms * 1e3:8.1f} us "
          f"{row['torch_copy_gbps']:7.0f} GB/s")
    return row


def main(out: str) -> None:
    half = torch.float16
    rows = []
    # conv1 (Cin 3, Nin 4085, Nout 964, Cout 64): x -> xt [Cin*Nin + 1, B]
    x = torch.randn(B, 3 * 4085, device=DEVICE, dtype=half)
    rows.append(case("conv1 x -> xt", x, (0, x.stride(0), 1), (1, B, 3 * 4085),
                     (1, B, 3 * 4085 + 1), (0, B), half, lambda: x.t().contiguous()))
    # conv1 grad_y [B, 64, 964] -> gt [964, 64, B], with the bias sums
    g = torch.randn(B, 64, 964, device=DEVICE, dtype=half)
    rows.append(case("conv1 grad_y -> gt (+bias)", g, (g.stride(1), g.stride(0), 1),
                     (64, B, 964), (64, B, 964), (B, 64 * B), half,
                     lambda: g.permute(2, 1, 0).contiguous(), with_sums=True))
    rows.append(case("conv1 grad_y -> gt", g, (g.stride(1), g.stride(0), 1), (64, B, 964),
                     (64, B, 964), (B, 64 * B), half, lambda: g.permute(2, 1, 0).contiguous()))
    # conv1 dx staging fp32 [Cin*Nin, B] -> dx [B, Cin*Nin] fp16 (scatter algorithm)
    s = torch.randn(3 * 4085, B, device=DEVICE)
    dx = torch.empty(B, 3 * 4085, device=DEVICE, dtype=half)
    rows.append(case("conv1 dx staging -> dx", s, (0, B, 1), (1, 3 * 4085, B),
                     (1, 3 * 4085, B), (0, 3 * 4085), half, lambda: dx.copy_(s.t())))
    # layer4.0.conv2 grad_y [B, 512, 2] -> gt [2, 512, B], with the bias sums
    g2 = torch.randn(B, 512, 2, device=DEVICE, dtype=half)
    rows.append(case("layer4 grad_y -> gt (+bias)", g2, (g2.stride(1), g2.stride(0), 1),
                     (512, B, 2), (512, B, 2), (B, 512 * B), half,
                     lambda: g2.permute(2, 1, 0).contiguous(), with_sums=True))
    # layer4.0.conv1 dx staging fp32 [B, Nin 16, Cin 256] -> dx [B, 256, 16] (gather)
    s2 = torch.randn(B, 16, 256, device=DEVICE)
    dx2 = torch.empty(B, 256, 16, device=DEVICE, dtype=half)
    rows.append(case("layer4 dx staging -> dx", s2, (16 * 256, 256, 1), (B, 16, 256),
                     (B, 16, 256), (256 * 16, 16), half, lambda: dx2.copy_(s2.transpose(1, 2))))
    # weight by cell, V = 9: W [512, 256*9] -> wr [9, 512, 256]
    w = torch.randn(512, 256 * 9, device=DEVICE, dtype=half)
    rows.append(case("layer4 weight -> by cell (V 9)", w, (w.stride(0), 9, 1), (512, 256, 9),
                     (512, 256, 9), (256, 512 * 256), half,
                     lambda: w.view(512, 256, 9).permute(2, 0, 1).contiguous()))
    # layer4.0.conv2's float32 parameter under autocast, V = 36: W [512, 512*36] -> wc
    # [36, 512, 512] float16, one source read (a layer per input channel, along the rows)
    w32 = torch.randn(512, 512 * 36, device=DEVICE)
    by_cell = relayout.weight_by_cell_transposed(512, 512, 36, 512, half, DEVICE.index or 0)
    wc = torch.empty(36, 512, 512, device=DEVICE, dtype=half)
    rows.append(row_of("layer4 fp32 weight -> by cell^T (V 36)", "WeightLayout",
                       None, w32, wc, gpu_ms(lambda: by_cell(w32, wc.data_ptr())),
                       gpu_ms(lambda: wc.copy_(w32.view(512, 512, 36).permute(2, 1, 0)))))
    write_rows(out, rows, DEVICE, batch=B)


if __name__ == "__main__":
    main(sys.argv[1])
