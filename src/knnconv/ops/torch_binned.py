"""Binned gather-GEMM in plain PyTorch: each node's neighbours summed into their kernel cells,
then dense GEMMs shared by every node.

Xbin[b, n, c*V + v] is the sum of x[b, c, knn[k, n]] over node n's real neighbours k in cell
v (rf[n, k] == v). Then y[b, :, n] = W @ Xbin[b, n] + bias with the one weight matrix, and the
backward is dense too: dW = gᵀ·Xbin and dXbin = g·W over B*Nout rows. The bins are gathered
through a table of source addresses (one table per rank when several neighbours of a node
share a cell), and dx flows back through the same tables with index_add_ in float32. Where V
is much larger than K the bins are mostly zeros, and torch_compact, which multiplies only the
K real slots per node, moves less.
"""

from __future__ import annotations

import torch

from ..plan import KNNConvPlan
from .registry import KNNConvOps, accumulation_dtype
from .torch_compact import DEFAULT_MEMORY_BUDGET, padded_flat_input


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


class TorchBinnedOps(KNNConvOps):
    name = "torch_binned"

    def __init__(self, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.memory_budget = memory_budget

    @staticmethod
    def _sources(plan: KNNConvPlan, device: torch.device) -> torch.Tensor:
        # Built from the host tables: their rank count depends on the data, which a meta
        # device does not hold.
        def build(_device_tables):
            host = plan.on("cpu")
            return bin_sources(host.knn_indices, host.rf_index, plan.cin, plan.nin,
                               plan.v).to(device)
        return plan.derived(device, "torch_binned.sources", build)

    def _node_chunks(self, plan: KNNConvPlan, batch: int, element_size: int):
        # Per node: its bins (and a float32 copy while ranks are summed or dx flows back),
        # its output or output-gradient rows.
        per_node = batch * (plan.q * (element_size + 4) + plan.cout * (element_size + 4))
        step = max(1, min(plan.nout, self.memory_budget // max(per_node, 1)))
        for start in range(0, plan.nout, step):
            yield start, min(start + step, plan.nout)

    @staticmethod
    def _bins(flat: torch.Tensor, sources: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Xbin of nodes [start, stop) as rows (b, n): [B * (stop - start), Cin*V]. Cells
        holding several neighbours are summed in at least float32."""
        addresses = sources[:, start:stop].reshape(sources.shape[0], -1)
        bins = flat[:, addresses[0]]
        if addresses.shape[0] > 1:
            bins = bins.to(accumulation_dtype(flat.dtype))
            for rank_addresses in addresses[1:]:
                bins += flat[:, rank_addresses]
            bins = bins.to(flat.dtype)
        return bins.view(-1, sources.shape[2])

    @staticmethod
    def _gradient_rows(grad_y: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """grad_y of nodes [start, stop) as rows (b, n): [B * (stop - start), Cout]."""
        return grad_y[:, :, start:stop].transpose(1, 2).reshape(-1, grad_y.shape[1])

    def forward(self, plan, x, weight, bias):
        batch = x.shape[0]
        sources = self._sources(plan, x.device)
        flat = padded_flat_input(plan, x)
        y = torch.empty(batch, plan.nout, plan.cout, dtype=x.dtype, device=x.device)
        for start, stop in self._node_chunks(plan, batch, x.element_size()):
            rows = self._bins(flat, sources, start, stop) @ weight.t()
            y[:, start:stop] = rows.view(batch, stop - start, plan.cout)
        if bias is not None:
            y += bias.to(y.dtype)
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
        sources = self._sources(plan, grad_y.device)
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
                grad_weight += (rows.t() @ self._bins(flat, sources, start, stop)).to(acc)
            if grad_flat is not None:
                grad_bins = (rows @ weight).to(acc).view(batch, -1)
                for rank_addresses in sources[:, start:stop].reshape(sources.shape[0], -1):
                    grad_flat.index_add_(1, rank_addresses, grad_bins)
        grad_x = None
        if grad_flat is not None:
            grad_x = grad_flat[:, : plan.cin * plan.nin].view(batch, plan.cin, plan.nin)
        return grad_x, grad_weight
