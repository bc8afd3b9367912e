"""The ``triton`` backend's index tables of one layer, built once per device from a plan.

Each table holds element offsets into the 2-D views its kernel loads boxes from (x as
[B, Nin*Cin], grad_y as [B, Nout*Cout], the weight by cell as [V*Cin, Cout] or [V*Cout, Cin]),
so a kernel step reads its box coordinates instead of multiplying them out. Padding neighbours
are left out of every table: no kernel spends a step on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TritonTables:
    """forward: node n's real entries are entry_x[n, :count[n]] (m*Cin) and entry_w (v*Cin),
    padding after them. grad_input: input node m's (output node, cell) pairs are
    [pair_start[m], pair_start[m+1]) of pair_gy (n*Cout) and pair_w (v*Cout). grad_weight: cell
    v's (input node, output node) pairs are [cell_start[v], cell_start[v+1]) of cell_x (m*Cin)
    and cell_gy (n*Cout). All int32."""

    count: torch.Tensor  # [Nout]
    entry_x: torch.Tensor  # [Nout, K]
    entry_w: torch.Tensor  # [Nout, K]
    pair_start: torch.Tensor  # [Nin + 1]
    pair_gy: torch.Tensor  # [entries]
    pair_w: torch.Tensor  # [entries]
    cell_start: torch.Tensor  # [V + 1]
    cell_x: torch.Tensor  # [entries]
    cell_gy: torch.Tensor  # [entries]


@dataclass
class StemTables:
    """The tables of the few-channel kernels (knnconv.ops.triton.stem_kernels): node n's K
    slots are neighbour[n, :] (Nin for padding) and cell[n, :]; kernel cell v's real slots
    are [cell_start[v], cell_start[v+1]) of cell_slot (n*K + k, in node order); input node
    m's real slots (the pairs that read it) are [pair_start[m], pair_start[m+1]) of pair_slot
    (n*K + k, in node order). All int32."""

    neighbour: torch.Tensor  # [Nout, K]
    cell: torch.Tensor  # [Nout, K]
    cell_start: torch.Tensor  # [V + 1]
    cell_slot: torch.Tensor  # [entries]
    pair_start: torch.Tensor  # [Nin + 1]
    pair_slot: torch.Tensor  # [entries]


def _starts(keys: torch.Tensor, groups: int) -> torch.Tensor:
    """CSR offsets [groups + 1] of sorted ``keys`` in [0, groups)."""
    starts = torch.zeros(groups + 1, dtype=torch.int64, device=keys.device)
    starts[1:] = torch.cumsum(torch.bincount(keys, minlength=groups), 0)
    return starts.int()


def _node_major(knn_indices: torch.Tensor, rf_index: torch.Tensor,
                nin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots node by node: neighbours and cells [Nout, K] (int64), and which are real."""
    neighbours = knn_indices.t().to(torch.int64)
    return neighbours, rf_index.to(torch.int64), neighbours != nin


def build_tables(knn_indices: torch.Tensor, rf_index: torch.Tensor, *, nin: int, v: int,
                 cin: int, cout: int) -> TritonTables:
    """The tables of a layer (knn_indices [K, Nout], rf_index [Nout, K]), on their device."""
    neighbours, cells, real = _node_major(knn_indices, rf_index, nin)
    nout, _ = neighbours.shape
    real_first = torch.argsort((~real).to(torch.int8), dim=1, stable=True)
    entry_x = torch.gather(neighbours, 1, real_first) * cin
    entry_w = torch.gather(cells, 1, real_first) * cin
    nodes = torch.arange(nout, device=neighbours.device).unsqueeze(1).expand_as(neighbours)
    m, n, cell = neighbours[real], nodes[real], cells[real]  # node-major order
    by_input = torch.argsort(m, stable=True)
    by_cell = torch.argsort(cell, stable=True)
    return TritonTables(
        count=real.sum(dim=1).int(), entry_x=entry_x.int().contiguous(),
        entry_w=entry_w.int().contiguous(),
        pair_start=_starts(m, nin), pair_gy=(n[by_input] * cout).int().contiguous(),
        pair_w=(cell[by_input] * cout).int().contiguous(),
        cell_start=_starts(cell, v), cell_x=(m[by_cell] * cin).int().contiguous(),
        cell_gy=(n[by_cell] * cout).int().contiguous())


