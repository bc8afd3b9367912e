"""The one interface every backend implements, and the registry of backends.

The interface covers every KNN op: the convolution on a KNNConvPlan, and the per-channel
neighbourhood ops (pooling, depthwise convolution) on a NeighbourhoodPlan. A backend computes
in the dtype it is handed (the autograd layer has already applied autocast). Its grad_input,
grad_weight and backward_combined return gradients accumulated in float32 (float64 for float64
inputs); ``gradients`` and ``depthwise_gradients`` return each one in the dtype the autograd
layer asks for (``dtypes``: those of x, weight and bias), so fp32 master weights get fp32
gradients.

Storage: a [B, C, N] activation is either contiguous or "channels-last", the transposed view
of a contiguous [B, N, C] buffer, which is what the convolution returns. Pooling keeps its
input's storage, and its dx takes the storage of x.
"""

from __future__ import annotations

import torch

from ..plan import GeometryPlan, KNNConvPlan, NeighbourhoodPlan

# The pooling modes; ``max_relu`` is the max of ReLU(x), which equals ReLU of the max: one
# pass where a ReLU feeds a max pooling. In the max modes the backward reads x, y and the
# forward's tie counts (MAX_POOL_MODES).
POOL_MODES = ("max", "avg", "sum", "max_relu")
MAX_POOL_MODES = ("max", "max_relu")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What gradients accumulate in: float64 for float64 inputs, float32 for the rest."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def channels_fastest(t: torch.Tensor) -> bool:
    """Whether [B, C, N] t has its channels contiguous and its nodes C apart, whatever its
    batch stride (a batch slice of channels-last storage); size-1 dimensions may have any
    stride. Read from the sizes and strides alone: it runs on every call of the hot paths."""
    _, channels, nodes = t.shape
    return (channels == 1 or t.stride(1) == 1) and (nodes == 1 or t.stride(2) == channels)


def _channels_last_strides(t: torch.Tensor) -> bool:
    """Whether [B, C, N] t has the strides of a transposed contiguous [B, N, C] buffer."""
    batch, channels, nodes = t.shape
    return channels_fastest(t) and (batch == 1 or t.stride(0) == channels * nodes)


def is_channels_last(t: torch.Tensor) -> bool:
    """Whether a [B, C, N] tensor is the transposed view of a contiguous [B, N, C] buffer and
    not also contiguous (with C or N of 1 the two storages are one memory order)."""
    return _channels_last_strides(t) and not t.is_contiguous()


