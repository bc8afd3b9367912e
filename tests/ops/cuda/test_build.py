"""Compile every kernel instantiation the default tile rules can pick, with nvcc for several
architectures and with NVRTC (the compiler CuPy runs on the GPU machine) for the ones we run on,
no GPU needed, and hold the resource report to: no spills, no stack frame."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from knnconv.ops.cuda.build import (
    KERNEL_DIR,
    KERNEL_SOURCES,
    kernel_code,
    kernel_target,
    neighbourhood_name,
    nvrtc_options,
    transpose_name,
)
from knnconv.ops.cuda.configs import (
    ARCHITECTURE_FAMILIES,
    CHANNELS_LAST_FAMILIES,
    FAMILIES,
    KernelConfig,
    check_config,
    tile_rules,
)
from knnconv.ops.cuda.launch_plan import kernel_name
from knnconv.ops.cuda.neighbourhood import POOL_BATCHES, POOL_MODE_CODES, channel_vectors

ARCHITECTURES = ("sm_80", "sm_90", "sm_120")
NVCC = shutil.which("nvcc")


def default_instantiations() -> dict[Path, list[str]]:
    """Every kernel the default tile rules can pick, every re-layout and every pooling and
    depthwise kernel, by the source file each is built from (build.KERNEL_SOURCES)."""
    by_family: dict[str, set[str]] = {}
    for family in FAMILIES:
        names = by_family.setdefault(family, set())
        for rule in tile_rules()[family]:
            cfg = check_config(family, KernelConfig(*rule["config"]))
            for dtype in (torch.float16, torch.bfloat16):
                names.add(kernel_name(family, dtype, cfg))
                if family == "grad_input":  # dx staged in its own dtype
                    names.add(kernel_name(family, dtype, cfg, dtype))
                if family == "grad_weight":  # reading channels-last grad_y in place
                    names.add(kernel_name(family, dtype, cfg, grad_in_place=True))
    for family in CHANNELS_LAST_FAMILIES:
        names = by_family.setdefault(family, set())
        for rule in tile_rules()[family]:
            cfg = check_config(family, KernelConfig(*rule["config"]))
            for dtype in (torch.float16, torch.bfloat16):
                names.add(kernel_name(family, dtype, cfg))
                if family == "gather_cl":  # dx of a float32 x, stored as float32
                    names.add(kernel_name(family, dtype, cfg, torch.float32))
    floats = (torch.float32, torch.float16, torch.bfloat16)
    by_family["transpose"] = {transpose_name(source, target, pairs) for source in floats
                              for target in floats for pairs in (False, True)}
    names = by_family["neighbourhood"] = set()
    for dtype in floats:  # the pooling / depthwise kernels, in every dtype they serve
        names.update(neighbourhood_name("knn_pool_forward", dtype, mode=mode)
                     for mode in POOL_MODE_CODES.values())
        # the backward of max_relu is max's
        backward_modes = [POOL_MODE_CODES[mode] for mode in POOL_MODE_CODES if mode != "max_relu"]
        names.update(neighbourhood_name("knn_pool_backward", dtype, mode=mode)
                     for mode in backward_modes)
        names.update(neighbourhood_name(f"knn_pool_{direction}_channels_last", dtype, mode=mode,
                                        vector=vector, batch=batch)
                     for direction, modes in (("forward", POOL_MODE_CODES.values()),
                                              ("backward", backward_modes))
                     for batch in POOL_BATCHES for mode in modes
                     for vector in channel_vectors(dtype))
        names.add(neighbourhood_name("knn_depthwise_forward", dtype))
        names.add(neighbourhood_name("knn_depthwise_grad_weight", dtype))
        names.update(neighbourhood_name("knn_depthwise_grad_input", dtype, grad)
                     for grad in floats)
    by_source: dict[Path, set[str]] = {}
    for family, names in by_family.items():
        source, architecture = KERNEL_SOURCES[family]
        assert architecture is None
        by_source.setdefault(source, set()).update(names)
    return {source: sorted(names) for source, names in by_source.items()}


def every_default_instantiation() -> list[str]:
    return [name for names in default_instantiations().values() for name in names]


def architecture_instantiations(family: str) -> list[str]:
    """Every kernel the default rules of an architecture-specific family can pick (the dx
    instantiation stores float32 too)."""
    names = set()
    for rule in tile_rules()[family]:
        cfg = check_config(family, KernelConfig(*rule["config"]))
        for dtype in (torch.float16, torch.bfloat16):
            names.update(kernel_name(family, dtype, cfg, out)
                         for out in (None, torch.float32))
    return sorted(names)


def _compile(names: list[str], arch: str, tmp_path, *flags: str,
             source: Path) -> subprocess.CompletedProcess:
    """nvcc over a unit that takes each kernel's address, which instantiates exactly the NVRTC
    name expressions; the output lands in tmp_path / "<source stem>.out"."""
    unit = tmp_path / f"instantiate_{source.stem}.cu"
    unit.write_text(
        f'#include "{source.name}"\n'
        + "void* knnconv_kernels[] = {\n"
        + "".join(f"    reinterpret_cast<void*>(&{name}),\n" for name in names)
        + "};\n"
    )
    return subprocess.run(
        [NVCC, "-std=c++17", f"-I{KERNEL_DIR}", f"-arch={arch}", *flags,
         "-o", str(tmp_path / f"{source.stem}.out"), str(unit)],
        capture_output=True, text=True, timeout=600,
    )


def test_every_tile_rule_is_a_valid_config():
    # default_instantiations raises on an invalid rule; every family must have rules, and
    # each distinct (family, config) gives one kernel per dtype (grad_input two: dx staged in
    # float32 or in the compute dtype; grad_weight two: grad_y re-laid out or read in place).
    rules = tile_rules()
    assert all(rules[family] for family in FAMILIES)
    configs = {(family, tuple(rule["config"])) for family in FAMILIES for rule in rules[family]}
    per_dtype = sum(2 if family in ("grad_input", "grad_weight") else 1
                    for family, _ in configs)
    channels_last = {(family, tuple(rule["config"])) for family in CHANNELS_LAST_FAMILIES
                     for rule in rules[family]}
    per_dtype += sum(2 if family == "gather_cl" else 1 for family, _ in channels_last)
    gemms = [name for name in every_default_instantiation()
             if "knn_forward" in name or "knn_grad_" in name or "knn_gather_cl" in name]
    assert len(gemms) == 2 * per_dtype


def load_nvrtc():
    """libnvrtc of the nvidia-cuda-nvrtc 13 wheel (a dev dependency), or None."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "cu13" / "lib"
        builtins = sorted(lib.glob("libnvrtc-builtins.so.13.*"))
        if (lib / "libnvrtc.so.13").is_file() and builtins:
            ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)  # NVRTC dlopens it by name
            return ctypes.CDLL(str(lib / "libnvrtc.so.13"))
    return None


