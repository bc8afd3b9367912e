"""Fuzz a backend (by default the native cuda one) against the float64 reference backend.

    python3 scripts/fuzz_gpu.py                          # 2000 cases per float16 / bfloat16
    python3 scripts/fuzz_gpu.py --device cpu --backend torch_compact --cases 50   # no GPU

Cases come from the property tests' hypothesis strategy (tests/strategies.py); each runs the
forward and backward through knn_conv and is compared with the reference on the same device.
Prints ``fuzz: N cases, M outside tolerance``, writes the failing cases to --out (each a
LayerCase's fields plus its errors or exception; ``LayerCase(**failure["case"])`` replays one,
e.g. as an ``@example`` in tests/test_properties.py) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as fixed_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from strategies import dtype_name, layer_cases, outside_tolerance  # noqa: E402


def fuzz(dtype: torch.dtype, cases: int, backend: str, device: str,
         seed: int) -> tuple[int, list[dict]]:
    """Run ``cases`` random cases in ``dtype``; return how many ran and the failures."""
    ran, failures = 0, []

    # Generation only: a failure is recorded, not raised, so hypothesis neither stops nor
    # shrinks and every case runs.
    @fixed_seed(seed)
    @settings(max_examples=cases, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(layer=layer_cases([dtype]))
    def run(layer):
        nonlocal ran
        ran += 1
        try:
            errors = outside_tolerance(layer, backend, device)
        except Exception as exc:  # a crashing case is a failure of that case, not of the run
            errors = {"exception": f"{type(exc).__name__}: {exc}"}
        if errors:
            failures.append({"case": layer.to_json(), "errors": errors})

    run()
    return ran, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="cases per dtype")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed")
    parser.add_argument("--out", type=Path, default=Path("fuzz_failures.json"))
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device (use --device cpu --backend torch_compact for a CPU run)")
    seed = random.randrange(2**32) if args.seed is None else args.seed
    total, failures = 0, []
    for name in args.dtypes:
        ran, failed = fuzz(getattr(torch, name), args.cases, args.backend, args.device, seed)
        print(f"fuzz {args.backend} {dtype_name(getattr(torch, name))}: {ran} cases, "
              f"{len(failed)} outside tolerance")
        total += ran
        failures += failed
    args.out.write_text(json.dumps({"seed": seed, "backend": args.backend,
                                    "device": args.device, "failures": failures}, indent=1))
    print(f"fuzz: {total} cases, {len(failures)} outside tolerance (seed {seed}, "
          f"failures in {args.out})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
