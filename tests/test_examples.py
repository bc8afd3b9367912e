"""The shipped examples run: DDP over two CPU processes (gloo) follows one process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"
ARGUMENTS = ["--device", "cpu", "--steps", "12"]
TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(out: Path, world: int) -> None:
    """Starts the example's ranks with the environment torchrun would give them.

    Launching the ranks directly keeps the launcher's own agent out of the test, and a rank that
    hangs is aborted with faulthandler on, so the failure shows every rank's Python stack.
    """
    port = free_port()
    ranks = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        ranks.append(subprocess.Popen(
            [sys.executable, "-X", "faulthandler", str(EXAMPLE), *ARGUMENTS, "--out", str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        outputs = [rank.communicate(timeout=TIMEOUT_S) for rank in ranks]
    except subprocess.TimeoutExpired:
        for rank in ranks:
            if rank.poll() is None:
                rank.send_signal(signal.SIGABRT)
        stacks = [rank.communicate()[1].decode(errors="replace")[-4000:] for rank in ranks]
        pytest.fail(f"a rank hung for {TIMEOUT_S} s; their stderr:\n" + "\n---\n".join(stacks))
    for number, (rank, (_, stderr)) in enumerate(zip(ranks, outputs, strict=True)):
        assert rank.returncode == 0, f"rank {number} failed:\n{stderr.decode(errors='replace')}"


def test_two_process_ddp_follows_the_single_process_trajectory(tmp_path):
    single_out, ddp_out = tmp_path / "single.json", tmp_path / "ddp.json"
    subprocess.run([sys.executable, str(EXAMPLE), *ARGUMENTS, "--out", str(single_out)],
                   check=True, timeout=TIMEOUT_S, capture_output=True)
    run_ranks(ddp_out, world=2)
    single, ddp = json.loads(single_out.read_text()), json.loads(ddp_out.read_text())
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    assert single["losses"][-1] < single["losses"][0]
    for a, b in zip(single["losses"], ddp["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a)
