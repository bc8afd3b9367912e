"""torch_binned's gather tables (its agreement with the reference: test_torch_backends.py)."""

import torch

from knnconv import get_ops, make_plan
from knnconv.ops.torch_binned import BinTables, bin_sources

BINNED = get_ops("torch_binned")


def test_bin_sources_rank_neighbours_sharing_a_cell_and_address_padding():
    nin, cin, v = 5, 2, 3
    # Node 0: slots 0 and 2 in cell 1, slot 1 in cell 0, slot 3 padding (in cell 2).
    # Node 1: every slot in cell 2, one of them padding.
    knn = torch.tensor([[4, 0], [1, 5], [3, 2], [5, 1]])  # [K, Nout]
    rf = torch.tensor([[1, 0, 1, 2], [2, 2, 2, 2]])  # [Nout, K]
    sources = bin_sources(knn, rf, cin, nin, v).view(-1, 2, cin, v)
    pad = cin * nin
    assert sources.shape[0] == 3  # node 1 has three real neighbours in cell 2
    for channel in range(cin):
        base = channel * nin
        assert sources[:, 0, channel].tolist() == [[base + 1, base + 4, pad],
                                                   [pad, base + 3, pad],
                                                   [pad, pad, pad]]
        assert sources[:, 1, channel].tolist() == [[pad, pad, base + 0],
                                                   [pad, pad, base + 2],
                                                   [pad, pad, base + 1]]


def test_bin_tables_keep_first_neighbours_dense_and_list_the_rest_by_node():
    knn = torch.tensor([[4, 0], [1, 5], [3, 2], [5, 1]])
    rf = torch.tensor([[1, 0, 1, 2], [2, 2, 2, 2]])
    sources = bin_sources(knn, rf, 2, 5, 3)
    tables = BinTables.build(sources, padding_address=10)
    assert torch.equal(tables.first, sources[0])
    # Further neighbours: node 0 cell 1 (address 3, 8 in channels 0, 1); node 1 cell 2, twice.
    assert tables.extra_start == [0, 2, 6]
    assert tables.extra_position.tolist() == [1, 4, 8, 11, 8, 11]
    assert tables.extra_address.tolist() == [3, 8, 2, 7, 1, 6]
    positions, addresses = tables.extras(1, 2)
    assert positions.tolist() == [2, 5, 2, 5] and addresses.tolist() == [2, 7, 1, 6]
    assert tables.extras(0, 0) is None


def test_all_padding_gives_one_rank_of_padding_addresses():
    knn = torch.full((3, 2), 4)
    sources = bin_sources(knn, torch.zeros(2, 3, dtype=torch.int64), 2, 4, 1)
    assert sources.shape == (1, 2, 2) and bool((sources == 8).all())


def test_a_neighbour_listed_twice_counts_twice():
    # The same input in two slots of one cell: the bin holds twice its value.
    knn = torch.tensor([[0, 1], [0, 1], [2, 3]])
    rf = torch.tensor([[0, 0, 1], [1, 0, 0]])
    plan = make_plan(knn, rf, nin=4, v=2, cin=1, cout=1)
    x = torch.arange(1.0, 5.0, dtype=torch.float64).view(1, 1, 4)
    weight = torch.tensor([[10.0, 1.0]], dtype=torch.float64)
    y = BINNED.forward(plan, x, weight, None)
    assert y.tolist() == [[[2 * 1.0 * 10 + 3.0 * 1, 2.0 * 1 + (2.0 + 4.0) * 10]]]
