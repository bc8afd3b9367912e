"""Half-precision error of every backend's outputs and gradients across gradient magnitudes.

For each backend, compute dtype (float16, bfloat16) and gradient scale (|grad_y| from 1e-8 to
1e4), one KNN convolution, pooling and depthwise call runs as a user calls it (fp32 parameters
under autocast; x in the compute dtype, as a layer's input is inside a network, and in
float32, as the image entering the first layer is) and is compared with float64 arithmetic on
the same rounded operands (tests/strategies.py builds the calls). The error is
max|out - ref| / max|ref|; ``floor`` is that of the float64 result rounded to the output's
dtype, the best any implementation can return.

    python scripts/gradient_magnitudes.py [--device cuda] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from knnconv import available_backends  # noqa: E402
from strategies import (  # noqa: E402
    GRAD_SCALES,
    LayerCase,
    magnitude_outputs,
    neighbourhood_outputs,
)

LAYER = LayerCase(nin=300, nout=120, k=9, v=9, cin=16, cout=40, batch=6, padding=0.05,
                  repeats=True, bias=True, dtype="float16", seed=0)


def max_relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.detach().cpu().double(), reference.detach().cpu().double()
    scale = reference.abs().max().item()
    error = (value - reference).abs().max().item()
    return error / scale if scale > 0 else error


def errors(pairs) -> dict[str, float]:
    row = {}
    for name, (value, reference) in pairs.items():
        row[name] = max_relative(value, reference)
        row[name + "_floor"] = max_relative(reference.detach().to(value.dtype), reference)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    conv_backends = [b for b in ("reference", "torch_compact", "torch_binned", "cuda")
                     if b in available_backends() and (b != "cuda" or gpu)]
    neighbourhood_backends = ["torch_compact"] + (["cuda"] if gpu else [])
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        case = dataclasses.replace(LAYER, dtype=str(dtype)[6:])
        for scale in GRAD_SCALES:
            for backend in conv_backends:
                for x_dtype in (dtype, torch.float32):
                    pairs = magnitude_outputs(case, backend, scale, args.device, x_dtype)
                    rows.append({"op": "conv", "backend": backend, "dtype": case.dtype,
                                 "x_dtype": str(x_dtype)[6:], "scale": scale, **errors(pairs)})
            for layer in ("max", "avg", "sum", "depthwise"):
                for backend in neighbourhood_backends:
                    pairs = neighbourhood_outputs(layer, backend, dtype, scale, args.device)
                    rows.append({"op": layer, "backend": backend, "dtype": case.dtype,
                                 "x_dtype": case.dtype, "scale": scale, **errors(pairs)})
    for row in rows:
        names = [k for k in row if k.startswith(("y", "grad")) and not k.endswith("_floor")]
        cells = "  ".join(f"{k} {row[k]:.1e} (floor {row[k + '_floor']:.1e})" for k in names)
        print(f"{row['op']:9s} {row['backend']:13s} {row['dtype']:8s} x {row['x_dtype']:8s} "
              f"|g| {row['scale']:.0e}  {cells}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": args.device, "torch": torch.__version__,
                       "command": " ".join(sys.argv), "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
