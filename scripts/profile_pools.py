"""One forward and one backward of a fovi pooling layer for each batch-per-thread choice of
the channels-last pooling kernels, for Nsight Compute to profile side by side:

    ncu -k regex:knn_pool python scripts/profile_pools.py [MODEL] [LAYER] [BATCH] [POOL_BATCHES]

Defaults: alexnet layers.0.pool 512 1,4. Needs fovi and a CUDA device.
"""

from __future__ import annotations

import sys

import torch
from bench_fovi_pools import DTYPE, pooling_layers

from knnconv import KNNPool
from knnconv.ops.cuda import neighbourhood


def main() -> int:
    model, name, batch, pool_batches = (sys.argv[1:] + ["alexnet", "layers.0.pool", "512",
                                                        "1,4"][len(sys.argv) - 1:])[:4]
    device = torch.device("cuda")
    layer = next(found for found in pooling_layers(model, device) if found["layer"] == name)
    pool = KNNPool(layer["table"], nin=layer["nin"], mode=layer["mode"]).to(device)
    x = torch.randn(int(batch), layer["nin"], layer["channels"], device=device, dtype=DTYPE)
    x = x.transpose(1, 2).requires_grad_()
    for pool_batch in (int(b) for b in pool_batches.split(",")):
        neighbourhood.POOL_BATCH = pool_batch
        y = pool(x)
        y.backward(torch.randn_like(y))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
