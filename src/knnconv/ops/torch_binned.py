"""Binned gather-GEMM in plain PyTorch: each node's neighbours summed into their kernel cells,
then dense GEMMs shared by every node.

Xbin[b, n, c*V + v] is the sum of x[b, c, knn[k, n]] over node n's real neighbours k in cell
v (rf[n, k] == v). Then y[b, :, n] = W @ Xbin[b, n] + bias with the one weight matrix, and the
backward is dense too: dW = gᵀ·Xbin and dXbin = g·W over B*Nout rows. The bins are gathered
through a table holding each cell's first neighbour; the cells holding more than one (6-24%
of the cells of the published layers with V close to K, almost none of their V = 4K ones)
add the others from a list with index_add_. Sums are kept in float32 (float64 for float64
inputs) throughout: a bin holding several neighbours, every GEMM's products, the bias, and dx,
which flows back through the same table and list with index_add_; each result is rounded once
to its dtype. Where V is much larger than K the bins are mostly zeros, and torch_compact,
which multiplies only the K real slots per node, moves less.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan import KNNConvPlan
from .registry import KNNConvOps, accumulation_dtype
from .torch_common import (
    DEFAULT_MEMORY_BUDGET,
    matmul_accumulating,
    node_chunks,
    padded_flat_input,
)
from .torch_neighbourhood import TorchNeighbourhoodOps


def bin_sources(knn_indices: torch.Tensor, rf_index: torch.Tensor, cin: int, nin: int,
                v: int) -> torch.Tensor:
    """int64 [ranks, Nout, Cin*V]: at [r, n, c*V + v] the address c*Nin + knn[k, n] of node
    n's r-th real neighbour in cell v (in slot order), or Cin*Nin, the padding address, where
    the cell holds fewer. ``ranks`` is the most real neighbours any node has in one cell."""
    k, nout = knn_indices.shape
    device = knn_indices.device
    real = (knn_indices < nin).t()  # [Nout, K]
    same_cell = (rf_index[:, :, None] == rf_index[:, None, :]) & real[:, None, :]
    earlier_slot = torch.ones(k, k, dtype=torch.bool, device=device).tril(-1)
    rank = (same_cell & earlier_slot).sum(dim=2)  # real neighbours of the cell in earlier slots
    ranks = int(rank[real].max()) + 1 if bool(real.any()) else 1
    sources = torch.full((ranks, nout, cin, v), cin * nin, dtype=torch.int64, device=device)
    node, slot = real.nonzero(as_tuple=True)
    channels = torch.arange(cin, dtype=torch.int64, device=device)
    sources[rank[node, slot], node, :, rf_index[node, slot]] = (
        channels[None, :] * nin + knn_indices[slot, node][:, None])
    return sources.reshape(ranks, nout, cin * v)


@dataclass
class BinTables:
    """bin_sources split for gathering: every cell's first neighbour as a dense table, and the
    rare further neighbours as a list sorted by node."""

    first: torch.Tensor  # int64 [Nout, Cin*V]: bin_sources' rank 0
    extra_position: torch.Tensor  # int64 [E]: n*Cin*V + c*V + v of a further neighbour
    extra_address: torch.Tensor  # int64 [E]: its address, c*Nin + knn[k, n]
    extra_start: list[int]  # [Nout + 1]: node n's entries are [extra_start[n], [n + 1])

    @classmethod
    def build(cls, sources: torch.Tensor, padding_address: int) -> BinTables:
        ranks, nout, q = sources.shape
        further = sources[1:].permute(1, 0, 2)  # [Nout, ranks - 1, Q], node-major
        node, _, position = (further != padding_address).nonzero(as_tuple=True)
        counts = torch.bincount(node, minlength=nout)
        extra_start = [0] + torch.cumsum(counts, 0).tolist()
        return cls(sources[0].contiguous(), node * q + position,
                   further[further != padding_address], extra_start)

    def to(self, device: torch.device) -> BinTables:
        return BinTables(self.first.to(device), self.extra_position.to(device),
                         self.extra_address.to(device), self.extra_start)

    def extras(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Nodes [start, stop)'s further neighbours: (their positions in the chunk's bins,
        their addresses), or None if there are none."""
        low, high = self.extra_start[start], self.extra_start[stop]
        if low == high:
            return None
        offset = start * self.first.shape[1]
        return self.extra_position[low:high] - offset, self.extra_address[low:high]


