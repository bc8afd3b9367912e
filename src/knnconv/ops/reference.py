"""The oracle: fovi's original formulation (pad, gather, one-hot binning, linear).

Slow and memory hungry by design; it is the definition every other backend is tested
against. Its gradients come from PyTorch autograd over that same formulation.
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

    def forward(self, plan, x, weight, bias):
        tables = plan.on(x.device)
        padded = F.pad(x, (0, 1))  # the padding neighbour Nin reads this zero column
        neighbours = padded[:, :, tables.knn_indices]  # [B, Cin, K, Nout]
        one_hot = F.one_hot(tables.rf_index, plan.v).to(x.dtype)  # [Nout, K, V]
        binned = torch.einsum("bckn,nkv->bncv", neighbours, one_hot)
        y = F.linear(binned.reshape(x.shape[0], plan.nout, plan.q), weight, bias)
        return y.transpose(1, 2)

    def _gradients(self, plan: KNNConvPlan, grad_y, x, weight, wanted):
        with torch.enable_grad():
            x = x.detach().requires_grad_(wanted[0])
            weight = weight.detach().requires_grad_(wanted[1])
            y = self.forward(plan, x, weight, None)
            inputs = [t for t, w in zip((x, weight), wanted, strict=True) if w]
            grads = torch.autograd.grad(y, inputs, grad_y.to(y.dtype))
        return [g.to(_accumulation_dtype(g.dtype)) for g in grads]

    def grad_input(self, plan, grad_y, weight):
        x = weight.new_zeros(grad_y.shape[0], plan.cin, plan.nin)
        return self._gradients(plan, grad_y, x, weight, (True, False))[0]

    def grad_weight(self, plan, grad_y, x):
        weight = torch.zeros(plan.cout, plan.q, dtype=x.dtype, device=x.device)
        return self._gradients(plan, grad_y, x, weight, (False, True))[0]

    def backward_combined(self, plan, grad_y, x, weight):
        grad_x, grad_w = self._gradients(plan, grad_y, x, weight, (True, True))
        return grad_x, grad_w
