"""First-use checks of the native backends (``cuda``, ``triton``): the first call of each
kernel configuration writes into NaN-poisoned outputs and is judged against the torch_compact
oracle in float32 on the same operands (:class:`FirstUseChecks`), and the rule for when a
result passes (:func:`disagreement`), judged by the truth.

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

import threading

import torch

from .torch_compact import TorchCompactOps

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


class FirstUseChecks:
    """The first-use checks a native backend mixes in: the keys it has verified, the oracle,
    and the refusal of a first use inside CUDA-graph capture (warm up eagerly first). A first
    call whose operands hold a NaN or inf (the user's data) is not judged, and the next call
    is checked instead."""

    name: str

    def __init__(self) -> None:
        self._oracle = TorchCompactOps()
        self._verified: set[tuple] = set()
        self._lock = threading.Lock()

    def _first_use(self, key: tuple) -> bool:
        if key in self._verified:
            return False
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"knnconv {self.name} kernel {key[:3]} is used for the first time inside "
                "CUDA-graph capture; run one eager step with the same shapes before capturing"
            )
        return True

    def _check(self, key: tuple, value: torch.Tensor, compute, *operands) -> None:
        """Judge a first use's ``value`` by ``compute`` (the oracle's computation of it) on
        ``operands`` widened to float32, and on their absolute values for the allowance."""
        if not all_finite(*operands):
            return  # nothing to judge the kernel by; a later call with finite data is checked
        wide = [None if t is None else t.float() for t in operands]
        reference = compute(*wide)
        magnitude = compute(*(None if t is None else t.abs() for t in wide))
        ratio = disagreement(value, reference, magnitude)
        if not ratio <= 1.0:  # also catches NaN
            raise RuntimeError(
                f"knnconv {self.name} {key[0]} kernel failed its first-use check for {key}: "
                f"an entry is {ratio:.3g} times further from the float32 reference than "
                "rounding allows; please report this with your layer sizes"
            )
        with self._lock:
            self._verified.add(key)

    def _check_forward(self, plan, key: tuple, y, x, weight, bias) -> None:
        """The first-use check of a convolution's forward kernel, judged on the operands it
        multiplied: the weight rounded to x's dtype, as the backend cast it."""
        self._check(key, y, lambda *args: self._oracle.forward(plan, *args), x,
                    weight.to(x.dtype), bias)

    def _check_gradients(self, plan, keys: dict, first: set, grads, grad_y, x, weight) -> None:
        """The first-use checks of the gradient kernels named in ``first`` (roles of keys);
        ``x`` as the backward got it, or a backend's re-layout of it with an ``original()``;
        the weight (for dx) in any float dtype, judged rounded to grad_y's, as the backend cast
        it."""
        oracle = self._oracle
        if "input" in first:
            self._check(keys["input"], grads[0], lambda g, w: oracle.grad_input(plan, g, w),
                        grad_y, weight.to(grad_y.dtype))
        if "weight" in first:
            original = x.original() if hasattr(x, "original") else x
            self._check(keys["weight"], grads[1], lambda g, xs: oracle.grad_weight(plan, g, xs),
                        grad_y, original)
        if "bias" in first:
            self._check(keys["bias"], grads[2], lambda g: g.sum(dim=(0, 2)), grad_y)
