"""Run the channels-last gather of one layer once per given kernel, for Nsight Compute (GPU).

    ncu -k regex:knn_gather python scripts/profile_gather.py GEOMETRY_DIR LAYER_SUBSTR BATCH \
        FAMILY:bn,bk,rb,wm,wn,ksteps [...]

Each FAMILY:CONFIG (e.g. gather_cl:128,32,2,2,4,4 or gather_cl_wgmma:128,64,2,8,1,4) runs the
layer's forward twice (a warm-up, then the launch to profile), one walk of one node a CTA, on
random fp16 channels-last operands.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from knnconv.ops.cuda import channels_last
from knnconv.ops.cuda.configs import KernelConfig
from knnconv.tools.bench import load_geometry_dir


def main(argv: list[str]) -> None:
    layer = next(layer for layer in load_geometry_dir(Path(argv[0])) if argv[1] in layer.name)
    batch = int(argv[2])
    plan = layer.plan()
    device = torch.device("cuda")
    tables = plan.on(device)
    entries = channels_last.entry_tables(tables.knn_indices, tables.rf_index, plan.nin)
    x = torch.randn(batch, plan.nin, plan.cin, device=device, dtype=torch.float16)
    x = x.transpose(1, 2)  # channels-last storage
    weight = torch.randn(plan.cout, plan.q, device=device, dtype=torch.float16)
    for spec in argv[3:]:
        family, values = spec.split(":")
        numbers = [int(v) for v in values.split(",")]
        cfg = KernelConfig(*numbers, True, 8)
        launch = channels_last.ChannelsLastForward(
            batch=batch, cin=plan.cin, nin=plan.nin, cout=plan.cout, nout=plan.nout, v=plan.v,
            entries=plan.entry_count, dtype=torch.float16, device=device, config=cfg,
            family=family, nodes_per_cta=1)
        for _ in range(2):
            launch.run(x, weight, None, entries)
        torch.cuda.synchronize()
        print(f"{layer.name} B={batch} {family} {tuple(cfg)}")


if __name__ == "__main__":
    main(sys.argv[1:])
