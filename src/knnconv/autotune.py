"""Measured backend choice for ``backend="auto"``, opt in: ``KNNCONV_AUTOTUNE=1`` in the
environment, or :func:`enable`.

The first ``auto`` call of a cell (device, torch version, compute dtype, batch, layer
geometry) times one forward and backward of every backend that can serve it, on random
operands of the call's shapes, and keeps the fastest; later calls, and later processes, read
the choice from a JSON file (``$KNNCONV_CACHE_DIR/autotune.json``, by default
``~/.cache/knnconv``). Nothing is timed while a CUDA graph is being captured or under
deterministic algorithms (those calls take a stored choice, else the heuristic policy), and
torch.compile traces the heuristic policy (its batch may be symbolic). The backend that ran
is, as always, in ``knn_conv_with_backend``'s result and a module's ``last_backend``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import threading
import time
import warnings
from pathlib import Path

import torch

from .ops.registry import available_backends, get_ops
from .plan import KNNConvPlan

ENVIRONMENT_SWITCH = "KNNCONV_AUTOTUNE"
CACHE_DIRECTORY = "KNNCONV_CACHE_DIR"
CANDIDATES = ("cuda", "torch_binned", "torch_compact")
TIMED_STEPS = 3

_enabled: bool | None = None  # None: the environment decides
_lock = threading.Lock()
_choices: dict[str, dict] | None = None  # the file's content, read once


def enable(on: bool | None = True) -> None:
    """Turn measured choices on or off for this process, overriding the environment (None:
    the environment decides again)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return os.environ.get(ENVIRONMENT_SWITCH, "") not in ("", "0")


def cache_path() -> Path:
    directory = os.environ.get(CACHE_DIRECTORY) or Path.home() / ".cache" / "knnconv"
    return Path(directory) / "autotune.json"


def forget() -> None:
    """Drop the choices read into this process (the file stays; the next lookup rereads it)."""
    global _choices
    with _lock:
        _choices = None


def _stored() -> dict[str, dict]:
    global _choices
    if _choices is None:
        path = cache_path()
        try:
            _choices = json.loads(path.read_text()) if path.exists() else {}
            if not isinstance(_choices, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            warnings.warn(f"knnconv: ignoring the autotune file {path} ({exc}); it will be "
                          "rewritten", stacklevel=3)
            _choices = {}
    return _choices


def _store(key: str, record: dict) -> None:
    choices = _stored()
    choices[key] = record
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
        partial.write_text(json.dumps(choices, indent=1, sort_keys=True))
        os.replace(partial, path)  # readers see the old file or the new one, never a part
    except OSError as exc:
        warnings.warn(f"knnconv: could not write the autotune file {path} ({exc}); the "
                      "choice holds for this process only", stacklevel=3)


def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} {platform.machine()} {torch.get_num_threads()} threads"


def _geometry_digest(plan: KNNConvPlan) -> str:
    def build(host) -> str:
        digest = hashlib.sha256()
        for table in (host.knn_indices, host.rf_index):
            digest.update(table.numpy().tobytes())
        digest.update(repr((plan.cin, plan.cout, plan.nin, plan.v)).encode())
        return digest.hexdigest()[:16]
    return plan.derived("cpu", "autotune.digest", build)


def cell_key(plan: KNNConvPlan, batch: int, device: torch.device, dtype: torch.dtype) -> str:
    return (f"{_device_label(device)} | torch {torch.__version__} | {dtype} | B={batch} | "
            f"Cin={plan.cin} Cout={plan.cout} K={plan.k} V={plan.v} Nin={plan.nin} "
            f"Nout={plan.nout} | {_geometry_digest(plan)}")


def candidates(plan: KNNConvPlan, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The backends ``auto`` may measure for this call: those that load and can serve it."""
    names = []
    for name in CANDIDATES:
        if name not in available_backends():
            continue
        try:
            ops = get_ops(name)
        except ImportError:  # a native backend whose toolchain is missing here
            continue
        if ops.unsupported_reason(plan, device, dtype) is None:
            names.append(name)
    return names


def _measuring_is_unsafe(device: torch.device) -> bool:
    return torch.are_deterministic_algorithms_enabled() or (
        device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def step_ms(name: str, plan: KNNConvPlan, batch: int, device: torch.device,
            dtype: torch.dtype) -> float:
    """Median ms of a forward and backward of backend ``name`` on random operands, after one
    untimed step (which compiles and checks whatever the backend builds at first use)."""
    ops = get_ops(name)
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    x, weight, bias = normal(batch, plan.cin, plan.nin), normal(plan.cout, plan.q), None
    grad_y = normal(batch, plan.cout, plan.nout)
    needs, dtypes = (True, True, False), (dtype, dtype, dtype)

    def step() -> None:
        _, saved = ops.forward_saving(plan, x, weight, bias)
        ops.gradients(plan, grad_y, saved, weight, needs, dtypes)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    with torch.no_grad():
        for index in range(TIMED_STEPS + 1):
            start = time.perf_counter()
            step()
            if index:
                times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def choose(plan: KNNConvPlan, batch: int, device: torch.device,
           dtype: torch.dtype) -> str | None:
    """The measured choice for this cell, measuring it first if it has none and measuring
    is safe here; None when disabled or when the heuristic policy should decide."""
    if not enabled() or torch.compiler.is_compiling():  # a traced batch may be symbolic
        return None
    if batch == 0 or device.type == "meta":
        return None
    names = candidates(plan, device, dtype)
    if len(names) < 2:
        return None
    key = cell_key(plan, batch, device, dtype)
    with _lock:
        stored = _stored().get(key)
    if stored is not None and stored.get("backend") in names:
        return stored["backend"]
    if _measuring_is_unsafe(device):
        return None
    with _lock:  # one thread measures a cell; the others wait and read its choice
        stored = _stored().get(key)
        if stored is not None and stored.get("backend") in names:
            return stored["backend"]
        times = {name: step_ms(name, plan, batch, device, dtype) for name in names}
        best = min(times, key=times.__getitem__)
        _store(key, {"backend": best, "step_ms": times})
    return best
