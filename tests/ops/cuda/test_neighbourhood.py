"""The host side of the pooling and depthwise kernels: the tables they read and the windows
they refuse (the kernels themselves: test_neighbourhood_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_geometry
from knnconv.ops.cuda import neighbourhood


@pytest.mark.parametrize("depthwise", [False, True])
def test_each_pair_of_the_reversed_graph_names_its_slot_or_cell(depthwise):
    """A pooling's pairs carry the slot k that reads the input (what a max's choice code
    names); a depthwise layer's carry that slot's kernel cell."""
    geometry = random_geometry(torch.Generator().manual_seed(3), nin=30, nout=11, k=6, v=6,
                               padding=0.25, collisions=True)
    knn, nin = geometry.knn_indices, geometry.nin
    cells = geometry.rf_index.t() if depthwise else None
    tables = neighbourhood.native_tables(knn, cells, nin)
    reverse = tables.reverse
    start = reverse.pair_start.long()
    pairs = [(m, reverse.pair_node[j].item(), reverse.pair_cell[j].item())
             for m in range(nin) for j in range(start[m], start[m + 1])]
    real_slots = [(knn[k, n].item(), n, k) for k, n in (knn != nin).nonzero().tolist()]
    if depthwise:
        assert sorted(pairs) == sorted((m, n, cells[k, n].item()) for m, n, k in real_slots)
    else:  # each real slot once, as (input, node, slot)
        assert sorted(pairs) == sorted(real_slots)


def test_a_choice_code_holds_every_slot_and_tie_count_in_one_byte():
    limit = neighbourhood.MAX_TIED_NEIGHBOURS
    assert limit < neighbourhood.CHOICE_TIED  # slots 0 .. K-1 stay under the flag
    assert neighbourhood.CHOICE_TIED + limit == torch.iinfo(neighbourhood.TIES_DTYPE).max


@pytest.mark.parametrize("mode", ["max", "max_relu"])
def test_max_pooling_refuses_a_window_wider_than_its_choice_byte_before_any_launch(mode):
    k = neighbourhood.MAX_TIED_NEIGHBOURS + 1
    knn = torch.arange(k, dtype=torch.int32)[:, None]
    x = torch.ones(1, 8, k)
    with pytest.raises(ValueError, match=f"at most K = {k - 1} neighbours, got K = {k}"):
        neighbourhood.pool_forward(x, knn, k, mode)
