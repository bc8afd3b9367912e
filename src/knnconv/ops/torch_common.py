"""What the PyTorch backends (torch_compact, torch_binned) share: the flat input with its
padding column, node chunks that keep gathered temporaries within a memory budget, and a matmul
whose products are summed and returned in the accumulation dtype."""

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


_OUT_DTYPE_MATMUL: dict[str, bool] = {}  # device type -> whether mm/bmm take out_dtype


def matmul_accumulating(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b (2-D or batched 3-D) with its products summed and returned in ``acc``.

    A half-precision result rounds every sum to 11 (fp16) or 8 (bf16) significant bits and
    flushes sums below fp16's subnormal range to zero: unscaled fp16 gradients (|grad_y| near
    1e-7) lose most of their value, and a weight gradient summed over a large batch overflows.
    Widening half operands to float32 is exact, so the only rounding left is float32's.

    On CUDA, where mm/bmm take out_dtype (recent PyTorch), the half-precision GEMM writes
    float32 itself. Elsewhere the operands are widened first, which on the CPU is also faster
    than its half-precision GEMM.
    """
    if a.dtype == acc and b.dtype == acc:
        return torch.matmul(a, b)
    device_type = a.device.type
    if a.dtype == b.dtype and _OUT_DTYPE_MATMUL.get(device_type, device_type == "cuda"):
        try:
            result = (torch.mm if a.dim() == 2 else torch.bmm)(a, b, out_dtype=acc)
            _OUT_DTYPE_MATMUL[device_type] = True
            return result
        except torch.cuda.OutOfMemoryError:
            raise  # says nothing about out_dtype
        except (TypeError, RuntimeError):  # NotImplementedError is a RuntimeError
            _OUT_DTYPE_MATMUL[device_type] = False
    return torch.matmul(a.to(acc), b.to(acc))
