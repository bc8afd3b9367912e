"""Tables that outlive the call building them, kept out of CUDA-graph memory pools.

torch.compile(mode="reduce-overhead") runs a graph's first call eagerly with every
allocation of the calling thread routed into the graph's private memory pool (PyTorch's
CUDA-graph trees), then refuses to record the graph if tensors allocated there outlive the
call without being its outputs. A plan's device tables, and what backends derive from them,
are built at first use, possibly inside such a call, and live as long as the plan: on a CUDA
device they are built by a thread of their own on a stream of their own, which no pool
claims whether it takes a thread's allocations (PyTorch 2.8 on) or a stream's (before: the
builder's stream is a high-priority one, never one of the default-priority streams a
warm-up is handed). The calling stream waits for the build before it uses the tables, and
the tables' memory is reused only after the calling stream's work queued when they are
freed (as if the caller had allocated them); other streams are not ordered after a first
use. Memory the builder's stream caches serves only its later builds.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_builder_state = threading.local()  # on the builder thread: active, and its stream per device


def _mark_builder_thread() -> None:
    _builder_state.active = True
    _builder_state.streams = {}


def _builder() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="knnconv-tables",
                                           initializer=_mark_builder_thread)
        return _executor


def _build_on_own_stream(device: torch.device, caller: torch.cuda.Stream,
                         build: Callable[[], T]) -> tuple[T, torch.cuda.Event]:
    streams = _builder_state.streams
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device, priority=-1)
    stream.wait_stream(caller)  # the build reads what the caller's stream produced
    with torch.cuda.device(device), torch.cuda.stream(stream):
        value = build()
    return value, stream.record_event()


def on_builder_thread() -> bool:
    return getattr(_builder_state, "active", False)


def _tensors(value: Any):
    """The tensors in a built value: tensors, tuples and lists, dicts, dataclasses (what
    builds return; tensors inside other objects would not be found)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for item in dataclasses.fields(value):
            yield from _tensors(getattr(value, item.name))


def build_persistent(device: torch.device, build: Callable[[], T]) -> T:
    """``build()``, run where its CUDA allocations stay out of CUDA-graph memory pools (see the
    module docstring); inline on other devices, on the builder thread itself, and while the
    current stream is being captured (a first use there fails by design: warm up first)."""
    if (device.type != "cuda" or on_builder_thread()
            or torch.cuda.is_current_stream_capturing()):
        return build()
    caller = torch.cuda.current_stream(device)
    value, built = _builder().submit(_build_on_own_stream, device, caller, build).result()
    caller.wait_event(built)
    for tensor in _tensors(value):
        if tensor.device.type == "cuda":
            tensor.record_stream(caller)
    return value
