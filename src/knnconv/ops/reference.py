"""The oracle: fovi's formulation (pad, gather, bin per reference cell, linear).

Slow and memory hungry by design; it is the definition every other backend is tested
against. Its gradients are that formulation's transposes, written out (no autograd, so they
also run inside the custom ops). The binning adds neighbours into their cells
(scatter-add) and its transpose reads them back (gather), where fovi multiplies by a one-hot
matrix: the same numbers for finite inputs, but an inf neighbour stays inf instead of
turning every other cell into inf * 0 = NaN, so non-finite values propagate exactly as the
defining sum says. It sums in float32 (float64 for float64 inputs), with each result rounded
once to its dtype, so that half-precision calls are as exact as their dtype allows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..plan import KNNConvPlan
from .registry import KNNConvOps, accumulation_dtype
from .torch_neighbourhood import TorchNeighbourhoodOps


class ReferenceOps(TorchNeighbourhoodOps, KNNConvOps):
    name = "reference"
    float32_bias = True

    @staticmethod
    def _binned(plan: KNNConvPlan, x):
        """[B, Nout, Cin*V]: each node's neighbours summed per reference cell."""
        tables = plan.on(x.device)
        padded = F.pad(x, (0, 1))  # the padding neighbour Nin reads this zero column
        neighbours = padded[:, :, tables.knn_indices].permute(0, 3, 1, 2)  # [B, Nout, Cin, K]
        cells = tables.rf_index[None, :, None, :].expand(neighbours.shape)
        binned = neighbours.new_zeros(x.shape[0], plan.nout, plan.cin, plan.v)
        binned.scatter_add_(3, cells, neighbours)
        return binned.reshape(x.shape[0], plan.nout, plan.q)

    def forward(self, plan, x, weight, bias):
        acc = accumulation_dtype(x.dtype)
        y = F.linear(self._binned(plan, x.to(acc)), weight.to(acc),
                     None if bias is None else bias.to(acc))
        return y.to(x.dtype).transpose(1, 2)

    # The gradients are the formulation's own transposes: y = binned(x) @ W^T, so
    # dW = grad_y^T @ binned(x), and dx reads grad_y @ W back out of the cells (gather) and
    # scatters it through the neighbour table.
    def grad_input(self, plan, grad_y, weight):
        acc = accumulation_dtype(grad_y.dtype)
        tables = plan.on(grad_y.device)
        grad_binned = torch.einsum("bon,oq->bnq", grad_y.to(acc), weight.to(acc))
        batch = grad_y.shape[0]
        grad_binned = grad_binned.reshape(batch, plan.nout, plan.cin, plan.v)
        cells = tables.rf_index[None, :, None, :].expand(batch, plan.nout, plan.cin, plan.k)
        grad_neighbours = grad_binned.gather(3, cells).permute(0, 2, 3, 1)  # [B, Cin, K, Nout]
        grad_padded = grad_y.new_zeros(batch, plan.cin, plan.nin + 1, dtype=acc)
        grad_padded.index_add_(2, tables.knn_indices.reshape(-1),
                               grad_neighbours.reshape(batch, plan.cin, plan.k * plan.nout))
        return grad_padded[:, :, : plan.nin]

    def grad_weight(self, plan, grad_y, x):
        acc = accumulation_dtype(grad_y.dtype)
        return torch.einsum("bon,bnq->oq", grad_y.to(acc), self._binned(plan, x.to(acc)))
