"""GPU time of a convolution's bias gradient (grad_y [B, C, N] summed over the batch and the
nodes, in float32) on shapes of ResNet-18's layers at B = 2048, in both storages: torch's
one reduction ``grad_y.sum(dim=(0, 2))``, torch's two (over the nodes, then the batch) and
the triton backend's kernel (knnconv.ops.triton.launch.grad_bias), against a copy of
grad_y in the same run (the bandwidth the read could have).

    python scripts/bench_grad_bias.py OUT.json

Each figure is the median over 5 replays of 20 calls captured as one CUDA graph, divided by
20, so host launch cost does not count.
"""

from __future__ import annotations

import sys

import torch

from knnconv.ops.triton import launch
from knnconv.tools.bench import replayed_ms_per_call, write_rows

DEVICE = torch.device("cuda")
B = 2048
SHAPES = ((64, 964), (64, 230), (128, 60), (256, 16), (512, 2))  # (C, N)


def gpu_ms(call) -> float:
    return replayed_ms_per_call(call, DEVICE)


def case(channels: int, nodes: int, storage: str, processors: int) -> dict:
    """One shape and storage: each way's GPU time, the kernel's error against float64."""
    grad_y = torch.randn(B, channels, nodes, device=DEVICE, dtype=torch.float16)
    if storage == "channels_last":
        grad_y = grad_y.transpose(1, 2).contiguous().transpose(1, 2)
    tile = launch.grad_bias_tile(channels)
    want = grad_y.double().sum(dim=(0, 2))
    got = launch.grad_bias(grad_y, tile=tile, processors=processors)
    error = ((got.double() - want).abs().max() / want.abs().max()).item()
    read = grad_y.numel() * grad_y.element_size()
    row = {"channels": channels, "nodes": nodes, "storage": storage, "bytes": read,
           "max_rel_err": error,
           "copy_ms": gpu_ms(lambda: grad_y.clone(memory_format=torch.preserve_format)),
           "torch_one_ms": gpu_ms(lambda: grad_y.sum(dim=(0, 2), dtype=torch.float32)),
           "torch_two_ms": gpu_ms(lambda: grad_y.sum(dim=2, dtype=torch.float32).sum(dim=0)),
           "triton_ms": gpu_ms(lambda: launch.grad_bias(grad_y, tile=tile,
                                                        processors=processors))}
    row["read_floor_ms"] = row["copy_ms"] / 2  # a copy reads and writes: the read at its rate
    print(f"C {channels:4d} N {nodes:4d} {storage:13s} {read / 1e6:6.1f} MB  "
          + "  ".join(f"{key[:-3]} {row[key] * 1e3:7.1f} us" for key in
                      ("read_floor_ms", "torch_one_ms", "torch_two_ms", "triton_ms"))
          + f"  err {error:.1e}")
    return row


def main(out: str) -> None:
    processors = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    rows = [case(channels, nodes, storage, processors) for channels, nodes in SHAPES
            for storage in ("channels_last", "contiguous")]
    write_rows(out, rows, DEVICE, batch=B)


if __name__ == "__main__":
    main(sys.argv[1])