def _nvrtc_report(nvrtc, names: list[str], arch: str, source: Path) -> tuple[int, str]:
    """Compile ``names`` as CuPy does (one program, name expressions, nvrtc_options) with
    ptxas' resource report; (NVRTC status, log)."""
    program = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), kernel_code(source).encode(),
                                    source.name.encode(), 0, None, None) == 0
    for name in names:
        assert nvrtc.nvrtcAddNameExpression(program, name.encode()) == 0
    options = [*(o.encode() for o in nvrtc_options()), f"-arch={arch}".encode(),
               b"--ptxas-options=-v"]
    status = nvrtc.nvrtcCompileProgram(program, len(options),
                                       (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace")


def assert_no_spills(report: str, names: list[str], where: str) -> None:
    compiled = re.findall(r"Compiling entry function '(\w+)'", report)
    assert len(compiled) == len(names), report
    frames = re.findall(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report
    )
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert len(frames) == len(names) and len(registers) == len(names)
    spilling = [(fn, f) for fn, f in zip(compiled, frames, strict=True) if any(map(int, f))]
    assert not spilling, f"{where}: kernels with stack frame or spills: {spilling}"
    assert max(registers) <= 255
    print(f"{where}: {len(names)} kernels, registers {min(registers)}-{max(registers)}, no spills")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_default_instantiations_compile_without_spills(arch, tmp_path):
    sources = default_instantiations()
    # one nvcc per source, as many at once as there are CPUs (each is a process of its own)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = pool.map(lambda source: _compile(sources[source], arch, tmp_path, "-cubin",
                                                   "--resource-usage", source=source), sources)
        for (source, names), result in zip(sources.items(), results, strict=True):
            assert result.returncode == 0, result.stderr
            assert_no_spills(result.stdout + result.stderr, names, f"nvcc {arch} {source.name}")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_default_instantiations_compile_without_spills_under_nvrtc(arch):
    # NVRTC 13.0 gave transpose_pairs a stack frame that nvcc 13.0 did not (ncu on the H200
    # counted its local-memory traffic), so the runtime compiler is held to the same report.
    nvrtc = load_nvrtc()
    if nvrtc is None:
        pytest.skip("the nvidia-cuda-nvrtc 13 wheel is not installed (pip install -e '.[dev]')")
    for source, names in default_instantiations().items():
        status, report = _nvrtc_report(nvrtc, names, arch, source)
        assert status == 0, report
        assert_no_spills(report, names, f"NVRTC {arch} {source.name}")


