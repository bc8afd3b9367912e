"""Measured backend choice for ``backend="auto"``, opt in: knnconv.context's ``autotune``
(``KNNCONV_AUTOTUNE=1`` in the environment, or ``knnconv.context.configure(autotune=True)``).

The first ``auto`` call of a cell (device, knnconv and torch versions, compute dtype, batch,
layer geometry, whether x or its re-layout is kept for the backward) times one training step
of every backend that can serve it (forward, then the gradients of x, weight and bias, the
way a call with the context's current ``keep_input_relayout`` runs them) on random
operands of the call's shapes, and keeps the fastest; later calls, and later processes, read
the choice from a JSON file (``autotune.json`` in the context's ``cache_dir``, by default
``~/.cache/knnconv``). Nothing is timed while a CUDA graph is being captured or under
deterministic algorithms (those calls take a stored choice, else the heuristic policy), and
torch.compile traces the heuristic policy (its batch may be symbolic). A candidate that fails
to run (out of memory, say) is left out with a warning, and a choice made without it is
not written to the file. Candidates keep the tables they built while being measured. Choices
are remembered per plan in the process (``forget()`` drops them, e.g. after moving the
file); the file's keys hold the knnconv version, so delete it after changing the code
without changing the version. The backend that ran is, as always, in ``knn_conv_with_backend``'s
result and a module's ``last_backend``. The choice is made on a training step's time and
serves inference calls of the cell too.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from pathlib import Path

import torch

from .. import context
from .._version import __version__
from ..plan import KNNConvPlan
from .execute import backward_impl, forward_impl
from .registry import available_backends, get_ops
from .timing import (
    device_description,
    random_inputs,
    release_memory,
    time_calls,
    unsupported_reason,
)

CANDIDATES = ("triton", "cuda", "torch_binned", "torch_compact")
TIMED_STEPS = 3

_lock = threading.Lock()  # measuring and the file; lookups of known cells do not take it
_choices: dict[str, dict] | None = None  # the file's content, read once
_memo: dict[tuple, str | None] = {}  # _memo_key(...) -> choice, None for the policy's


def enabled() -> bool:
    """Whether ``auto`` makes measured choices (knnconv.context's ``autotune``)."""
    return context.settings().autotune


def cache_path() -> Path:
    """The file the choices are kept in, in knnconv.context's ``cache_dir``."""
    return context.settings().cache_dir / "autotune.json"


def forget() -> None:
    """Drop the choices read into this process (the file stays; the next lookup rereads it)."""
    global _choices
    with _lock:
        _choices = None
        _memo.clear()


def _read_file(path: Path) -> dict[str, dict]:
    """The file's valid records ({key: {"backend": str, ...}}); others are dropped."""
    content = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(content, dict):
        raise ValueError("not a JSON object")
    return {key: record for key, record in content.items()
            if isinstance(record, dict) and isinstance(record.get("backend"), str)}


def _stored() -> dict[str, dict]:
    global _choices
    if _choices is None:
        path = cache_path()
        try:
            _choices = _read_file(path)
        except (OSError, ValueError) as exc:
            warnings.warn(f"knnconv: ignoring the autotune file {path} ({exc}); it will be "
                          "rewritten", stacklevel=4)
            _choices = {}
    return _choices


def _store(key: str, record: dict) -> None:
    """Add a choice to this process's and to the file's, keeping what other processes wrote
    there since it was read."""
    choices = _stored()
    choices[key] = record
    path = cache_path()
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            merged = {**_read_file(path), key: record}
        except (OSError, ValueError):
            merged = dict(choices)
        partial.write_text(json.dumps(merged, indent=1, sort_keys=True))
        os.replace(partial, path)  # readers see the old file or the new one, never a part
    except OSError as exc:
        warnings.warn(f"knnconv: could not write the autotune file {path} ({exc}); the "
                      "choice holds for this process only", stacklevel=4)
    finally:
        try:
            partial.unlink(missing_ok=True)
        except OSError:  # its directory could not be made
            pass


def _geometry_digest(plan: KNNConvPlan) -> str:
    def build(host) -> str:  # the sizes are spelled out in the key beside it
        digest = hashlib.sha256()
        for table in (host.knn_indices, host.rf_index):
            digest.update(table.numpy().tobytes())
        return digest.hexdigest()[:16]
    return plan.derived("cpu", "autotune.digest", build)


def _keeps_relayout() -> bool:
    return context.settings().keep_input_relayout


def cell_key(plan: KNNConvPlan, batch: int, device: torch.device, dtype: torch.dtype) -> str:
    kept = "re-layout of x kept" if _keeps_relayout() else "x kept"
    return (f"{device_description(device)} | knnconv {__version__} | torch {torch.__version__} | "
            f"{dtype} | B={batch} | Cin={plan.cin} Cout={plan.cout} K={plan.k} V={plan.v} "
            f"Nin={plan.nin} Nout={plan.nout} | {kept} | {_geometry_digest(plan)}")


def candidates(plan: KNNConvPlan, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The backends ``auto`` may measure for this call: those that load and can serve it."""
    available = available_backends()
    return [name for name in CANDIDATES
            if name in available and unsupported_reason(name, plan, device, dtype) is None]


def _capturing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def step_ms(name: str, plan: KNNConvPlan, batch: int, device: torch.device,
            dtype: torch.dtype) -> float:
    """Median ms of a training step of backend ``name`` on random operands (through the
    functions the autograd layer runs, keeping x or its re-layout as a call would), after one
    untimed step (which compiles and checks whatever the backend builds at first use)."""
    ops = get_ops(name)
    inputs = random_inputs(plan, batch, dtype, device)
    x, weight, bias, grad_y = inputs.x, inputs.weight, inputs.bias, inputs.grad_y
    keep = _keeps_relayout()

    def step() -> None:
        _, saved = forward_impl(plan, ops, x, weight, bias, dtype, keep_for_backward=keep)
        backward_impl(plan, ops, grad_y, saved, weight, (True, True, True), (dtype,) * 3, dtype)

    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        return time_calls(step, device, warmup=1, repeats=TIMED_STEPS)[0]


def _measure(names: list[str], plan: KNNConvPlan, batch: int, device: torch.device,
             dtype: torch.dtype) -> dict[str, float]:
    times = {}
    for name in names:
        try:
            times[name] = step_ms(name, plan, batch, device, dtype)
        except Exception as exc:  # noqa: BLE001 (any failure rules the candidate out)
            warnings.warn(f"knnconv autotune: {name} failed on this call's shapes and is left "
                          f"out ({type(exc).__name__}: {exc})", stacklevel=5)
            release_memory(device)
    return times


def _memo_key(plan: KNNConvPlan, batch: int, device: torch.device, dtype: torch.dtype,
              deterministic: bool) -> tuple:
    return (plan.handle, batch, device, dtype, deterministic, torch.get_num_threads(),
            _keeps_relayout())


def choose(plan: KNNConvPlan, batch: int, device: torch.device,
           dtype: torch.dtype) -> str | None:
    """The measured choice for this cell, measuring it first if it has none and measuring
    is safe here; None when disabled or when the heuristic policy should decide."""
    if not enabled() or torch.compiler.is_compiling():  # a traced batch may be symbolic
        return None
    deterministic = torch.are_deterministic_algorithms_enabled()
    memo_key = _memo_key(plan, batch, device, dtype, deterministic)
    if memo_key in _memo:
        return _memo[memo_key]
    if batch == 0 or device.type == "meta":
        return None
    names = candidates(plan, device, dtype)
    if len(names) < 2:
        _memo[memo_key] = None
        return None
    key = cell_key(plan, batch, device, dtype)
    with _lock:
        stored = _stored().get(key)
        if stored is not None and stored["backend"] in names:
            _memo[memo_key] = stored["backend"]
            return stored["backend"]
        if deterministic:
            _memo[memo_key] = None  # this key never measures
            return None
        if _capturing(device):
            return None  # not remembered: a later call may measure
        times = _measure(names, plan, batch, device, dtype)
        if not times:
            return None  # every candidate failed; a later call tries again
        best = min(times, key=times.__getitem__)
        if len(times) == len(names):
            _store(key, {"backend": best, "step_ms": times})
        # else a candidate failed, perhaps for lack of memory at that moment: the choice
        # holds for this process only
        _memo[memo_key] = best
        # deterministic calls of the cell may now take the stored choice
        _memo.pop(_memo_key(plan, batch, device, dtype, deterministic=True), None)
    return best
