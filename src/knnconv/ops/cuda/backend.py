"""The registry ops of the native CUDA backend (:class:`CudaOps`): which calls it serves,
the launch plans it keeps per layer, and the path each call takes (decided by
:mod:`.launch_plan`): the channels-last kernels (:mod:`.channels_last`), the re-laying-out
ones (:mod:`.gemm`) or the neighbourhood ones (:mod:`.neighbourhood`)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ... import context
from ...plan import GeometryPlan, KNNConvPlan, NeighbourhoodPlan
from ..first_use import FirstUseChecks
from ..registry import (
    MAX_POOL_MODES,
    GradientsFirstOps,
    channels_fastest,
    in_storage,
    is_channels_last,
)
from . import channels_last, neighbourhood
from .build import (
    MIN_COMPUTE_CAPABILITY,
    SCALAR_TYPES,
    cuda_include_dir,
    import_cupy,
    nvrtc_mismatch,
)
from .gemm import COMPUTE_DTYPES, BackwardLaunch, ForwardLaunch
from .launch import readable
from .launch_plan import (
    forward_batch_padding,
    plan_backward_path,
    plan_forward_path,
    reads_in_place,
)
from .relayout import ReverseTables, TransposedInput, reverse_tables


class RecentLaunches:
    """A layer's launch plans by (direction, batch, dtype, ...), the most recent few kept:
    a run with varying batch sizes does not grow it without bound."""

    LIMIT = 16

    def __init__(self) -> None:
        self._plans: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple, build):
        with self._lock:
            launch = self._plans.get(key)
            if launch is None:
                launch = self._plans[key] = build()
                while len(self._plans) > self.LIMIT:
                    self._plans.popitem(last=False)
            else:
                self._plans.move_to_end(key)
            return launch


# A property of the process and the device: under torch.compile the probe runs once, outside
# the graph, and its answer is a constant of it (the probe's CuPy queries are not traceable,
# and tracing them would break the graph of a model whose first call is compiled).
@torch.compiler.assume_constant_result
def probe_device(index: int) -> str | None:
    """Why the kernels cannot run on device ``index``, or None: CuPy, an NVRTC newer than the
    driver, CUDA's headers, the compute capability."""
    try:  # the NVRTC / driver mismatch first: it blocks whatever the headers
        reason = nvrtc_mismatch(import_cupy())
        if reason is None:
            cuda_include_dir()
    except (ImportError, RuntimeError) as exc:
        reason = str(exc)
    capability = torch.cuda.get_device_capability(index)
    if reason is None and capability < MIN_COMPUTE_CAPABILITY:
        reason = (f"needs compute capability >= {MIN_COMPUTE_CAPABILITY}, device {index} "
                  f"has {capability}")
    return reason


