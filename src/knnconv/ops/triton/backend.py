"""The ``triton`` backend: forward, dx and dW as gather-GEMMs whose operands are TMA boxes
(knnconv.ops.triton.kernels), for Hopper and newer GPUs.

It reads x and grad_y in channels-last storage, where a neighbour's rows for a batch tile are
one box; operands in other storage are re-laid out once per call. Layers of fewer than 16
input channels (image stems) run on the few-channel kernels
(knnconv.ops.triton.stem_kernels). Every output element is written once, dW adds its
windows' sums in window order, and a stem's dx and the bias gradient sum fixed partials
(knnconv.ops.triton.bias_kernels), so the backward is
deterministic and this backend serves under ``torch.use_deterministic_algorithms(True)``.
Under Triton's interpreter (``TRITON_INTERPRET=1``) it also runs on CPU tensors, which is how
the tests check it without a GPU.
"""

from __future__ import annotations

import os

import torch

from ...plan import GeometryPlan, KNNConvPlan, NeighbourhoodPlan
from ..first_use import FirstUseChecks
from ..registry import GradientsFirstOps, in_storage, is_channels_last
from .configs import MIN_BLOCK, few_channels
from .tables import (
    DepthwiseTables,
    StemTables,
    TritonTables,
    build_depthwise_tables,
    build_share_starts,
    build_stem_tables,
    build_tables,
)

try:  # Triton ships with torch's CUDA builds; a CPU-only install may lack it
    from . import launch
    MISSING = None
except ImportError as exc:  # pragma: no cover - depends on the environment
    launch, MISSING = None, f"Triton with tensor descriptors is not importable ({exc})"

COMPUTE_DTYPES = (torch.float16, torch.bfloat16)
# the depthwise kernels multiply on the CUDA cores, in float32, whatever their operands
DEPTHWISE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_COMPUTE_CAPABILITY = (9, 0)  # the tensor memory accelerator


