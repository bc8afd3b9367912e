"""Compact gather-GEMM in plain PyTorch: the compact int32 tables, batched matmuls, fp32 index_add_.

Per output node n the operands are A_n[b, p] = x[b, input_linear[n, p]] and
W_n[p, o] = weight[o, weight_linear[n, p]], so y[:, :, n] = A_n @ W_n. Nodes are processed in
chunks so the gathered temporaries stay under ``memory_budget`` bytes. Runs on any device
and dtype. Every product is summed in float32 (float64 for float64 inputs), the bias added
there too, and each result rounded once to its dtype; the backward scatters with index_add_ in
that accumulation dtype.
"""

from __future__ import annotations

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


class TorchCompactOps(TorchNeighbourhoodOps, KNNConvOps):
    name = "torch_compact"
    float32_bias = True

    def __init__(self, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.memory_budget = memory_budget

    def _node_chunks(self, plan: KNNConvPlan, batch: int, element_size: int):
        # Per node: gathered inputs and weights in the compute dtype, their float32 copies
        # (where the matmul widens them) and the float32 product.
        per_node = (batch * plan.p + plan.p * plan.cout + batch * max(plan.p, plan.cout))
        return node_chunks(plan.nout, per_node * (element_size + 8), self.memory_budget)

    @staticmethod
    def _tables(plan: KNNConvPlan, device: torch.device):
        def build(tables):
            # Slots past Cin*K only exist to pad kernel tiles; this backend skips them.
            return (tables.input_linear[:, :plan.p].long().contiguous(),
                    tables.weight_linear[:, :plan.p].long().contiguous())
        return plan.derived(device, "torch_compact.slots", build)

    def forward(self, plan, x, weight, bias):
        batch = x.shape[0]
        input_slots, weight_slots = self._tables(plan, x.device)
        flat = padded_flat_input(plan, x)
        weight_rows = weight.t()  # [Q, Cout]
        acc = accumulation_dtype(x.dtype)
        bias_acc = None if bias is None else bias.to(acc)
        y = torch.empty(batch, plan.nout, plan.cout, dtype=x.dtype, device=x.device)
        for start, stop in self._node_chunks(plan, batch, x.element_size()):
            gathered = flat[:, input_slots[start:stop]].transpose(0, 1)  # [n, B, P]
            node_weights = weight_rows[weight_slots[start:stop]]  # [n, P, Cout]
            sums = matmul_accumulating(gathered, node_weights, acc)  # [n, B, Cout]
            if bias_acc is not None:
                sums += bias_acc
            y[:, start:stop] = sums.transpose(0, 1)
        return y.transpose(1, 2)

    def grad_input(self, plan, grad_y, weight):
        batch = grad_y.shape[0]
        input_slots, weight_slots = self._tables(plan, grad_y.device)
        acc = accumulation_dtype(grad_y.dtype)
        grad_flat = torch.zeros(batch, plan.cin * plan.nin + 1, dtype=acc, device=grad_y.device)
        weight_rows = weight.t().to(grad_y.dtype)
        for start, stop in self._node_chunks(plan, batch, grad_y.element_size()):
            grad_nodes = grad_y[:, :, start:stop].permute(2, 0, 1)  # [n, B, Cout]
            node_weights = weight_rows[weight_slots[start:stop]]  # [n, P, Cout]
            grad_gathered = matmul_accumulating(grad_nodes, node_weights.transpose(1, 2), acc)
            grad_flat.index_add_(  # grad_gathered: [n, B, P]
                1, input_slots[start:stop].reshape(-1),
                grad_gathered.transpose(0, 1).reshape(batch, -1),
            )
        return grad_flat[:, : plan.cin * plan.nin].view(batch, plan.cin, plan.nin)

    def grad_weight(self, plan, grad_y, x):
        batch = grad_y.shape[0]
        input_slots, weight_slots = self._tables(plan, grad_y.device)
        acc = accumulation_dtype(grad_y.dtype)
        grad_rows = torch.zeros(plan.q, plan.cout, dtype=acc, device=grad_y.device)
        flat = padded_flat_input(plan, x.to(grad_y.dtype))
        for start, stop in self._node_chunks(plan, batch, grad_y.element_size()):
            gathered = flat[:, input_slots[start:stop]].permute(1, 2, 0)  # [n, P, B]
            grad_nodes = grad_y[:, :, start:stop].permute(2, 0, 1)  # [n, B, Cout]
            grad_node_weights = matmul_accumulating(gathered, grad_nodes, acc)  # [n, P, Cout]
            grad_rows.index_add_(0, weight_slots[start:stop].reshape(-1),
                                 grad_node_weights.reshape(-1, plan.cout))
        return grad_rows.t()
