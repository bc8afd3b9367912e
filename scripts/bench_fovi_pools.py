"""Every KNN pooling layer of fovi's published models against the copy-bandwidth floor: the
forward and the backward of knnconv's KNNPool, each timed alone (CUDA events, median), over
the bytes the pool must move (forward: x read, y written; backward: grad_y read, dx written)
at the device-copy bandwidth measured in the same run.

    python scripts/bench_fovi_pools.py OUT.json [MODELS] [BATCHES]

MODELS: comma-separated names of the fovi-model bench (default resnet18,alexnet); BATCHES
(default 512,2048). x is fp16 in channels-last storage, as knnconv's layers pass it. Needs
fovi and, for timings, a CUDA device (on a CPU it lists the layers and times nothing).
"""

from __future__ import annotations

import json
import sys

import torch

from knnconv import KNNPool
from knnconv.tools.bench import measure_ceilings, time_calls
from knnconv.tools.fovi_models import build_fovi, sensor_samples

DTYPE = torch.float16
WARMUP, REPEATS = 3, 30


def pooling_layers(name: str, device: torch.device) -> list[dict]:
    """The model's max and avg KNN pooling layers: name, table, mode, Nin, Nout and the
    channels each pools (read off one forward of fovi's model)."""
    from fovi.arch.knn import KNNPoolingLayer

    model = build_fovi(name, 64, device).eval()
    layers, channels = [], {}

    def record_channels(path: str):
        def hook(module, inputs, output) -> None:  # None: the output stays the layer's
            channels[path] = inputs[0].shape[1]
        return hook

    for path, module in model.named_modules():
        if isinstance(module, KNNPoolingLayer) and module.mode in ("max", "avg"):
            layers.append((path, module))
            module.register_forward_hook(record_channels(path))
    with torch.no_grad():
        model(torch.randn(2, 3, sensor_samples(model), device=device))
    found = []
    for path, module in layers:
        table = module.knn_indices_pad_token.detach().cpu()
        found.append({"model": name, "layer": path, "mode": module.mode, "table": table,
                      "nin": int(module.knn_pad_token_val), "nout": table.shape[1],
                      "k": table.shape[0], "channels": channels[path]})
    return found


def time_pool(layer: dict, batch: int, device: torch.device) -> tuple[float, float]:
    """Median ms of the forward (no grad) and of the backward alone."""
    pool = KNNPool(layer["table"], nin=layer["nin"], mode=layer["mode"]).to(device)
    x = torch.randn(batch, layer["nin"], layer["channels"], device=device, dtype=DTYPE)
    x = x.transpose(1, 2).requires_grad_()  # channels-last storage
    with torch.no_grad():
        forward_ms = time_calls(lambda: pool(x), device, warmup=WARMUP, repeats=REPEATS)[0]
    y = pool(x)
    grad_y = torch.randn_like(y)
    backward_ms = time_calls(
        lambda: torch.autograd.grad(y, x, grad_y, retain_graph=True), device, warmup=WARMUP,
        repeats=REPEATS)[0]
    return forward_ms, backward_ms


def main() -> int:
    out = sys.argv[1]
    models = (sys.argv[2] if len(sys.argv) > 2 else "resnet18,alexnet").split(",")
    batches = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "512,2048").split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ceilings = measure_ceilings(device)
    copy_gbps = ceilings["copy_gbps"]
    rows = []
    for name in models:
        for layer in pooling_layers(name, device):
            for batch in batches:
                row = {key: layer[key] for key in
                       ("model", "layer", "mode", "nin", "nout", "k", "channels")}
                row["batch"] = batch
                elements = batch * layer["channels"]
                moved = elements * (layer["nin"] + layer["nout"]) * DTYPE.itemsize
                row["floor_ms"] = moved / copy_gbps / 1e6 if copy_gbps else None
                if device.type == "cuda":
                    row["forward_ms"], row["backward_ms"] = time_pool(layer, batch, device)
                    for direction in ("forward", "backward"):
                        row[f"{direction}_pct_of_floor"] = (
                            100 * row["floor_ms"] / row[f"{direction}_ms"])
                rows.append(row)
                timed = (f"forward {row['forward_ms']:.3f} ms "
                         f"({row['forward_pct_of_floor']:.0f}%), backward "
                         f"{row['backward_ms']:.3f} ms ({row['backward_pct_of_floor']:.0f}%)"
                         if "forward_ms" in row else "not timed (no CUDA device)")
                print(f"{name} {layer['layer']} {layer['mode']} C={layer['channels']} "
                      f"{layer['nin']}->{layer['nout']} B={batch}: {timed}", flush=True)
    with open(out, "w") as handle:
        json.dump({"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                   else "cpu", "ceilings": ceilings, "rows": rows}, handle, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