class CudaOps(FirstUseChecks, GradientsFirstOps):
    """Registry ops backed by the native kernels.

    The first call of each (kernel, dtype, tile config) on a device writes into NaN-poisoned
    outputs and is checked against the torch_compact oracle (knnconv.ops.first_use), and
    raises if they disagree; later calls are not.
    """

    name = "cuda"
    float32_bias = True
    casts_weight = True  # the weight's re-layout kernel casts it (relayout.WeightLayout)

    def __init__(self) -> None:
        super().__init__()
        self._device_reasons: dict[int, str | None] = {}

    def device_reason(self, index: int) -> str | None:
        """Why the kernels cannot run on device ``index`` (CuPy, headers, NVRTC, capability)."""
        if index not in self._device_reasons:
            self._device_reasons[index] = probe_device(index)
        return self._device_reasons[index]

    def call_reason(self, device: torch.device, *, atomics: bool, alternative: str) -> str | None:
        """Why native kernels (this backend's or the pooling / depthwise ones) cannot serve a
        call on ``device`` whatever its sizes: not a CUDA device, deterministic algorithms
        requested of a backward that accumulates with atomics (``alternative`` names the
        backend to use instead), or :meth:`device_reason`."""
        if device.type != "cuda":
            return f"needs CUDA tensors, got {device.type}"
        if atomics and torch.are_deterministic_algorithms_enabled():
            return ("its weight gradient accumulates with fp32 atomics, which is not "
                    f"deterministic; use backend='{alternative}' under "
                    "torch.use_deterministic_algorithms")
        index = device.index if device.index is not None else torch.cuda.current_device()
        return self.device_reason(index)

    def unsupported_reason(self, plan: GeometryPlan, device: torch.device, dtype: torch.dtype,
                           *, backward: bool = True) -> str | None:
        if isinstance(plan, NeighbourhoodPlan):
            return self._neighbourhood_reason(plan, device, dtype, backward)
        if device.type == "cuda" and dtype not in COMPUTE_DTYPES:
            return (f"computes in float16/bfloat16, got {dtype} (use torch.autocast, or "
                    "backend='torch_compact' / 'auto' for float32)")
        # the forward writes each output once; only the backward accumulates with atomics
        return self.call_reason(device, atomics=backward, alternative="torch_compact")

    def _neighbourhood_reason(self, plan: NeighbourhoodPlan, device: torch.device,
                              dtype: torch.dtype, backward: bool) -> str | None:
        if plan.v is not None and plan.v > neighbourhood.MAX_NATIVE_CELLS:
            return (f"has V = {plan.v} kernel cells; its weight gradient holds at most "
                    f"{neighbourhood.MAX_NATIVE_CELLS} in shared memory")
        if plan.v is None and plan.k > neighbourhood.MAX_TIED_NEIGHBOURS:
            return (f"has K = {plan.k} neighbours; its max records each window's choice of "
                    f"neighbour in a byte, which serves at most "
                    f"{neighbourhood.MAX_TIED_NEIGHBOURS}")
        if device.type == "cuda" and dtype not in neighbourhood.NATIVE_DTYPES:
            return f"computes in float16/bfloat16/float32, got {dtype}"
        # only a depthwise weight gradient accumulates with atomics
        return self.call_reason(device, atomics=backward and plan.v is not None,
                                alternative="torch_compact")

    @staticmethod
    def reverse(plan: KNNConvPlan, device: torch.device) -> ReverseTables:
        return plan.derived(device, "cuda.reverse",
                            lambda t: reverse_tables(t.knn_indices, t.rf_index, plan.nin))

    @staticmethod
    def _launch_plan(plan: KNNConvPlan, device: torch.device, key: tuple, build):
        launches = plan.derived(device, "cuda.launches", lambda tables: RecentLaunches())
        return launches.get(key, build)

    @staticmethod
    def entries(plan: KNNConvPlan, device: torch.device) -> channels_last.EntryTables:
        return plan.derived(device, "cuda.entries", lambda t: channels_last.entry_tables(
            t.knn_indices, t.rf_index, plan.nin))

    def _forward_in_place(self, plan, x, weight, bias):
        device, batch = x.device, x.shape[0]
        # the gather kernel follows knnconv.context's warpgroup_mma: a plan per setting
        wgmma = context.settings().warpgroup_mma
        launch = self._launch_plan(plan, device, ("forward_cl", batch, x.dtype, wgmma), lambda: (
            channels_last.ChannelsLastForward(
                batch=batch, cin=plan.cin, nin=plan.nin, cout=plan.cout, nout=plan.nout,
                v=plan.v, entries=plan.entry_count, dtype=x.dtype, device=device,
                warpgroup_mma=wgmma)))
        key = launch.kernel_key(bias)
        first = self._first_use(key)
        y = launch.run(x, weight, bias, self.entries(plan, device), poison_output=first)
        if first:
            self._check_forward(plan, key, y, x, weight, bias)
        return y

    def forward_saving(self, plan, x, weight, bias):
        path = plan_forward_path(cin=plan.cin, cout=plan.cout,
                                 x_channels_last=channels_fastest(x), x_readable=readable(x))
        if path.channels_last:
            return self._forward_in_place(plan, x, weight, bias), x
        if path.keeps_x:  # unaligned x: re-laid out this once, but kept as it is
            return self._forward_relaying(plan, x, weight, bias)[0], x
        return self._forward_relaying(plan, x, weight, bias)

    def _forward_relaying(self, plan, x, weight, bias):
        device, batch = x.device, x.shape[0]
        launch = self._launch_plan(plan, device, ("forward", batch, x.dtype), lambda: ForwardLaunch(
            batch=batch, cin=plan.cin, nin=plan.nin, cout=plan.cout, nout=plan.nout, q=plan.q,
            p64=plan.p64, dtype=x.dtype, device=device, slots=plan.cin * plan.k))
        key = launch.kernel_key(bias)
        first = self._first_use(key)
        tables = plan.on(device)
        y, saved = launch.run(x, weight, bias, tables.input_linear, tables.weight_linear,
                              poison_output=first)
        if first:
            self._check_forward(plan, key, y, x, weight, bias)
        return y, saved

    def forward(self, plan, x, weight, bias):
        return self.forward_saving(plan, x, weight, bias)[0]

    def saved_layout(self, plan, x, dtype):
        if reads_in_place(plan.cin, plan.cout, channels_fastest(x)):
            return None
        batch = x.shape[0]
        return (plan.cin * plan.nin + 1, forward_batch_padding(
            batch, plan.cin, plan.nin, plan.cout, plan.nout, plan.p64))

    def saved_tensor(self, saved_x):
        return saved_x.xt

    def saved_input(self, saved, plan, batch):
        return TransposedInput(saved, batch, plan.cin, plan.nin)

    def gradients(self, plan, grad_y, x, weight, needs, dtypes, *,
                  dx_channels_last: bool = False):
        """dx_channels_last: dx in channels-last storage (the [B, Cin, Nin] view of a
        contiguous [B, Nin, Cin] buffer), as a channels-last x is stored. The kernels write
        float16, bfloat16 or float32 gradients; a float64 one (a float64 parameter under
        autocast) is written in float32 and widened by torch."""
        wanted = tuple(torch.float32 if d is None else d for d in dtypes)
        written = tuple(d if d in SCALAR_TYPES else torch.float32 for d in wanted)
        grads = self._gradients(plan, grad_y, x, weight, needs, written, dx_channels_last)
        if written == wanted:
            return grads
        return tuple(None if g is None else g.to(d) for g, d in zip(grads, wanted, strict=True))

    def _gradients(self, plan, grad_y, x, weight, needs, grad_dtypes, dx_channels_last):
        device, batch = grad_y.device, grad_y.shape[0]
        need_input, need_weight, need_bias = needs
        path = plan_backward_path(
            cin=plan.cin, cout=plan.cout, need_input=need_input, need_weight=need_weight,
            dx_channels_last=dx_channels_last,
            x_readable=isinstance(x, torch.Tensor) and readable(x),
            grad_y_readable=readable(grad_y))
        if path.channels_last:
            return self._gradients_in_place(plan, grad_y, x, weight, needs, grad_dtypes)
        # a kept re-layout of x is reused only if the backward pads the batch as it is padded
        padding = x.bpad if isinstance(x, TransposedInput) else None
        grad_y_in_place = path.grad_y_in_place
        launch = self._launch_plan(
            plan, device,
            ("backward", batch, grad_y.dtype, needs, grad_dtypes, padding, dx_channels_last,
             grad_y_in_place),
            lambda: BackwardLaunch(batch=batch, cin=plan.cin, nin=plan.nin, cout=plan.cout,
                                   nout=plan.nout, q=plan.q, p64=plan.p64, dtype=grad_y.dtype,
                                   device=device, need_input=need_input,
                                   need_weight=need_weight, need_bias=need_bias,
                                   grad_dtypes=grad_dtypes, batch_padding=padding,
                                   dx_channels_last=dx_channels_last,
                                   grad_y_in_place=grad_y_in_place))
        keys = launch.kernel_keys
        first = {role for role, key in keys.items() if self._first_use(key)}
        tables = plan.on(device)
        gathers = need_input and launch.algorithm == "gather"
        reverse = self.reverse(plan, device) if gathers else None
        grads = launch.run(grad_y, x, weight, tables.input_linear, tables.weight_linear, reverse,
                           poison=bool(first))
        self._check_gradients(plan, keys, first, grads, grad_y, x, weight)
        return grads

    def _gradients_in_place(self, plan, grad_y, x, weight, needs, grad_dtypes):
        device, batch = grad_y.device, grad_y.shape[0]
        need_input, need_weight, need_bias = needs
        wgmma = context.settings().warpgroup_mma
        launch = self._launch_plan(
            plan, device, ("backward_cl", batch, grad_y.dtype, needs, grad_dtypes, wgmma),
            lambda: channels_last.ChannelsLastBackward(
                batch=batch, cin=plan.cin, nin=plan.nin, cout=plan.cout, nout=plan.nout,
                v=plan.v, entries=plan.entry_count, dtype=grad_y.dtype, device=device,
                need_input=need_input, need_weight=need_weight, need_bias=need_bias,
                grad_dtypes=grad_dtypes, warpgroup_mma=wgmma))
        keys = launch.kernel_keys
        first = {role for role, key in keys.items() if self._first_use(key)}
        grads = launch.run(grad_y, x, weight, self.entries(plan, device) if need_weight else None,
                           self.reverse(plan, device) if need_input else None,
                           poison=bool(first))
        self._check_gradients(plan, keys, first, grads, grad_y, x, weight)
        return grads

    # The neighbourhood ops, on the kernels of knn_neighbourhood.cu: every dx is a gather over
    # the reversed graph (deterministic); the depthwise dW sums per block and adds with fp32
    # atomics, its bias gradient is a torch sum.
    serves_neighbourhood = True

    @staticmethod
    def neighbourhood_tables(plan: NeighbourhoodPlan,
                             device: torch.device) -> neighbourhood.NativeTables:
        return plan.derived(device, "cuda.neighbourhood", lambda tables: (
            neighbourhood.native_tables(tables.knn_indices, tables.slot_cells, plan.nin)))

    def pool_forward(self, plan, x, mode):
        tables = self.neighbourhood_tables(plan, x.device)
        y, ties = neighbourhood.pool_forward(x, tables.knn, plan.nin, mode)
        channels_last = is_channels_last(x)  # the contract, whatever storage the kernel took
        return in_storage(y, channels_last), None if ties is None else in_storage(
            ties, channels_last)

    def pool_ties_dtype(self, mode):
        return neighbourhood.TIES_DTYPE if mode in MAX_POOL_MODES else None

    def pool_backward(self, plan, grad_y, x, y, ties, mode, channels_last):
        tables = self.neighbourhood_tables(plan, grad_y.device)
        return neighbourhood.pool_backward(grad_y, x, y, ties, tables.scale, tables.reverse,
                                           mode, plan.nin, channels_last=channels_last)

    def depthwise_forward(self, plan, x, weight, bias):
        tables = self.neighbourhood_tables(plan, x.device)
        bias = None if bias is None else bias.to(x.dtype).contiguous()
        return neighbourhood.depthwise_forward(x.contiguous(), weight.contiguous(), bias,
                                               tables.knn, tables.cells, plan.nin)

    def depthwise_gradients(self, plan, grad_y, x, weight, needs, dtypes):
        tables = self.neighbourhood_tables(plan, grad_y.device)
        need_x, need_w, need_b = needs
        grad_y = grad_y.contiguous()
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = neighbourhood.depthwise_grad_input(grad_y, weight.contiguous(),
                                                        tables.reverse, plan.nin, dtypes[0])
        if need_w:
            grad_w = neighbourhood.depthwise_grad_weight(x.contiguous(), grad_y, tables.knn,
                                                         tables.cells, plan.v).to(dtypes[1])
        if need_b:
            grad_b = grad_y.sum(dim=(0, 2), dtype=torch.float32).to(dtypes[2])
        return grad_x, grad_w, grad_b
