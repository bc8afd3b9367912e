"""The shipped examples run: DDP over two CPU processes (gloo) follows one process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on the PATH")
def test_two_process_ddp_follows_the_single_process_trajectory(tmp_path):
    def losses(command, name):
        out = tmp_path / f"{name}.json"
        subprocess.run([*command, str(EXAMPLE), "--device", "cpu", "--steps", "12",
                        "--out", str(out)], check=True, timeout=300, capture_output=True)
        return json.loads(out.read_text())

    single = losses([sys.executable], "single")
    ddp = losses(["torchrun", "--standalone", "--nproc_per_node=2"], "ddp")
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    assert single["losses"][-1] < single["losses"][0]
    for a, b in zip(single["losses"], ddp["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a)