def in_storage(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """t [B, C, N] in channels-last storage or contiguous, copied only where it is not."""
    if not channels_last:
        return t.contiguous()
    return t if _channels_last_strides(t) else t.transpose(1, 2).contiguous().transpose(1, 2)


def empty_in_storage(shape: tuple, channels_last: bool, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """An uninitialised [B, C, N] tensor, in channels-last storage or contiguous."""
    if not channels_last:
        return torch.empty(shape, dtype=dtype, device=device)
    batch, channels, nodes = shape
    return torch.empty(batch, nodes, channels, dtype=dtype, device=device).transpose(1, 2)


class KNNConvOps:
    """Base class of a backend. Subclasses set ``name`` and implement the three primitives."""

    name: str = ""
    # True when forward accepts a float32 bias whatever the compute dtype (and adds it in
    # float32), sparing the autograd layer a cast under autocast.
    float32_bias: bool = False
    # True when forward and gradients accept the weight in any float dtype and cast it to the
    # compute dtype (that of x and grad_y) as they lay it out, sparing the autograd layer a
    # cast kernel per call under autocast.
    casts_weight: bool = False
    # True when the backend implements neighbourhood ops (pool_*, depthwise_*); its
    # unsupported_reason names any it lacks.
    serves_neighbourhood: bool = False

    def unsupported_reason(self, plan: GeometryPlan, device: torch.device, dtype: torch.dtype,
                           *, backward: bool = True) -> str | None:
        """Why this backend cannot compute this plan on ``device`` in ``dtype`` (None if it can);
        ``backward``: whether the call's gradients will be computed (a forward-only call is
        not refused for what only the backward does; for a depthwise convolution, whether its
        weight gradient will be). Subclasses extend this one."""
        if isinstance(plan, NeighbourhoodPlan) and not self.serves_neighbourhood:
            return "does not implement the pooling and depthwise ops"
        return None

    def forward(self, plan: KNNConvPlan, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """y [B, Cout, Nout] in x's dtype; the weight in x's dtype, or in any float dtype where
        ``casts_weight``."""
        raise NotImplementedError

    def forward_saving(self, plan: KNNConvPlan, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None):
        """y, and what the backward should receive as ``x``: x itself, unless the backend keeps
        a re-laid-out copy from the forward that spares the backward re-laying x out again."""
        return self.forward(plan, x, weight, bias), x

    # The compiled path passes forward_saving's re-layout between its two custom ops as a
    # tensor; these say its shape (for the ops' fake implementations) and convert it.
    def saved_layout(self, plan: KNNConvPlan, x: torch.Tensor, dtype: torch.dtype):
        """Shape of the tensor form of forward_saving's re-layout of x [B, Cin, Nin] (already
        in ``dtype``: its sizes and strides are what counts, the tensor may be fake), or None
        when forward_saving returns x itself (never asked for batch 0, which
        knnconv.ops.execute.forward_impl serves with x itself)."""
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
                  needs: tuple[bool, bool, bool], dtypes: tuple, *,
                  dx_channels_last: bool = False) -> tuple:
        """(grad_x, grad_weight, grad_bias), None where ``needs`` says not needed, each in its
        dtype from ``dtypes`` (x's, weight's, bias's), accumulated in at least float32.

        grad_y and weight are in the compute dtype (the weight in its own where
        ``casts_weight``), x as forward_saving returned it. grad_x is
        in channels-last storage when ``dx_channels_last`` (the forward's x was), else
        contiguous. Backends override this to fuse the conversions, the bias reduction and
        dx's storage into their own launches.
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
        grad_x = in_storage(grad_x.to(dtypes[0]), dx_channels_last) if need_x else None
        grad_w = grad_w.to(dtypes[1]).contiguous() if need_w else None
        return grad_x, grad_w, grad_b

    # The neighbourhood ops, on a NeighbourhoodPlan; x and grad_y [B, C, N] in either storage.
    def pool_forward(self, plan: NeighbourhoodPlan, x: torch.Tensor, mode: str):
        """(y [B, C, Nout] in x's dtype and storage, ties): ties, for the backward of the
        MAX_POOL_MODES, is a tensor of y's shape and storage in :meth:`pool_ties_dtype`, or None."""
        raise NotImplementedError

    def pool_ties_dtype(self, mode: str) -> torch.dtype | None:
        """The dtype of pool_forward's ties in ``mode`` (None when it returns none)."""
        raise NotImplementedError

    def pool_backward(self, plan: NeighbourhoodPlan, grad_y: torch.Tensor, x, y, ties,
                      mode: str, channels_last: bool) -> torch.Tensor:
        """dx [B, C, Nin] in grad_y's dtype (x's), channels-last storage when
        ``channels_last``; x, y and ties (pool_forward's) are given in MAX_POOL_MODES only."""
        raise NotImplementedError

    def depthwise_forward(self, plan: NeighbourhoodPlan, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """y [B, C, Nout] in x's dtype; weight [C, V] in x's dtype, bias [C] in x's dtype or, if
        float32_bias, float32."""
        raise NotImplementedError

    def depthwise_gradients(self, plan: NeighbourhoodPlan, grad_y: torch.Tensor, x, weight,
                            needs: tuple[bool, bool, bool], dtypes: tuple) -> tuple:
        """(grad_x, grad_weight, grad_bias) as :meth:`gradients` returns them; x is given when
        the weight gradient is needed, weight when dx is."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<knnconv ops {self.name!r}>"


class GradientsFirstOps(KNNConvOps):
    """A backend whose ``gradients`` is its primitive (it fuses the conversions, the bias
    reduction and dx's storage into its launches): the single-gradient primitives are
    ``gradients`` asked for one or two of them, in float32."""

    def grad_input(self, plan, grad_y, weight):
        return self.gradients(plan, grad_y, None, weight, (True, False, False),
                              (torch.float32,) * 3)[0]

    def grad_weight(self, plan, grad_y, x):
        return self.gradients(plan, grad_y, x, None, (False, True, False),
                              (torch.float32,) * 3)[1]

    def backward_combined(self, plan, grad_y, x, weight):
        return self.gradients(plan, grad_y, x, weight, (True, True, False),
                              (torch.float32,) * 3)[:2]


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


def check_backend(name) -> str:
    """A layer's ``backend`` argument, checked when the layer is built: 'auto' or a registered
    name (an unknown one fails here, not at the first forward)."""
    if name != "auto":
        get_ops(name)
    return name


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
