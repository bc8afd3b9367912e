"""Host-side launch geometry of the cuda backend (no GPU needed)."""

from __future__ import annotations

import pytest

from knnconv.ops.cuda.launch import LOG_TRANSPOSE_ELEMENTS, transpose_tile_log2


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
