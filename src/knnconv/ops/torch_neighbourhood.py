"""The per-channel neighbourhood ops (KNN pooling, depthwise KNN convolution) in plain PyTorch,
forward and backward written out (no autograd, so they also run inside the custom ops). The
torch backends (reference, torch_compact, torch_binned) all serve them with this code.

Appending one extra input column holding a fill value lets the ops gather without masking: a
padding slot reads the fill (0 for sums, -inf for a max) and never a real feature, so a NaN in
x can only reach the nodes that have it as a real neighbour. Every gradient is the transpose
of that gather: an index_add into the extra column, which is then dropped.

Half-precision inputs are widened to float32 (float64 stays float64) before any sum, and each
result is rounded once: a sum of K values, and dx, which sums the gradients of every node
that reads an input, would otherwise round at every step and flush or overflow where float32
does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..plan import NeighbourhoodPlan
from .registry import MAX_POOL_MODES, accumulation_dtype, in_storage, is_channels_last


def gather_neighbours(x: torch.Tensor, knn_indices: torch.Tensor, fill: float) -> torch.Tensor:
    """The neighbour features [B, C, K, Nout] of x [B, C, Nin]; padding slots read ``fill``.

    knn_indices: int64 [K, Nout] on x's device, entries in [0, Nin].
    """
    batch, channels, _ = x.shape
    k, nout = knn_indices.shape
    padded = F.pad(x, (0, 1), value=fill)
    return padded.index_select(2, knn_indices.reshape(-1)).view(batch, channels, k, nout)


def scatter_to_inputs(per_slot: torch.Tensor, knn_indices: torch.Tensor,
                      nin: int) -> torch.Tensor:
    """The transpose of gather_neighbours: per_slot [B, C, K, Nout] summed into [B, C, Nin]."""
    batch, channels = per_slot.shape[:2]
    inputs = per_slot.new_zeros(batch, channels, nin + 1)
    flat = per_slot.reshape(batch, channels, knn_indices.numel())
    inputs.index_add_(2, knn_indices.reshape(-1), flat)
    return inputs[:, :, :nin]


def real_neighbours(knn_indices: torch.Tensor, nin: int) -> torch.Tensor:
    """[K, Nout] bool: which slots hold a real neighbour."""
    return knn_indices != nin


def pool_neighbours(x: torch.Tensor, knn_indices: torch.Tensor, nin: int,
                    mode: str) -> torch.Tensor:
    """The pooling of x [B, C, Nin] (knn_indices int64 on x's device), in x's dtype."""
    real = real_neighbours(knn_indices, nin)
    wide = x.to(accumulation_dtype(x.dtype))
    if mode in MAX_POOL_MODES:
        # -inf padding never wins a max over a real value; a node without a real neighbour
        # would give -inf and is set to 0.
        pooled = gather_neighbours(wide, knn_indices, fill=-torch.inf).amax(dim=2)
        pooled = torch.where(real.any(dim=0), pooled, 0.0)
        return (torch.relu(pooled) if mode == "max_relu" else pooled).to(x.dtype)
    pooled = gather_neighbours(wide, knn_indices, fill=0.0).sum(dim=2)
    if mode == "avg":
        # Clamping the count at 1 leaves an all-padding node at its sum, 0.
        pooled = pooled / real.sum(dim=0).clamp_min(1).to(pooled.dtype)
    return pooled.to(x.dtype)


def pool_gradient(grad_y: torch.Tensor, x: torch.Tensor | None, y: torch.Tensor | None,
                  knn_indices: torch.Tensor, nin: int, mode: str) -> torch.Tensor:
    """dx [B, C, Nin] in grad_y's dtype. The max modes (x and y given) share each node's
    gradient equally between the real neighbours equal to its max, as torch.amax does: a NaN
    max and a node without a real neighbour pass none, nor in max_relu a max of at most 0
    (ReLU's gradient there is 0)."""
    real = real_neighbours(knn_indices, nin)
    batch, channels, nout = grad_y.shape
    k = knn_indices.shape[0]
    wide = grad_y.to(accumulation_dtype(grad_y.dtype))
    if mode in MAX_POOL_MODES:
        gathered = gather_neighbours(x.to(wide.dtype), knn_indices, fill=-torch.inf)
        winners = (gathered == y.to(wide.dtype)[:, :, None, :]) & real
        if mode == "max_relu":
            winners &= y.to(wide.dtype)[:, :, None, :] > 0
        ties = winners.sum(dim=2, keepdim=True).clamp_min(1).to(wide.dtype)
        per_slot = torch.where(winners, wide[:, :, None, :] / ties, 0.0)
    else:
        if mode == "avg":
            wide = wide / real.sum(dim=0).clamp_min(1).to(wide.dtype)
        per_slot = wide[:, :, None, :].expand(batch, channels, k, nout)
    return scatter_to_inputs(per_slot, knn_indices, nin).to(grad_y.dtype)


def slot_weights(weight: torch.Tensor, slot_cells: torch.Tensor) -> torch.Tensor:
    """[C, K, Nout]: the weight each slot multiplies; padding slots read an appended zero cell,
    so a non-finite weight never reaches them."""
    return F.pad(weight, (0, 1))[:, slot_cells]


class TorchNeighbourhoodOps:
    """The neighbourhood half of the ops interface (see KNNConvOps), for the torch backends."""

    serves_neighbourhood = True

    def pool_forward(self, plan: NeighbourhoodPlan, x: torch.Tensor, mode: str):
        y = pool_neighbours(x, plan.on(x.device).knn_indices, plan.nin, mode)
        return in_storage(y, is_channels_last(x)), None

    def pool_ties_dtype(self, mode: str) -> torch.dtype | None:
        return None

    def pool_backward(self, plan: NeighbourhoodPlan, grad_y, x, y, ties, mode: str,
                      channels_last: bool) -> torch.Tensor:
        dx = pool_gradient(grad_y, x, y, plan.on(grad_y.device).knn_indices, plan.nin, mode)
        return in_storage(dx, channels_last)

    def depthwise_forward(self, plan: NeighbourhoodPlan, x, weight, bias) -> torch.Tensor:
        tables = plan.on(x.device)
        wide = accumulation_dtype(x.dtype)
        neighbours = gather_neighbours(x.to(wide), tables.knn_indices, fill=0.0)
        y = (neighbours * slot_weights(weight.to(wide), tables.slot_cells)).sum(dim=2)
        if bias is not None:
            y = y + bias.to(wide)[:, None]
        return y.to(x.dtype)

    def depthwise_gradients(self, plan: NeighbourhoodPlan, grad_y, x, weight,
                            needs: tuple[bool, bool, bool], dtypes: tuple) -> tuple:
        tables = plan.on(grad_y.device)
        need_x, need_w, need_b = needs
        wide = grad_y.to(accumulation_dtype(grad_y.dtype))[:, :, None, :]  # [B, C, 1, Nout]
        grad_x = grad_w = grad_b = None
        if need_x:
            per_slot = wide * slot_weights(weight.to(wide.dtype), tables.slot_cells)
            grad_x = scatter_to_inputs(per_slot, tables.knn_indices, plan.nin).to(dtypes[0])
        if need_w:
            neighbours = gather_neighbours(x.to(wide.dtype), tables.knn_indices, fill=0.0)
            per_slot = (neighbours * wide).sum(dim=0)  # [C, K, Nout]
            cells = per_slot.new_zeros(per_slot.shape[0], plan.v + 1)
            cells.index_add_(1, tables.slot_cells.reshape(-1),
                             per_slot.reshape(len(cells), tables.slot_cells.numel()))
            grad_w = cells[:, :plan.v].to(dtypes[1])
        if need_b:
            grad_b = wide.sum(dim=(0, 2, 3)).to(dtypes[2])
        return grad_x, grad_w, grad_b
