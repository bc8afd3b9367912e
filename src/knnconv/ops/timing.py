"""Timing as a user sees it, shared by the autotuner and the benchmarks: CUDA events
around the Python call, CUDA-graph replays, and the random operands of one cell."""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..plan import KNNConvPlan
from .registry import get_ops


@dataclass
class CellInputs:
    """Random operands of one (layer, batch, dtype), shared by every backend and mode."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    grad_y: torch.Tensor

    def clear_grads(self) -> None:
        for leaf in (self.x, self.weight, self.bias):
            leaf.grad = None


def time_calls(call: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int,
               reset: Callable[[], None] | None = None) -> tuple[float, Any]:
    """Median time in ms of ``repeats`` calls after ``warmup`` calls, and the last call's result.

    On CUDA each call is bracketed by events recorded on the current stream around the Python
    call, so host overhead counts as a user sees it. ``reset`` runs before every call, outside
    the timed region.
    """
    for _ in range(warmup):
        if reset is not None:
            reset()
        call()
    result = None
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        torch.cuda.synchronize(device)  # the warm-up's queued work must not leak into call 1
        for start, end in events:
            if reset is not None:
                reset()
            start.record()
            result = call()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        times = []
        for _ in range(repeats):
            if reset is not None:
                reset()
            begin = time.perf_counter()
            result = call()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times), result


def graph_replay_ms(step: Callable[[], Any], device: torch.device, *, warmup: int,
                    repeats: int, reset: Callable[[], None] | None = None) -> tuple[float, Any]:
    """Median ms of replaying ``step`` captured as a CUDA graph, and the result of an eager
    warm-up call. The warm-up runs on a side stream (as torch.cuda.graphs asks); ``reset``
    runs before capture (clearing gradients, so the captured step writes them as a step after
    zero_grad does, where leaving them allocated would capture an accumulation into them)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(2, warmup)):
            if reset is not None:
                reset()
            result = step()
    torch.cuda.current_stream(device).wait_stream(side)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    median_ms = time_calls(graph.replay, device, warmup=1, repeats=repeats)[0]
    del graph
    return median_ms, result


# A reduce-overhead step's warm-up calls: the first runs eagerly, the next record the graphs.


def random_inputs(plan: KNNConvPlan, batch: int, dtype: torch.dtype,
                  device: torch.device, *, channels_last: bool = False) -> CellInputs:
    """Normal x, bias and grad_y, and a weight scaled by 1/sqrt(Cin*K) so y stays O(1).
    ``channels_last``: x and grad_y in channels-last storage (the [B, C, N] view of a
    contiguous [B, N, C] buffer), as a layer inside a network of KNN layers receives them."""
    generator = torch.Generator(device=device).manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype, device=device)

    def activation(channels: int, nodes: int) -> torch.Tensor:
        if channels_last:
            return normal(batch, nodes, channels).transpose(1, 2)
        return normal(batch, channels, nodes)

    weight = normal(plan.cout, plan.q) / math.sqrt(plan.cin * plan.k)
    return CellInputs(
        x=activation(plan.cin, plan.nin).requires_grad_(),
        weight=weight.requires_grad_(),
        bias=normal(plan.cout).requires_grad_(),
        grad_y=activation(plan.cout, plan.nout),
    )


def unsupported_reason(backend: str, plan: KNNConvPlan, device: torch.device,
                       dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot serve this cell, or None ('auto' always finds a backend)."""
    if backend == "auto":
        return None
    return get_ops(backend).unsupported_reason(plan, device, dtype)


def release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return f"{device.type} ({platform.machine()}, {torch.get_num_threads()} threads)"
