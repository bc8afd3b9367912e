"""What the PyTorch backends (torch_compact, torch_binned) share: the flat input with its
padding column, and node chunks that keep gathered temporaries within a memory budget."""

from __future__ import annotations

import torch

from ..plan import KNNConvPlan

DEFAULT_MEMORY_BUDGET = 256 * 2**20


def padded_flat_input(plan: KNNConvPlan, x: torch.Tensor) -> torch.Tensor:
    """x [B, Cin, Nin] as [B, Cin*Nin + 1]: address c*Nin + m is x[:, c, m], and Cin*Nin an
    appended zero column, where the padding neighbour reads."""
    flat = x.reshape(x.shape[0], plan.cin * plan.nin)
    return torch.cat([flat, flat.new_zeros(x.shape[0], 1)], dim=1)


def node_chunks(nout: int, per_node_bytes: int, memory_budget: int):
    """(start, stop) ranges of output nodes whose temporaries fit in ``memory_budget`` bytes
    (at least one node per range)."""
    step = max(1, min(nout, memory_budget // max(per_node_bytes, 1)))
    for start in range(0, nout, step):
        yield start, min(start + step, nout)
