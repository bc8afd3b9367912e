"""Where the host time of one training step of an accelerated fovi model goes: cProfile
over a few steps at a small batch (GPU-light, so the step is host-bound), the top functions
by own and by cumulative time, and the step's wall time on every path of the fovi-model
bench (fovi's own, accelerated, accelerated under torch.compile's default mode, the grid
ResNet-18, also compiled), and torch.profiler's host-side table (CUDA runtime calls:
launches, synchronisations, allocations) of the profiled paths.

    python scripts/profile_fovi_host.py [MODEL] [BATCH] [PROFILED_PATHS]

MODEL: one of the fovi-model bench's (resnet18 by default); PROFILED_PATHS: comma-separated
paths of that bench (accelerated by default).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from knnconv.tools.fovi_models import PATHS, PathModels

STEPS = 20


def wall_ms(step) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / STEPS * 1e3


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "resnet18"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    profiled_paths = (sys.argv[3] if len(sys.argv) > 3 else "accelerated").split(",")
    for profiled in profiled_paths:
        if profiled not in PATHS:
            raise SystemExit(f"PROFILED_PATHS must be of {', '.join(PATHS)}, not {profiled!r}")
    device = torch.device("cuda")
    models = PathModels(name, 64, device)
    steps = {}
    for path in PATHS:
        steps[path] = models.eager_step(path, batch, device)
        for _ in range(3):
            steps[path]()
        print(f"{name} {path} B={batch}: {wall_ms(steps[path]):.2f} ms per eager step")
    for profiled in profiled_paths:
        print_python_profile(steps[profiled], profiled)
        print_runtime_profile(steps[profiled], profiled)
    return 0


def print_python_profile(step, path: str) -> None:
    """cProfile's top Python functions of STEPS steps, by own and by cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    print(f"cProfile: {path}")
    stats.print_stats(35)
    stats.sort_stats("cumulative").print_stats(45)
    print(text.getvalue())


def print_runtime_profile(step, path: str) -> None:
    """torch.profiler's ops and CUDA runtime calls of STEPS steps by host time: a
    synchronisation or an allocation on the hot path shows here, not in cProfile."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    print(f"torch.profiler ({STEPS} steps): {path}")
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


if __name__ == "__main__":
    raise SystemExit(main())
