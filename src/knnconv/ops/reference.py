"""The oracle: fovi's original formulation (pad, gather, one-hot binning, linear).

Slow and memory hungry by design; it is the definition every other backend is tested
against. Its gradients are that formulation's transposes, written out (no autograd, so they
also run inside the custom ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..plan import KNNConvPlan
from .registry import KNNConvOps


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ReferenceOps(KNNConvOps):
    name = "reference"

    @staticmethod
    def _binned(plan: KNNConvPlan, x):
        """[B, Nout, Cin*V]: each node's neighbours summed per reference cell."""
        tables = plan.on(x.device)
        padded = F.pad(x, (0, 1))  # the padding neighbour Nin reads this zero column
        neighbours = padded[:, :, tables.knn_indices]  # [B, Cin, K, Nout]
        one_hot = F.one_hot(tables.rf_index, plan.v).to(x.dtype)  # [Nout, K, V]
        binned = torch.einsum("bckn,nkv->bncv", neighbours, one_hot)
        return binned.reshape(x.shape[0], plan.nout, plan.q)

    def forward(self, plan, x, weight, bias):
        return F.linear(self._binned(plan, x), weight, bias).transpose(1, 2)

    # The gradients are the formulation's own transposes: y = binned(x) @ W^T, so
    # dW = grad_y^T @ binned(x), and dx scatters grad_y @ W back through the one-hot binning
    # and the gather.
    def grad_input(self, plan, grad_y, weight):
        acc = _accumulation_dtype(grad_y.dtype)
        tables = plan.on(grad_y.device)
        grad_binned = torch.einsum("bon,oq->bnq", grad_y.to(acc), weight.to(acc))
        grad_binned = grad_binned.reshape(grad_y.shape[0], plan.nout, plan.cin, plan.v)
        one_hot = F.one_hot(tables.rf_index, plan.v).to(acc)  # [Nout, K, V]
        grad_neighbours = torch.einsum("bncv,nkv->bckn", grad_binned, one_hot)
        batch = grad_y.shape[0]
        grad_padded = grad_y.new_zeros(batch, plan.cin, plan.nin + 1, dtype=acc)
        grad_padded.index_add_(2, tables.knn_indices.reshape(-1),
                               grad_neighbours.reshape(batch, plan.cin, plan.k * plan.nout))
        return grad_padded[:, :, : plan.nin]

    def grad_weight(self, plan, grad_y, x):
        acc = _accumulation_dtype(grad_y.dtype)
        return torch.einsum("bon,bnq->oq", grad_y.to(acc), self._binned(plan, x.to(acc)))
