"""What is alive at the peak of one training step of a fovi model: torch's allocator history
over one step (after warm-up), replayed to the moment the most memory was allocated, and the
allocations alive then grouped by the line of the model, knnconv or fovi code that made them.

    python scripts/profile_fovi_memory.py [MODEL] [BATCH] [IN_RES] [PATHS]

MODEL: one of the fovi-model bench's (resnet18 by default); BATCH (512); IN_RES: the
sensor's in_res (64, the published setting); PATHS: comma-separated paths of that bench
(fovi,accelerated by default). Needs a CUDA device.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from knnconv.tools.fovi_models import PATHS, PathModels, training_step

MIB = 2**20
WARMUP_STEPS = 2
TOP = 20
# the first frame (innermost first) from these files names an allocation's origin
OWN_CODE = ("/knnconv/", "/fovi/", "/torch/nn/", "/torch/autograd/", "/torch/amp/",
            "/torch/optim/")


def origin(frames: list[dict]) -> str:
    """The innermost frame in model, knnconv, fovi or torch.nn code, as file:line (name)."""
    for frame in frames:
        filename = frame.get("filename", "")
        if any(part in filename for part in OWN_CODE):
            short = filename.split("/site-packages/")[-1].split("/src/")[-1]
            return f"{short}:{frame.get('line')} ({frame.get('name')})"
    return "(no Python frame of the model's code)"


def peak_allocations(trace: list[dict]) -> tuple[int, dict[int, tuple[int, str]]]:
    """Replays an allocator trace: the most bytes allocated by the step at once, and the
    allocations alive at that moment (address -> (bytes, origin))."""
    alive: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action = event["action"]
        if action == "alloc":
            alive[event["addr"]] = (event["size"], origin(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(alive)
        elif action in ("free_requested", "free_completed") and event["addr"] in alive:
            total -= alive.pop(event["addr"])[0]
    return peak, at_peak


def profile(models: PathModels, path: str, batch: int, device: torch.device) -> None:
    module, forward = models.network(path)
    x, labels = models.inputs(path, batch, device)
    step = training_step(module, forward, x, labels, device, graph=False)
    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    peak, alive = peak_allocations(snapshot["device_traces"][index])
    by_origin: dict[str, list[int]] = defaultdict(list)
    for size, where in alive.values():
        by_origin[where].append(size)
    print(f"\n{path} B={batch}: max_memory_allocated {torch.cuda.max_memory_allocated() / MIB:.1f}"
          f" MiB; before the step {before / MIB:.1f} MiB (parameters, gradients, optimizer "
          f"state, inputs); the step's own at its peak {peak / MIB:.1f} MiB, of which:")
    ranked = sorted(by_origin.items(), key=lambda item: -sum(item[1]))
    for where, sizes in ranked[:TOP]:
        print(f"  {sum(sizes) / MIB:9.1f} MiB  {len(sizes):4d} blocks  {where}")
    rest = sum(sum(sizes) for _, sizes in ranked[TOP:])
    print(f"  {rest / MIB:9.1f} MiB  in {max(0, len(ranked) - TOP)} other places")


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "resnet18"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    in_res = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    paths = (sys.argv[4] if len(sys.argv) > 4 else "fovi,accelerated").split(",")
    for path in paths:
        if path not in PATHS:
            raise SystemExit(f"PATHS must be of {', '.join(PATHS)}, not {path!r}")
    if not torch.cuda.is_available():
        raise SystemExit("profile_fovi_memory.py needs a CUDA device")
    device = torch.device("cuda")
    models = PathModels(name, in_res, device)
    for path in paths:
        profile(models, path, batch, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
