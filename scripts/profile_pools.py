"""One forward and one backward of a fovi pooling layer for each batch-per-thread choice of
the channels-last pooling kernels, for Nsight Compute to profile side by side:

    ncu -k regex:knn_pool python scripts/profile_pools.py [MODEL [LAYER [BATCH [POOL_BATCHES]]]]

Defaults: alexnet layers.0.pool 512 1,4. Needs fovi and a CUDA device.
"""

from __future__ import annotations

import argparse

import torch
from bench_fovi_pools import DTYPE, pooling_layers

from knnconv import KNNPool
from knnconv.ops.cuda import neighbourhood


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="alexnet")
    parser.add_argument("layer", nargs="?", default="layers.0.pool")
    parser.add_argument("batch", nargs="?", type=int, default=512)
    parser.add_argument("pool_batches", nargs="?", default="1,4")
    args = parser.parse_args()
    device = torch.device("cuda")
    layer = next(found for found in pooling_layers(args.model, device)
                 if found["layer"] == args.layer)
    pool = KNNPool(layer["table"], nin=layer["nin"], mode=layer["mode"]).to(device)
    x = torch.randn(args.batch, layer["nin"], layer["channels"], device=device, dtype=DTYPE)
    x = x.transpose(1, 2).requires_grad_()
    for pool_batch in (int(b) for b in args.pool_batches.split(",")):
        neighbourhood.POOL_BATCH = pool_batch
        y = pool(x)
        y.backward(torch.randn_like(y))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
