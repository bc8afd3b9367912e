"""The raw launches' host side: the transpose kernels' tiles, grids and pair accesses and
what the kernels read in place (CPU, kernel builds stubbed), and the transposes against torch
(GPU). The re-layouts built on them are tested in test_relayout.py."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from knnconv.ops.cuda import launch
from knnconv.ops.cuda.launch import LOG_TRANSPOSE_ELEMENTS, Transpose, transpose_tile_log2
from knnconv.ops.cuda.launch_plan import MAX_GRID_YZ


@pytest.mark.parametrize("dst_a,dst_c,expected", [
    (4096, 4096, (5, 5)),  # both extents wide: the square tile
    (2048, 2, (9, 1)),  # two nodes: two columns, 512 batch rows
    (512, 9, (6, 4)),  # nine cells: 16 columns
    (512, 1, (10, 0)),  # one column
    (1, 1024, (0, 10)),  # one batch row
    (16, 4096, (4, 6)),
    (33, 31, (5, 5)),
])
def test_transpose_tile_narrows_to_a_small_extent(dst_a, dst_c, expected):
    log_a, log_c = transpose_tile_log2(dst_a, dst_c)
    assert (log_a, log_c) == expected
    assert log_a + log_c == LOG_TRANSPOSE_ELEMENTS


class UnbuiltKernel:
    def allow_shared_memory(self, size: int) -> None:
        pass


@pytest.fixture
def unbuilt(monkeypatch):
    monkeypatch.setattr(launch, "get_kernel", lambda name, index, **target: UnbuiltKernel())


def test_a_relayout_reports_the_kernel_and_tile_each_call_takes(unbuilt):
    relayout = Transpose(torch.float16, torch.float16, 0, (1, 256, 256), (1, 256, 256),
                         (0, 256))
    pad_tile = (1 << relayout.log_tile_a, 1 << relayout.log_tile_c)
    assert relayout.kernel_and_tile(0, 0, (0, 256, 1)) == (
        "transpose_pairs", (launch.PAIRS_TILE, launch.PAIRS_TILE))
    # an address off the pair boundary, or an odd source stride, takes single elements
    assert relayout.kernel_and_tile(2, 0, (0, 256, 1)) == ("transpose_pad", pad_tile)
    assert relayout.kernel_and_tile(0, 0, (0, 255, 1)) == ("transpose_pad", pad_tile)


def test_relayout_grids_stay_within_cuda_limits(unbuilt):
    # the scatter path's dx restore of Cin 15 x Nin 300,001 rows: 140,626 row tiles of 32,
    # launched as at most 65,535 CTA rows that loop over the rest
    rows = 15 * 300_001
    relayout = Transpose(torch.float32, torch.float16, 0, (1, rows, 17), (1, rows, 17),
                         (0, rows))
    assert -(-rows // (1 << relayout.log_tile_a)) > MAX_GRID_YZ
    assert relayout.grid[1] == MAX_GRID_YZ
    even = Transpose(torch.float32, torch.float16, 0, (1, rows + 1, 64), (1, rows + 1, 64),
                     (0, rows + 1))
    assert even.pairs_grid[1] <= MAX_GRID_YZ
    with pytest.raises(ValueError, match="grid limit"):
        Transpose(torch.float16, torch.float16, 0, (70_000, 8, 8), (70_000, 8, 8), (64, 8))


def test_only_aligned_channels_last_storage_is_read_in_place():
    grad = torch.zeros(4, 10, 64, dtype=torch.float16).transpose(1, 2)
    assert launch.readable(grad)
    assert not launch.readable(grad.contiguous())  # channels not fastest
    assert not launch.readable(torch.zeros(4, 10, 60, dtype=torch.float16).transpose(1, 2))
    odd_stride = torch.zeros(4, 10 * 64 + 4, dtype=torch.float16)[:, :640]
    assert not launch.readable(odd_stride.view(4, 10, 64).transpose(1, 2))


requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
    reason="needs a CUDA device and CuPy")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (torch.float16, torch.float16), (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("extents,kernel", [
    ((3, 65, 70, 80, 71), "pairs"),  # odd extents, padding past both
    ((2, 130, 34, 130, 35), "pairs"),
    ((2, 200, 2, 208, 2), "narrow"),  # two columns: transpose_pad's narrow tile
    ((1, 9, 300, 16, 301), "narrow"),
    ((3, 65, 70, 80, 71), "misaligned"),  # a source one element off: no pair accesses
    ((2, 40, 69, 48, 70), "odd_width"),  # rows padded to 70: pairs, then one odd last column
    ((2, 60, 70, 65, 71), "odd_dst"),  # 65 destination rows in a pitch of 66: one odd last row
])
def test_transpose_matches_torch_with_padding_and_sums(src_dtype, dst_dtype, extents, kernel):
    z, a, c, dst_a, dst_c = extents
    skip = 1 if kernel == "misaligned" else 0
    pitch = c + 1 if kernel == "odd_width" else c
    storage = torch.randn(z * a * pitch + skip, device="cuda").to(src_dtype)
    src = storage[skip:].view(z, a, pitch)[:, :, :c]
    dst_pitch = dst_a + 1 if kernel == "odd_dst" else dst_a
    relayout = Transpose(src_dtype, dst_dtype, 0, (z, a, c), (z, dst_a, dst_c),
                         (dst_c * dst_pitch, dst_pitch), sums_z=True)
    assert relayout.uses_pairs(src.data_ptr(), 0, src.stride()) == (
        kernel in ("pairs", "odd_width", "odd_dst"))
    dst = torch.full((z, dst_c, dst_pitch), math.nan, dtype=dst_dtype, device="cuda")
    sums = torch.zeros(z, device="cuda")
    relayout(src, dst.data_ptr(), src.stride(), sums.data_ptr())
    expected = torch.full((z, dst_c, dst_pitch), math.nan, dtype=dst_dtype, device="cuda")
    expected[:, :, :dst_a] = 0
    expected[:, :c, :a] = src.transpose(1, 2).to(dst_dtype)
    assert torch.equal(dst[..., :dst_a], expected[..., :dst_a])
    assert dst[..., dst_a:].isnan().all(), "wrote past the destination rows"
    torch.testing.assert_close(sums, src.float().sum((1, 2)), rtol=1e-5, atol=1e-3)
