"""The channels-last path's host side, no GPU needed: its entry tables, tile choice and
refusals, and which calls take it."""

from __future__ import annotations

import pytest
import torch

from conftest import random_geometry, with_all_padding_node
from knnconv import make_plan
from knnconv.ops.cuda import CudaOps, channels_last, configs
from knnconv.ops.registry import channels_fastest


@pytest.mark.parametrize("padding,all_padding_node", [(0.0, False), (0.4, True)])
def test_entry_tables_list_each_nodes_real_neighbours_in_order(padding, all_padding_node):
    geometry = random_geometry(torch.Generator().manual_seed(3), nin=20, nout=9, k=6,
                               padding=padding)
    knn = with_all_padding_node(geometry) if all_padding_node else geometry.knn_indices
    tables = channels_last.entry_tables(knn, geometry.rf_index, geometry.nin)
    assert tables.start[0] == 0 and tables.start[-1] == tables.count
    for node in range(geometry.nout):
        begin, end = int(tables.start[node]), int(tables.start[node + 1])
        real = [k for k in range(geometry.k) if knn[k, node] != geometry.nin]
        assert tables.row[begin:end].tolist() == [int(knn[k, node]) for k in real]
        assert tables.cell[begin:end].tolist() == [int(geometry.rf_index[node, k]) for k in real]
        assert tables.node[begin:end].tolist() == [node] * len(real)
    if all_padding_node:
        assert tables.start[-1] == tables.start[-2]
    for table in (tables.start, tables.row, tables.cell, tables.node):
        assert table.dtype == torch.int32 and table.is_contiguous()
    plan = make_plan(knn, geometry.rf_index, nin=geometry.nin, v=geometry.v, cin=16, cout=16)
    assert plan.entry_count == tables.count


@pytest.mark.parametrize("batch", [1, 17, 129, 2048])
@pytest.mark.parametrize("width", [16, 48, 64, 96, 512])
@pytest.mark.parametrize("n", [16, 80, 512])
def test_default_tiles_fit_the_channels_of_an_entry(batch, width, n):
    gather = configs.default_gather_cl_config(batch, n, width, nodes=60)
    assert width % gather.bk == 0
    configs.check_config("gather_cl", gather, width=width)
    weight = configs.default_grad_weight_cl_config(batch, n, width)
    assert width % weight.tile_m == 0
    configs.check_config("grad_weight_cl", weight, width=width)


@pytest.mark.parametrize("family,cfg,width", [
    ("gather_cl", (64, 64, 32, 1, 2, 2, 3, True, 8), 48),
    ("grad_weight_cl", (64, 64, 32, 1, 2, 2, 4, True, 8), 96),
])
def test_a_channel_tile_that_does_not_divide_an_entrys_channels_is_refused(family, cfg, width):
    with pytest.raises(ValueError, match="must divide the"):
        configs.check_config(family, configs.KernelConfig(*cfg), width=width)


def test_the_backward_of_an_in_place_forward_keeps_x_itself():
    # torch.compile allocates what the forward keeps from saved_layout (the fake
    # implementation): None, x itself, for a channels-last x the kernels read in place; a
    # contiguous x, or a layer of odd channel counts, keeps the re-layout
    geometry = random_geometry(torch.Generator().manual_seed(1), nin=30, nout=12, k=5)
    ops = CudaOps()

    def x_in(storage, cin):
        if storage == "channels_last":
            return torch.empty(4, 30, cin, device="meta").transpose(1, 2)
        return torch.empty(4, cin, 30, device="meta")

    plan = geometry.plan(cin=64, cout=32)
    assert ops.saved_layout(plan, x_in("channels_last", 64), torch.float16) is None
    assert ops.saved_layout(plan, x_in("contiguous", 64), torch.float16) is not None
    odd = geometry.plan(cin=24, cout=32)
    assert ops.saved_layout(odd, x_in("channels_last", 24), torch.float16) is not None
    assert channels_fastest(x_in("channels_last", 64))
    assert not channels_fastest(x_in("contiguous", 64))
