"""Every global switch of knnconv, with the environment variables that set them, read here
and nowhere else.

=====================  ==========================  =================================================
setting                environment variable        meaning
=====================  ==========================  =================================================
keep_input_relayout    KNNCONV_KEEP_INPUT_RELAYOUT whether a training forward keeps the cuda
                                                   backend's batch-contiguous copy of x for the
                                                   backward (faster backward, more memory held
                                                   between forward and backward); default off
autotune               KNNCONV_AUTOTUNE            whether ``backend="auto"`` times the backends on
                                                   a cell's first call and keeps the fastest
                                                   (knnconv.ops.autotune); default off
warpgroup_mma          KNNCONV_WARPGROUP_MMA       whether Hopper GPUs (compute capability 9.0) take
                                                   the warpgroup-MMA channels-last gather where
                                                   tiles.json has a rule for the layer; default
                                                   off (slower than the mma.sync gather on the
                                                   published layers so far: bench/NOTES.md)
graph_replay           KNNCONV_GRAPH_REPLAY        whether ``backend="auto"`` chooses for steps
                                                   replayed as CUDA graphs, by GPU time, instead
                                                   of for steps run call by call (eager, or
                                                   torch.compile's default mode), by GPU and
                                                   host time (knnconv.ops.dispatch.triton_suits),
                                                   and a compiled fovi batch norm is the opaque
                                                   cuDNN op; set it before the warm-up of a
                                                   captured step and around the first calls of
                                                   a model compiled with
                                                   mode="reduce-overhead"; default off
cache_dir              KNNCONV_CACHE_DIR           where the autotuner keeps its choices
                                                   (default ~/.cache/knnconv)
cuda_include_dir       KNNCONV_CUDA_INCLUDE        the CUDA headers' directory for the runtime
                                                   compiler (default: searched, see
                                                   knnconv.ops.cuda.build)
=====================  ==========================  =================================================

The environment is read when knnconv is imported (a malformed value raises there, naming the
variable); :func:`reset` reads it again. :func:`configure` changes settings for the process,
and :func:`using` for a block, like NATTEN's context::

    with knnconv.context.using(keep_input_relayout=True):
        loss = model(x).sum()

Settings are process-wide; torch.compile reads them when it traces and guards on them, so a
compiled model traces again when a setting it read has changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from pathlib import Path

ENVIRONMENT = {"keep_input_relayout": "KNNCONV_KEEP_INPUT_RELAYOUT",
               "autotune": "KNNCONV_AUTOTUNE", "warpgroup_mma": "KNNCONV_WARPGROUP_MMA",
               "graph_replay": "KNNCONV_GRAPH_REPLAY",
               "cache_dir": "KNNCONV_CACHE_DIR", "cuda_include_dir": "KNNCONV_CUDA_INCLUDE"}
FLAGS = ("keep_input_relayout", "autotune", "warpgroup_mma", "graph_replay")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
# Where a CUDA toolkit announces itself; each names a root holding include/.
TOOLKIT_ROOT_VARIABLES = ("CUDA_PATH", "CUDA_HOME", "CUDA_ROOT")


@dataclasses.dataclass(frozen=True)
class Settings:
    keep_input_relayout: bool = False
    autotune: bool = False
    warpgroup_mma: bool = False
    graph_replay: bool = False
    cache_dir: Path = Path.home() / ".cache" / "knnconv"
    cuda_include_dir: Path | None = None


def _flag(variable: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{variable}={value!r}: expected one of {', '.join(_TRUE + _FALSE[1:])}")


def _from_environment() -> Settings:
    values = {}
    for name, variable in ENVIRONMENT.items():
        raw = os.environ.get(variable)
        if raw is None or (raw == "" and name in ("cache_dir", "cuda_include_dir")):
            continue
        values[name] = _flag(variable, raw) if name in FLAGS \
            else Path(raw).expanduser()
    return _checked(Settings(), values, source="environment")


def _checked(base: Settings, changes: dict, *, source: str) -> Settings:
    """``base`` with ``changes``, refusing unknown names, wrong types and paths that cannot
    serve."""
    unknown = set(changes) - {field.name for field in dataclasses.fields(Settings)}
    if unknown:
        raise TypeError(f"unknown knnconv settings {sorted(unknown)}; known: "
                        f"{[field.name for field in dataclasses.fields(Settings)]}")
    for name in FLAGS:
        if name in changes and not isinstance(changes[name], bool):
            raise TypeError(f"{name} must be a bool, got {type(changes[name]).__name__}")
    for name in ("cache_dir", "cuda_include_dir"):
        if name not in changes or (name == "cuda_include_dir" and changes[name] is None):
            continue  # only the include directory may be unset (searched for)
        if not isinstance(changes[name], (str, os.PathLike)):
            raise TypeError(f"{name} must be a path, got {type(changes[name]).__name__}")
        changes[name] = Path(changes[name]).expanduser()
    cache_dir = changes.get("cache_dir")
    if cache_dir is not None and cache_dir.exists() and not cache_dir.is_dir():
        raise ValueError(f"cache_dir {cache_dir} ({source}) is a file, not a directory")
    include = changes.get("cuda_include_dir")
    if include is not None and not include.is_dir():
        raise ValueError(f"cuda_include_dir {include} ({source}) is not a directory")
    return dataclasses.replace(base, **changes)


_lock = threading.Lock()
# Read at import, so that reading the settings is one global lookup: torch.compile traces it.
_current: Settings = _from_environment()


def settings() -> Settings:
    """The settings in force: the environment's, as changed since."""
    return _current


def configure(**changes) -> Settings:
    """Change settings for the process; returns the settings it replaced."""
    global _current
    with _lock:
        previous = _current
        _current = _checked(previous, dict(changes), source="configure")
    return previous


def reset() -> None:
    """Forget every change and read the environment again."""
    global _current
    with _lock:
        _current = _from_environment()


@contextlib.contextmanager
def using(**changes):
    """:func:`configure` for a block; the settings before it are back after it, on error too."""
    previous = configure(**changes)
    try:
        yield settings()
    finally:
        global _current
        with _lock:
            _current = previous


def toolkit_roots() -> list[Path]:
    """The CUDA toolkit roots the environment names (CUDA_PATH, CUDA_HOME, CUDA_ROOT)."""
    return [Path(os.environ[v]) for v in TOOLKIT_ROOT_VARIABLES if os.environ.get(v)]


def set_keep_input_relayout(enabled: bool) -> bool:
    """Set ``keep_input_relayout`` (see the table above); returns the previous setting."""
    return configure(keep_input_relayout=bool(enabled)).keep_input_relayout


def keep_input_relayout(enabled: bool):
    """``using(keep_input_relayout=enabled)``: the setting for a block."""
    return using(keep_input_relayout=bool(enabled))