def interpreting() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonOps(FirstUseChecks, GradientsFirstOps):
    """Registry ops backed by the Triton TMA kernels; first uses are checked as the ``cuda``
    backend's are (knnconv.ops.first_use)."""

    name = "triton"
    float32_bias = True
    casts_weight = True  # launch.weight_by_cell casts as it lays the weight out

    def __init__(self) -> None:
        super().__init__()
        self._capabilities: dict[int, tuple[int, int]] = {}
        self._device_sizes_seen: dict[int, tuple[int, int]] = {}

    def _device_reason(self, device: torch.device) -> str | None:
        if MISSING is not None:
            return MISSING
        if device.type == "cpu" and interpreting():
            return None
        if device.type != "cuda":
            return f"needs CUDA tensors, got {device.type}"
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._capabilities:
            self._capabilities[index] = torch.cuda.get_device_capability(index)
        if self._capabilities[index] < MIN_COMPUTE_CAPABILITY:
            return (f"needs compute capability >= {MIN_COMPUTE_CAPABILITY} (the tensor memory "
                    f"accelerator), device {index} has {self._capabilities[index]}")
        return None

    # of the neighbourhood ops, the depthwise convolution (knnconv.ops.triton.depthwise_kernels);
    # pooling runs on the cuda and torch backends
    serves_neighbourhood = True

    def unsupported_reason(self, plan: GeometryPlan, device: torch.device, dtype: torch.dtype,
                           *, backward: bool = True) -> str | None:
        if isinstance(plan, NeighbourhoodPlan):
            if plan.v is None:
                return "has no pooling kernels (the cuda and torch backends pool)"
            if dtype not in DEPTHWISE_DTYPES:
                return f"computes depthwise convolutions in {DEPTHWISE_DTYPES}, got {dtype}"
            return self._device_reason(device)
        reason = super().unsupported_reason(plan, device, dtype, backward=backward)
        if reason is not None:
            return reason
        if dtype not in COMPUTE_DTYPES:
            return (f"computes in float16/bfloat16, got {dtype} (use torch.autocast, or "
                    "backend='torch_compact' / 'auto' for float32)")
        if dtype == torch.bfloat16 and device.type == "cpu" and interpreting():
            return ("runs bfloat16 on the GPU only: Triton's CPU interpreter multiplies "
                    "bfloat16 dot operands wrongly")
        if plan.cout % MIN_BLOCK:
            return (f"needs output channels that are a multiple of {MIN_BLOCK} (a contraction "
                    f"chunk of dx), got Cout = {plan.cout}")
        return self._device_reason(device)

    @staticmethod
    def tables(plan: KNNConvPlan, device: torch.device) -> TritonTables:
        """The layer's tables, with offsets over the channels the kernels take
        (launch.padded_channels)."""
        return plan.derived(device, "triton.tables", lambda t: build_tables(
            t.knn_indices, t.rf_index, nin=plan.nin, v=plan.v,
            cin=launch.padded_channels(plan.cin), cout=plan.cout))

    @classmethod
    def share_starts(cls, plan: KNNConvPlan, device: torch.device, shares: int) -> torch.Tensor:
        """Where each cell's pairs of each of ``shares`` node shares begin (dW's windows)."""
        return plan.derived(device, f"triton.share_starts.{shares}",
                            lambda _: build_share_starts(
                                cls.tables(plan, device), nout=plan.nout, cout=plan.cout,
                                v=plan.v, shares=shares))

    @staticmethod
    def stem_tables(plan: KNNConvPlan, device: torch.device) -> StemTables:
        """The tables of the few-channel kernels (configs.few_channels)."""
        return plan.derived(device, "triton.stem_tables", lambda t: build_stem_tables(
            t.knn_indices, t.rf_index, nin=plan.nin, v=plan.v))

    @staticmethod
    def _boxable(t: torch.Tensor) -> torch.Tensor:
        """t in storage the kernels box (see launch.boxable), copied only where it is not."""
        return t if launch.boxable(t) else in_storage(t.contiguous(), channels_last=True)

    def _kernel_input(self, plan, x: torch.Tensor) -> torch.Tensor:
        """x as the kernels read it: boxable, its channels padded (launch.padded_channels)."""
        channels = launch.padded_channels(plan.cin)
        if channels != plan.cin:
            return launch.with_padded_channels(x, channels)
        return self._boxable(x)

    @staticmethod
    def _kernel_weight(plan, weight: torch.Tensor) -> torch.Tensor:
        channels = launch.padded_channels(plan.cin)
        if channels != plan.cin:
            return launch.weight_with_padded_channels(weight, channels, plan.v)
        return weight

    def forward(self, plan, x, weight, bias):
        if few_channels(plan.cin):
            tile = launch.stem_forward_tile(x.shape[0], plan.cout)
            key = ("stem_forward", x.dtype, tile, x.device, bias is not None)
            first = self._first_use(key)
            y = launch.stem_forward(x, weight, bias, self.stem_tables(plan, x.device),
                                    nin=plan.nin, nout=plan.nout, v=plan.v, tile=tile,
                                    poison=first)
        else:
            cin = launch.padded_channels(plan.cin)
            tile = launch.forward_tile(x.shape[0], cin, plan.cout, plan.nout)
            key = ("forward", x.dtype, tile, x.device, bias is not None)
            first = self._first_use(key)
            y = launch.forward(self._kernel_input(plan, x), self._kernel_weight(plan, weight),
                               bias, self.tables(plan, x.device), nout=plan.nout, v=plan.v,
                               tile=tile, poison=first)
        if first:
            self._check_forward(plan, key, y, x, weight, bias)
        return y

    def gradients(self, plan, grad_y, x, weight, needs, dtypes, *,
                  dx_channels_last: bool = False):
        need_input, need_weight, need_bias = needs
        device, batch = grad_y.device, grad_y.shape[0]
        grad_dtypes = tuple(torch.float32 if d is None else d for d in dtypes)
        gy = self._boxable(grad_y)
        # a few-channel layer's dx and dW on its own kernels, any other's on the gather-GEMMs
        cin = launch.padded_channels(plan.cin)
        few = few_channels(plan.cin)
        keys, grads = {}, [None, None, None]
        if need_input and few:
            tile = launch.stem_grad_input_tile(batch, plan.cout)
            keys["input"] = ("stem_grad_input", grad_y.dtype, tile, device, grad_dtypes[0])
        elif need_input:
            tile = launch.grad_input_tile(batch, cin, plan.cout, plan.nin)
            keys["input"] = ("grad_input", grad_y.dtype, tile, device, grad_dtypes[0])
        if need_weight and few:
            tile_w = launch.stem_grad_weight_tile(batch, plan.cout)
            keys["weight"] = ("stem_grad_weight", grad_y.dtype, tile_w, device)
        elif need_weight:
            tile_w = launch.grad_weight_tile(batch, cin, plan.cout)
            processors, l2_bytes = self._device_sizes(device)
            windows = launch.grad_weight_windows(
                tile_w, batch=batch, cin=cin, cout=plan.cout, nin=plan.nin, nout=plan.nout,
                v=plan.v, entries=plan.entry_count, processors=processors, l2_bytes=l2_bytes)
            keys["weight"] = ("grad_weight", grad_y.dtype, tile_w, device, windows)
        if need_bias:
            tile_b = launch.grad_bias_tile(plan.cout)
            keys["bias"] = ("grad_bias", grad_y.dtype, tile_b, device)
        first = {role for role, key in keys.items() if self._first_use(key)}
        if need_input and few:
            grads[0] = launch.stem_grad_input(gy, weight, self.stem_tables(plan, device),
                                              nin=plan.nin, v=plan.v, tile=tile,
                                              dtype=grad_dtypes[0], poison="input" in first)
        elif need_input:
            grads[0] = launch.grad_input(gy, self._kernel_weight(plan, weight),
                                         self.tables(plan, device), nin=plan.nin, v=plan.v,
                                         tile=tile, dtype=grad_dtypes[0],
                                         poison="input" in first)
            grads[0] = grads[0][:, :plan.cin]  # the padded channels' dx is dropped
        if need_weight and few:
            grads[1] = launch.stem_grad_weight(gy, x, self.stem_tables(plan, device),
                                               nin=plan.nin, v=plan.v, tile=tile_w,
                                               poison="weight" in first)
        elif need_weight:
            grads[1] = launch.grad_weight(gy, self._kernel_input(plan, x),
                                          self.tables(plan, device),
                                          self.share_starts(plan, device, windows.shares),
                                          v=plan.v, tile=tile_w, windows=windows,
                                          poison="weight" in first)
            if cin != plan.cin:  # the padded channels' columns are the last ones
                grads[1] = grads[1][:, :plan.cin * plan.v].contiguous()
        if need_bias:
            grads[2] = launch.grad_bias(gy, tile=tile_b, processors=self._device_sizes(device)[0],
                                        poison="bias" in first)
        if first:
            self._check_gradients(plan, keys, first, grads, grad_y, x, weight)
        grad_x = None if grads[0] is None else in_storage(grads[0], dx_channels_last)
        grad_w = None if grads[1] is None else grads[1].to(grad_dtypes[1])
        grad_b = None if grads[2] is None else grads[2].to(grad_dtypes[2])
        return grad_x, grad_w, grad_b

    @staticmethod
    def depthwise_tables(plan: NeighbourhoodPlan, device: torch.device) -> DepthwiseTables:
        return plan.derived(device, "triton.depthwise", lambda t: build_depthwise_tables(
            t.knn_indices, t.slot_cells, nin=plan.nin, v=plan.v))

    def depthwise_forward(self, plan, x, weight, bias):
        tile = launch.depthwise_tile("depthwise_forward", x.shape[0], x.shape[1])
        key = ("depthwise_forward", x.dtype, tile, x.device, bias is not None)
        first = self._first_use(key)
        y = launch.depthwise_forward(x, weight, bias, self.depthwise_tables(plan, x.device),
                                     nin=plan.nin, tile=tile, poison=first)
        if first:
            self._check(key, y, lambda *args: self._oracle.depthwise_forward(plan, *args), x,
                        weight, bias)
        return y

    def depthwise_gradients(self, plan, grad_y, x, weight, needs, dtypes):
        need_input, need_weight, need_bias = needs
        device, (batch, channels, _) = grad_y.device, grad_y.shape
        grad_dtypes = tuple(torch.float32 if d is None else d for d in dtypes)
        tables = self.depthwise_tables(plan, device)
        oracle = self._oracle
        grad_x = grad_w = grad_b = None
        if need_input:
            tile = launch.depthwise_tile("depthwise_grad_input", batch, channels)
            key = ("depthwise_grad_input", grad_y.dtype, tile, device, grad_dtypes[0])
            first = self._first_use(key)
            grad_x = launch.depthwise_grad_input(grad_y, weight, tables, nin=plan.nin,
                                                 tile=tile, dtype=grad_dtypes[0], poison=first)
            if first:
                self._check(key, grad_x, lambda g, w: oracle.depthwise_gradients(
                    plan, g, None, w, (True, False, False), (torch.float32,) * 3)[0],
                    grad_y, weight)
            grad_x = in_storage(grad_x, channels_last=False)  # the ops' contract: contiguous
        if need_weight:
            tile = launch.depthwise_tile("depthwise_grad_weight", batch, channels)
            splits = launch.depthwise_grad_weight_splits(
                tile, batch=batch, channels=channels, v=plan.v,
                entries=tables.entries, processors=self._device_sizes(device)[0])
            key = ("depthwise_grad_weight", grad_y.dtype, tile, device, splits)
            first = self._first_use(key)
            grad_w = launch.depthwise_grad_weight(grad_y, x, tables, v=plan.v, tile=tile,
                                                  splits=splits, poison=first)
            if first:
                self._check(key, grad_w, lambda g, xs: oracle.depthwise_gradients(
                    plan, g, xs, None, (False, True, False), (torch.float32,) * 3)[1],
                    grad_y, x)
            grad_w = grad_w.to(grad_dtypes[1])
        if need_bias:
            grad_b = self._depthwise_grad_bias(grad_y).to(grad_dtypes[2])
        return grad_x, grad_w, grad_b

    def _depthwise_grad_bias(self, grad_y: torch.Tensor) -> torch.Tensor:
        # grad_y comes in its own storage here. The kernel reads channels-last rows; on
        # contiguous grad_y with few nodes each row is a strided gather (119 us against torch's
        # 35 for 128 channels x 60 nodes at B = 2048, bench/results/h100_grad_bias.json), so
        # there torch's reduction, deterministic too, sums it
        if not is_channels_last(grad_y):
            return grad_y.sum(dim=(0, 2), dtype=torch.float32)
        device, channels = grad_y.device, grad_y.shape[1]
        tile = launch.grad_bias_tile(channels)
        key = ("grad_bias", grad_y.dtype, tile, device)
        first = self._first_use(key)
        grad_b = launch.grad_bias(grad_y, tile=tile, processors=self._device_sizes(device)[0],
                                  poison=first)
        if first:
            self._check(key, grad_b, lambda g: g.sum(dim=(0, 2)), grad_y)
        return grad_b

    def _device_sizes(self, device: torch.device) -> tuple[int, int | None]:
        """The device's SMs and L2 bytes, asked once per device (the backward asks on every
        call); in the interpreter one processor and no L2 size."""
        if device.type != "cuda":
            return 1, None
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._device_sizes_seen:
            properties = torch.cuda.get_device_properties(index)
            self._device_sizes_seen[index] = (properties.multi_processor_count,
                                              properties.L2_cache_size)
        return self._device_sizes_seen[index]