class TorchBinnedOps(TorchNeighbourhoodOps, KNNConvOps):
    name = "torch_binned"
    float32_bias = True

    def __init__(self, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.memory_budget = memory_budget

    @staticmethod
    def _tables(plan: KNNConvPlan, device: torch.device) -> BinTables:
        # Built once, from the host tables (their sizes depend on the data, which a meta
        # device does not hold), and copied to each other device.
        def build(_device_tables):
            if torch.device(device).type != "cpu":
                return TorchBinnedOps._tables(plan, torch.device("cpu")).to(device)
            host = plan.on("cpu")
            sources = bin_sources(host.knn_indices, host.rf_index, plan.cin, plan.nin, plan.v)
            return BinTables.build(sources, plan.cin * plan.nin)
        return plan.derived(device, "torch_binned.tables", build)

    def _node_chunks(self, plan: KNNConvPlan, batch: int, element_size: int):
        # Per node, at most (the combined backward): its bins and their float32 sums, their
        # float32 gradient, and its output-gradient rows with their float32 product.
        per_node = batch * (plan.q * (element_size + 8) + plan.cout * (element_size + 4))
        return node_chunks(plan.nout, per_node, self.memory_budget)

    @staticmethod
    def _bins(flat: torch.Tensor, tables: BinTables, start: int, stop: int) -> torch.Tensor:
        """Xbin of nodes [start, stop) as rows (b, n): [B * (stop - start), Cin*V]. Where a
        cell holds several neighbours the bins are their sums in the accumulation dtype (a sum
        of half-precision values is not one, and may overflow); else x's values themselves."""
        bins = flat[:, tables.first[start:stop].reshape(-1)]
        extras = tables.extras(start, stop)
        if extras is not None:
            positions, addresses = extras
            bins = bins.to(accumulation_dtype(flat.dtype))
            bins.index_add_(1, positions, flat[:, addresses].to(bins.dtype))
        return bins.view(-1, tables.first.shape[1])

    @staticmethod
    def _gradient_rows(grad_y: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """grad_y of nodes [start, stop) as rows (b, n): [B * (stop - start), Cout]."""
        return grad_y[:, :, start:stop].transpose(1, 2).reshape(-1, grad_y.shape[1])

    def forward(self, plan, x, weight, bias):
        batch = x.shape[0]
        tables = self._tables(plan, x.device)
        flat = padded_flat_input(plan, x)
        acc = accumulation_dtype(x.dtype)
        bias_acc = None if bias is None else bias.to(acc)
        y = torch.empty(batch, plan.nout, plan.cout, dtype=x.dtype, device=x.device)
        for start, stop in self._node_chunks(plan, batch, x.element_size()):
            rows = matmul_accumulating(self._bins(flat, tables, start, stop), weight.t(), acc)
            if bias_acc is not None:
                rows += bias_acc
            y[:, start:stop] = rows.view(batch, stop - start, plan.cout)
        return y.transpose(1, 2)

    def grad_input(self, plan, grad_y, weight):
        return self._gradients(plan, grad_y, None, weight)[0]

    def grad_weight(self, plan, grad_y, x):
        return self._gradients(plan, grad_y, x, None)[1]

    def backward_combined(self, plan, grad_y, x, weight):
        return self._gradients(plan, grad_y, x, weight)

    def _gradients(self, plan, grad_y, x, weight):
        """(dx or None without weight, dW or None without x), one pass over the node chunks."""
        batch = grad_y.shape[0]
        tables = self._tables(plan, grad_y.device)
        acc = accumulation_dtype(grad_y.dtype)
        grad_flat = grad_weight = flat = None
        if weight is not None:
            grad_flat = torch.zeros(batch, plan.cin * plan.nin + 1, dtype=acc,
                                    device=grad_y.device)
            weight = weight.to(grad_y.dtype)
        if x is not None:
            grad_weight = torch.zeros(plan.cout, plan.q, dtype=acc, device=grad_y.device)
            flat = padded_flat_input(plan, x.to(grad_y.dtype))
        for start, stop in self._node_chunks(plan, batch, grad_y.element_size()):
            rows = self._gradient_rows(grad_y, start, stop)
            if flat is not None:
                grad_weight += matmul_accumulating(rows.t(), self._bins(flat, tables, start,
                                                                        stop), acc)
            if grad_flat is not None:
                grad_bins = matmul_accumulating(rows, weight, acc).view(batch, -1)
                grad_flat.index_add_(1, tables.first[start:stop].reshape(-1), grad_bins)
                extras = tables.extras(start, stop)
                if extras is not None:
                    positions, addresses = extras
                    grad_flat.index_add_(1, addresses, grad_bins[:, positions])
        grad_x = None
        if grad_flat is not None:
            grad_x = grad_flat[:, : plan.cin * plan.nin].view(batch, plan.cin, plan.nin)
        return grad_x, grad_weight
