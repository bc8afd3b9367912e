"""Run-time compilation of the .cu kernels through CuPy's NVRTC, and the module cache.

torch is imported before CuPy so that the process binds one NVRTC consistently; CUDA's
headers (cuda_fp16.h, cuda_bf16.h, mma.h) are located once, with an error that lists every
place searched when they are missing.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import sys
import threading
from functools import cache, lru_cache
from pathlib import Path

import torch  # noqa: F401  (must be imported before cupy, see module docstring)

from ... import context
from .configs import CHANNELS_LAST_FAMILIES, FAMILIES

KERNEL_DIR = Path(__file__).parent / "kernels"
# One family of kernels per source file: each launch family's source, and the target it is
# built for (None: the device's own architecture)
KERNEL_SOURCES = {
    **dict.fromkeys(FAMILIES, (KERNEL_DIR / "knn_gemm.cu", None)),
    **dict.fromkeys(CHANNELS_LAST_FAMILIES, (KERNEL_DIR / "knn_gemm_channels_last.cu", None)),
    "gather_cl_wgmma": (KERNEL_DIR / "knn_gemm_channels_last_sm90.cu", "sm_90a"),
    "transpose": (KERNEL_DIR / "knn_relayout.cu", None),
    "neighbourhood": (KERNEL_DIR / "knn_neighbourhood.cu", None),
}
# CUfunction_attribute CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES of the driver API
_MAX_DYNAMIC_SHARED_ATTRIBUTE = 8
REQUIRED_HEADERS = ("cuda_fp16.h", "cuda_bf16.h", "mma.h")
SCALAR_TYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}
MIN_COMPUTE_CAPABILITY = (8, 0)


class CudaHeadersNotFound(RuntimeError):
    pass


def import_cupy():
    """CuPy, or an ImportError that says how to install it."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            "the 'cuda' backend needs CuPy: pip install 'knnconv[cuda13]' (CUDA 13) or "
            "'knnconv[cuda12]' (CUDA 12)"
        ) from exc
    return cupy


