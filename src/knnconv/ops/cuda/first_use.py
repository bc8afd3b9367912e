"""When a first-use check accepts a kernel's result: the rule, judged by the truth.

The reference is the torch_compact oracle run on the kernel's operands widened to float32.
Widening half-precision values is exact and so are their products in float32 (11 + 11
significant bits fit in 24, and fp16's subnormals are float32 normals), so the reference
differs from the exact sum only by float32 accumulation, and is at least as accurate as the
kernel. Running the oracle once more on the operands' absolute values gives each entry's
magnitude, the sum of |terms|, which bounds what accumulation error can reach however much
the terms cancel.

An entry passes when |value - reference| <= OUTPUT_ROUNDING * u * |reference| +
ACCUMULATION * magnitude + tiny, where u is the unit roundoff of the value's dtype (its own
rounding) and tiny its smallest subnormal (rounding in the subnormal range, where unscaled fp16
gradients live). Both terms are relative to the operands' scale, so a correct kernel passes at
any magnitude; an unwritten (NaN-poisoned) entry, a wrong neighbour or a lost tile does not.
"""

from __future__ import annotations

import torch

OUTPUT_ROUNDING = 4.0  # the value's rounding to its dtype is at most 1 u; slack for ties
ACCUMULATION = 2.0**-10  # float32 sums over tiles and atomics, relative to the sum of |terms|


def all_finite(*tensors: torch.Tensor | None) -> bool:
    """Whether every entry of the given tensors is finite (one device sync)."""
    flags = [torch.isfinite(t).all() for t in tensors if t is not None]
    return bool(torch.stack(flags).all()) if flags else True


def disagreement(value: torch.Tensor, reference: torch.Tensor,
                 magnitude: torch.Tensor) -> float:
    """The worst entry's |value - reference| over its allowance (see the module docstring):
    at most 1 passes. NaN where the value holds a NaN the reference does not; infinite where
    the value overflows although the reference is well inside the dtype's range."""
    if value.numel() == 0:
        return 0.0
    dtype = torch.finfo(value.dtype)
    value, reference, magnitude = value.double(), reference.double(), magnitude.double()
    if (torch.isnan(value) & ~torch.isnan(reference)).any():
        return float("nan")
    allowance = (OUTPUT_ROUNDING * dtype.eps / 2 * reference.abs() + ACCUMULATION * magnitude
                 + dtype.smallest_normal * dtype.eps)
    # A sum beyond the dtype's largest value rounds to inf of its sign: no error.
    overflowed = (torch.isinf(value) & (torch.sign(value) == torch.sign(reference))
                  & (reference.abs() + allowance >= dtype.max))
    error = torch.where(overflowed, 0.0, (value - reference).abs())
    return float((error / allowance).max())