# ptxas' notes that it serialised warpgroup MMAs or waited for them where the source does not
# (C7510-C7520): each costs the overlap of products with the next tile's staging
SERIALISED_MMA = re.compile(r"\(C75\d\d\)[^\n]*")


@pytest.mark.parametrize("family", sorted(ARCHITECTURE_FAMILIES))
def test_architecture_kernels_compile_for_their_target_without_spills_or_serialisation(
        family, tmp_path):
    target = kernel_target(family)
    source, target = target["source"], target["architecture"]
    major, minor = ARCHITECTURE_FAMILIES[family]
    assert target == f"sm_{major}{minor}a"
    names = architecture_instantiations(family)
    reports = []
    if NVCC is not None:
        result = _compile(names, target, tmp_path, "-cubin", "--resource-usage", source=source)
        assert result.returncode == 0, result.stderr
        reports.append(("nvcc", result.stdout + result.stderr))
    nvrtc = load_nvrtc()
    if nvrtc is not None:
        status, report = _nvrtc_report(nvrtc, names, target, source)
        assert status == 0, report
        reports.append(("NVRTC", report))
    if not reports:
        pytest.skip("neither nvcc nor the nvidia-cuda-nvrtc 13 wheel is available")
    for compiler, report in reports:
        assert_no_spills(report, names, f"{compiler} {target}")
        assert not SERIALISED_MMA.findall(report), SERIALISED_MMA.findall(report)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
def test_every_fragment_load_reads_shared_memory_in_both_dtypes(tmp_path):
    # Fragments are always staged in shared memory; a wmma.load without the .shared state
    # space is a generic load ptxas cannot turn into ldmatrix (bf16 ran 1.22-1.31x slower).
    sources = [kernel_target(family)["source"] for family in ("forward", "gather_cl")]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # the two GEMM sources
        results = list(pool.map(lambda source: _compile(
            default_instantiations()[source], "sm_90", tmp_path, "-ptx", source=source), sources))
    loads = []
    for source, result in zip(sources, results, strict=True):
        assert result.returncode == 0, result.stderr
        loads += re.findall(r"wmma\.load\.[ab]\.[\w.]+",
                            (tmp_path / f"{source.stem}.out").read_text())
    assert {load.rsplit(".", 1)[1] for load in loads} == {"f16", "bf16"}
    generic = sorted({load for load in loads if ".shared." not in load})
    assert not generic, f"fragment loads from generic addresses: {generic}"


@pytest.mark.parametrize("nvrtc,driver,refused", [((13, 0), 13000, False), ((12, 8), 13000, False),
                                                  ((13, 1), 13000, True)])
def test_nvrtc_newer_than_the_driver_is_refused(nvrtc, driver, refused):
    from types import SimpleNamespace

    from knnconv.ops.cuda.build import nvrtc_mismatch

    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(
        nvrtc=SimpleNamespace(getVersion=lambda: nvrtc),
        runtime=SimpleNamespace(driverGetVersion=lambda: driver)))
    reason = nvrtc_mismatch(fake_cupy)
    assert (reason is not None) == refused
    if refused:
        assert "13.1" in reason and "13.0" in reason


def test_host_constants_match_the_kernel_headers():
    from knnconv.ops.cuda import configs, launch

    header = (KERNEL_DIR / "knn_common.cuh").read_text()
    values = {name: int(value) for name, value in
              re.findall(r"constexpr int (k\w+) = (\d+);", header)}
    assert values["kPad"] == configs.SHARED_PAD
    assert values["kLogTransposeElements"] == launch.LOG_TRANSPOSE_ELEMENTS
    assert values["kTransposeThreads"] == launch.TRANSPOSE_THREADS
    assert values["kPairsTile"] == launch.PAIRS_TILE


def test_every_kernel_takes_no_more_arguments_than_a_launch_holds():
    # a launch writes its arguments into MAX_KERNEL_ARGS parameter slots: a kernel with more
    # would fail on its first launch, which only a GPU run would show
    from knnconv.ops.cuda.launch import MAX_KERNEL_ARGS

    source = "\n".join(path.read_text() for path in KERNEL_DIR.glob("*.c*"))
    signatures = re.findall(r"__global__[^{;]*?\b(\w+)\s*\(([^)]*)\)\s*\{", source)
    assert len(signatures) >= 8
    for name, parameters in signatures:
        count = len([p for p in parameters.split(",") if p.strip()])
        assert count <= MAX_KERNEL_ARGS, (name, count)
