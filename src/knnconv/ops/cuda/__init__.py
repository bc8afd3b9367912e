"""knnconv's native CUDA backend: gather-GEMM kernels compiled at run time through NVRTC.

The public names follow the seed design (fovi.arch.knn_cuda): :func:`forward`,
:func:`grad_input`, :func:`grad_weight`, :func:`backward_combined`, :class:`CudaOps`,
:class:`KernelConfig`, the ``default_*`` heuristics and :func:`clear_kernel_cache`.
The kernels compute in float16/bfloat16 with fp32 accumulation; float32 calls are served by
the ``torch_compact`` backend when ``backend="auto"`` (and refused by ``backend="cuda"``).
"""

from __future__ import annotations

import threading

import torch

from ...plan import KNNConvPlan
from ..registry import KNNConvOps
from ..torch_compact import TorchCompactOps
from .build import MIN_COMPUTE_CAPABILITY, clear_modules, cuda_include_dir, import_cupy
from .configs import (
    KernelConfig,
    default_config,
    default_grad_input_config,
    default_grad_weight_config,
    default_grad_weight_ksplit,
)
from .launch import (
    COMPUTE_DTYPES,
    backward_combined,
    clear_launch_caches,
    forward,
    grad_input,
    grad_weight,
)

__all__ = [
    "CudaOps", "KernelConfig", "backward_combined", "clear_kernel_cache", "default_config",
    "default_grad_input_config", "default_grad_weight_config", "default_grad_weight_ksplit",
    "forward", "grad_input", "grad_weight",
]

# Relative error against the torch_compact oracle above which a first-use canary fails.
CANARY_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.double(), reference.double()
    scale = reference.norm().item()
    error = (value - reference).norm().item()
    return error / scale if scale > 0 else error


class CudaOps(KNNConvOps):
    """Registry ops backed by the native kernels (forward + fused-atomic backward).

    The first call of each (kernel, dtype, tile config) on a device is checked against the
    torch_compact oracle on the same inputs (the forward with a NaN-poisoned output), and
    raises if they disagree; later calls, and calls under CUDA-graph capture, are not.
    """

    name = "cuda"

    def __init__(self) -> None:
        self._oracle = TorchCompactOps()
        self._verified: set[tuple] = set()
        self._device_reasons: dict[int, str | None] = {}
        self._lock = threading.Lock()

    def _device_reason(self, index: int) -> str | None:
        if index not in self._device_reasons:
            reason = None
            try:
                import_cupy()
                cuda_include_dir()
            except (ImportError, RuntimeError) as exc:
                reason = str(exc)
            capability = torch.cuda.get_device_capability(index)
            if reason is None and capability < MIN_COMPUTE_CAPABILITY:
                reason = (f"needs compute capability >= {MIN_COMPUTE_CAPABILITY}, device {index} "
                          f"has {capability}")
            self._device_reasons[index] = reason
        return self._device_reasons[index]

    def unsupported_reason(self, plan: KNNConvPlan, device: torch.device,
                           dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"needs CUDA tensors, got {device.type}"
        if dtype not in COMPUTE_DTYPES:
            return (f"computes in float16/bfloat16, got {dtype} (use torch.autocast, or "
                    "backend='torch_compact' / 'auto' for float32)")
        if torch.are_deterministic_algorithms_enabled():
            return ("its gradients accumulate with fp32 atomics, which is not deterministic; "
                    "use backend='torch_compact' under torch.use_deterministic_algorithms")
        index = device.index if device.index is not None else torch.cuda.current_device()
        return self._device_reason(index)

    def _first_use(self, key: tuple) -> bool:
        if key in self._verified:
            return False
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"knnconv cuda kernel {key[:3]} is used for the first time inside CUDA-graph "
                "capture; run one eager step with the same shapes before capturing"
            )
        return True

    def _canary(self, key: tuple, what: str, value: torch.Tensor, reference: torch.Tensor) -> None:
        error = _relative_error(value, reference)
        if not error <= CANARY_TOLERANCE[key[1]]:  # also catches NaN
            raise RuntimeError(
                f"knnconv cuda {what} canary failed for {key}: relative error {error:.3g} "
                "against torch_compact; please report this with your layer sizes"
            )
        with self._lock:
            self._verified.add(key)

    def _tables(self, plan: KNNConvPlan, device: torch.device):
        tables = plan.on(device)
        return tables.input_linear, tables.weight_linear

    def forward(self, plan, x, weight, bias):
        input_linear, weight_linear = self._tables(plan, x.device)
        cfg = default_config(x.shape[0], plan.cout, plan.p64, x.dtype, plan.nout)
        key = ("forward", x.dtype, cfg, x.device)
        first = self._first_use(key)
        y = forward(x, weight, bias, input_linear, weight_linear, cfg, poison_output=first)
        if first:
            self._canary(key, "forward", y, self._oracle.forward(plan, x, weight, bias))
        return y

    def grad_input(self, plan, grad_y, weight):
        input_linear, weight_linear = self._tables(plan, grad_y.device)
        cfg = default_grad_input_config(grad_y.shape[0], plan.cout)
        key = ("grad_input", grad_y.dtype, cfg, grad_y.device)
        first = self._first_use(key)
        dx = grad_input(grad_y, weight, input_linear, weight_linear, plan.cin, plan.nin, cfg)
        if first:
            self._canary(key, "grad_input", dx, self._oracle.grad_input(plan, grad_y, weight))
        return dx

    def grad_weight(self, plan, grad_y, x):
        input_linear, weight_linear = self._tables(plan, grad_y.device)
        cfg = default_grad_weight_config(grad_y.shape[0], plan.cout, plan.p64)
        key = ("grad_weight", grad_y.dtype, cfg, grad_y.device)
        first = self._first_use(key)
        dw = grad_weight(grad_y, x, input_linear, weight_linear, plan.q, cfg)
        if first:
            self._canary(key, "grad_weight", dw, self._oracle.grad_weight(plan, grad_y, x))
        return dw

    def backward_combined(self, plan, grad_y, x, weight):
        batch = grad_y.shape[0]
        input_cfg = default_grad_input_config(batch, plan.cout)
        weight_cfg = default_grad_weight_config(batch, plan.cout, plan.p64)
        keys = [(family, grad_y.dtype, cfg, grad_y.device)
                for family, cfg in (("grad_input", input_cfg), ("grad_weight", weight_cfg))]
        if any(self._first_use(key) for key in keys):
            return self.grad_input(plan, grad_y, weight), self.grad_weight(plan, grad_y, x)
        input_linear, weight_linear = self._tables(plan, grad_y.device)
        return backward_combined(grad_y, x, weight, input_linear, weight_linear, plan.cin,
                                 plan.nin, plan.q, input_cfg, weight_cfg)


def clear_kernel_cache() -> None:
    """Drop compiled-module references and launch caches (CuPy's on-disk cache is kept)."""
    clear_modules()
    clear_launch_caches()