def nvrtc_mismatch(cupy) -> str | None:
    """Why CuPy's NVRTC cannot build for this driver (None when it can): code from an NVRTC
    newer than the driver's CUDA version does not load."""
    try:
        nvrtc_major, nvrtc_minor = cupy.cuda.nvrtc.getVersion()
        driver = cupy.cuda.runtime.driverGetVersion()  # e.g. 13000 for CUDA 13.0
    except (AttributeError, RuntimeError):  # a CuPy without these queries: nothing to compare
        return None
    if (nvrtc_major, nvrtc_minor) > (driver // 1000, driver % 1000 // 10):
        return (f"CuPy's NVRTC is CUDA {nvrtc_major}.{nvrtc_minor} but the driver supports CUDA "
                f"{driver // 1000}.{driver % 1000 // 10}: install the cupy-cudaXXx wheel that "
                "matches the driver, or update the driver")
    return None


def _candidate_include_dirs(forced: Path | None) -> list[Path]:
    candidates = [forced] if forced is not None else []
    candidates += [root / "include" for root in context.toolkit_roots()]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for site in sys.path:
        for pattern in ("nvidia/cu13/include", "nvidia/cuda_runtime/include",
                        "nvidia/cu12/include"):
            candidates.extend(Path(p) for p in glob.glob(os.path.join(site, pattern)))
    return candidates


def cuda_include_dir() -> str:
    """The first directory holding all of REQUIRED_HEADERS: knnconv.context's
    ``cuda_include_dir`` (KNNCONV_CUDA_INCLUDE) when set, else a search."""
    return _search_include_dir(context.settings().cuda_include_dir)


@lru_cache(maxsize=4)
def _search_include_dir(forced: Path | None) -> str:
    searched = _candidate_include_dirs(forced)
    for directory in searched:
        if all((directory / header).is_file() for header in REQUIRED_HEADERS):
            return str(directory)
    listing = "\n  ".join(str(d) for d in searched) or "(no candidates)"
    raise CudaHeadersNotFound(
        f"CUDA headers {', '.join(REQUIRED_HEADERS)} not found. Searched:\n  {listing}\n"
        "Install the CUDA toolkit (or the 'nvidia-cuda-runtime' / 'cuda-toolkit' wheels for your "
        "CUDA version) and set CUDA_PATH, or point KNNCONV_CUDA_INCLUDE at the include directory."
    )


def transpose_name(source: torch.dtype, target: torch.dtype, pairs: bool = False) -> str:
    """transpose_pad, or with ``pairs`` transpose_pairs (two-element accesses)."""
    kernel = "transpose_pairs" if pairs else "transpose_pad"
    return f"knnconv::{kernel}<{SCALAR_TYPES[source]}, {SCALAR_TYPES[target]}>"


_modules: dict[tuple[str, int], CompiledKernel] = {}
_lock = threading.Lock()


class CompiledKernel:
    """One kernel loaded on one device: its CUfunction handle, and what owns its module."""

    def __init__(self, ptr: int, device_index: int, owner) -> None:
        self.ptr, self.device_index, self.owner = ptr, device_index, owner
        self.dynamic_shared_limit = 48 * 1024
        self._launch_kernel = import_cupy().cuda.driver.launchKernel

    def launch(self, grid, block, shared: int, stream: int, parameters: int) -> None:
        """cuLaunchKernel with a prepared kernel-parameter array (see launch.launch_kernel)."""
        self._launch_kernel(self.ptr, *grid, *block, shared, stream, parameters, 0)

    def allow_shared_memory(self, size: int) -> None:
        """Raise the kernel's dynamic shared-memory limit (needed past 48 KiB), once."""
        if size > self.dynamic_shared_limit:
            cupy = import_cupy()
            with cupy.cuda.Device(self.device_index):
                cupy.cuda.driver.funcSetAttribute(self.ptr, _MAX_DYNAMIC_SHARED_ATTRIBUTE, size)
            self.dynamic_shared_limit = size


@cache
def kernel_code(source: Path) -> str:
    """A kernel source headed by a digest of every kernel file:
    CuPy's on-disk cache keys on the code string, and the headers it includes would otherwise
    not take part."""
    digest = hashlib.sha256()
    for path in sorted(KERNEL_DIR.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return f"// kernel files {digest.hexdigest()}\n" + source.read_text()


def neighbourhood_name(kernel: str, dtype: torch.dtype, grad_dtype: torch.dtype | None = None,
                       mode: int | None = None, vector: int | None = None,
                       batch: int | None = None) -> str:
    """The NVRTC name expression of a pooling / depthwise kernel (knn_neighbourhood.cu).
    ``vector``: the channels a channels-last pooling kernel moves per load; ``batch``: the
    batch elements each of its threads serves."""
    arguments = [SCALAR_TYPES[dtype]]
    if grad_dtype is not None:
        arguments.append(SCALAR_TYPES[grad_dtype])
    if mode is not None:
        arguments.append(str(mode))
    if vector is not None:
        arguments.append(str(vector))
    if batch is not None:
        arguments.append(str(batch))
    return f"knnconv::{kernel}<{', '.join(arguments)}>"


def nvrtc_options() -> tuple[str, ...]:
    """What NVRTC compiles the kernels with (CuPy adds the target architecture)."""
    return ("--std=c++17", f"-I{KERNEL_DIR}", f"-I{cuda_include_dir()}")


def kernel_target(family: str) -> dict:
    """get_kernel's source and target architecture for a kernel family (KERNEL_SOURCES; the
    re-layouts are family "transpose", the pooling and depthwise kernels "neighbourhood")."""
    source, architecture = KERNEL_SOURCES[family]
    return {"source": source, "architecture": architecture}


def _compile_for(architecture: str, source: Path, name: str) -> tuple[bytes, str]:
    """(cubin, lowered name) of one name expression of ``source``, by NVRTC for a named
    target such as sm_90a, which CuPy's RawModule (it picks the device's plain sm_XY) cannot
    ask for."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(kernel_code(source), source.name, [], [])
    try:
        nvrtc.addNameExpression(program, name)
        options = [*nvrtc_options(), f"--gpu-architecture={architecture}"]
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC could not compile {name} for {architecture}:\n"
                               f"{nvrtc.getProgramLog(program)}") from exc
        return nvrtc.getCUBIN(program), nvrtc.getLoweredName(program, name)
    finally:
        nvrtc.destroyProgram(program)


def get_kernel(name: str, device_index: int, *, source: Path,
               architecture: str | None = None) -> CompiledKernel:
    """The compiled kernel named by an NVRTC name expression, on one device, built once:
    from ``source`` (see kernel_target) for the device's architecture through CuPy's RawModule
    (cached on disk), or, given ``architecture``, for that target (see _compile_for).

    Compilation is serialised so that threads asking for the same kernel compile it once.
    """
    key = (name, device_index)
    function = _modules.get(key)
    if function is not None:
        return function
    cupy = import_cupy()
    with _lock:
        function = _modules.get(key)
        if function is None:
            with cupy.cuda.Device(device_index):
                if architecture is None:
                    module = cupy.RawModule(code=kernel_code(source), options=nvrtc_options(),
                                            name_expressions=[name])
                    function = CompiledKernel(module.get_function(name).kernel.ptr,
                                              device_index, module)
                else:
                    cubin, lowered = _compile_for(architecture, source, name)
                    module = cupy.cuda.driver.moduleLoadData(cubin)
                    function = CompiledKernel(
                        cupy.cuda.driver.moduleGetFunction(module, lowered), device_index, module)
            _modules[key] = function
    return function


def compiled_kernel_count() -> int:
    return len(_modules)


def clear_kernel_cache() -> None:
    """Drop compiled-module references (CuPy's on-disk cache is kept; layers' launch plans
    keep the kernels they resolved)."""
    with _lock:
        _modules.clear()
