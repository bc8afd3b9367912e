"""Probe Hopper's warpgroup MMA (wgmma) on shared-memory operands before building kernels on
it: which descriptor field takes the byte offset between core matrices adjacent along K
(the leading one, as the PTX ISA describes K-major operands, or the stride one), for operands
staged K-major and, with the transpose flag, M-major (batch-contiguous rows, as the image
layer's re-laid-out x has them); and whether the accumulator layout a store assumes holds.
Compiles scripts/probe_wgmma.cu with nvcc for sm_90a, runs one warpgroup on random fp16
operands per layout, convention and K, and compares with torch's float32 product.

    python3 scripts/probe_wgmma.py [--out FILE.json]

Exits 0 when exactly one K-major convention is right for every K, and at least one M-major
layout is. Needs an sm_90 GPU, nvcc and CuPy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("probe_wgmma.cu")
# K-major: core matrices adjacent along K back to back, 8-row groups two of them apart
K_CORE_BYTES, ROW_CORE_BYTES = 128, 256
FIELDS = {0: "leading", 1: "stride"}  # which descriptor field takes the K offset
# M-major A: (offset along K, offset along M) of its core matrices; the first keeps a 16-deep
# step's two K halves of each 8-row group together, the second lays each K half's eight
# 8-row groups back to back
M_MAJOR_LAYOUTS = ((128, 256), (1024, 128))
KS = (16, 64, 128)
TOLERANCE = 1e-3


def build(directory: Path):
    import cupy

    cubin = directory / "probe_wgmma.cubin"
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "-cubin", "-o", str(cubin),
                    str(SOURCE)], check=True)
    return cupy.RawModule(path=str(cubin)).get_function("probe_wgmma")


def run(kernel, k: int, generator: torch.Generator, field: int, a_layout=None,
        a_field: int = 0) -> float:
    """max |C - A B^T| / max |A B^T| for B (and A unless a_layout) K-major with the K offset
    in descriptor field ``field``; A M-major with offsets ``a_layout`` and field ``a_field``."""
    import cupy
    import numpy as np

    a = torch.randn(64, k, generator=generator).half().cuda()
    b = torch.randn(64, k, generator=generator).half().cuda()
    c = torch.full((64, 64), float("nan"), device="cuda")
    a_k_bytes, a_row_bytes = a_layout or (K_CORE_BYTES, ROW_CORE_BYTES)
    ints = (k, K_CORE_BYTES, ROW_CORE_BYTES, field, int(a_layout is not None), a_k_bytes,
            a_row_bytes, a_field)
    kernel((1,), (128,), (cupy.asarray(a), cupy.asarray(b), cupy.asarray(c),
                          *(np.int32(value) for value in ints)))
    torch.cuda.synchronize()
    expected = a.float() @ b.float().t()
    return float((c - expected).abs().max() / expected.abs().max())


def right(errors: dict) -> bool:
    return all(error <= TOLERANCE for error in errors.values())  # False for a NaN


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the errors as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("needs an sm_90 GPU")
        return 2
    generator = torch.Generator().manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as directory:
        kernel = build(Path(directory))
        for field, name in FIELDS.items():
            errors = {k: run(kernel, k, generator, field) for k in KS}
            results.append({"a": "K-major", "k_offset_field": name, "errors": errors})
        k_major = [r["k_offset_field"] for r in results if right(r["errors"])]
        field = next((f for f, name in FIELDS.items() if [name] == k_major), 0)
        for layout in M_MAJOR_LAYOUTS:
            for a_field, name in FIELDS.items():
                errors = {k: run(kernel, k, generator, field, layout, a_field) for k in KS}
                results.append({"a": f"M-major, core offsets K {layout[0]} B, M {layout[1]} B",
                                "k_offset_field": name, "errors": errors})
    for result in results:
        cells = ", ".join(f"K={k}: {error:.2e}" for k, error in result["errors"].items())
        mark = "  <- right" if right(result["errors"]) else ""
        print(f"A {result['a']:36} K offset in the {result['k_offset_field']:8} field: "
              f"{cells}{mark}")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "results": results}, indent=1))
    m_major = [r for r in results if r["a"] != "K-major" and right(r["errors"])]
    return 0 if len(k_major) == 1 and m_major else 1


if __name__ == "__main__":
    sys.exit(main())
