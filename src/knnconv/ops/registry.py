"""The one interface every backend implements, and the registry of backends.

A backend computes in the dtype it is handed (the autograd layer has already applied autocast).
Its grad_input, grad_weight and backward_combined return gradients accumulated in float32
(float64 for float64 inputs); ``gradients`` returns each one in the dtype the autograd layer
asks for (``dtypes``: those of x, weight and bias), so fp32 master weights get fp32 gradients.
"""

from __future__ import annotations

import torch

from ..plan import KNNConvPlan


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What gradients accumulate in: float64 for float64 inputs, float32 for the rest."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class KNNConvOps:
    """Base class of a backend. Subclasses set ``name`` and implement the three primitives."""

    name: str = ""
    # True when forward accepts a float32 bias whatever the compute dtype (and adds it in
    # float32), sparing the autograd layer a cast under autocast.
    float32_bias: bool = False

    def unsupported_reason(self, plan: KNNConvPlan, device: torch.device, dtype: torch.dtype,
                           *, backward: bool = True) -> str | None:
        """Why this backend cannot compute this plan on ``device`` in ``dtype`` (None if it can);
        ``backward``: whether the call's gradients will be computed (a forward-only call is
        not refused for what only the backward does)."""
        return None

    def forward(self, plan: KNNConvPlan, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """y [B, Cout, Nout] in x's dtype."""
        raise NotImplementedError

    def forward_saving(self, plan: KNNConvPlan, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None):
        """y, and what the backward should receive as ``x``: x itself, unless the backend keeps
        a re-laid-out copy from the forward that spares the backward re-laying x out again."""
        return self.forward(plan, x, weight, bias), x

    # The compiled path passes forward_saving's re-layout between its two custom ops as a
    # tensor; these say its shape (for the ops' fake implementations) and convert it.
    def saved_layout(self, plan: KNNConvPlan, batch: int, dtype: torch.dtype):
        """Shape of the tensor form of forward_saving's re-layout of a [batch, Cin, Nin] x in
        ``dtype``, or None when forward_saving returns x itself (never asked for batch 0,
        which knnconv.ops.execute.forward_impl serves with x itself)."""
        return None

    def saved_tensor(self, saved_x) -> torch.Tensor:
        """forward_saving's re-layout as one tensor (only called when saved_layout is not None)."""
        raise NotImplementedError

    def saved_input(self, saved: torch.Tensor, plan: KNNConvPlan, batch: int):
        """saved_tensor's result back as what gradients() takes for x."""
        raise NotImplementedError

    def grad_input(self, plan: KNNConvPlan, grad_y: torch.Tensor,
                   weight: torch.Tensor) -> torch.Tensor:
        """dL/dx [B, Cin, Nin], accumulated in at least float32."""
        raise NotImplementedError

    def grad_weight(self, plan: KNNConvPlan, grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dL/dweight [Cout, Cin*V], accumulated in at least float32."""
        raise NotImplementedError

    def backward_combined(self, plan: KNNConvPlan, grad_y: torch.Tensor, x: torch.Tensor,
                          weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both gradients; backends override this when they can share work between them."""
        return self.grad_input(plan, grad_y, weight), self.grad_weight(plan, grad_y, x)

    def gradients(self, plan: KNNConvPlan, grad_y: torch.Tensor, x, weight: torch.Tensor | None,
                  needs: tuple[bool, bool, bool], dtypes: tuple) -> tuple:
        """(grad_x, grad_weight, grad_bias), None where ``needs`` says not needed, each in its
        dtype from ``dtypes`` (x's, weight's, bias's), accumulated in at least float32.

        grad_y and weight are in the compute dtype, x as forward_saving returned it. Backends
        override this to fuse the conversions and the bias reduction into their own launches.
        """
        need_x, need_w, need_b = needs
        grad_x = grad_w = grad_b = None
        if need_x and need_w:
            grad_x, grad_w = self.backward_combined(plan, grad_y, x, weight)
        elif need_x:
            grad_x = self.grad_input(plan, grad_y, weight)
        elif need_w:
            grad_w = self.grad_weight(plan, grad_y, x)
        if need_b:
            grad_b = grad_y.sum(dim=(0, 2), dtype=accumulation_dtype(grad_y.dtype))
            grad_b = grad_b.to(dtypes[2])
        grad_x = grad_x.to(dtypes[0]).contiguous() if need_x else None
        grad_w = grad_w.to(dtypes[1]).contiguous() if need_w else None
        return grad_x, grad_w, grad_b

    def __repr__(self) -> str:
        return f"<knnconv ops {self.name!r}>"


_REGISTRY: dict[str, KNNConvOps] = {}


def register_ops(ops: KNNConvOps, *, replace: bool = False) -> KNNConvOps:
    """Make ``ops`` available as ``backend=ops.name``."""
    if not isinstance(ops, KNNConvOps) or not ops.name:
        raise TypeError("register_ops expects a KNNConvOps instance with a non-empty name")
    if ops.name == "auto":
        raise ValueError("'auto' is reserved for the automatic backend choice")
    if ops.name in _REGISTRY and not replace:
        raise ValueError(f"a backend named {ops.name!r} is already registered")
    _REGISTRY[ops.name] = ops
    return ops


def available_backends() -> list[str]:
    """Names that ``backend=`` accepts, besides 'auto'."""
    return sorted(_REGISTRY)


def get_ops(name: str) -> KNNConvOps:
    """The backend registered under ``name``."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    ops = _REGISTRY.get(name)
    if ops is None:
        raise ValueError(
            f"unknown backend {name!r}; choose 'auto' or one of {available_backends()}"
        )
    return ops