def build_share_starts(tables: TritonTables, *, nout: int, cout: int, v: int,
                       shares: int) -> torch.Tensor:
    """[V, shares + 1] int32, row u: where cell u's pairs whose output node lies in node share
    s begin, for s = 0 .. shares (the end). Share s holds the output nodes
    [s * Nout // shares, (s + 1) * Nout // shares); a cell's pairs are in node order."""
    device = tables.cell_start.device
    counts = (tables.cell_start[1:] - tables.cell_start[:-1]).to(torch.int64)
    cell_of_pair = torch.repeat_interleave(torch.arange(v, device=device), counts)
    # ascending: pairs sorted by cell, then node
    key = cell_of_pair * (nout + 1) + tables.cell_gy.to(torch.int64) // cout
    bounds = torch.arange(shares + 1, device=device) * nout // shares
    queries = torch.arange(v, device=device).unsqueeze(1) * (nout + 1) + bounds
    return torch.searchsorted(key, queries).int().contiguous()


def build_stem_tables(knn_indices: torch.Tensor, rf_index: torch.Tensor, *, nin: int,
                      v: int) -> StemTables:
    """The few-channel kernels' tables of a layer (knn_indices [K, Nout], rf_index [Nout, K]),
    on their device."""
    neighbours, cells, real = _node_major(knn_indices, rf_index, nin)
    slots = torch.arange(real.numel(), device=real.device).view_as(real)[real]
    cell, m = cells[real], neighbours[real]
    return StemTables(
        neighbour=neighbours.int().contiguous(), cell=cells.int().contiguous(),
        cell_start=_starts(cell, v),
        cell_slot=slots[torch.argsort(cell, stable=True)].int().contiguous(),
        pair_start=_starts(m, nin),
        pair_slot=slots[torch.argsort(m, stable=True)].int().contiguous())


@dataclass
class DepthwiseTables:
    """The depthwise kernels' tables (knnconv.ops.triton.depthwise_kernels): node n's slot k
    reads input neighbour[k, n] (Nin for padding) through cell[k, n] ([K, Nout], as
    knn_indices); input node m's real slots are [pair_start[m], pair_start[m+1]) of pair_node
    (n) and pair_cell; kernel cell u's real slots are [cell_start[u], cell_start[u+1]) of
    cell_input (m) and cell_node (n), in node order. All int32."""

    neighbour: torch.Tensor  # [K, Nout]
    cell: torch.Tensor  # [K, Nout]
    pair_start: torch.Tensor  # [Nin + 1]
    pair_node: torch.Tensor  # [entries]
    pair_cell: torch.Tensor  # [entries]
    cell_start: torch.Tensor  # [V + 1]
    cell_input: torch.Tensor  # [entries]
    cell_node: torch.Tensor  # [entries]
    entries: int  # the real slots, counted once on the host


def build_depthwise_tables(knn_indices: torch.Tensor, slot_cells: torch.Tensor, *, nin: int,
                           v: int) -> DepthwiseTables:
    """The depthwise kernels' tables of a layer (knn_indices [K, Nout], slot_cells [K, Nout]
    with V on padding slots), on their device."""
    neighbours, cells = knn_indices.t(), slot_cells.t()  # node-major [Nout, K]
    real = neighbours != nin
    nodes = torch.arange(neighbours.shape[0], device=neighbours.device).unsqueeze(1)
    m, n, cell = neighbours[real], nodes.expand_as(neighbours)[real], cells[real]
    by_input = torch.argsort(m, stable=True)
    by_cell = torch.argsort(cell, stable=True)
    return DepthwiseTables(
        neighbour=knn_indices.int().contiguous(), cell=slot_cells.int().contiguous(),
        pair_start=_starts(m, nin), pair_node=n[by_input].int().contiguous(),
        pair_cell=cell[by_input].int().contiguous(), cell_start=_starts(cell, v),
        cell_input=m[by_cell].int().contiguous(), cell_node=n[by_cell].int().contiguous(),
        entries=m.numel())
