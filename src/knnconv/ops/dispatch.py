"""The dispatcher of every KNN op: which backend serves a call, for ``backend="auto"`` (the
measured choice when autotuning is on, else the policy below) or a named backend, which never
falls back."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .. import context
from ..plan import GeometryPlan, KNNConvPlan
from . import autotune
from .registry import KNNConvOps, available_backends, get_ops
from .triton.configs import MIN_BLOCK as TRITON_CHANNEL_CHUNK
from .triton.configs import few_channels

if TYPE_CHECKING:
    from .cuda import CudaOps

# On the CPU torch_binned's dense GEMMs beat torch_compact's per-node products wherever a
# node has no more cells than neighbours (V <= K: 1.2-3.1x at B = 64) and, at batches up to 8,
# on the published layers whatever V (B = 1: 1.6-104x; B = 8: all training steps, all but two
# forwards, those at 0.85-0.99x); at B = 64 with V = 4K it does four times the FLOPs and loses
# (0.25-0.91x), measured on a 2-core CPU (bench/results/cpu_binned_geometry_b*.json).
BINNED_ANY_CELLS_MAX_BATCH = 8


def torch_policy(plan: GeometryPlan, device: torch.device, batch) -> str:
    """The torch backend auto takes: for a convolution, torch_binned on the CPU where it is the
    faster one (see BINNED_ANY_CELLS_MAX_BATCH), else torch_compact; the torch backends share
    one implementation of the neighbourhood ops. ``batch``: an int, or None / a symbolic size
    under torch.compile, where only the V <= K rule applies."""
    if device.type != "cpu" or not isinstance(plan, KNNConvPlan):
        return "torch_compact"
    if plan.v <= plan.k:
        return "torch_binned"
    small = isinstance(batch, int) and batch <= BINNED_ANY_CELLS_MAX_BATCH
    return "torch_binned" if small else "torch_compact"


def resolve_backend(name: str, plan: GeometryPlan, device: torch.device, dtype: torch.dtype,
                    batch: int | None = None, *, backward: bool = True) -> KNNConvOps:
    """The backend that will serve a call: ``name`` itself, or the auto policy's choice.

    An explicitly named backend that cannot serve the call raises; it never falls back.
    Auto takes the measured choice for a convolution's cell when autotuning is on (see
    knnconv.ops.autotune; ``batch`` is needed for it), else the first native backend of
    NATIVE_ORDER that serves the call on CUDA tensors (the triton backend only for calls of
    enough work), else the torch backend of :func:`torch_policy`. ``backward``:
    whether the call's gradients will be computed (see KNNConvOps.unsupported_reason).
    """
    if name == "auto":
        if batch is not None and isinstance(plan, KNNConvPlan):
            tuned = autotune.choose(plan, batch, device, dtype)
            if tuned is not None:
                return get_ops(tuned)
        if device.type == "cuda":
            native = _native_choice(plan, device, dtype, backward, batch)
            if native is not None:
                return native
        return get_ops(torch_policy(plan, device, batch))
    ops = get_ops(name)
    reason = ops.unsupported_reason(plan, device, dtype, backward=backward)
    if reason is not None:
        raise ValueError(f"backend {name!r} cannot run this call: {reason}")
    return ops


# The native backends auto tries on CUDA tensors, in this order: the TMA-fed Triton kernels
# where they serve (compute capability 9.0+, output channels a multiple of 16) and suit the call
# (triton_suits), then the NVRTC kernels (sm_80+, every layer).
NATIVE_ORDER = ("triton", "cuda")
# Replayed, the triton backend's training step reaches 43% of the floor on the large published
# layers (geomean, one H100; 39% on one H200, against the cuda backend's 25% there), but each
# of its calls costs more host time (an eager training step of a small layer never under about
# 0.6 ms against cuda's 0.31 on one H100 host, 1.0 against 0.72 on a slower H200 host).
# Eager, a layer's own training step was the faster on triton from about 100 GFLOP of forward
# work (2 * B * real entries * Cin * Cout) on the H200 host, 33 GFLOP on the H100 one. In
# whole models a lower threshold did not pay: at 30 GFLOP a fovi ResNet-18's eager step at
# B = 2048 took 17.6 against 19.3 ms in a process of that model alone
# (bench/results/h100_eager_crossover.json), but 20.7 in the whole-model bench (20.9 in the
# previous run at 100 GFLOP), whose compiled step, which chooses by the same rule, went from
# 22.0 to 27.2 ms, host-bound (bench/results/h100_eager30_fovi_models.json, bench/NOTES.md
# 2026-12-06). Below this an eager call keeps the cuda kernels.
TRITON_MIN_FORWARD_FLOP = 100e9
# A few-channel stem's forward-only call (inference) or training step replayed as a CUDA
# graph. On stems of at most 64 output channels from about 2**18 output rows (B * Nout) up
# (fovi ResNet-18 conv1 at B = 512 and 2048, the generated K = 49 stems at B = 128-2048), the
# triton backend's few-channel forward kernel took 0.36-0.77x the cuda backend's time
# (bench/results/h200_stems_tuned.json), its replayed training step 0.70-0.97x with the input
# gradient (its two-pass slot-gradient kernels) and 0.58-0.91x without
# (bench/results/h200_stems.json). On wider stems (AlexNet's 96 channels, the ViT patch
# embeddings' 192-1280) the forward took 0.68-1.73x and AlexNet's replayed step 1.01-1.09x
# with dx, 0.94-1.30x without. Eager, a triton training call costs the host more: ResNet-18
# conv1's step without dx took 1.3-1.7x cuda's at B = 128 and 512. Only on much work does the
# eager step pay: on one H100 (bench/results/h100_fovi_kernels_2026-12-06.json, x fresh each
# call) the generated K = 49 stems' step took 0.70-0.81x cuda's from 41 GFLOP of forward work
# up (B = 512 and 2048 on 4,241 nodes, B = 2048 on 3,321), and 0.74-1.18x below, where
# ResNet-18's conv1 took 0.89-1.79x (up to 36 GFLOP, B = 2048).
FEW_CHANNEL_MAX_COUT = 64
FEW_CHANNEL_MIN_ROWS = 2**18
FEW_CHANNEL_MIN_TRAIN_FLOP = 40e9


def triton_suits(plan: KNNConvPlan, batch, backward: bool = True) -> bool:
    """Whether auto takes the triton backend for a convolution call it serves.

    - Under deterministic algorithms: always (the cuda backend's backward is refused there).
    - Layers of input channels that are not a multiple of 16 (triton pads them): never, but
      for a layer of fewer than 16 (image stems: the few-channel kernels run it) of at most
      FEW_CHANNEL_MAX_COUT output channels and FEW_CHANNEL_MIN_ROWS output rows (or no batch
      given: None), in a forward-only call, a replayed training step (below), or a training
      step run call by call from FEW_CHANNEL_MIN_TRAIN_FLOP of forward work up.
    - Steps replayed as CUDA graphs (the graph_replay setting, which the user sets for a step
      captured by hand or compiled with mode="reduce-overhead"), where GPU time alone counts:
      where the layer
      has at least one neighbour slot (Nout x K) per kernel cell; the slot count, not the
      real pairs, so that Dynamo does not trace a count of the table. Replayed, triton's
      training step was 1.26x the cuda backend's (geomean of 75 published cells); it lost
      on layers of a few nodes and many cells, whose step is the weight's re-layout and
      gradient.
    - Steps run call by call, eager or compiled in torch.compile's default mode, where host
      time counts too: from TRITON_MIN_FORWARD_FLOP of forward work up; without a batch
      (None), or with a batch torch.compile traces as a data-dependent symbol, never, the
      cuda kernels' calls costing the host less. Compiled as if replayed (triton on 15 of 20
      layers), a fovi ResNet-18 step at B = 512 took 38.6 ms, host-bound, against eager's
      21.3 (bench/results/host_profile_resnet18_b512.txt).

    (bench/results/h200.json, bench/NOTES.md 2026-12-03)"""
    if torch.are_deterministic_algorithms_enabled():
        return True
    if plan.cin % TRITON_CHANNEL_CHUNK:
        if not (few_channels(plan.cin) and plan.cout <= FEW_CHANNEL_MAX_COUT
                and (batch is None or _at_least(batch * plan.nout, FEW_CHANNEL_MIN_ROWS))):
            return False
        if not backward or context.settings().graph_replay:
            return True
        return batch is not None and _at_least(_forward_flop(plan, batch),
                                               FEW_CHANNEL_MIN_TRAIN_FLOP)
    if context.settings().graph_replay:
        return plan.nout * plan.k >= plan.v
    return batch is not None and _at_least(_forward_flop(plan, batch), TRITON_MIN_FORWARD_FLOP)


def _forward_flop(plan: KNNConvPlan, batch):
    """A call's forward work, 2 * B * real entries * Cin * Cout (the entries counted when the
    plan was built, so Dynamo traces no count of the table)."""
    return 2 * batch * plan.entry_count * plan.cin * plan.cout


def _at_least(work, threshold) -> bool:
    """work >= threshold, where work may be a size Dynamo traces as a symbol and passes off
    as an int: compared (and guarded on) where the symbol has a value to guard on, False where
    it is unbacked (data-dependent), which no guard can check."""
    return guard_or_false(work >= threshold)


def _native_choice(plan: GeometryPlan, device: torch.device, dtype: torch.dtype,
                   backward: bool, batch) -> KNNConvOps | None:
    """The first native backend of NATIVE_ORDER that serves the call (triton only where
    :func:`triton_suits` the call), or None (after warning once where the cuda backend
    cannot run on the device at all)."""
    for name in NATIVE_ORDER:
        if name == "triton" and not (isinstance(plan, KNNConvPlan)
                                     and triton_suits(plan, batch, backward)):
            continue
        if name in available_backends():
            ops = get_ops(name)
            if ops.unsupported_reason(plan, device, dtype, backward=backward) is None:
                return ops
    if "cuda" in available_backends():
        _warn_once_if_device_unserved(get_ops("cuda"), device)
    return None


# (device index, reason) pairs already warned about in this process
_warned_devices: set[tuple[int, str]] = set()


def _warn_once_if_device_unserved(cuda_ops: CudaOps, device: torch.device) -> None:
    """Warns, once per device and reason, when auto cannot use the native kernels on a CUDA
    device at all (no CuPy, no CUDA headers, an NVRTC newer than the driver, an old GPU): a
    GPU user then trains on the much slower torch backends, and should hear why. A call's own
    reasons (float32 operands, deterministic mode) are documented choices and stay quiet.
    Under torch.compile it says nothing: Dynamo cannot trace a warning, and fullgraph=True
    would fail on it."""
    if torch.compiler.is_compiling():
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    reason = cuda_ops.device_reason(index)
    if reason is None or (index, reason) in _warned_devices:
        return
    _warned_devices.add((index, reason))
    warnings.warn(f"knnconv: backend='auto' runs the torch backends on cuda:{index}, where the "
                  f"native kernels cannot run: {reason}", RuntimeWarning, stacklevel=4)
